"""The Paddle drop-in against PaddlePaddle 3.3.1's own engine, on the job a Paddle loader
does: build the engine, then ask ``find_shard_sources`` once for every destination shard.

Two kinds of programs, both sides given the same statements, shard descriptions and queries:

* the synthetic 61-layer, 256-expert MoE of ``compile_scale.py`` (``--sizes``, default
  61x256: 125,486 queries), the job of issue 13 goal 1;
* the programs PaddleFormers 1.2.0 generates for its model families, frozen in
  ``tests/golden/paddleformers/<case>/case.json`` (2-3 layers, 10-40 statements with
  ``$LAYER_ID`` templates, 30-220 queries): here fixed costs per engine dominate.

Timed, per job: ``AOAEngine(aoa_config, source, destination)`` then one
``find_shard_sources(query)`` per destination shard, the query a descriptor of its own
equal to the destination's (as Paddle's loader builds one per tensor), not the object given
to the constructor. Building descriptors is not timed, nor importing either library.
Each measurement is the best of ``--inner`` runs of the job (a small job takes a few
milliseconds); Paddle and aoa alternate, measurement for measurement (``--rounds`` each,
the small jobs' rounds in turns over all of them, so that a job's lie seconds apart), a
persistent Paddle worker (run by the Paddle environment's python, ``--paddle-python``)
serving one measurement per request, so a slow spell of a shared machine falls on both.
Each side keeps its best measurement; the table gives both and their ratio, and the entry
counts (which must agree: aoa's entries are Paddle's, one per piece of a shard).

    python bench/dropin.py                        # 61x256 and every PaddleFormers case
    python bench/dropin.py --sizes 16x32 --cases llama_tp2,qwen3_moe_bf16_tp2_ep2
    python bench/dropin.py --no-paddle            # aoa only

The Qwen3.5 cases use ``fused_in_proj``, a macro PaddleFormers registers in Paddle's engine
when its qwen3_5 module is imported: the worker imports it for them (as
``paddleformers_reference.py`` does), outside the timing.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from compile_scale import PADDLE_PYTHON, Layout, Worker, build_model, parse_sizes

ROOT = Path(__file__).resolve().parents[1]
CASES = ROOT / "tests" / "golden" / "paddleformers"
RESULT_TAG = "@@dropin "
#: cases whose statements use a macro PaddleFormers registers in Paddle's engine
NEEDS_PADDLEFORMERS_MACROS = ("qwen3_5_",)


def all_cases() -> list[str]:
    return sorted(p.name for p in CASES.iterdir() if (p / "case.json").is_file())


def job_data(job: str) -> tuple[list[str], Layout, Layout]:
    """Statements, source and destination of a job (``LxE`` or a PaddleFormers case), as
    plain data: each shard (key, local_shape, global_shape, global_offset, dtype)."""
    if job[0].isdigit():
        layers, experts = parse_sizes(job)[0]
        model = build_model(layers, experts)
        return model.statements, model.source, model.destination
    case = json.loads((CASES / job / "case.json").read_text())

    def layout(shards: dict[str, list[dict[str, Any]]]) -> Layout:
        return {key: [(s["key"], tuple(s["local_shape"]), tuple(s["global_shape"]),
                       tuple(s["global_offset"]), s["dtype"]) for s in listed]
                for key, listed in shards.items()}

    return case["paddleformers"]["forward"], layout(case["source"]), layout(case["destination"])


def best_of(job: Callable[[], int], runs: int) -> tuple[float, int]:
    """Best wall-clock seconds of ``runs`` runs of ``job`` and what it returned."""
    best, result = float("inf"), 0
    for _ in range(runs):
        gc.collect()
        start = time.perf_counter()
        result = job()
        best = min(best, time.perf_counter() - start)
    return best, result


def measure(engine_class: type, desc_class: type, job: str, inner: int) -> dict:
    """The job with either side's classes: engine construction plus every query."""
    statements, source, destination = job_data(job)

    def shard_info(layout: Layout) -> dict:
        return {key: [desc_class(*s) for s in shards] for key, shards in layout.items()}

    source_info, destination_info = shard_info(source), shard_info(destination)
    queries = [desc_class(*s) for shards in destination.values() for s in shards]

    def run() -> int:
        engine = engine_class({"aoa_statements": list(statements)}, source_info,
                              destination_info)
        return sum(len(engine.find_shard_sources(query)) for query in queries)

    seconds, entries = best_of(run, inner)
    return {"seconds": seconds, "entries": entries, "queries": len(queries),
            "statements": len(statements)}


