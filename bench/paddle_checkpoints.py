"""Paddle's side of the checkpoint-format tests: run with PaddlePaddle 3.3.1's Python.

    /work/paddle-venv/bin/python bench/paddle_checkpoints.py save [--output tests/fixtures/paddle]
    /work/paddle-venv/bin/python bench/paddle_checkpoints.py load CKPT SPEC.json OUT.npz
    /work/paddle-venv/bin/python bench/paddle_checkpoints.py from-safetensors FILE CKPT
    /work/paddle-venv/bin/python bench/paddle_checkpoints.py time-load CKPT SPEC.json

``save`` writes the small checkpoints the tests read, each by ``paddle.distributed.
save_state_dict`` itself (several ranks through ``paddle.distributed.launch`` on the CPU),
and beside each an ``expected.npz`` of its global tensors (bfloat16 as uint16 bits):

  single      one rank: float32, bfloat16, int64, a 0-d tensor
  tp2         two ranks, tensor parallel: a column split, a row split (bfloat16), a
              replicated norm both ranks save (Paddle keeps one copy)
  flat4       four ranks, a sharded optimizer's flattened states: a whole tensor split in
              four element ranges; a tensor split in two rows-blocks, each split in two
              ranges that start and end mid-row
  two_saves   one folder saved twice (unique ids 0 and 1), with different values

``load`` reads a checkpoint with ``paddle.distributed.load_state_dict`` into whole tensors of
the shapes and dtypes ``SPEC.json`` gives (``{key: [shape, dtype]}``) and writes them to
``OUT.npz``: how the tests check what aoa wrote.

``from-safetensors`` saves the tensors of a safetensors file as a one-rank Paddle checkpoint
(bench/formats.py's source), and ``time-load`` prints how many seconds ``load_state_dict``
takes to read a checkpoint into preallocated CPU tensors (the median of three, after one
untimed read).

Values come from one seeded stream per tensor, so a rerun writes the same tensor bytes
(the pickles differ only in Paddle's generated tensor names).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

TENSORS = {  # name: (shape, dtype, seed)
    "single": {"embed.weight": ((6, 4), "float32", 1), "norm.weight": ((5,), "bfloat16", 2),
               "step": ((3,), "int64", 3), "scale": ((), "float32", 4)},
    "tp2": {"qkv.weight": ((4, 8), "float32", 5), "down.weight": ((6, 4), "bfloat16", 6),
            "norm.weight": ((4,), "float32", 7)},
    "flat4": {"w": ((6, 10), "float32", 8), "v": ((6, 10), "float32", 9)},
    "two_saves": {"w": ((2, 3), "float32", 10)},
}


def values(name: str):
    """The global tensors of a case as numpy (bfloat16 as float32 before Paddle casts)."""
    out = {}
    for key, (shape, dtype, seed) in TENSORS[name].items():
        rng = np.random.default_rng(seed)
        if dtype == "int64":
            out[key] = rng.integers(-1000, 1000, shape).astype(np.int64)
        else:
            out[key] = rng.standard_normal(shape).astype(np.float32)
    return out


def _paddle_tensor(array, dtype):
    import paddle
    tensor = paddle.to_tensor(array)
    return tensor.astype(dtype) if dtype == "bfloat16" else tensor


def _sharded(key, full, rank, global_offset, local, flattened=None):
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight
    kwargs = {}
    tensor = full[tuple(slice(o, o + s) for o, s in zip(global_offset, local))]
    if flattened is not None:
        tensor = tensor.flatten()[flattened[0]:flattened[1]]
        kwargs = {"is_flattened": True, "flattened_range": slice(*flattened)}
    return ShardedWeight(key=key, local_tensor=tensor, local_shape=tuple(local),
                         global_shape=tuple(full.shape), global_offset=tuple(global_offset),
                         **kwargs)


def save_rank(name: str, folder: str) -> None:
    """The body each rank runs (under paddle.distributed.launch for several ranks)."""
    import paddle.distributed as dist
    tensors = {key: _paddle_tensor(array, TENSORS[name][key][1])
               for key, array in values(name).items()}
    if name == "single":
        dist.save_state_dict(tensors, folder)
        return
    if name == "two_saves":
        dist.save_state_dict(tensors, folder, unique_id=0)
        dist.save_state_dict({"w": tensors["w"] * 2}, folder, unique_id=1)
        return
    dist.init_parallel_env()
    rank = dist.get_rank()
    if name == "tp2":
        state = {
            "qkv.weight": _sharded("qkv.weight", tensors["qkv.weight"], rank, (0, 4 * rank),
                                   (4, 4)),
            "down.weight": _sharded("down.weight", tensors["down.weight"], rank, (3 * rank, 0),
                                    (3, 4)),
            "norm.weight": _sharded("norm.weight", tensors["norm.weight"], rank, (0,), (4,)),
        }
    else:  # flat4
        block = rank // 2
        state = {
            "w": _sharded("w", tensors["w"], rank, (0, 0),
                                    (6, 10), (15 * rank, 15 * rank + 15)),
            "v": _sharded("v", tensors["v"], rank,
                                    (3 * block, 0), (3, 10),
                                    (0, 13) if rank % 2 == 0 else (13, 30)),
        }
    dist.save_state_dict(state, folder)


def expected(name: str) -> dict:
    """What the tests compare against: Paddle's own bytes of each global tensor."""
    out = {}
    for key, array in values(name).items():
        dtype = TENSORS[name][key][1]
        out[key] = np.array(_paddle_tensor(array, dtype)) if dtype == "bfloat16" else array
    if name == "two_saves":
        out = {"w": out["w"], "w@1": out["w"] * 2}
    return out


