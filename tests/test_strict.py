"""Mistakes Paddle runs to a wrong checkpoint with exit code 0, refused by `aoa convert`,
`aoa check` and `aoa.load` unless asked to be lenient (issue 12, item 5): a template that
expands to nothing, a key passed on unmentioned while others are renamed, a layout rule
that decides nothing, a fused tensor (as the source's record says) re-laid without its
macro, a fused_qkv group split between ranks. Each is run as a user would, then with
--lenient / strict=False, which keep Paddle's behaviour."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors_files import read_back, save_folder
from test_models import QWEN3, hf_folder

import aoa
from aoa.cli import main
from aoa.dtypes import NUMPY_DTYPES
from aoa.record import RECORD
from aoa.storage.formats import open_source

LAYERS = 2


def weights(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {"model.norm.weight": rng.standard_normal(4, dtype=np.float32)}
    for layer in range(LAYERS):
        out[f"model.layers.{layer}.w"] = rng.standard_normal((4, 8), dtype=np.float32)
    return out


@pytest.fixture
def source(tmp_path) -> tuple[Path, dict[str, np.ndarray]]:
    arrays = weights()
    return save_folder(tmp_path / "hf", arrays), arrays


def cli(*arguments: object, capsys) -> tuple[int, str]:
    status = main([str(a) for a in arguments])
    return status, capsys.readouterr().err


def refused(folder: Path, mapping: Path, text: str, capsys) -> str:
    """``text`` saved as ``mapping`` and converted from ``folder`` into a folder beside it:
    refused, nothing written. The error printed."""
    mapping.write_text(text)
    out = mapping.parent / "out"
    status, err = cli("convert", mapping, "--source", folder, "--output", out, "--quiet",
                      capsys=capsys)
    assert status == 1 and not out.exists()
    return err


def written(folder: Path) -> dict[str, np.ndarray]:
    return {key: value for path in sorted(folder.glob("*.safetensors"))
            for key, value in read_back(path).items()}


# -- a template whose first name matches no source key ------------------------------------

TYPO = """\
modle.layers.$LAYER_ID.w -> layers.$LAYER_ID.w
model.norm.weight -> norm.weight
"""


def test_a_template_that_expands_to_nothing_is_refused(source, tmp_path, capsys):
    folder, _ = source
    err = refused(folder, tmp_path / "typo.aoa", TYPO, capsys)
    assert err.splitlines() == [
        f"{tmp_path / 'typo.aoa'}:1:1: error: 'modle.layers.$LAYER_ID.w' matches no source "
        "key: the statement expands to nothing",
        "    modle.layers.$LAYER_ID.w -> layers.$LAYER_ID.w",
        "    ^^^^^^^^^^^^^^^^^^^^^^^^",
        "  hint: Check the name against the source keys (a source key like it: "
        "'model.layers.0.w'), or delete the statement; --lenient (strict=False) lets it "
        "expand to nothing, as Paddle does."]
    status, check_err = cli("check", tmp_path / "typo.aoa", "--source", folder, capsys=capsys)
    assert (status, check_err) == (1, err)
    with pytest.raises(aoa.MacroError, match="expands to nothing"):
        aoa.load(TYPO, source=folder, into={}, progress=False)


def test_lenient_expands_it_to_nothing_as_paddle_does(source, tmp_path, capsys):
    folder, _ = source
    (tmp_path / "typo.aoa").write_text(TYPO)
    out = tmp_path / "out"
    status, err = cli("convert", tmp_path / "typo.aoa", "--source", folder, "--output", out,
                      "--quiet", "--lenient", capsys=capsys)
    assert status == 0
    assert "note: 'modle.layers.$LAYER_ID.w' matches no source key" in err
    # the keys it meant to rename pass on under their own names
    assert sorted(written(out)) == ["model.layers.0.w", "model.layers.1.w", "norm.weight"]


# -- a name written twice, the first result never read -------------------------------------

COPIED = """\
model.layers.0.w -> layers.0.w
model.layers.1.w -> layers.0.w
model.norm.weight -> norm.weight
"""


def test_a_name_written_over_before_anything_reads_it_is_refused(source, tmp_path, capsys):
    folder, arrays = source
    mapping = tmp_path / "copied.aoa"
    err = refused(folder, mapping, COPIED, capsys)
    assert err.splitlines() == [
        f"{mapping}:2:21: error: 'layers.0.w' is written again, but nothing read what the "
        f"statement at {mapping}:1:1 wrote to it: that result would be lost",
        "    model.layers.1.w -> layers.0.w",
        "                        ^^^^^^^^^^",
        "  hint: Give each result a name of its own (a template's target needs its "
        "placeholder); to change a tensor, read it: `t -> t, dtype='float16'`."]
    out = tmp_path / "out"
    status, err = cli("convert", mapping, "--source", folder, "--output", out, "--quiet",
                      "--lenient", capsys=capsys)
    assert status == 0 and "note: 'layers.0.w' is written again" in err
    got = written(out)  # Paddle's meaning: the last write
    assert sorted(got) == ["layers.0.w", "norm.weight"]
    assert got["layers.0.w"].tobytes() == arrays["model.layers.1.w"].tobytes()


@pytest.mark.parametrize(("statements", "reverse", "message"), [
    (["model.layers.$LAYER_ID.w -> axis"], False,
     "<statement 0>:1:29: error: 'axis' is written again, but nothing read what "
     "'model.layers.0.w -> axis' (expanded from the statement at <statement 0>:1:1) wrote to "
     "it: that result would be lost"),
    (["x.$LAYER_ID.w, dtype -> model.layers.$LAYER_ID.w, axis=1"], True,
     "<statement 0>:1:16: error: 'dtype' is written again, but nothing read what "
     "'x.1.w, dtype -> model.layers.1.w, axis=1' (expanded from the statement at "
     "<statement 0>:1:1) wrote to it: that result would be lost"),
])
def test_template_instances_writing_one_name_are_refused(statements, reverse, message):
    """A name spelled as a keyword needs no placeholder in a template (Q21), so each
    instance writes it; run backwards, a tensor joined to every layer is split off each."""
    shards = {key: [aoa.ShardDesc.full(key, array.shape, "float32")]
              for key, array in weights().items()}
    with pytest.raises(aoa.ValidationError) as raised:
        aoa.compile(statements, shards, reverse=reverse, strict=True)
    assert raised.value.render().splitlines()[0] == message


def test_a_name_read_before_it_is_written_again_passes():
    shards = {key: [aoa.ShardDesc.full(key, array.shape, "float32")]
              for key, array in weights().items()}
    aoa.compile(["model.layers.0.w -> t", "t -> u", "model.layers.1.w -> t",
                 "t -> t, dtype='float16'", "model.norm.weight -> n, axis=0",
                 "model.layers.0.w -> n"], shards, strict=True)


# -- a key no statement mentions, passed on while others are renamed ------------------------

FORGOTTEN = "model.layers.$LAYER_ID.w -> layers.$LAYER_ID.w\n"


def test_a_forgotten_key_is_refused(source, tmp_path, capsys):
    folder, arrays = source
    err = refused(folder, tmp_path / "forgot.aoa", FORGOTTEN, capsys)
    assert err.splitlines()[0] == (
        "error: source key 'model.norm.weight' reaches the output under its own name, but no "
        "statement mentions it, while statements rename other keys")
    status, check_err = cli("check", tmp_path / "forgot.aoa", "--source", folder,
                            capsys=capsys)
    assert (status, check_err) == (1, err)
    into = {f"layers.{n}.w": np.zeros((4, 8), np.float32) for n in range(LAYERS)}
    into["model.norm.weight"] = np.zeros(4, np.float32)
    with pytest.raises(aoa.ValidationError, match=r"'model\.norm\.weight' reaches the output"):
        aoa.load(FORGOTTEN, source=folder, into=into, progress=False)
    aoa.load(FORGOTTEN, source=folder, into=into, progress=False, strict=False)
    assert into["model.norm.weight"].tobytes() == arrays["model.norm.weight"].tobytes()


def test_keys_said_to_stay_and_a_pure_reshard_pass(source, tmp_path, capsys):
    folder, arrays = source
    (tmp_path / "kept.aoa").write_text(FORGOTTEN + "model.norm.weight -> model.norm.weight\n")
    (tmp_path / "reshard.aoa").write_text("# no statements: every key as it is\n")
    (tmp_path / "tp2.toml").write_text('[mesh]\ntp = 2\n\n[[rule]]\nmatch = "*.w"\ntp = 1\n')
    for name in ("kept", "reshard"):
        status, err = cli("convert", tmp_path / f"{name}.aoa", "--source", folder, "--output",
                          tmp_path / name, "--layout", tmp_path / "tp2.toml", "--quiet",
                          capsys=capsys)
        assert status == 0, err
    assert written(tmp_path / "reshard")["model.layers.1.w"].tobytes() == \
        arrays["model.layers.1.w"][:, 4:].tobytes()


# -- a layout rule that decides nothing ---------------------------------------------------

def test_a_layout_rule_that_matches_nothing_is_refused(source, tmp_path, capsys):
    folder, _ = source
    (tmp_path / "map.aoa").write_text("model.layers.$LAYER_ID.w -> layers.$LAYER_ID.w\n"
                                      "model.norm.weight -> norm.weight\n")
    (tmp_path / "tp2.toml").write_text('[mesh]\ntp = 2\n\n[[rule]]\nmatch = "layer.*.w"\n'
                                       'tp = 1\n')
    out = tmp_path / "out"
    arguments = ("--source", folder, "--layout", tmp_path / "tp2.toml")
    status, err = cli("convert", tmp_path / "map.aoa", *arguments, "--output", out, "--quiet",
                      capsys=capsys)
    assert status == 2 and not out.exists()
    assert err.splitlines() == [
        f"aoa: error: {tmp_path / 'tp2.toml'}: rule 1 (match = \"layer.*.w\") matches no "
        "tensor the mapping makes",
        "  hint: Check the pattern against the destination keys (a key like it: "
        "'layers.1.w'); a tensor no rule decides is replicated on every rank. --lenient "
        "(strict=False) lets such a rule decide nothing."]
    assert cli("check", tmp_path / "map.aoa", *arguments, capsys=capsys) == (2, err)
    status, _ = cli("convert", tmp_path / "map.aoa", *arguments, "--output", out, "--quiet",
                    "--lenient", capsys=capsys)
    assert status == 0
    assert written(out)["layers.0.w"].shape == (4, 8)  # replicated: the rule decided nothing


def test_a_rule_shadowed_by_an_earlier_one_is_refused(source, tmp_path, capsys):
    folder, _ = source
    (tmp_path / "map.aoa").write_text("model.layers.$LAYER_ID.w -> layers.$LAYER_ID.w\n"
                                      "model.norm.weight -> norm.weight\n")
    (tmp_path / "tp2.toml").write_text('[mesh]\ntp = 2\n\n[[rule]]\nmatch = "*"\ntp = 0\n\n'
                                       '[[rule]]\nmatch = "layers.*.w"\ntp = 1\n')
    status, err = cli("check", tmp_path / "map.aoa", "--source", folder, "--layout",
                      tmp_path / "tp2.toml", capsys=capsys)
    assert status == 2
    assert err.splitlines()[0] == (
        f"aoa: error: {tmp_path / 'tp2.toml'}: rule 2 (match = \"layers.*.w\") matches only "
        "keys an earlier rule decides (first match wins), such as 'layers.0.w'")


# -- a fused tensor re-laid without its macro --------------------------------------------------

UP_GATE = "model.layers.$LAYER_ID.mlp.up_gate_proj.weight"
TP4 = """\
[mesh]
tp = 4

