"""Fuzz the safetensors reader: whatever the bytes, opening a file or a folder of them and
reading every shard either works or raises an AoaError. Any other exception fails the test.

Headers are built from entries whose every field may be wrong (dtype codes, shapes and
offsets of any JSON value, numbers past int64, names with lone surrogates), with metadata
and DCP sharding info of any shape; files are also valid ones with bytes flipped, cut or
inserted. Run many more cases with ``AOA_FUZZ_EXAMPLES`` (tests/fuzzing.py).
"""

from __future__ import annotations

import contextlib
import math
import struct
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from fuzzing import NUMBERS, dumps, fuzz_settings, json_values
from hypothesis import given
from hypothesis import strategies as st

from aoa.dtypes import SAFETENSORS_CODES, itemsize
from aoa.errors import AoaError
from aoa.storage import chunks as chunks_module
from aoa.storage import safetensors as safetensors_module
from aoa.storage import safetensors_folder
from aoa.storage.formats import open_source
from aoa.storage.safetensors import SafetensorsFile

CODES = sorted(SAFETENSORS_CODES)
ANY_JSON = json_values()
NAMES = st.one_of(st.sampled_from(["w", "a", "b.c", "w", "a", "b.c", "__metadata__", "w\ud800",
                                   ""]), st.text(max_size=4))


@st.composite
def entries(draw, offset: int) -> tuple[dict, int]:
    """One header entry starting at data offset ``offset``: right in every field half the
    time, else wrong in any; returns it and the bytes it claims."""
    right = draw(st.booleans())
    code = draw(st.sampled_from(CODES) if right else st.one_of(st.sampled_from(CODES),
                                                                ANY_JSON))
    shape = draw(st.lists(st.integers(0, 4), max_size=3) if right else st.one_of(
        st.lists(st.integers(0, 4), max_size=3), st.lists(NUMBERS, max_size=3), ANY_JSON,
        st.just([0] * 65), st.just([2**40, 2**40, 0])))
    size = 0
    if isinstance(code, str) and code in SAFETENSORS_CODES and isinstance(shape, list) and all(
            type(n) is int and 0 <= n < 64 for n in shape):
        size = math.prod(shape) * itemsize(SAFETENSORS_CODES[code])
    offsets = draw(st.just([offset, offset + size]) if right else st.one_of(
        st.just([offset, offset + size]), st.lists(NUMBERS, min_size=2, max_size=2), ANY_JSON))
    entry = {"dtype": code, "shape": shape, "data_offsets": offsets}
    if not right and draw(st.integers(0, 4)) == 0:
        entry = draw(st.one_of(ANY_JSON, st.dictionaries(st.sampled_from(
            ["dtype", "shape", "data_offsets", "x"]), ANY_JSON, max_size=4)))
    return entry, size


@st.composite
def sharding_info(draw, names: list[str]) -> str:
    """DCP_SHARDING_INFO: offsets per tensor, right or wrong, or any JSON, or not JSON."""
    info = {name: {"saved_offsets": draw(st.one_of(st.lists(st.integers(0, 8), max_size=3),
                                                   st.lists(NUMBERS, max_size=3),
                                                   ANY_JSON))}
            for name in names}
    return draw(st.one_of(st.just(dumps(info)), ANY_JSON.map(dumps),
                          st.sampled_from(["{", "[" * 5000, '{"w": ' + "[" * 100_000])))


@st.composite
def files(draw) -> bytes:
    """The bytes of one file: a header of fuzzed entries, or a valid file mangled."""
    header: dict = {}
    offset = 0
    for name in draw(st.lists(NAMES, max_size=3, unique=True)):
        header[name], size = draw(entries(offset))
        offset += size
    dcp = st.builds(lambda info: {"DCP_SHARDING_INFO": info, "DCP_VERSION": "1.0"},
                    sharding_info([n for n in header if n != "__metadata__"]))
    metadata = draw(st.one_of(st.none(), st.none(), dcp, dcp, ANY_JSON))
    compact = draw(st.booleans())  # as the safetensors library writes it: metadata first
    if metadata is not None:
        header = {"__metadata__": metadata, **header} if compact else {
            **header, "__metadata__": metadata}
    text = dumps(header, compact).encode()
    text += b" " * draw(st.integers(0, 7))
    data_size = offset + draw(st.sampled_from([0, 0, 0, 1, -1]))
    blob = struct.pack("<Q", len(text)) + text + bytes(max(0, data_size))
    if draw(st.integers(0, 3)) == 0:  # mangle: flip, cut or insert bytes
        at = draw(st.integers(0, len(blob)))
        how = draw(st.sampled_from(["flip", "cut", "insert", "length"]))
        if how == "flip" and at < len(blob):
            blob = blob[:at] + bytes([blob[at] ^ draw(st.integers(1, 255))]) + blob[at + 1:]
        elif how == "cut":
            blob = blob[:at]
        elif how == "insert":
            blob = blob[:at] + draw(st.binary(min_size=1, max_size=8)) + blob[at:]
        else:
            blob = struct.pack("<Q", draw(st.one_of(NUMBERS.filter(
                lambda n: 0 <= n < 2**64), st.integers(0, 2**64 - 1)))) + blob[8:]
    return blob


