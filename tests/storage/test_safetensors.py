"""The safetensors reader and writer, checked against the reference implementation."""

from __future__ import annotations

import itertools
import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import safetensors
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from aoa import _core
from aoa.dtypes import ITEMSIZES, NUMPY_DTYPES, SAFETENSORS_CODES
from aoa.errors import StorageError
from aoa.layout import ShardDesc, shards_nbytes
from aoa.storage.dcp_safetensors import DcpSafetensorsDestination, sharding_info
from aoa.storage.formats import ShardSpan
from aoa.storage.safetensors import (
    MAX_HEADER_BYTES,
    SafetensorsFile,
    SafetensorsWriter,
    header_bytes,
    header_texts,
    write_safetensors,
)


def sample(dtype: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Arbitrary bytes of the right size, viewed as ``dtype`` (every bit pattern is valid)."""
    numpy_dtype = NUMPY_DTYPES[dtype]
    count = int(np.prod(shape, dtype=np.int64))
    raw = np.random.default_rng(seed).integers(0, 256, count * numpy_dtype.itemsize, np.uint8)
    if dtype == "bool":
        raw = raw % 2
    return raw.view(numpy_dtype).reshape(shape)


def write_arrays(path: Path, arrays: dict[str, np.ndarray], metadata=None) -> Path:
    """Write ``arrays`` with aoa, each filled by a plain byte copy."""
    specs = [ShardDesc.full(name, a.shape, str_dtype(a)) for name, a in arrays.items()]

    def fill(views: dict[str, memoryview]) -> None:
        for name, view in views.items():
            view[:] = arrays[name].tobytes()

    return write_safetensors(path, specs, metadata, fill)


def reference_read(path: Path) -> dict[str, tuple[str, list[int], bytes]]:
    """What the reference parser finds in ``path``: code, shape and bytes by name (its numpy
    loader has no fp8, so this goes through the format-level ``deserialize``)."""
    return {
        name: (info["dtype"], info["shape"], bytes(info["data"]))
        for name, info in safetensors.deserialize(path.read_bytes())
    }


def str_dtype(array: np.ndarray) -> str:
    return next(name for name, dtype in NUMPY_DTYPES.items() if dtype == array.dtype)


def raw_file(path: Path, header: Any, data: bytes = b"", length: int | None = None) -> Path:
    """A safetensors file with any header at all, for headers no writer would produce."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text) if length is None else length) + text + data)
    return path


def entry(code: str, shape: list[int], begin: int, end: int) -> dict[str, Any]:
    return {"dtype": code, "shape": shape, "data_offsets": [begin, end]}


def message(path: Path) -> str:
    with pytest.raises(StorageError) as caught:
        SafetensorsFile.open(path)
    return caught.value.message


# ------------------------------------------------------------------------------ round trips


ALL_DTYPES = list(SAFETENSORS_CODES.values())


def test_written_file_reads_back_in_safetensors_byte_identical(tmp_path: Path) -> None:
    arrays = {f"t.{dtype}": sample(dtype, (3, 5), seed=i) for i, dtype in enumerate(ALL_DTYPES)}
    arrays["scalar"] = sample("float32", ())
    arrays["empty"] = sample("bfloat16", (0, 4))
    path = write_arrays(tmp_path / "model.safetensors", arrays, {"format": "pt"})

    codes = {name: code for code, name in SAFETENSORS_CODES.items()}
    assert reference_read(path) == {
        name: (codes[str_dtype(a)], list(a.shape), a.tobytes()) for name, a in arrays.items()
    }
    with safe_open(path, framework="numpy") as file:
        assert file.metadata() == {"format": "pt"}


def test_written_file_loads_with_safetensors_numpy(tmp_path: Path) -> None:
    arrays = {
        "w": sample("float32", (4, 3)),
        "b": sample("bfloat16", (7,)),
        "i": sample("int64", (2, 2)),
        "m": sample("bool", (5,)),
        "h": sample("float16", ()),
    }
    loaded = load_file(write_arrays(tmp_path / "model.safetensors", arrays))
    assert set(loaded) == set(arrays)
    for name, array in arrays.items():
        assert loaded[name].dtype == array.dtype and loaded[name].shape == array.shape
        assert loaded[name].tobytes() == array.tobytes()


def test_reader_reads_fp8_of_the_reference_writer(tmp_path: Path) -> None:
    arrays = {"e4m3": sample("float8_e4m3fn", (2, 3)), "e5m2": sample("float8_e5m2", (4,))}
    specs = {
        name: safetensors.TensorSpec(
            dtype=str_dtype(a), shape=list(a.shape), data_ptr=a.ctypes.data, data_len=a.nbytes
        )
        for name, a in arrays.items()
    }
    path = tmp_path / "fp8.safetensors"
    path.write_bytes(safetensors.serialize(specs))
    with SafetensorsFile.open(path) as file:
        for name, array in arrays.items():
            assert file.tensors[name].dtype == str_dtype(array)
            assert file.array(name).dtype == array.dtype
            assert file.array(name).tobytes() == array.tobytes()


def test_header_is_padded_with_spaces_to_eight_bytes(tmp_path: Path) -> None:
    path = write_arrays(tmp_path / "a.safetensors", {"w": sample("float16", (3,))})
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = raw[8 : 8 + length]
    compact = b'{"w":{"dtype":"F16","shape":[3],"data_offsets":[0,6]}}'
    assert header == compact + b" " * (-len(compact) % 8)
    assert length % 8 == 0
    assert len(raw) == 8 + length + 6


def test_tensors_are_stored_in_the_given_order(tmp_path: Path) -> None:
    arrays = {"z": sample("int8", (2,)), "a": sample("int8", (3,)), "m": sample("int8", (1,))}
    with SafetensorsFile.open(write_arrays(tmp_path / "a.safetensors", arrays)) as file:
        assert list(file.tensors) == ["z", "a", "m"]
        assert [info.offset for info in file.tensors.values()] == [
            file.tensors["z"].offset + n for n in (0, 2, 5)
        ]


def test_reader_reads_files_of_the_reference_writer(tmp_path: Path) -> None:
    arrays = {
        "a": np.arange(12, dtype=np.float32).reshape(3, 4),
        "b": np.arange(5, dtype=np.int64),
        "c": np.ones((2, 2), dtype=ml_dtypes.bfloat16),
        "d": np.zeros((0,), dtype=np.float16),
        "e": np.array(True),
    }
    path = tmp_path / "ref.safetensors"
    save_file(arrays, path, metadata={"format": "np", "note": "ünïcode"})
    with SafetensorsFile.open(path) as file:
        assert file.metadata == {"format": "np", "note": "ünïcode"}
        assert set(file.tensors) == set(arrays)
        for name, array in arrays.items():
            info = file.tensors[name]
            assert (info.name, info.shape, info.nbytes) == (name, array.shape, array.nbytes)
            assert bytes(file.buffer(name)) == array.tobytes()
            assert file.array(name).dtype == array.dtype
            np.testing.assert_array_equal(file.array(name), array)
        assert file.tensors["c"].dtype == "bfloat16"
        assert path.read_bytes()[file.tensors["b"].offset :][:40] == arrays["b"].tobytes()


def test_buffers_are_read_only_views_of_the_mapping(tmp_path: Path) -> None:
    path = write_arrays(tmp_path / "a.safetensors", {"w": sample("float8_e4m3fn", (4, 4))})
    file = SafetensorsFile.open(path)
    view = file.buffer("w")
    array = file.array("w")
    assert view.readonly and not array.flags.writeable
    assert array.dtype == np.dtype(ml_dtypes.float8_e4m3fn)
    assert np.shares_memory(array, np.frombuffer(file.buffer("w"), np.uint8))
    file.close()  # views still alive: the mapping outlives close until they go
    assert bytes(view) == array.tobytes()
    with pytest.raises(StorageError, match="closed"):
        file.buffer("w")


def test_file_with_no_tensors(tmp_path: Path) -> None:
    path = write_safetensors(tmp_path / "empty.safetensors", [], None, lambda views: None)
    assert reference_read(path) == {} and load_file(path) == {}
    with SafetensorsFile.open(path) as file:
        assert file.tensors == {} and file.metadata == {}


def test_file_of_only_zero_size_tensors(tmp_path: Path) -> None:
    arrays = {"a": sample("float32", (0,)), "b": sample("int64", (3, 0, 2))}
    path = write_arrays(tmp_path / "z.safetensors", arrays)
    assert reference_read(path) == {"a": ("F32", [0], b""), "b": ("I64", [3, 0, 2], b"")}
    with SafetensorsFile.open(path) as file:
        assert file.array("b").shape == (3, 0, 2)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(ALL_DTYPES), st.lists(st.integers(0, 4), min_size=0, max_size=3)),
        max_size=5,
    )
)
def test_round_trip_any_dtypes_and_shapes(tmp_path_factory, tensors) -> None:
    folder = tmp_path_factory.mktemp("rt")
    arrays = {f"t{i}": sample(dtype, tuple(shape), i) for i, (dtype, shape) in enumerate(tensors)}
    path = write_arrays(folder / "x.safetensors", arrays)
    assert {n: data for n, (_, _, data) in reference_read(path).items()} == {
        n: a.tobytes() for n, a in arrays.items()
    }
    with SafetensorsFile.open(path) as file:
        assert {n: bytes(file.buffer(n)) for n in file.tensors} == {
            n: a.tobytes() for n, a in arrays.items()
        }


