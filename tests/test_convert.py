"""`aoa convert` end to end: generated checkpoints in both source formats, both destination
formats, read back with the `safetensors` package and compared with numpy."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from safetensors.numpy import load_file
from safetensors_files import read_back, save

from aoa.cli import main
from aoa.jobs.convert import destination_shards
from aoa.layout import ShardDesc

MAPPING = """\
# rename, fuse gate/up, transpose, cast
a.$LAYER_ID.gate^T, a.$LAYER_ID.up^T -> b.$LAYER_ID.up_gate, fused_ffn
a.$LAYER_ID.norm -> b.$LAYER_ID.norm, dtype='float32'
"""
LAYOUT = """\
[mesh]
tp = 2

[[rule]]
match = "b.*.up_gate"
tp = 1
"""


def tensors(seed=0):
    rng = np.random.default_rng(seed)
    out = {}
    for layer in range(2):
        out[f"a.{layer}.gate"] = rng.standard_normal((8, 4), dtype=np.float32)
        out[f"a.{layer}.up"] = rng.standard_normal((8, 4), dtype=np.float32)
        out[f"a.{layer}.norm"] = rng.standard_normal(4).astype(ml_dtypes.bfloat16)
    return out


def expected_full(hf):
    out = {}
    for layer in range(2):
        gate, up = hf[f"a.{layer}.gate"].T, hf[f"a.{layer}.up"].T
        out[f"b.{layer}.up_gate"] = np.concatenate([gate, up], axis=1)
        out[f"b.{layer}.norm"] = hf[f"a.{layer}.norm"].astype(np.float32)
    return out


def expected_rank(hf, rank):
    out = {}
    for layer in range(2):
        gate, up = hf[f"a.{layer}.gate"].T, hf[f"a.{layer}.up"].T
        half = slice(rank * 4, rank * 4 + 4)
        out[f"b.{layer}.up_gate"] = np.concatenate([gate[:, half], up[:, half]], axis=1)
        out[f"b.{layer}.norm"] = hf[f"a.{layer}.norm"].astype(np.float32)
    return out


@pytest.fixture
def workspace(tmp_path):
    (tmp_path / "map.aoa").write_text(MAPPING)
    (tmp_path / "tp2.toml").write_text(LAYOUT)
    return tmp_path


def hf_single(folder: Path, hf):
    folder.mkdir()
    save(folder / "model.safetensors", hf)


def hf_index(folder: Path, hf):
    folder.mkdir()
    names = sorted(hf)
    parts = {"model-00001-of-00002.safetensors": names[:3],
             "model-00002-of-00002.safetensors": names[3:]}
    weight_map = {}
    for file, keys in parts.items():
        save(folder / file, {k: hf[k] for k in keys})
        weight_map |= dict.fromkeys(keys, file)
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": weight_map}))


def dcp_sharded(folder: Path, hf):
    """Each tensor split in two along axis 0 over two files, with DCP_SHARDING_INFO."""
    folder.mkdir()
    for rank in range(2):
        chunk, info = {}, {}
        for key, array in hf.items():
            half = array.shape[0] // 2
            chunk[key] = np.ascontiguousarray(array[rank * half:(rank + 1) * half])
            info[key] = {"saved_offsets": [rank * half] + [0] * (array.ndim - 1)}
        save(folder / f"shard-{rank}.safetensors", chunk,
             {"DCP_SHARDING_INFO": json.dumps(info)})


SOURCES = {"hf_single": hf_single, "hf_index": hf_index, "dcp_sharded": dcp_sharded}


@pytest.mark.parametrize("source_format", sorted(SOURCES))
def test_convert_to_full_hf(workspace, source_format):
    hf = tensors()
    SOURCES[source_format](workspace / "src", hf)
    assert main(["convert", str(workspace / "map.aoa"), "--source", str(workspace / "src"),
                 "--output", str(workspace / "out"), "--quiet"]) == 0
    got = read_back(workspace / "out" / "model.safetensors")
    want = expected_full(hf)
    assert set(got) == set(want)
    for key in want:
        assert got[key].dtype == want[key].dtype
        assert got[key].tobytes() == want[key].tobytes(), key


@pytest.mark.parametrize("source_format", sorted(SOURCES))
def test_convert_to_tensor_parallel_ranks(workspace, source_format):
    hf = tensors()
    SOURCES[source_format](workspace / "src", hf)
    assert main(["convert", str(workspace / "map.aoa"), "--source", str(workspace / "src"),
                 "--output", str(workspace / "out"), "--layout", str(workspace / "tp2.toml"),
                 "--quiet", "--threads", "2"]) == 0
    for rank in range(2):
        path = workspace / "out" / f"rank-{rank:05d}-of-00002.safetensors"
        got = read_back(path)
        want = expected_rank(hf, rank)
        assert set(got) == set(want)
        for key in want:
            assert got[key].tobytes() == want[key].tobytes(), (rank, key)
        from safetensors import safe_open

        with safe_open(str(path), "np") as f:
            info = json.loads(f.metadata()["DCP_SHARDING_INFO"])
        assert info["b.0.up_gate"]["saved_offsets"] == [0, 8 * rank]


def test_split_output_files_with_index(workspace):
    hf = tensors()
    hf_single(workspace / "src", hf)
    assert main(["convert", str(workspace / "map.aoa"), "--source", str(workspace / "src"),
                 "--output", str(workspace / "out"), "--quiet",
                 "--max-file-size", "0.0000002"]) == 0
    index = json.loads((workspace / "out" / "model.safetensors.index.json").read_text())
    want = expected_full(hf)
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in want.values())
    for key, file in index["weight_map"].items():
        assert read_back(workspace / "out" / file)[key].tobytes() == want[key].tobytes()
    assert load_file(str(workspace / "out" / index["weight_map"]["b.0.up_gate"]))


def test_round_trip_sharded_output_reads_back_as_source(workspace):
    hf = tensors()
    hf_single(workspace / "src", hf)
    assert main(["convert", str(workspace / "map.aoa"), "--source", str(workspace / "src"),
                 "--output", str(workspace / "tp2"), "--layout", str(workspace / "tp2.toml"),
                 "--quiet"]) == 0
    (workspace / "same.aoa").write_text("")
    assert main(["convert", str(workspace / "same.aoa"), "--source", str(workspace / "tp2"),
                 "--output", str(workspace / "full"), "--quiet"]) == 0
    got = read_back(workspace / "full" / "model.safetensors")
    # Resharding alone (no statements) gathers the rank-local layout back into one tensor.
    for key in ("b.0.up_gate", "b.1.norm"):
        whole = np.concatenate([expected_rank(hf, r)[key] for r in range(2)], axis=-1) \
            if key.endswith("up_gate") else expected_full(hf)[key]
        assert got[key].tobytes() == whole.tobytes()


def test_dry_run_writes_nothing(workspace, capsys):
    hf_single(workspace / "src", tensors())
    assert main(["convert", str(workspace / "map.aoa"), "--source", str(workspace / "src"),
                 "--output", str(workspace / "out"), "--layout", str(workspace / "tp2.toml"),
                 "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert "rank-00000-of-00002.safetensors" in printed
    assert "b.0.up_gate  float32  [4, 8] at [0, 0] of [4, 16]" in printed
    assert not (workspace / "out").exists()


def no_partial_files(folder: Path) -> bool:
    return not folder.exists() or not any(folder.iterdir())


def _unknown_key(workspace):
    hf_single(workspace / "src", tensors())
    (workspace / "map.aoa").write_text("a.0.gate -> x\nmissing.key -> y\n")
    return "map.aoa:2:1: error: 'missing.key' is neither a source key nor assigned before"


def _missing_shard_file(workspace):
    hf_index(workspace / "src", tensors())
    (workspace / "src" / "model-00002-of-00002.safetensors").unlink()
    return "model-00002-of-00002.safetensors"


def _truncated_source(workspace):
    hf_single(workspace / "src", tensors())
    path = workspace / "src" / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-10])
    return "model.safetensors: tensor 'a.0.norm': truncated"


@pytest.mark.parametrize("make", [_unknown_key, _missing_shard_file, _truncated_source])
def test_bad_input_is_an_error_and_writes_nothing(workspace, capsys, make):
    fragment = make(workspace)
    assert main(["convert", str(workspace / "map.aoa"), "--source", str(workspace / "src"),
                 "--output", str(workspace / "out"), "--quiet"]) == 1
    assert fragment in capsys.readouterr().err
    assert no_partial_files(workspace / "out")


def _rows(*spans: tuple[int, int]) -> list[dict]:
    """Shards of the rows ``spans`` of an [8, 4] float32 tensor 'g', as shard-info JSON."""
    return [{"key": "g", "local_shape": [stop - start, 4], "global_shape": [8, 4],
             "global_offset": [start, 0], "dtype": "float32"} for start, stop in spans]


@pytest.mark.parametrize("spans, message", [
    (((0, 4), (4, 8), (0, 4)), None),  # a replica counts once
    (((0, 4),), "the destination shards of 'g' cover 16 of the 32 elements of its global "
                "shape [8, 4]"),
    (((0, 4), (2, 6), (6, 8)), "the destination shards of 'g' overlap: [0:4, 0:4] and "
                               "[2:6, 0:4] share elements of its global shape [8, 4]"),
    (((0, 4), (4, 8), (4, 4)), "the destination shards of 'g' put an empty box of shape "
                               "[0, 4] at [4, 0], where the box of shape [4, 4] starts"),
])
def test_a_shard_list_must_tile_each_tensor(workspace, capsys, spans, message):
    """A checkpoint written from a shard list that leaves elements out, or overlaps, would
    be read by no reader whole (aoa's included): refused, nothing written."""
    hf = tensors()
    hf_single(workspace / "src", hf)
    (workspace / "g.aoa").write_text("a.0.gate -> g\n")
    (workspace / "dst.json").write_text(json.dumps({"g": _rows(*spans)}))
    status = main(["convert", str(workspace / "g.aoa"), "--source", str(workspace / "src"),
                   "--destination", str(workspace / "dst.json"), "--output",
                   str(workspace / "out"), "--quiet"])
    if message is None:
        assert status == 0
        ranks = [read_back(workspace / "out" / f"rank-0000{rank}-of-00003.safetensors")
                 for rank in range(3)]
        assert [rank["g"].tobytes() for rank in ranks] == [
            hf["a.0.gate"][start:stop].tobytes() for start, stop in spans]
        return
    assert status == 1
    assert f"error: {message}" in capsys.readouterr().err
    assert no_partial_files(workspace / "out")


def test_an_empty_box_where_none_starts_is_written_and_reads_back(workspace):
    """A shard list may give a rank an empty box (no rows) where no other box starts: the
    checkpoint written reads back whole, as a source again."""
    hf = tensors()
    hf_single(workspace / "src", hf)
    (workspace / "g.aoa").write_text("a.0.gate -> g\n")
    (workspace / "dst.json").write_text(json.dumps({"g": _rows((0, 4), (4, 8), (8, 8))}))
    assert main(["convert", str(workspace / "g.aoa"), "--source", str(workspace / "src"),
                 "--destination", str(workspace / "dst.json"), "--output",
                 str(workspace / "ranks"), "--quiet"]) == 0
    (workspace / "same.aoa").write_text("g -> g\n")
    assert main(["convert", str(workspace / "same.aoa"), "--source", str(workspace / "ranks"),
                 "--output", str(workspace / "whole"), "--quiet"]) == 0
    assert read_back(workspace / "whole" / "model.safetensors")["g"].tobytes() == \
        hf["a.0.gate"].tobytes()


def test_output_folder_that_cannot_be_made(workspace, capsys):
    hf_single(workspace / "src", tensors())
    (workspace / "a_file").write_text("not a folder")
    assert main(["convert", str(workspace / "map.aoa"), "--source", str(workspace / "src"),
                 "--output", str(workspace / "a_file" / "out"), "--quiet"]) == 1
    assert "a_file" in capsys.readouterr().err


def test_output_folder_with_a_checkpoint_is_refused(workspace, capsys):
    hf_single(workspace / "src", tensors())
    args = ["convert", str(workspace / "map.aoa"), "--source", str(workspace / "src"),
            "--output", str(workspace / "out"), "--quiet"]
    assert main(args) == 0
    assert main(args) == 1
    assert "already holds a checkpoint" in capsys.readouterr().err


def test_failure_during_copies_leaves_no_files(workspace, monkeypatch):
    hf_single(workspace / "src", tensors())
    from aoa.runtime import executor

    def broken(*args, **kwargs):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(executor, "_run", broken)
    with pytest.raises(RuntimeError):
        main(["convert", str(workspace / "map.aoa"), "--source", str(workspace / "src"),
              "--output", str(workspace / "out"), "--layout", str(workspace / "tp2.toml"),
              "--quiet"])
    assert no_partial_files(workspace / "out")


def test_optimizer_states_follow_their_parameter(workspace):
    hf = tensors()
    rng = np.random.default_rng(1)
    for layer in range(2):
        for name in ("gate", "up"):
            hf[f"a.{layer}.{name}.moment1_0"] = rng.standard_normal((8, 4), dtype=np.float32)
            hf[f"a.{layer}.{name}.beta1_pow_acc_0"] = np.array([0.9], np.float32)
    hf_single(workspace / "src", hf)
    assert main(["convert", str(workspace / "map.aoa"), "--source", str(workspace / "src"),
                 "--output", str(workspace / "out"), "--layout", str(workspace / "tp2.toml"),
                 "--quiet"]) == 0
    for rank in range(2):
        got = read_back(workspace / "out" / f"rank-{rank:05d}-of-00002.safetensors")
        moments = {k.replace(".moment1_0", ""): v for k, v in hf.items() if "moment1_0" in k}
        want = expected_rank(moments | {k: v for k, v in hf.items() if "norm" in k}, rank)
        assert got["b.0.up_gate.moment1_0"].tobytes() == want["b.0.up_gate"].tobytes()
        assert got["b.1.up_gate.beta1_pow_acc_0"].tobytes() == hf["a.1.gate.beta1_pow_acc_0"] \
            .tobytes()
        assert "b.0.norm.moment1_0" not in got  # the norm has no moments in the source


def test_output_format_by_name(workspace):
    """Whole tensors written as one rank of dcp-safetensors, read back as a checkpoint."""
    hf = tensors()
    hf_single(workspace / "src", hf)
    assert main(["convert", str(workspace / "map.aoa"), "--source", str(workspace / "src"),
                 "--source-format", "safetensors", "--output", str(workspace / "out"),
                 "--output-format", "dcp-safetensors", "--quiet"]) == 0
    path = workspace / "out" / "rank-00000-of-00001.safetensors"
    got, want = read_back(path), expected_full(hf)
    assert {key: value.tobytes() for key, value in got.items()} == {
        key: value.tobytes() for key, value in want.items()}
    from safetensors import safe_open

    with safe_open(str(path), "np") as f:
        info = json.loads(f.metadata()["DCP_SHARDING_INFO"])
    assert info["b.0.up_gate"]["saved_offsets"] == [0, 0]


@pytest.mark.parametrize(("option", "name", "message"), [
    ("--source-format", "npz", "aoa: error: unknown source format 'npz'"),
    ("--output-format", "npz", "aoa: error: unknown output format 'npz'"),
    ("--output-format", "bin", "aoa: error: output format 'bin' cannot be written"),
    ("--output-format", "safetensors", "aoa: error: the safetensors format (Hugging Face) "
                                       "holds whole tensors, not one file per rank"),
])
def test_format_names_refused(workspace, capsys, option, name, message):
    hf_single(workspace / "src", tensors())
    assert main(["convert", str(workspace / "map.aoa"), "--source", str(workspace / "src"),
                 "--output", str(workspace / "out"), "--layout", str(workspace / "tp2.toml"),
                 option, name, "--quiet"]) == 2
    assert capsys.readouterr().err.startswith(message)
    assert not (workspace / "out").exists()


@pytest.mark.parametrize(("where", "compiles"), [([], 1), (["--layout", "tp2.toml"], 2)],
                         ids=["whole-tensors", "mesh-layout"])
def test_compiles_once_unless_a_layout_needs_the_outputs_first(workspace, monkeypatch, where,
                                                               compiles):
    """A mesh layout's shards come from what the program makes, so it compiles twice (see
    aoa/jobs/job.py); everything else compiles once."""
    from aoa.jobs import job

    calls = []
    analyze = job.analyze
    monkeypatch.setattr(job, "analyze", lambda *a, **k: calls.append(1) or analyze(*a, **k))
    hf_single(workspace / "src", tensors())
    where = [str(workspace / w) if w.endswith(".toml") else w for w in where]
    assert main(["convert", str(workspace / "map.aoa"), "--source", str(workspace / "src"),
                 "--output", str(workspace / "out"), "--quiet", *where]) == 0
    assert len(calls) == compiles


@given(st.lists(st.integers(0, 4), max_size=12))
def test_a_shard_list_gives_rank_i_the_ith_shard_of_each_key(counts: list[int]) -> None:
    """Positions in the key-by-key listing: rank i holds the i-th listed shard of each key
    that has one."""
    listing = {f"k{k}": [ShardDesc(f"k{k}", (1,), (count,), (i,), "float32")
                         for i in range(count)] for k, count in enumerate(counts)}
    expected: list[list[int]] = []
    position = 0
    for count in counts:
        for i in range(count):
            while len(expected) <= i:
                expected.append([])
            expected[i].append(position)
            position += 1
    by_key, ranks = destination_shards(None, {}, destination=listing)
    assert by_key is listing
    assert ranks == expected
