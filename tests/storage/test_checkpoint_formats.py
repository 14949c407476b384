"""The checkpoint formats end to end: checkpoints written by their own frameworks (Paddle,
PyTorch DCP, Megatron-Core; the committed fixtures come from bench/paddle_checkpoints.py and
bench/torch_checkpoints.py) are read by aoa, converted into every writable format and
layout, and read back by the framework that owns the output format, bytes equal to what the
framework saved."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
from collections.abc import Collection
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from frameworks import MEGATRON_PYTHON, PADDLE_PYTHON

from aoa.cli import main
from aoa.dtypes import numpy_dtype
from aoa.errors import StorageError
from aoa.layout import ShardDesc
from aoa.storage import pickler
from aoa.storage.formats import open_source
from aoa.storage.paddle import metadata_value

FIXTURES = Path(__file__).parent.parent / "fixtures"
BENCH = Path(__file__).parent.parent.parent / "bench"

#: fixture -> (detected format, expected.npz key suffix)
SOURCES = {
    "paddle/single": "paddle", "paddle/tp2": "paddle", "paddle/flat4": "paddle",
    "dcp/tp2": "dcp", "dcp/fsdp4": "dcp",
    "torch_dist/tp2": "torch_dist", "torch_dist/fsdp4": "torch_dist",
}
#: Layouts that split the fixtures' tensors: rows over 2 ranks (1-D tensors too), and a
#: 2 x 2 grid over 4 ranks (rows by dp, columns by tp) of the 2-D ones; as (mesh, the keys
#: ruled, the rule's splits). A fixture's layout has the rules of the keys it holds (a rule
#: that decides nothing is an error).
_MATRICES = ("qkv.weight", "down.weight", "embed.weight", "mlp.weight", "w", "v")
LAYOUTS = {
    "rows2": ("tp = 2", (*_MATRICES, "bias", "norm.weight"), "tp = 0"),
    "grid4": ("dp = 2\ntp = 2", _MATRICES, "dp = 0\ntp = 1"),
}


def layout_text(name: str, keys: Collection[str]) -> str:
    mesh, ruled, splits = LAYOUTS[name]
    return f"[mesh]\n{mesh}\n" + "".join(f'\n[[rule]]\nmatch = "{key}"\n{splits}\n'
                                         for key in ruled if key in keys)


def expected(fixture: str) -> dict[str, bytes]:
    with np.load(FIXTURES / fixture / "expected.npz") as arrays:
        return {key: arrays[key].tobytes() for key in arrays.files if "@" not in key}


def assemble(path: Path) -> tuple[str, dict[str, bytes], dict[str, tuple]]:
    """The format aoa detects, each key's global tensor bytes, and its (shape, dtype)."""
    with open_source(path) as source:
        tensors, specs = {}, {}
        for key, shards in source.shards.items():
            first = shards[0]
            full = np.zeros(first.global_shape, numpy_dtype(first.dtype))
            for shard in shards:
                box = tuple(slice(o, o + n) for o, n in zip(shard.global_offset,
                                                            shard.local_shape))
                full[box] = np.frombuffer(source.buffer(shard), full.dtype).reshape(
                    shard.local_shape)
            tensors[key] = full.tobytes()
            specs[key] = (first.global_shape, first.dtype)
        return source.format, tensors, specs


@pytest.mark.parametrize("fixture", sorted(SOURCES))
def test_framework_checkpoints_read_as_saved(fixture):
    format, tensors, _ = assemble(FIXTURES / fixture)
    assert format == SOURCES[fixture]
    assert tensors == expected(fixture)


def test_several_paddle_saves_need_one_chosen():
    folder = FIXTURES / "paddle" / "two_saves"
    with pytest.raises(StorageError) as caught:
        open_source(folder)
    assert caught.value.message == (
        f"{folder}: holds 2 metadata files (0.metadata, 1.metadata), one per save")
    assert caught.value.hint == f"Give the one to read, e.g. {folder / '1.metadata'}."
    with np.load(folder / "expected.npz") as arrays:
        for name, key in (("0.metadata", "w"), ("1.metadata", "w@1")):
            _, tensors, _ = assemble(folder / name)
            assert tensors == {"w": arrays[key].tobytes()}