def save(output: Path) -> None:
    ranks = {"single": 1, "tp2": 2, "flat4": 4, "two_saves": 1}
    for name, count in ranks.items():
        folder = output / name
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        if count == 1:
            save_rank(name, str(folder))
        else:
            with tempfile.TemporaryDirectory() as logs:
                subprocess.run([sys.executable, "-m", "paddle.distributed.launch",
                                "--nproc_per_node", str(count), "--log_dir", logs,
                                __file__, "rank", name, str(folder)], check=True)
        np.savez(folder / "expected.npz", **expected(name))
        print(f"{folder}: {sorted(p.name for p in folder.iterdir())}")


def load(checkpoint: Path, spec: Path, out: Path, unique_id: int | None) -> None:
    import paddle
    import paddle.distributed as dist
    shapes = json.loads(spec.read_text())
    state = {key: paddle.zeros(shape, dtype=dtype) for key, (shape, dtype) in shapes.items()}
    dist.load_state_dict(state, str(checkpoint), unique_id=unique_id)
    np.savez(out, **{key: np.array(tensor) for key, tensor in state.items()})


def from_safetensors(file: Path, checkpoint: Path) -> None:
    import paddle
    import paddle.distributed as dist
    from safetensors.numpy import load_file
    dist.save_state_dict({key: paddle.to_tensor(array) for key, array in
                          load_file(str(file)).items()}, str(checkpoint))


def time_load(checkpoint: Path, spec: Path) -> None:
    import statistics
    import time

    import paddle
    import paddle.distributed as dist
    shapes = json.loads(spec.read_text())
    state = {key: paddle.zeros(shape, dtype=dtype) for key, (shape, dtype) in shapes.items()}
    times = []
    for _ in range(4):
        start = time.perf_counter()
        dist.load_state_dict(state, str(checkpoint))
        times.append(time.perf_counter() - start)
    print(statistics.median(times[1:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    saving = commands.add_parser("save")
    saving.add_argument("--output", type=Path,
                        default=Path(__file__).parent.parent / "tests" / "fixtures" / "paddle")
    rank = commands.add_parser("rank")
    rank.add_argument("name")
    rank.add_argument("folder")
    loading = commands.add_parser("load")
    loading.add_argument("checkpoint", type=Path)
    loading.add_argument("spec", type=Path)
    loading.add_argument("out", type=Path)
    loading.add_argument("--unique-id", type=int)
    converting = commands.add_parser("from-safetensors")
    converting.add_argument("file", type=Path)
    converting.add_argument("checkpoint", type=Path)
    timing = commands.add_parser("time-load")
    timing.add_argument("checkpoint", type=Path)
    timing.add_argument("spec", type=Path)
    args = parser.parse_args()
    if args.command == "save":
        save(args.output)
    elif args.command == "rank":
        save_rank(args.name, args.folder)
    elif args.command == "from-safetensors":
        from_safetensors(args.file, args.checkpoint)
    elif args.command == "time-load":
        time_load(args.checkpoint, args.spec)
    else:
        load(args.checkpoint, args.spec, args.out, args.unique_id)


if __name__ == "__main__":
    main()