[[rule]]
match = "model.layers.*.qkv_proj.weight"
tp = 1

[[rule]]
match = "model.layers.*.up_gate_proj.weight"
tp = 1
"""


@pytest.fixture
def paddleformers_tp2(tmp_path, capsys) -> tuple[Path, dict[str, np.ndarray]]:
    """Qwen3 converted to PaddleFormers' layout at tensor parallel 2: gate and up fused per
    rank, as the folder's record says."""
    tensors = hf_folder(tmp_path / "hf", QWEN3)
    out = tmp_path / "pf2"
    assert cli("convert", "--source", tmp_path / "hf", "--output", out, "--to",
               "paddleformers", "--tp", 2, "--quiet", capsys=capsys)[0] == 0
    assert (out / RECORD).is_file()
    return out, tensors


def test_a_fused_tensor_resharded_without_its_macro_is_refused(paddleformers_tp2, tmp_path,
                                                                 capsys):
    folder, _ = paddleformers_tp2
    (tmp_path / "reshard.aoa").write_text("# the same keys, laid out over 4 ranks\n")
    (tmp_path / "tp4.toml").write_text(TP4)
    out = tmp_path / "out"
    arguments = ("--source", folder, "--layout", tmp_path / "tp4.toml")
    status, err = cli("convert", tmp_path / "reshard.aoa", *arguments, "--output", out,
                      "--quiet", capsys=capsys)
    assert status == 1 and not out.exists()
    key = "model.layers.0.mlp.up_gate_proj.weight"
    assert err.splitlines() == [
        f"error: '{key}' is stored fused by fused_ffn over 2 shards (as {folder / RECORD} "
        f"records), but reaches '{key}' over 4 through no fused_ffn statement: copied as it "
        "lies, its parts would land on the wrong ranks",
        f"  hint: Re-lay it with its macro, e.g. `{key} -> {key}, fused_ffn` (a template with "
        "$LAYER_ID covers every layer); --lenient (strict=False) copies it as it lies."]
    assert cli("check", tmp_path / "reshard.aoa", *arguments, capsys=capsys) == (1, err)


