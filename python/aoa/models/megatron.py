"""Conventions of the `megatron` target: Megatron-Core's GPTModel, as its modules name their
parameters and as its distributed checkpoint (``torch_dist``) lays them out.

Read from Megatron-Core 0.16's own code (`gpt_layer_specs`, `TELayerNormColumnParallelLinear`,
`MLP.sharded_state_dict`, `TEGroupedMLP`, `SequentialMLP`, `TransformerBlock`), never copied:

* Names, per layer (``decoder.layers.N.``): ``self_attention.linear_qkv`` holds q, k and v
  as rows grouped by key/value head (for each group: its query heads, its key head, its
  value head; biases alike), ``self_attention.linear_proj`` the output projection,
  ``mlp.linear_fc1`` gate then up as rows, ``mlp.linear_fc2`` the down projection; every
  linear weight stays [out, in] as in Hugging Face. The embedding is
  ``embedding.word_embeddings``, the final norm ``decoder.final_layernorm``, the head
  ``output_layer`` (absent when the embeddings are tied: Megatron shares the embedding).
  Latent attention (MLASelfAttention, DeepSeek-V3) keeps its projections apart and as they
  are: ``linear_q_proj`` or ``linear_q_down_proj``/``linear_q_up_proj``,
  ``linear_kv_down_proj``, ``linear_kv_up_proj``, ``linear_proj``.
* Norms (``--transformer-impl``): with Transformer Engine (the default) the norm before
  attention is held by ``linear_qkv`` (``layer_norm_weight``), the norm before a dense MLP by
  ``linear_fc1``, and a layer with experts keeps ``pre_mlp_layernorm``; the local
  implementation keeps ``input_layernorm`` and ``pre_mlp_layernorm`` as modules. With
  latent attention ``input_layernorm`` is always a module, and Transformer Engine's up
  projections hold the low-rank norms (the local modules: ``q_layernorm``, ``kv_layernorm``).
* Experts: ``mlp.router``; grouped GEMM (TEGroupedMLP, the default) names expert E's
  weights ``mlp.experts.linear_fc1.weightE``, the sequential ones
  ``mlp.experts.local_experts.E.linear_fc1.weight``; a shared expert is
  ``mlp.shared_experts`` (its sigmoid gate ``gate_weight``).
* Parallelism: column-parallel weights (linear_qkv, linear_fc1, the embedding and the head)
  split their rows, linear_fc1 gate and up each (rank r holds gate part r and up part r);
  row-parallel ones (linear_proj, linear_fc2) split their columns; norms, biases of
  row-parallel layers and the router are whole on every rank. Experts are whole on the
  expert-parallel rank that owns them and split by tensor parallelism like a dense MLP
  (Megatron's expert tensor parallelism defaults to the tensor-parallel degree). Layers go to
  pipeline stages in equal parts, the embedding to the first, the final norm and the head to
  the last.
* The distributed checkpoint (`aoa.storage.stacked`): every layer's tensor of a name is one
  stored tensor with a leading layer axis (``decoder.layers.self_attention.linear_qkv
  .weight``: [layers, ...]), experts a further expert axis
  (``decoder.layers.mlp.experts.experts.linear_fc1.weight``: [layers, experts, ...], for
  grouped and sequential experts alike); where layers differ (dense layers among sparse
  ones, as Megatron's list-valued ``moe_layer_freq``) each layer keeps its own keys and only
  experts are stacked. The local implementation's norms are stored under the Transformer
  Engine names, so both load either checkpoint's dense layers. Beside the tensors the
  checkpoint holds the ``_extra_state`` sharded object of each module that has one (Transformer
  Engine's linears, norms and attention; the local linears), written as Megatron writes a
  module with nothing to keep: ``None``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from aoa.mesh_layout import Placement
from aoa.models.base import (
    EXPERT,
    LAYER,
    Config,
    Mesh,
    ModelError,
    Split,
    Step,
    TargetMapping,
    by_layer,
    rename,
)
from aoa.storage.stacked import Stacking

TRANSFORMER_ENGINE = "transformer_engine"
LOCAL = "local"
IMPLS = (TRANSFORMER_ENGINE, LOCAL)
GROUPED, SEQUENTIAL = "grouped", "sequential"
EXPERT_KINDS = (GROUPED, SEQUENTIAL)
LAYERS = "decoder.layers."
EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT = "output_layer.weight"
FINAL_NORM = "decoder.final_layernorm.weight"
FIRST = Placement(where="first")
LAST = Placement(where="last")


@dataclass(frozen=True)
class Options:
    """How the Megatron model is built: ``transformer_impl`` (Megatron's
    ``--transformer-impl``) and ``experts`` (grouped GEMM or sequential)."""

    transformer_impl: str = TRANSFORMER_ENGINE
    experts: str = GROUPED

    @classmethod
    def of(cls, transformer_impl: str | None = None, experts: str | None = None) -> Options:
        impl = transformer_impl or TRANSFORMER_ENGINE
        if impl not in IMPLS:
            raise ModelError(f"--transformer-impl {impl}: choose one of {', '.join(IMPLS)}")
        kind = experts or (GROUPED if impl == TRANSFORMER_ENGINE else SEQUENTIAL)
        if kind not in EXPERT_KINDS:
            raise ModelError(f"--experts {kind}: choose one of {', '.join(EXPERT_KINDS)}")
        if kind == GROUPED and impl == LOCAL:
            raise ModelError("--experts grouped needs --transformer-impl transformer_engine "
                             "(TEGroupedMLP)",
                             hint="The local implementation's GroupedMLP keeps all experts in "
                                  "two fused weights; use --experts sequential with it.")
        return cls(impl, kind)

    def to_json(self) -> dict[str, str]:
        return {"transformer_impl": self.transformer_impl, "experts": self.experts}


@dataclass(frozen=True)
class Decoder:
    """What a Hugging Face decoder family holds, in the words the megatron target needs.
    Names are relative to ``model.layers.N.``; ``sparse`` says which layers have experts."""

    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    mlp_bias: bool = False
    sparse: Sequence[bool] = ()
    experts: int = 0
    moe: str = "mlp."  # the block holding router and experts
    router: str = "gate.weight"
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    shared_expert: str | None = None  # the shared expert's block, under ``moe``
    shared_gate: str | None = None  # its gate's weight, under ``moe``
    expert_bias: str | None = None  # the router's score correction, under ``moe``
    latent_attention: bool = False  # DeepSeek's multi-head latent attention
    notes: list[str] = field(default_factory=list)


def rows(sources: Sequence[str], target: str) -> Step:
    """Tensors stacked as rows of one (gate then up in linear_fc1)."""
    listed = ", ".join(sources)
    return Step((f"{listed} -> {target}, axis=0",), (f"{target} -> {listed}, axis=0",),
                tuple(sources), (target,))


def grouped_qkv(q: str, k: str, v: str, target: str, heads: int, kv_heads: int) -> Step:
    """q, k, v as rows grouped by key/value head: for each group its query heads, its key
    head and its value head (weights and biases alike)."""
    counts = f"num_heads={heads}, num_key_value_groups={kv_heads}, axis=0"
    return Step((f"{q}, {k}, {v} -> {target}, fused_qkv, {counts}",),
                (f"{target} -> {q}, {k}, {v}, fused_qkv, {counts}",), (q, k, v), (target,))


def check_mesh(cfg: Config, mesh: Mesh, *, heads: int, kv_heads: int, layers: int,
               experts: int) -> None:
    """What Megatron-Core needs of the degrees: whole heads and key/value groups per
    tensor-parallel rank, a vocabulary that splits evenly, equal pipeline stages, whole
    experts per expert-parallel rank."""
    for count, name in ((heads, "num_attention_heads"), (kv_heads, "num_key_value_heads")):
        if count % mesh.tp:
            raise ModelError(f"--tp {mesh.tp} does not divide {name} {count} of {cfg.path}",
                             hint="Megatron gives every tensor-parallel rank whole heads and "
                                  "whole key/value groups.")
    vocab = cfg.positive("vocab_size")
    if vocab % mesh.tp:
        raise ModelError(f"--tp {mesh.tp} does not divide vocab_size {vocab} of {cfg.path}",
                         hint="Megatron splits the vocabulary evenly; training scripts pad it "
                              "(make_vocab_size_divisible_by), which aoa does not do.")
    if layers % mesh.pp:
        raise ModelError(f"--pp {mesh.pp} does not divide the {layers} layers of {cfg.path}",
                         hint="Megatron's pipeline stages hold equal numbers of layers.")
    if mesh.ep > 1 and not experts:
        raise ModelError(f"--ep {mesh.ep}: {cfg.model_type} has no experts to place")
    if experts and experts % mesh.ep:
        raise ModelError(f"--ep {mesh.ep} does not divide the {experts} experts of {cfg.path}")


def decoder(cfg: Config, mesh: Mesh, spec: Decoder, options: Options) -> TargetMapping:
    """The megatron mapping of a standard decoder: grouped-query or latent attention, dense
    and sparse layers."""
    heads = cfg.positive("num_attention_heads")
    kv_heads = heads if spec.latent_attention else cfg.kv_heads()
    layers = cfg.positive("num_hidden_layers")
    sparse = list(spec.sparse) or [False] * layers
    experts = spec.experts if any(sparse) else 0
    check_mesh(cfg, mesh, heads=heads, kv_heads=kv_heads, layers=layers, experts=experts)
    te = options.transformer_impl == TRANSFORMER_ENGINE
    m = TargetMapping(notes=list(spec.notes))
    hf, mg = f"model.layers.{LAYER}.", f"{LAYERS}{LAYER}."
    m.add(rename("model.embed_tokens.weight", EMBEDDING))
    if not cfg.flag("tie_word_embeddings"):
        m.add(rename("lm_head.weight", OUTPUT))
    m.add(rename("model.norm.weight", FINAL_NORM))
    if spec.latent_attention:
        _latent_attention(m, cfg, hf, mg, te)
    else:
        _attention(m, spec, hf, mg, te, heads, kv_heads)
    _pre_mlp_norms(m, sparse, te)
    if not all(sparse):
        _mlp(m, hf + "mlp.", mg + "mlp.", ("gate_proj", "up_proj", "down_proj"),
             spec.mlp_bias)
    if any(sparse):
        moe = hf + spec.moe
        m.add(rename(moe + spec.router, mg + "mlp.router.weight"))
        gate, up, down = spec.expert_names
        expert = f"{moe}experts.{EXPERT}."
        for name, hf_names in (("linear_fc1", (gate, up)), ("linear_fc2", (down,))):
            target = _expert_key(mg, name, options)
            sources = [f"{expert}{n}.weight" for n in hf_names]
            m.add(rows(sources, target) if len(sources) > 1 else rename(sources[0], target))
        if spec.shared_expert:
            _mlp(m, moe + spec.shared_expert, mg + "mlp.shared_experts.",
                 ("gate_proj", "up_proj", "down_proj"), False)
        if spec.shared_gate:
            m.add(rename(moe + spec.shared_gate, mg + "mlp.shared_experts.gate_weight"))
        if spec.expert_bias:  # Megatron keeps it in float32
            m.add(rename(moe + spec.expert_bias, mg + "mlp.router.expert_bias", float32=True))
    homogeneous = len(set(sparse)) == 1
    q_lora = spec.latent_attention and bool(cfg.optional_count("q_lora_rank"))
    m.splits = splits(mesh, layers, experts, options, latent=spec.latent_attention)
    m.stacking = stacking(layers, experts, options, homogeneous,
                          local_norms=not spec.latent_attention)
    m.objects = extra_states(layers, experts, sparse, options, homogeneous,
                             attention=_attention_modules(spec, te, q_lora),
                             shared=bool(spec.shared_expert))
    m.options = options.to_json()
    return m


def _attention(m: TargetMapping, spec: Decoder, hf: str, mg: str, te: bool, heads: int,
               kv_heads: int) -> None:
    """Grouped-query attention: q, k, v as linear_qkv's rows grouped by key/value head."""
    a, s = hf + "self_attn.", mg + "self_attention."
    m.add(rename(hf + "input_layernorm.weight",
                 s + "linear_qkv.layer_norm_weight" if te else mg + "input_layernorm.weight"))
    m.add(grouped_qkv(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight",
                      s + "linear_qkv.weight", heads, kv_heads))
    if spec.qkv_bias:
        m.add(grouped_qkv(a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias",
                          s + "linear_qkv.bias", heads, kv_heads))
    m.add(rename(a + "o_proj.weight", s + "linear_proj.weight"))
    if spec.o_bias:
        m.add(rename(a + "o_proj.bias", s + "linear_proj.bias"))
    if spec.qk_norm:
        m.add(rename(a + "q_norm.weight", s + "q_layernorm.weight"),
              rename(a + "k_norm.weight", s + "k_layernorm.weight"))


