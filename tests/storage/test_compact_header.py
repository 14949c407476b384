"""The compact-form header reader: what the safetensors library writes is read without a
JSON parser, exactly as the parser reads it; any other text is left to the parser."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from unittest import mock

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

from aoa import _core
from aoa.errors import StorageError
from aoa.storage import safetensors as safetensors_module
from aoa.storage.compact_header import read_compact_header, read_saved_offsets
from aoa.storage.safetensors import SafetensorsFile


def header_text(path: Path) -> str:
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    return data[8 : 8 + length].decode()


def read(path: Path, compact: bool = True):
    """Metadata and columns of ``path``, or the error it raises; ``compact``: False reads
    the header with the JSON parser only."""
    reader = read_compact_header if compact else (lambda text: None)
    with mock.patch.object(safetensors_module, "read_compact_header", reader):
        try:
            with SafetensorsFile.open(path) as file:
                return file.metadata, file.columns
        except StorageError as error:
            return str(error)


def test_reference_writer_header_reads_as_the_json_parser_reads_it(tmp_path: Path) -> None:
    arrays = {
        "model.layers.0.w": np.arange(12, dtype=np.float32).reshape(3, 4),
        "b": np.arange(5, dtype=np.int64),
        "ünï c": np.ones((2, 2), dtype=ml_dtypes.bfloat16),
        "d": np.zeros((0, 3), dtype=np.float16),
        "e": np.array(True),
    }
    path = tmp_path / "ref.safetensors"
    save_file(arrays, path, metadata={"DCP_SHARDING_INFO": json.dumps({"b": [0]}),
                                      "note": "ünïcode \"quoted\" \\ \t"})
    assert read_compact_header(header_text(path)) is not None
    assert read(path) == read(path, compact=False)
    assert read(path)[0]["note"] == "ünïcode \"quoted\" \\ \t"


def write(path: Path, text: str, data_bytes: int) -> Path:
    path.write_bytes(struct.pack("<Q", len(text.encode())) + text.encode()
                     + bytes(data_bytes))
    return path


ENTRY = '"{}":{{"dtype":"F32","shape":[{}],"data_offsets":[{},{}]}}'


@pytest.mark.parametrize("text", [
    '{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}, "b":'
    '{"dtype":"F32","shape":[2],"data_offsets":[8,16]}}',  # a space
    '{"a\\u0062":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}',  # an escape
    '{"a":{"dtype":"F32","shape":[02],"data_offsets":[0,8]}}',  # a leading zero
    '{"a":{"dtype":"F32","shape":[2],"data_offsets":[00,8]}}',
    '{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,08]}}',
    '{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}' + " " * 70,  # long padding
    '{"a":{"dtype":"F32","shape":[2,],"data_offsets":[0,8]}}',
    '{"a":{"shape":[2],"dtype":"F32","data_offsets":[0,8]}}',  # another field order
    '{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}"b":'
    '{"dtype":"F32","shape":[2],"data_offsets":[8,16]}}',  # no comma
    '{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"a":'
    '{"dtype":"F32","shape":[2],"data_offsets":[8,16]}}',  # a name twice
    '{"a\x01":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}',  # a control character
    '{"__metadata__":{},"__metadata__":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}',
    '{"__metadata__":{"x":1},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}',
    '{"__metadata__":{"x":"y","x":"z"},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}',
    '{"__metadata__":{"x":"\\ud800"},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}',
    '{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"__metadata__":{}}',
    ' {"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}',
    '{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}x',
    '{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},}',
    '{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,' + "9" * 5000 + ']}}',
    '{}',
])
def test_other_forms_are_left_to_the_json_parser(tmp_path: Path, text: str) -> None:
    assert read_compact_header(text) is None
    path = write(tmp_path / "x.safetensors", text, 16)
    assert read(path) == read(path, compact=False)


@pytest.mark.parametrize("entries, data_bytes, refused", [
    ([("a", "2", 0, 8), ("b", "2", 8, 16)], 16, False),
    ([("a", "2", 8, 16), ("b", "2", 0, 8)], 16, False),  # listed out of byte order
    ([("a", "2", 0, 8), ("b", "2", 4, 12)], 16, True),  # overlapping
    ([("a", "2", 0, 8), ("b", "2", 12, 20)], 20, True),  # a gap
    ([("a", "3", 0, 8), ("b", "2", 8, 16)], 16, True),  # a range shorter than its shape
    ([("a", "2", 0, 8), ("b", "2", 8, 16)], 24, True),  # bytes after the last tensor
    ([("a", "2", 0, 8), ("b", "2", 8, 16)], 8, True),  # past the end of the file
    ([("a", "", 0, 4), ("b", "0,9223372036854775807,2", 4, 4)], 4, True),  # past int64
])
def test_lying_headers_in_the_compact_form_are_refused_as_ever(
        tmp_path: Path, entries: list[tuple[str, str, int, int]], data_bytes: int,
        refused: bool) -> None:
    text = "{" + ",".join(ENTRY.format(*entry) for entry in entries) + "}"
    assert read_compact_header(text) is not None
    path = write(tmp_path / "x.safetensors", text, data_bytes)
    assert read(path) == read(path, compact=False)
    assert isinstance(read(path), str) == refused


def test_sharding_info_as_json_dumps_writes_it_reads_as_the_parser_reads_it() -> None:
    info = {"a.w": {"saved_offsets": [0, 64]}, "b": {"saved_offsets": []},
            "c": {"saved_offsets": [12345678901234567890]}}
    keys, saved = read_saved_offsets(json.dumps(info))  # type: ignore[misc]
    assert dict(zip(keys, map(list, saved))) == {
        key: entry["saved_offsets"] for key, entry in info.items()}


def test_sharding_info_listing_the_header_names_reads_the_same() -> None:
    text = '{"a": {"saved_offsets": [0, 64]}, "b": {"saved_offsets": [8]}}'
    assert read_saved_offsets(text, ["a", "b"]) == read_saved_offsets(text) == (
        ["a", "b"], [(0, 64), (8,)])
    twice = '{"a": {"saved_offsets": [0]}, "a": {"saved_offsets": [8]}}'
    assert read_saved_offsets(twice, ["a", "b"]) is None


@pytest.mark.parametrize("names", [
    ["a", "b"], ["b", "a"],  # the header's order, or another
    ["a[0]", "b"], ["a[x]", "b"], ["a, b", "c"], ["ü", "b"],  # brackets, commas, non-ASCII
])
def test_sharding_info_read_by_the_header_names_reads_as_the_parser_reads_it(
        names: list[str]) -> None:
    info = {name: {"saved_offsets": [offset, 64]} for offset, name in enumerate(names)}
    text = json.dumps(info, ensure_ascii=False)
    keys, saved = read_saved_offsets(text, names)  # type: ignore[misc]
    assert keys == names and dict(zip(keys, map(list, saved))) == {
        key: entry["saved_offsets"] for key, entry in info.items()}
    assert read_saved_offsets(text, sorted(names, reverse=True)) == (keys, saved)


@pytest.mark.parametrize("text, names", [
    # a name holding quotes would stand for other keys (the parser finds "k" and "z")
    ('{"k": 1, "z": {"saved_offsets": [0]}}', ['k": 1, "z']),
    ('{"a": {"saved_offsets": [0]}, "b": {"saved_offsets": [0]}}',
     ['a": {"saved_offsets": [0]}, "b']),
    ('{"a\x01": {"saved_offsets": [0]}}', ["a\x01"]),  # a control character
    ('{"a": {"saved_offsets": [0]}, "b": {"saved_offsets": [0]}}', ["a"]),  # more keys
    ('{"a": {"saved_offsets": [0]}}', ["a", "b"]),  # fewer
    ('{"a": {"saved_offsets": [0,1]}}', ["a"]),  # other spacing
    ('{"a": {"saved_offsets": [01]}}', ["a"]),  # a leading zero
])
def test_sharding_info_not_listing_the_header_names_as_written_reads_as_without_them(
        text: str, names: list[str]) -> None:
    assert read_saved_offsets(text, names) == read_saved_offsets(text)


@pytest.mark.parametrize("text", [
    '{"a": {"saved_offsets": [0, 1]}, "a": {"saved_offsets": [0, 2]}}',  # a key twice
    '{"a": {"saved_offsets": [0,1]}}',  # other spacing
    '{"a": {"saved_offsets": [0,  1]}}',
    '{"a": {"saved_offsets": [01]}}',  # a leading zero
    '{"a": {"saved_offsets": [0, ]}}',
    '{"a\\u0062": {"saved_offsets": [0]}}',  # an escape
    '{"a\x01": {"saved_offsets": [0]}}',  # a control character
    '{"a": {"saved_offsets": [0]}}, "b": {"saved_offsets": [0]}}',
    '{"a": {"saved_offsets": [0]} "b": {"saved_offsets": [0]}}',  # no comma
    '{"a": {"saved_offsets": [0]},"b": {"saved_offsets": [0]}}',
    '{"a": {"saved_offsets": [0], "x": 1}}',
    '{"a": {"saved_offsets": [' + "9" * 5000 + ']}}',
    '{}', ' {"a": {"saved_offsets": [0]}}',
])
def test_other_sharding_info_is_left_to_the_json_parser(text: str) -> None:
    assert read_saved_offsets(text) is None


# ------------------------------------------- the native pass against the regular expressions

def python_only(read, *args):
    """``read(*args)`` with the native passes off: the regular expressions read it all."""
    with mock.patch.object(_core, "compact_entries", lambda *a: None), \
            mock.patch.object(_core, "saved_offsets_of", lambda *a: None):
        return read(*args)


NAMES = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=8)
ODD_NAMES = st.one_of(NAMES, st.text(max_size=4))  # control, non-ASCII characters too
NUMBERS = st.one_of(st.integers(0, 300), st.integers(0, 2**64))  # past int64 too
#: What a mutation puts into a text: the form's own characters, mostly.
MUTATIONS = st.sampled_from(list('{}[],:" 0123456789\\ax\x01é'))


@st.composite
def mutated(draw, text: str) -> str:
    """``text``, or it with one character put in, taken out or replaced."""
    if not text or draw(st.booleans()):
        return text
    at = draw(st.integers(0, len(text) - 1))
    what = draw(st.sampled_from(["insert", "delete", "replace"]))
    if what == "delete":
        return text[:at] + text[at + 1:]
    return text[:at] + draw(MUTATIONS) + text[at + (what == "replace"):]


@st.composite
def compact_headers(draw) -> str:
    entries = draw(st.lists(st.tuples(ODD_NAMES, st.sampled_from(["F32", "BF16", "X"]),
                                      st.lists(NUMBERS, max_size=3), NUMBERS, NUMBERS),
                            max_size=5))
    body = ",".join(
        f'"{name}":{{"dtype":"{code}","shape":[{",".join(map(str, shape))}],'
        f'"data_offsets":[{begin},{end}]}}' for name, code, shape, begin, end in entries)
    metadata = '"__metadata__":{"k":"v"}' + ("," if body else "")
    return draw(mutated("{" + (metadata if draw(st.booleans()) else "") + body + "}"))


@settings(max_examples=300, deadline=None)
@given(text=compact_headers())
def test_the_native_pass_reads_headers_as_the_regular_expressions_do(text: str) -> None:
    """Whatever the text (names with the form's own characters, numbers past int64, one
    character put in, taken out or replaced anywhere), the header reads the same with the
    native pass as with the regular expressions alone."""
    assert read_compact_header(text) == python_only(read_compact_header, text)


def test_the_native_pass_reads_a_plain_header_and_leaves_what_passes_int64() -> None:
    text = ('{"a.w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},'
            '"b":{"dtype":"BF16","shape":[],"data_offsets":[24,26]}}')
    assert _core.compact_entries(text, 1, len(text) - 1) == (
        ["a.w", "b"], ["F32", "BF16"], [(2, 3), ()], [0, 24], [24, 26])
    assert read_compact_header(text) == ({}, ["a.w", "b"], ["F32", "BF16"], [(2, 3), ()],
                                         [0, 24], [24, 26])
    big = text.replace("[24,26]", f"[24,{2**63}]")
    assert _core.compact_entries(big, 1, len(big) - 1) is None
    assert read_compact_header(big)[-1] == [24, 2**63]  # type: ignore[index]
    for start, end in [(-1, 5), (5, 4), (0, len(text) + 1)]:  # never past the text
        assert _core.compact_entries(text, start, end) is None


@settings(max_examples=300, deadline=None)
@given(data=st.data(), names=st.lists(ODD_NAMES, min_size=1, max_size=5, unique=True),
       ascii_only=st.booleans())
def test_the_native_pass_reads_sharding_info_as_the_regular_expressions_do(
        data, names: list[str], ascii_only: bool) -> None:
    """Sharding info as json.dumps writes it (mutated or not), read by the header's names or
    names that differ from its keys: the same with the native pass as without."""
    offsets = data.draw(st.lists(st.lists(NUMBERS, max_size=3), min_size=len(names),
                                 max_size=len(names)))
    text = data.draw(mutated(json.dumps(
        {name: {"saved_offsets": box} for name, box in zip(names, offsets)},
        ensure_ascii=ascii_only)))
    asked = data.draw(st.sampled_from([names, names[::-1], names[1:], names[:-1],
                                       [*names, "z"]]))
    assert read_saved_offsets(text, asked) == python_only(read_saved_offsets, text, asked)


def test_the_native_pass_reads_plain_sharding_info() -> None:
    text = '{"a": {"saved_offsets": [0, 64]}, "b": {"saved_offsets": []}}'
    assert _core.saved_offsets_of(text, ["a", "b"]) == [(0, 64), ()]
    for names in (["b", "a"], ["a"], [], ['a"'], ["ü", "b"]):
        assert _core.saved_offsets_of(text, names) is None
    assert _core.saved_offsets_of(text.replace("64", str(2**63)), ["a", "b"]) is None
    more = '{"a": {"saved_offsets": [0]}}, "b": {"saved_offsets": [0]}}'  # after the end
    assert _core.saved_offsets_of(more, ["a"]) is None