def read_everything(path: Path) -> None:
    """Open ``path`` as a source and read every shard's bytes; open each file and read its
    tensors as arrays."""
    with open_source(path) as source:
        for shards in source.shards.values():
            for shard in shards:
                assert len(source.buffer(shard)) == shard.nbytes
                source.release(shard)
    for file in sorted(path.glob("*.safetensors")) if path.is_dir() else [path]:
        with SafetensorsFile.open(file) as opened:
            for name, info in opened.tensors.items():
                assert opened.array(name).shape == info.shape


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """One folder for all cases (emptied before each): making and removing a folder per
    case costs more than the case."""
    return tmp_path_factory.mktemp("fuzz")


def emptied(folder: Path) -> Path:
    for path in folder.iterdir():
        path.unlink()
    return folder


@fuzz_settings
@given(contents=st.lists(files(), min_size=1, max_size=3))
def test_fuzz_reader_raises_only_aoa_errors(folder, contents):
    emptied(folder)
    for rank, content in enumerate(contents):
        (folder / f"rank-{rank:05d}.safetensors").write_bytes(content)
    for path in (folder, folder / "rank-00000.safetensors"):
        with contextlib.suppress(AoaError):
            read_everything(path)


@contextlib.contextmanager
def entry_by_entry():
    """The readers' bulk checks turned off: every header, sharding info and key checked in
    turn, as they are where the bulk checks doubt."""
    with mock.patch.object(safetensors_module, "_read_well_formed", return_value=None), \
            mock.patch.object(safetensors_folder, "_well_formed_offsets", return_value=None), \
            mock.patch.object(safetensors_folder, "_offsets_in_written_form",
                              return_value=None), \
            mock.patch.object(safetensors_folder, "_shards_in_bulk", return_value=None), \
            mock.patch.object(chunks_module, "_well_typed", return_value=False):
        yield


def outcome(read, path: Path):
    """What ``read(path)`` returns, or the error it raises (its class, message and hint)."""
    try:
        return read(path)
    except AoaError as error:
        return type(error), str(error), error.hint


def opened(path: Path):
    with open_source(path) as source:
        return source.format, source.shards


def header(path: Path):
    with SafetensorsFile.open(path) as file:
        assert list(zip(*file.columns)) == list(file.tensors.values())
        return file.metadata, file.columns, list(file.tensors.items())


@fuzz_settings
@given(contents=st.lists(files(), min_size=1, max_size=3))
def test_fuzz_bulk_checks_read_as_entry_by_entry(folder, contents):
    """A file the bulk checks accept reads as it does entry by entry; one they doubt is
    read entry by entry, so its fault has the same message as ever."""
    emptied(folder)
    for rank, content in enumerate(contents):
        (folder / f"rank-{rank:05d}.safetensors").write_bytes(content)
    for path in [*sorted(folder.iterdir()), folder]:
        read = opened if path.is_dir() else header
        fast = outcome(read, path)
        with entry_by_entry():
            assert outcome(read, path) == fast


@st.composite
def chunk(draw) -> tuple[list[int], list[int], str]:
    """(shape, saved offsets, dtype code) of one chunk: offsets of the shape's rank mostly."""
    shape = draw(st.lists(st.integers(0, 3), max_size=3))
    rank = len(shape) if draw(st.integers(0, 5)) else draw(st.integers(0, 4))
    saved = draw(st.lists(st.one_of(st.integers(0, 6), st.integers(0, 6), NUMBERS),
                          min_size=rank, max_size=rank))
    return shape, saved, draw(st.sampled_from(CODES))


@fuzz_settings
@given(chunks=st.dictionaries(st.sampled_from(["w", "a", "b"]), chunk(), min_size=1,
                              max_size=3),
       ranks=st.integers(1, 3))
def test_fuzz_sharded_folders_raise_only_aoa_errors(folder, chunks, ranks):
    """Well-formed files whose sharding info places chunks anywhere: overlapping, leaving
    gaps, past int64, of different ranks."""
    emptied(folder)
    for rank in range(ranks):
        header: dict = {}
        info = {}
        offset = 0
        for name, (shape, saved, code) in chunks.items():
            size = math.prod(shape) * itemsize(SAFETENSORS_CODES[code])
            header[name] = {"dtype": code, "shape": shape,
                            "data_offsets": [offset, offset + size]}
            info[name] = {"saved_offsets": [n * (rank + 1) for n in saved]}
            offset += size
        header["__metadata__"] = {"DCP_SHARDING_INFO": dumps(info)}
        text = dumps(header).encode()
        (folder / f"rank-{rank:05d}.safetensors").write_bytes(
            struct.pack("<Q", len(text)) + text
            + np.random.default_rng(rank).integers(0, 256, offset, np.uint8).tobytes())
    with contextlib.suppress(AoaError):
        read_everything(folder)
