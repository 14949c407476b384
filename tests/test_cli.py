"""`aoa compile | explain | check`: outputs and exit codes (0 ok, 1 errors, 2 bad usage)."""

from __future__ import annotations

import json
import os
import struct

import pytest

from aoa import Plan
from aoa.cli import main


@pytest.fixture
def files(tmp_path):
    source = {"w": [{"key": "w", "local_shape": [2, 4], "global_shape": [4, 4],
                     "global_offset": [2 * i, 0], "dtype": "float32"} for i in range(2)],
              "unused": [{"key": "unused", "local_shape": [1], "global_shape": [1],
                          "global_offset": [0], "dtype": "float32"}]}
    destination = {"v": [{"key": "v", "local_shape": [4, 4], "global_shape": [4, 4],
                          "global_offset": [0, 0], "dtype": "float32"}]}
    (tmp_path / "src.json").write_text(json.dumps(source))
    (tmp_path / "dst.json").write_text(json.dumps(destination))
    (tmp_path / "ok.aoa").write_text("# transpose\nw^T -> v\n")
    (tmp_path / "bad.aoa").write_text("w^T -> v\nzz -> q\n")
    return tmp_path


def run(files, *args):
    return main([args[0], str(files / args[1]), "--source", str(files / "src.json"),
                 *args[2:]])


def test_check_ok_prints_notes(files, capsys):
    assert run(files, "check", "ok.aoa", "--destination", str(files / "dst.json")) == 0
    out = capsys.readouterr().out
    assert "note: 1 source keys are used by nothing: 'unused'" in out
    assert out.rstrip().endswith("ok: 2 statements after expansion, 1 notes")


def test_a_dropped_key_is_not_unused(files, capsys):
    (files / "drop.aoa").write_text("w^T -> v\nunused -> _\n")
    assert run(files, "check", "drop.aoa", "--destination", str(files / "dst.json")) == 0
    assert "used by nothing" not in capsys.readouterr().out


def test_check_error_exit_1_with_caret(files, capsys):
    assert run(files, "check", "bad.aoa") == 1
    err = capsys.readouterr().err
    assert err.splitlines()[:3] == [
        f"{files / 'bad.aoa'}:2:1: error: 'zz' is neither a source key nor assigned before",
        "    zz -> q",
        "    ^^",
    ]


def test_bad_usage_exit_2(files, capsys):
    assert main(["check"]) == 2
    assert main(["check", str(files / "ok.aoa"), "--source", str(files / "nope.json")]) == 2
    assert "cannot read source shard info" in capsys.readouterr().err


def test_compile_writes_a_plan_that_loads_back(files):
    out = files / "plan.json"
    assert run(files, "compile", "ok.aoa", "--destination", str(files / "dst.json"),
               "-o", str(out)) == 0
    plan = Plan.loads(out.read_text())
    assert [d.key for d in plan.destinations] == ["v"]
    assert {(c.source_start, c.shape, c.order) for c in plan.copies} == {
        ((0, 0), (4, 2), (1, 0)), ((0, 0), (4, 2), (1, 0))}
    assert sorted(c.destination_start for c in plan.copies) == [(0, 0), (0, 2)]


def test_explain_shows_origins_and_pieces(files, capsys):
    assert run(files, "explain", "ok.aoa", "--destination", str(files / "dst.json"),
               "--plan") == 0
    out = capsys.readouterr().out
    assert f"w -> w_transpose_tmp, permute='[]'  [{files / 'ok.aoa'}:2:1 via transpose]" in out
    assert "v: shape [4, 4], source dtype float32" in out
    assert "    [0:4, 0:4] <- w[0:4, 0:4]  ([1, 0])" in out
    assert "    [0:4, 0:2] <- w[0:2, 0:4]  (permute [1, 0])" in out


def test_explain_prints_after_the_passes_asked_for(files, capsys):
    assert run(files, "explain", "ok.aoa", "--destination", str(files / "dst.json"),
               "--print-after", "expand_fused", "--print-after", "plan") == 0
    out = capsys.readouterr().out
    assert out.splitlines() == [
        "# after expand_fused",
        f"w -> w_transpose_tmp, permute='[]'  [{files / 'ok.aoa'}:2:1 via transpose]",
        f"w_transpose_tmp -> v  [{files / 'ok.aoa'}:2:1 via transpose]",
        "# after plan",
        "plan: 2 source shards -> 1 destination shards, 2 copies, 64 bytes",
        "v[0:4, 0:4] of [4, 4]  float32",
        "    [0:4, 0:2] <- w[0:2, 0:4]  (permute [1, 0])",
        "    [0:4, 2:4] <- w[2:4, 0:4]  (permute [1, 0])",
        "# notes",
        "note: 1 source keys are used by nothing: 'unused'",
    ]


