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
from safetensors.numpy import save_file

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
