"""Random AOA programs of every kind (renames, splits, concats, transposes, casts, aliases,
chains of temporaries through the fused macros, templates, `*`, `[a:b]`, optimizer states,
reverse runs, runs that derive their outputs, tensor parallelism 1-8, names that a careless
macro would capture): the bytes aoa's plan produces equal the numpy meaning of the program
(tests/numpy_programs.py, written from the spec, not from aoa).

The number of examples is modest by default; `AOA_PROPERTY_EXAMPLES=20000` runs many more.
"""

from __future__ import annotations

import os

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from numpy_programs import DTYPES, Program, Stored, expected, programs
from sharding import sharded

import aoa
from aoa.runtime import reference

EXAMPLES = int(os.environ.get("AOA_PROPERTY_EXAMPLES", "60"))
STATE = ".moment1_0"


def layout(stored: dict[str, Stored], states: set[str]) -> dict[str, list[aoa.ShardDesc]]:
    info = {key: sharded(key, s.shape, s.shards, s.axis, s.dtype) for key, s in stored.items()}
    info.update({key + STATE: sharded(key + STATE, s.shape, s.shards, s.axis, s.dtype)
                 for key, s in stored.items() if key in states})
    return info


def random_arrays(stored: dict[str, Stored], rng) -> dict[str, np.ndarray]:
    return {key: rng.standard_normal(s.shape).astype(np.float32).astype(DTYPES[s.dtype])
            for key, s in stored.items()}


def run(program: Program, seed: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(what aoa's plan writes, what numpy says) for every key written, optimizer states
    included."""
    reads, writes = ((program.destinations, program.sources) if program.reverse
                     else (program.sources, program.destinations))
    rng = np.random.default_rng(seed)
    arrays = random_arrays(reads, rng)
    states = {key: value for key, value in random_arrays(
        {k: s for k, s in reads.items() if k in program.states}, rng).items()}
    source = layout(reads, program.states)
    destination = None if program.derive else layout(writes, program.states)
    plan = aoa.compile(program.statements, source, destination, reverse=program.reverse)
    given_arrays = {**arrays, **{k + STATE: v for k, v in states.items()}}
    got: dict[str, np.ndarray] = {}
    for shard, out in zip(plan.destinations, reference.run_plan_on_arrays(plan, given_arrays),
                          strict=True):
        whole = got.setdefault(shard.key, np.zeros(shard.global_shape, out.dtype))
        whole[tuple(slice(o, o + n) for o, n in zip(shard.global_offset, shard.local_shape))] \
            = out
    want = expected(program, arrays)
    if states:
        followed = expected(program, {**arrays, **states})
        want.update({k + STATE: v for k, v in followed.items() if k in program.states})
    return got, want


@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(programs(), st.integers(0, 2**32 - 1))
def test_program_bytes_equal_numpy(program, seed):
    got, want = run(program, seed)
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype, key
        assert got[key].shape == value.shape, key
        assert got[key].tobytes() == np.ascontiguousarray(value).tobytes(), key
