"""The storage interface: formats by name, detection, and the output folder check."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors_files import dcp_file, save

from aoa.errors import StorageError, UsageError
from aoa.storage import FORMAT_NAMES, detect, format_named, open_source
from aoa.storage.folder import check_output_folder
from aoa.storage.formats import checkpoint_patterns


def test_every_name_of_the_issue_is_known() -> None:
    assert FORMAT_NAMES == ("safetensors", "dcp-safetensors", "paddle", "dcp", "torch_dist",
                            "bin")


@pytest.mark.parametrize(("name", "role", "message"), [
    ("npz", "source", "unknown source format 'npz'"),
    ("npz", "output", "unknown output format 'npz'"),
])
def test_unknown_names(name: str, role: str, message: str) -> None:
    with pytest.raises(UsageError) as caught:
        format_named(name, role)
    assert caught.value.message == message
    assert caught.value.hint == ("Choose one of: safetensors, dcp-safetensors, paddle, dcp, "
                                 "torch_dist, bin.")


@pytest.mark.parametrize("name", [n for n in FORMAT_NAMES if n not in ("safetensors",
                                                                       "dcp-safetensors")])
def test_names_not_yet_available(name: str) -> None:
    try:
        found = format_named(name, "output")
    except UsageError as error:
        assert error.message == f"output format '{name}' cannot be written by this version of aoa"
        assert error.hint is not None and "safetensors, dcp-safetensors" in error.hint
    else:  # a format module landed: it must say what it is
        assert found.name == name


def test_detection(tmp_path: Path) -> None:
    hf, sharded = tmp_path / "hf", tmp_path / "sharded"
    hf.mkdir()
    sharded.mkdir()
    save(hf / "model.safetensors", {"w": np.zeros(2, np.float32)})
    dcp_file(sharded / "a.safetensors", {"w": (np.zeros(2, np.float32), [0])})
    assert detect(hf).name == "safetensors"
    assert format_named("dcp-safetensors").claims(sharded)
    assert not format_named("dcp-safetensors").claims(hf)
    for folder, name in ((hf, "safetensors"), (sharded, "dcp-safetensors")):
        with open_source(folder) as source:
            assert source.format == name
        with open_source(folder / next(p.name for p in folder.iterdir()), name) as source:
            assert source.format == name


def test_source_format_given_by_name(tmp_path: Path) -> None:
    save(tmp_path / "model.safetensors", {"w": np.zeros(2, np.float32)})
    with open_source(tmp_path, "safetensors") as source:
        assert list(source.shards) == ["w"]
    with pytest.raises(UsageError) as caught:
        open_source(tmp_path, "pickle")
    assert caught.value.message == "unknown source format 'pickle'"


def test_output_folder_check(tmp_path: Path) -> None:
    patterns = checkpoint_patterns()
    assert {"*.safetensors", "model.safetensors.index.json"} <= set(patterns)
    check_output_folder(tmp_path / "new", patterns)
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    (tmp_path / ".aoa-staging").mkdir()
    (tmp_path / ".aoa-staging" / "model.safetensors").write_text("a file of another run")
    check_output_folder(tmp_path, patterns)
    save(tmp_path / "model.safetensors", {"w": np.zeros(2, np.float32)})
    with pytest.raises(StorageError) as caught:
        check_output_folder(tmp_path, patterns)
    assert caught.value.message == (
        f"{tmp_path}: the output folder already holds a checkpoint (model.safetensors)")
    with pytest.raises(StorageError) as caught:
        check_output_folder(tmp_path / "notes.txt", patterns)
    assert caught.value.message == f"{tmp_path / 'notes.txt'}: the output is a file, not a folder"


def test_output_folder_check_asks_for_the_patterns_only_when_a_file_is_there(
        tmp_path: Path) -> None:
    """Finding every format's patterns imports every format: a new or empty folder (hidden
    files aside) is fine without them."""
    asked = []

    def patterns() -> tuple[str, ...]:
        asked.append(True)
        return checkpoint_patterns()

    check_output_folder(tmp_path / "new", patterns)
    (tmp_path / ".aoa-lock").write_text("")
    check_output_folder(tmp_path, patterns)
    assert asked == []
    save(tmp_path / "model.safetensors", {"w": np.zeros(2, np.float32)})
    with pytest.raises(StorageError) as caught:
        check_output_folder(tmp_path, patterns)
    assert asked == [True]
    assert caught.value.message == (
        f"{tmp_path}: the output folder already holds a checkpoint (model.safetensors)")
