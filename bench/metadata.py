"""Reading a large checkpoint's metadata pickle: PyTorch DCP's ``.metadata`` with many chunks,
side by side in one run: ``pickle.loads`` (torch's own classes, imported), aoa's restricted
pickle machine (`unpickler.load`), the restricted C unpickler aoa reads metadata with
(`unpickler.load_metadata`), and `dcp.read_metadata` (that, plus every field checked).

The metadata is torch's: ``torch.distributed.checkpoint.metadata.Metadata`` of ``--tensors``
tensors, each in ``--chunks`` row chunks, pickled as DCP saves it.

Usage: python bench/metadata.py [--tensors 3200] [--chunks 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import pickle
import time
from pathlib import Path

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from aoa.storage import dcp, unpickler


def dcp_metadata(tensors: int, chunks: int) -> bytes:
    state, storage = {}, {}
    for t in range(tensors):
        key = f"model.layers.{t}.weight"
        pieces = []
        for c in range(chunks):
            offsets = torch.Size([c * 64, 0])
            pieces.append(ChunkStorageMetadata(offsets=offsets, sizes=torch.Size([64, 128])))
            storage[MetadataIndex(key, offsets)] = _StorageInfo(
                f"__{c}_0.distcp", t * 64 * 128 * 2, 64 * 128 * 2)
        state[key] = TensorStorageMetadata(TensorProperties(dtype=torch.bfloat16),
                                           torch.Size([64 * chunks, 128]), pieces)
    return pickle.dumps(Metadata(state_dict_metadata=state, storage_data=storage))


def timed(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=3200)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    data = dcp_metadata(args.tensors, args.chunks)
    view = memoryview(data)
    where = Path(".metadata")
    print(f"{args.tensors * args.chunks:,} chunks, {len(data) / 1e6:.1f} MB")
    print(f"{'repeat':>6s}{'pickle.loads':>14s}{'machine':>10s}{'C restricted':>14s}"
          f"{'read_metadata':>15s}{'machine / C':>13s}")
    for repeat in range(1, args.repeats + 1):
        loads = timed(lambda: pickle.loads(data))
        machine = timed(lambda: unpickler.load(view, where, dcp.ALLOWED))
        restricted = timed(lambda: unpickler.load_metadata(view, where, dcp.ALLOWED))
        read = timed(lambda: dcp.read_metadata(view, where))
        print(f"{repeat:6d}{loads:14.3f}{machine:10.3f}{restricted:14.3f}{read:15.3f}"
              f"{machine / restricted:13.2f}")


if __name__ == "__main__":
    main()