def convert(tmp_path: Path, source: Path, output_format: str, layout: str | None) -> Path:
    (tmp_path / "identity.aoa").write_text("# every key as it is\n")
    out = tmp_path / f"out-{output_format}-{layout}"
    args = ["convert", str(tmp_path / "identity.aoa"), "--source", str(source),
            "--output", str(out), "--output-format", output_format, "--quiet"]
    if layout is not None:
        with open_source(source) as checkpoint:
            (tmp_path / f"{layout}.toml").write_text(layout_text(layout, checkpoint.shards))
        args += ["--layout", str(tmp_path / f"{layout}.toml")]
    assert main(args) == 0
    return out


def torch_load(folder: Path, specs: dict[str, tuple]) -> dict[str, bytes]:
    """What torch.distributed.checkpoint.load reads into whole tensors."""
    state = {key: torch.zeros(shape, dtype=getattr(torch, dtype))
             for key, (shape, dtype) in specs.items()}
    dcp.load(state, checkpoint_id=str(folder), no_dist=True)
    return {key: tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
            for key, tensor in state.items()}


@pytest.mark.parametrize("layout", [None, "rows2", "grid4"])
@pytest.mark.parametrize("output_format", ["dcp", "torch_dist"])
@pytest.mark.parametrize("fixture", ["paddle/flat4", "paddle/tp2", "dcp/fsdp4",
                                     "torch_dist/tp2"])
def test_converted_checkpoints_load_in_torch(tmp_path, fixture, output_format, layout):
    out = convert(tmp_path, FIXTURES / fixture, output_format, layout)
    format, tensors, specs = assemble(out)
    assert format == output_format
    assert tensors == expected(fixture)
    assert torch_load(out, specs) == expected(fixture)
    if output_format == "torch_dist":
        config = json.loads((out / "metadata.json").read_text())
        assert config["sharded_backend"] == "torch_dist"
        assert torch.load(out / "common.pt", weights_only=True) is not None


def test_megatron_files_are_carried_over(tmp_path):
    source = FIXTURES / "torch_dist" / "tp2"
    out = convert(tmp_path, source, "torch_dist", "grid4")
    for name in ("common.pt", "metadata.json"):
        assert (out / name).read_bytes() == (source / name).read_bytes()
    assert torch.load(out / "common.pt", weights_only=True)["iteration"] == 7


def _objects(folder: Path) -> dict[str, object]:
    with open_source(folder) as source:
        return {key: torch.load(io.BytesIO(data), weights_only=True)
                for key, data in source.objects().items()}


#: The objects the fixtures' frameworks saved beside the tensors.
OBJECTS = {"dcp/tp2": {"step": 7},
           "torch_dist/tp2": {"rng/shard_0_2": [{"seed": 0}], "rng/shard_1_2": [{"seed": 1}]}}


@pytest.mark.parametrize("fixture", sorted(OBJECTS))
def test_objects_are_read_and_carried_within_their_family(tmp_path, fixture):
    assert _objects(FIXTURES / fixture) == OBJECTS[fixture]
    for output_format in ("dcp", "torch_dist"):
        out = convert(tmp_path, FIXTURES / fixture, output_format, "rows2")
        assert _objects(out) == OBJECTS[fixture]
    out = convert(tmp_path, FIXTURES / fixture, "paddle", "rows2")
    assert _objects(out) == {}


def test_a_carried_step_count_loads_in_torch(tmp_path):
    out = convert(tmp_path, FIXTURES / "dcp" / "tp2", "dcp", "grid4")
    _, _, specs = assemble(out)
    state: dict = {key: torch.zeros(shape, dtype=getattr(torch, dtype))
                   for key, (shape, dtype) in specs.items()}
    state["step"] = 0
    dcp.load(state, checkpoint_id=str(out), no_dist=True)
    assert state["step"] == 7


@pytest.mark.parametrize("fixture, layout", [
    ("dcp/tp2", None), ("dcp/tp2", "rows2"), ("torch_dist/fsdp4", "rows2"),
    ("paddle/single", None), ("paddle/flat4", "rows2")])
def test_converted_to_paddle_read_back_by_aoa(tmp_path, fixture, layout):
    out = convert(tmp_path, FIXTURES / fixture, "paddle", layout)
    format, tensors, _ = assemble(out)
    assert format == "paddle"
    assert tensors == expected(fixture)
    files = sorted(p.name for p in out.iterdir())
    assert files == (["0.metadata", "0_0.distcp"] if layout is None
                     else ["0.metadata", "0_0.distcp", "1_0.distcp"])