def _latent_attention(m: TargetMapping, cfg: Config, hf: str, mg: str, te: bool) -> None:
    """Multi-head latent attention (MLASelfAttention): every projection as it is (heads in
    Hugging Face's order, no-position part before rotary part); the low-rank norms held by
    the up projections with Transformer Engine, kept as q_layernorm and kv_layernorm by the
    local modules; the norm before attention a module of its own."""
    if cfg.flag("attention_bias"):
        raise ModelError(f"{cfg.path}: attention_bias is true, but Megatron's latent attention "
                         "has no biases on its projections",
                         hint="Convert this model with --to paddleformers, or write the "
                              "mapping by hand.")
    a, s = hf + "self_attn.", mg + "self_attention."
    m.add(rename(hf + "input_layernorm.weight", mg + "input_layernorm.weight"))
    if cfg.optional_count("q_lora_rank"):
        m.add(rename(a + "q_a_proj.weight", s + "linear_q_down_proj.weight"),
              rename(a + "q_a_layernorm.weight", s + ("linear_q_up_proj.layer_norm_weight"
                                                       if te else "q_layernorm.weight")),
              rename(a + "q_b_proj.weight", s + "linear_q_up_proj.weight"))
    else:
        m.add(rename(a + "q_proj.weight", s + "linear_q_proj.weight"))
    m.add(rename(a + "kv_a_proj_with_mqa.weight", s + "linear_kv_down_proj.weight"),
          rename(a + "kv_a_layernorm.weight", s + ("linear_kv_up_proj.layer_norm_weight"
                                                    if te else "kv_layernorm.weight")),
          rename(a + "kv_b_proj.weight", s + "linear_kv_up_proj.weight"),
          rename(a + "o_proj.weight", s + "linear_proj.weight"))


