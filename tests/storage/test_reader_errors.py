"""Headers and sharding info that used to end in a raw Python error: each a StorageError
naming the file and what is wrong, before anything is read from the data section."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors_files import dcp_file, hf_index, save

from aoa.errors import StorageError
from aoa.storage.formats import open_source
from aoa.storage.safetensors import SafetensorsFile

DEEP = 100_000


def raw_file(path: Path, header: bytes | dict, data: bytes = b"") -> Path:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


def refusal(call, *args) -> str:
    with pytest.raises(StorageError) as caught:
        call(*args)
    return caught.value.message


def test_a_dtype_that_is_a_list(tmp_path):
    path = raw_file(tmp_path / "a.safetensors",
                    {"w": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}}, bytes(4))
    assert refusal(SafetensorsFile.open, path).startswith(
        f"{path}: tensor 'w': unknown dtype ['F32'] (known: F64 F32 ")


def test_a_header_nested_100000_deep(tmp_path):
    path = raw_file(tmp_path / "a.safetensors", b'{"w":' + b"[" * DEEP + b"]" * DEEP + b"}")
    assert refusal(SafetensorsFile.open, path) == (
        f"{path}: header: not valid JSON: nested too deeply")


def test_sharding_info_nested_100000_deep(tmp_path):
    path = save(tmp_path / "a.safetensors", {"w": np.zeros(2, np.float32)},
                {"DCP_SHARDING_INFO": '{"w": ' + "[" * DEEP + "]" * DEEP + "}"})
    assert refusal(open_source, tmp_path) == (
        f"{path}: DCP_SHARDING_INFO: not valid JSON: nested too deeply")


@pytest.mark.parametrize(("offset", "shown"), [
    (2**64, "[18446744073709551618]"),
    (2**63 - 1, "[9223372036854775809]"),  # offset + 2 rows: past int64
    (2**61, "[2305843009213693954]"),  # fits int64, but not 4 bytes each
])
def test_saved_offsets_past_int64(tmp_path, offset, shown):
    dcp_file(tmp_path / "a.safetensors", {"w": (np.zeros(2, np.float32), [offset])})
    assert refusal(open_source, tmp_path) == (
        f"tensor 'w': its global shape {shown} would hold more than 9223372036854775807 bytes "
        f"(2**63 - 1); files: {tmp_path / 'a.safetensors'}")


def test_a_zero_size_chunk_far_out_holds_no_huge_tensor(tmp_path):
    dcp_file(tmp_path / "a.safetensors", {"w": (np.zeros((0, 3), np.float32), [2**64, 0])})
    assert refusal(open_source, tmp_path).startswith(
        "tensor 'w': its global shape [18446744073709551616, 3] would hold more than")


def test_a_tensor_name_with_a_lone_surrogate(tmp_path):
    path = raw_file(tmp_path / "a.safetensors",
                    b'{"w\\ud800": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}',
                    bytes(4))
    assert refusal(SafetensorsFile.open, path) == (
        f"{path}: header: a string holds an escaped lone surrogate (such as \\ud800), which is "
        "not Unicode text")


@pytest.mark.parametrize(("shape", "problem"), [
    ([2**40, 2**40, 0], "would hold more than 9223372036854775807 bytes (2**63 - 1)"),
    ([0] * 65, "has 65 axes, more than 64"),
])
def test_zero_size_tensors_of_huge_or_too_many_axes(tmp_path, shape, problem):
    path = raw_file(tmp_path / "a.safetensors",
                    {"w": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}})
    message = refusal(SafetensorsFile.open, path)
    assert message.startswith(f"{path}: tensor 'w': shape [") and message.endswith(problem)
    with pytest.raises(Exception), safe_open(str(path), "numpy") as reference:  # noqa: B017
        reference.get_tensor("w")  # the reference cannot read it either


def test_the_largest_zero_size_tensor_allowed_reads_as_the_reference_reads_it(tmp_path):
    path = raw_file(tmp_path / "a.safetensors",
                    {"w": {"dtype": "F32", "shape": [2**30, 2**30, 0], "data_offsets": [0, 0]}})
    with SafetensorsFile.open(path) as file:
        assert file.array("w").shape == (2**30, 2**30, 0)
    with safe_open(str(path), "numpy") as reference:
        assert reference.get_tensor("w").shape == (2**30, 2**30, 0)


@pytest.mark.parametrize(("zip_format", "looks_like"), [
    (True, "it is a zip archive (a PyTorch .bin or .pt file?)"),
    (False, "it is a Python pickle (a PyTorch .bin file of an old format?)"),
])
def test_a_torch_bin_file_is_named_for_what_it_is(tmp_path, zip_format, looks_like):
    path = tmp_path / "pytorch_model.bin"
    torch.save({"w": torch.zeros(2)}, path, _use_new_zipfile_serialization=zip_format)
    assert refusal(SafetensorsFile.open, path) == f"{path}: not a safetensors file: {looks_like}"


def test_an_index_given_as_a_file_is_json_not_safetensors(tmp_path):
    hf_index(tmp_path, {"w": "model.safetensors"})
    path = tmp_path / "model.safetensors.index.json"
    assert refusal(SafetensorsFile.open, path) == (
        f"{path}: not a safetensors file: it is JSON text (an index? give the checkpoint's "
        "folder)")


def test_an_index_given_as_the_source_opens_its_folder(tmp_path):
    save(tmp_path / "model-00001-of-00001.safetensors", {"w": np.ones(3, np.float32)})
    hf_index(tmp_path, {"w": "model-00001-of-00001.safetensors"})
    with open_source(tmp_path / "model.safetensors.index.json") as source:
        assert [(s.key, s.global_shape) for s in source.shards["w"]] == [("w", (3,))]
        assert bytes(source.buffer(source.shards["w"][0])) == np.ones(3, np.float32).tobytes()


def test_any_other_file_says_what_its_length_claims(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_bytes(b"hello, world, this is text")
    assert refusal(SafetensorsFile.open, path) == (
        f"{path}: not a safetensors file: its first 8 bytes, read as the header length, say "
        f"{int.from_bytes(b'hello, w', 'little')} bytes, and no JSON header follows (it starts "
        "b'hello, world, th')")