def _run_reference(python: Path, args: list[str]) -> None:
    result = subprocess.run([str(python), *args], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.skipif(PADDLE_PYTHON is None, reason="PaddlePaddle 3.3.1 venv not here")
@pytest.mark.parametrize("fixture", ["dcp/fsdp4", "torch_dist/tp2", "paddle/flat4"])
def test_converted_to_paddle_loads_in_paddle(tmp_path, fixture):
    assert PADDLE_PYTHON is not None
    out = convert(tmp_path, FIXTURES / fixture, "paddle", "grid4")
    _, _, specs = assemble(out)
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({key: [list(shape), dtype] for key, (shape, dtype)
                                in specs.items()}))
    _run_reference(PADDLE_PYTHON, [str(BENCH / "paddle_checkpoints.py"), "load", str(out),
                                   str(spec), str(tmp_path / "back.npz")])
    with np.load(tmp_path / "back.npz") as back:
        assert {key: back[key].tobytes() for key in back.files} == expected(fixture)


@pytest.mark.slow
@pytest.mark.skipif(MEGATRON_PYTHON is None, reason="Megatron-Core venv not here")
@pytest.mark.parametrize("fixture", ["paddle/tp2", "dcp/fsdp4", "torch_dist/tp2"])
def test_converted_to_torch_dist_loads_in_megatron(tmp_path, fixture):
    out = convert(tmp_path, FIXTURES / fixture, "torch_dist", "rows2")
    _, _, specs = assemble(out)
    spec = tmp_path / "spec.json"
    objects = OBJECTS.get(fixture, {})
    spec.write_text(json.dumps({**{key: [list(shape), dtype] for key, (shape, dtype)
                                   in specs.items()}, "@objects": sorted(objects)}))
    assert MEGATRON_PYTHON is not None
    _run_reference(MEGATRON_PYTHON, [str(BENCH / "torch_checkpoints.py"), "load-megatron",
                                     str(out), str(spec), str(tmp_path / "back.npz")])
    with np.load(tmp_path / "back.npz") as back:
        assert {key: back[key].tobytes() for key in back.files} == expected(fixture)
    if objects:
        loaded = json.loads((tmp_path / "back.objects.json").read_text())
        assert loaded == {key: repr(value[0]) for key, value in objects.items()}


def test_torch_bin_with_tied_and_transposed_tensors(tmp_path):
    torch.manual_seed(0)
    embed = torch.randn(6, 4)
    state = {"embed.weight": embed, "lm_head.weight": embed, "proj.weight": embed.t(),
             "norm.weight": torch.randn(4).to(torch.bfloat16), "step": 3}
    folder = tmp_path / "bin"
    folder.mkdir()
    torch.save(state, folder / "pytorch_model.bin")
    format, tensors, _ = assemble(folder)
    assert format == "bin"
    want = {key: value.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            for key, value in state.items() if isinstance(value, torch.Tensor)}
    assert tensors == want
    out = convert(tmp_path, folder, "dcp", "rows2")
    assert torch_load(out, {key: (tuple(v.shape), str(v.dtype)[6:]) for key, v in
                            state.items() if isinstance(v, torch.Tensor)}) == want


def test_sharded_bin_with_index(tmp_path):
    folder = tmp_path / "bin"
    folder.mkdir()
    parts = {"pytorch_model-00001-of-00002.bin": {"a": torch.ones(2, 3)},
             "pytorch_model-00002-of-00002.bin": {"b": torch.arange(4.0)}}
    weight_map = {}
    for name, part in parts.items():
        torch.save(part, folder / name)
        weight_map |= dict.fromkeys(part, name)
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"weight_map": weight_map}))
    _, tensors, _ = assemble(folder)
    assert tensors == {"a": torch.ones(2, 3).numpy().tobytes(),
                       "b": torch.arange(4.0).numpy().tobytes()}


def _sharded_bin(folder: Path, weight_map: dict[str, str], extra: bool = False) -> Path:
    folder.mkdir()
    torch.save({"a": torch.ones(2, 3)}, folder / "pytorch_model-00001-of-00002.bin")
    second = {"b": torch.arange(4.0)} | ({"c": torch.zeros(1)} if extra else {})
    torch.save(second, folder / "pytorch_model-00002-of-00002.bin")
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"weight_map": weight_map}))
    return folder / "pytorch_model.bin.index.json"


