"""What every model family shares: config.json read with errors that name the field, the
tensors a family's checkpoint holds, and the steps of a mapping.

A step knows its forward statements (Hugging Face -> target), the statements that undo them
(target -> Hugging Face, a true inverse: each one is the exact reverse of a forward one), the
keys it reads and writes, and how a target written at other degrees is laid out again. Family
modules only list steps; `aoa.models.mapping` turns them into AOA text, casts and a layout.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from aoa.errors import AoaError
from aoa.limits import MAX_CONFIG_COUNT, MAX_MODEL_TENSORS, MAX_MODEL_UNITS
from aoa.mesh_layout import Placement
from aoa.storage.stacked import Stacking

LAYER = "$LAYER_ID"
EXPERT = "$EXPERT_ID"


class ModelError(AoaError):
    """A config.json or a checkpoint that does not fit its model family."""


# --- config.json ---------------------------------------------------------------------------

_MISSING = object()

#: The counts a family makes tensors and steps for one by one (`MAX_MODEL_UNITS`).
_ONE_BY_ONE = frozenset({"num_hidden_layers", "num_nextn_predict_layers",
                         "first_k_dense_replace", "n_routed_experts", "num_local_experts",
                         "num_experts", "moe_num_experts"})


class Config:
    """A Hugging Face config.json; a field the family needs and the file lacks is an error
    that names it."""

    def __init__(self, data: Mapping[str, Any], path: str = "config.json",
                 present: frozenset[str] | None = None) -> None:
        self.data = dict(data)
        self.path = path
        self.model_type = str(self.data.get("model_type", ""))
        self.present = present  # the checkpoint's keys, when one is at hand

    def has(self, key: str) -> bool:
        """Whether the checkpoint holds ``key`` (True when no checkpoint is at hand)."""
        return self.present is None or key in self.present

    def with_checkpoint(self, keys: frozenset[str], absent: Sequence[str] = ()) -> Config:
        """This config for a checkpoint of these keys; ``absent``: count fields (of optional
        layer groups the checkpoint leaves out) to read as 0."""
        data = dict(self.data)
        data.update({name: 0 for name in absent})
        return Config(data, self.path, keys)

    def _value(self, name: str, default: Any) -> Any:
        value = self.data.get(name, _MISSING)
        if value is _MISSING or (value is None and default is not _MISSING):
            if default is _MISSING:
                raise ModelError(f"{self.path}: the {self.model_type} family needs "
                                 f"'{name}', which the file does not have",
                                 hint=f"Add \"{name}\": ... to {self.path} (the model's "
                                      "original config.json has it).")
            return default
        return value

    def count(self, name: str, default: Any = _MISSING) -> int:
        value = self._value(name, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ModelError(f"{self.path}: '{name}' is {value!r}; a count from 0 is needed")
        most = MAX_MODEL_UNITS if name in _ONE_BY_ONE else MAX_CONFIG_COUNT
        if value > most:
            raise ModelError(f"{self.path}: '{name}' is {value}, more than aoa takes ({most:,})",
                             hint="The model's original config.json has the right value.")
        return value

    def optional_count(self, name: str) -> int | None:
        """A count that may be missing or null (DeepSeek's q_lora_rank)."""
        return None if self.data.get(name) is None else self.count(name)

    def either(self, *names: str) -> int:
        """A positive count spelled several ways (Qwen3-MoE's num_experts is saved by
        transformers 5 as num_local_experts): the first name the file has."""
        for name in names:
            if self.data.get(name) is not None:
                return self.positive(name)
        return self.positive(names[0])

    def positive(self, name: str, default: Any = _MISSING) -> int:
        value = self.count(name, default)
        if value == 0:
            raise ModelError(f"{self.path}: '{name}' is 0; it must be at least 1")
        return value

    def flag(self, name: str, default: bool = False) -> bool:
        value = self._value(name, default)
        if not isinstance(value, bool):
            raise ModelError(f"{self.path}: '{name}' is {value!r}; true or false is needed")
        return value

    def counts(self, name: str, default: Any = _MISSING) -> list[int]:
        value = self._value(name, default)
        if not isinstance(value, list) or not all(isinstance(v, int) for v in value):
            raise ModelError(f"{self.path}: '{name}' is {value!r}; a list of numbers is needed")
        return value

    def head_dim(self) -> int:
        """``head_dim`` when the config says it, else hidden_size / num_attention_heads."""
        if self.data.get("head_dim") is not None:
            return self.positive("head_dim")
        hidden, heads = self.positive("hidden_size"), self.positive("num_attention_heads")
        if hidden % heads:
            raise ModelError(f"{self.path}: hidden_size {hidden} is not a multiple of "
                             f"num_attention_heads {heads}, and there is no head_dim")
        return hidden // heads

    def kv_heads(self) -> int:
        heads = self.positive("num_attention_heads")
        kv = self.positive("num_key_value_heads", heads)
        if heads % kv:
            raise ModelError(f"{self.path}: num_attention_heads {heads} is not a multiple of "
                             f"num_key_value_heads {kv}",
                             hint="Each key/value head serves a whole group of query heads.")
        return kv


# --- the tensors of a checkpoint -----------------------------------------------------------


@dataclass(frozen=True)
class Dim:
    """One axis of an expected tensor: its size and, for messages, where it comes from."""

    size: int
    why: str


def dim(size: int, why: str) -> Dim:
    return Dim(size, why)


@dataclass(frozen=True)
class Expected:
    """A tensor the checkpoint must hold. ``group``: tensors that come all together or not at
    all (a multi-token-prediction layer that `transformers` does not save)."""

    dims: tuple[Dim, ...]
    group: str | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(d.size for d in self.dims)

    def describe(self) -> str:
        return "[" + ", ".join(f"{d.size} ({d.why})" for d in self.dims) + "]"


class Tensors:
    """Builder for a config's expected tensors, key by key, in checkpoint order."""

    def __init__(self, cfg: Config) -> None:
        self.expected: dict[str, Expected] = {}
        self.group: str | None = None
        self._path = cfg.path

    def add(self, key: str, *dims: Dim) -> None:
        if len(self.expected) >= MAX_MODEL_TENSORS:
            raise ModelError(f"{self._path}: its counts make more than {MAX_MODEL_TENSORS:,} "
                             "tensors, more than aoa maps for one model",
                             hint="Check num_hidden_layers and the expert counts against the "
                                  "model's original config.json.")
        self.expected[key] = Expected(tuple(dims), self.group)


# --- mesh ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mesh:
    """Degrees of tensor, expert and pipeline parallelism."""

    tp: int = 1
    ep: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "ep", "pp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ModelError(f"--{name} {value!r}: a degree is a whole number from 1")

    def dimensions(self) -> dict[str, int]:
        """Mesh dimensions, outermost first (Paddle's topology keeps model parallel inside)."""
        return {"pp": self.pp, "ep": self.ep, "tp": self.tp}

    def to_json(self) -> dict[str, int]:
        return {"tp": self.tp, "ep": self.ep, "pp": self.pp}


# --- steps of a mapping --------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """One piece of a mapping between a source (Hugging Face) and a target layout."""

    forward: tuple[str, ...]
    inverse: tuple[str, ...]
    reads: tuple[str, ...]  # source key templates
    writes: tuple[str, ...]  # target key templates
    float32: bool = False  # the target keeps these in float32
    reshard: tuple[str, ...] = ()  # re-lays the target written at other degrees

    @property
    def simple(self) -> bool:
        """One plain statement: a cast can ride on it as `, dtype=...`."""
        return len(self.forward) == 1 and len(self.reads) == 1 and len(self.writes) == 1


def rename(source: str, target: str, *, float32: bool = False) -> Step:
    return Step((f"{source} -> {target}",), (f"{target} -> {source}",), (source,), (target,),
                float32)


def linear(source: str, target: str, *, float32: bool = False) -> Step:
    """A linear weight: Hugging Face keeps [out, in], Paddle [in, out]."""
    return Step((f"{source}^T -> {target}",), (f"{target}^T -> {source}",), (source,),
                (target,), float32)


def fused_qkv(q: str, k: str, v: str, target: str, heads: int, kv_heads: int, *,
              bias: bool = False) -> Step:
    """q, k, v into one tensor grouped by key/value head: [q heads of group g, k_g, v_g]
    for each g, which any tensor-parallel split cuts into whole groups."""
    counts = f"num_heads={heads}, num_key_value_groups={kv_heads}"
    if bias:
        return Step((f"{q}, {k}, {v} -> {target}, fused_qkv, {counts}, axis=0",),
                    (f"{target} -> {q}, {k}, {v}, fused_qkv, {counts}, axis=0",),
                    (q, k, v), (target,))
    return Step((f"{q}^T, {k}^T, {v}^T -> {target}, fused_qkv, {counts}",),
                (f"{target} -> {q}, {k}, {v}, fused_qkv, {counts}",
                 f"{q}^T -> {q}", f"{k}^T -> {k}", f"{v}^T -> {v}"),
                (q, k, v), (target,))


def fused_ffn(gate: str, up: str, target: str) -> Step:
    """gate and up into [gate_r | up_r] for each tensor-parallel rank r: the layout depends
    on the degree, so a target written at other degrees is laid out again."""
    return Step((f"{gate}^T, {up}^T -> {target}, fused_ffn",),
                (f"{target} -> {gate}, {up}, fused_ffn", f"{gate}^T -> {gate}",
                 f"{up}^T -> {up}"),
                (gate, up), (target,), reshard=(f"{target} -> {target}, fused_ffn",))


def fused_ffn_of_fused(source: str, target: str) -> Step:
    """A Hugging Face [gate | up] (Phi-3's gate_up_proj) into [gate_r | up_r] per rank."""
    return Step((f"{source}^T -> {target}, fused_ffn",),
                (f"{target} -> {source}, fused_ffn", f"{source}^T -> {source}"),
                (source,), (target,), reshard=(f"{target} -> {target}, fused_ffn",))


def fused_qkv_per_rank(source: str, target: str, heads: int, kv_heads: int) -> Step:
    """A Hugging Face [Q | K | V] (Phi-3's qkv_proj) into [Q_r | K_r | V_r] per rank."""
    counts = f"num_heads={heads}, num_key_value_groups={kv_heads}, axis=1"
    return Step((f"{source}^T -> {target}, fused_qkv_old, {counts}",),
                (f"{target} -> {source}, fused_qkv_old, {counts}", f"{source}^T -> {source}"),
                (source,), (target,),
                reshard=(f"{target} -> {target}, fused_qkv_old, {counts}",))


def concat_linears(sources: Sequence[str], target: str) -> Step:
    """Linear weights side by side, [in, out_1 | out_2 | ...] (an expert's gate and up)."""
    listed = ", ".join(f"{s}^T" for s in sources)
    return Step((f"{listed} -> {target}, axis=1",),
                (f"{target} -> {', '.join(sources)}, axis=1",
                 *(f"{s}^T -> {s}" for s in sources)),
                tuple(sources), (target,))


# --- layout rules --------------------------------------------------------------------------


@dataclass(frozen=True)
class Split:
    """How the target keys matching ``match`` are laid out on the mesh: ``tp`` the axis tensor
    parallelism splits (None: replicated), ``ep``/``pp`` a placement of whole tensors."""

    match: str
    tp: int | None = None
    ep: Placement | int | None = None
    pp: Placement | None = None
    tp_blocks: int = 1  # the tp axis is this many equal blocks, each split (gate, up)


def by_layer(layers: int) -> Placement:
    return Placement(number_after="layers.", of=layers)


def by_expert(experts: int) -> Placement:
    return Placement(number_after="experts.", of=experts)


FIRST = Placement(where="first")
LAST = Placement(where="last")


# --- what a family gives for one target ----------------------------------------------------


@dataclass
class TargetMapping:
    """A family's mapping onto one target, before dtypes and degrees are applied.
    ``stacking`` and ``objects``: how the target's own checkpoint format stores the keys and
    which sharded objects it holds beside them (Megatron's `torch_dist`); ``options``: the
    target's options as given (recorded with the conversion)."""

    steps: list[Step] = field(default_factory=list)
    splits: list[Split] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    stacking: list[Stacking] = field(default_factory=list)
    objects: list[str] = field(default_factory=list)
    options: dict[str, str] = field(default_factory=dict)

    def add(self, *steps: Step) -> None:
        self.steps.extend(steps)


@dataclass(frozen=True)
class Family:
    """A model family: the `model_type`s it covers, the tensors its checkpoints hold and, per
    target, the mapping."""

    name: str
    model_types: tuple[str, ...]
    tensors: Callable[[Config], dict[str, Expected]]
    #: target -> its mapping for a config and mesh (and the target's options, by keyword)
    targets: Mapping[str, Callable[..., TargetMapping]]
    summary: str = ""