def test_with_its_macro_each_rank_gets_its_own_gate_and_up(paddleformers_tp2, tmp_path,
                                                           capsys):
    folder, hf = paddleformers_tp2
    (tmp_path / "reshard.aoa").write_text(f"{UP_GATE} -> {UP_GATE}, fused_ffn\n")
    (tmp_path / "tp4.toml").write_text(TP4)
    arguments = ("--source", folder, "--layout", tmp_path / "tp4.toml", "--quiet")
    assert cli("convert", tmp_path / "reshard.aoa", *arguments, "--output", tmp_path / "out",
               capsys=capsys)[0] == 0
    assert cli("convert", tmp_path / "reshard.aoa", *arguments, "--output",
               tmp_path / "lenient", "--lenient", capsys=capsys)[0] == 0
    empty = tmp_path / "empty.aoa"
    empty.write_text("# as it lies\n")
    assert cli("convert", empty, *arguments, "--output", tmp_path / "as_it_lies", "--lenient",
               capsys=capsys)[0] == 0
    gate = hf["model.layers.1.mlp.gate_proj.weight"].T
    up = hf["model.layers.1.mlp.up_proj.weight"].T
    key = "model.layers.1.mlp.up_gate_proj.weight"
    for rank in range(4):
        columns = slice(rank * 16, rank * 16 + 16)
        want = np.concatenate([gate[:, columns], up[:, columns]], axis=1)
        name = f"rank-{rank:05d}-of-00004.safetensors"
        assert read_back(tmp_path / "out" / name)[key].tobytes() == want.tobytes()
        assert read_back(tmp_path / "lenient" / name)[key].tobytes() == want.tobytes()
        # what Paddle writes without the macro: the TP2 ranks' [gate_r | up_r] cut in four,
        # rank 0 all gate and rank 1 all up
        as_it_lies = read_back(tmp_path / "as_it_lies" / name)[key]
        half = np.concatenate([gate, up][rank % 2::2], axis=1)[:, rank // 2 * 32:][:, :32]
        assert as_it_lies.tobytes() == np.ascontiguousarray(half).tobytes() != want.tobytes()


# -- a fused_qkv group split between ranks --------------------------------------------------

def test_fused_qkv_groups_that_do_not_divide_the_ranks_are_refused(tmp_path, capsys):
    rng = np.random.default_rng(3)
    arrays = {"q": rng.standard_normal((8, 4), dtype=np.float32),  # 4 heads of 2
              "k": rng.standard_normal((4, 4), dtype=np.float32),  # 2 groups
              "v": rng.standard_normal((4, 4), dtype=np.float32)}
    folder = save_folder(tmp_path / "hf", arrays)
    (tmp_path / "qkv.aoa").write_text(
        "q^T, k^T, v^T -> qkv, fused_qkv, num_heads=4, num_key_value_groups=2\n")
    (tmp_path / "tp4.toml").write_text('[mesh]\ntp = 4\n\n[[rule]]\nmatch = "qkv"\ntp = 1\n')
    arguments = ("--source", folder, "--layout", tmp_path / "tp4.toml")
    status, err = cli("convert", tmp_path / "qkv.aoa", *arguments, "--output", tmp_path / "out",
                      "--quiet", capsys=capsys)
    assert status == 1 and not (tmp_path / "out").exists()
    assert err.splitlines()[0] == (
        f"{tmp_path / 'qkv.aoa'}:1:47: error: fused_qkv writes 'qkv' as 2 key/value groups, "
        "which do not divide over its 4 shards: a group would be split between ranks")
    assert cli("check", tmp_path / "qkv.aoa", *arguments, capsys=capsys) == (1, err)
    assert cli("convert", tmp_path / "qkv.aoa", *arguments, "--output", tmp_path / "out",
               "--quiet", "--lenient", capsys=capsys)[0] == 0


# -- a fused_in_proj tensor, which no statement can lay out again -----------------------------

def test_a_fused_in_proj_tensor_over_another_shard_count_is_refused(tmp_path):
    """fused_in_proj's parts may differ in size, so no statement lays its tensor out again
    (it cannot run backwards): the hint says to go back to Hugging Face and forward."""
    import json

    from aoa.pipeline import analyze
    from aoa.record import fused_record

    (tmp_path / RECORD).write_text(json.dumps({
        "family": "qwen3_5", "target": "paddleformers", "mesh": {"tp": 2},
        "source_dtypes": {}, "mapping": "q, z -> t, fused_in_proj, axis=0, tp_probe_key=t\n"}))
    fused = fused_record(tmp_path)
    source = {"t": [aoa.ShardDesc("t", (4, 2), (8, 2), (row, 0), "float32") for row in (0, 4)]}
    four = {"t": [aoa.ShardDesc("t", (2, 2), (8, 2), (row, 0), "float32")
                  for row in (0, 2, 4, 6)]}
    with pytest.raises(aoa.ValidationError) as error:
        analyze("", source, four, strict=True, fused=fused)
    assert error.value.message == (
        f"'t' is stored fused by fused_in_proj over 2 shards (as {tmp_path / RECORD} records), "
        "but reaches 't' over 4 through no fused_in_proj statement: copied as it lies, its "
        "parts would land on the wrong ranks")
    assert error.value.hint == (
        "fused_in_proj cannot lay it out again: convert the folder back (--to hf) and forward "
        "at the new degree; --lenient (strict=False) copies it as it lies.")
    analyze("", source, source, strict=True, fused=fused)  # at its own shard count
    analyze("", source, four, strict=False, fused=fused)


# -- a destination shard that gives no dtype -------------------------------------------------

def untyped_destination(tmp_path: Path, shape: tuple[int, ...]) -> Path:
    """A destination list of one key, 'w', in two row shards whose dtype is null."""
    rows = shape[0] // 2
    path = tmp_path / "destination.json"
    path.write_text(json.dumps({"w": [
        {"key": "w", "local_shape": [rows, *shape[1:]], "global_shape": list(shape),
         "global_offset": [start, *[0] * (len(shape) - 1)], "dtype": None}
        for start in (0, rows)]}))
    return path


@pytest.mark.parametrize("dtype", ["bfloat16", "float64"])
def test_a_destination_of_no_dtype_filled_from_another_is_refused(tmp_path, capsys, dtype):
    """No dtype reads as float32 (Paddle's reading of None): filled from a bfloat16 or
    float64 tensor, that is a cast nobody wrote."""
    folder = save_folder(tmp_path / "hf", {"w": np.ones((4, 2), NUMPY_DTYPES[dtype])})
    (tmp_path / "map.aoa").write_text("w -> w\n")
    out = tmp_path / "out"
    status, err = cli("convert", tmp_path / "map.aoa", "--source", folder, "--destination",
                      untyped_destination(tmp_path, (4, 2)), "--output", out, "--quiet",
                      capsys=capsys)
    assert (status, out.exists()) == (1, False)
    assert err.splitlines()[0] == (
        f"{tmp_path / 'map.aoa'}:1:1: error: destination 'w' [0:2, 0:2] gives no dtype, so it "
        f"is written as float32, but 'w' is {dtype}")
    assert err.splitlines()[-1] == (
        f"  hint: Give the destination its dtype ('{dtype}' keeps it), or cast: `... -> w, "
        "dtype='float32'`; --lenient (strict=False) writes float32, as Paddle reads a missing "
        "dtype.")


def test_lenient_writes_a_destination_of_no_dtype_as_float32(tmp_path, capsys):
    values = np.arange(8, dtype=np.float32).reshape(4, 2) / 3
    source = values.astype(NUMPY_DTYPES["bfloat16"])
    folder = save_folder(tmp_path / "hf", {"w": source})
    (tmp_path / "map.aoa").write_text("w -> w\n")
    out = tmp_path / "out"
    status, err = cli("convert", tmp_path / "map.aoa", "--source", folder, "--destination",
                      untyped_destination(tmp_path, (4, 2)), "--output", out, "--quiet",
                      "--lenient", capsys=capsys)
    assert status == 0
    assert "note: destination 'w' [0:2, 0:2] gives no dtype" in err
    with open_source(out) as written:
        (first, second) = written.shards["w"]
        assert (first.dtype, second.dtype) == ("float32", "float32")
        got = np.concatenate([np.frombuffer(written.buffer(s), np.float32).reshape(2, 2)
                              for s in (first, second)])
    assert got.tobytes() == source.astype(np.float32).tobytes()


def test_a_destination_of_no_dtype_filled_from_float32_passes(tmp_path, capsys):
    values = np.arange(8, dtype=np.float32).reshape(4, 2)
    folder = save_folder(tmp_path / "hf", {"w": values})
    (tmp_path / "map.aoa").write_text("w -> w\n")
    status, _ = cli("convert", tmp_path / "map.aoa", "--source", folder, "--destination",
                    untyped_destination(tmp_path, (4, 2)), "--output", tmp_path / "out",
                    "--quiet", capsys=capsys)
    assert status == 0
