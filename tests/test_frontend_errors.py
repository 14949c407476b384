"""Input that used to end in a raw Python error or minutes of work: each is now an AoaError
naming the place, before the work is done (bounds in python/aoa/limits.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

import aoa
from aoa import limits
from aoa.cli import main
from aoa.layout import ShardDesc

SOURCE = {"w": [ShardDesc.full("w", (4, 6), "float32")],
          "a": [ShardDesc.full("a", (8, 6), "float32")]}


def error_of(statements, source=SOURCE, destination=None) -> aoa.AoaError:
    with pytest.raises(aoa.AoaError) as caught:
        aoa.compile(statements, source, destination)
    return caught.value


def test_a_number_of_4301_digits_is_a_syntax_error_at_the_number():
    error = error_of("w -> v, axis=" + "9" * 4301)
    assert isinstance(error, aoa.AoaSyntaxError)
    assert error.render().splitlines()[0] == (
        "<aoa>:1:14: error: the number '999999999999999999999999999...9999999999999999999999999"
        "999' has 4301 digits, more than 18")


def test_a_long_line_is_shown_around_the_caret():
    lines = error_of("w -> v, axis=" + "9" * 4301).render().splitlines()
    assert lines[1] == "    w -> v, axis=" + "9" * 107 + "..."
    assert lines[2] == "    " + " " * 13 + "^" * 107


def test_a_permutation_of_strings_is_not_a_permutation():
    error = error_of("w -> v, permute='[0, \"x\"]'")
    assert isinstance(error, aoa.ValidationError)
    assert error.message == ("permute='[0, \"x\"]' is not a permutation of the 2 axes of 'w' "
                             "(shape [4, 6])")


@pytest.mark.parametrize("permute", ["[[[[1]]]]", "[" * 5000 + "]" * 5000, "[1e9, 0]",
                                     "[-1, 0]", "[" + "1" * 5000 + ", 0]", "(1, 0)"])
def test_permute_takes_only_a_list_of_axes(permute):
    assert isinstance(error_of(f"w -> v, permute='{permute}'"), aoa.ValidationError)


def test_fused_ffn_refuses_nothing_as_its_tensor():
    error = error_of("a -> _, fused_ffn")
    assert isinstance(error, aoa.MacroError)
    assert error.message == "fused_ffn cannot take '_' (nothing) as a tensor"
    assert (error.span.column, error.span.end_column) == (6, 7)


@pytest.mark.parametrize("statements", [[1, 2], None, 3, ["a -> b", None]])
def test_statements_must_be_texts(statements):
    error = error_of(statements)
    assert isinstance(error, aoa.UsageError)
    assert error.message.startswith("statements must be a text or a list of texts, not ")


# --- resource bombs ------------------------------------------------------------------------


def test_a_range_of_10_to_the_20_names_is_refused_as_a_number():
    error = error_of("w -> p[0:99999999999999999999], axis=0")
    assert error.message == "the number '99999999999999999999' has 20 digits, more than 18"


def test_a_range_of_ten_million_names_is_refused_before_it_is_made():
    error = error_of("w -> p[0:10000000], axis=0")
    assert isinstance(error, aoa.MacroError)
    assert error.message == "'p[0:10000000]' names 10000000 tensors, more than 16384"


@pytest.mark.parametrize("heads", ["9" * 18, str(limits.MAX_MACRO_NAMES + 1)])
def test_num_heads_beyond_the_bound_is_refused(heads):
    error = error_of(f"a -> q, fused_qkv_old, num_heads={heads}, num_key_value_groups=1")
    assert error.message == f"num_heads={heads} is more than 16384"


def test_concatenating_a_tensor_with_itself_stops_at_the_piece_bound():
    program = ["w -> t0"] + [f"t{i}, t{i} -> t{i + 1}, axis=0" for i in range(40)]
    error = error_of(program)
    assert isinstance(error, aoa.ShapeError)
    assert error.message == ("the result would be made of 131072 pieces of source tensors, "
                             "more than 65536")
    assert error.span.source.name == "<statement 17>"


def test_a_split_that_cuts_every_piece_stops_at_the_piece_bound():
    source = {"w": [ShardDesc.full("w", (512, 512), "float32")]}
    error = error_of(["w -> p[0:512], axis=1", "p[0:512] -> t, axis=1",
                      "t -> q[0:512], axis=0"], source)
    assert error.message == ("the result would be made of 262144 pieces of source tensors, "
                             "more than 65536")


def test_a_template_of_too_many_instances_is_refused_before_expanding():
    keys = [f"x.{i}.e.0.w" for i in range(1100)] + [f"x.0.e.{j}.w" for j in range(1000)]
    source = {key: [ShardDesc.full(key, (2,), "float32")] for key in keys}
    error = error_of("x.$LAYER_ID.e.$EXPERT_ID.w -> y.$LAYER_ID.e.$EXPERT_ID.w", source)
    assert isinstance(error, aoa.MacroError)
    assert error.message == (
        "'x.$LAYER_ID.e.$EXPERT_ID.w' would expand to 1100000 statements (1000 $EXPERT_ID "
        "times 1100 $LAYER_ID), more than 1048576")


def test_fused_ffn_between_coprime_shard_counts_is_bounded():
    rows = 4099 * 4093

    def shards(key, count):
        step = rows // count
        return [ShardDesc(key, (step, 2), (rows, 2), (i * step, 0), "float32")
                for i in range(count)]

    error = error_of("w -> v, fused_ffn, axis=0", {"w": shards("w", 4099)},
                     {"v": shards("v", 4093)})
    assert isinstance(error, aoa.MacroError)
    assert error.message == ("the 4099 source and 4093 destination shards of 'w' would cut "
                             "it into 16777207 pieces, more than 16384")


# --- shard descriptions ----------------------------------------------------------------


@pytest.mark.parametrize(("description", "message"), [
    (("w", (4,), (4,), (0,), "float33"), "shard of 'w' has dtype 'float33', which aoa does "
                                         "not know"),
    (("w", (4.5,), (4,), (0,)), "shard of 'w': local_shape (4.5,) is not a list of integers"),
    (("w", (True,), (4,), (0,)), "shard of 'w': local_shape (True,) is not a list of "
                                 "integers"),
    (("w", "ab", (4,), (0,)), "shard of 'w': local_shape 'ab' is not a list of integers"),
    (("w", (2**64,), (2**64,), (0,)), "shard of 'w': its global shape [18446744073709551616] "
                                      "would hold more than 9223372036854775807 bytes "
                                      "(2**63 - 1)"),
    (("w", (0,) * 65, (0,) * 65, (0,) * 65), "shard of 'w': its global shape "
                                             "[0, 0, 0, 0, 0, 0, ...] has 65 axes, more "
                                             "than 64"),
    ((3, (4,), (4,), (0,)), "a shard's key must be a text, not 3"),
    (("w\ud800", (4,), (4,), (0,)), "a shard's key must be a text, not 'w\\ud800'"),
])
def test_a_shard_description_is_checked_whole(description, message):
    with pytest.raises(aoa.UsageError) as caught:
        ShardDesc(*description)
    assert caught.value.message == message


def test_numpy_integers_make_a_shard_description():
    shard = ShardDesc("w", np.array([4]), (np.int64(4),), [np.int32(0)])
    assert shard.local_shape == (4,) and type(shard.local_shape[0]) is int


def test_a_key_without_shards_is_a_usage_error():
    assert error_of("w -> v", {"w": []}).message == "source shard info lists no shard of 'w'"


# --- files given to the command line ----------------------------------------------------


@pytest.fixture
def source_json(tmp_path):
    path = tmp_path / "src.json"
    path.write_text(json.dumps({"w": [ShardDesc.full("w", (4, 6), "float32").to_json()]}))
    return path


def cli(capsys, *arguments) -> tuple[int, str]:
    code = main([str(a) for a in arguments])
    captured = capsys.readouterr()
    return code, captured.err


def test_a_mapping_that_is_not_utf8(tmp_path, source_json, capsys):
    mapping = tmp_path / "m.aoa"
    mapping.write_bytes(b"w -> v\n# caf\xe9\n")
    code, err = cli(capsys, "check", mapping, "--source", source_json)
    assert code == 2
    assert err.strip() == (f"aoa: error: {mapping}: the mapping is not UTF-8 text: byte 12 "
                           "(line 2) is b'\\xe9'")


@pytest.mark.parametrize(("content", "message"), [
    ({"aoa_statements": [1, 2]},
     "expected a list of statements (texts) or an object with 'aoa_statements' (a list of "
     "texts); found [1, 2]"),
    ({"aoa_statements": "w -> v"},
     "expected a list of statements (texts) or an object with 'aoa_statements' (a list of "
     "texts); found 'w -> v'"),
    ({"aoa_statements": [], "aoa_config_reverse": "yes"},
     "aoa_config_reverse is 'yes', not true or false"),
    (7, "expected a list of statements (texts) or an object with 'aoa_statements' (a list "
        "of texts); found 7"),
])
def test_a_json_mapping_of_the_wrong_shape(tmp_path, source_json, capsys, content, message):
    mapping = tmp_path / "m.json"
    mapping.write_text(json.dumps(content))
    code, err = cli(capsys, "check", mapping, "--source", source_json)
    assert (code, err.strip()) == (2, f"aoa: error: {mapping}: {message}")


@pytest.mark.parametrize("nested", ['{"a":' * 100_000 + "1" + "}" * 100_000,
                                    "[" * 100_000 + "]" * 100_000])
@pytest.mark.parametrize("which", ["mapping", "source"])
def test_json_nested_100000_deep(tmp_path, source_json, capsys, nested, which):
    mapping = tmp_path / "m.json"
    mapping.write_text('["w -> v"]')
    deep = tmp_path / "deep.json"
    deep.write_text(nested)
    arguments = ((deep, source_json) if which == "mapping" else (mapping, deep))
    code, err = cli(capsys, "check", arguments[0], "--source", arguments[1])
    assert (code, err.strip()) == (2, f"aoa: error: {deep}: not valid JSON: nested too deeply")


def test_shard_info_with_an_unknown_dtype_fails_check_as_compile_would(tmp_path, capsys):
    mapping = tmp_path / "m.aoa"
    mapping.write_text("w -> v\n")
    source = tmp_path / "src.json"
    shard = ShardDesc.full("w", (4, 6)).to_json()
    source.write_text(json.dumps({"w": [{**shard, "dtype": "float33"}]}))
    for command in ("check", "compile"):
        code, err = cli(capsys, command, mapping, "--source", source)
        assert code == 2
        assert err.splitlines()[0] == (f"aoa: error: {source}: shard of 'w' has dtype "
                                       "'float33', which aoa does not know")


def test_shard_info_with_a_lone_surrogate_key(tmp_path, capsys):
    mapping = tmp_path / "m.aoa"
    mapping.write_text("w -> v\n")
    source = tmp_path / "src.json"
    source.write_text('{"w\\ud800": []}')
    code, err = cli(capsys, "check", mapping, "--source", source)
    assert (code, err.strip()) == (2, f"aoa: error: {source}: a string holds an escaped lone "
                                      "surrogate (such as \\ud800), which is not Unicode text")


@pytest.mark.parametrize("given", ["file", "folder", "index"])
def test_check_explain_compile_take_a_checkpoint_as_source(tmp_path, capsys, given):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    save_file({"w": np.zeros((4, 6), np.float32)}, folder / "model-00001-of-00001.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"w": "model-00001-of-00001.safetensors"}}))
    source = {"file": folder / "model-00001-of-00001.safetensors", "folder": folder,
              "index": folder / "model.safetensors.index.json"}[given]
    mapping = tmp_path / "m.aoa"
    mapping.write_text("w^T -> v\n")
    assert cli(capsys, "check", mapping, "--source", source)[0] == 0
    assert main(["explain", str(mapping), "--source", str(source)]) == 0
    assert "v: shape [6, 4], source dtype float32" in capsys.readouterr().out
    plan_path = tmp_path / "plan.json"
    assert main(["compile", str(mapping), "--source", str(source), "-o", str(plan_path)]) == 0
    plan = aoa.Plan.loads(plan_path.read_text())
    assert [(s.key, s.local_shape, s.dtype) for s in plan.sources] == [("w", (4, 6),
                                                                        "float32")]


_NOT_TORCH = "not a checkpoint aoa reads: it is neither a zip archive, as torch.save has " \
    "written since torch 1.6, nor in torch.save's legacy format (not written by torch.save)"
_UNKNOWN_FILE = "not a checkpoint aoa reads: by its name and first bytes it is no " \
    "safetensors file, torch.save archive or checkpoint metadata"


@pytest.mark.parametrize(("name", "content", "message"), [
    ("pytorch_model.bin", b"\x80\x02}q\x00X\x01\x00\x00\x00wq\x01K\x01s.", _NOT_TORCH),
    ("garbage.bin", bytes(100), _NOT_TORCH),
    ("weights.dat", b"\x07" * 64, _UNKNOWN_FILE),
    ("m.aoa", b"w -> v\n", _UNKNOWN_FILE),
])
@pytest.mark.parametrize("command", ["check", "explain", "compile", "convert"])
def test_a_file_no_format_claims_is_refused_by_name(tmp_path, capsys, name, content, message,
                                                    command):
    """Not a reader's guess at its bytes (a header of 5088219219985302144 bytes)."""
    source = tmp_path / name
    source.write_bytes(content)
    mapping = tmp_path / "map.aoa"
    mapping.write_text("w -> v\n")
    extra = ["--output", str(tmp_path / "out")] if command == "convert" else []
    code, err = cli(capsys, command, mapping, "--source", source, *extra)
    assert (code, err.splitlines()[0]) == (1, f"error: {source}: {message}")
    assert not (tmp_path / "out").exists()


