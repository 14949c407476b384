"""A family's steps made into what a conversion runs: the forward AOA text (Hugging Face ->
target), its true inverse, the text that lays a target out again at other degrees, the casts
each needs, and the destination layout on the mesh.

Casts: the target keeps what PaddleFormers keeps in float32 (router gates) in float32 and,
with a dtype asked for, everything else in that dtype; the way back restores each tensor's
original dtype (exact where the forward cast widened; a narrowed tensor comes back widened).
"""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from aoa.mesh_layout import MeshLayout, Rule
from aoa.models.base import (
    EXPERT,
    LAYER,
    Config,
    Expected,
    Family,
    Mesh,
    ModelError,
    Step,
    TargetMapping,
)
from aoa.models.fp8 import SUFFIX, Fp8Weights, scales_of, target_blocks, with_scales
from aoa.storage.stacked import Stacking

DTYPES = ("float32", "bfloat16", "float16")
#: The options each target takes (by keyword, from the command line's flags).
TARGET_OPTIONS = {"paddleformers": (), "megatron": ("transformer_impl", "experts")}


@dataclass(frozen=True)
class ModelMapping:
    """Everything a conversion between Hugging Face and a target needs, as text and layout."""

    family: Family
    config: Config
    target: str
    mesh: Mesh
    dtype: str | None
    forward: str
    layout: MeshLayout
    steps: tuple[Step, ...]
    #: how the target's own format stores the keys, and the sharded objects it holds
    #: (`TargetMapping`); the target's options
    stacking: tuple[Stacking, ...] = ()
    objects: tuple[str, ...] = ()
    options: Mapping[str, str] = field(default_factory=dict)
    #: the fp8 weights of the source, with their scales in the mapping
    fp8: Fp8Weights | None = None

    @property
    def name(self) -> str:
        return self.family.name

    @property
    def model_type(self) -> str:
        return self.config.model_type

    @functools.cached_property
    def source_tensors(self) -> dict[str, Expected]:
        """The tensors the source checkpoint holds, fp8 scales included (made when asked: a
        big MoE has tens of thousands)."""
        tensors = self.family.tensors(self.config)
        if self.fp8 is not None:
            templates = templates_of(list(tensors), self.fp8.templates)
            tensors.update({key + SUFFIX: scales_of(tensors[key], self.fp8.block)
                            for key in templates})
        return tensors

    @property
    def dequantizes(self) -> bool:
        """Whether the conversion dequantizes the fp8 weights (a dtype is asked for)."""
        return self.fp8 is not None and self.dtype is not None

    def target_blocks(self) -> dict[str, tuple[int, ...]]:
        """Target weight template -> its block, for the weights kept in fp8."""
        if self.fp8 is None or self.dtype is not None:
            return {}
        return target_blocks(self.steps, self.fp8.block)

    def inverse(self, source_dtypes: Mapping[str, str] | None = None,
                stored_dtypes: Mapping[str, str] | None = None) -> str:
        """Target -> Hugging Face. ``source_dtypes``: the original dtype of each source key
        template (as recorded by the forward conversion); ``stored_dtypes``: the dtype each
        target key template has now. Without them no cast is written."""
        return _inverse_text(self, source_dtypes or {}, stored_dtypes or {})

    def reshard(self, stored_dtypes: Mapping[str, str] | None = None) -> str:
        """Target at other degrees -> target at these degrees (and dtype)."""
        return _reshard_text(self, stored_dtypes or {})


def build(family: Family, cfg: Config, target: str, mesh: Mesh, *, dtype: str | None = None,
          source_dtypes: Mapping[str, str] | None = None,
          fp8: Fp8Weights | None = None,
          options: Mapping[str, str | None] | None = None) -> ModelMapping:
    """The mapping of ``family`` onto ``target`` for this config, mesh and dtype.
    ``source_dtypes``: the dtype of each source key template, when a checkpoint is at hand
    (casts that would change nothing are then left out); ``fp8``: the source's weights
    stored in fp8, whose scales the mapping then consumes (with a dtype: dequantized) or
    carries beside them; ``options``: the target's own (Megatron's transformer_impl and
    experts)."""
    if dtype is not None and dtype not in DTYPES:
        raise ModelError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}")
    if target not in family.targets:
        others = sorted(_model_types_by_target().get(target, []))
        raise ModelError(f"the {family.name} family has no '{target}' target "
                         f"(it has {', '.join(family.targets)})"
                         + (f"; the model types with one: {', '.join(others)}" if others
                            else ""))
    given = {name: value for name, value in (options or {}).items() if value is not None}
    unknown = sorted(set(given) - set(TARGET_OPTIONS.get(target, ())))
    if unknown:
        raise ModelError(f"--to {target} takes no option "
                         f"{', '.join('--' + n.replace('_', '-') for n in unknown)}")
    mapping = family.targets[target](cfg, mesh, **given)
    if fp8 is not None:
        mapping = with_scales(mapping, fp8, dequantize=dtype is not None)
    _check_casts(mapping, target, dtype, source_dtypes or {})
    forward = _forward_text(family, cfg, target, mapping, dtype, source_dtypes or {})
    return ModelMapping(family, cfg, target, mesh, dtype, forward, layout(mapping, mesh),
                        tuple(mapping.steps), tuple(mapping.stacking), tuple(mapping.objects),
                        dict(mapping.options), fp8)


