"""The executor fills a destination whole or a range of rows at a time (pieces given as the
range of elements the rows hold), with the same bytes as the numpy reference. Ranges whose
edges fall anywhere are in tests/runtime/test_lower.py."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest
from sharding import sharded

import aoa
from aoa.dtypes import numpy_dtype
from aoa.runtime import reference
from aoa.runtime.executor import PlanExecutor
from aoa.storage import Piece


@pytest.mark.parametrize("backend", ["cpp", "numpy"])
@pytest.mark.parametrize("cuts", [(0, 5), (0, 2, 5), (0, 1, 3, 4, 5)])
def test_rows_of_a_destination_fill_what_the_whole_fills(backend, cuts):
    source = {"w": sharded("w", (6, 5), 2, 0), "b": sharded("b", (5, 4), 1, 0)}
    plan = aoa.compile("w^T -> t, dtype='bfloat16'\nb -> c", source,
                       {"t": sharded("t", (5, 6), 1, 0, "bfloat16"),
                        "c": sharded("c", (5, 4), 1, 0)})
    rng = np.random.default_rng(3)
    tensors = {"w": rng.standard_normal((6, 5), dtype=np.float32),
               "b": rng.standard_normal((5, 4), dtype=np.float32)}
    expected = reference.run_plan_on_arrays(plan, tensors)
    sources = [np.ascontiguousarray(tensors[s.key][tuple(
        slice(o, o + n) for o, n in zip(s.global_offset, s.local_shape))]) for s in plan.sources]
    executor = PlanExecutor(plan, sources.__getitem__, backend=backend)
    for index, shard in enumerate(plan.destinations):
        whole = np.zeros(shard.local_shape, numpy_dtype(shard.dtype))
        row = int(np.prod(shard.local_shape[1:]))
        pieces = [Piece(index, whole[start:stop], (start * row, stop * row))
                  for start, stop in pairwise(cuts)]
        executor.fill(pieces)
        assert whole.tobytes() == expected[index].tobytes(), shard.key