def _attention_modules(spec: Decoder, te: bool, q_lora: bool) -> list[str]:
    """The attention modules of a layer that keep an ``_extra_state``."""
    if not spec.latent_attention:
        modules = ["self_attention.linear_qkv", "self_attention.linear_proj"]
        if te:
            modules.append("self_attention.core_attention")
            if spec.qk_norm:
                modules += ["self_attention.q_layernorm", "self_attention.k_layernorm"]
        return modules
    queries = ["linear_q_down_proj", "linear_q_up_proj"] if q_lora else ["linear_q_proj"]
    modules = [f"self_attention.{name}" for name in (
        *queries, "linear_kv_down_proj", "linear_kv_up_proj", "linear_proj")]
    if te:
        modules += ["self_attention.core_attention", "input_layernorm"]
    return modules


def _pre_mlp_norms(m: TargetMapping, sparse: list[bool], te: bool) -> None:
    """The norm before the MLP: Transformer Engine keeps it in a dense layer's linear_fc1 and
    as pre_mlp_layernorm before experts; where layers differ, one statement per layer."""
    def target(layer: str, has_experts: bool) -> str:
        if te and not has_experts:
            return f"{LAYERS}{layer}.mlp.linear_fc1.layer_norm_weight"
        return f"{LAYERS}{layer}.pre_mlp_layernorm.weight"

    source = "model.layers.{}.post_attention_layernorm.weight"
    if len(set(sparse)) == 1 or not te:
        m.add(rename(source.format(LAYER), target(LAYER, sparse[0])))
        return
    for layer, has_experts in enumerate(sparse):
        m.add(rename(source.format(layer), target(str(layer), has_experts)))


