"""PyTorch's and Megatron-Core's side of the checkpoint-format tests.

    .venv/bin/python bench/torch_checkpoints.py dcp [--output tests/fixtures/dcp]
    /work/megatron-venv/bin/python bench/torch_checkpoints.py torch_dist \
        [--output tests/fixtures/torch_dist]
    /work/megatron-venv/bin/python bench/torch_checkpoints.py load-megatron CKPT SPEC.json OUT.npz

``dcp`` writes multi-rank checkpoints with ``torch.distributed.checkpoint.save`` itself, ranks
as processes on the CPU (gloo), tensors as DTensors the way FSDP2 and torchtitan save them:

  tp2     two ranks: a column split, a row split (bfloat16), a replicated norm (DCP keeps one)
  fsdp4   four ranks, every tensor split on its first axis, unevenly (10 rows: 3 3 3 1;
          Megatron-Core splits only evenly, so 12 rows there)

``torch_dist`` writes the same two layouts with Megatron-Core's ``dist_checkpointing.save``
(``ShardedTensor.from_rank_offsets``, replica ids for the replicated norm, a sharded object
and common state), which adds ``metadata.json`` and ``common.pt``. Megatron-Core's writer
forks worker processes and synchronizes CUDA; on this CPU-only machine the script runs its
write step in the process and skips the CUDA calls (the files are Megatron's own).

``load-megatron`` reads a checkpoint with ``dist_checkpointing.load`` into whole tensors of
the shapes and dtypes ``SPEC.json`` gives (``{key: [shape, dtype]}``) and writes ``OUT.npz``
(bfloat16 as uint16): how the tests check a ``torch_dist`` checkpoint aoa wrote. Sharded
objects named in the spec's ``"@objects"`` (their unique keys, ``rng/shard_0_2``) are loaded
too and written beside as ``OUT.objects.json`` (each value's ``repr``).

Beside each checkpoint, ``expected.npz`` holds its global tensors (bfloat16 as uint16 bits).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import socket
from pathlib import Path

import numpy as np
import torch

TENSORS = {  # case: {key: (shape, dtype, seed)}
    "tp2": {"qkv.weight": ((4, 8), torch.float32, 1), "down.weight": ((6, 4), torch.bfloat16, 2),
            "norm.weight": ((4,), torch.float32, 3)},
    "fsdp4": {"embed.weight": ((10, 4), torch.float32, 4),
              "mlp.weight": ((10, 6), torch.bfloat16, 5), "bias": ((10,), torch.float32, 6)},
}
RANKS = {"tp2": 2, "fsdp4": 4}
#: Per case and key: the axis split over the ranks (None: replicated).
SPLITS = {"tp2": {"qkv.weight": 1, "down.weight": 0, "norm.weight": None},
          "fsdp4": {"embed.weight": 0, "mlp.weight": 0, "bias": 0}}


def values(case: str, kind: str = "dcp") -> dict[str, torch.Tensor]:
    out = {}
    for key, (shape, dtype, seed) in TENSORS[case].items():
        if case == "fsdp4" and kind == "torch_dist":
            shape = (12, *shape[1:])
        generator = torch.Generator().manual_seed(seed)
        out[key] = torch.randn(shape, generator=generator).to(dtype)
    return out


def bits(tensor: torch.Tensor) -> np.ndarray:
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(np.uint16)
    return tensor.numpy()


def _pieces(size: int, ranks: int) -> list[tuple[int, int]]:
    """torch.chunk's split of ``size`` rows over ``ranks``: (start, length) each."""
    step = -(-size // ranks)
    return [(min(r * step, size), max(0, min(step, size - r * step))) for r in range(ranks)]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _init(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)


def _dcp_rank(rank: int, case: str, folder: str, port: int) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    world = RANKS[case]
    _init(rank, world, port)
    mesh = init_device_mesh("cpu", (world,))
    state = {key: distribute_tensor(tensor, mesh,
                                    [Replicate() if SPLITS[case][key] is None
                                     else Shard(SPLITS[case][key])])
             for key, tensor in values(case).items()}
    state["step"] = 7  # an object saved as bytes: not a tensor
    dcp.save(state, checkpoint_id=folder)
    torch.distributed.destroy_process_group()


def _megatron_rank(rank: int, case: str, folder: str, port: int) -> None:
    _patch_megatron_for_cpu()
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    world = RANKS[case]
    _init(rank, world, port)
    state: dict = {}
    for key, tensor in values(case, "torch_dist").items():
        axis = SPLITS[case][key]
        if axis is None:
            state[key] = ShardedTensor.from_rank_offsets(key, tensor.clone(),
                                                         replica_id=rank)
            continue
        start, length = _pieces(tensor.shape[axis], world)[rank]
        local = tensor.narrow(axis, start, length).clone()
        state[key] = ShardedTensor.from_rank_offsets(key, local, (axis, rank, world))
    state["rng"] = ShardedObject("rng", {"seed": rank}, (world,), (rank,))
    state["iteration"] = 7
    dist_checkpointing.save(state, folder)
    torch.distributed.destroy_process_group()


def _patch_megatron_for_cpu() -> None:
    """Run Megatron's file writer in this process and skip its CUDA calls (no GPU here)."""
    import megatron.core.dist_checkpointing.strategies.filesystem_async as writer_module
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync,
    )

    def write_here(transforms, use_msc, rank, buckets, results):
        written = {}
        for index, bucket in enumerate(buckets):
            local, count = queue.Queue(), queue.Queue()
            count.put(index)
            FileSystemWriterAsync.write_preloaded_data(transforms, index, bucket, local, count,
                                                       True)
            position, result = local.get()
            if isinstance(result, Exception):
                results.put(result)
                return
            written[position] = result
        results.put(written)

    FileSystemWriterAsync.write_preloaded_data_multiproc = staticmethod(write_here)
    writer_module._get_write_results_queue = queue.Queue
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_device = lambda: "cpu"