FIXTURES = Path(__file__).parent / "fixtures"


@pytest.mark.parametrize(("source", "key"), [
    ("paddle/single", "norm.weight"), ("paddle/single/0.metadata", "norm.weight"),
    ("dcp/tp2", "norm.weight"), ("torch_dist/tp2", "norm.weight")])
def test_check_explain_compile_read_every_format_as_convert_does(tmp_path, capsys, source,
                                                                   key):
    mapping = tmp_path / "m.aoa"
    mapping.write_text(f"{key} -> n\n")
    path = FIXTURES / source
    for command in ("check", "explain", "compile"):
        code, err = cli(capsys, command, mapping, "--source", path, "--lenient")
        assert (code, err) == (0, "")


def test_a_safetensors_file_of_another_name_is_still_read(tmp_path, capsys):
    save_file({"w": np.zeros((4, 6), np.float32)}, tmp_path / "weights.st")
    mapping = tmp_path / "m.aoa"
    mapping.write_text("w^T -> v\n")
    assert cli(capsys, "check", mapping, "--source", tmp_path / "weights.st")[0] == 0


def test_a_missing_source_is_a_usage_error(tmp_path, capsys):
    mapping = tmp_path / "m.aoa"
    mapping.write_text("w -> v\n")
    code, err = cli(capsys, "check", mapping, "--source", tmp_path / "nothing")
    assert (code, err.strip()) == (2, f"aoa: error: cannot read source {tmp_path / 'nothing'}:"
                                      " no such file or folder")


