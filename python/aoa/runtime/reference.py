"""Run a plan on in-memory numpy arrays: the oracle for every other executor.

Sources are whole global tensors by key; each physical source shard is cut out of them,
and each destination shard starts zero-filled (a region no copy writes stays zero).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from aoa.dtypes import numpy_dtype
from aoa.plan import Plan


def _box(offset, shape):
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


def run_plan_on_arrays(plan: Plan, tensors: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    """Destination shard arrays (C order, in plan order) from global source tensors."""
    sources = []
    for shard in plan.sources:
        whole = np.asarray(tensors[shard.key])
        sources.append(np.ascontiguousarray(
            whole[_box(shard.global_offset, shard.local_shape)].astype(
                numpy_dtype(shard.dtype), copy=False)))
    destinations = [np.zeros(d.local_shape, numpy_dtype(d.dtype)) for d in plan.destinations]
    from aoa.runtime.lower import kernel_copies
    from aoa.runtime.numpy_backend import execute_copies

    execute_copies(kernel_copies(plan), sources, destinations)
    return destinations