def test_a_bin_index_that_disagrees_with_its_files_is_refused(tmp_path):
    first, second = "pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin"
    for case, weight_map, key, name in (("wrong file", {"a": second, "b": second}, "a", second),
                                        ("not stored", {"a": first, "z": second}, "z", second)):
        index = _sharded_bin(tmp_path / case, weight_map)
        with pytest.raises(StorageError) as caught:
            open_source(index.parent)
        assert caught.value.message == (f"{index}: says tensor '{key}' is in '{name}', which "
                                        "does not hold it")
    index = _sharded_bin(tmp_path / "unnamed", {"a": first, "b": second}, extra=True)
    with pytest.raises(StorageError) as caught:
        open_source(index.parent)
    assert caught.value.message == (f"{index.parent / second}: tensor 'c' is not in the index "
                                    f"{index}")


@pytest.mark.parametrize("index_name", ["pytorch_model.bin.index.json",
                                        "model.safetensors.index.json"])
@pytest.mark.parametrize("text, says", [
    ('{"weight_map": {"a": "x.bin",}}', ":1:30: not valid JSON: Expecting property name "
                                         "enclosed in double quotes"),
    ('{"weight_map": {"a": 1}}', ": index has no weight_map object of key -> file name"),
    ('{"weight_map": {"a": "../x.bin"}}', ": file name '../x.bin' is not a name inside the "
                                           "folder"),
    ('{"weight_map": {"a": "gone.bin"}}', ": names shard file 'gone.bin', which does not "
                                           "exist"),
])
def test_a_broken_index_is_refused_alike_for_bin_and_safetensors(tmp_path, index_name, text,
                                                                  says):
    (tmp_path / index_name).write_text(text)
    with pytest.raises(StorageError) as caught:
        open_source(tmp_path)
    assert caught.value.message == f"{tmp_path / index_name}{says}"


# -------------------------------------------------------------------------------- bad input


def broken_copy(tmp_path: Path, fixture: str) -> Path:
    folder = tmp_path / "broken"
    shutil.copytree(FIXTURES / fixture, folder)
    return folder


BAD = {  # case: (fixture, how to break it, the message's start after the folder)
    "paddle truncated data": ("paddle/tp2", lambda f: _truncate(f / "1_0.distcp", 100),
                              "1_0.distcp: truncated"),
    "paddle missing data file": ("paddle/tp2", lambda f: (f / "1_0.distcp").unlink(),
                                 "0.metadata: names data file '1_0.distcp'"),
    "paddle truncated metadata": ("paddle/tp2", lambda f: _truncate(f / "0.metadata", 300),
                                  "0.metadata: truncated"),
    "dcp truncated data": ("dcp/tp2", lambda f: _truncate(f / "__1_0.distcp", 2000),
                           "__1_0.distcp: truncated"),
    "dcp missing data file": ("dcp/fsdp4", lambda f: (f / "__3_0.distcp").unlink(),
                              ".metadata: names data file '__3_0.distcp'"),
    "dcp truncated object": ("dcp/tp2", lambda f: _truncate(f / "__1_0.distcp", 1000),
                             "__1_0.distcp: truncated: the object 'step' needs bytes "
                             "[0, 1261) of a file of 1000"),
    "paddle array of no numpy dtype": ("paddle/tp2",
                                       lambda f: _replace(f / "0_0.distcp", b"\x8c\x02f4",
                                                          b"\x8c\x02i0"),
                                       "0_0.distcp: tensor 'qkv.weight' has numpy "
                                       "dtype 'i0', which aoa does not read"),
    "torch_dist truncated metadata": ("torch_dist/tp2",
                                      lambda f: _truncate(f / ".metadata", 500),
                                      ".metadata: truncated"),
}


def _truncate(path: Path, size: int) -> None:
    path.write_bytes(path.read_bytes()[:size])