def test_a_layout_of_too_many_ranks(tmp_path):
    from aoa.mesh_layout import read_mesh_layout as read_layout

    layout = tmp_path / "l.toml"
    layout.write_text("[mesh]\ntp = 1000\npp = 1000\n")
    with pytest.raises(aoa.UsageError) as caught:
        read_layout(layout)
    assert caught.value.message == f"{layout}: the mesh has 1000000 ranks, more than 65536"
    layout.write_bytes(b"[mesh]\ntp = 2 # \xff\n")
    with pytest.raises(aoa.UsageError) as caught:
        read_layout(layout)
    assert caught.value.message == (f"{layout}: the layout is not UTF-8 text: byte 16 "
                                    "(line 2) is b'\\xff'")


@pytest.mark.parametrize(("content", "message"), [
    (b'{"model_type": "llama"} \xff', "the config is not UTF-8 text: byte 24 (line 1) is "
                                      "b'\\xff'"),
    (b"[" * 100_000 + b"]" * 100_000, "not valid JSON: nested too deeply"),
    (b"[1, 2]", "expected a JSON object"),
])
def test_a_model_config_that_is_not_a_json_object(tmp_path, capsys, content, message):
    config = tmp_path / "config.json"
    config.write_bytes(content)
    code, err = cli(capsys, "mapping", "--config", config, "--to", "paddleformers")
    assert (code, err.strip()) == (2, f"aoa: error: {config}: {message}")


