"""`aoa convert` under faults, run as a process the way a user runs it: killed at any point,
interrupted, a full disk, two runs into one folder, a source cut short while it is read.
Afterwards the output folder holds either the complete checkpoint (the bytes of a run that
met no fault) or nothing that loads, and a process never dies of a signal it could report.

The command runs with small staging buffers (so that even a small checkpoint takes many
buffers) and, for the deterministic cases, a hook that places the fault exactly.
"""

from __future__ import annotations

import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors_files import save

from aoa.errors import StorageError
from aoa.storage import open_source
from aoa.storage.folder import OutputFolder
from aoa.storage.formats import checkpoint_patterns

#: The command, with hooks that place a fault (AOA_TEST_FAULT) and small staging buffers.
RUNNER = """\
import os, signal, sys, time
import aoa.storage.writer as writer
writer.BUFFER_BYTES = 256 << 10
fault = os.environ.get("AOA_TEST_FAULT", "")
if fault:
    from aoa.runtime.executor import PlanExecutor
    from aoa.storage import folder
    fill = PlanExecutor.fill
    calls = []

    def faulty_fill(self, pieces):
        calls.append(1)
        if fault == "truncate-source" and len(calls) == 2:
            os.truncate(os.environ["AOA_TEST_SOURCE"], 4096)
        if fault == "slow":
            print("filling", flush=True)
            time.sleep(0.2)
        return fill(self, pieces)

    PlanExecutor.fill = faulty_fill
    replace = os.replace

    def faulty_replace(source, target):
        replace(source, target)
        if fault == "kill-between-renames" and str(target).endswith(".safetensors"):
            os.kill(os.getpid(), signal.SIGKILL)

    folder.os.replace = faulty_replace
    write_file = folder.write_file

    def full_disk(path, data):
        if fault == "full-disk-at-index" and path.name.endswith(".index.json"):
            raise folder.StorageError(f"{path}: cannot write: No space left on device")
        return write_file(path, data)

    folder.write_file = full_disk
    import aoa.storage.formats as formats
    formats.write_file = full_disk
from aoa.cli import main
sys.exit(main(sys.argv[1:]))
"""

MAPPING = """\
w.$LAYER_ID^T -> x.$LAYER_ID
v.$LAYER_ID -> y.$LAYER_ID, dtype='bfloat16'
"""
LAYOUT = """\
[mesh]
tp = 2
"""
LAYERS, ROWS, COLUMNS = 4, 256, 384


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A source of 8 float32 tensors (3 MB), the mapping, a layout."""
    root = tmp_path_factory.mktemp("faults")
    rng = np.random.default_rng(0)
    tensors = {}
    for layer in range(LAYERS):
        tensors[f"w.{layer}"] = rng.standard_normal((ROWS, COLUMNS), dtype=np.float32)
        tensors[f"v.{layer}"] = rng.standard_normal((COLUMNS, ROWS), dtype=np.float32)
    (root / "src").mkdir()
    save(root / "src" / "model.safetensors", tensors)
    (root / "map.aoa").write_text(MAPPING)
    (root / "tp2.toml").write_text(LAYOUT)
    return root


#: Outputs, each a conversion into several files: Hugging Face files and an index, and
#: one file per rank.
SHAPES = {"hugging-face": ["--max-file-size", "0.0009"], "ranks": ["--layout", "tp2.toml"]}


def command(work: Path, output: Path, shape: str, source: Path | None = None) -> list[str]:
    extra = [str(work / a) if a.endswith(".toml") else a for a in SHAPES[shape]]
    return [sys.executable, "-c", RUNNER, "convert", str(work / "map.aoa"), "--source",
            str(source or work / "src"), "--output", str(output), "--quiet", *extra]


def run(args: list[str], fault: str = "", **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "AOA_TEST_FAULT": fault, **env})


@pytest.fixture(scope="module")
def reference(work: Path) -> dict[str, dict[str, bytes]]:
    """Each shape's files, as a run that met no fault wrote them."""
    files = {}
    for shape in SHAPES:
        output = work / f"reference-{shape}"
        done = run(command(work, output, shape))
        assert done.returncode == 0, done.stderr
        files[shape] = visible(output)
        assert len(files[shape]) >= 2
    return files