def dumped_header(tensors: list[ShardDesc], metadata: dict[str, str] | None) -> bytes:
    """The header as the writer once made it: the header object through json.dumps."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for spec in tensors:
        nbytes = spec.nbytes
        header[spec.key] = {"dtype": {v: k for k, v in SAFETENSORS_CODES.items()}[spec.dtype],
                            "shape": list(spec.local_shape),
                            "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


#: Any names (quotes, backslashes, control and non-ASCII characters), or plain ones (printable
#: ASCII, no quote or backslash: the header's texts are then made in one native pass).
PLAIN_KEYS = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E,
                                   blacklist_characters='"\\'), max_size=6)
KEYS = st.one_of(PLAIN_KEYS, st.text(st.characters(blacklist_categories=["Cs"]), max_size=6),
                st.text(st.sampled_from(list('a."\\\x01\x7fé')), max_size=4))


@settings(max_examples=150, deadline=None)
@given(specs=st.lists(st.tuples(KEYS, st.sampled_from(ALL_DTYPES),
                                st.lists(st.integers(0, 300), max_size=3),
                                st.lists(st.integers(0, 9), max_size=3)),
                      max_size=6, unique_by=lambda spec: spec[0]),
       metadata=st.one_of(st.none(), st.dictionaries(KEYS, KEYS, max_size=3)))
def test_header_and_sharding_info_are_what_json_dumps_makes(specs, metadata) -> None:
    """The header and DCP_SHARDING_INFO are written entry by entry; byte for byte what
    json.dumps makes of them, whatever the names (quotes, backslashes, control and
    non-ASCII characters), shapes and metadata."""
    tensors = []
    for key, dtype, shape, offset in specs:
        offset = (offset + [0] * len(shape))[:len(shape)]
        tensors.append(ShardDesc(key, tuple(shape), tuple(map(sum, zip(shape, offset))),
                                 tuple(offset), dtype))
    assert header_bytes(tensors, metadata) == dumped_header(tensors, metadata)
    assert sharding_info(tensors) == json.dumps(
        {spec.key: {"saved_offsets": list(spec.global_offset)} for spec in tensors})


# ---------------------------------------------------------------------- writer atomicity


def leftovers(folder: Path) -> list[str]:
    return sorted(os.listdir(folder))


def test_fill_that_raises_leaves_no_file(tmp_path: Path) -> None:
    def fill(views: dict[str, memoryview]) -> None:
        views["w"][:4] = b"abcd"
        raise RuntimeError("kernel failed")

    with pytest.raises(RuntimeError, match="kernel failed"):
        write_safetensors(tmp_path / "a.safetensors", [ShardDesc.full("w", (2,), "int32")],
                          None, fill)
    assert leftovers(tmp_path) == []


def test_fill_that_raises_keeps_the_older_file(tmp_path: Path) -> None:
    path = write_arrays(tmp_path / "a.safetensors", {"w": sample("int8", (3,))})
    before = path.read_bytes()

    def fill(views: dict[str, memoryview]) -> None:
        raise RuntimeError("kernel failed")

    with pytest.raises(RuntimeError):
        write_safetensors(path, [ShardDesc.full("w", (3,), "int8")], None, fill)
    assert leftovers(tmp_path) == ["a.safetensors"]
    assert path.read_bytes() == before


def test_writer_left_without_commit_leaves_no_file(tmp_path: Path) -> None:
    with SafetensorsWriter(tmp_path / "a.safetensors", [ShardDesc.full("w", (3,), "int8")]
                           ) as w:
        w.buffer("w")[:] = b"xyz"
        assert leftovers(tmp_path) == [".a.safetensors.aoa-partial"]
    assert leftovers(tmp_path) == []


def test_writer_commit_then_failure_removes_the_file(tmp_path: Path) -> None:
    path = tmp_path / "a.safetensors"
    w_int8 = [ShardDesc.full("w", (3,), "int8")]
    with pytest.raises(RuntimeError), SafetensorsWriter(path, w_int8) as w:
        w.commit()
        assert leftovers(tmp_path) == ["a.safetensors"]
        raise RuntimeError("later step failed")
    assert leftovers(tmp_path) == []


def test_writer_with_a_view_still_held_commits(tmp_path: Path) -> None:
    with SafetensorsWriter(tmp_path / "a.safetensors", [ShardDesc.full("w", (3,), "uint8")]
                           ) as w:
        view = w.buffer("w")
        kept = np.frombuffer(view, np.uint8)
        kept[:] = [1, 2, 3]
        w.commit()
        with pytest.raises(ValueError):  # released: it cannot write into the finished file
            view[0] = 9
        with pytest.raises(StorageError, match="already finished"):
            w.buffer("w")
    assert load_file(tmp_path / "a.safetensors")["w"].tolist() == [1, 2, 3]


def test_killed_writer_leaves_only_a_partial_dot_file(tmp_path: Path) -> None:
    script = (
        "import os, sys\n"
        "from aoa.layout import ShardDesc\n"
        "from aoa.storage.safetensors import write_safetensors\n"
        "def fill(views):\n"
        "    views['w'][:2] = b'ab'\n"
        "    os._exit(9)\n"
        "write_safetensors(sys.argv[1], [ShardDesc.full('w', (4,), 'float32')], None, fill)\n"
    )
    # (aoa as this interpreter has it installed: its source folder alone has no C++ core)
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "a.safetensors")], check=False
    )
    assert done.returncode == 9
    assert leftovers(tmp_path) == [".a.safetensors.aoa-partial"]


@pytest.mark.parametrize(("specs", "message"), [
    ([ShardDesc.full("w", (1,), "int8"), ShardDesc.full("w", (1,), "int8")],
     "tensor 'w': name is reserved or used twice in one file"),
    ([ShardDesc.full("__metadata__", (1,), "int8")],
     "tensor '__metadata__': name is reserved or used twice in one file"),
    ([ShardDesc.full("w", (1,), None)], "tensor 'w': dtype None has no safetensors code"),
])
def test_writer_rejects_bad_specs(tmp_path: Path, specs: list[ShardDesc], message: str) -> None:
    path = tmp_path / "a.safetensors"
    with pytest.raises(StorageError) as caught:
        write_safetensors(path, specs, None, lambda views: None)
    assert caught.value.message == f"{path}: {message}"
    assert leftovers(tmp_path) == []


def test_unwritable_destination_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "plain").write_text("not a folder")
    path = tmp_path / "plain" / "a.safetensors"
    with pytest.raises(StorageError) as caught:
        write_safetensors(path, [ShardDesc.full("w", (1,), "int8")], None, lambda views: None)
    assert caught.value.message == f"{path}: cannot write: Not a directory"


# ----------------------------------------------------------------------------- bad input


def test_file_shorter_than_the_length_prefix(tmp_path: Path) -> None:
    path = tmp_path / "short.safetensors"
    for size in (0, 5):
        path.write_bytes(b"\0" * size)
        assert message(path) == (
            f"{path}: truncated: {size} bytes, too short for the 8-byte header length"
        )


def test_header_length_past_the_end(tmp_path: Path) -> None:
    path = raw_file(tmp_path / "a.safetensors", {}, length=1000)
    assert message(path) == (
        f"{path}: truncated: header length 1000 runs past the end of the file (10 bytes)"
    )


def test_header_over_the_limit(tmp_path: Path) -> None:
    path = raw_file(tmp_path / "a.safetensors", {}, length=MAX_HEADER_BYTES + 1)
    assert message(path) == (
        f"{path}: header of {MAX_HEADER_BYTES + 1} bytes is over the limit of {MAX_HEADER_BYTES}"
    )


@pytest.mark.parametrize(
    ("header", "fragment"),
    [
        (b"{not json", "header:1:2: not valid JSON: Expecting property name enclosed in double "
                       "quotes"),
        (b'{"a": 1\xff}', "the header is not UTF-8 text: byte 7 (line 1) is b'\\xff'"),
        (b'{"w": NaN}', "header: not valid JSON: NaN is not JSON"),
        (b'{"__metadata__": {}, "__metadata__": {}}', "key '__metadata__' appears twice"),
        (b"[]", "header is not a JSON object"),
        (b'{"__metadata__": {"a": 1}}', "__metadata__ is not an object of strings to strings"),
    ],
)
def test_header_that_is_not_a_json_object(tmp_path: Path, header: bytes, fragment: str) -> None:
    path = raw_file(tmp_path / "a.safetensors", header)
    text = message(path)
    assert text.startswith(f"{path}: ") and fragment in text


@pytest.mark.parametrize(
    ("header", "data", "expected"),
    [
        (
            {"w": entry("C64", [1], 0, 8)},
            8,
            "tensor 'w': unknown dtype 'C64' (known: " + " ".join(SAFETENSORS_CODES) + ")",
        ),
        (
            {"w": {**entry("F32", [1], 0, 4), "extra": 1}},
            4,
            "tensor 'w': entry must have exactly dtype, shape and data_offsets",
        ),
        (
            {"w": {"dtype": "F32", "shape": [1]}},
            4,
            "tensor 'w': entry must have exactly dtype, shape and data_offsets",
        ),
        (
            {"w": entry("F32", [-1], 0, 4)},
            4,
            "tensor 'w': shape [-1] is not a list of non-negative integers",
        ),
        (
            {"w": entry("F32", [True], 0, 4)},
            4,
            "tensor 'w': shape [True] is not a list of non-negative integers",
        ),
        (
            {"w": {**entry("F32", [1], 0, 4), "data_offsets": [0]}},
            4,
            "tensor 'w': data_offsets [0] is not [begin, end]",
        ),
        (
            {"w": entry("F32", [1], 4, 0)},
            4,
            "tensor 'w': data_offsets [4, 0] end before they begin",
        ),
        (
            {"w": entry("F32", [2], 0, 8)},
            4,
            "tensor 'w': truncated: data_offsets [0, 8] run past the end of the data section "
            "(4 bytes)",
        ),
        (
            {"w": entry("F32", [2, 3], 0, 16)},
            16,
            "tensor 'w': data_offsets [0, 16] hold 16 bytes, but F32 [2, 3] needs 24",
        ),
        (
            {"a": entry("I8", [4], 0, 4), "b": entry("I8", [4], 2, 6)},
            6,
            "tensor 'b' starts at data offset 2, overlapping the tensor that ends at 4",
        ),
        (
            {"a": entry("I8", [4], 0, 4), "b": entry("I8", [4], 6, 10)},
            10,
            "tensor 'b' starts at data offset 6, leaving a gap after byte 4",
        ),
        (
            {"a": entry("I8", [4], 2, 6)},
            6,
            "tensor 'a' starts at data offset 2, leaving a gap after byte 0",
        ),
        (
            {"a": entry("I8", [4], 0, 4)},
            7,
            "tensors end at data offset 4 but the data section holds 7 bytes",
        ),
    ],
)
def test_bad_tensor_entries(tmp_path: Path, header: dict, data: int, expected: str) -> None:
    path = raw_file(tmp_path / "a.safetensors", header, b"\0" * data)
    assert message(path) == f"{path}: {expected}"


def test_truncated_data_names_the_tensor(tmp_path: Path) -> None:
    arrays = {"first": sample("float32", (4,)), "last": sample("float32", (4,))}
    path = write_arrays(tmp_path / "a.safetensors", arrays)
    path.write_bytes(path.read_bytes()[:-3])
    assert message(path) == (
        f"{path}: tensor 'last': truncated: data_offsets [16, 32] run past the end of the data "
        "section (29 bytes)"
    )


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nothing.safetensors"
    assert message(path) == f"{path}: cannot open: No such file or directory"


def test_unknown_tensor_name(tmp_path: Path) -> None:
    path = write_arrays(tmp_path / "a.safetensors", {"w": sample("int8", (1,))})
    with SafetensorsFile.open(path) as file, pytest.raises(StorageError) as caught:
        file.buffer("v")
    assert caught.value.message == f"{path}: no tensor 'v'"


def laid_out(fixed: list[tuple[int, bytes]]) -> bytes:
    """The bytes a layout's fixed pieces put at the file's start, checked to follow one
    another from offset 0 (a header is laid out in pieces, not joined)."""
    assert [offset for offset, _ in fixed] == list(itertools.accumulate(
        (len(data) for _, data in fixed[:-1]), initial=0))
    return b"".join(data for _, data in fixed)


@settings(max_examples=100, deadline=None)
@given(specs=st.lists(st.tuples(KEYS, st.sampled_from(ALL_DTYPES),
                                st.lists(st.integers(0, 300), max_size=3)),
                      max_size=6, unique_by=lambda spec: spec[0]))
def test_a_dcp_safetensors_layout_is_its_header_then_its_shards(specs) -> None:
    """A rank's file as the dcp-safetensors destination lays it out: the header json.dumps
    makes (the key texts shared with DCP_SHARDING_INFO where the keys are ASCII), then the
    shards back to back."""
    tensors = [ShardDesc(key, tuple(shape), tuple(shape), (0,) * len(shape), dtype)
               for key, dtype, shape in specs]
    files = DcpSafetensorsDestination.plan_files(tensors, None)
    destination = DcpSafetensorsDestination(Path("/nonexistent"), tensors, files)
    layout = destination.layout(files[0])
    header = dumped_header(tensors, {"DCP_SHARDING_INFO": json.dumps(
        {spec.key: {"saved_offsets": list(spec.global_offset)} for spec in tensors}),
        "DCP_VERSION": "1.0"})
    assert laid_out(layout.fixed) == header
    offsets = list(itertools.accumulate((spec.nbytes for spec in tensors), initial=len(header)))
    assert list(layout.shards) == [
        ShardSpan(i, offset, spec.nbytes, ITEMSIZES[spec.dtype])
        for i, (offset, spec) in enumerate(zip(offsets, tensors))]
    assert layout.size == offsets[-1] == len(header) + files[0].nbytes


@settings(max_examples=100, deadline=None)
@given(specs=st.lists(st.tuples(KEYS, st.sampled_from(ALL_DTYPES),
                                st.lists(st.integers(0, 30), max_size=2)),
                      max_size=5, unique_by=lambda spec: spec[0]),
       ranks=st.lists(st.tuples(st.integers(1, 3), st.booleans(), st.booleans()),
                      min_size=1, max_size=4))
def test_dcp_safetensors_ranks_laid_out_alike_or_not(specs, ranks) -> None:
    """Each rank's file is its own header then its shards, whether a rank holds the keys,
    shapes and dtypes of the rank before it (and takes its header entries from it) or
    shards of another shape, fewer keys, or other offsets."""
    tensors: list[ShardDesc] = []
    groups = []
    for rank, (halve, fewer, shift) in enumerate(ranks):
        chosen = specs[1:] if fewer else specs
        groups.append(list(range(len(tensors), len(tensors) + len(chosen))))
        for key, dtype, shape in chosen:
            local = tuple(n // halve for n in shape)
            offset = tuple(rank * n if shift else 0 for n in local)
            tensors.append(ShardDesc(key, local, tuple(n * len(ranks) for n in shape),
                                     offset, dtype))
    files = DcpSafetensorsDestination.plan_files(tensors, groups)
    destination = DcpSafetensorsDestination(Path("/nonexistent"), tensors, files)
    for file in files:
        held = [tensors[i] for i in file.shards]
        header = dumped_header(held, {"DCP_SHARDING_INFO": json.dumps(
            {spec.key: {"saved_offsets": list(spec.global_offset)} for spec in held}),
            "DCP_VERSION": "1.0"})
        layout = destination.layout(file)
        assert laid_out(layout.fixed) == header
        offsets = list(itertools.accumulate((spec.nbytes for spec in held),
                                            initial=len(header)))
        assert list(layout.shards) == [
            ShardSpan(i, offset, spec.nbytes, ITEMSIZES[spec.dtype])
            for i, offset, spec in zip(file.shards, offsets, held)]
        assert layout.size == offsets[-1]


@settings(max_examples=150, deadline=None)
@given(specs=st.lists(st.tuples(PLAIN_KEYS, st.sampled_from(ALL_DTYPES),
                                st.lists(st.integers(0, 300), max_size=3),
                                st.lists(st.integers(0, 2**14), max_size=3)),
                      max_size=6, unique_by=lambda spec: spec[0]))
def test_plain_shards_texts_are_made_natively_as_json_dumps_writes_them(specs) -> None:
    """Plain keys, any dtype and box: the native pass makes the header's entries, sizes and
    sharding info, as json.dumps writes them."""
    tensors = []
    for key, dtype, shape, offset in specs:
        offset = (offset + [0] * len(shape))[:len(shape)]
        tensors.append(ShardDesc(key, tuple(shape), tuple(map(sum, zip(shape, offset))),
                                 tuple(offset), dtype))
    made = header_texts(tensors, ('"', "saved_offsets", "{", "}"))
    assert made is not None
    entries, info = made
    header = json.loads(dumped_header(tensors, None)[8:])
    assert json.loads(b"{" + entries.text + b"}") == header
    assert entries.text == json.dumps(header, separators=(",", ":")).encode()[1:-1]
    assert entries.sizes.tolist() == [spec.nbytes for spec in tensors]
    assert entries.itemsizes.tolist() == [ITEMSIZES[spec.dtype] for spec in tensors]
    assert info == json.dumps({spec.key: {"saved_offsets": list(spec.global_offset)}
                               for spec in tensors}).encode()


class _Unslotted:
    """A shard description without slots (its fields in a dict)."""

    def __init__(self, shard: ShardDesc) -> None:
        self.key, self.local_shape, self.dtype = shard.key, shard.local_shape, shard.dtype
        self.global_offset = shard.global_offset


@pytest.mark.parametrize("shard", [
    ShardDesc.full('a"b', (2,), "float32"),  # a quote
    ShardDesc.full("a\\b", (2,), "float32"),  # a backslash
    ShardDesc.full("a\nb", (2,), "float32"),  # a control character
    ShardDesc.full("a\x7fb", (2,), "float32"),
    ShardDesc.full("ü", (2,), "float32"),  # not ASCII
    ShardDesc.full("a", (2,), None),  # no dtype
    ShardDesc.unchecked("a", [2], [2], [0], "float32"),  # boxes not tuples
    ShardDesc.unchecked("a", (True,), (2,), (0,), "float32"),  # not an int
    ShardDesc.unchecked("a", (-1,), (2,), (0,), "float32"),  # negative
    ShardDesc.unchecked("a", (2**63,), (2**63,), (0,), "int8"),  # past int64
    ShardDesc.unchecked("a", (2**62,), (2**62,), (0,), "float32"),  # its bytes past int64
    ShardDesc.unchecked("a", (2,), (2,), (-1,), "float32"),  # a negative offset
    _Unslotted(ShardDesc.full("a", (2,), "float32")),
])
def test_what_is_not_plain_is_left_to_the_python_texts(shard) -> None:
    fine = ShardDesc.full("fine", (3,), "float32")
    assert header_texts([fine], ('"', "saved_offsets", "{", "}")) is not None
    assert header_texts([fine, shard], ('"', "saved_offsets", "{", "}")) is None


@settings(max_examples=100, deadline=None)
@given(specs=st.lists(st.tuples(st.sampled_from([*ITEMSIZES, None]),
                                st.lists(st.integers(0, 300), max_size=3)), max_size=8))
def test_shard_bytes_are_counted_natively_as_each_shard_counts_them(specs) -> None:
    """Every dtype aoa knows (None reading as float32), any shape: each shard's bytes from
    the native pass are its `nbytes`."""
    shards = [ShardDesc.full(f"k{i}", tuple(shape), dtype)
              for i, (dtype, shape) in enumerate(specs)]
    made = _core.shard_nbytes(shards, ITEMSIZES, "float32")
    assert made is not None and made.tolist() == [shard.nbytes for shard in shards]
    assert shards_nbytes(shards) == [shard.nbytes for shard in shards]


@pytest.mark.parametrize("shard", [
    ShardDesc.unchecked("a", (2,), (2,), (0,), "no such dtype"),
    ShardDesc.unchecked("a", [2], [2], [0], "float32"),  # a shape not a tuple
    ShardDesc.unchecked("a", (2**62,), (2**62,), (0,), "float32"),  # bytes past int64
    _Unslotted(ShardDesc.full("a", (2,), "float32")),
])
def test_shard_bytes_not_plain_are_left_to_python(shard) -> None:
    fine = ShardDesc.full("fine", (3,), None)
    assert _core.shard_nbytes([fine], ITEMSIZES, "float32").tolist() == [12]
    assert _core.shard_nbytes([fine, shard], ITEMSIZES, "float32") is None


def test_a_metaclass_emptying_the_shards_while_they_are_read_is_survived() -> None:
    """Finding a new type's slots may run its metaclass's code, which may change the list
    being read: the native passes look at it again, and leave it to the Python path."""
    shards: list[Any] = []

    class Emptying(type):
        def __getattribute__(cls, name: str) -> Any:
            if name == "key":
                shards.clear()
            return super().__getattribute__(name)

    class Odd(metaclass=Emptying):
        __slots__ = ("dtype", "global_offset", "global_shape", "key", "local_shape")

    odd = Odd()
    fields = {"key": "b", "local_shape": (2,), "global_shape": (2,), "global_offset": (0,),
              "dtype": "float32"}
    for field, value in fields.items():
        object.__setattr__(odd, field, value)
    for read, emptied in ((header_texts, None), (shards_nbytes, [])):  # (then by Python)
        shards[:] = [ShardDesc.full(f"k{i}", (2,), "float32") for i in range(40)]
        shards.insert(20, odd)
        assert read(shards) == emptied
        assert shards == []


def test_the_native_texts_count_bytes_past_int64_as_not_plain() -> None:
    """Each tensor fits in int64, the sum of two does not: left to the Python texts."""
    tensors = [ShardDesc.full(key, (2**60,), "float32") for key in ("a", "b")]
    assert header_texts(tensors[:1]) is not None
    assert header_texts(tensors) is None


def test_a_file_of_more_bytes_than_int64_counts_is_refused(tmp_path: Path) -> None:
    """Each tensor fits, their sum does not: refused naming the file, not laid out with
    offsets that wrapped around."""
    tensors = [ShardDesc.full(key, (2**60,), "float32") for key in ("a", "b")]
    files = DcpSafetensorsDestination.plan_files(tensors, None)
    destination = DcpSafetensorsDestination(tmp_path, tensors, files)
    with pytest.raises(StorageError) as caught:
        destination.layout(files[0])
    assert caught.value.message == (
        f"{tmp_path / files[0].filename}: its tensors hold {2**63} bytes, more than a file "
        f"can ({2**63 - 1})")
