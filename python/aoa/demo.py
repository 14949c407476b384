"""`aoa demo`: the main job on a small Llama-like checkpoint made here, checked against numpy.

It writes a Hugging Face checkpoint (bfloat16, separate q/k/v and gate/up) to a temporary
folder, converts it with the bundled mapping (fused QKV with grouped-query heads, fused
gate/up, transposes, one float32 cast) into tensor-parallel 2 shards, and verifies every
output shard against the same layout computed directly with numpy.
"""

from __future__ import annotations

import tempfile
import time
from importlib import resources
from pathlib import Path

import ml_dtypes
import numpy as np

from aoa.jobs.convert import execute, prepare
from aoa.layout import ShardDesc
from aoa.mapping import read_mapping
from aoa.mesh_layout import read_mesh_layout
from aoa.storage.formats import open_source
from aoa.storage.safetensors import SafetensorsFile, write_safetensors

LAYERS, HIDDEN, HEADS, KV_HEADS, INTERMEDIATE, VOCAB, TP = 2, 256, 4, 2, 512, 1024, 2
HEAD_DIM = HIDDEN // HEADS


def data_file(name: str) -> Path:
    return Path(str(resources.files("aoa").joinpath("data", name)))


def make_checkpoint(folder: Path, seed: int = 0) -> dict[str, np.ndarray]:
    """A Llama-like HF checkpoint in bfloat16; returns its tensors."""
    rng = np.random.default_rng(seed)
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,),
              "lm_head.weight": (VOCAB, HIDDEN)}
    for layer in range(LAYERS):
        p = f"model.layers.{layer}."
        shapes |= {p + "self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
                   p + "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
                   p + "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
                   p + "self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
                   p + "mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN),
                   p + "mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
                   p + "mlp.down_proj.weight": (HIDDEN, INTERMEDIATE),
                   p + "input_layernorm.weight": (HIDDEN,),
                   p + "post_attention_layernorm.weight": (HIDDEN,)}
    tensors = {k: rng.standard_normal(s, dtype=np.float32).astype(ml_dtypes.bfloat16)
               for k, s in shapes.items()}

    def fill(views):
        for name, view in views.items():
            np.frombuffer(view, dtype=np.uint8)[:] = tensors[name].view(np.uint8).reshape(-1)

    write_safetensors(folder / "model.safetensors",
                      [ShardDesc.full(k, v.shape, "bfloat16") for k, v in tensors.items()], None,
                      fill)
    return tensors


def expected_shards(hf: dict[str, np.ndarray], rank: int) -> dict[str, np.ndarray]:
    """What rank ``rank`` must hold, computed directly with numpy (not through aoa)."""
    def cols(x, parts):  # this rank's slice of the last axis
        width = x.shape[1] // parts
        return x[:, rank * width:(rank + 1) * width]

    def rows(x, parts):
        height = x.shape[0] // parts
        return x[rank * height:(rank + 1) * height]

    out = {"embed_tokens.weight": rows(hf["model.embed_tokens.weight"], TP),
           "norm.weight": hf["model.norm.weight"].astype(np.float32),
           "lm_head.weight": cols(hf["lm_head.weight"].T, TP)}
    group = HEADS // KV_HEADS
    for layer in range(LAYERS):
        p, d = f"model.layers.{layer}.", f"layers.{layer}."
        q, k, v = (hf[p + f"self_attn.{n}_proj.weight"].T for n in "qkv")
        grouped = []
        for g in range(KV_HEADS):  # [q heads of group g | k_g | v_g] for every group
            grouped += [q[:, (g * group + i) * HEAD_DIM:(g * group + i + 1) * HEAD_DIM]
                        for i in range(group)]
            head = slice(g * HEAD_DIM, (g + 1) * HEAD_DIM)
            grouped += [k[:, head], v[:, head]]
        out[d + "self_attn.qkv_proj.weight"] = cols(np.concatenate(grouped, axis=1), TP)
        gate, up = hf[p + "mlp.gate_proj.weight"].T, hf[p + "mlp.up_proj.weight"].T
        out[d + "mlp.up_gate_proj.weight"] = np.concatenate([cols(gate, TP), cols(up, TP)], 1)
        out[d + "self_attn.o_proj.weight"] = rows(hf[p + "self_attn.o_proj.weight"].T, TP)
        out[d + "mlp.down_proj.weight"] = rows(hf[p + "mlp.down_proj.weight"].T, TP)
        for norm in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            out[d + norm] = hf[p + norm]
    return out


def run(threads: int | None = None, keep: str | None = None) -> int:
    """Build, convert, verify, report. Returns the number of mismatching tensors (0 = ok)."""
    with tempfile.TemporaryDirectory(prefix="aoa-demo-") as tmp:
        work = Path(keep) if keep else Path(tmp)
        source_dir, output_dir = work / "hf", work / "tp2"
        source_dir.mkdir(parents=True, exist_ok=True)
        hf = make_checkpoint(source_dir)
        mapping = data_file("llama_fused_tp2.aoa")
        print(f"source: {source_dir} ({len(hf)} bfloat16 tensors, Hugging Face names)")
        print(f"mapping: {mapping.name}, layout: {data_file('llama_tp2.toml').name}")
        with open_source(source_dir) as checkpoint:
            start = time.perf_counter()
            conversion = prepare(read_mapping(mapping), checkpoint,
                                 layout=read_mesh_layout(data_file("llama_tp2.toml")))
            compiled = time.perf_counter() - start
            execute(conversion, output_dir, threads=threads)
        mismatches = 0
        for rank, file in enumerate(conversion.files):
            expected = expected_shards(hf, rank)
            with SafetensorsFile.open(output_dir / file.filename) as written:
                assert set(written.tensors) == set(expected), "tensor names differ"
                for name, want in expected.items():
                    got = written.array(name)
                    if got.shape != want.shape or got.tobytes() != np.ascontiguousarray(
                            want).tobytes():
                        mismatches += 1
                        print(f"  MISMATCH rank {rank}: {name}")
        seconds = conversion.seconds
        print(f"wrote {len(conversion.files)} files to {output_dir}: "
              f"{len(conversion.plan.destinations)} shards, {conversion.nbytes / 1e6:.1f} MB")
        print(f"compile {compiled * 1e3:.1f} ms, write {seconds * 1e3:.1f} ms "
              f"({conversion.nbytes / seconds / 1e9:.2f} GB/s)")
        print("verified every shard against numpy: "
              + ("all bytes identical" if not mismatches else f"{mismatches} MISMATCHES"))
        return mismatches
