"""`aoa.storage.layout_aside`: rank 0's file laid out by a grandchild of the `--destination`
reader is the file laid out here, byte for byte; it is taken only for the conversion of that
listing as given, and anything else lays the file out here as before."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors_files import save

from aoa import cli
from aoa.jobs.convert import ranks_of_listing
from aoa.layout import ShardDesc
from aoa.storage import layout_aside
from aoa.storage.dcp_safetensors import DcpSafetensorsDestination
from aoa.storage.layout_aside import LayoutAside, _rank_zero_layout


def _listing(counts: list[int], dtypes: list[str | None]) -> dict[str, list[ShardDesc]]:
    """Key k split in ``counts[k]`` rows along its first axis."""
    return {f"layers.{k}.w": [ShardDesc(f"layers.{k}.w", (2, 3), (2 * count, 3), (2 * i, 0),
                                        dtypes[k % len(dtypes)]) for i in range(count)]
            for k, count in enumerate(counts)}


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=12),
       st.lists(st.sampled_from(["bfloat16", "float32", None]), min_size=1, max_size=3))
def test_the_grandchilds_layout_is_rank_zeros_laid_out_here(counts: list[int],
                                                            dtypes: list[str | None]) -> None:
    listing = _listing(counts, dtypes)
    shards = list(itertools.chain.from_iterable(listing.values()))
    files = DcpSafetensorsDestination.plan_files(shards, ranks_of_listing(counts))
    rows = (list(listing), [[(s.local_shape, s.global_shape, s.global_offset, s.dtype)
                             for s in key_shards] for key_shards in listing.values()])
    if not files:
        return  # no shards, no file
    file, layout = _rank_zero_layout(rows)
    here = DcpSafetensorsDestination("/elsewhere", shards, files).layout(files[0])
    assert file == files[0]
    assert (layout.size, layout.fixed) == (here.size, here.fixed)
    assert all(np.array_equal(a, b) for a, b in zip(layout.shards.columns,  # type: ignore[attr-defined]
                                                    here.shards.columns))  # type: ignore[attr-defined]


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    """A source of 300 keys, a mapping renaming them, and a TP2 destination list over
    1 MB (read aside)."""
    rng = np.random.default_rng(0)
    keys = [f"layers.{k}.w" for k in range(300)]
    save(tmp_path / "model.safetensors",
         {key: rng.standard_normal((8, 6)).astype(np.float32) for key in keys})
    (tmp_path / "map.aoa").write_text("layers.$LAYER_ID.w -> out.$LAYER_ID.w\n")
    listing = {f"out.{k}.w": [{"key": f"out.{k}.w", "local_shape": [4, 6],
                               "global_shape": [8, 6], "global_offset": [4 * i, 0],
                               "dtype": "float32"} for i in range(2)] for k in range(300)}
    (tmp_path / "d.json").write_text(json.dumps(listing))
    return tmp_path


def _convert(folder: Path, output: str, *extra: str) -> dict[str, bytes]:
    assert cli.main(["convert", str(folder / "map.aoa"), "--source",
                     str(folder / "model.safetensors"), "--destination", str(folder / "d.json"),
                     "--output", str(folder / output), "--quiet", *extra]) == cli.EXIT_OK
    return {path.name: path.read_bytes() for path in sorted((folder / output).iterdir())}


@pytest.fixture
def laid_out_here(monkeypatch) -> list[str]:
    """The files laid out in this process, by name, with every listing read aside (the
    layout waited for)."""
    monkeypatch.setattr("aoa.forked.WORTH_A_CHILD_BYTES", 0)
    # a thread another test left (tqdm's monitor) would keep aoa from forking: the children
    # here run only aoa's code
    monkeypatch.setattr("aoa.forked.threading", SimpleNamespace(active_count=lambda: 1))
    monkeypatch.setattr(layout_aside, "WORTH_A_GRANDCHILD_SHARDS", 1)
    ready = LayoutAside.ready
    monkeypatch.setattr(LayoutAside, "ready", lambda self, seconds: ready(self, 30))
    names: list[str] = []
    layout = DcpSafetensorsDestination.layout
    monkeypatch.setattr(DcpSafetensorsDestination, "layout",
                        lambda self, file: names.append(file.filename) or layout(self, file))
    return names


def test_a_conversion_takes_rank_zeros_layout_from_aside(checkpoint: Path, laid_out_here,
                                                         monkeypatch) -> None:
    aside = _convert(checkpoint, "aside")
    assert laid_out_here == ["rank-00001-of-00002.safetensors"]
    monkeypatch.setattr(layout_aside, "WORTH_A_GRANDCHILD_SHARDS", 10**9)
    assert _convert(checkpoint, "here") == aside
    assert laid_out_here[1:] == ["rank-00000-of-00002.safetensors",
                                 "rank-00001-of-00002.safetensors"]
    assert LayoutAside.pending is None


def test_another_format_lays_its_files_out_itself(checkpoint: Path, laid_out_here) -> None:
    written = _convert(checkpoint, "dcp", "--output-format", "dcp")
    assert laid_out_here == [] and ".metadata" in written
    assert LayoutAside.pending is None


def test_a_layout_is_taken_only_for_the_listings_shards(checkpoint: Path, laid_out_here
                                                        ) -> None:
    from aoa.mapping import shard_info_read_aside

    for other in (False, True):
        with shard_info_read_aside(checkpoint / "d.json", "destination") as result:
            listing = result()
        aside = LayoutAside.pending
        assert listing is not None and aside is not None and aside.listing is listing
        shards = list(itertools.chain.from_iterable(listing.values()))
        files = DcpSafetensorsDestination.plan_files(shards, ranks_of_listing([2] * 300))
        if other:
            shards[5] = ShardDesc("out.2.w", (4, 6), (8, 6), (0, 0), "bfloat16")
        layout = aside.take(shards, files[0])
        assert LayoutAside.pending is None
        if other:
            assert layout is None
        else:
            here = DcpSafetensorsDestination("/x", shards, files).layout(files[0])
            assert layout is not None and layout.fixed == here.fixed


def test_the_commands_output_ends_with_it_not_with_the_grandchild(checkpoint: Path) -> None:
    """A grandchild still at work (here: for 20 s) holds none of the command's
    descriptors: whoever reads its output is not kept waiting."""
    script = f"""
import time
import aoa.forked
from aoa import cli
from aoa.storage import layout_aside
aoa.forked.WORTH_A_CHILD_BYTES = 0
layout_aside.WORTH_A_GRANDCHILD_SHARDS = 1
layout_aside._rank_zero_layout = lambda rows: time.sleep(20)
raise SystemExit(cli.main(["convert", {str(checkpoint / "map.aoa")!r}, "--source",
                           {str(checkpoint / "model.safetensors")!r}, "--destination",
                           {str(checkpoint / "d.json")!r}, "--output",
                           {str(checkpoint / "out")!r}]))
"""
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=40,
                          check=True)
    assert time.monotonic() - start < 15
    assert b"wrote 2 files" in done.stdout
