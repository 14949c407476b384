"""Converting by naming the target costs nothing measurable: the 1.5 GB benchmark model of
bench/convert.py (Llama, float32, 8 layers), with a config.json, converted to PaddleFormers'
layout at tensor-parallel 2, side by side in one run, turn by turn:

  --to       `aoa convert --to paddleformers --tp 2` through the model library (config read,
             tensors checked against the family, mapping and layout made, record written)
  by hand    the same statements and layout written by hand, through `aoa convert
             MAPPING --layout` (the job the model library hands its text to)
  fused      the demo's hand-written fused mapping (fused QKV and gate/up, a cast), for scale

Each turn writes to a fresh folder; the first two must write the same bytes. Then, without
writing (where the disk's noise hides small differences), planning alone, turn by turn:
`--to` (config, key check, mapping, layout, compile and plan) against `by hand` (compile and
plan of the same text).
Usage: python bench/models.py [--layers 8] [--repeats 3] [--plan-repeats 10] [--threads N]
                              [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from convert import HEADS, HIDDEN, INTERMEDIATE, KV_HEADS, VOCAB, make_source, mapping_text

from aoa import demo
from aoa.jobs.convert import execute, prepare
from aoa.mapping import MappingText
from aoa.mesh_layout import parse_mesh_layout, read_mesh_layout
from aoa.models import Mesh
from aoa.models import convert as model_convert
from aoa.storage import open_source
from aoa.storage.safetensors import SafetensorsFile

#: PaddleFormers' Llama, written by hand: what `aoa mapping --config` prints for this model.
BY_HAND = (Path(__file__).parent / "paddleformers_llama.aoa").read_text()
LAYOUT = {"mesh": {"tp": 2}, "rule": [
    *({"match": f"model.layers.*.{name}.weight", "tp": 1}
      for name in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")),
    *({"match": f"model.layers.*.{name}.weight", "tp": 0} for name in ("o_proj", "down_proj")),
    {"match": "model.embed_tokens.weight", "tp": 0}, {"match": "lm_head.weight", "tp": 0}]}


def config(layers: int) -> dict:
    return {"model_type": "llama", "vocab_size": VOCAB, "hidden_size": HIDDEN,
            "intermediate_size": INTERMEDIATE, "num_hidden_layers": layers,
            "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
            "tie_word_embeddings": False}


def by_target(source: Path, output: Path, threads: int | None) -> tuple[float, float]:
    start = time.perf_counter()
    job = model_convert.run(source, output, target="paddleformers", mesh=Mesh(tp=2),
                            threads=threads)
    return time.perf_counter() - start, job.conversion.seconds


def by_mapping(text: str, layout, source: Path, output: Path, threads: int | None
               ) -> tuple[float, float]:
    start = time.perf_counter()
    with open_source(source) as checkpoint:
        conversion = prepare(MappingText(text), checkpoint, layout=layout)
        execute(conversion, output, threads=threads)
    return time.perf_counter() - start, conversion.seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--plan-repeats", type=int, default=10)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--work", help="folder for the files (default: a temporary one)")
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="aoa-bench-models-"))
    source = work / "hf"
    if not (source / "model.safetensors").exists():
        source.mkdir(parents=True, exist_ok=True)
        make_source(source, args.layers)
    (source / "config.json").write_text(json.dumps(config(args.layers)))
    made = model_convert.run(source, work / "probe", target="paddleformers", mesh=Mesh(tp=2),
                             dry_run=True)
    body = [line for line in made.text.splitlines() if not line.startswith("#")]
    hand = [line for line in BY_HAND.splitlines() if not line.startswith("#")]
    assert body == hand, "the hand-written mapping is not the library's"
    hand_layout = parse_mesh_layout(LAYOUT)
    fused_layout = read_mesh_layout(demo.data_file("llama_tp2.toml"))
    runs = {
        "--to": lambda out: by_target(source, out, args.threads),
        "by hand": lambda out: by_mapping(BY_HAND, hand_layout, source, out, args.threads),
        "fused": lambda out: by_mapping(mapping_text(), fused_layout, source, out, args.threads),
    }
    totals: dict[str, list[float]] = {name: [] for name in runs}
    writes: dict[str, list[float]] = {name: [] for name in runs}
    for repeat in range(args.repeats):
        for name, run in runs.items():
            out = work / f"out-{name.strip('-').replace(' ', '-')}"
            shutil.rmtree(out, ignore_errors=True)
            total, write = run(out)
            totals[name].append(total)
            writes[name].append(write)
        print(f"repeat {repeat + 1}: " + ", ".join(f"{k} {v[-1]:.3f} s" for k, v in
                                                   totals.items()), file=sys.stderr)
    for rank in range(2):  # --to and by hand wrote the same bytes
        name = f"rank-{rank:05d}-of-00002.safetensors"
        with SafetensorsFile.open(work / "out-to" / name) as a, \
                SafetensorsFile.open(work / "out-by-hand" / name) as b:
            assert set(a.tensors) == set(b.tensors)
            for key in a.tensors:
                assert a.buffer(key) == b.buffer(key), key
    nbytes = sum(p.stat().st_size for p in (work / "out-to").glob("*.safetensors"))
    print(f"{nbytes / 1e9:.2f} GB written per run, {args.layers} layers, tensor-parallel 2, "
          f"median of {args.repeats}")
    print(f"{'':10s}{'total s':>9s}{'writing s':>11s}{'the rest s':>12s}{'vs by hand':>12s}")
    reference = statistics.median(totals["by hand"])
    for name in runs:
        total, write = statistics.median(totals[name]), statistics.median(writes[name])
        print(f"{name:10s}{total:9.3f}{write:11.3f}{total - write:12.3f}"
              f"{total / reference:11.2f}x")
    plans: dict[str, list[float]] = {"--to": [], "by hand": []}
    with open_source(source) as checkpoint:
        for _ in range(args.plan_repeats):
            start = time.perf_counter()
            model_convert.plan_job(source, checkpoint, target="paddleformers",
                                   mesh=Mesh(tp=2))
            plans["--to"].append(time.perf_counter() - start)
            start = time.perf_counter()
            prepare(MappingText(BY_HAND), checkpoint, layout=hand_layout)
            plans["by hand"].append(time.perf_counter() - start)
    to, hand = (statistics.median(plans[k]) for k in ("--to", "by hand"))
    print(f"planning alone, median of {args.plan_repeats}: --to {to * 1e3:.1f} ms, by hand "
          f"{hand * 1e3:.1f} ms: the model library adds {(to - hand) * 1e3:.1f} ms")
    if not args.work:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
