"""Random shard layouts and random split/concat/permute/cast programs: the bytes through the
plan equal a direct numpy computation of the same program."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from sharding import sharded

import aoa
import aoa.dtypes
from aoa.runtime import reference


def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def programs(draw):
    rank = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=rank, max_size=rank)))
    axis = draw(st.integers(0, rank - 1))
    source = {"s": sharded("s", shape, draw(st.sampled_from(divisors(shape[axis]))), axis,
                           "float32")}
    statements, current, dtype = [], "s", "float32"
    steps = draw(st.lists(st.sampled_from(["permute", "regroup", "cast", "rename"]),
                          max_size=5))
    ops = []
    for i, step in enumerate(steps):
        name = f"t{i}"
        if step == "permute":
            perm = draw(st.permutations(range(rank)))
            statements.append(f"{current} -> {name}, permute='{list(perm)}'")
            ops.append(("permute", perm))
            shape = tuple(shape[a] for a in perm)
        elif step == "regroup":
            a = draw(st.integers(0, rank - 1))
            n = draw(st.sampled_from(divisors(shape[a])))
            order = draw(st.permutations(range(n)))
            parts = [f"{name}_p{j}" for j in range(n)]
            if n == 1:
                statements.append(f"{current} -> {name}")
            else:
                statements.append(f"{current} -> {', '.join(parts)}, axis={a}")
                statements.append(f"{', '.join(parts[j] for j in order)} -> {name}, axis={a}")
            ops.append(("regroup", (a, n, order)))
        elif step == "cast":
            target = draw(st.sampled_from(["float16", "bfloat16", "float64", "float32"]))
            statements.append(f"{current} -> {name}, dtype='{target}'")
            ops.append(("cast", target))
            dtype = target
        else:
            statements.append(f"{current} -> {name}")
        current = name
    statements.append(f"{current} -> d")
    out_axis = draw(st.integers(0, rank - 1))
    destination = {"d": sharded("d", shape, draw(st.sampled_from(divisors(shape[out_axis]))),
                                out_axis, dtype)}
    return statements, source, destination, ops, dtype


def numpy_program(x, ops):
    for kind, arg in ops:
        if kind == "permute":
            x = np.transpose(x, arg)
        elif kind == "regroup":
            axis, n, order = arg
            parts = np.split(x, n, axis=axis)
            x = np.concatenate([parts[j] for j in order], axis=axis)
        else:
            x = x.astype(aoa.dtypes.numpy_dtype(arg))
    return x


@settings(max_examples=150, deadline=None)
@given(programs(), st.integers(0, 2**32 - 1))
def test_plan_bytes_equal_numpy(program, seed):
    statements, source, destination, ops, dtype = program
    shape = source["s"][0].global_shape
    tensor = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    plan = aoa.compile(statements, source, destination)
    outputs = reference.run_plan_on_arrays(plan, {"s": tensor})
    expected = numpy_program(tensor, ops).astype(aoa.dtypes.numpy_dtype(dtype))
    for shard, got in zip(plan.destinations, outputs, strict=True):
        region = tuple(slice(o, o + n) for o, n in zip(shard.global_offset, shard.local_shape))
        assert got.tobytes() == np.ascontiguousarray(expected[region]).tobytes()
