"""End to end: a synthetic Llama-like float32 checkpoint (1.55 GB at 8 layers, 3.2 GB at 17,
6.3 GB at 34) converted with the demo's statements (fused QKV with grouped heads, fused
gate/up, transposes, a cast, tensor-parallel 2), side by side in one run with:

  command  `aoa convert` as a user runs it: a fresh process, start to exit, the files
           fsynced, aoa's modules compiled to bytecode first (as a wheel's install does);
           with its peak RSS (VmHWM of its own image)
  dd       `dd if=/dev/zero of=F bs=16M oflag=direct` writing as many bytes to the same
           file system: the disk's speed (the goal: command <= 1.1x dd)
  aoa      the conversion in this process (compiled, then executed)
  numpy    a numpy script over the memory-mapped source files (np.transpose/concatenate
           then np.copyto into the mapped destination file),
  memcpy   a plain copy of the destination bytes into fresh pages, and into touched pages.

Without --cold, the source is read into the page cache before each repeat (the seconds
that took are printed): the command is timed against dd writing, so it should not read
from the disk as well. The VMs here page out what has been left alone for a minute (DAMON's
``pageout`` scheme: regions idle for 12 x 5 s, up to 128 MB/s): the 6.16 GB source, read a
quarter of an hour before, was read again in a command that took 9.1 s against dd's 3.4 s
(2.1 s once in memory). For the same reason one command runs untimed before the repeats,
so that the interpreter's and aoa's own files are in memory, as for any command run twice;
with --cold its source is then dropped again before each timed run.

With --cold, each command run starts with the source out of the page cache
(posix_fadvise DONTNEED) and writes into --cold-output (default /dev/shm, memory: only the
reading is measured), beside `dd if=SRC of=/dev/null bs=16M iflag=direct` (the goal:
command <= 1.25x dd, i.e. reading at >= 0.8x its speed). The device's own count of bytes
read (/proc/diskstats, sampled every 5 ms) gives the rate at which the command read, from
its first read to its last, beside dd's: the goal's words ("reads at >= 0.8x dd") without
the command's start-up, compile and copies, which the whole-command ratio counts too.

With --base PYTHON, each repeat runs the command with that interpreter too (another build
of aoa, e.g. a venv of main), just before this one: an A/B in the same run, on a disk whose
speed swings within minutes.

Usage: python bench/convert.py [--layers 8] [--repeats 3] [--threads N] [--work DIR]
       [--command-only] [--cold [--cold-output DIR]] [--base PYTHON]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from aoa import demo
from aoa.jobs.convert import execute, prepare
from aoa.layout import ShardDesc
from aoa.mesh_layout import read_mesh_layout
from aoa.storage import open_source
from aoa.storage.safetensors import SafetensorsFile, write_safetensors

HIDDEN, HEADS, KV_HEADS, INTERMEDIATE, VOCAB, TP = 2048, 16, 4, 5504, 8192, 2
HEAD_DIM = HIDDEN // HEADS


def mapping_text() -> str:
    text = demo.data_file("llama_fused_tp2.aoa").read_text()
    return text.replace("num_heads=4, num_key_value_groups=2",
                        f"num_heads={HEADS}, num_key_value_groups={KV_HEADS}")


def make_source(folder: Path, layers: int) -> None:
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,),
              "lm_head.weight": (VOCAB, HIDDEN)}
    for layer in range(layers):
        p = f"model.layers.{layer}."
        shapes |= {p + "self_attn.q_proj.weight": (HIDDEN, HIDDEN),
                   p + "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
                   p + "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
                   p + "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
                   p + "mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN),
                   p + "mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
                   p + "mlp.down_proj.weight": (HIDDEN, INTERMEDIATE),
                   p + "input_layernorm.weight": (HIDDEN,),
                   p + "post_attention_layernorm.weight": (HIDDEN,)}
    rng = np.random.default_rng(0)

    def fill(views):
        for view in views.values():
            out = np.frombuffer(view, dtype=np.float32)
            out[:] = rng.standard_normal(out.size, dtype=np.float32)

    write_safetensors(folder / "model.safetensors",
                      [ShardDesc.full(k, s, "float32") for k, s in shapes.items()], None, fill)


def numpy_script(source: Path, output: Path, layers: int) -> int:
    """The same conversion written by hand with numpy over mmapped safetensors."""
    output.mkdir()
    with SafetensorsFile.open(source / "model.safetensors") as f:
        hf = {name: f.array(name) for name in f.tensors}
        group = HEADS // KV_HEADS
        total = 0
        for rank in range(TP):
            def cols(x, r=rank):
                width = x.shape[1] // TP
                return x[:, r * width:(r + 1) * width]

            def rows(x, r=rank):
                height = x.shape[0] // TP
                return x[r * height:(r + 1) * height]

            tensors = {"embed_tokens.weight": rows(hf["model.embed_tokens.weight"]),
                       "norm.weight": hf["model.norm.weight"],
                       "lm_head.weight": cols(hf["lm_head.weight"].T)}
            for layer in range(layers):
                p, d = f"model.layers.{layer}.", f"layers.{layer}."
                q, k, v = (hf[p + f"self_attn.{n}_proj.weight"].T for n in "qkv")
                parts = []
                for g in range(KV_HEADS):
                    parts.append(q[:, g * group * HEAD_DIM:(g + 1) * group * HEAD_DIM])
                    parts += [k[:, g * HEAD_DIM:(g + 1) * HEAD_DIM],
                              v[:, g * HEAD_DIM:(g + 1) * HEAD_DIM]]
                tensors[d + "self_attn.qkv_proj.weight"] = cols(np.concatenate(parts, axis=1))
                gate, up = hf[p + "mlp.gate_proj.weight"].T, hf[p + "mlp.up_proj.weight"].T
                tensors[d + "mlp.up_gate_proj.weight"] = np.concatenate([cols(gate), cols(up)], 1)
                tensors[d + "self_attn.o_proj.weight"] = rows(hf[p + "self_attn.o_proj.weight"].T)
                tensors[d + "mlp.down_proj.weight"] = rows(hf[p + "mlp.down_proj.weight"].T)
                for norm in ("input_layernorm.weight", "post_attention_layernorm.weight"):
                    tensors[d + norm] = hf[p + norm]

            def fill(views, tensors=tensors):
                for name, view in views.items():
                    np.copyto(np.frombuffer(view, np.float32).reshape(tensors[name].shape),
                              tensors[name])

            write_safetensors(output / f"rank-{rank}.safetensors",
                              [ShardDesc.full(k, v.shape, "float32") for k, v in tensors.items()],
                              None, fill)
            total += sum(v.nbytes for v in tensors.values())
    return total


def memcpy(nbytes: int, touched: bool) -> float:
    source = np.ones(nbytes, np.uint8)
    target = np.empty(nbytes, np.uint8)
    if touched:
        target[:] = 0
    start = time.perf_counter()
    np.copyto(target, source)
    return time.perf_counter() - start


#: Run in the child: the CLI as the `aoa` script runs it (`aoa.cli.run`: its environment,
#: collector and exit), its `main` followed by printing its peak RSS (VmHWM of its own image:
#: a forked child's getrusage would count this process's buffers too).
CHILD = ("import aoa.cli as cli\n"
         "main = cli.main\n"
         "def measured():\n"
         "    code = main()\n"
         "    print(next(l.split()[1] for l in open('/proc/self/status')\n"
         "               if l.startswith('VmHWM')))\n"
         "    return code\n"
         "cli.main = measured\n"
         "cli.run()\n")


def run_command(work: Path, source: Path, output: Path, threads: int | None,
                python: str = sys.executable) -> tuple[float, int]:
    """`aoa convert` in a fresh process of ``python``: seconds from start to exit, and peak
    RSS (bytes)."""
    command = [python, "-c", CHILD, "convert", str(work / "map.aoa"), "--source",
               str(source), "--output", str(output), "--quiet", "--layout",
               str(demo.data_file("llama_tp2.toml"))]
    if threads:
        command += ["--threads", str(threads)]
    start = time.perf_counter()
    printed = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    seconds = time.perf_counter() - start
    return seconds, int(printed.split()[-1]) * 1024


def compile_bytecode(python: str) -> None:
    """Compile the aoa package that ``python`` imports to bytecode, as installing its wheel
    does: where PYTHONDONTWRITEBYTECODE is set (this machine's sessions) an editable checkout
    would otherwise compile every module from source at each start, 0.1-0.2 s of CPU that a
    user's command does not spend."""
    subprocess.run([python, "-c", "import compileall, os, aoa; "
                    "compileall.compile_dir(os.path.dirname(aoa.__file__), quiet=1)"],
                   check=True)


def dd(arguments: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(["dd", *arguments], check=True, capture_output=True)
    return time.perf_counter() - start


def dd_write(path: Path, nbytes: int) -> float:
    """dd writing ``nbytes`` zeros to ``path`` around the page cache."""
    seconds = dd(["if=/dev/zero", f"of={path}", "bs=16M", "iflag=count_bytes",
                  f"count={nbytes}", "oflag=direct"])
    path.unlink()
    return seconds


def into_page_cache(path: Path) -> float:
    """Read ``path`` into the page cache (sendfile to /dev/null: no copy); the seconds it
    took (near nothing where it was all there)."""
    start = time.perf_counter()
    with open(path, "rb") as source, open(os.devnull, "wb") as sink:
        size, done = os.fstat(source.fileno()).st_size, 0
        while done < size:
            sent = os.sendfile(sink.fileno(), source.fileno(), done, min(size - done, 1 << 26))
            if sent <= 0:
                break
            done += sent
    return time.perf_counter() - start


def drop_from_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def file_system(path: Path) -> str:
    """The file system type and device under ``path``, from /proc/mounts."""
    best = ("?", "?", "")
    for line in Path("/proc/mounts").read_text().splitlines():
        device, mount, kind = line.split()[:3]
        if str(path.resolve()).startswith(mount) and len(mount) >= len(best[2]):
            best = (kind, device, mount)
    return f"{best[0]} ({best[1]})"


class DeviceReads:
    """The bytes the block device under ``path`` reads while the ``with`` block runs
    (/proc/diskstats, sampled every 5 ms), and the seconds from the first sample that saw a
    read to the last; no device (not a block device listed there): nothing counted."""

    def __init__(self, path: Path) -> None:
        device = file_system(path).rpartition("(")[2].rstrip(")")
        self.device = device.removeprefix("/dev/")
        self.nbytes = 0
        self.seconds = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _read_bytes(self) -> int | None:
        for line in Path("/proc/diskstats").read_text().splitlines():
            fields = line.split()
            if fields[2] == self.device:
                return int(fields[5]) * 512
        return None

    def _sample(self) -> None:
        start = self._read_bytes()
        if start is None:
            return
        last, first_at, last_at = start, None, None
        while not self._stop.wait(0.005):
            now, at = self._read_bytes() or last, time.perf_counter()
            if now != last:
                if first_at is None:
                    first_at = self._previous_at
                last_at = at
                last = now
            self._previous_at = at
        self.nbytes = last - start
        self.seconds = (last_at - first_at) if first_at is not None and last_at else 0.0

    def __enter__(self) -> DeviceReads:
        self._previous_at = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def rate(self) -> float:
        """Bytes a second from the first read to the last (0 where none was seen)."""
        return self.nbytes / self.seconds if self.seconds else 0.0


def command_table(work: Path, source: Path, args: argparse.Namespace) -> None:
    """The command as a process beside dd, each repeat side by side; peak RSS of each."""
    cold = args.cold
    out_root = Path(args.cold_output) if cold else work
    output = out_root / "out-command"
    source_file = source / "model.safetensors"
    rows = []
    bases: list[float] = []
    rates: list[tuple[float, float, int]] = []  # cold: the command's read rate, dd's, bytes
    base_rates: list[float] = []  # the other build's read rate
    nbytes = 0
    for python in (sys.executable, *([args.base] if args.base else [])):
        compile_bytecode(python)
        shutil.rmtree(output, ignore_errors=True)
        run_command(work, source, output, args.threads, python)  # warm-up, untimed
    for repeat in range(args.repeats):
        if not cold:
            print(f"repeat {repeat + 1}: the source read into the page cache in "
                  f"{into_page_cache(source_file):.2f} s", file=sys.stderr)
        if args.base:  # the other build first, then this one, in each repeat
            shutil.rmtree(output, ignore_errors=True)
            if cold:
                drop_from_page_cache(source_file)
            with DeviceReads(source) as base_read:
                bases.append(run_command(work, source, output, args.threads, args.base)[0])
            base_rates.append(base_read.rate)
        shutil.rmtree(output, ignore_errors=True)
        if cold:
            drop_from_page_cache(source_file)
        with DeviceReads(source) as read:
            seconds, peak = run_command(work, source, output, args.threads)
        nbytes = sum(f.stat().st_size for f in output.glob("*.safetensors"))
        if cold:
            drop_from_page_cache(source_file)
            base = dd([f"if={source_file}", "of=/dev/null", "bs=16M", "iflag=direct"])
            rates.append((read.rate, source_file.stat().st_size / base, read.nbytes))
        else:
            base = dd_write(work / "dd.out", nbytes)
        rows.append((seconds, base, peak))
        other = f", base {bases[-1]:.3f} s" if bases else ""
        print(f"repeat {repeat + 1}: command {seconds:.3f} s{other}, dd {base:.3f} s, "
              f"ratio {seconds / base:.2f}, peak RSS {peak / 1e6:.0f} MB", file=sys.stderr)
    shutil.rmtree(output, ignore_errors=True)
    what = (f"reading {source_file.stat().st_size / 1e9:.2f} GB from {file_system(source)}, "
            f"cold, writing into {file_system(out_root)}" if cold else
            f"writing {nbytes / 1e9:.2f} GB to {file_system(work)}")
    base_name = "dd iflag=direct" if cold else "dd oflag=direct"
    print(f"aoa convert as a process ({args.layers} layers), {what}")
    other = f"{'base s':>9s}{'base ratio':>12s}" if bases else ""
    print(f"{'repeat':>6s}{'command s':>11s}{base_name:>17s}{'ratio':>8s}{'peak RSS MB':>13s}"
          + other)
    for repeat, (seconds, base, peak) in enumerate(rows, start=1):
        other = (f"{bases[repeat - 1]:9.3f}{bases[repeat - 1] / base:12.2f}" if bases
                 else "")
        print(f"{repeat:6d}{seconds:11.3f}{base:17.3f}{seconds / base:8.2f}{peak / 1e6:13.0f}"
              + other)
    if rates:
        print("the device's reads during the command, first to last, against dd's "
              "(goal: >= 0.8x)")
        other = f"{'base GB/s':>11s}{'base ratio':>12s}" if bases else ""
        print(f"{'repeat':>6s}{'read GB':>9s}{'command GB/s':>14s}{'dd GB/s':>9s}{'ratio':>8s}"
              + other)
        for repeat, (rate, dd_rate, read_bytes) in enumerate(rates, start=1):
            other = (f"{base_rates[repeat - 1] / 1e9:11.2f}"
                     f"{base_rates[repeat - 1] / dd_rate:12.2f}" if bases else "")
            print(f"{repeat:6d}{read_bytes / 1e9:9.2f}{rate / 1e9:14.2f}{dd_rate / 1e9:9.2f}"
                  f"{rate / dd_rate:8.2f}" + other)
    if len(rows) > 1:
        ratios = sorted(seconds / base for seconds, base, _ in rows)
        line = (f"ratio median {statistics.median(ratios):.2f} "
                f"({ratios[0]:.2f}-{ratios[-1]:.2f})")
        if bases:
            others = sorted(b / base for b, (_, base, _) in zip(bases, rows))
            line += (f", base {statistics.median(others):.2f} ({others[0]:.2f}-{others[-1]:.2f})"
                     f"; this faster in {sum(s < b for b, (s, _, _) in zip(bases, rows))} "
                     f"of {len(rows)}")
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--work", help="folder for the files (default: a temporary one)")
    parser.add_argument("--command-only", action="store_true",
                        help="only the command against dd (for the big models)")
    parser.add_argument("--cold", action="store_true",
                        help="the command with the source out of the page cache, against dd "
                             "reading it (implies --command-only)")
    parser.add_argument("--cold-output", default="/dev/shm/aoa-bench-cold",
                        help="where --cold writes (default: memory, /dev/shm)")
    parser.add_argument("--base", metavar="PYTHON",
                        help="also run the command with this interpreter (another build of "
                             "aoa), just before this one in each repeat: an A/B in one run")
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="aoa-bench-"))
    source = work / "hf"
    if not (source / "model.safetensors").exists():
        source.mkdir(parents=True, exist_ok=True)
        make_source(source, args.layers)
    (work / "map.aoa").write_text(mapping_text())
    command_table(work, source, args)
    if not (args.command_only or args.cold):
        in_process_table(work, source, args)
    if not args.work:
        shutil.rmtree(work)


