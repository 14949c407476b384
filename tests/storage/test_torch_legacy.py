"""torch.save's legacy format (before PyTorch 1.6) read without torch, checked against
torch.load of the same file."""

from __future__ import annotations

import io
import pickle
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
from fuzzing import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st
from safetensors.numpy import load_file

from aoa.cli import main
from aoa.errors import AoaError, StorageError
from aoa.storage.formats import detect, open_source
from aoa.storage.torch_legacy import MAGIC_NUMBER


def legacy_save(value, path: Path, protocol: int = 2) -> Path:
    torch.save(value, path, _use_new_zipfile_serialization=False, pickle_protocol=protocol)
    return path


def torch_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def a_state_dict() -> OrderedDict:
    """Every way a state dict stores a tensor: dtypes with and without numpy twins, a
    parameter, one storage shared by two keys and by a slice with an offset, a transpose."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(4, 6, generator=generator)
    return OrderedDict([
        ("layer.weight", torch.nn.Parameter(weight)),
        ("layer.bias", torch.randn(6, generator=generator).half()),
        ("norm.weight", torch.randn(5, generator=generator).bfloat16()),
        ("steps", torch.arange(3, dtype=torch.int64)),
        ("mask", torch.tensor([True, False, True])),
        ("tied", weight),
        ("rows", weight[1:3]),
        ("transposed", weight.t()),
        ("every_other", weight[:, ::2]),
    ])


@pytest.mark.parametrize("protocol", [2, 4])
def test_a_legacy_file_reads_as_torch_loads_it(tmp_path, protocol):
    path = legacy_save(a_state_dict(), tmp_path / "pytorch_model.bin", protocol)
    loaded = torch.load(path, weights_only=False)  # its reader does not take protocol 4
    assert detect(path).name == "bin"
    with open_source(path) as source:
        assert list(source.shards) == list(loaded)
        for key, tensor in loaded.items():
            (shard,) = source.shards[key]
            assert shard.global_shape == tuple(tensor.shape)
            assert shard.dtype == str(tensor.dtype).removeprefix("torch.")
            assert bytes(source.buffer(shard)) == torch_bytes(tensor), key


def test_a_legacy_pytorch_model_bin_converts_to_safetensors(tmp_path, capsys):
    state = a_state_dict()
    folder = tmp_path / "model"
    folder.mkdir()
    legacy_save(state, folder / "pytorch_model.bin")
    mapping = tmp_path / "map.aoa"
    mapping.write_text("layer.weight^T -> layer.weight_t\n"
                       "norm.weight -> norm.weight, dtype='float32'\n")
    assert main(["convert", str(mapping), "--source", str(folder), "--output",
                 str(tmp_path / "out"), "--lenient", "--quiet"]) == 0
    written = load_file(tmp_path / "out" / "model.safetensors")
    expected = {key: tensor.detach() for key, tensor in state.items()}
    expected["layer.weight_t"] = expected.pop("layer.weight").t()
    expected["norm.weight"] = expected["norm.weight"].float()
    assert sorted(written) == sorted(expected)
    for key, tensor in expected.items():
        assert written[key].tobytes() == torch_bytes(tensor), key


class _Storage:
    def __init__(self, pid: tuple) -> None:
        self.pid = pid


class _Tensor:
    """A tensor as torch pickles one: ``_rebuild_tensor_v2`` of a storage."""

    def __init__(self, storage: _Storage, offset: int, size: tuple, stride: tuple) -> None:
        self.args = (storage, offset, size, stride, False, OrderedDict())

    def __reduce__(self):
        return torch._utils._rebuild_tensor_v2, self.args


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj):
        return obj.pid if isinstance(obj, _Storage) else None


def with_views(path: Path, data: bytes, view: tuple) -> Path:
    """``path`` holding ``data``'s preamble, then three tensors of one storage of ten float32
    (0 to 9): the whole storage, and two of the storage view ``view``."""
    root = ("storage", torch.FloatStorage, "r", "cpu", 10, None)
    viewed = ("storage", torch.FloatStorage, "r", "cpu", 10, view)
    state = {"whole": _Tensor(_Storage(root), 0, (10,), (1,)),
             "view": _Tensor(_Storage(viewed), 1, (2, 2), (2, 1)),
             "view_again": _Tensor(_Storage(viewed), 0, (6,), (1,))}
    written = io.BytesIO()
    _Pickler(written, protocol=2).dump(state)
    preamble = data[:pickles(data)[3][0]]
    path.write_bytes(preamble + written.getvalue() + pickle.dumps(["r"], protocol=2)
                     + (10).to_bytes(8, "little") + np.arange(10, dtype=np.float32).tobytes())
    return path


def test_storage_views_of_torch_before_0_4_read_as_torch_loads_them(saved):
    """A storage's view (key, offset, count): a range of its root storage."""
    path = with_views(*saved[:2], ("v", 2, 6))
    loaded = torch.load(path, weights_only=True)
    assert torch_bytes(loaded["view"]) == np.arange(3, 7, dtype=np.float32).tobytes()
    with open_source(path) as source:
        for key, tensor in loaded.items():
            (shard,) = source.shards[key]
            assert bytes(source.buffer(shard)) == torch_bytes(tensor), key


def test_a_view_past_its_storage_is_refused(saved):
    path = with_views(*saved[:2], ("v", 5, 6))
    assert refusal(path) == f"{path}: view 'v' of storage 'r' takes elements [5, 11) of its 10"


class _Skimmer(pickle.Unpickler):
    """Python's unpickler with torch's storages and tensors stood in for."""

    def find_class(self, module, name):
        return super().find_class(module, name) if module == "collections" else (
            lambda *args: None)

    def persistent_load(self, pid):
        return None


