"""Across ranks: two local processes on the CPU (gloo) against one process doing it all.

A tensor-parallel-2 load done by two ranks gives the bytes one process gives loading both
shards; each rank reads only the source shards its own shards need; a two-rank `aoa
convert` (torchrun's environment, or --rank/--world-size) writes the files one rank writes.
This file is also the ranks' program: `python test_distributed.py load ...`.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from sharding import shard_buffers

import aoa
from aoa import demo
from aoa.cli import main as cli_main
from aoa.jobs.distributed import split_files
from aoa.jobs.job import derived_outputs
from aoa.mapping import as_mapping
from aoa.mesh_layout import read_mesh_layout
from aoa.storage import OutputFile, open_source

TIMEOUT = 120
LAYOUT = demo.data_file("llama_tp2.toml")
MAPPING = demo.data_file("llama_fused_tp2.aoa")


def layout_ranks(source: Path, mapping: list[str] | str):
    with open_source(source) as checkpoint:
        outputs = derived_outputs(as_mapping(mapping), checkpoint.shards)
    shards = read_mesh_layout(LAYOUT).shards(outputs)
    return [shards.of_rank(rank) for rank in range(len(shards.ranks))]


def _statements(mapping: str) -> list[str] | str:
    return [] if mapping == "-" else Path(mapping).read_text()


# -- the ranks' program ----------------------------------------------------------------------


def rank_load(source: str, mapping: str, out: str) -> None:
    """Init gloo from the environment, load this rank's shards, save what it got."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    statements = _statements(mapping)
    into = shard_buffers(layout_ranks(Path(source), statements)[rank])
    loaded = aoa.load(statements, source=source, into=into, progress=False)
    arrays = {f"{key}@{i}": shard.buffer.reshape(-1).view(np.uint8)
              for key, shards in into.items() for i, shard in enumerate(shards)}
    np.savez(Path(out) / f"rank{rank}.npz", **arrays)
    read = [[s.key, list(s.global_offset)] for s in loaded.sources_read]
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(
        {"read": read, "filled": len(loaded.filled), "plan": len(loaded.plan.destinations)}))
    dist.destroy_process_group()


def rank_load_refused(source: str, out: str) -> None:
    """Rank 1 gives a read-only buffer: every rank raises, none waits for another."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    into = shard_buffers(layout_ranks(Path(source), MAPPING.read_text())[rank])
    if rank == 1:
        into["norm.weight"][0] = aoa.Shard(np.frombuffer(bytes(1024), np.float32), (256,))
    try:
        aoa.load(MAPPING, source=source, into=into, progress=False)
    except aoa.AoaError as error:
        (Path(out) / f"rank{rank}.txt").write_text(error.message)
    dist.destroy_process_group()


# -- the tests -------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(commands: list[list[str]], torchrun: bool) -> None:
    """Run one command per rank at once, with torchrun's environment when asked."""
    port = _free_port()
    processes = []
    for rank, command in enumerate(commands):
        env = dict(os.environ)
        env.pop("WORLD_SIZE", None)
        if torchrun:
            env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                    "LOCAL_RANK": str(rank), "WORLD_SIZE": str(len(commands)),
                    "LOCAL_WORLD_SIZE": str(len(commands))}
        processes.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        for process in processes:
            outputs.append(process.communicate(timeout=TIMEOUT)[0])
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    for rank, (process, output) in enumerate(zip(processes, outputs)):
        assert process.returncode == 0, f"rank {rank} failed:\n{output}"