def _model_types_by_target() -> dict[str, list[str]]:
    from aoa.models import FAMILIES  # the registry imports this module

    found: dict[str, list[str]] = {}
    for family in FAMILIES:
        for target in family.targets:
            found.setdefault(target, []).extend(family.model_types)
    return found


def layout(mapping: TargetMapping, mesh: Mesh) -> MeshLayout:
    """The family's splits as mesh rules; dimensions of size 1, and rules that decide no key
    the mapping writes (none matches, or an earlier rule takes each: first match wins), are
    left out, so that the layout passes the strict check of a user's layout. A split that
    asks nothing of this mesh stays where it keeps its keys whole from a later rule (an
    expert's up_gate_proj from the rule for every layer's: experts at --ep 1)."""
    dimensions = {name: size for name, size in mesh.dimensions().items()
                  if size > 1 or name == "tp"}
    written = [write.replace(LAYER, "0").replace(EXPERT, "0")
               for step in mapping.steps for write in step.writes]
    rules = []
    for split in mapping.splits:
        if not any(fnmatch.fnmatchcase(key, split.match) for key in written):
            continue
        axes: dict[str, int] = {}
        places = {}
        if split.tp is not None and mesh.tp > 1:
            axes["tp"] = split.tp
        if split.ep is not None and mesh.ep > 1:
            if isinstance(split.ep, int):
                axes["ep"] = split.ep
            else:
                places["ep"] = split.ep
        if split.pp is not None and mesh.pp > 1:
            places["pp"] = split.pp
        blocks = ({axes["tp"]: split.tp_blocks} if "tp" in axes and split.tp_blocks > 1
                  else {})
        rules.append(Rule(split.match, axes, places, blocks))
    rules = _without_idle_rules(rules, written)
    deciding = {next((i for i, rule in enumerate(rules)
                      if fnmatch.fnmatchcase(key, rule.match)), None) for key in written}
    return MeshLayout(dimensions, tuple(rule for i, rule in enumerate(rules) if i in deciding),
                      "<model layout>")


def _without_idle_rules(rules: list[Rule], keys: Sequence[str]) -> list[Rule]:
    """``rules`` less each one that splits and places nothing on this mesh, where dropping it
    leaves every key decided as before (no rule: whole on every rank)."""

    def decided(chosen: list[Rule]) -> list[tuple]:
        first = (next((r for r in chosen if fnmatch.fnmatchcase(key, r.match)), None)
                 for key in keys)
        return [(r.axes, r.places, r.blocks) if r else ({}, {}, {}) for r in first]

    want = decided(rules)
    kept = list(rules)
    for rule in reversed(rules):
        if not (rule.axes or rule.places):
            trial = [r for r in kept if r is not rule]
            if decided(trial) == want:
                kept = trial
    return kept


def template_dtypes(templates: Sequence[str], key_dtypes: Mapping[str, str]) -> dict[str, str]:
    """The dtype of each template's concrete keys; the keys of one template must agree.

    Each key is written once as each kind of template would write it (its layer and/or
    expert numbers replaced by the placeholders), so a template finds its keys by lookup:
    one pass over the keys per kind, not one per template."""
    found: dict[str, str] = {}
    if len(set(key_dtypes.values())) == 1:  # one dtype for every key: no need to look
        (dtype,) = set(key_dtypes.values())
        return dict.fromkeys(templates, dtype)
    by_form: dict[tuple[bool, bool], dict[str, set[str]]] = {}
    for template in templates:
        kind = (LAYER in template, EXPERT in template)
        if kind == (False, False):
            dtypes = {key_dtypes[template]} if template in key_dtypes else set()
        else:
            forms = by_form.get(kind)
            if forms is None:
                forms = by_form[kind] = {}
                for key, dtype in key_dtypes.items():
                    forms.setdefault(_template_form(key, *kind), set()).add(dtype)
            dtypes = set(forms.get(template, ()))
        if len(dtypes) > 1:
            raise ModelError(f"the keys of '{template}' do not share one dtype "
                             f"({', '.join(sorted(dtypes))})",
                             hint="Convert with --dtype to make them one.")
        if dtypes:
            found[template] = dtypes.pop()
    return found