def pickles(data: bytes) -> list[tuple[int, int]]:
    """Where each of a legacy file's five pickles starts and ends, found by Python's pickle."""
    stream = io.BytesIO(data)
    spans = []
    for _ in range(5):
        start = stream.tell()
        _Skimmer(stream).load()
        spans.append((start, stream.tell()))
    return spans


def replaced(data: bytes, which: int, value) -> bytes:
    """``data`` with its pickle ``which`` (0: the magic number ... 4: the keys) in place of
    a pickle of ``value``."""
    start, end = pickles(data)[which]
    return data[:start] + pickle.dumps(value, protocol=2) + data[end:]


def refusal(path: Path) -> str:
    with pytest.raises(StorageError) as caught:
        open_source(path)
    return caught.value.message


@pytest.fixture
def saved(tmp_path) -> tuple[Path, bytes, list[str]]:
    """A legacy file of two storages of 24 float32 each, and their keys in the file's order
    (torch names a storage by its address)."""
    path = legacy_save({"w": torch.ones(4, 6), "b": torch.zeros(24)},
                       tmp_path / "pytorch_model.bin")
    data = path.read_bytes()
    start, end = pickles(data)[4]
    return path, data, pickle.loads(data[start:end])


def test_a_truncated_legacy_file_names_the_storage_cut(saved):
    path, data, keys = saved
    path.write_bytes(data[:-2])
    end = len(data) - 2
    assert refusal(path) == (f"{path}: truncated: storage '{keys[1]}' needs bytes "
                             f"[{end - 94}, {end + 2}), past the file's {end} bytes")
    first = pickles(data)[4][1]
    path.write_bytes(data[:first + 3])
    assert refusal(path) == (f"{path}: truncated: storage '{keys[0]}' starts at byte {first}, "
                             f"past the file's {first + 3} bytes")


def test_a_storage_whose_count_lies_is_refused(saved):
    path, data, keys = saved
    first = pickles(data)[4][1]
    path.write_bytes(data[:first] + (25).to_bytes(8, "little") + data[first + 8:])
    assert refusal(path) == (f"{path}: storage '{keys[0]}' at byte {first} says it holds 25 "
                             "elements; the saved object says 24")


def test_keys_that_are_not_the_objects_storages_are_refused(saved):
    path, data, keys = saved
    path.write_bytes(replaced(data, 4, [keys[0], "7"]))
    assert refusal(path) == (f"{path}: the storages' keys {sorted([keys[0], '7'])} are not "
                             f"those the saved object names, {sorted(keys)}")
    path.write_bytes(replaced(data, 4, [*keys, keys[1]]))
    assert refusal(path).startswith(f"{path}: the storages' keys {sorted([*keys, keys[1]])} "
                                    "are not")


@pytest.mark.parametrize(("which", "value", "message"), [
    (0, (MAGIC_NUMBER,), "not a torch.save file: it starts with a pickle of "
     f"({MAGIC_NUMBER},), not torch's magic number"),
    (1, 1002, "torch.save legacy format version 1002; aoa reads version 1001"),
    (2, {"little_endian": False},
     "the writer's facts {'little_endian': False} do not say little_endian = True; aoa reads "
     "little-endian files"),
])
def test_the_preamble_is_checked(saved, which, value, message):
    path, data, _ = saved
    path.write_bytes(replaced(data, which, value))
    assert refusal(path) == f"{path}: {message}"


def test_a_pickle_of_anything_but_a_state_dict_is_refused(tmp_path):
    path = legacy_save([torch.ones(2)], tmp_path / "pytorch_model.bin")
    assert refusal(path) == f"{path}: holds a list, not a state dict"


@fuzz_settings
@given(st.data())
def test_fuzz_a_legacy_file_changed_anywhere_reads_or_raises_an_aoa_error(tmp_path_factory,
                                                                         data):
    path = tmp_path_factory.mktemp("legacy") / "pytorch_model.bin"
    original = legacy_save(a_state_dict(), path).read_bytes()
    changed = bytearray(original)
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(changed) - 1))
        how = data.draw(st.sampled_from(["set", "cut", "insert"]))
        if how == "set":
            changed[at] = data.draw(st.integers(0, 255))
        elif how == "cut":
            del changed[at:at + data.draw(st.integers(1, 16))]
        else:
            changed[at:at] = data.draw(st.binary(min_size=1, max_size=9))
    path.write_bytes(bytes(changed))
    try:
        with open_source(path) as source:
            for shards in source.shards.values():
                for shard in shards:
                    np.frombuffer(source.buffer(shard), np.uint8).sum()
    except AoaError:
        pass


def test_a_legacy_llama_goes_to_paddleformers_and_back(tmp_path, capsys):
    """A Hugging Face folder of a legacy pytorch_model.bin (config.json beside it), to
    PaddleFormers at TP 2 and back: the same bytes."""
    from test_models import LLAMA, hf_folder

    folder = tmp_path / "hf"
    tensors = hf_folder(folder, LLAMA)
    (folder / "model.safetensors").unlink()
    legacy_save({key: torch.from_numpy(value) for key, value in tensors.items()},
                folder / "pytorch_model.bin")
    for source, output, target in ((folder, "pf", ["--to", "paddleformers", "--tp", "2"]),
                                   (tmp_path / "pf", "back", ["--to", "hf"])):
        assert main(["convert", "--source", str(source), "--output", str(tmp_path / output),
                     *target, "--quiet"]) == 0, capsys.readouterr().err
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(back) == sorted(tensors)
    for key, value in tensors.items():
        assert back[key].tobytes() == value.tobytes(), key