def run_paddle_worker() -> int:
    """``--paddle-worker``: for each line ``JOB INNER`` read, one measurement of Paddle's
    engine, answered with one tagged JSON line."""
    from paddle.distributed.flex_checkpoint.aoa.aoa_engine import AOAEngine
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeightDesc

    macros_loaded = False
    for line in sys.stdin:
        job, inner = line.split()
        if job.startswith(NEEDS_PADDLEFORMERS_MACROS) and not macros_loaded:
            import importlib

            from paddleformers_statements import install_paddlefleet_stand_ins
            with contextlib.redirect_stdout(sys.stderr):
                install_paddlefleet_stand_ins()
                importlib.import_module("paddleformers.transformers.qwen3_5.modeling")
            macros_loaded = True
        with contextlib.redirect_stdout(sys.stderr):
            result = measure(AOAEngine, ShardedWeightDesc, job, int(inner))
        print(RESULT_TAG + json.dumps(result), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="61x256",
                        help="synthetic MoE sizes, LxE, comma-separated ('' for none)")
    parser.add_argument("--cases", default=None,
                        help="PaddleFormers cases, comma-separated (default all; '' for none)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="measurements of each side per job, alternating (default 3)")
    parser.add_argument("--inner", type=int, default=20,
                        help="runs per measurement of a small job, the best kept (default 20; "
                             "1 for the synthetic sizes)")
    default_python = PADDLE_PYTHON if os.path.exists(PADDLE_PYTHON) else None
    parser.add_argument("--paddle-python", default=default_python,
                        help=f"python of the Paddle environment (default {PADDLE_PYTHON})")
    parser.add_argument("--no-paddle", action="store_true", help="measure aoa only")
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    parser.add_argument("--paddle-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.paddle_worker:
        return run_paddle_worker()

    from aoa.compat.paddle import AOAEngine, ShardedWeightDesc

    sizes = [f"{layers}x{experts}" for layers, experts in parse_sizes(args.sizes)]
    cases = all_cases() if args.cases is None else [c for c in args.cases.split(",") if c]
    worker = None
    if not args.no_paddle:
        if args.paddle_python is None:
            print(f"paddle: skipped (no {PADDLE_PYTHON}; pass --paddle-python)",
                  file=sys.stderr)
        else:
            worker = Worker("paddle", [args.paddle_python, os.path.abspath(__file__),
                                       "--paddle-worker"], RESULT_TAG)
    runs: dict[str, tuple[list[dict], list[dict]]] = {job: ([], []) for job in sizes + cases}

    def measure_both(job: str) -> None:
        inner = 1 if job in sizes else args.inner
        paddle_runs, aoa_runs = runs[job]
        if worker is not None and (result := worker.measure(f"{job} {inner}")):
            paddle_runs.append(result)
        aoa_runs.append(measure(AOAEngine, ShardedWeightDesc, job, inner))

    # a synthetic size's rounds one after another (each takes seconds); the small jobs' in
    # turns over all of them, so that one job's rounds lie seconds apart: one slow spell of
    # the VM (a second or so, seen taking one side's best of 60 runs 50% over its usual) then
    # falls on one round of a job, not on all of them
    for job in sizes:
        for _ in range(args.rounds):
            measure_both(job)
    for _ in range(args.rounds):
        for job in cases:
            measure_both(job)
    rows = []
    for job, (paddle_runs, aoa_runs) in runs.items():
        paddle = min(paddle_runs, key=lambda r: r["seconds"]) if paddle_runs else None
        ours = min(aoa_runs, key=lambda r: r["seconds"])
        rows.append({"job": job, "paddle": paddle, "aoa": ours,
                     "paddle_runs": [r["seconds"] for r in paddle_runs],
                     "aoa_runs": [r["seconds"] for r in aoa_runs]})
        ratio = f"{paddle['seconds'] / ours['seconds']:.1f}x" if paddle else "-"
        print(f"{job}: aoa {ours['seconds'] * 1e3:.2f} ms, paddle "
              f"{paddle['seconds'] * 1e3 if paddle else float('nan'):.2f} ms: {ratio}",
              file=sys.stderr)
    if worker is not None:
        worker.close()

    print(f"drop-in: engine + find_shard_sources for every destination shard (best of "
          f"{args.rounds} alternating measurements; small jobs best of {args.inner} runs each)")
    header = (f"{'job':<30} {'stmts':>5} {'queries':>8} {'entries':>8} {'paddle ms':>10} "
              f"{'aoa ms':>9} {'ratio':>7}")
    print(header)
    print("-" * len(header))
    small = []
    for row in rows:
        paddle, ours = row["paddle"], row["aoa"]
        ratio = paddle["seconds"] / ours["seconds"] if paddle else None
        if ratio is not None and row["job"] not in sizes:
            small.append(ratio)
        same = "" if paddle is None or paddle["entries"] == ours["entries"] else (
            f"  (Paddle: {paddle['entries']} entries)")
        print(f"{row['job']:<30} {ours['statements']:>5} {ours['queries']:>8,} "
              f"{ours['entries']:>8,} "
              f"{paddle['seconds'] * 1e3 if paddle else float('nan'):>10.2f} "
              f"{ours['seconds'] * 1e3:>9.2f} "
              f"{'-' if ratio is None else f'{ratio:.1f}x':>7}{same}")
    if small:
        small.sort()
        print(f"PaddleFormers cases: ratio min {small[0]:.1f}x, median "
              f"{small[len(small) // 2]:.1f}x, max {small[-1]:.1f}x")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
