"""torch.save files read and written without torch, checked against torch itself."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from aoa.errors import StorageError
from aoa.storage.stored_zip import ZipLayout, read_records
from aoa.storage.torch_save import (
    SavedTensor,
    TensorToSave,
    TorchSaveLayout,
    read_torch_save,
)


def saved(value) -> memoryview:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return memoryview(buffer.getvalue())


def bytes_of(data: memoryview, tensor: SavedTensor) -> bytes:
    offset = tensor.contiguous_offset()
    if offset is None:
        return tensor.gather(data).tobytes()
    return bytes(data[offset:offset + tensor.nbytes])


def torch_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_tensors_are_found_in_place_with_offsets_and_strides():
    torch.manual_seed(0)
    embedding = torch.randn(6, 4)
    state = {
        "embed": embedding,
        "lm_head": embedding,  # tied: the same storage
        "transposed": embedding.t(),
        "rows": embedding[2:5],
        "column": embedding[:, 1],
        "bf16": torch.randn(7).to(torch.bfloat16),
        "fp8": torch.randn(3).to(torch.float8_e4m3fn),
        "uint16": torch.arange(5, dtype=torch.int32).to(torch.uint16),
        "flags": torch.tensor([True, False]),
        "param": torch.nn.Parameter(torch.ones(2, 2)),
        "scalar": torch.tensor(3.5),
    }
    data = saved(state)
    loaded = read_torch_save(data, "model.bin")
    assert list(loaded) == list(state)
    for key, tensor in state.items():
        found = loaded[key]
        assert found.shape == tuple(tensor.shape), key
        assert str(tensor.dtype) == f"torch.{found.dtype}", key
        assert bytes_of(data, found) == torch_bytes(tensor), key
    assert loaded["embed"].storage is loaded["lm_head"].storage
    assert loaded["rows"].contiguous_offset() == loaded["embed"].storage.offset + 2 * 4 * 4
    assert loaded["transposed"].contiguous_offset() is None
    assert loaded["column"].contiguous_offset() is None


def test_a_module_state_dict_keeps_its_order():
    module = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.LayerNorm(2))
    loaded = read_torch_save(saved(module.state_dict()), "m.pt")
    assert list(loaded) == list(module.state_dict())


@pytest.mark.parametrize("base", [0, 5, 64])
def test_written_archives_load_in_torch(tmp_path: Path, base: int):
    tensors = [TensorToSave("float32", (3, 4)), TensorToSave("bfloat16", (5,)),
               TensorToSave("float8_e5m2", (2, 2)), TensorToSave("int64", ()),
               TensorToSave("uint32", (0, 3))]
    rng = np.random.default_rng(0)
    contents = [rng.integers(0, 256, t.nbytes, dtype=np.uint8).tobytes() for t in tensors]
    layout = TorchSaveLayout(tensors, {"w": 0, "rest": [1, 2, (3, 4)]}, base=base)
    data = bytearray(base + layout.nbytes)
    archive = memoryview(data)[base:]
    for index, content in enumerate(contents):
        offset = layout.data_offset(index)
        assert (base + offset) % 64 == 0
        archive[offset:offset + len(content)] = content
    layout.write(archive)
    path = tmp_path / "t.pt"
    path.write_bytes(bytes(archive))
    assert zipfile.ZipFile(path).testzip() is None  # CRCs right
    for mmap in (False, True):
        loaded = torch.load(path, weights_only=True, mmap=mmap)
        flat = [loaded["w"], loaded["rest"][0], loaded["rest"][1], *loaded["rest"][2]]
        for tensor, spec, content in zip(flat, tensors, contents):
            assert tuple(tensor.shape) == spec.shape
            assert str(tensor.dtype) == f"torch.{spec.dtype}"
            assert torch_bytes(tensor) == content
    ours = read_torch_save(memoryview(data), "t.pt", start=base)
    assert bytes_of(memoryview(data), ours["w"]) == contents[0]


def test_zip_layout_matches_pythons_reader():
    layout = ZipLayout([("a/data.pkl", 10), ("a/empty", 0), ("a/data/0", 100)], base=3)
    data = bytearray(layout.nbytes)
    view = memoryview(data)
    for record in layout.records:
        view[record.offset:record.offset + record.nbytes] = bytes(range(record.nbytes))
    layout.write(view)
    archive = zipfile.ZipFile(io.BytesIO(bytes(data)))
    assert archive.testzip() is None
    assert [(i.filename, i.file_size) for i in archive.infolist()] == [
        ("a/data.pkl", 10), ("a/empty", 0), ("a/data/0", 100)]
    records = read_records(view, "x")
    assert {name: (r.offset, r.nbytes) for name, r in records.items()} == {
        r.name: (r.offset, r.nbytes) for r in layout.records}


def test_a_truncated_file_is_an_error_naming_it():
    data = saved({"w": torch.ones(1000)})
    for cut in (10, len(data) // 2, len(data) - 30):
        with pytest.raises(StorageError, match=r"^error: w\.bin: (truncated|not a zip)"):
            read_torch_save(data[:cut], "w.bin")


def test_a_storage_running_past_its_record_is_an_error():
    data = bytearray(saved({"w": torch.ones(8)}))
    pickle_at = data.index(b"FloatStorage")
    count_at = data.index(b"K\x08t", pickle_at)  # numel 8 in the persistent id
    data[count_at + 1] = 9
    with pytest.raises(StorageError, match="storage '0' holds 32 bytes, but its 9 float32"):
        read_torch_save(memoryview(bytes(data)), "w.bin")


def test_a_view_past_its_storage_is_an_error():
    data = bytearray(saved({"w": torch.ones(2, 4)}))
    at = data.index(b"K\x02K\x04\x86")  # size (2, 4)
    data[at + 1] = 3
    with pytest.raises(StorageError, match="reaches past the end of storage '0'"):
        read_torch_save(memoryview(bytes(data)), "w.bin")


class Unsafe:
    pass


def test_a_forbidden_class_in_a_torch_file_is_refused():
    data = saved({"w": torch.ones(2), "extra": Unsafe()})
    with pytest.raises(StorageError) as caught:
        read_torch_save(data, "pytorch_model.bin")
    assert caught.value.message == (f"pytorch_model.bin: the pickle asks for "
                                    f"'{__name__}.Unsafe', which aoa does not load")