def in_process_table(work: Path, source: Path, args: argparse.Namespace) -> None:
    """aoa in this process beside a numpy script and memcpy, medians of the repeats."""
    layout = read_mesh_layout(demo.data_file("llama_tp2.toml"))
    times: dict[str, list[float]] = {"aoa": [], "numpy": [], "memcpy fresh": [],
                                     "memcpy touched": []}
    nbytes = 0
    for repeat in range(args.repeats):
        for name in ("out-aoa", "out-numpy"):
            shutil.rmtree(work / name, ignore_errors=True)
        with open_source(source) as checkpoint:
            conversion = prepare(mapping_text(), checkpoint, layout=layout)
            start = time.perf_counter()
            execute(conversion, work / "out-aoa", threads=args.threads)
            times["aoa"].append(time.perf_counter() - start)
            nbytes = conversion.nbytes
        start = time.perf_counter()
        numpy_bytes = numpy_script(source, work / "out-numpy", args.layers)
        times["numpy"].append(time.perf_counter() - start)
        assert numpy_bytes == nbytes, (numpy_bytes, nbytes)
        times["memcpy fresh"].append(memcpy(nbytes, touched=False))
        times["memcpy touched"].append(memcpy(nbytes, touched=True))
        print(f"repeat {repeat + 1}: " + ", ".join(f"{k} {v[-1]:.3f} s" for k, v in
                                                   times.items()), file=sys.stderr)
    for rank in range(TP):  # the two conversions agree byte for byte
        with SafetensorsFile.open(work / "out-aoa" / f"rank-{rank:05d}-of-00002.safetensors") \
                as a, SafetensorsFile.open(work / "out-numpy" / f"rank-{rank}.safetensors") as b:
            for name in a.tensors:
                assert a.buffer(name) == b.buffer(name), name
    shutil.rmtree(work / "out-aoa")
    shutil.rmtree(work / "out-numpy")
    median = {k: statistics.median(v) for k, v in times.items()}
    print(f"in this process: {nbytes / 1e9:.2f} GB in {TP} files ({args.layers} layers, "
          "float32), medians")
    print(f"{'':16s}{'seconds':>9s}{'GB/s':>8s}{'aoa is':>10s}")
    for name, seconds in median.items():
        ratio = seconds / median["aoa"]
        print(f"{name:16s}{seconds:9.3f}{nbytes / seconds / 1e9:8.2f}{ratio:9.2f}x")

if __name__ == "__main__":
    main()
