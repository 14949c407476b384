"""Compile time at model scale: aoa against PaddlePaddle 3.3.1, side by side.

A synthetic mixture-of-experts model of L layers and E experts is described by shards only
(no tensor data): a tensor-parallel-2 source checkpoint with HF-like names and a
tensor-parallel-4 destination model with Paddle names. Both sides are timed on the same job,
"compile the statements and plan every destination shard":

* aoa:    ``aoa.compile(statements, source, destination)`` (the plan covers every shard);
* Paddle: ``AOAEngine(...)`` then ``find_shard_sources`` for every destination shard.

Paddle is never imported by this process: it is measured in a subprocess run by the Python
of a separate virtual environment (``--paddle-python``, default /work/paddle-venv/bin/python
when it exists; bench/README.md says how to make it). aoa is measured here; if it cannot be
imported (from the installed package or from ``python/`` of this checkout) only Paddle runs.
The two alternate run for run (Paddle, aoa, Paddle, aoa, ...) and each keeps its best, so
a slow spell of a noisy machine weighs on both alike. ``--baseline DIR`` also measures the aoa
of another checkout (DIR/python, e.g. ``git worktree add /tmp/main main``) in a subprocess of
this Python, alternating with the others: a change's before and after, side by side.

    python bench/compile_scale.py                     # default sizes
    python bench/compile_scale.py --quick             # (4,8) and (8,16) only
    python bench/compile_scale.py --sizes 4x8,61x256 --repeats 1
    python bench/compile_scale.py --no-paddle         # aoa only
    python bench/compile_scale.py --no-paddle --baseline /tmp/main   # aoa before/after a change

Per layer the model has (hidden 64, 8 query heads and 4 key/value heads of dim 8, expert
inner size 32, vocabulary 512)::

    source (TP2, bfloat16, 2-D tensors split in 2 along their output axis)
      model.layers.{l}.self_attn.{q,k,v,o}_proj.weight         HF [out, in]
      model.layers.{l}.input_layernorm.weight                  [64], one shard
      model.layers.{l}.mlp.experts.{e}.up_gate_proj.weight     [64, 64]: per rank [GATE_r | UP_r]
      model.layers.{l}.mlp.experts.{e}.down_proj.weight        HF [64, 32]
    destination (TP4, 2-D tensors split in 4 along axis 1, the output axis of [in, out])
      layers.{l}.self_attn.qkv_proj.weight                     [64, 128], fused_qkv (grouped)
      layers.{l}.self_attn.o_proj.weight                       [64, 64]
      layers.{l}.input_layernorm.weight                        [64], one shard
      layers.{l}.mlp.experts.{e}.up_gate_proj.weight           [64, 64]: per rank [GATE_r | UP_r]
      layers.{l}.mlp.experts.{e}.down_proj.weight              [32, 64]

plus ``embed_tokens``, ``norm`` and ``lm_head``. Source keys: L*(5 + 2E) + 3; destination
shards: L*(9 + 8E) + 9 -- for L=61, E=256: 31,540 source tensors and 125,486 destination
shards, the counts of the issue ("31k source tensors, 125k destination shards"). The expert
gate/up tensor is re-laid out from the TP2 fused layout to the TP4 one (``fused_ffn``,
lcm(2, 4) = 4 pieces per half), which is the tensor-parallel 2 -> 4 resharding.

``--ffn merge`` keeps HF's separate ``gate_proj``/``up_proj`` ([32, 64] each) in the source
and fuses them with ``gate^T, up^T -> up_gate_proj, fused_ffn`` (L*(5 + 3E) + 3 source tensors,
the same destination).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

HIDDEN = 64
HEADS = 8
KV_HEADS = 4
HEAD_DIM = 8
INTER = 32
VOCAB = 512
SOURCE_TP = 2
DESTINATION_TP = 4
DTYPE = "bfloat16"

DEFAULT_SIZES = ((4, 8), (8, 16), (16, 32), (32, 64), (61, 256))
QUICK_SIZES = ((4, 8), (8, 16))
PADDLE_PYTHON = "/work/paddle-venv/bin/python"
RESULT_TAG = "@@compile_scale "

#: a shard as plain data: (key, local_shape, global_shape, global_offset, dtype)
Shard = tuple[str, tuple[int, ...], tuple[int, ...], tuple[int, ...], str]
Layout = dict[str, list[Shard]]


# -- the synthetic model -----------------------------------------------------------------

def split_shards(key: str, shape: tuple[int, ...], axis: int, parts: int) -> list[Shard]:
    """``parts`` equal shards of ``key`` along ``axis`` (one full shard for 1-D tensors)."""
    if len(shape) == 1:
        return [(key, shape, shape, (0,), DTYPE)]
    size = shape[axis] // parts
    local = tuple(size if i == axis else n for i, n in enumerate(shape))
    return [
        (key, local, shape, tuple(r * size if i == axis else 0 for i in range(len(shape))), DTYPE)
        for r in range(parts)
    ]


@dataclass(frozen=True)
class Model:
    layers: int
    experts: int
    statements: list[str]
    source: Layout
    destination: Layout

    @property
    def source_shards(self) -> int:
        return sum(len(v) for v in self.source.values())

    @property
    def destination_shards(self) -> int:
        return sum(len(v) for v in self.destination.values())


def build_model(layers: int, experts: int, ffn: str = "relayout") -> Model:
    """Statements, TP2 source and TP4 destination of the synthetic MoE model."""
    q_out, kv_out = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    source: Layout = {}
    destination: Layout = {}

    def src(key: str, shape: tuple[int, ...], axis: int = 0) -> None:
        source[key] = split_shards(key, shape, axis, SOURCE_TP)

    def dst(key: str, shape: tuple[int, ...], axis: int = 1) -> None:
        destination[key] = split_shards(key, shape, axis, DESTINATION_TP)

    src("model.embed_tokens.weight", (VOCAB, HIDDEN))
    src("model.norm.weight", (HIDDEN,))
    src("lm_head.weight", (VOCAB, HIDDEN))
    dst("embed_tokens.weight", (VOCAB, HIDDEN), axis=0)
    dst("norm.weight", (HIDDEN,))
    dst("lm_head.weight", (HIDDEN, VOCAB))
    for layer in range(layers):
        s, d = f"model.layers.{layer}.", f"layers.{layer}."
        src(s + "self_attn.q_proj.weight", (q_out, HIDDEN))
        src(s + "self_attn.k_proj.weight", (kv_out, HIDDEN))
        src(s + "self_attn.v_proj.weight", (kv_out, HIDDEN))
        src(s + "self_attn.o_proj.weight", (HIDDEN, q_out))
        src(s + "input_layernorm.weight", (HIDDEN,))
        dst(d + "self_attn.qkv_proj.weight", (HIDDEN, q_out + 2 * kv_out))
        dst(d + "self_attn.o_proj.weight", (q_out, HIDDEN))
        dst(d + "input_layernorm.weight", (HIDDEN,))
        for expert in range(experts):
            se, de = f"{s}mlp.experts.{expert}.", f"{d}mlp.experts.{expert}."
            if ffn == "relayout":
                src(se + "up_gate_proj.weight", (HIDDEN, 2 * INTER), axis=1)
            else:
                src(se + "gate_proj.weight", (INTER, HIDDEN))
                src(se + "up_proj.weight", (INTER, HIDDEN))
            src(se + "down_proj.weight", (HIDDEN, INTER))
            dst(de + "up_gate_proj.weight", (HIDDEN, 2 * INTER))
            dst(de + "down_proj.weight", (INTER, HIDDEN))

    s, d = "model.layers.$LAYER_ID.", "layers.$LAYER_ID."
    se, de = f"{s}mlp.experts.$EXPERT_ID.", f"{d}mlp.experts.$EXPERT_ID."
    if ffn == "relayout":
        up_gate = f"{se}up_gate_proj.weight -> {de}up_gate_proj.weight, fused_ffn"
    else:
        up_gate = (f"{se}gate_proj.weight^T, {se}up_proj.weight^T -> "
                   f"{de}up_gate_proj.weight, fused_ffn")
    statements = [
        "model.embed_tokens.weight -> embed_tokens.weight",
        "model.norm.weight -> norm.weight",
        "lm_head.weight^T -> lm_head.weight",
        f"{s}self_attn.q_proj.weight^T, {s}self_attn.k_proj.weight^T, "
        f"{s}self_attn.v_proj.weight^T -> {d}self_attn.qkv_proj.weight, fused_qkv, "
        f"num_heads={HEADS}, num_key_value_groups={KV_HEADS}",
        f"{s}self_attn.o_proj.weight^T -> {d}self_attn.o_proj.weight",
        f"{s}input_layernorm.weight -> {d}input_layernorm.weight",
        up_gate,
        f"{se}down_proj.weight^T -> {de}down_proj.weight",
    ]
    return Model(layers, experts, statements, source, destination)


# -- the two measurements ----------------------------------------------------------------

def best_time(job: Callable[[], int], repeats: int) -> tuple[float, int]:
    """Best wall-clock time of ``repeats`` runs of ``job``, and what its last run returned."""
    best, result = float("inf"), 0
    for _ in range(repeats):
        gc.collect()
        start = time.perf_counter()
        result = job()
        best = min(best, time.perf_counter() - start)
    return best, result


def measure_paddle(model: Model, repeats: int) -> dict:
    """Build Paddle's engine and ask it for every destination shard (Paddle's python only)."""
    from paddle.distributed.flex_checkpoint.aoa.aoa_engine import AOAEngine
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeightDesc

    def shard_info(layout: Layout) -> dict:
        return {k: [ShardedWeightDesc(*s) for s in v] for k, v in layout.items()}

    source, destination = shard_info(model.source), shard_info(model.destination)
    targets = [t for shards in destination.values() for t in shards]

    def job() -> int:
        engine = AOAEngine(aoa_config={"aoa_statements": list(model.statements)},
                           source_state_shard_info=source,
                           destination_state_shard_info=destination)
        return sum(len(engine.find_shard_sources(t)) for t in targets)

    seconds, entries = best_time(job, repeats)
    return {"seconds": seconds, "entries": entries, "targets": len(targets)}


def import_aoa() -> tuple[object | None, str]:
    """aoa from the installed package, else from python/ of this checkout, and why not."""
    try:
        import aoa
    except ImportError:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))
        sys.modules.pop("aoa", None)
        try:
            import aoa
        except Exception as exc:  # a checkout in mid-edit may fail in any way
            return None, f"{type(exc).__name__}: {exc}"
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}"
    if not (hasattr(aoa, "compile") and hasattr(aoa, "ShardDesc")):
        return None, f"{aoa.__file__} has no aoa.compile / aoa.ShardDesc yet"
    return aoa, ""


def measure_aoa(aoa, model: Model, repeats: int) -> dict:
    def shard_info(layout: Layout) -> dict:
        return {k: [aoa.ShardDesc(*s) for s in v] for k, v in layout.items()}

    source, destination = shard_info(model.source), shard_info(model.destination)
    pipeline = importlib.import_module("aoa.pipeline")
    plan = None
    pass_seconds: dict[str, float] = {}

    def after_pass(name: str, ir: object, ctx: object, seconds: float) -> None:
        pass_seconds[name] = seconds

    def job() -> int:
        nonlocal plan
        plan = pipeline.analyze(model.statements, source, destination,
                                after_pass=after_pass).plan()
        return len(plan.destinations)

    seconds, planned = best_time(job, repeats)
    copies = getattr(plan, "copies", None)
    result = {"seconds": seconds, "targets": planned, "plan_seconds": pass_seconds.get("plan"),
              "entries": None if copies is None else len(copies)}
    try:  # what the executor lowers a plan into: the kernel's table of every copy
        from aoa.runtime.kernel_table import PlanTable as lower_plan
    except ImportError:  # an older checkout: the list of kernel copies
        try:
            from aoa.runtime.lower import kernel_copies as lower_plan
        except ImportError:  # a checkout without the runtime's lowering
            return result
    gc.collect()
    start = time.perf_counter()
    lower_plan(plan)
    result["lower_seconds"] = time.perf_counter() - start
    return result


# -- driver --------------------------------------------------------------------------------

def parse_sizes(text: str) -> list[tuple[int, int]]:
    sizes = []
    for item in text.replace(" ", "").split(","):
        if item:
            layers, _, experts = item.lower().partition("x")
            sizes.append((int(layers), int(experts)))
    return sizes


def repeats_for(layers: int, experts: int, override: int | None) -> int:
    if override:
        return override
    return 3 if layers * experts <= 2048 else 1


def run_paddle_worker(args: argparse.Namespace) -> int:
    """``--paddle-worker``: for each ``LxE`` line read, one timed Paddle run of that model,
    answered with one tagged JSON line (so the driver can alternate Paddle and aoa)."""
    models: dict[tuple[int, int], Model] = {}
    for line in sys.stdin:
        layers, experts = parse_sizes(line)[0]
        if (layers, experts) not in models:
            models[(layers, experts)] = build_model(layers, experts, args.ffn)
        result = measure_paddle(models[(layers, experts)], 1)
        print(RESULT_TAG + json.dumps({"size": [layers, experts], **result}), flush=True)
    return 0


def import_aoa_from(checkout: Path) -> object:
    """aoa from ``checkout``/python, never the installed one (an editable install's finder,
    which would answer first, is set aside)."""
    sys.meta_path[:] = [finder for finder in sys.meta_path
                        if not type(finder).__module__.startswith("_editable")]
    sys.path.insert(0, str(checkout.resolve() / "python"))
    import aoa

    if not Path(aoa.__file__).resolve().is_relative_to(checkout.resolve()):
        raise SystemExit(f"--aoa-worker: imported {aoa.__file__}, not aoa of {checkout}")
    return aoa


def run_aoa_worker(args: argparse.Namespace) -> int:
    """``--aoa-worker DIR``: as ``--paddle-worker``, timing the aoa of checkout DIR."""
    aoa = import_aoa_from(args.aoa_worker)
    models: dict[tuple[int, int], Model] = {}
    for line in sys.stdin:
        layers, experts = parse_sizes(line)[0]
        if (layers, experts) not in models:
            models = {(layers, experts): build_model(layers, experts, args.ffn)}
        result = measure_aoa(aoa, models[(layers, experts)], 1)
        print(RESULT_TAG + json.dumps({"size": [layers, experts], **result}), flush=True)
    return 0


class Worker:
    """A library timed in a subprocess, one run per request: Paddle (run by the Paddle
    environment's python, so Paddle is never imported here) or the aoa of a baseline
    checkout."""

    def __init__(self, name: str, command: list[str], result_tag: str = RESULT_TAG) -> None:
        self.name = name
        self.result_tag = result_tag
        print(f"{name}: measuring in a subprocess: {' '.join(command)}", file=sys.stderr)
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        text=True)

    def measure(self, request: str) -> dict | None:
        """Send one request line; the worker's result line, or None once it has exited."""
        assert self.process.stdin is not None and self.process.stdout is not None
        try:
            self.process.stdin.write(request + "\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            return None
        for line in self.process.stdout:
            if line.startswith(self.result_tag):
                return json.loads(line[len(self.result_tag):])
        print(f"{self.name}: the worker exited with status {self.process.wait()}",
              file=sys.stderr)
        return None

    def close(self) -> None:
        if self.process.stdin:
            self.process.stdin.close()
        self.process.wait()


def best(results: list[dict]) -> dict | None:
    """The fastest of several runs' results (None if there were none)."""
    return min(results, key=lambda r: r["seconds"]) if results else None


def seconds_text(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=parse_sizes, default=None,
                        help="comma-separated LxE list, e.g. 4x8,32x64,61x256")
    parser.add_argument("--quick", action="store_true", help="sizes (4,8) and (8,16) only")
    parser.add_argument("--repeats", type=int, default=None,
                        help="best of N (default 3, or 1 where L*E > 2048)")
    parser.add_argument("--ffn", choices=("relayout", "merge"), default="relayout",
                        help="expert gate/up: TP2 fused -> TP4 fused (default) or HF gate, up "
                             "-> fused")
    default_python = PADDLE_PYTHON if os.path.exists(PADDLE_PYTHON) else None
    parser.add_argument("--paddle-python", default=default_python,
                        help=f"python of the Paddle environment (default {PADDLE_PYTHON} "
                             "if it exists)")
    parser.add_argument("--no-paddle", action="store_true", help="measure aoa only")
    parser.add_argument("--no-aoa", action="store_true", help="measure Paddle only")
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    parser.add_argument("--baseline", type=Path, metavar="DIR",
                        help="also time the aoa of checkout DIR (its python/ folder), "
                             "alternating run for run: before and after a change")
    parser.add_argument("--paddle-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--aoa-worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.sizes is None:
        args.sizes = list(QUICK_SIZES if args.quick else DEFAULT_SIZES)

    if args.paddle_worker:
        return run_paddle_worker(args)
    if args.aoa_worker:
        return run_aoa_worker(args)

    worker = baseline = None
    if args.baseline is not None:
        baseline = Worker("baseline", [sys.executable, os.path.abspath(__file__), "--aoa-worker",
                                       str(args.baseline), "--ffn", args.ffn])
    if not args.no_paddle:
        if args.paddle_python:
            worker = Worker("paddle", [args.paddle_python, os.path.abspath(__file__),
                                       "--paddle-worker", "--ffn", args.ffn])
        else:
            print(f"paddle: skipped (no {PADDLE_PYTHON}; see bench/README.md or pass "
                  "--paddle-python)", file=sys.stderr)
    aoa, why_not = (None, "") if args.no_aoa else import_aoa()
    if why_not:
        print(f"aoa: skipped ({why_not})", file=sys.stderr)

    # The two alternate, run for run, so that a slow spell of a noisy machine falls on both.
    paddle: dict[tuple[int, int], dict] = {}
    ours: dict[tuple[int, int], dict] = {}
    before: dict[tuple[int, int], dict] = {}
    for layers, experts in args.sizes:
        model = build_model(layers, experts, args.ffn)
        paddle_runs, aoa_runs, baseline_runs = [], [], []
        for _ in range(repeats_for(layers, experts, args.repeats)):
            if worker is not None and (result := worker.measure(f"{layers}x{experts}")):
                paddle_runs.append(result)
            if baseline is not None and (result := baseline.measure(f"{layers}x{experts}")):
                baseline_runs.append(result)
            if aoa is not None:
                aoa_runs.append(measure_aoa(aoa, model, 1))
        for name, runs, table in (("paddle", paddle_runs, paddle), ("aoa", aoa_runs, ours),
                                  ("baseline", baseline_runs, before)):
            if (fastest := best(runs)) is not None:
                table[(layers, experts)] = fastest
                print(f"{name}: L={layers} E={experts}: {fastest['seconds']:.3f} s "
                      f"(best of {len(runs)})", file=sys.stderr)
    for running in (worker, baseline):
        if running is not None:
            running.close()

    header = (f"{'L':>4} {'E':>5} {'src tensors':>12} {'src shards':>11} {'dst shards':>11} "
              f"{'paddle s':>9} {'aoa s':>8} {'ratio':>7} {'paddle us/LE':>13} "
              f"{'aoa us/LE':>10}")
    print(f"compile + plan every destination shard ({args.ffn} experts; "
          f"TP{SOURCE_TP} -> TP{DESTINATION_TP}, wall clock, best of N)")
    print(header)
    print("-" * len(header))
    rows = []
    for layers, experts in args.sizes:
        model = build_model(layers, experts, args.ffn)
        p = paddle.get((layers, experts), {}).get("seconds")
        a = ours.get((layers, experts), {}).get("seconds")
        units = layers * experts
        ratio = f"{p / a:.1f}x" if p is not None and a else "-"
        per_p = "-" if p is None else f"{p / units * 1e6:.1f}"
        per_a = "-" if a is None else f"{a / units * 1e6:.1f}"
        print(f"{layers:>4} {experts:>5} {len(model.source):>12,} {model.source_shards:>11,} "
              f"{model.destination_shards:>11,} {seconds_text(p):>9} {seconds_text(a):>8} "
              f"{ratio:>7} {per_p:>13} {per_a:>10}")
        rows.append({"layers": layers, "experts": experts, "source_tensors": len(model.source),
                     "source_shards": model.source_shards,
                     "destination_shards": model.destination_shards,
                     "paddle": paddle.get((layers, experts)), "aoa": ours.get((layers, experts))})
    for row in rows:
        p_entries = (row["paddle"] or {}).get("entries")
        a_entries = (row["aoa"] or {}).get("entries")
        if p_entries is not None and a_entries is not None:
            same = "same count" if p_entries == a_entries else "counts differ (may be fine)"
            print(f"L={row['layers']} E={row['experts']}: aoa {a_entries:,} copies, "
                  f"Paddle {p_entries:,} entries: {same}")
    lowered = [row for row in rows if (row["aoa"] or {}).get("lower_seconds") is not None]
    if lowered:
        print("lowering the plan into the kernel's copy table (runtime.kernel_table.PlanTable, "
              "as the executor does), against the plan pass of the same run; and compile + "
              "plan + lower against Paddle")
        for row in lowered:
            ours_row, paddle_row = row["aoa"], row["paddle"]
            lower, plan_pass = ours_row["lower_seconds"], ours_row["plan_seconds"]
            total = ours_row["seconds"] + lower
            versus = "" if paddle_row is None else (
                f", compile + plan + lower {paddle_row['seconds'] / total:.1f}x Paddle")
            print(f"L={row['layers']} E={row['experts']}: lower {lower:.3f} s, plan pass "
                  f"{plan_pass:.3f} s: {lower / plan_pass:.2f}x the plan pass{versus}")
    if baseline is not None:
        print(f"aoa against the baseline {args.baseline} (aoa s / baseline s; below 1: faster)")
        for row in rows:
            size = (row["layers"], row["experts"])
            row["baseline"] = before.get(size)
            b = before.get(size, {}).get("seconds")
            a = ours.get(size, {}).get("seconds")
            ratio = f"{a / b:.2f}" if a is not None and b else "-"
            print(f"L={size[0]:>3} E={size[1]:>4}: baseline {seconds_text(b)} s, aoa "
                  f"{seconds_text(a)} s, ratio {ratio}")
    if args.json:
        args.json.write_text(json.dumps({"ffn": args.ffn, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