def _replace(path: Path, old: bytes, new: bytes) -> None:
    data = path.read_bytes()
    assert data.count(old) == 1
    path.write_bytes(data.replace(old, new))


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_a_storage_error_naming_the_file_and_writes_nothing(tmp_path, case,
                                                                         capsys):
    fixture, breaking, message = BAD[case]
    folder = broken_copy(tmp_path, fixture)
    breaking(folder)
    with pytest.raises(StorageError) as caught:
        open_source(folder)
    assert caught.value.message.startswith(f"{folder}/{message}"), caught.value.message
    (tmp_path / "identity.aoa").write_text("# every key as it is\n")
    out = tmp_path / "out"
    assert main(["convert", str(tmp_path / "identity.aoa"), "--source", str(folder),
                 "--output", str(out), "--output-format", "dcp", "--quiet"]) != 0
    assert f"{folder}/{message}" in capsys.readouterr().err
    assert not out.exists() or not any(out.iterdir())


#: paddle/tp2's boxes, as its 0.metadata describes them: (key, local shape, global shape,
#: global offset, dtype, file)
TP2_BOXES = [("qkv.weight", (4, 4), (4, 8), (0, 0), "float32", "0_0.distcp"),
             ("qkv.weight", (4, 4), (4, 8), (0, 4), "float32", "1_0.distcp"),
             ("down.weight", (3, 4), (6, 4), (0, 0), "bfloat16", "0_0.distcp"),
             ("down.weight", (3, 4), (6, 4), (3, 0), "bfloat16", "1_0.distcp"),
             ("norm.weight", (4,), (4,), (0,), "float32", "1_0.distcp")]


def _paddle_tp2_metadata(folder: Path, boxes=TP2_BOXES, index_shapes=None) -> None:
    """paddle/tp2's metadata written again from ``boxes``; ``index_shapes``: the
    LocalTensorIndex local_shape of each box, where it says another than the box's."""
    value = metadata_value([(ShardDesc(*box[:5]), box[5]) for box in boxes])
    for (index, _), shape in zip(value.state["storage_metadata"].items, index_shapes or []):
        index.state["local_shape"] = shape
    (folder / "0.metadata").write_bytes(pickler.dumps(value).bytes())


def test_paddle_metadata_written_again_reads_as_the_fixture(tmp_path):
    folder = broken_copy(tmp_path, "paddle/tp2")
    _paddle_tp2_metadata(folder)
    assert assemble(folder) == assemble(FIXTURES / "paddle/tp2")


@pytest.mark.parametrize("boxes, index_shapes, message", [
    ([*TP2_BOXES[:1], ("qkv.weight", (4, 4), (4, 9), (0, 4), "float32", "1_0.distcp"),
      *TP2_BOXES[2:]], None,
     "state_dict_metadata's boxes of 'qkv.weight' disagree on its global shape: [4, 8] and "
     "[4, 9]"),
    (TP2_BOXES, [(4, 4), (4, 3)],
     "storage_metadata's box of 'qkv.weight' at [0, 4] has shape [4, 3], but "
     "state_dict_metadata's has [4, 4]"),
    ([*TP2_BOXES[:1], ("qkv.weight", (4, 4), (4, 8), (0, 4), "float32", "0_0.distcp"),
      *TP2_BOXES[2:]], None,
     "'0_0.distcp' holds one array of 'qkv.weight', but storage_metadata stores two boxes of "
     "it there (at [0, 0] and [0, 4])"),
])
def test_paddle_metadata_that_contradicts_itself_is_refused(tmp_path, boxes, index_shapes,
                                                            message):
    folder = broken_copy(tmp_path, "paddle/tp2")
    _paddle_tp2_metadata(folder, boxes, index_shapes)
    with pytest.raises(StorageError) as caught:
        open_source(folder)
    assert caught.value.message == f"{folder / '0.metadata'}: {message}"


def _dcp_tp2_storage_moved(folder: Path, key: str, **changes) -> None:
    """dcp/tp2's .metadata (read by torch) with the storage of ``key``'s last chunk (or
    object) changed."""
    import dataclasses
    import pickle

    metadata = pickle.loads((FIXTURES / "dcp/tp2/.metadata").read_bytes())
    index = [index for index in metadata.storage_data if index.fqn == key][-1]
    metadata.storage_data[index] = dataclasses.replace(metadata.storage_data[index], **changes)
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))