def templates_of(keys: Sequence[str], templates: Sequence[str]) -> dict[str, str]:
    """The template each key belongs to (keys of none are left out)."""
    kinds = {(LAYER in t, EXPERT in t) for t in templates}
    wanted = set(templates)
    found = {}
    for key in keys:
        for kind in kinds:
            form = _template_form(key, *kind)
            if form in wanted:
                found[key] = form
                break
    return found


def _template_form(key: str, layer: bool, expert: bool) -> str:
    """``key`` with its layer number (after `layers.`) and/or expert number (after
    `experts.`) written as the placeholder."""
    parts = key.split(".")
    for i in range(1, len(parts)):
        if parts[i].isdigit():
            if layer and parts[i - 1] == "layers":
                parts[i] = LAYER
            elif expert and parts[i - 1] == "experts":
                parts[i] = EXPERT
    return ".".join(parts)


def _header(family: Family, cfg: Config, target: str, notes: Sequence[str]) -> list[str]:
    lines = [f"# {family.summary or family.name}: Hugging Face ({cfg.model_type}) -> {target}",
             "# made by aoa.models from config.json; edit and pass with --mapping"]
    lines += [f"# {note}" for note in notes]
    return lines


def _cast(statement: str, dtype: str) -> str:
    return f"{statement}, dtype='{dtype}'"


def _check_casts(mapping: TargetMapping, target: str, dtype: str | None,
                 source_dtypes: Mapping[str, str]) -> None:
    """A tensor stored as integers or booleans where the target casts it (a router kept in
    float32, everything with --dtype) is a mistake in the checkpoint: no family's weight
    has such a dtype, and the way back (--to hf) could not cast it back."""
    for step in mapping.steps:
        want = "float32" if step.float32 else dtype
        for read in step.reads if want is not None else ():
            have = source_dtypes.get(read)
            if have is not None and have != want and have.startswith(("int", "uint", "bool")):
                casts = ("keeps it in float32" if step.float32 else f"casts it to {dtype}")
                raise ModelError(f"'{read}' is stored as {have}; the {target} target {casts}, "
                                 "and no weight of this family is stored as integers",
                                 hint="The checkpoint holds a tensor of the wrong dtype; the "
                                      "model's original files have it in a float dtype.")


def _forward_text(family: Family, cfg: Config, target: str, mapping: TargetMapping,
                  dtype: str | None, source_dtypes: Mapping[str, str]) -> str:
    lines = _header(family, cfg, target, mapping.notes)
    casts: list[str] = []
    for step in mapping.steps:
        want = "float32" if step.float32 else dtype
        have = {source_dtypes.get(read) for read in step.reads}
        if want is None or have == {want}:
            lines += step.forward
        elif step.simple:
            lines.append(_cast(step.forward[0], want))
        else:
            lines += step.forward
            casts += [_cast(f"{write} -> {write}", want) for write in step.writes]
    if casts:
        lines.append(f"# cast to {dtype}")
        lines += casts
    return "\n".join(lines) + "\n"


def _inverse_text(mapping: ModelMapping, source_dtypes: Mapping[str, str],
                  stored_dtypes: Mapping[str, str]) -> str:
    lines = [f"# {mapping.target} -> Hugging Face ({mapping.model_type}): the inverse of the "
             "forward mapping, made by aoa.models"]
    casts: list[str] = []
    for step in mapping.steps:
        stored = {stored_dtypes.get(write) for write in step.writes}
        wants = [(read, source_dtypes.get(read)) for read in step.reads]
        differ = [(read, want) for read, want in wants
                  if want is not None and stored != {want} and None not in stored]
        if step.inverse and step.inverse[0].endswith("-> _"):
            differ = []  # a copy dropped on the way back
        if differ and step.simple:
            lines.append(_cast(step.inverse[0], differ[0][1]))  # type: ignore[arg-type]
            continue
        lines += step.inverse
        casts += [_cast(f"{read} -> {read}", want) for read, want in differ]  # type: ignore
    if casts:
        lines.append("# back to the dtypes of the original checkpoint")
        lines += casts
    return "\n".join(lines) + "\n"


def _reshard_text(mapping: ModelMapping, stored_dtypes: Mapping[str, str]) -> str:
    lines = [f"# {mapping.target} at other degrees -> {mapping.target} at "
             f"tp {mapping.mesh.tp}, ep {mapping.mesh.ep}, pp {mapping.mesh.pp}: fused layouts "
             "that depend on the degree are laid out again; every other key is resharded as "
             "it is"]
    casts: list[str] = []
    for step in mapping.steps:
        lines += step.reshard
        want = "float32" if step.float32 else mapping.dtype
        if want is None:
            continue
        for write in step.writes:
            if stored_dtypes.get(write) != want:
                casts.append(_cast(f"{write} -> {write}", want))
    if casts:
        lines.append(f"# cast to {mapping.dtype}")
        lines += casts
    return "\n".join(lines) + "\n"