def test_explain_stops_after_the_last_pass_asked_for(files, capsys):
    """Passes after it do not run: a program that planning refuses still prints."""
    (files / "wrong.json").write_text(json.dumps({"v": [{
        "key": "v", "local_shape": [4, 4], "global_shape": [4, 4], "global_offset": [0, 0],
        "dtype": "bfloat16"}]}))
    assert run(files, "explain", "ok.aoa", "--destination", str(files / "wrong.json"),
               "--print-after", "propagate_shapes") == 0
    assert capsys.readouterr().out.splitlines() == [
        "# after propagate_shapes", "v: shape [4, 4], source dtype float32",
        "    [0:4, 0:4] <- w[0:4, 0:4]  ([1, 0])"]
    assert run(files, "explain", "ok.aoa", "--destination", str(files / "wrong.json"),
               "--print-after", "propagate_shapes", "--time-passes") == 1
    captured = capsys.readouterr()
    assert "destination 'v' [0:4, 0:4] is bfloat16, but 'w' is float32" in captured.err


def test_explain_times_every_pass(files, capsys):
    assert run(files, "explain", "ok.aoa", "--time-passes", "--destination",
               str(files / "dst.json")) == 0
    captured = capsys.readouterr()
    assert captured.out == ""
    rows = [line.split() for line in captured.err.splitlines()]
    assert rows[0] == ["pass", "seconds", "share"]
    assert [row[0] for row in rows[1:]] == [
        "parse", "expand_macros", "share_instances", "resolve_chains", "expand_fused",
        "propagate_shapes", "check_mapping", "plan", "total"]
    assert abs(sum(float(row[1]) for row in rows[1:-1]) - float(rows[-1][1])) < 1e-3


def test_mapping_as_paddle_config_json(files, capsys):
    (files / "config.json").write_text(json.dumps(
        {"aoa_statements": ["w^T -> v"], "aoa_config_reverse": False}))
    assert run(files, "check", "config.json", "--destination", str(files / "dst.json")) == 0


def _modules_after(code: str) -> set[str]:
    """The top-level modules a fresh interpreter has imported after running ``code``."""
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys\nprint(' '.join(sys.modules))"],
        capture_output=True, text=True, check=True)
    last_line = result.stdout.splitlines()[-1]  # after what ``code`` printed
    return {name.split(".")[0] for name in last_line.split()}


def test_help_and_check_import_only_what_they_need(files):
    """Start-up (issue 13, goal 6): `aoa --help` needs neither the compiler (Lark) nor
    numpy; checking a mapping of whole source tensors needs neither Lark (the fast parser
    takes its statements) nor numpy (which compares shards only where a key has several),
    ml_dtypes or the kernel."""
    heavy = {"lark", "numpy", "ml_dtypes", "torch"}
    help_modules = _modules_after(
        "from aoa.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass")
    assert help_modules & heavy == set()
    (files / "whole.json").write_text(json.dumps(
        {"w": [{"key": "w", "local_shape": [4, 4], "global_shape": [4, 4],
                "global_offset": [0, 0], "dtype": "float32"}]}))
    check = [str(files / "ok.aoa"), "--source", str(files / "whole.json"), "--destination",
             str(files / "dst.json")]
    check_modules = _modules_after(f"from aoa.cli import main\nmain(['check', *{check!r}])")
    assert check_modules & heavy == set()
    # the same source as a safetensors file: its header read, its bytes never
    header = json.dumps({"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]}})
    (files / "whole.safetensors").write_bytes(
        struct.pack("<Q", len(header)) + header.encode() + bytes(64))
    check[2] = str(files / "whole.safetensors")
    check_modules = _modules_after(f"from aoa.cli import main\nmain(['check', *{check!r}])")
    assert check_modules & heavy == set()


@pytest.mark.parametrize(("mapping", "code"), [("ok.aoa", 0), ("bad.aoa", 1)])
def test_the_command_as_a_process_flushes_its_output_and_exits_with_mains_code(
        files, capsys, mapping, code):
    """`aoa` (`run`) ends the process right after `main`: what it printed still reaches a
    pipe, in full, and the exit code is main's."""
    import subprocess
    import sys

    args = ["check", str(files / mapping), "--source", str(files / "src.json"),
            "--destination", str(files / "dst.json")]
    assert main(args) == code
    expected = capsys.readouterr()
    result = subprocess.run([sys.executable, "-m", "aoa.cli", *args], capture_output=True,
                            text=True)
    assert (result.returncode, result.stdout, result.stderr) == (code, expected.out,
                                                                 expected.err)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs /proc/self/task")
@pytest.mark.parametrize(("asked", "threads"), [(None, ("1", 1)), ("2", ("2", 2))])
def test_the_command_gives_numpy_one_blas_thread_unless_the_user_asks(asked, threads):
    """`aoa` as a process sets OPENBLAS_NUM_THREADS=1 before numpy is imported (its thread
    server would spin a second core for nothing: aoa does no linear algebra); a value the
    user set is kept."""
    import subprocess
    import sys

    probe = ("import os, aoa.cli as cli\n"
             "def main():\n"
             "    import numpy\n"
             "    print(os.environ['OPENBLAS_NUM_THREADS'], len(os.listdir('/proc/self/task')))\n"
             "    return 0\n"
             "cli.main = main\n"
             "cli.run()\n")
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    if asked is not None:
        env["OPENBLAS_NUM_THREADS"] = asked
    if asked is not None and (os.cpu_count() or 1) < 2:
        pytest.skip("one core: OpenBLAS starts no second thread whatever is asked")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            env=env, check=True)
    value, count = result.stdout.split()
    assert (value, int(count)) == threads