# --- the Python API beyond compile ----------------------------------------------------------


def test_the_paddle_engine_refuses_statements_given_as_one_text():
    from aoa.compat.paddle import AOAEngine

    source = {"w": [ShardDesc.full("w", (4, 6), "float32")]}
    with pytest.raises(aoa.UsageError) as caught:
        AOAEngine({"aoa_statements": "w -> v"}, source)
    assert caught.value.message == ("aoa_statements must be a list of statement texts, not "
                                    "one text")
    with pytest.raises(aoa.UsageError) as caught:
        AOAEngine(["w -> v"], source)
    assert caught.value.message == ("aoa_config must be a dict with 'aoa_statements', not "
                                    "['w -> v']")


@pytest.fixture
def checkpoint(tmp_path):
    save_file({"w": np.arange(24, dtype=np.float32).reshape(4, 6)},
              tmp_path / "model.safetensors")
    return tmp_path


@pytest.mark.parametrize(("shard", "message"), [
    (aoa.Shard(np.zeros((4, 6), np.float32), [4.5, 6]),
     "shard of 'v': global_shape [4.5, 6] is not a list of integers"),
    (aoa.Shard(np.zeros((4, 6), np.float32), [8, 6], ["0", 0]),
     "shard of 'v': global_offset ['0', 0] is not a list of integers"),
])
def test_load_refuses_a_shard_of_other_than_integers(checkpoint, shard, message):
    with pytest.raises(aoa.UsageError) as caught:
        aoa.load("w -> v", source=checkpoint, into={"v": shard})
    assert caught.value.message == message