@pytest.mark.parametrize("key, changes, message", [
    ("qkv.weight", dict(relative_path="__0_0.distcp", offset=0),
     ".metadata: storage_data places the chunk of 'qkv.weight' at [0, 0] at bytes [0, 1641) "
     "and the chunk of 'qkv.weight' at [0, 4] at [0, 1641) of '__0_0.distcp', which overlap"),
    ("step", dict(offset=1261),
     ".metadata: storage_data places the object 'step' at bytes [1261, 2522) and the chunk "
     "of 'qkv.weight' at [0, 4] at [1261, 2902) of '__1_0.distcp', which overlap"),
    ("step", dict(length=1200),
     "__1_0.distcp: the object 'step' at bytes [0, 1200): not a zip archive (no end of "
     "central directory); truncated, or not written by torch.save"),
])
def test_dcp_storage_that_contradicts_itself_is_refused(tmp_path, key, changes, message):
    folder = broken_copy(tmp_path, "dcp/tp2")
    _dcp_tp2_storage_moved(folder, key)
    assert assemble(folder) == assemble(FIXTURES / "dcp/tp2")
    _dcp_tp2_storage_moved(folder, key, **changes)
    with pytest.raises(StorageError) as caught:
        open_source(folder)
    assert caught.value.message == f"{folder}/{message}"


def _pickle_asking_for(cls: str) -> bytes:
    module, name = cls.rsplit(".", 1)
    return b"\x80\x02c" + f"{module}\n{name}\n".encode() + b")R."


@pytest.mark.parametrize("fixture, name", [("paddle/tp2", "0.metadata"),
                                           ("paddle/tp2", "0_0.distcp"),
                                           ("dcp/tp2", ".metadata")])
def test_a_pickle_asking_for_a_forbidden_class_is_refused(tmp_path, fixture, name):
    folder = broken_copy(tmp_path, fixture)
    (folder / name).write_bytes(_pickle_asking_for("os.system"))
    with pytest.raises(StorageError) as caught:
        open_source(folder)
    assert caught.value.message == (f"{folder / name}: the pickle asks for 'os.system', "
                                    "which aoa does not load")


def test_a_dcp_archive_asking_for_a_forbidden_class_is_refused(tmp_path):
    state = {"w": torch.ones(2), "evil": _Evil()}
    with pytest.raises(StorageError, match=r"asks for 'subprocess\.Popen'"):
        folder = tmp_path / "bin"
        folder.mkdir()
        torch.save(state, folder / "pytorch_model.bin")
        open_source(folder)


class _Evil:
    def __reduce__(self):
        return (subprocess.Popen, (["true"],))


def test_offsets_past_the_end_are_refused(tmp_path):
    """A chunk whose byte range in the metadata runs past its data file."""
    folder = broken_copy(tmp_path, "dcp/tp2")
    size = (folder / "__0_0.distcp").stat().st_size
    _truncate(folder / "__0_0.distcp", size - 1)
    with pytest.raises(StorageError, match=r"__0_0\.distcp: truncated: the chunk of "):
        open_source(folder)


def test_a_failed_write_leaves_nothing(tmp_path):
    from aoa.jobs.convert import execute, prepare

    (tmp_path / "identity.aoa").write_text("# every key as it is\n")
    for output_format in ("paddle", "dcp", "torch_dist"):
        with open_source(FIXTURES / "dcp" / "tp2") as source:
            conversion = prepare(str(tmp_path / "identity.aoa"), source,
                                 output_format=output_format)
            executor_fill = conversion.job.executor

            def failing(*args, executor_fill=executor_fill, **kwargs):
                executor = executor_fill(*args, **kwargs)

                def fill(pieces):
                    raise RuntimeError("disk on fire")
                executor.fill = fill
                return executor
            conversion.job.executor = failing  # type: ignore[method-assign]
            out = tmp_path / f"failed-{output_format}"
            with pytest.raises(RuntimeError, match="disk on fire"):
                execute(conversion, out)
            assert not out.exists()  # not even the folder it made


def test_detection_by_folder_contents():
    from aoa.storage.formats import detect

    assert detect(FIXTURES / "paddle" / "tp2").name == "paddle"
    assert detect(FIXTURES / "paddle" / "tp2" / "0.metadata").name == "paddle"
    assert detect(FIXTURES / "dcp" / "fsdp4").name == "dcp"
    assert detect(FIXTURES / "torch_dist" / "tp2").name == "torch_dist"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