def visible(folder: Path) -> dict[str, bytes]:
    if not folder.is_dir():
        return {}
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())
            if not p.name.startswith(".")}


def outcome(folder: Path, complete: dict[str, bytes]) -> str:
    """"complete" (the reference's files, byte for byte), "nothing" (no checkpoint file),
    or "refused" (checkpoint files the reader refuses); anything else fails the test."""
    files = visible(folder)
    if files == complete:
        return "complete"
    if not files:
        return "nothing"
    try:
        open_source(folder).close()
    except StorageError:
        return "refused"
    raise AssertionError(f"{folder} loads, but is not the checkpoint: {sorted(files)}")


# -- deterministic faults ----------------------------------------------------------------


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_a_kill_between_the_renames_leaves_a_set_that_is_refused(work, reference, tmp_path,
                                                                  shape):
    done = run(command(work, tmp_path / "out", shape), "kill-between-renames")
    assert done.returncode == -signal.SIGKILL
    assert len(visible(tmp_path / "out")) == 1
    assert outcome(tmp_path / "out", reference[shape]) == "refused"


def test_a_full_disk_at_the_index_leaves_nothing(work, reference, tmp_path):
    done = run(command(work, tmp_path / "out", "hugging-face"), "full-disk-at-index")
    assert done.returncode == 1
    assert done.stderr.endswith("model.safetensors.index.json: cannot write: No space left on "
                                "device\n")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("cold", [False, True], ids=["warm", "cold"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_a_source_cut_short_while_read_is_an_error(work, tmp_path, shape, cold):
    """Cold, the source is read ahead of the fills too (`aoa.storage.read_ahead`): the
    thread reading it ends where the file does, and the fills say what is wrong."""
    source = tmp_path / "src"
    shutil.copytree(work / "src", source)
    if cold:  # (where the file system keeps it in memory anyway, this is the warm case)
        with open(source / "model.safetensors", "rb") as file:
            os.fsync(file.fileno())
            os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    done = run(command(work, tmp_path / "out", shape, source), "truncate-source",
               AOA_TEST_SOURCE=str(source / "model.safetensors"))
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith(f"error: {source / 'model.safetensors'}: cut short while aoa "
                                  "read it: byte ")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupt_is_one_line_and_removes_the_partial_files(work, tmp_path, stop):
    output = tmp_path / "out"
    process = subprocess.Popen(command(work, output, "ranks"), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "AOA_TEST_FAULT": "slow"})
    assert process.stdout is not None
    assert process.stdout.readline() == "filling\n"
    process.send_signal(stop)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130
    assert stderr == (f"aoa: interrupted by {signal.Signals(stop).name}; nothing was left "
                      "half-written\n")
    assert not output.exists()


def test_a_second_run_into_a_folder_being_written_is_refused(work, tmp_path):
    holder = OutputFolder(tmp_path, checkpoint_patterns())
    holder.open()
    try:
        done = run(command(work, tmp_path, "ranks"))
    finally:
        holder.release()
    assert done.returncode == 1
    assert done.stderr.startswith(f"error: {tmp_path}: another aoa convert is writing into this "
                                  f"folder (process {os.getpid()}, since ")
    assert "hint: Wait for it to finish, or convert into another folder." in done.stderr
    assert os.listdir(tmp_path) == []


# -- random faults -----------------------------------------------------------------------


def timed(args: list[str]) -> float:
    start = time.monotonic()
    assert run(args).returncode == 0
    return time.monotonic() - start


@pytest.mark.slow
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_killed_at_random_points(work, reference, tmp_path, shape):
    """SIGKILL anywhere: the complete checkpoint or nothing that loads; the next run into
    the folder then succeeds (a set cut between renames stays, and is refused)."""
    duration = timed(command(work, tmp_path / "timing", shape))
    rng = random.Random(shape)
    seen = set()
    for attempt in range(8):
        output = tmp_path / f"out{attempt}"
        process = subprocess.Popen(command(work, output, shape), stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.0, duration * 1.1))
        process.kill()
        process.wait()
        result = outcome(output, reference[shape])
        seen.add(result)
        if result == "nothing":
            done = run(command(work, output, shape))
            assert done.returncode == 0, done.stderr
            assert visible(output) == reference[shape]
    assert "nothing" in seen or "complete" in seen


