"""`aoa demo`: the main job on a small Llama checkpoint made here, checked against numpy.

It writes a Hugging Face Llama folder (config.json and bfloat16 weights) to a temporary
folder, converts it by naming its target (`--to paddleformers --tp 2`: the model library
makes the mapping and the layout from config.json), verifies every output shard against the
same layout computed directly with numpy, and converts back (`--to hf`) to the original
bytes.

The same checkpoint with the bundled hand-written mapping (`data/llama_fused_tp2.aoa`: fused
QKV with grouped-query heads, fused gate/up, a float32 cast) and its layout
(`data/llama_tp2.toml`) is what the tests and benchmarks of the language use;
`expected_shards` is that mapping's result computed with numpy.
"""

from __future__ import annotations

import json
import tempfile
import time
from importlib import resources
from pathlib import Path

import ml_dtypes
import numpy as np

from aoa.layout import ShardDesc
from aoa.storage.safetensors import SafetensorsFile, write_safetensors

LAYERS, HIDDEN, HEADS, KV_HEADS, INTERMEDIATE, VOCAB, TP = 2, 256, 4, 2, 512, 1024, 2
HEAD_DIM = HIDDEN // HEADS


def data_file(name: str) -> Path:
    return Path(str(resources.files("aoa").joinpath("data", name)))


CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": VOCAB,
          "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE, "num_hidden_layers": LAYERS,
          "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
          "tie_word_embeddings": False, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16"}


def make_checkpoint(folder: Path, seed: int = 0) -> dict[str, np.ndarray]:
    """A Llama HF checkpoint in bfloat16 (weights only); returns its tensors."""
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


def expected_paddleformers_shards(hf: dict[str, np.ndarray], rank: int
                                  ) -> dict[str, tuple[tuple[int, ...], np.ndarray]]:
    """What rank ``rank`` of PaddleFormers' Llama at TP 2 holds, computed with numpy, each
    tensor with its global offset: linear weights transposed to [in, out], column-parallel
    ones (q, k, v, gate, up) split on axis 1, row-parallel ones (o, down) and the vocabulary
    on axis 0, norms whole."""
    def part(x, axis):
        size = x.shape[axis] // TP
        offset = tuple(rank * size if a == axis else 0 for a in range(x.ndim))
        return offset, np.take(x, range(rank * size, (rank + 1) * size), axis=axis)

    out = {"model.embed_tokens.weight": part(hf["model.embed_tokens.weight"], 0),
           "lm_head.weight": part(hf["lm_head.weight"], 0),
           "model.norm.weight": ((0,), hf["model.norm.weight"])}
    for layer in range(LAYERS):
        p = f"model.layers.{layer}."
        for name, axis in (("self_attn.q_proj", 1), ("self_attn.k_proj", 1),
                           ("self_attn.v_proj", 1), ("self_attn.o_proj", 0),
                           ("mlp.gate_proj", 1), ("mlp.up_proj", 1), ("mlp.down_proj", 0)):
            out[f"{p}{name}.weight"] = part(hf[f"{p}{name}.weight"].T, axis)
        for norm in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            out[p + norm] = ((0,), hf[p + norm])
    return out


def paddleformers_mismatches(hf: dict[str, np.ndarray], folder: Path) -> list[str]:
    """Each tensor of each rank that the folder (read in whatever format it is written) does
    not hold with exactly the bytes numpy computes, and each shard it holds beyond them."""
    from aoa.storage.formats import open_source

    expected = {(name, offset): want for rank in range(TP)
                for name, (offset, want) in expected_paddleformers_shards(hf, rank).items()}
    found = []
    with open_source(folder) as written:
        held = {(shard.key, shard.global_offset): shard
                for shards in written.shards.values() for shard in shards}
        for (name, offset), want in expected.items():
            shard = held.get((name, offset))
            if shard is None or shard.local_shape != want.shape or bytes(
                    written.buffer(shard)) != np.ascontiguousarray(want).tobytes():
                found.append(f"{name} at {list(offset)}")
        found += [f"{name} at {list(offset)} (not expected)" for name, offset in held
                  if (name, offset) not in expected]
    return found


def run(threads: int | None = None, keep: str | None = None) -> int:
    """Build, convert, verify, convert back, verify. Returns the number of mismatching
    tensors (0 = ok)."""
    from aoa.models import Mesh
    from aoa.models import convert as model_convert

    with tempfile.TemporaryDirectory(prefix="aoa-demo-") as tmp:
        work = Path(keep) if keep else Path(tmp)
        source_dir, output_dir, back_dir = work / "hf", work / "paddleformers-tp2", work / "back"
        source_dir.mkdir(parents=True, exist_ok=True)
        hf = make_checkpoint(source_dir)
        (source_dir / "config.json").write_text(json.dumps(CONFIG, indent=1))
        print(f"source: {source_dir} (Llama, {len(hf)} bfloat16 tensors, Hugging Face names)")
        print(f"aoa convert --source {source_dir} --output {output_dir} --to paddleformers "
              f"--tp {TP}")
        start = time.perf_counter()
        job = model_convert.run(source_dir, output_dir, target="paddleformers",
                                mesh=Mesh(tp=TP), threads=threads)
        total = time.perf_counter() - start
        conversion = job.conversion
        statements = [line for line in job.text.splitlines() if not line.startswith("#")]
        print(f"mapping ({len(statements)} statements made from config.json by aoa.models):")
        for line in [line for line in statements if "^T" in line][:2]:
            print(f"  {line}")
        print("  ...")
        wrong = paddleformers_mismatches(hf, output_dir)
        for where in wrong:
            print(f"  MISMATCH {where}")
        mismatches = len(wrong)
        seconds = conversion.seconds
        print(f"wrote {len(conversion.files)} files to {output_dir}: "
              f"{len(conversion.plan.destinations)} shards, {conversion.nbytes / 1e6:.1f} MB, "
              f"and {model_convert.RECORD} (family, target, mesh, the mapping)")
        print(f"all in {total * 1e3:.0f} ms, of which writing {seconds * 1e3:.1f} ms "
              f"({conversion.nbytes / seconds / 1e9:.2f} GB/s)")
        print(f"verified every shard ({conversion.format.name} format) against numpy: "
              + ("all bytes identical" if not mismatches else f"{mismatches} MISMATCHES"))
        print(f"aoa convert --source {output_dir} --output {back_dir} --to hf")
        model_convert.run(output_dir, back_dir, target="hf", threads=threads)
        with SafetensorsFile.open(back_dir / "model.safetensors") as written:
            differ = sorted(k for k, v in hf.items() if written.array(k).tobytes()
                            != v.tobytes()) + sorted(set(written.tensors) - set(hf))
        mismatches += len(differ)
        print("back to Hugging Face: " + ("every tensor byte-identical to the original"
                                          if not differ else f"DIFFERS: {', '.join(differ)}"))
        return mismatches
