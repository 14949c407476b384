"""Random AOA programs of every kind (renames, splits, concats, transposes, casts, aliases,
chains of temporaries through the fused macros, templates, `*`, `[a:b]`, optimizer states,
reverse runs, runs that derive their outputs, tensor parallelism 1-8, names that a careless
macro would capture): the bytes aoa's plan produces equal the numpy meaning of the program
(tests/numpy_programs.py, written from the spec, not from aoa), and so do the Paddle drop-in's
answers, applied as Paddle applies them.

The number of examples is modest by default; `AOA_PROPERTY_EXAMPLES=20000` runs many more.
"""

from __future__ import annotations

import json
import os

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from numpy_programs import DTYPES, Program, Stored, expected, programs
from sharding import ListBoxes, sharded

import aoa
from aoa.compat.paddle import AOAEngine, ShardMappingEntry
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


def inputs(program: Program, seed: int
           ) -> tuple[dict, dict | None, dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The program's source and destination layouts (None: it derives its outputs), random
    arrays of its source keys and optimizer states, and what numpy says it writes."""
    reads, writes = ((program.destinations, program.sources) if program.reverse
                     else (program.sources, program.destinations))
    rng = np.random.default_rng(seed)
    arrays = random_arrays(reads, rng)
    states = {key: value for key, value in random_arrays(
        {k: s for k, s in reads.items() if k in program.states}, rng).items()}
    source = layout(reads, program.states)
    destination = None if program.derive else layout(writes, program.states)
    given_arrays = {**arrays, **{k + STATE: v for k, v in states.items()}}
    want = expected(program, arrays)
    if states:
        followed = expected(program, {**arrays, **states})
        want.update({k + STATE: v for k, v in followed.items() if k in program.states})
    return source, destination, given_arrays, want


def run(program: Program, seed: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(what aoa's plan writes, what numpy says) for every key written, optimizer states
    included."""
    source, destination, given_arrays, want = inputs(program, seed)
    plan = aoa.compile(program.statements, source, destination, reverse=program.reverse)
    got: dict[str, np.ndarray] = {}
    for shard, out in zip(plan.destinations, reference.run_plan_on_arrays(plan, given_arrays),
                          strict=True):
        whole = got.setdefault(shard.key, np.zeros(shard.global_shape, out.dtype))
        whole[tuple(slice(o, o + n) for o, n in zip(shard.global_offset, shard.local_shape))] \
            = out
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


def apply_entries(entries: list[ShardMappingEntry], arrays: dict[str, np.ndarray],
                  whole: np.ndarray) -> None:
    """Paddle's meaning of the drop-in's entries: each source box, its postprocess list
    applied in order (a permutation as "[1, 0]", else a cast), into its target box."""
    for entry in entries:
        source, target = entry.source_slice, entry.target_slice
        piece = arrays[source.key][tuple(slice(o, o + n) for o, n in
                                         zip(source.global_offset, source.local_shape))]
        for step in entry.postprocess_list or []:
            piece = (np.transpose(piece, json.loads(step)) if step.startswith("[")
                     else piece.astype(DTYPES[step]))
        whole[tuple(slice(o, o + n) for o, n in zip(target.global_offset,
                                                    target.local_shape))] = piece


@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(programs(), st.integers(0, 2**32 - 1))
def test_paddle_engine_answers_give_numpy_s_bytes(program, seed):
    """The drop-in's answer for every destination shard, from what it planned at
    construction, equals the answer worked out when asked, and applied as Paddle applies it
    gives the numpy meaning of the program."""
    source, destination, arrays, want = inputs(program, seed)
    if destination is None:
        return
    engine = AOAEngine({"aoa_statements": program.statements,
                        "aoa_config_reverse": program.reverse}, source, destination)
    for key, shards in destination.items():
        whole = np.zeros(want[key].shape, want[key].dtype)
        for shard in shards:
            planned = engine.find_shard_sources(shard)
            assert planned == engine.find_shard_sources(ListBoxes(shard.to_json())), shard
            apply_entries(planned, arrays, whole)
        assert whole.tobytes() == np.ascontiguousarray(want[key]).tobytes(), key