def _bytes(into) -> dict[str, bytes]:
    return {f"{key}@{i}": shard.buffer.tobytes() for key, shards in into.items()
            for i, shard in enumerate(shards)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The demo's Hugging Face checkpoint, and its tensor-parallel-2 conversion."""
    root = tmp_path_factory.mktemp("distributed")
    hf = root / "hf"
    hf.mkdir()
    tensors = demo.make_checkpoint(hf)
    tp2 = root / "tp2"
    assert cli_main(["convert", str(MAPPING), "--source", str(hf), "--output", str(tp2),
                     "--layout", str(LAYOUT), "--quiet"]) == 0
    return hf, tp2, tensors


def test_split_files_balances_bytes():
    files = [OutputFile(f"f{i}", (i,), size) for i, size in enumerate([5, 1, 4, 2, 3])]
    shares = split_files(files, 2)
    assert [[f.filename for f in share] for share in shares] == [["f0", "f1", "f3"],
                                                                 ["f2", "f4"]]
    assert split_files(files, 1) == [files]


def test_two_ranks_load_what_one_process_loads(checkpoints, tmp_path):
    pytest.importorskip("torch.distributed")
    hf, _, tensors = checkpoints
    command = [sys.executable, __file__, "load", str(hf), str(MAPPING), str(tmp_path)]
    run_ranks([command, command], torchrun=True)
    ranks = layout_ranks(hf, MAPPING.read_text())
    whole = shard_buffers([s for shards in ranks for s in shards])
    aoa.load(MAPPING, source=hf, into=whole, progress=False)
    for rank in range(2):
        expected = demo.expected_shards(tensors, rank)
        with np.load(tmp_path / f"rank{rank}.npz") as got:
            for key, shards in whole.items():
                index = next(i for i, s in enumerate(ranks[rank]) if s.key == key)
                shard = shards[rank]
                assert got[f"{key}@0"].tobytes() == shard.buffer.tobytes(), (rank, key)
                assert got[f"{key}@0"].tobytes() == np.ascontiguousarray(
                    expected[key]).tobytes(), (rank, key)
                assert ranks[rank][index].global_offset == tuple(shard.global_offset)
        info = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert info["filled"] == len(ranks[rank])
        assert info["plan"] == sum(len(r) for r in ranks)  # every rank compiled every shard


def test_a_rank_that_cannot_load_stops_every_rank(checkpoints, tmp_path):
    pytest.importorskip("torch.distributed")
    hf, _, _ = checkpoints
    command = [sys.executable, __file__, "load-refused", str(hf), str(tmp_path)]
    run_ranks([command, command], torchrun=True)
    own = "the buffer for 'norm.weight' is read-only (numpy array)"
    assert (tmp_path / "rank1.txt").read_text() == own
    assert (tmp_path / "rank0.txt").read_text() == f"rank 1 cannot load: {own}"


def _intersects(a_offset, a_shape, b_offset, b_shape) -> bool:
    return all(max(a, b) < min(a + n, b + m)
               for a, n, b, m in zip(a_offset, a_shape, b_offset, b_shape))


def test_each_rank_reads_only_the_source_shards_it_needs(checkpoints, tmp_path):
    """Resharding a tensor-parallel-2 checkpoint onto the same layout: rank r reads the
    chunks that overlap its own shards, and of a split tensor only its own chunk."""
    pytest.importorskip("torch.distributed")
    _, tp2, _ = checkpoints
    command = [sys.executable, __file__, "load", str(tp2), "-", str(tmp_path)]
    run_ranks([command, command], torchrun=True)
    ranks = layout_ranks(tp2, [])
    with open_source(tp2) as checkpoint:
        stored = {key: [(s.global_offset, s.local_shape) for s in shards]
                  for key, shards in checkpoint.shards.items()}
    for rank in range(2):
        read = {(key, tuple(offset)) for key, offset in
                json.loads((tmp_path / f"rank{rank}.json").read_text())["read"]}
        needed = {(s.key, offset) for s in ranks[rank] for offset, shape in stored[s.key]
                  if _intersects(offset, shape, s.global_offset, s.local_shape)}
        assert read == needed
        assert ("embed_tokens.weight", (512 * (1 - rank), 0)) not in read
        with np.load(tmp_path / f"rank{rank}.npz") as got:
            written = open_source(tp2)
            try:
                for s in ranks[rank]:
                    chunk = next(c for c in written.shards[s.key]
                                 if c.global_offset == s.global_offset)
                    assert got[f"{s.key}@0"].tobytes() == bytes(written.buffer(chunk))
            finally:
                written.close()


def _convert(output: Path, hf: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "aoa.cli", "convert", str(MAPPING), "--source", str(hf),
            "--output", str(output), "--quiet", *extra]


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("where", [["--max-file-size", "0.0008"], ["--layout", str(LAYOUT)]],
                         ids=["hugging-face", "sharded"])
def test_two_rank_convert_under_torchrun(checkpoints, tmp_path, where):
    pytest.importorskip("torch.distributed")
    hf, _, _ = checkpoints
    assert cli_main(_convert(tmp_path / "one", hf, *where)[3:]) == 0
    run_ranks([_convert(tmp_path / "two", hf, *where)] * 2, torchrun=True)
    one, two = _files(tmp_path / "one"), _files(tmp_path / "two")
    assert len(one) >= 2
    assert one.keys() == two.keys()
    assert one == two


def test_two_rank_convert_with_rank_options(checkpoints, tmp_path):
    """No torch needed: ranks meet through marker files in the output folder."""
    hf, _, _ = checkpoints
    where = ["--max-file-size", "0.0008"]
    assert cli_main(_convert(tmp_path / "one", hf, *where)[3:]) == 0
    run_ranks([_convert(tmp_path / "two", hf, *where, "--rank", str(rank), "--world-size", "2")
               for rank in range(2)], torchrun=False)
    one, two = _files(tmp_path / "one"), _files(tmp_path / "two")
    assert "model.safetensors.index.json" in one
    assert one == two  # markers removed, index written once


def test_rank_options_refused(checkpoints, tmp_path, capsys):
    hf, _, _ = checkpoints
    assert cli_main(_convert(tmp_path / "x", hf, "--rank", "2", "--world-size", "2")[3:]) == 2
    assert "--rank 2 is not a rank of --world-size 2" in capsys.readouterr().err
    assert cli_main(_convert(tmp_path / "x", hf, "--rank", "0")[3:]) == 2
    assert "give --rank and --world-size together" in capsys.readouterr().err


def main(argv: list[str]) -> None:
    if argv[0] == "load":
        rank_load(*argv[1:])
    elif argv[0] == "load-refused":
        rank_load_refused(*argv[1:])
    else:
        raise SystemExit(f"unknown command {argv[0]!r}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main(sys.argv[1:])