def _mlp(m: TargetMapping, hf: str, mg: str, names: tuple[str, str, str], bias: bool) -> None:
    gate, up, down = names
    m.add(rows((f"{hf}{gate}.weight", f"{hf}{up}.weight"), mg + "linear_fc1.weight"),
          rename(f"{hf}{down}.weight", mg + "linear_fc2.weight"))
    if bias:
        m.add(rows((f"{hf}{gate}.bias", f"{hf}{up}.bias"), mg + "linear_fc1.bias"),
              rename(f"{hf}{down}.bias", mg + "linear_fc2.bias"))


def _expert_key(layer: str, name: str, options: Options, what: str = "weight") -> str:
    if options.experts == GROUPED:
        return f"{layer}mlp.experts.{name}.{what}{EXPERT}"
    return f"{layer}mlp.experts.local_experts.{EXPERT}.{name}.{what}"


def splits(mesh: Mesh, layers: int, experts: int, options: Options, *, latent: bool = False
           ) -> list[Split]:
    """The layout rules of a Megatron GPTModel, first match first."""
    by = by_layer(layers)
    rules: list[Split] = []
    if latent:
        # the up projections split their heads; the down projections are whole with
        # Transformer Engine, split like any column-parallel linear by the local modules
        down = None if options.transformer_impl == TRANSFORMER_ENGINE else 0
        rules += [Split(f"{LAYERS}*.linear_q_proj.weight", tp=0, pp=by),
                  Split(f"{LAYERS}*.linear_q_up_proj.weight", tp=0, pp=by),
                  Split(f"{LAYERS}*.linear_kv_up_proj.weight", tp=0, pp=by),
                  Split(f"{LAYERS}*.linear_q_down_proj.weight", tp=down, pp=by),
                  Split(f"{LAYERS}*.linear_kv_down_proj.weight", tp=down, pp=by)]
    if experts:
        after = (".weight" if options.experts == GROUPED else "local_experts.")
        place = Placement(number_after=after, of=experts)
        rules += [Split(f"{LAYERS}*.mlp.experts.*linear_fc1*", tp=0, ep=place, pp=by,
                        tp_blocks=2),
                  Split(f"{LAYERS}*.mlp.experts.*linear_fc2*", tp=1, ep=place, pp=by)]
    rules += [Split(f"{LAYERS}*.linear_qkv.weight", tp=0, pp=by),
              Split(f"{LAYERS}*.linear_qkv.bias", tp=0, pp=by),
              Split(f"{LAYERS}*.linear_proj.weight", tp=1, pp=by),
              Split(f"{LAYERS}*.linear_fc1.weight", tp=0, pp=by, tp_blocks=2),
              Split(f"{LAYERS}*.linear_fc1.bias", tp=0, pp=by, tp_blocks=2),
              Split(f"{LAYERS}*.linear_fc2.weight", tp=1, pp=by),
              Split(f"{LAYERS}*", pp=by),
              Split(EMBEDDING, tp=0, pp=FIRST),
              Split(OUTPUT, tp=0, pp=LAST),
              Split("*", pp=LAST)]  # the final norm
    return rules


