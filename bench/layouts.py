"""Destination layouts of many small tensors: what the dcp-safetensors destination works out
before a byte is copied, for the 61-layer, 256-expert MoE of compile_scale.py (125,486
destination shards, TP4, four rank files), against ``json.dumps`` of the same headers.

  plan_files  the rank files and their bytes (part of ``prepare``)
  layouts     each file's header (JSON with DCP_SHARDING_INFO) and where its shards go
  spans       the writer's span table of each layout (`aoa.storage.writer._items`)
  json.dumps  the reference: the header objects (metadata included) through json.dumps,
              which the layouts' headers equal byte for byte

Each is the best of ``--repeats``, the cyclic garbage collector stopped as the write does.

Usage: python bench/layouts.py [--layers 61] [--experts 256] [--repeats 5]
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from collections.abc import Callable
from pathlib import Path

from compile_scale import build_model

from aoa.dtypes import SAFETENSORS_NAMES
from aoa.layout import ShardDesc
from aoa.storage.dcp_safetensors import DcpSafetensorsDestination
from aoa.storage.writer import _items


def best(repeats: int, work: Callable[[], object]) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return min(times)


def dumped(shards: list[ShardDesc]) -> str:
    """A rank file's header object as the reference writes it."""
    info = {shard.key: {"saved_offsets": list(shard.global_offset)} for shard in shards}
    header: dict[str, object] = {"__metadata__": {"DCP_SHARDING_INFO": json.dumps(info),
                                                  "DCP_VERSION": "1.0"}}
    offset = 0
    for shard in shards:
        header[shard.key] = {"dtype": SAFETENSORS_NAMES[shard.dtype],  # type: ignore[index]
                             "shape": list(shard.local_shape),
                             "data_offsets": [offset, offset + shard.nbytes]}
        offset += shard.nbytes
    return json.dumps(header, separators=(",", ":"), ensure_ascii=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=61)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    model = build_model(args.layers, args.experts)
    shards: list[ShardDesc] = []
    ranks: list[list[int]] = []
    for listed in model.destination.values():  # rank i: the i-th shard of each key
        for rank, shard in enumerate(listed):
            if rank == len(ranks):
                ranks.append([])
            ranks[rank].append(len(shards))
            shards.append(ShardDesc(*shard))
    files = DcpSafetensorsDestination.plan_files(shards, ranks)
    destination = DcpSafetensorsDestination(Path("/nonexistent"), shards, files)
    layouts = [destination.layout(file) for file in files]
    by_rank = [[shards[i] for i in file.shards] for file in files]
    assert [layout.fixed[0][1][8:].rstrip(b" ") for layout in layouts] == [
        dumped(rank).encode() for rank in by_rank]
    collecting = gc.isenabled()
    gc.disable()
    try:
        rows = [
            ("plan_files", best(args.repeats, lambda: DcpSafetensorsDestination.plan_files(
                shards, ranks))),
            ("layouts", best(args.repeats, lambda: [destination.layout(f) for f in files])),
            ("spans", best(args.repeats, lambda: [_items(Path(f.filename), layout)
                                                 for f, layout in zip(files, layouts)])),
            ("json.dumps", best(args.repeats, lambda: [dumped(rank) for rank in by_rank])),
        ]
    finally:
        if collecting:
            gc.enable()
    reference = rows[-1][1]
    print(f"{len(shards):,} destination shards in {len(files)} files")
    print(f"| {'step':<10} | {'ms':>7} | {'us/shard':>8} | {'/ json.dumps':>12} |")
    print(f"|{'-' * 12}|{'-' * 8}:|{'-' * 9}:|{'-' * 13}:|")
    for name, seconds in rows:
        print(f"| {name:<10} | {seconds * 1e3:7.1f} | {seconds / len(shards) * 1e6:8.2f} "
              f"| {seconds / reference:12.2f} |")


if __name__ == "__main__":
    main()
