"""The `aoa` command line: compile, explain, check (and the main job, convert and demo)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from aoa.errors import AoaError, UsageError
from aoa.layout import ShardDesc
from aoa.pipeline import Compilation, analyze

EXIT_OK, EXIT_ERRORS, EXIT_USAGE = 0, 1, 2


def read_mapping(path: str) -> tuple[str | list[str], bool, str]:
    """A `.aoa` file, or JSON: a list of statements or Paddle's aoa_config dict.

    Returns (statements, reverse flag from the file, file name for messages)."""
    file = Path(path)
    try:
        text = file.read_text()
    except OSError as error:
        raise UsageError(f"cannot read mapping {path}: {error.strerror}") from None
    if file.suffix != ".json":
        return text, False, str(file)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise UsageError(f"{path}:{error.lineno}:{error.colno}: not valid JSON: {error.msg}"
                         ) from None
    if isinstance(data, dict):
        return (list(data.get("aoa_statements", [])), bool(data.get("aoa_config_reverse")),
                str(file))
    if isinstance(data, list) and all(isinstance(s, str) for s in data):
        return data, False, str(file)
    raise UsageError(f"{path}: expected a list of statements or an object with "
                     "'aoa_statements'")


def read_shard_info(path: str | None, what: str) -> dict[str, list[ShardDesc]] | None:
    """Shard-info JSON: {key: [{key, local_shape, global_shape, global_offset, dtype}, ...]}."""
    if path is None:
        return None
    try:
        data = json.loads(Path(path).read_text())
    except OSError as error:
        raise UsageError(f"cannot read {what} shard info {path}: {error.strerror}") from None
    except json.JSONDecodeError as error:
        raise UsageError(f"{path}:{error.lineno}:{error.colno}: not valid JSON: {error.msg}"
                         ) from None
    if not isinstance(data, dict):
        raise UsageError(f"{path}: expected an object mapping keys to lists of shards")
    try:
        return {key: [ShardDesc.from_json(s) for s in (shards if isinstance(shards, list)
                                                       else [shards])]
                for key, shards in data.items()}
    except (KeyError, TypeError, ValueError) as error:
        raise UsageError(f"{path}: a shard description needs key, local_shape, global_shape, "
                         f"global_offset and dtype ({error})") from None


def _compilation(args, share: bool = True) -> Compilation:
    statements, reverse, file = read_mapping(args.mapping)
    return analyze(statements, read_shard_info(args.source, "source") or {},
                   read_shard_info(args.destination, "destination"),
                   reverse=reverse or args.reverse, file=file, share=share)


def cmd_compile(args) -> int:
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
    compilation = _compilation(args, share=False)
    print("# statements after macro expansion")
    for statement in compilation.program.statements:
        written = statement.written()
        where = written.span.location() if written.span else "?"
        steps = [macro for macro, _ in statement.expansion()]
        via = f"  [{where}{' via ' + ', '.join(steps) if steps else ''}]"
        print(f"{statement}{via}")
    print()
    print("# destination keys and their pieces")
    state = compilation.ctx.facts["symbolic"]
    for key, tensor in state.outputs.items():
        if tensor is None:
            print(f"{key}: declared empty (`_ -> {key}`), left as it is")
            continue
        print(f"{key}: shape {list(tensor.shape)}, source dtype {tensor.dtype}")
        for key_of_piece, piece in tensor.pieces():
            target = ", ".join(f"{a}:{b}" for a, b in zip(piece.target_lo, piece.target_hi))
            source = ", ".join(f"{a}:{b}" for a, b in zip(piece.source_lo, piece.source_hi))
            ops = [op.text if hasattr(op, "text") else f"cast {op}" for op in piece.ops]
            deleted = "  (deleted by `-> _`)" if key_of_piece in state.removed else ""
            suffix = f"  ({'; '.join(ops)})" if ops else ""
            print(f"    [{target}] <- {key_of_piece}[{source}]{suffix}{deleted}")
    if args.plan:
        print()
        print(compilation.plan().describe())
    return EXIT_OK


def cmd_check(args) -> int:
    compilation = _compilation(args)
    compilation.plan()
    for note in compilation.ctx.notes:
        print(note.render())
    print(f"ok: {len(compilation.program.statements)} statements after expansion, "
          f"{len(compilation.ctx.notes)} notes")
    return EXIT_OK


def cmd_convert(args) -> int:
    if args.to is not None:
        return cmd_convert_model(args)
    if args.mapping is None:
        raise UsageError("convert needs a mapping (MAPPING.aoa) or a target (--to "
                         "paddleformers, --to hf)")
    for option in ("tp", "ep", "pp", "dtype", "mapping_file"):
        if getattr(args, option) is not None:
            raise UsageError(f"--{option.replace('_file', '')} goes with --to")
    from aoa.convert import check_output_folder, execute, prepare
    from aoa.destination_layout import read_layout
    from aoa.distributed import rank_share
    from aoa.storage.checkpoint import open_source_checkpoint

    statements, reverse, file = read_mapping(args.mapping)
    layout = read_layout(args.layout) if args.layout else None
    destination = read_shard_info(args.destination, "destination")
    with open_source_checkpoint(args.source) as checkpoint:
        conversion = prepare(statements, checkpoint, layout=layout, destination=destination,
                             reverse=reverse or args.reverse, file=file,
                             max_file_bytes=int(args.max_file_size * 1e9))
        for note in conversion.notes:
            print(note, file=sys.stderr)
        if args.dry_run:
            print(conversion.describe())
            return EXIT_OK
        share = rank_share(args.rank, args.world_size)  # None: this process writes all
        files = conversion.files if share is None else share.files(conversion)
        nbytes = sum(f.nbytes for f in files)
        try:
            if share is None:
                check_output_folder(Path(args.output))
            with _progress(nbytes, args.quiet) as advance:
                if share is None:
                    execute(conversion, checkpoint, args.output, threads=args.threads,
                            progress=advance, check_output=False)
                else:
                    share.execute(conversion, checkpoint, args.output, threads=args.threads,
                                  progress=advance)
        finally:
            if share is not None:
                share.close()
    rate = nbytes / conversion.seconds / 1e9 if conversion.seconds else 0.0
    plural = "s" if len(files) != 1 else ""
    print(f"wrote {len(files)} file{plural} ({nbytes / 1e9:.3f} GB) to "
          f"{args.output} in {conversion.seconds:.2f} s, {rate:.2f} GB/s")
    return EXIT_OK


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
    from aoa.storage.checkpoint import open_source_checkpoint

    if not args.dry_run:
        model_convert.check_output(Path(args.output))
    with open_source_checkpoint(args.source) as checkpoint:
        job = model_convert.plan_job(args.source, checkpoint, target=args.to,
                                     mesh=_mesh(args), dtype=args.dtype,
                                     mapping_file=args.mapping_file)
        if args.dry_run:
            print(job.text)
            print(job.conversion.describe())
            return EXIT_OK
        with _progress(job.conversion.nbytes, args.quiet) as advance:
            model_convert.write_job(job, checkpoint, args.source, args.output,
                                    threads=args.threads, progress=advance)
    for note in job.notes + job.conversion.notes:
        print(note, file=sys.stderr)
    conversion = job.conversion
    rate = conversion.nbytes / conversion.seconds / 1e9 if conversion.seconds else 0.0
    mesh = job.record["mesh"]
    where = "Hugging Face" if args.to == "hf" else (
        f"{args.to}, tp {mesh['tp']} ep {mesh['ep']} pp {mesh['pp']}")
    print(f"{job.mapping.family} ({job.mapping.model_type}) -> {where}: wrote "
          f"{len(conversion.files)} files ({conversion.nbytes / 1e9:.3f} GB) to {args.output} "
          f"in {conversion.seconds:.2f} s, {rate:.2f} GB/s")
    return EXIT_OK


def cmd_mapping(args) -> int:
    """`aoa mapping --config config.json --to TARGET`: the mapping and layout to read or edit."""
    from aoa.destination_layout import layout_text
    from aoa.models import Config, mapping_for

    try:
        data = json.loads(Path(args.config).read_text())
    except OSError as error:
        raise UsageError(f"cannot read {args.config}: {error.strerror}") from None
    except json.JSONDecodeError as error:
        raise UsageError(f"{args.config}:{error.lineno}:{error.colno}: not valid JSON: "
                         f"{error.msg}") from None
    mapping = mapping_for(Config(data, args.config), args.to, _mesh(args), dtype=args.dtype)
    print(mapping.inverse() if args.inverse else mapping.forward, end="")
    if not args.inverse:
        print()
        print("# layout (TOML, as `aoa convert --layout` reads it)")
        print("\n".join(f"# {line}" if line else "#"
                        for line in layout_text(mapping.layout).splitlines()))
    return EXIT_OK


class _progress:
    """A byte-counting progress bar (tqdm) on stderr, or nothing when quiet."""

    def __init__(self, total: int, quiet: bool) -> None:
        self.total, self.quiet, self.bar = total, quiet, None

    def __enter__(self):
        if self.quiet:
            return None
        from tqdm import tqdm

        self.bar = tqdm(total=self.total, unit="B", unit_scale=True, unit_divisor=1000,
                        desc="writing", file=sys.stderr, leave=False)
        return self.bar.update

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.close()


def cmd_demo(args) -> int:
    from aoa import demo

    return EXIT_OK if demo.run(threads=args.threads, keep=args.keep) == 0 else EXIT_ERRORS


def _add_program_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("mapping", help="AOA statements: a .aoa file, or JSON (a list of "
                                        "statements or Paddle's aoa_config)")
    parser.add_argument("--source", required=True, help="source shard info (JSON)")
    parser.add_argument("--destination", help="destination shard info (JSON); without it "
                                              "the outputs are derived, as in a full export")
    parser.add_argument("--reverse", action="store_true",
                        help="run the program backwards (Paddle's aoa_config_reverse)")


def _add_model_arguments(parser: argparse.ArgumentParser, required: bool = False) -> None:
    parser.add_argument("--to", required=required,
                        help="target layout: paddleformers, or hf (back to Hugging Face, "
                             "from the folder's record); the family comes from config.json")
    for name, what in (("tp", "tensor"), ("ep", "expert"), ("pp", "pipeline")):
        parser.add_argument(f"--{name}", type=int, help=f"{what}-parallel degree (default 1)")
    parser.add_argument("--dtype", help="store the weights in this dtype (float32, bfloat16, "
                                        "float16; what the target keeps in float32 stays)")


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
    explain.set_defaults(run=cmd_explain)
    check = commands.add_parser("check", help="report errors and notes (exit 1 on errors)")
    _add_program_arguments(check)
    check.set_defaults(run=cmd_check)
    convert = commands.add_parser("convert", help="convert a checkpoint through a mapping")
    convert.add_argument("mapping", nargs="?",
                         help="AOA statements (.aoa, or JSON); or name a target with --to")
    convert.add_argument("--source", required=True,
                         help="source checkpoint: a safetensors file or folder (Hugging Face, "
                              "or sharded with DCP_SHARDING_INFO)")
    convert.add_argument("--output", required=True, help="destination folder (new or empty)")
    where = convert.add_mutually_exclusive_group()
    where.add_argument("--layout", help="destination mesh and rules (TOML); without it and "
                                        "without --destination: full, unsharded tensors")
    where.add_argument("--destination", help="destination shard info (JSON)")
    convert.add_argument("--threads", type=int, help="copy threads (default: all CPUs)")
    convert.add_argument("--dry-run", action="store_true",
                         help="print what would be written and write nothing")
    convert.add_argument("--max-file-size", type=float, default=5.0,
                         help="GB per Hugging Face file (default 5)")
    convert.add_argument("--reverse", action="store_true", help="run the program backwards")
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit:
        return EXIT_USAGE if exit.code else EXIT_OK
    try:
        return args.run(args)
    except BrokenPipeError:  # `aoa explain ... | head`: the reader has seen enough
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - Python flushes it at exit
        return EXIT_OK
    except UsageError as error:
        print(f"aoa: {error.render()}", file=sys.stderr)
        return EXIT_USAGE
    except AoaError as error:
        print(error.render(), file=sys.stderr)
        return EXIT_ERRORS


if __name__ == "__main__":
    sys.exit(main())