def stacking(layers: int, experts: int, options: Options, homogeneous: bool, *,
             local_norms: bool = True) -> list[Stacking]:
    """How the distributed checkpoint stores the per-layer (and per-expert) keys;
    ``local_norms``: the local modules store their norms under Transformer Engine's names
    (grouped-query attention's layer spec maps them; latent attention's does not)."""
    layer = LAYERS + ("" if homogeneous else f"{LAYER}.")
    sizes = (layers,) if homogeneous else ()
    rules = []
    if experts:
        stacked = f"{layer}mlp.experts.experts.*"
        if options.experts == GROUPED:
            for what in ("weight", "bias"):
                rules.append(Stacking(f"{LAYERS}{LAYER}.mlp.experts.*.{what}{EXPERT}",
                                      f"{stacked}.{what}", (*sizes, experts)))
        else:
            rules.append(Stacking(f"{LAYERS}{LAYER}.mlp.experts.local_experts.{EXPERT}.*",
                                  stacked, (*sizes, experts)))
    if options.transformer_impl == LOCAL and local_norms:
        for module, stored in (("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
                               ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_")):
            rules.append(Stacking(f"{LAYERS}{LAYER}.{module}weight", f"{layer}{stored}weight",
                                  sizes))
    if homogeneous:
        rules.append(Stacking(f"{LAYERS}{LAYER}.*", f"{LAYERS}*", (layers,)))
    return rules


def extra_states(layers: int, experts: int, sparse: Sequence[bool], options: Options,
                 homogeneous: bool, *, attention: Sequence[str], shared: bool) -> list[str]:
    """The unique keys of the ``_extra_state`` sharded objects Megatron's modules ask for
    (``KEY/shard_OFFSETS_SHAPE``, as `ShardedObject.unique_key` spells them);
    ``attention``: the attention modules of a layer that have one."""
    te = options.transformer_impl == TRANSFORMER_ENGINE
    keys = []
    for number, has_experts in enumerate(sparse):
        modules = list(attention)
        if not has_experts:
            modules += ["mlp.linear_fc1", "mlp.linear_fc2"]
        else:
            if te:
                modules.append("pre_mlp_layernorm")
            if shared:
                modules += ["mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2"]
        if homogeneous:
            keys += [f"{LAYERS}{module}._extra_state/shard_{number}_{layers}"
                     for module in modules]
        else:
            keys += [f"{LAYERS}{number}.{module}._extra_state/shard_0_1" for module in modules]
        if has_experts:
            for expert in range(experts):
                for name in ("linear_fc1", "linear_fc2"):
                    if homogeneous:
                        keys.append(f"{LAYERS}mlp.experts.experts.{name}._extra_state/shard_"
                                    f"{number}.{expert}_{layers}.{experts}")
                    else:
                        keys.append(f"{LAYERS}{number}.mlp.experts.experts.{name}._extra_state"
                                    f"/shard_{expert}_{experts}")
    if te:
        keys.append("decoder.final_layernorm._extra_state/shard_0_1")
    return keys


def target(describe: Callable[[Config], Decoder]) -> Callable[..., TargetMapping]:
    """A family's `megatron` target from what it holds (``describe``), taking the options
    by keyword."""
    def to_megatron(cfg: Config, mesh: Mesh, *, transformer_impl: str | None = None,
                    experts: str | None = None) -> TargetMapping:
        return decoder(cfg, mesh, describe(cfg), Options.of(transformer_impl, experts))

    return to_megatron
