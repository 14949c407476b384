"""Every worked case of the spec's examples (copied to tests/golden/examples), and
realistic model mappings whose bytes were frozen from PaddlePaddle 3.3.1's own answers
(tests/golden/paddle_crosscheck, made with bench/paddle_reference.py): the bytes produced
through the Paddle drop-in and through aoa.compile + the numpy executor must be the expected
ones; error and refuse cases must raise an AoaError."""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from sharding import ListBoxes

import aoa
from aoa.compat.paddle import AOAEngine, ShardMappingEntry
from aoa.dtypes import numpy_dtype
from aoa.runtime import reference

GOLDEN = Path(__file__).parent / "golden"
CASES = sorted(f"{folder}/{p.name}" for folder in ("examples", "paddle_crosscheck")
               for p in (GOLDEN / folder).iterdir() if (p / "case.json").is_file())


def load_case(name: str):
    case = json.loads((GOLDEN / name / "case.json").read_text())
    with np.load(GOLDEN / name / "arrays.npz") as npz:
        bf16 = set(case["bfloat16_as_uint16"])
        arrays = {k: npz[k].view(ml_dtypes.bfloat16) if k in bf16 else npz[k] for k in npz.files}
    return case, arrays


def expected_arrays(case):
    return case["aoa"]["arrays"] if case["aoa"]["class"] == "fixed" else case["expect"]["arrays"]


def box(offset, shape):
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


def apply_entries(query, entries, sources):
    """examples/README.md's data path, written out independently of aoa."""
    out = np.zeros(query["local_shape"], dtype=numpy_dtype(query["dtype"]))
    for e in entries:
        s, t = e.source_slice, e.target_slice
        x = sources[s.key][box(s.global_offset, s.local_shape)]
        for item in e.postprocess_list or []:
            try:
                perm = ast.literal_eval(item)
            except (ValueError, SyntaxError):
                perm = None
            x = np.transpose(x, perm) if isinstance(perm, list) else x.astype(numpy_dtype(item))
        rel = [a - b for a, b in zip(t.global_offset, query["global_offset"])]
        out[box(rel, t.local_shape)] = x.astype(out.dtype)
    return out


def sources_of(arrays):
    return {k[len("src::"):]: v for k, v in arrays.items() if k.startswith("src::")}


@pytest.mark.parametrize("name", CASES)
def test_paddle_engine_gives_expected_bytes(name):
    case, arrays = load_case(name)
    config = {"aoa_statements": case["aoa_statements"], "aoa_config_reverse": case["reverse"]}
    if case["aoa"]["class"] in ("error", "refuse"):
        with pytest.raises(aoa.AoaError):
            engine = AOAEngine(config, case["source"], case["destination"])
            for query in case["queries"]:
                engine.find_shard_sources(aoa.ShardDesc.from_json(query))
        return
    engine = AOAEngine(config, case["source"], case["destination"])
    for query, expected in zip(case["queries"], expected_arrays(case), strict=True):
        entries = engine.find_shard_sources(aoa.ShardDesc.from_json(query))
        got = apply_entries(query, entries, sources_of(arrays))
        want = arrays[expected["npz_key"]]
        assert got.shape == want.shape
        assert got.tobytes() == want.tobytes(), f"{query['key']} {query['global_offset']}"


@pytest.mark.parametrize("name", CASES)
def test_paddle_engine_answers_from_the_plan_as_when_asked(name):
    """A query for a planned shard is answered from what planning found; the same box asked
    another way is answered from the program at the query: both answers are equal."""
    case, _ = load_case(name)
    if case["aoa"]["class"] in ("error", "refuse") or not case["destination"]:
        return
    config = {"aoa_statements": case["aoa_statements"], "aoa_config_reverse": case["reverse"]}
    engine = AOAEngine(config, case["source"], case["destination"])
    for query in case["queries"]:
        planned = engine.find_shard_sources(aoa.ShardDesc.from_json(query))
        assert engine.find_shard_sources(ListBoxes(query)) == planned, query
        assert engine.find_shard_sources(aoa.ShardDesc.from_json(query)) == planned
        for entry in planned:  # made field by field, they are what their constructors make
            assert type(entry) is ShardMappingEntry and type(entry.postprocess_list) in (
                list, type(None))
            remade = ShardMappingEntry(
                *(aoa.ShardDesc(**dataclasses.asdict(shard))
                  for shard in (entry.target_slice, entry.source_slice)),
                entry.postprocess_list)
            assert remade == entry and repr(remade) == repr(entry)
            assert hash(entry.source_slice) == hash(remade.source_slice)
            with pytest.raises(dataclasses.FrozenInstanceError):
                entry.source_slice.key = "x"  # type: ignore[misc]


def test_paddle_engine_compilation_is_made_again_when_asked():
    """With a destination, the engine keeps the answers of its shards, not the compilation
    behind them; asked for afterwards, the compilation is made again, once, from the same
    program and shard descriptions, and answers another box as it would have."""
    source = {"w": [aoa.ShardDesc.full("w", (4, 6), "float32")]}
    destination = {"v": [aoa.ShardDesc("v", (3, 4), (6, 4), (0, 0), "float32"),
                         aoa.ShardDesc("v", (3, 4), (6, 4), (3, 0), "float32")]}
    engine = AOAEngine({"aoa_statements": ["w^T -> v"]}, source, destination)
    compilation = engine.compilation
    assert engine.compilation is compilation
    assert compilation.made_as("v") == aoa.ShardDesc.full("v", (6, 4), "float32")
    (entry,) = engine.find_shard_sources(aoa.ShardDesc("v", (2, 4), (6, 4), (1, 0), "float32"))
    assert entry.source_slice == aoa.ShardDesc("w", (4, 2), (4, 6), (0, 1), "float32")
    assert entry.postprocess_list == ["[1, 0]"]


@pytest.mark.parametrize("name", CASES)
def test_compile_and_numpy_executor_give_expected_bytes(name):
    case, arrays = load_case(name)
    if case["aoa"]["class"] in ("error", "refuse"):
        with pytest.raises(aoa.AoaError):
            aoa.compile(case["aoa_statements"], case["source"], case["destination"],
                        reverse=case["reverse"])
        return
    compilation = aoa.pipeline.analyze(case["aoa_statements"], case["source"],
                                       case["destination"], reverse=case["reverse"])
    compilation.plan()  # the whole destination validates
    queries = [aoa.ShardDesc.from_json(q) for q in case["queries"]]
    plan = compilation.plan(queries)
    plan = aoa.Plan.loads(plan.dumps())  # the plan survives JSON unchanged
    outputs = reference.run_plan_on_arrays(plan, sources_of(arrays))
    for index, expected in enumerate(expected_arrays(case)):
        want = arrays[expected["npz_key"]]
        assert outputs[index].tobytes() == want.tobytes(), queries[index]
