"""aoa.models' paddleformers mappings against PaddleFormers 1.2.0's own statements, as
PaddlePaddle 3.3.1's engine ran them (frozen by bench/paddleformers_golden.py): the same
tensor names, the same layout, the same bytes in every shard; and the way back gives the
original bytes (PaddleFormers' own way back does where the case records it as true)."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import aoa
from aoa.jobs.job import derived_outputs
from aoa.layout import ShardDesc
from aoa.mapping import MappingText
from aoa.models import Config, Mesh, mapping_for
from aoa.models.mapping import template_dtypes
from aoa.runtime.reference import run_plan_on_arrays

GOLDEN = Path(__file__).parent / "golden" / "paddleformers"
FOLDERS = sorted(p for p in GOLDEN.iterdir() if (p / "case.json").is_file())
#: a model library mapping against PaddleFormers' own
CASES = [p.name for p in FOLDERS if '"kind": "statements"' not in (p / "case.json").read_text()]
#: PaddleFormers' statements themselves, run by aoa (its fused_in_proj macro)
STATEMENT_CASES = [p.name for p in FOLDERS if p.name not in CASES]


def load(name: str):
    case = json.loads((GOLDEN / name / "case.json").read_text())
    with np.load(GOLDEN / name / "arrays.npz") as npz:
        bf16 = set(case["bfloat16_as_uint16"])
        arrays = {k: npz[k].view(ml_dtypes.bfloat16) if k in bf16 else npz[k]
                  for k in npz.files}
    return case, arrays


def info(layout: dict) -> dict[str, list[ShardDesc]]:
    return {key: [ShardDesc.from_json(s) for s in shards] for key, shards in layout.items()}


def ours(case: dict):
    source = info(case["source"])
    cfg = Config(case["config"]).with_checkpoint(frozenset(source))
    return mapping_for(cfg, "paddleformers", Mesh(**case["mesh"])), source


@pytest.mark.parametrize("name", CASES)
def test_same_names_and_layout(name):
    case, _ = load(name)
    mapping, source = ours(case)
    outputs = derived_outputs(MappingText(mapping.forward), source)
    assert sorted(outputs) == case["paddleformers_keys"]
    by_key = mapping.layout.shards(outputs).by_key
    assert {k: [s.to_json() for s in v] for k, v in by_key.items()} == case["destination"]


@pytest.mark.parametrize("name", CASES)
def test_same_bytes_per_shard(name):
    case, arrays = load(name)
    mapping, source = ours(case)
    plan = aoa.compile(mapping.forward, source, info(case["destination"]))
    tensors = {k[len("src::"):]: v for k, v in arrays.items() if k.startswith("src::")}
    got = {(d.key, d.global_offset): a for d, a in zip(plan.destinations,
                                                         run_plan_on_arrays(plan, tensors))}
    for expected in case["arrays"]:
        query = case["queries"][expected["query"]]
        want = arrays[expected["npz_key"]]
        have = got[(query["key"], tuple(query["global_offset"]))]
        assert have.dtype == want.dtype and have.shape == want.shape, query["key"]
        assert have.tobytes() == want.tobytes(), (query["key"], query["global_offset"])


@pytest.mark.parametrize("name", CASES)
def test_way_back_gives_the_original_bytes(name):
    """aoa's inverse always; PaddleFormers' where the case says it is a true inverse."""
    case, arrays = load(name)
    mapping, _ = ours(case)
    shards = info(case["destination"])
    pf = {}
    for expected in case["arrays"]:
        query = case["queries"][expected["query"]]
        whole = pf.setdefault(query["key"], np.zeros(query["global_shape"],
                                                     arrays[expected["npz_key"]].dtype))
        whole[tuple(slice(o, o + n) for o, n in zip(query["global_offset"],
                                                    query["local_shape"]))] = \
            arrays[expected["npz_key"]]
    reads = sorted({read for step in mapping.steps for read in step.reads})
    writes = sorted({write for step in mapping.steps for write in step.writes})
    original = template_dtypes(reads, {k: v[0]["dtype"] for k, v in case["source"].items()})
    stored = template_dtypes(writes, {k: v[0]["dtype"] for k, v in case["destination"].items()})
    text = mapping.inverse(original, stored)
    plan = aoa.compile(text, shards, info(case["source"]))
    for shard, array in zip(plan.destinations, run_plan_on_arrays(plan, pf)):
        assert array.tobytes() == arrays[f"src::{shard.key}"].tobytes(), shard.key


def test_paddleformers_way_back_is_not_always_true():
    """The defects the frozen cases record of PaddleFormers 1.2.0's inverse statements."""
    verdicts = {name: load(name)[0]["paddleformers_inverse"] for name in CASES}
    untrue = {name for name, verdict in verdicts.items() if not verdict["true"]}
    assert {"phi3_tp2", "gemma3_text_tp2"} <= untrue


@pytest.mark.parametrize("name", STATEMENT_CASES)
def test_paddleformers_fused_in_proj_as_paddleformers_registers_it(name):
    """PaddleFormers' Qwen3.5 linear-attention statements (fused_in_proj with
    tp_probe_key, which PaddleFormers adds to Paddle's macros) give in aoa the bytes Paddle
    gives with PaddleFormers' macro registered."""
    case, arrays = load(name)
    statements = case["paddleformers"]["forward"]
    assert any("fused_in_proj" in s and "tp_probe_key=" in s for s in statements)
    plan = aoa.compile(statements, info(case["source"]), info(case["destination"]))
    tensors = {k[len("src::"):]: v for k, v in arrays.items() if k.startswith("src::")}
    got = {(d.key, d.global_offset): a for d, a in zip(plan.destinations,
                                                         run_plan_on_arrays(plan, tensors))}
    for expected in case["arrays"]:
        query = case["queries"][expected["query"]]
        want = arrays[expected["npz_key"]]
        have = got[(query["key"], tuple(query["global_offset"]))]
        assert have.dtype == want.dtype and have.tobytes() == want.tobytes(), query["key"]
