"""The `aoa` command line: compile, explain, check (and the main job, convert and demo)."""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, TypeVar

from aoa.collector import collector_paused
from aoa.errors import AoaError, UsageError
from aoa.storage.formats import DEFAULT_MAX_FILE_BYTES, FORMAT_NAMES

if TYPE_CHECKING:
    from aoa.layout import ShardDesc, ShardInfo
    from aoa.mapping import MappingText
    from aoa.passes import Pass
    from aoa.passes.context import CompileContext
    from aoa.pipeline import Compilation
    from aoa.storage.formats import Source

# Each command imports what it needs when it runs (the compiler needs Lark, a conversion
# numpy and the kernel): `aoa --help` needs none of them (issue 13, goal 6).

EXIT_OK, EXIT_ERRORS, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
T = TypeVar("T")
#: Signals that stop a command: each ends it with one line and exit 130, after the files it
#: was writing are removed.
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP")
                     if hasattr(signal, name))


class Interrupted(KeyboardInterrupt):
    """A stop signal, raised in the main thread where Python notices it; what is being
    written is removed as the exception unwinds."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _stop(signum: int, frame: object) -> None:
    for stop in STOP_SIGNALS:  # the cleanup that follows runs to its end
        signal.signal(stop, signal.SIG_IGN)
    raise Interrupted(signum)


def _program(args) -> tuple[MappingText, CompileContext]:
    """The mapping and the context of `compile`, `explain` and `check`, as `convert` would
    compile them: the source's shards and record, the destination's shards (listed, or
    derived through a mesh layout), strict unless --lenient."""
    from aoa.mapping import read_mapping, read_shard_info, read_source
    from aoa.pipeline import new_context
    from aoa.record import source_record

    mapping = read_mapping(args.mapping)
    mapping = mapping._replace(reverse=mapping.reverse or args.reverse)
    strict = not args.lenient
    source, checkpoint = read_source(args.source, args.source_format)
    fused = source_record(checkpoint) if checkpoint is not None else None
    destination: Mapping[str, Sequence[ShardDesc]] | None = read_shard_info(
        args.destination, "destination")
    if args.layout is not None:
        from aoa.jobs.convert import destination_shards  # numpy, only for a layout
        from aoa.mesh_layout import read_mesh_layout

        destination, _ = destination_shards(mapping, source,
                                            layout=read_mesh_layout(args.layout),
                                            destination=destination, strict=strict)
    return mapping, new_context(source, destination, mapping.reverse, strict=strict,
                                fused=fused)


def _compilation(args, passes: Sequence[Pass] | None = None) -> Compilation:
    from aoa.passes import PIPELINE
    from aoa.pipeline import compile_in

    mapping, ctx = _program(args)
    return compile_in(ctx, mapping.statements, file=mapping.file,
                      passes=PIPELINE if passes is None else passes)


def cmd_compile(args) -> int:
    import json

    compilation = _compilation(args)
    plan = compilation.plan()
    text = json.dumps(plan.to_json(), indent=1)
    if args.output:
        Path(args.output).write_text(text)
        print(f"wrote {args.output}: {len(plan.destinations)} destination shards, "
              f"{len(plan.copies)} copies")
    else:
        print(text)
    return EXIT_OK


def cmd_explain(args) -> int:
    if args.print_after or args.time_passes:
        return _explain_passes(args)
    from aoa.passes import propagate_shapes, share_instances, through
    from aoa.printer import Printer

    printer = Printer(sys.stdout)
    # every template instance in full, and nothing planned unless asked
    compilation = _compilation(args, tuple(p for p in through(propagate_shapes)
                                           if p is not share_instances))
    print("# statements after macro expansion")
    printer.print_program(compilation.program)
    print()
    print("# destination keys and their pieces")
    printer.print_tensors(compilation.tensors)
    if args.plan:
        print()
        printer.print_plan(compilation.plan())
    return EXIT_OK


def _explain_passes(args) -> int:
    """The pipeline as `aoa compile` runs it, printing the IR after the passes asked for
    (up to the last of them, or all with --time-passes or --plan) and timing each."""
    from aoa.passes import PIPELINE, through
    from aoa.passes.parse import texts
    from aoa.pipeline import run_passes
    from aoa.printer import Printer

    printer = Printer(sys.stdout)
    wanted = set(args.print_after or ())
    if "all" in wanted:
        wanted = {p.NAME for p in PIPELINE}
    passes: tuple[Pass, ...] = PIPELINE
    if not (args.time_passes or args.plan):
        passes = through(max((p for p in PIPELINE if p.NAME in wanted), key=PIPELINE.index))
    times: list[tuple[str, float]] = []

    def after(name: str, ir: object, ctx: CompileContext, seconds: float) -> None:
        times.append((name, seconds))
        if name in wanted:
            printer.line(f"# after {name}")
            printer.print_ir(ir)

    mapping, ctx = _program(args)
    try:
        run_passes(texts(mapping.statements, file=mapping.file), ctx, passes, after)
    finally:
        if args.time_passes:
            _print_times(times)
    return EXIT_OK


def _print_times(times: Sequence[tuple[str, float]]) -> None:
    """Seconds per pass and share of the total, on stderr (stdout holds the IR)."""
    total = sum(seconds for _, seconds in times) or 1e-9
    print(f"{'pass':<18} {'seconds':>9} {'share':>7}", file=sys.stderr)
    for name, seconds in times:
        print(f"{name:<18} {seconds:>9.4f} {seconds / total:>7.1%}", file=sys.stderr)
    print(f"{'total':<18} {sum(s for _, s in times):>9.4f}", file=sys.stderr)


def cmd_check(args) -> int:
    compilation = _compilation(args)
    compilation.plan()
    for note in compilation.ctx.notes:
        print(note.render())
    print(f"ok: {len(compilation.program.statements)} statements after expansion, "
          f"{len(compilation.ctx.notes)} notes")
    return EXIT_OK


def _source_then_destination(args, destination: Callable[[], ShardInfo | None]
                             ) -> tuple[ShardInfo | None, Source]:
    """The `--destination`'s shard info (``destination()``: read aside meanwhile, by
    `aoa.mapping.shard_info_read_aside`) and the source, opened; the destination's faults
    are reported first, as when it was read first. Its records are made while the source's
    reader waits for a child of its own (`aoa.forked.meanwhile`), where it has one."""
    from aoa.forked import meanwhile
    from aoa.storage.formats import open_source

    destination = _once(destination)
    try:
        with meanwhile(destination):
            checkpoint = open_source(args.source, args.source_format)
    except BaseException:
        destination()
        raise
    try:
        return destination(), checkpoint
    except BaseException:
        checkpoint.close()
        raise


def _once(work: Callable[[], T]) -> Callable[[], T]:
    """``work``, done the first time it is called; each call returns its result or raises
    its error again."""
    done: list[T] = []
    failed: list[BaseException] = []

    def once() -> T:
        if failed:
            raise failed[0]
        if not done:
            try:
                done.append(work())
            except BaseException as error:
                failed.append(error)
                raise
        return done[0]

    return once


def cmd_convert(args) -> int:
    if args.to is not None:
        return cmd_convert_model(args)
    if args.mapping is None:
        raise UsageError("convert needs a mapping (MAPPING.aoa) or a target (--to "
                         "paddleformers, --to megatron, --to hf)")
    for option in ("tp", "ep", "pp", "dtype", "mapping_file", *_TARGET_OPTIONS):
        if getattr(args, option) is not None:
            raise UsageError(f"--{option.replace('_file', '').replace('_', '-')} goes with --to")
    from aoa.mapping import read_mapping, shard_info_read_aside

    # the destination's shard info is read in a child from here, the second core's work
    # while this process imports the compiler and the kernel and opens the source
    with shard_info_read_aside(args.destination, "destination") as read_destination:
        from aoa.jobs.convert import execute, prepare
        from aoa.jobs.distributed import rank_share
        from aoa.mesh_layout import read_mesh_layout
        from aoa.runtime.progress import progress_bar

        mapping = read_mapping(args.mapping)
        mapping = mapping._replace(reverse=mapping.reverse or args.reverse)
        layout = read_mesh_layout(args.layout) if args.layout else None
        destination, checkpoint = _source_then_destination(args, read_destination)
    max_file_bytes = None if args.max_file_size is None else int(args.max_file_size * 1e9)
    with checkpoint:
        conversion = prepare(mapping, checkpoint, layout=layout, destination=destination,
                             output_format=args.output_format, max_file_bytes=max_file_bytes,
                             strict=not args.lenient)
        for note in conversion.notes:
            print(note, file=sys.stderr)
        if args.dry_run:
            print(conversion.describe())
            return EXIT_OK
        share = rank_share(args.rank, args.world_size)  # None: this process writes all
        files = conversion.files if share is None else share.files(conversion)
        nbytes = sum(f.nbytes for f in files)
        try:
            with progress_bar(nbytes, "writing", show=not args.quiet) as advance:
                if share is None:
                    execute(conversion, args.output, threads=args.threads, progress=advance)
                else:
                    share.execute(conversion, args.output, threads=args.threads,
                                  progress=advance)
        finally:
            if share is not None:
                share.close()
    for note in conversion.write_notes:
        print(f"note: {note}", file=sys.stderr)
    rate = nbytes / conversion.seconds / 1e9 if conversion.seconds else 0.0
    plural = "s" if len(files) != 1 else ""
    print(f"wrote {len(files)} file{plural} ({nbytes / 1e9:.3f} GB) to "
          f"{args.output} in {conversion.seconds:.2f} s, {rate:.2f} GB/s")
    _keep_until_exit(conversion, destination)
    return EXIT_OK


#: Options of one target (`megatron`), as flags.
_TARGET_OPTIONS = ("transformer_impl", "experts")


def _options(args) -> dict[str, str | None]:
    return {name: getattr(args, name) for name in _TARGET_OPTIONS}


def _mesh(args):
    from aoa.models import Mesh

    given = {name: getattr(args, name) for name in ("tp", "ep", "pp")}
    if all(value is None for value in given.values()):
        return None
    return Mesh(**{name: value or 1 for name, value in given.items()})


def cmd_convert_model(args) -> int:
    """`aoa convert --to TARGET`: the mapping and layout come from the model library."""
    from aoa.models import convert as model_convert

    if args.mapping is not None:
        raise UsageError("with --to the mapping comes from config.json; pass an edited one "
                         "with --mapping FILE")
    for option in ("layout", "destination", "rank", "world_size"):
        if getattr(args, option) not in (None, False):
            raise UsageError(f"--{option.replace('_', '-')} does not go with --to")
    if args.reverse:
        raise UsageError("--reverse does not go with --to (use --to hf to go back)")
    from aoa.runtime.progress import progress_bar
    from aoa.storage.formats import open_source

    for option in ("source_format", "max_file_size"):
        if getattr(args, option) is not None:
            raise UsageError(f"--{option.replace('_', '-')} does not go with --to")
    if not args.dry_run:
        model_convert.check_output(Path(args.output))
    with open_source(args.source) as checkpoint:
        job = model_convert.plan_job(args.source, checkpoint, target=args.to,
                                     mesh=_mesh(args), dtype=args.dtype,
                                     mapping_file=args.mapping_file,
                                     output_format=args.output_format, options=_options(args),
                                     strict=not args.lenient)
        if args.dry_run:
            print(job.text)
            print(job.conversion.describe())
            return EXIT_OK
        with progress_bar(job.conversion.nbytes, "writing", show=not args.quiet) as advance:
            model_convert.write_job(job, args.source, args.output, threads=args.threads,
                                    progress=advance)
    for note in job.notes + job.conversion.notes:
        print(note, file=sys.stderr)
    conversion = job.conversion
    rate = conversion.nbytes / conversion.seconds / 1e9 if conversion.seconds else 0.0
    mesh = job.record["mesh"]
    where = "Hugging Face" if args.to == "hf" else (
        f"{args.to}, tp {mesh['tp']} ep {mesh['ep']} pp {mesh['pp']}")
    print(f"{job.mapping.name} ({job.mapping.model_type}) -> {where}: wrote "
          f"{len(conversion.files)} files ({conversion.nbytes / 1e9:.3f} GB) to {args.output} "
          f"in {conversion.seconds:.2f} s, {rate:.2f} GB/s")
    return EXIT_OK


def cmd_mapping(args) -> int:
    """`aoa mapping --config config.json --to TARGET`: the mapping and layout to read or edit."""
    from aoa.inputs import load_json, read_text
    from aoa.mesh_layout import layout_text
    from aoa.models import Config, mapping_for

    data = load_json(read_text(args.config, "config"), args.config)
    if not isinstance(data, dict):
        raise UsageError(f"{args.config}: expected a JSON object")
    mapping = mapping_for(Config(data, args.config), args.to, _mesh(args), dtype=args.dtype,
                          options=_options(args))
    print(mapping.inverse() if args.inverse else mapping.forward, end="")
    if not args.inverse:
        print()
        print("# layout (TOML, as `aoa convert --layout` reads it)")
        print("\n".join(f"# {line}" if line else "#"
                        for line in layout_text(mapping.layout).splitlines()))
    return EXIT_OK


def cmd_demo(args) -> int:
    from aoa import demo

    return EXIT_OK if demo.run(threads=args.threads, keep=args.keep) == 0 else EXIT_ERRORS


def _add_program_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("mapping", help="AOA statements: a .aoa file, or JSON (a list of "
                                        "statements or Paddle's aoa_config)")
    parser.add_argument("--source", required=True,
                        help="the source: a checkpoint, as for convert (a file or folder), or "
                             "its shard info (JSON)")
    parser.add_argument("--source-format", metavar="FORMAT",
                        help="the source checkpoint's format (default: detected from its "
                             "contents): " + ", ".join(FORMAT_NAMES))
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--destination", help="destination shard info (JSON); without it "
                                             "the outputs are derived, as in a full export")
    where.add_argument("--layout", help="destination mesh and rules (TOML), as convert "
                                        "takes them")
    parser.add_argument("--reverse", action="store_true",
                        help="run the program backwards (Paddle's aoa_config_reverse)")
    _add_lenient(parser)


def _add_lenient(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lenient", action="store_true",
                        help="run what Paddle runs, with notes instead of errors: a statement "
                             "that expands to nothing, a source key passed on unmentioned "
                             "while others are renamed, a layout rule that decides nothing, a "
                             "fused tensor (as the source's record says) re-laid without its "
                             "macro, a fused_qkv group split between ranks")


def _add_model_arguments(parser: argparse.ArgumentParser, required: bool = False) -> None:
    parser.add_argument("--to", required=required,
                        help="target layout: paddleformers, megatron, or hf (back to Hugging "
                             "Face, from the folder's record); the family comes from "
                             "config.json")
    for name, what in (("tp", "tensor"), ("ep", "expert"), ("pp", "pipeline")):
        parser.add_argument(f"--{name}", type=int, help=f"{what}-parallel degree (default 1)")
    parser.add_argument("--dtype", help="store the weights in this dtype (float32, bfloat16, "
                                        "float16; what the target keeps in float32 stays)")
    parser.add_argument("--transformer-impl", choices=("transformer_engine", "local"),
                        help="with --to megatron: the modules the model is built from, as "
                             "Megatron's flag (default transformer_engine: norms held by "
                             "linear_qkv and linear_fc1)")
    parser.add_argument("--experts", choices=("grouped", "sequential"),
                        help="with --to megatron: experts as TEGroupedMLP (linear_fc1.weightN; "
                             "the default with transformer_engine) or SequentialMLP "
                             "(local_experts.N)")


class _PassNames:
    """The choices of --print-after: the pipeline's pass names and 'all', looked up only
    when an argument is checked or `aoa explain --help` shows them."""

    def __iter__(self) -> Iterator[str]:
        from aoa.passes import PIPELINE

        return iter([p.NAME for p in PIPELINE] + ["all"])

    def __contains__(self, name: object) -> bool:
        return name in list(self)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aoa", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    compile_parser = commands.add_parser("compile", help="compile a mapping into a plan (JSON)")
    _add_program_arguments(compile_parser)
    compile_parser.add_argument("-o", "--output", help="write the plan here (default stdout)")
    compile_parser.set_defaults(run=cmd_compile)
    explain = commands.add_parser("explain", help="show the expanded statements and, per "
                                                  "destination key, its pieces")
    _add_program_arguments(explain)
    explain.add_argument("--plan", action="store_true", help="also describe the plan")
    explain.add_argument("--print-after", action="append", metavar="PASS",
                         choices=_PassNames(),
                         help="print the IR after this pass (repeatable; 'all': every "
                              "pass), running the passes as `aoa compile` does: "
                              "%(choices)s")
    explain.add_argument("--time-passes", action="store_true",
                         help="time each pass (on stderr)")
    explain.set_defaults(run=cmd_explain)
    check = commands.add_parser("check", help="report errors and notes (exit 1 on errors)")
    _add_program_arguments(check)
    check.set_defaults(run=cmd_check)
    convert = commands.add_parser("convert", help="convert a checkpoint through a mapping")
    convert.add_argument("mapping", nargs="?",
                         help="AOA statements (.aoa, or JSON); or name a target with --to")
    convert.add_argument("--source", required=True,
                         help="source checkpoint: a folder or file (safetensors, Paddle, "
                              "PyTorch DCP, Megatron torch_dist, pytorch_model.bin; of several "
                              "Paddle saves in one folder, give the chosen {n}.metadata)")
    convert.add_argument("--source-format", metavar="FORMAT",
                         help="the source's format (default: detected from its contents): "
                              + ", ".join(FORMAT_NAMES))
    convert.add_argument("--output", required=True, help="destination folder (new or empty)")
    convert.add_argument("--output-format", metavar="FORMAT",
                         help="the output's format (default: safetensors for whole tensors, "
                              "dcp-safetensors for a layout or shard list, paddle for "
                              "--to paddleformers, torch_dist for --to megatron)")
    where = convert.add_mutually_exclusive_group()
    where.add_argument("--layout", help="destination mesh and rules (TOML); without it and "
                                        "without --destination: full, unsharded tensors")
    where.add_argument("--destination", help="destination shard info (JSON)")
    convert.add_argument("--threads", type=int, help="copy threads (default: all CPUs)")
    convert.add_argument("--dry-run", action="store_true",
                         help="print what would be written and write nothing")
    convert.add_argument("--max-file-size", type=float,
                         help=f"GB per Hugging Face file (default "
                              f"{DEFAULT_MAX_FILE_BYTES / 1e9:g})")
    convert.add_argument("--reverse", action="store_true", help="run the program backwards")
    _add_lenient(convert)
    convert.add_argument("--quiet", action="store_true", help="no progress bar")
    convert.add_argument("--rank", type=int, help="with --world-size: this process writes "
                         "its share of the files, rank 0 the index once all are done (under "
                         "torchrun both come from its environment)")
    convert.add_argument("--world-size", type=int, help="how many processes share the work")
    _add_model_arguments(convert)
    convert.add_argument("--mapping", dest="mapping_file",
                         help="with --to: an edited mapping (from `aoa mapping`) instead of "
                              "the one made from config.json")
    convert.set_defaults(run=cmd_convert)
    mapping = commands.add_parser("mapping", help="print the mapping and layout the model "
                                                  "library makes from a config.json")
    mapping.add_argument("--config", required=True, help="a Hugging Face config.json")
    _add_model_arguments(mapping, required=True)
    mapping.add_argument("--inverse", action="store_true",
                         help="print the way back (target -> Hugging Face) instead")
    mapping.set_defaults(run=cmd_mapping)
    demo = commands.add_parser("demo", help="convert a small built-in Llama-like checkpoint "
                                            "and verify it against numpy")
    demo.add_argument("--threads", type=int)
    demo.add_argument("--keep", help="work in this folder and keep the files")
    demo.set_defaults(run=cmd_demo)
    return parser


#: What a command made, kept from being freed where the process ends right after it (`run`).
_kept: list[object] | None = None


def _keep_until_exit(*made: object) -> None:
    """Keep ``made`` (a conversion's plan and shard records: objects by the million) where
    `run` ends the process after the command: freeing them one by one is wasted work."""
    if _kept is not None:
        _kept.extend(made)


def run() -> NoReturn:
    """The `aoa` command as a process: `main`, then the process ends at once, its output
    flushed. The files a command writes are complete and durable before it returns; what it
    made in memory goes back to the system with the process, neither freed object by object
    nor walked by the interpreter's teardown. The cyclic collector stays off throughout: once
    back on, its first collection would walk every object the command kept (0.1 s here).
    numpy's BLAS gets one thread unless the user says otherwise: aoa does no linear algebra,
    and OpenBLAS's thread server spins ~0.07-0.12 s of a core after `import numpy`."""
    global _kept
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    _kept = []
    gc.disable()
    code = main()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe, a closed stream
            stream.flush()
    os._exit(code)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit:
        return EXIT_USAGE if exit.code else EXIT_OK
    handlers = ({stop: signal.signal(stop, _stop) for stop in STOP_SIGNALS}
                if threading.current_thread() is threading.main_thread() else {})
    try:
        # One command, then the process ends: its objects (a model's shard records by the
        # hundred thousand) make no cycles worth collecting meanwhile, and each full
        # collection would walk all of them (0.3 s of a 31k-tensor convert).
        with collector_paused():
            return args.run(args)
    except KeyboardInterrupt as interrupt:
        signum = interrupt.signum if isinstance(interrupt, Interrupted) else signal.SIGINT
        print(f"aoa: interrupted by {signal.Signals(signum).name}; nothing was left half-"
              "written", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `aoa explain ... | head`: the reader has seen enough
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - Python flushes it at exit
        return EXIT_OK
    except UsageError as error:
        print(f"aoa: {error.render()}", file=sys.stderr)
        return EXIT_USAGE
    except AoaError as error:
        print(error.render(), file=sys.stderr)
        return EXIT_ERRORS
    finally:
        for stop, handler in handlers.items():
            signal.signal(stop, handler)


if __name__ == "__main__":
    run()
