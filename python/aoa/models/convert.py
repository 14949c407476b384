"""Convert a model folder by naming its target: the family from config.json, the mapping and
the layout from the model library, the conversion from `aoa.jobs.convert`.

Three directions, told apart by the source folder and ``--to``:

* a Hugging Face folder `--to paddleformers` or `--to megatron`: forward, at the degrees
  asked for;
* a folder this job wrote `--to hf`: back to Hugging Face, from its record alone;
* a folder this job wrote `--to` its own target: laid out again at other degrees (fused
  layouts that depend on the degree are re-interleaved, never copied as they lie).

Before a byte moves, the source must hold exactly the tensors its family has for this config
(a missing key, an unknown key or a shape the config does not give is an error), and the
output folder must be new or empty. The output holds the checkpoint, the config, tokenizer
and generation files, and ``aoa-conversion.json``: family, target, mesh, dtype, the target's
options, the exact mapping text and aoa's version.

A target's own format (`megatron`: ``torch_dist``, its default) stores the keys as the
target's framework does (Megatron: stacked layers and experts, `aoa.storage.stacked`) with
the sharded objects it expects beside them (``_extra_state``); the record keeps the stacking,
and a folder read back is seen through it, one key per layer and expert. In any other format
the keys are the mapping's own.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from aoa.block_scales import FP8, Quantized
from aoa.errors import StorageError, UsageError
from aoa.inputs import load_json, read_text
from aoa.jobs.convert import Conversion, execute, prepare
from aoa.jobs.job import derived_outputs
from aoa.layout import ShardDesc
from aoa.mapping import MappingText
from aoa.mesh_layout import MeshLayout, layout_text
from aoa.models import TARGETS, family_of
from aoa.models.base import Config, Expected, Mesh, ModelError
from aoa.models.fp8 import (
    SUFFIX,
    Fp8Weights,
    block_of,
    check_scales_follow,
    check_whole_blocks,
    kept_weights,
    quantized_keys,
    scale_tensors,
    stored_fp8,
    without_quantization,
)
from aoa.models.mapping import ModelMapping, build, template_dtypes, templates_of
from aoa.record import RECORD, read_record
from aoa.storage.formats import Source, open_source
from aoa.storage.stacked import Stacking, UnstackedSource
from aoa.storage.torch_dist import sharded_object

HF = "hf"
#: Each target's own checkpoint format: its default, and the one its stacking and sharded
#: objects are for. PaddleFormers loads Paddle FlexCheckpoint as it is (``load_state_dict``).
OWN_FORMATS = {"megatron": "torch_dist", "paddleformers": "paddle"}
#: Files beside the weights that a model folder needs, copied as they are.
_SIDE_FILES = ("config.json", "generation_config.json", "special_tokens_map.json",
               "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt",
               "chat_template.jinja", "chat_template.json", "preprocessor_config.json")
_SIDE_PATTERNS = ("tokenizer*", "*.tiktoken", "*.model")


@dataclass
class Job:
    """What a model conversion will do: the text it runs, where and how."""

    direction: str  # "forward", "inverse" or "reshard"
    mapping: ModelMapping
    text: str
    layout: MeshLayout | None
    conversion: Conversion
    record: dict[str, Any]
    notes: list[str] = field(default_factory=list)


def aoa_version() -> str:
    try:
        return metadata.version("aoa-checkpoint")
    except metadata.PackageNotFoundError:
        return "unknown"


def read_config(folder: Path) -> Config:
    path = folder / "config.json"
    if not path.is_file():
        raise UsageError(f"{folder}: no config.json; the model family comes from it",
                         hint="Convert a Hugging Face model folder, or write the mapping by "
                              "hand and use `aoa convert MAPPING.aoa`.")
    data = load_json(read_text(path, "config", ModelError), str(path), ModelError)
    if not isinstance(data, dict):
        raise ModelError(f"{path}: expected a JSON object")
    return Config(data, str(path))


def check_output(output: Path) -> None:
    """Nothing is written into a folder that holds anything."""
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        what = "folder is not empty" if output.is_dir() else "is a file"
        raise StorageError(f"{output}: the output {what}",
                           hint="Convert into a new or empty folder.")


def plan_job(source: str | Path, checkpoint: Source, *, target: str,
             mesh: Mesh | None = None, dtype: str | None = None,
             mapping_file: str | Path | None = None, output_format: str | None = None,
             options: Mapping[str, str | None] | None = None, strict: bool = True) -> Job:
    """Decide the direction, check the source against its family, make the text and the
    layout, and prepare the conversion (nothing is written). ``options``: the target's own
    (`megatron`: transformer_impl, experts). ``strict``: as for `aoa.jobs.convert.prepare`
    (the library's own mappings pass it; an edited one may not)."""
    source = Path(source)
    if target not in (*TARGETS, HF):
        raise UsageError(f"--to {target}: choose one of {', '.join((*TARGETS, HF))}")
    record = read_record(source)
    cfg = read_config(source)
    family = family_of(cfg)
    if record is None:
        if target == HF:
            raise UsageError(f"{source}: not a folder aoa converted (no {RECORD}); it is "
                             "already in Hugging Face layout")
        return _forward(cfg, family, checkpoint, target, mesh or Mesh(), dtype, mapping_file,
                        output_format, options or {}, strict)
    if record["family"] != family.name:
        raise ModelError(f"{source / RECORD}: records family '{record['family']}', but "
                         f"config.json is of family '{family.name}'")
    given = {name: value for name, value in (options or {}).items() if value is not None}
    checkpoint = _unstacked(checkpoint, record)
    if target == HF:
        if mesh is not None or dtype is not None or mapping_file is not None or given:
            raise UsageError("--to hf takes everything from the record; give no --tp, --ep, "
                             "--pp, --dtype, --mapping or target options")
        return _inverse(cfg, family, checkpoint, record, output_format, strict)
    if target != record["target"]:
        raise UsageError(f"{source} holds the {record['target']} layout; convert it --to hf "
                         f"first, then --to {target}")
    recorded = record.get("options", {})
    changed = sorted(name for name, value in given.items() if recorded.get(name) != value)
    if changed:
        raise UsageError(f"{source} was written with "
                         + ", ".join(f"--{n.replace('_', '-')} {recorded.get(n)}"
                                     for n in changed)
                         + f"; convert it --to hf first, then --to {target} with other options")
    return _reshard(cfg, family, checkpoint, record, mesh or Mesh(), dtype, output_format,
                    strict)


def run(source: str | Path, output: str | Path, *, target: str, mesh: Mesh | None = None,
        dtype: str | None = None, mapping_file: str | Path | None = None,
        output_format: str | None = None, threads: int | None = None,
        progress: Callable[[int], None] | None = None, dry_run: bool = False,
        strict: bool = True) -> Job:
    """Plan the job, then (unless a dry run) write the checkpoint, side files and record.
    ``output_format``: the files' format (default: the target's own, `OWN_FORMATS`; Hugging
    Face safetensors for `hf`)."""
    output = Path(output)
    if not dry_run:
        check_output(output)
    with open_source(source) as checkpoint:
        job = plan_job(source, checkpoint, target=target, mesh=mesh, dtype=dtype,
                       mapping_file=mapping_file, output_format=output_format, strict=strict)
        if not dry_run:
            write_job(job, source, output, threads=threads, progress=progress)
    return job


def write_job(job: Job, source: str | Path, output: str | Path, *,
              threads: int | None = None, progress: Callable[[int], None] | None = None
              ) -> None:
    """Write the checkpoint, then the side files and the record (last: a folder with a
    record holds everything it names)."""
    output = Path(output)
    check_output(output)
    execute(job.conversion, output, threads=threads, progress=progress)
    copy_side_files(Path(source), output)
    if "dequantized" in job.record:  # the weights are no longer fp8
        config = json.loads((output / "config.json").read_text())
        (output / "config.json").write_text(json.dumps(without_quantization(config), indent=2)
                                            + "\n")
    if job.direction != "inverse":  # a Hugging Face folder stays a plain one
        job.record["format"] = job.conversion.format.name
        (output / RECORD).write_text(json.dumps(job.record, indent=1) + "\n")


def copy_side_files(source: Path, output: Path) -> None:
    names = {source / name for name in _SIDE_FILES}
    for pattern in _SIDE_PATTERNS:
        names.update(source.glob(pattern))
    for path in sorted(names):
        if path.is_file():
            shutil.copyfile(path, output / path.name)


# --- the three directions ------------------------------------------------------------------


def _forward(cfg: Config, family, checkpoint: Source, target: str, mesh: Mesh,
             dtype: str | None, mapping_file: str | Path | None, output_format: str | None,
             options: Mapping[str, str | None], strict: bool) -> Job:
    info = checkpoint.shards
    expected = family.tensors(cfg.with_checkpoint(frozenset(info)))
    expected.update(scale_tensors(info, expected, cfg))
    absent = check_tensors(info, expected, cfg, family.name)
    notes = [f"{cfg.path}: '{group}' is {cfg.data.get(group)}, but the checkpoint holds none "
             "of those layers; converted without them" for group in sorted(absent)]
    cfg = cfg.with_checkpoint(frozenset(info), sorted(absent))
    key_dtypes = {key: shards[0].dtype or "float32" for key, shards in info.items()}
    probe = build(family, cfg, target, mesh, dtype=dtype, options=options)
    reads = sorted({read for step in probe.steps for read in step.reads})
    source_dtypes = template_dtypes(reads, key_dtypes)
    fp8 = stored_fp8(cfg, source_dtypes)
    if fp8 is not None and mapping_file is not None:
        raise ModelError(f"{cfg.path}: the checkpoint stores fp8 weights with scales, and an "
                         "edited mapping cannot be checked to carry each scale with its weight",
                         hint="Convert without --mapping: --dtype bfloat16 dequantizes, "
                              "no --dtype keeps fp8 with the scales beside the weights.")
    mapping = build(family, cfg, target, mesh, dtype=dtype, source_dtypes=source_dtypes,
                    fp8=fp8, options=options)
    if fp8 is not None:  # the scales' templates too
        reads = sorted({read for step in mapping.steps for read in step.reads})
        source_dtypes = template_dtypes(reads, key_dtypes)
    text, origin = mapping.forward, "aoa.models"
    if mapping_file is not None:
        text, origin = _read_text(mapping_file), str(mapping_file)
    _check_fp8_layout(mapping, {key: shards[0].global_shape for key, shards in info.items()})
    quantized = None
    if fp8 is not None and mapping.dequantizes:
        quantized = {key: Quantized(key + SUFFIX, fp8.block) for key, shards in info.items()
                     if shards[0].dtype in FP8 and key + SUFFIX in info}
    output_format = output_format or OWN_FORMATS.get(target)
    own = output_format is not None and output_format == OWN_FORMATS.get(target)
    conversion = prepare(MappingText(text, False, origin if mapping_file else
                                     "<aoa.models mapping>"),
                         checkpoint, layout=mapping.layout, output_format=output_format,
                         quantized=quantized, strict=strict, **_stored_as(mapping, own))
    _check_fp8_scales(conversion, mapping)
    if mapping.dequantizes:
        record = _dequantized_record(cfg, family, mapping, text, source_dtypes, own)
    else:
        record = _record(mapping, text, origin, source_dtypes, own)
    record["absent_groups"] = sorted(absent)
    return Job("forward", mapping, text, mapping.layout, conversion, record, notes)


def _stored_as(mapping: ModelMapping, own: bool, carried: Mapping[str, bytes] | None = None
               ) -> dict[str, Any]:
    """How a target's files store its keys: in its own format stacked and with its sharded
    objects (those a source of that format holds, the others empty); else as they are."""
    if not own:
        return {"stacking": (), "objects": {}}
    empty = sharded_object()
    objects = {key: empty for key in mapping.objects}
    objects.update(carried or {})
    return {"stacking": mapping.stacking, "objects": objects}


def _unstacked(checkpoint: Source, record: Mapping[str, Any]) -> Source:
    """A folder written in its target's own format, seen one key per layer and expert."""
    rules = record.get("stacking") or []
    if not rules:
        return checkpoint
    try:
        stacking = [Stacking.from_json(rule) for rule in rules]
    except (TypeError, ValueError) as error:
        raise ModelError(f"{checkpoint.path / RECORD}: its stacking is not valid: "
                         f"{error}") from None
    return UnstackedSource(checkpoint, stacking)


def _inverse(cfg: Config, family, checkpoint: Source, record: dict,
             output_format: str | None, strict: bool) -> Job:
    info = checkpoint.shards
    cfg = cfg.with_checkpoint(frozenset(info), record.get("absent_groups", []))
    mapping = build(family, cfg, record["target"], _mesh(record), dtype=record.get("dtype"),
                    fp8=Fp8Weights.from_json(record.get("fp8")),
                    options=record.get("options"))
    _check_target(info, mapping, record, cfg)
    stored = _stored_dtypes(mapping, info)
    if record.get("mapping_origin", "aoa.models") == "aoa.models":
        text, reverse = mapping.inverse(record["source_dtypes"], stored), False
    else:
        text, reverse = record["mapping"], True  # an edited mapping, run backwards
    conversion = prepare(MappingText(text, reverse, "<aoa.models inverse>"), checkpoint,
                         output_format=output_format, strict=strict)
    _check_outputs(conversion, mapping.source_tensors, set(record.get("absent_groups", [])))
    out = dict(record, direction="inverse", target=HF, aoa_version=aoa_version(),
               mapping=text, mapping_origin="aoa.models inverse" if not reverse else
               f"{record.get('mapping_origin')} (reversed)", layout=None)
    out["mesh"] = Mesh().to_json()
    out.pop("stacking", None)
    return Job("inverse", mapping, text, None, conversion, out)


def _reshard(cfg: Config, family, checkpoint: Source, record: dict, mesh: Mesh,
             dtype: str | None, output_format: str | None, strict: bool) -> Job:
    info = checkpoint.shards
    cfg = cfg.with_checkpoint(frozenset(info), record.get("absent_groups", []))
    options = record.get("options")
    fp8 = Fp8Weights.from_json(record.get("fp8"))
    before = build(family, cfg, record["target"], _mesh(record), dtype=record.get("dtype"),
                   fp8=fp8, options=options)
    _check_target(info, before, record, cfg)
    if record.get("mapping_origin", "aoa.models") != "aoa.models":
        raise ModelError("this folder was written with an edited mapping; convert it --to hf "
                         "and then forward again with --mapping")
    mapping = build(family, cfg, record["target"], mesh, dtype=dtype or record.get("dtype"),
                    source_dtypes=record["source_dtypes"], fp8=fp8, options=options)
    text = mapping.reshard(_stored_dtypes(mapping, info))
    _check_fp8_layout(mapping, {key: spec.shape for key, spec in mapping.source_tensors.items()})
    quantized = None
    if mapping.dequantizes:  # the folder kept fp8: its target keys hold the scales
        blocks = before.target_blocks()
        quantized = quantized_keys(info, templates_of(list(info), list(blocks)), blocks)
    output_format = output_format or OWN_FORMATS.get(mapping.target)
    own = output_format is not None and output_format == OWN_FORMATS.get(mapping.target)
    carried = checkpoint.objects() if checkpoint.format == output_format else {}
    conversion = prepare(MappingText(text, False, "<aoa.models reshard>"), checkpoint,
                         layout=mapping.layout, output_format=output_format, strict=strict,
                         quantized=quantized, **_stored_as(mapping, own, carried))
    _check_fp8_scales(conversion, mapping)
    # The record names the mapping from Hugging Face to what the folder now holds.
    if mapping.dequantizes:
        out = _dequantized_record(cfg, family, mapping, text, record["source_dtypes"], own)
    else:
        out = _record(mapping, mapping.forward, "aoa.models", record["source_dtypes"], own)
    out["absent_groups"] = record.get("absent_groups", [])
    out["resharded_with"] = text
    return Job("reshard", mapping, text, mapping.layout, conversion, out)


# --- checks --------------------------------------------------------------------------------


def check_tensors(info: Mapping[str, list[ShardDesc]], expected: Mapping[str, Expected],
                  cfg: Config, family: str) -> set[str]:
    """The checkpoint holds exactly the family's tensors with the shapes the config gives.
    Returns the optional groups that are wholly absent."""
    groups: dict[str, list[str]] = {}
    for key, spec in expected.items():
        if spec.group is not None:
            groups.setdefault(spec.group, []).append(key)
    absent = {group for group, keys in groups.items() if not any(k in info for k in keys)}
    missing = [key for key, spec in expected.items()
               if key not in info and spec.group not in absent]
    if missing:
        raise ModelError(f"the checkpoint lacks {len(missing)} tensor(s) that the {family} "
                         f"family has for {cfg.path}: {_some(missing)}",
                         hint="Check that config.json belongs to these weights (layer and "
                              "expert counts, tie_word_embeddings, bias flags).")
    extra = [key for key in info if key not in expected]
    if extra:
        hint = ("A key the family does not know is never passed on silently: check "
                "config.json, or write the mapping by hand (--mapping).")
        if any(key.endswith(SUFFIX) for key in extra) and block_of(cfg) is None:
            hint = (f"These look like fp8 scales, but {cfg.path} has no fp8 "
                    "quantization_config (quant_method 'fp8', weight_block_size): use the "
                    "release's own config.json.")
        raise ModelError(f"the checkpoint holds {len(extra)} tensor(s) the {family} family "
                         f"does not know for {cfg.path}: {_some(extra)}", hint=hint)
    for key, spec in expected.items():
        if key not in info:
            continue
        shape = info[key][0].global_shape
        if tuple(shape) != spec.shape:
            raise ModelError(f"'{key}' has shape {list(shape)}, but {cfg.path} gives "
                             f"{spec.describe()}",
                             hint="A count in config.json (heads, head_dim, sizes) does not "
                                  "match these weights.")
    return absent


def _check_fp8_layout(mapping: ModelMapping, source: Mapping[str, tuple[int, ...]]) -> None:
    """Before planning: the mesh splits each weight kept in fp8 in whole blocks (so its
    scales can follow; a split through a block is named by its weight, not its scales)."""
    if mapping.fp8 is None or mapping.dequantizes:
        return
    kept = kept_weights(mapping.steps, mapping.fp8.block, source)
    shards = mapping.layout.shards({key: (shape, None) for key, (shape, _) in kept.items()})
    mesh = mapping.mesh
    check_whole_blocks(shards.listed(), {key: block for key, (_, block) in kept.items()},
                       f"the mesh (--tp {mesh.tp}, --ep {mesh.ep}, --pp {mesh.pp})")


def _check_fp8_scales(conversion: Conversion, mapping: ModelMapping) -> None:
    """After planning: each scale shard holds exactly the scales of its weight's shard."""
    blocks = mapping.target_blocks()
    if not blocks:
        return
    keys = [d.key for d in conversion.plan.destinations]
    check_scales_follow(conversion.plan.destinations,
                        {key: blocks[template]
                         for key, template in templates_of(keys, list(blocks)).items()})


def _some(keys: list[str], count: int = 5) -> str:
    shown = ", ".join(keys[:count])
    return shown + (f" and {len(keys) - count} more" if len(keys) > count else "")


def _check_target(info: Mapping[str, list[ShardDesc]], mapping: ModelMapping, record: dict,
                  cfg: Config) -> None:
    """A converted folder holds the target tensors of its record, laid out as its record's
    mesh says (a fused layout is read with the degree it was written at)."""
    absent = set(record.get("absent_groups", []))
    tensors = {k: spec for k, spec in mapping.source_tensors.items() if spec.group not in absent}
    dtypes = record["source_dtypes"]
    template = templates_of(list(tensors), list(dtypes))
    source = {key: [ShardDesc.full(key, spec.shape, dtypes.get(template.get(key, key),
                                                               "float32"))]
              for key, spec in tensors.items()}
    outputs = derived_outputs(MappingText(record["mapping"]), source)
    missing = sorted(set(outputs) - set(info))
    extra = sorted(set(info) - set(outputs))
    if missing or extra:
        what = (f"lacks {_some(missing)}" if missing else "") + \
            ("; " if missing and extra else "") + (f"holds unknown {_some(extra)}" if extra
                                                   else "")
        raise ModelError(f"the folder does not hold the {record['target']} tensors its "
                         f"record and {cfg.path} give: it {what}")
    for key, shards in mapping.layout.shards(outputs).by_key.items():
        want = {(s.global_offset, s.local_shape) for s in shards}
        have = {(s.global_offset, s.local_shape) for s in info[key]}
        if want != have or info[key][0].global_shape != shards[0].global_shape:
            raise ModelError(f"'{key}' is not laid out as the record's mesh "
                             f"{record['mesh']} says (its shards: "
                             f"{sorted(o for o, _ in have)})",
                             hint="A fused layout is read with the degrees it was written "
                                  "at; the record must be the one written with the files.")


def _check_outputs(conversion: Conversion, expected: Mapping[str, Expected],
                   absent: set[str]) -> None:
    got = {d.key: d.global_shape for d in conversion.plan.destinations}
    want = {k: s.shape for k, s in expected.items() if s.group not in absent}
    if got != want:
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        wrong = sorted(k for k in set(got) & set(want) if got[k] != want[k])
        raise ModelError("the way back does not give the Hugging Face tensors of the family: "
                         + "; ".join(part for part in (
                             f"missing {_some(missing)}" if missing else "",
                             f"unknown {_some(extra)}" if extra else "",
                             f"wrong shape {_some(wrong)}" if wrong else "") if part))


def _stored_dtypes(mapping: ModelMapping, info: Mapping[str, list[ShardDesc]]
                   ) -> dict[str, str]:
    writes = sorted({write for step in mapping.steps for write in step.writes})
    return template_dtypes(writes, {key: shards[0].dtype or "float32"
                                    for key, shards in info.items()})


def _mesh(record: dict) -> Mesh:
    mesh = record["mesh"]
    return Mesh(tp=mesh.get("tp", 1), ep=mesh.get("ep", 1), pp=mesh.get("pp", 1))


def _record(mapping: ModelMapping, text: str, origin: str, source_dtypes: Mapping[str, str],
            own: bool = False) -> dict[str, Any]:
    """What the output holds; ``own``: written in the target's own format (its stacking)."""
    record: dict[str, Any] = {"aoa_version": aoa_version(), "family": mapping.name,
                              "model_type": mapping.model_type, "target": mapping.target,
                              "mesh": mapping.mesh.to_json(), "dtype": mapping.dtype,
                              "mapping": text, "mapping_origin": origin,
                              "layout": layout_text(mapping.layout),
                              "source_dtypes": dict(sorted(source_dtypes.items()))}
    if mapping.fp8 and not mapping.dequantizes:
        record["fp8"] = mapping.fp8.to_json()
    if mapping.options:
        record["options"] = dict(mapping.options)
    if own and mapping.stacking:
        record["stacking"] = [rule.to_json() for rule in mapping.stacking]
    return record


def _dequantized_record(cfg: Config, family, mapping: ModelMapping, text: str,
                        source_dtypes: Mapping[str, str], own: bool = False
                        ) -> dict[str, Any]:
    """The record of a folder whose fp8 weights were dequantized: it holds a plain model,
    so the record names the mapping from the dequantized Hugging Face model (the one `--to
    hf` gives back), and says what was done."""
    assert mapping.fp8 is not None and mapping.dtype is not None
    fp8 = mapping.fp8
    plain_dtypes = {template: mapping.dtype if template in fp8.templates else dtype
                    for template, dtype in source_dtypes.items()
                    if not template.endswith(SUFFIX)}
    plain = Config(without_quantization(cfg.data), cfg.path, cfg.present)
    described = build(family, plain, mapping.target, mapping.mesh, dtype=mapping.dtype,
                      source_dtypes=plain_dtypes, options=mapping.options)
    record = _record(described, described.forward, "aoa.models", plain_dtypes, own)
    record["dequantized"] = {"from": sorted({source_dtypes[t] for t in fp8.templates
                                             if t in source_dtypes}),
                             "block": list(fp8.block), "scales": f"*{SUFFIX}",
                             "mapping": text}
    return record


def _read_text(path: str | Path) -> str:
    return read_text(path, "mapping")
