"""`aoa.forked` and the work it takes to the second core (the `--destination` read while the
source opens, the later rank files' headers while the first are read): a child's result is
what reading here makes, and whatever goes wrong in the child, the work is done here, with
its own errors, in the order they came before."""

from __future__ import annotations

import itertools
import json
import os
import threading
import traceback
from pathlib import Path

import numpy as np
import pytest
from safetensors_files import dcp_file, save

from aoa import cli
from aoa.errors import StorageError, UsageError
from aoa.forked import forked, meanwhile
from aoa.layout import ShardDesc, sharded_alike
from aoa.mapping import read_shard_info, shard_info_read_aside
from aoa.storage import safetensors as safetensors_module
from aoa.storage import safetensors_folder
from aoa.storage.formats import Source, open_source
from aoa.storage.safetensors import SafetensorsFile


def _reaped(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return False


def test_a_child_hands_its_result_over_and_is_reaped() -> None:
    with forked(lambda: (os.getpid(), [1, (2, 3)])) as pending:
        assert pending is not None
        pid, value = pending.result()
        assert pending.result() is None  # asked once
    assert pid != os.getpid() and value == [1, (2, 3)]
    assert _reaped(pending._pid)


def test_a_child_that_fails_gives_no_result() -> None:
    def fail() -> None:
        raise UsageError("no")

    with forked(fail) as pending:
        assert pending is not None and pending.result() is None


def test_a_child_not_asked_is_stopped_when_the_block_ends() -> None:
    with pytest.raises(KeyError), forked(lambda: threading.Event().wait(30)) as pending:
        assert pending is not None
        raise KeyError("the block failed")
    assert _reaped(pending._pid)


def test_no_child_while_another_thread_runs() -> None:
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        with forked(lambda: 1) as pending:
            assert pending is None
    finally:
        stop.set()
        thread.join()


def test_work_given_meanwhile_is_done_once_before_a_result_waits() -> None:
    done = []
    with meanwhile(lambda: done.append("meanwhile")):
        with forked(lambda: done == []) as pending:  # (the child's copy of ``done``)
            assert pending is not None and done == []
            assert pending.result() is True
            assert done == ["meanwhile"]
        with forked(lambda: 2) as pending:
            assert pending is not None and pending.result() == 2
    assert done == ["meanwhile"]
    with meanwhile(lambda: done.append("not asked")):
        pass
    with forked(lambda: 3) as pending:
        assert pending is not None and pending.result() == 3
    assert done == ["meanwhile"]


def test_an_error_of_work_meanwhile_is_raised_where_the_result_is_asked() -> None:
    def fail() -> None:
        raise UsageError("no")

    with meanwhile(fail), forked(lambda: 1) as pending, pytest.raises(UsageError):
        assert pending is not None
        pending.result()


def _big_shard_info(path: Path, experts: int = 4000) -> dict[str, list[ShardDesc]]:
    """Shard-info JSON over 1 MB (read aside), as `json.dumps` writes it."""
    info = {f"layers.{n // 100}.experts.{n % 100}.weight": [
        ShardDesc(f"layers.{n // 100}.experts.{n % 100}.weight", (4, 8), (8, 8), (4 * half, 0),
                  "bfloat16") for half in range(2)] for n in range(experts)}
    path.write_text(json.dumps({key: [s.to_json() for s in shards]
                                for key, shards in info.items()}))
    assert path.stat().st_size > 1 << 20
    return info


def test_shard_info_read_aside_is_what_reading_here_makes(tmp_path: Path, monkeypatch) -> None:
    expected = _big_shard_info(tmp_path / "d.json")
    with shard_info_read_aside(tmp_path / "d.json", "destination") as result, \
            monkeypatch.context() as patched:
        patched.setattr("aoa.mapping.read_shard_info", None)  # (so the result is the child's)
        found = result()
    assert found == expected == read_shard_info(tmp_path / "d.json", "destination")
    assert sharded_alike(found) == sharded_alike(read_shard_info(tmp_path / "d.json", "x"))


def test_a_fault_found_aside_is_the_error_of_reading_here(tmp_path: Path) -> None:
    _big_shard_info(tmp_path / "d.json")
    path = tmp_path / "d.json"
    path.write_text(path.read_text().replace('"global_shape": [8, 8]', '"global_shape": [3, 8]',
                                             1))
    with pytest.raises(UsageError) as here:
        read_shard_info(path, "destination")
    with pytest.raises(UsageError) as aside, \
            shard_info_read_aside(path, "destination") as result:
        result()
    assert aside.value.render() == here.value.render()
    assert "layers.0.experts.0.weight" in here.value.render()


def test_a_bad_destination_is_reported_before_a_bad_source(tmp_path: Path, capsys) -> None:
    _big_shard_info(tmp_path / "d.json")
    path = tmp_path / "d.json"
    path.write_text(path.read_text()[:-5])
    (tmp_path / "m.aoa").write_text("a -> b\n")
    code = cli.main(["convert", str(tmp_path / "m.aoa"), "--source", str(tmp_path / "none"),
                     "--destination", str(path), "--output", str(tmp_path / "out")])
    assert code == cli.EXIT_USAGE
    assert capsys.readouterr().err.startswith(f"aoa: error: {path}:1:")  # not the source's


def test_the_destination_read_while_the_source_is_opened_is_as_read_after(
        tmp_path: Path, monkeypatch) -> None:
    expected = _big_shard_info(tmp_path / "d.json")
    _dcp_ranks(tmp_path / "source")
    asked = []
    args = cli.build_parser().parse_args(
        ["convert", "m.aoa", "--source", str(tmp_path / "source"),
         "--destination", str(tmp_path / "d.json"), "--output", str(tmp_path / "out")])
    with shard_info_read_aside(args.destination, "destination") as result:
        def destination() -> object:
            asked.append([frame.name for frame in traceback.extract_stack()][-4:-1])
            return result()

        found, source = cli._source_then_destination(args, destination)
    source.close()
    assert found == expected
    assert asked == [["open_all_reading", "result", "once"]]  # once, as the header child read


@pytest.mark.parametrize("source_bad", [False, True])
def test_a_bad_destination_made_meanwhile_is_reported_once_and_first(
        tmp_path: Path, capsys, source_bad: bool) -> None:
    _big_shard_info(tmp_path / "d.json")
    path = tmp_path / "d.json"
    path.write_text(path.read_text().replace('"global_shape": [8, 8]', '"global_shape": [3, 8]',
                                             1))
    folder = _dcp_ranks(tmp_path / "source")
    if source_bad:
        rank = folder / "rank-00001-of-00002.safetensors"
        rank.write_bytes(rank.read_bytes()[:-4])
    (tmp_path / "m.aoa").write_text("a -> b\n")
    code = cli.main(["convert", str(tmp_path / "m.aoa"), "--source", str(folder),
                     "--destination", str(path), "--output", str(tmp_path / "out")])
    err = capsys.readouterr().err
    with pytest.raises(UsageError) as here:
        read_shard_info(path, "destination")
    assert code == cli.EXIT_USAGE and err == f"aoa: {here.value.render()}\n"


def _rank_files(folder: Path, ranks: int = 3, tensors: int = 16000) -> list[Path]:
    """Rank files whose headers are over 1 MB together past the first half (read aside)."""
    folder.mkdir()
    rng = np.random.default_rng(0)
    paths = []
    for rank in range(ranks):
        arrays = {f"layers.{n // 100}.experts.{n % 100}.w": rng.random((1, 2), np.float32)
                  for n in range(tensors)}
        paths.append(save(folder / f"rank-{rank:05d}-of-{ranks:05d}.safetensors", arrays))
    return paths


def _mapped_here(folder: Path) -> int:
    return Path("/proc/self/maps").read_text().count(str(folder))


def test_headers_read_aside_are_what_reading_here_makes(tmp_path: Path, monkeypatch) -> None:
    paths = _rank_files(tmp_path / "ranks")
    expected = [SafetensorsFile.open(path) for path in paths]
    parsed_here = []

    def parse(path: Path, data: object) -> object:
        parsed_here.append(path)
        return parse_here(path, data)

    parse_here = safetensors_module._parse
    monkeypatch.setattr(safetensors_module, "_parse", parse)
    opened = SafetensorsFile.open_all(paths)
    assert parsed_here == paths[:2]  # the third's header was read in the child
    for file, alone in zip(opened, expected):
        assert (file.path, file.metadata, file.columns) == (alone.path, alone.metadata,
                                                            alone.columns)
        assert bytes(file.whole("x")[-8:]) == bytes(alone.whole("x")[-8:])
    for file in opened + expected:
        file.close()
    assert _mapped_here(tmp_path) == 0


@pytest.mark.parametrize("broken", [[2], [0, 2], [1, 2]])
def test_a_header_refused_aside_is_refused_here_first_file_first(tmp_path: Path,
                                                                broken: list[int]) -> None:
    paths = _rank_files(tmp_path / "ranks")
    for at in broken:
        data = bytearray(paths[at].read_bytes())
        data[20:24] = b"\x00\x00\x00\x00"  # a control character in the header's JSON
        paths[at].write_bytes(bytes(data))
    with pytest.raises(StorageError) as alone:
        SafetensorsFile.open(paths[broken[0]])
    with pytest.raises(StorageError) as together:
        SafetensorsFile.open_all(paths)
    assert together.value.render() == alone.value.render()
    assert _mapped_here(tmp_path) == 0  # nothing left open


def test_each_files_reading_is_made_where_its_header_is_read(tmp_path: Path) -> None:
    paths = _rank_files(tmp_path / "ranks")
    opened = SafetensorsFile.open_all_reading(
        paths, lambda file: (os.getpid(), file.columns.names[-1]))
    assert [pid == os.getpid() for _, (pid, _) in opened] == [True, True, False]
    assert [last for _, (_, last) in opened] == [file.columns.names[-1] for file, _ in opened]
    for file, _ in opened:
        file.close()
    assert _mapped_here(tmp_path) == 0


def _dcp_ranks(folder: Path, tensors: int = 12000) -> Path:
    """Two rank files of a DCP folder, each key cut in two rows, sharding info over 1 MB."""
    folder.mkdir()
    rng = np.random.default_rng(0)
    arrays = {f"layers.{n // 100}.experts.{n % 100}.w": rng.random((2, 3), np.float32)
              for n in range(tensors)}
    for rank in range(2):
        dcp_file(folder / f"rank-{rank:05d}-of-00002.safetensors",
                 {key: (array[rank:rank + 1], [rank, 0]) for key, array in arrays.items()})
    return folder


def _locations(source: Source) -> list[object]:
    return source.locations(list(itertools.chain.from_iterable(source.shards.values())))


def test_sharding_info_read_aside_opens_the_source_reading_here_opens(tmp_path: Path,
                                                                      monkeypatch) -> None:
    folder = _dcp_ranks(tmp_path / "ranks")
    read_ahead = []

    def offsets(file: SafetensorsFile) -> object:
        read_ahead.append(file.path)  # (the parent's only: the child's list is its own)
        return offsets_here(file)

    offsets_here = safetensors_folder._offsets_read_ahead
    monkeypatch.setattr(safetensors_folder, "_offsets_read_ahead", offsets)
    with open_source(folder) as source:
        found = source.shards, _locations(source)
    assert read_ahead == [folder / "rank-00000-of-00002.safetensors"]  # rank 1's: the child's
    monkeypatch.setattr(safetensors_folder, "_offsets_read_ahead", lambda file: None)
    with open_source(folder) as source:
        assert found == (source.shards, _locations(source))
    assert len(found[0]) == 12000 and len(found[1]) == 24000


@pytest.mark.parametrize("fault", ["[1, 0, 0]", "[1, -1]", "[3, 0]"])
def test_a_fault_in_sharding_info_read_aside_is_the_error_of_reading_here(
        tmp_path: Path, monkeypatch, fault: str) -> None:
    folder = _dcp_ranks(tmp_path / "ranks")
    rank = folder / "rank-00001-of-00002.safetensors"
    data = rank.read_bytes()
    at = data.index(b"[1, 0]", data.index(b"DCP_SHARDING_INFO"))
    length = int.from_bytes(data[:8], "little") + len(fault) - 6
    rank.write_bytes(length.to_bytes(8, "little") + data[8:at] + fault.encode()
                     + data[at + 6:])
    with pytest.raises(StorageError) as aside:
        open_source(folder)
    monkeypatch.setattr(safetensors_folder, "_offsets_read_ahead", lambda file: None)
    with pytest.raises(StorageError) as here:
        open_source(folder)
    assert aside.value.render() == here.value.render()
    assert str(rank) in here.value.render()