def save(kind: str, output: Path) -> None:
    import torch.multiprocessing as mp

    target = _dcp_rank if kind == "dcp" else _megatron_rank
    for case, world in RANKS.items():
        folder = output / case
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        mp.spawn(target, (case, str(folder), _free_port()), nprocs=world)
        np.savez(folder / "expected.npz",
                 **{key: bits(tensor) for key, tensor in values(case, kind).items()})
        print(f"{folder}: {sorted(p.name for p in folder.iterdir())}")


def load_megatron(checkpoint: Path, spec: Path, out: Path) -> None:
    _patch_megatron_for_cpu()
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    _init(0, 1, _free_port())
    shapes = json.loads(spec.read_text())
    objects = shapes.pop("@objects", [])
    state: dict = {key: ShardedTensor.from_rank_offsets(
        key, torch.zeros(shape, dtype=getattr(torch, dtype)))
        for key, (shape, dtype) in shapes.items()}
    state |= {key: ShardedObject.empty_from_unique_key(key) for key in objects}
    loaded = dist_checkpointing.load(state, str(checkpoint))
    np.savez(out, **{key: bits(loaded[key]) for key in shapes})
    if objects:
        out.with_suffix(".objects.json").write_text(json.dumps(
            {key: repr(loaded[key]) for key in objects}))
    torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    fixtures = Path(__file__).parent.parent / "tests" / "fixtures"
    for kind in ("dcp", "torch_dist"):
        command = commands.add_parser(kind)
        command.add_argument("--output", type=Path, default=fixtures / kind)
    loading = commands.add_parser("load-megatron")
    loading.add_argument("checkpoint", type=Path)
    loading.add_argument("spec", type=Path)
    loading.add_argument("out", type=Path)
    args = parser.parse_args()
    if args.command == "load-megatron":
        load_megatron(args.checkpoint, args.spec, args.out)
    else:
        save(args.command, args.output)


if __name__ == "__main__":
    main()