@pytest.mark.parametrize("threads", ["2", 1.5, True, 0])
def test_load_refuses_threads_that_are_not_a_count(checkpoint, threads):
    with pytest.raises(aoa.UsageError) as caught:
        aoa.load("w -> v", source=checkpoint, into={"v": np.zeros((4, 6), np.float32)},
                 threads=threads)
    assert caught.value.message == f"threads must be a whole number from 1, not {threads!r}"


def plan_json() -> dict:
    source = {"w": [ShardDesc.full("w", (4, 6), "float32")]}
    return aoa.compile("w -> v", source, {"v": [ShardDesc.full("v", (4, 6), "float32")]}
                       ).to_json()


@pytest.mark.parametrize(("change", "message"), [
    (lambda p: p["copies"][0].__setitem__(0, 5),
     "not an aoa plan: copy 0 names shard 5 or 0, which the plan lacks"),
    (lambda p: p["copies"][0].__setitem__(2, [9, 6]), "not an aoa plan: copy 0 reaches past "
                                                      "its shards"),
    (lambda p: p["copies"][0].__setitem__(5, [0, 0]),
     "not an aoa plan: copy 0 has order [0, 0], not a permutation of 2 axes"),
    (lambda p: p["copies"][0].__setitem__(6, ["float33"]),
     "not an aoa plan: copy 0 casts to ('float33',), not known dtypes"),
    (lambda p: p["copies"][0].pop(), "not an aoa plan: not enough values to unpack "
                                     "(expected 7, got 6)"),
    (lambda p: p.pop("sources"), "not an aoa plan: it lacks 'sources'"),
    (lambda p: p.__setitem__("scales", [[0, 3, [2, 2]]]),
     "not an aoa plan: the scales of source 0 name source 3, of 1 sources"),
    (lambda p: p.__setitem__("scales", [[0, 0, [128]]]),
     "not an aoa plan: the scales of source 0 have blocks [128], not one of at least 1 per "
     "axis"),
    (lambda p: p.__setitem__("scales", [[0, 0]]),
     "not an aoa plan: not enough values to unpack (expected 3, got 2)"),
    (lambda p: p.__setitem__("format", "x"), "not an aoa plan (format 'x', expected "
                                             "'aoa-plan/1')"),
])
def test_a_plan_read_back_is_checked_whole(change, message):
    data = plan_json()
    assert aoa.Plan.loads(json.dumps(data)).to_json() == data
    change(data)
    with pytest.raises(aoa.UsageError) as caught:
        aoa.Plan.loads(json.dumps(data))
    assert caught.value.message == message


def test_a_plan_with_scales_reads_back_as_written():
    data = {**plan_json(), "scales": [[0, 0, [2, 3]]]}
    plan = aoa.Plan.loads(json.dumps(data))
    assert plan.scales == {0: (0, (2, 3))} and plan.to_json() == data


def test_a_plan_nested_100000_deep():
    with pytest.raises(aoa.UsageError) as caught:
        aoa.Plan.loads("[" * 100_000)
    assert caught.value.message == "plan: not valid JSON: nested too deeply"
