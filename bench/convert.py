"""End to end: a synthetic Llama-like float32 checkpoint (about 1.5 GB) converted with the
demo's statements (fused QKV with grouped heads, fused gate/up, transposes, a cast,
tensor-parallel 2), side by side in one run with:

  numpy    a numpy script over the memory-mapped source files (np.transpose/concatenate
           then np.copyto into the mapped destination file),
  memcpy   a plain copy of the destination bytes into fresh pages, and into touched pages.

aoa's peak RSS is measured in a child process running `aoa convert`.
Usage: python bench/convert.py [--layers 8] [--repeats 3] [--threads N] [--work DIR]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from aoa import demo
from aoa.jobs.convert import execute, prepare
from aoa.layout import ShardDesc
from aoa.mesh_layout import read_mesh_layout
from aoa.storage import open_source
from aoa.storage.safetensors import SafetensorsFile, write_safetensors

HIDDEN, HEADS, KV_HEADS, INTERMEDIATE, VOCAB, TP = 2048, 16, 4, 5504, 8192, 2
HEAD_DIM = HIDDEN // HEADS


def mapping_text() -> str:
    text = demo.data_file("llama_fused_tp2.aoa").read_text()
    return text.replace("num_heads=4, num_key_value_groups=2",
                        f"num_heads={HEADS}, num_key_value_groups={KV_HEADS}")


def make_source(folder: Path, layers: int) -> None:
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,),
              "lm_head.weight": (VOCAB, HIDDEN)}
    for layer in range(layers):
        p = f"model.layers.{layer}."
        shapes |= {p + "self_attn.q_proj.weight": (HIDDEN, HIDDEN),
                   p + "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
                   p + "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
                   p + "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
                   p + "mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN),
                   p + "mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
                   p + "mlp.down_proj.weight": (HIDDEN, INTERMEDIATE),
                   p + "input_layernorm.weight": (HIDDEN,),
                   p + "post_attention_layernorm.weight": (HIDDEN,)}
    rng = np.random.default_rng(0)

    def fill(views):
        for view in views.values():
            out = np.frombuffer(view, dtype=np.float32)
            out[:] = rng.standard_normal(out.size, dtype=np.float32)

    write_safetensors(folder / "model.safetensors",
                      [ShardDesc.full(k, s, "float32") for k, s in shapes.items()], None, fill)


def numpy_script(source: Path, output: Path, layers: int) -> int:
    """The same conversion written by hand with numpy over mmapped safetensors."""
    output.mkdir()
    with SafetensorsFile.open(source / "model.safetensors") as f:
        hf = {name: f.array(name) for name in f.tensors}
        group = HEADS // KV_HEADS
        total = 0
        for rank in range(TP):
            def cols(x, r=rank):
                width = x.shape[1] // TP
                return x[:, r * width:(r + 1) * width]

            def rows(x, r=rank):
                height = x.shape[0] // TP
                return x[r * height:(r + 1) * height]

            tensors = {"embed_tokens.weight": rows(hf["model.embed_tokens.weight"]),
                       "norm.weight": hf["model.norm.weight"],
                       "lm_head.weight": cols(hf["lm_head.weight"].T)}
            for layer in range(layers):
                p, d = f"model.layers.{layer}.", f"layers.{layer}."
                q, k, v = (hf[p + f"self_attn.{n}_proj.weight"].T for n in "qkv")
                parts = []
                for g in range(KV_HEADS):
                    parts.append(q[:, g * group * HEAD_DIM:(g + 1) * group * HEAD_DIM])
                    parts += [k[:, g * HEAD_DIM:(g + 1) * HEAD_DIM],
                              v[:, g * HEAD_DIM:(g + 1) * HEAD_DIM]]
                tensors[d + "self_attn.qkv_proj.weight"] = cols(np.concatenate(parts, axis=1))
                gate, up = hf[p + "mlp.gate_proj.weight"].T, hf[p + "mlp.up_proj.weight"].T
                tensors[d + "mlp.up_gate_proj.weight"] = np.concatenate([cols(gate), cols(up)], 1)
                tensors[d + "self_attn.o_proj.weight"] = rows(hf[p + "self_attn.o_proj.weight"].T)
                tensors[d + "mlp.down_proj.weight"] = rows(hf[p + "mlp.down_proj.weight"].T)
                for norm in ("input_layernorm.weight", "post_attention_layernorm.weight"):
                    tensors[d + norm] = hf[p + norm]

            def fill(views, tensors=tensors):
                for name, view in views.items():
                    np.copyto(np.frombuffer(view, np.float32).reshape(tensors[name].shape),
                              tensors[name])

            write_safetensors(output / f"rank-{rank}.safetensors",
                              [ShardDesc.full(k, v.shape, "float32") for k, v in tensors.items()],
                              None, fill)
            total += sum(v.nbytes for v in tensors.values())
    return total


def memcpy(nbytes: int, touched: bool) -> float:
    source = np.ones(nbytes, np.uint8)
    target = np.empty(nbytes, np.uint8)
    if touched:
        target[:] = 0
    start = time.perf_counter()
    np.copyto(target, source)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--work", help="folder for the files (default: a temporary one)")
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="aoa-bench-"))
    source = work / "hf"
    if not (source / "model.safetensors").exists():
        source.mkdir(parents=True, exist_ok=True)
        make_source(source, args.layers)
    (work / "map.aoa").write_text(mapping_text())
    layout = read_mesh_layout(demo.data_file("llama_tp2.toml"))
    times: dict[str, list[float]] = {"aoa": [], "numpy": [], "memcpy fresh": [],
                                     "memcpy touched": []}
    nbytes = 0
    for repeat in range(args.repeats):
        for name in ("out-aoa", "out-numpy"):
            shutil.rmtree(work / name, ignore_errors=True)
        with open_source(source) as checkpoint:
            conversion = prepare(mapping_text(), checkpoint, layout=layout)
            start = time.perf_counter()
            execute(conversion, work / "out-aoa", threads=args.threads)
            times["aoa"].append(time.perf_counter() - start)
            nbytes = conversion.nbytes
        start = time.perf_counter()
        numpy_bytes = numpy_script(source, work / "out-numpy", args.layers)
        times["numpy"].append(time.perf_counter() - start)
        assert numpy_bytes == nbytes, (numpy_bytes, nbytes)
        times["memcpy fresh"].append(memcpy(nbytes, touched=False))
        times["memcpy touched"].append(memcpy(nbytes, touched=True))
        print(f"repeat {repeat + 1}: " + ", ".join(f"{k} {v[-1]:.3f} s" for k, v in
                                                   times.items()), file=sys.stderr)
    for rank in range(TP):  # the two conversions agree byte for byte
        with SafetensorsFile.open(work / "out-aoa" / f"rank-{rank:05d}-of-00002.safetensors") \
                as a, SafetensorsFile.open(work / "out-numpy" / f"rank-{rank}.safetensors") as b:
            for name in a.tensors:
                assert a.buffer(name) == b.buffer(name), name
    shutil.rmtree(work / "out-aoa")
    # Peak RSS of a fresh process running the CLI (VmHWM of its own image: a forked child's
    # getrusage would count this process's buffers too).
    child = ("import sys; from aoa.cli import main; main(sys.argv[1:]); "
             "print(next(l.split()[1] for l in open('/proc/self/status') "
             "if l.startswith('VmHWM')))")
    command = [sys.executable, "-c", child, "convert", str(work / "map.aoa"), "--source",
               str(source), "--output", str(work / "out-aoa"), "--quiet", "--layout",
               str(demo.data_file("llama_tp2.toml"))]
    if args.threads:
        command += ["--threads", str(args.threads)]
    printed = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    peak = int(printed.split()[-1]) * 1024
    largest = max(f.stat().st_size for f in (work / "out-aoa").glob("*.safetensors"))
    median = {k: statistics.median(v) for k, v in times.items()}
    print(f"destination: {nbytes / 1e9:.2f} GB in {TP} files ({args.layers} layers, float32)")
    print(f"{'':16s}{'seconds':>9s}{'GB/s':>8s}{'aoa is':>10s}")
    for name, seconds in median.items():
        ratio = seconds / median["aoa"]
        print(f"{name:16s}{seconds:9.3f}{nbytes / seconds / 1e9:8.2f}{ratio:9.2f}x")
    print(f"aoa peak RSS {peak / 1e6:.0f} MB; largest destination file {largest / 1e6:.0f} MB "
          f"(+256 MB = {(largest + 256e6) / 1e6:.0f} MB allowed)")
    if not args.work:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