@pytest.mark.slow
def test_concurrent_runs_into_one_folder(work, reference, tmp_path):
    """Runs started together: one writes the checkpoint, the others are refused at once."""
    for attempt in range(3):
        output = tmp_path / f"out{attempt}"
        processes = [subprocess.Popen(command(work, output, "ranks"), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True) for _ in range(3)]
        results = [(p.wait(timeout=300), p.stderr.read()) for p in processes]  # type: ignore
        codes = sorted(code for code, _ in results)
        assert codes == [0, 1, 1], results
        for code, stderr in results:
            if code == 1:
                assert ("another aoa convert is writing into this folder" in stderr
                        or "the output folder already holds a checkpoint" in stderr), stderr
        assert visible(output) == reference["ranks"]
        assert sorted(os.listdir(output)) == sorted(reference["ranks"])


@pytest.mark.slow
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_sources_truncated_at_random_points(work, reference, tmp_path, shape):
    """A source cut short at any moment: a StorageError naming it (exit 1), never a death by
    SIGBUS; the complete checkpoint (cut after it was read) or nothing."""
    duration = timed(command(work, tmp_path / "timing", shape))
    rng = random.Random(shape)
    for attempt in range(5):
        source = tmp_path / f"src{attempt}"
        shutil.copytree(work / "src", source)
        output = tmp_path / f"out{attempt}"
        process = subprocess.Popen(command(work, output, shape, source),
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(rng.uniform(0.0, duration))
        os.truncate(source / "model.safetensors", rng.randrange(0, 3 << 20))
        _, stderr = process.communicate(timeout=300)
        assert process.returncode in (0, 1), (process.returncode, stderr)
        if process.returncode == 1:
            assert str(source / "model.safetensors") in stderr, stderr
        result = outcome(output, reference[shape])
        assert result == ("complete" if process.returncode == 0 else "nothing"), stderr


# -- a full disk ---------------------------------------------------------------------------

IN_SMALL_FILE_SYSTEM = """\
set -e
mount -t tmpfs -o size={size} aoa-test {mount}
set +e
{convert} > {log} 2>&1
echo $? >> {log}
{python} -c 'import json, os, sys; print(json.dumps(sorted(os.listdir(sys.argv[1]))))' \
    {mount} >> {log}
"""


def in_small_file_system(size: str, mount: Path, convert: list[str], log: Path
                         ) -> tuple[int, str, list[str]]:
    """Run ``convert`` with a tmpfs of ``size`` at ``mount``, in a mount namespace of its own
    (root, or a user namespace, may mount one there); its exit code, output, and what the
    file system holds afterwards. Skips where no namespace can be made."""
    script = IN_SMALL_FILE_SYSTEM.format(
        size=size, mount=mount, log=log, python=sys.executable,
        convert=" ".join(map(shlex.quote, convert)))
    for unshare in (["unshare", "--mount"], ["unshare", "--mount", "--map-root-user"]):
        if shutil.which("unshare") is None:
            break
        done = subprocess.run([*unshare, "bash", "-c", script], capture_output=True, text=True,
                              timeout=300)
        if done.returncode == 0:
            *output, code, listing = log.read_text().splitlines()
            return int(code), "\n".join(output), json.loads(listing)
    pytest.skip("cannot mount a small tmpfs here (no mount namespace: neither root nor user "
                "namespaces)")


@pytest.mark.slow
@pytest.mark.parametrize(("size", "shape"), [("1m", "ranks"), ("2m", "hugging-face")])
def test_a_full_disk_leaves_nothing(work, tmp_path, size, shape):
    """A file system too small for the checkpoint (a real tmpfs, not a simulation)."""
    mount = tmp_path / "small"
    mount.mkdir()
    code, output, listing = in_small_file_system(
        size, mount, command(work, mount / "out", shape), tmp_path / "log")
    assert code == 1, output
    assert "No space left on device" in output
    assert listing == []
