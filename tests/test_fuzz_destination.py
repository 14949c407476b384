"""Fuzz `aoa convert --destination`: a shard list of the dcp/tp2 fixture's keys, a few of its
values changed (to numbers where bugs live, other types, other keys' shapes), shards
repeated or dropped; written in every sharded format. Whatever the list, the command exits
with an error and leaves nothing, or exits 0 with a checkpoint whose every shard holds the
source's bytes of its box, read back by aoa and, for DCP, loaded by torch.

The hunt this test keeps found a half-covered tensor written with exit 0, an empty chunk
hiding the chunk at its offset when read, and torch failing to load such a DCP output.
"""

from __future__ import annotations

import contextlib
import copy
import io
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from fuzzing import NUMBERS, dumps, fuzz_settings
from hypothesis import given
from hypothesis import strategies as st
from sharding import assemble

from aoa import cli
from aoa.storage.formats import open_source

SOURCE = Path(__file__).parent / "fixtures" / "dcp" / "tp2"
FORMATS = ("dcp-safetensors", "dcp", "paddle", "torch_dist")
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _source() -> tuple[dict[str, list[dict]], dict[str, np.ndarray]]:
    """The fixture's shard list, and each key's whole tensor."""
    with open_source(SOURCE) as source:
        return ({key: [shard.to_json() for shard in shards]
                 for key, shards in source.shards.items()},
                {key: assemble(source, key) for key in source.shards})


def _box(shard) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(shard.global_offset, shard.local_shape))


LISTING, WHOLE = _source()
VALUES = st.one_of(NUMBERS, st.sampled_from([None, "x", "float32", "bfloat16", [], [0], True,
                                             [4, 4], [2, 8], [0, 4], [3, 0], [6, 4]]))


@st.composite
def shard_lists(draw) -> dict:
    """The fixture's list with one to three changes."""
    listing = copy.deepcopy(LISTING)
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from(sorted(listing)))
        shards = listing[key]
        change = draw(st.sampled_from(["field", "axis", "repeat", "drop"]))
        if change == "repeat" or not shards:
            shards.append(copy.deepcopy(draw(st.sampled_from(LISTING[key]))))
        elif change == "drop":
            shards.pop(draw(st.integers(0, len(shards) - 1)))
        else:
            shard = shards[draw(st.integers(0, len(shards) - 1))]
            field = draw(st.sampled_from(sorted(shard)))
            value = shard[field]
            if change == "axis" and isinstance(value, list) and value:
                value[draw(st.integers(0, len(value) - 1))] = draw(st.integers(0, 9))
            else:
                shard[field] = draw(VALUES)
    return listing


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz-destination")


def _torch_loads_the_source_bytes(output: Path) -> None:
    with open_source(output) as written:
        specs = {key: shards[0] for key, shards in written.shards.items()}
    state = {key: torch.zeros(spec.global_shape, dtype=TORCH_DTYPES[spec.dtype])
             for key, spec in specs.items()}
    dcp.load(state, checkpoint_id=str(output))
    for key, tensor in state.items():
        loaded = tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor
        assert loaded.numpy().tobytes() == WHOLE[key].tobytes(), key


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process loads
@fuzz_settings
@given(shard_lists(), st.sampled_from(FORMATS))
def test_fuzz_destination_gives_the_source_s_bytes_or_an_error(folder, listing, format):
    (folder / "identity.aoa").write_text("# every key as it is\n")
    (folder / "destination.json").write_text(dumps(listing))
    output = folder / "out"
    shutil.rmtree(output, ignore_errors=True)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        status = cli.main(["convert", str(folder / "identity.aoa"), "--source", str(SOURCE),
                           "--destination", str(folder / "destination.json"), "--output",
                           str(output), "--output-format", format, "--quiet"])
    if status != cli.EXIT_OK:
        assert status in (cli.EXIT_ERRORS, cli.EXIT_USAGE)
        assert not output.exists() or not any(output.iterdir())
        return
    with open_source(output) as written:
        for key, shards in written.shards.items():
            for shard in shards:
                assert bytes(written.buffer(shard)) == WHOLE[key][_box(shard)].tobytes(), shard
    if format == "dcp":
        _torch_loads_the_source_bytes(output)
