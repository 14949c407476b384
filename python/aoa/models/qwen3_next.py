"""Qwen3-Next: layers of gated linear attention (Gated DeltaNet: in_proj_qkvz, in_proj_ba,
a depthwise conv1d, A_log, dt_bias, a gated norm, out_proj) with a full-attention layer
every `full_attention_interval` (or as `layer_types` lists them), whose q_proj holds each
head's query and output gate side by side; q/k norms; routed experts with a shared expert
and its sigmoid gate; dense layers where `mlp_only_layers` or `decoder_sparse_step` say so.

paddleformers: PaddleFormers 1.2.0's Qwen3NextForCausalLM: q, k, v fused by key/value head
(each head's query and gate stay together, written as twice the heads so that the way back
splits them), gate and up fused per rank in the shared expert
and dense layers, each expert's side by side (whole); every linear weight transposed, the
router too and kept in float32; the linear attention's tensors kept whole on every
tensor-parallel rank, as its plain Linear layers hold them. (PaddleFormers 1.2.0 writes no
statement for dense layers; they are fused like the shared expert.) `attention_bias` is
refused: PaddleFormers maps only the q/k/v biases, not o_proj's.
"""

from __future__ import annotations

from aoa.models import decoder, paddleformers
from aoa.models.base import (
    EXPERT,
    LAYER,
    Config,
    Expected,
    Family,
    Mesh,
    ModelError,
    TargetMapping,
    Tensors,
    dim,
    fused_qkv,
    linear,
    rename,
)
from aoa.models.qwen2_moe import expert_count, gated_shared_expert_moe, sparse_layers

LINEAR = "linear_attn."


def full_attention_layers(cfg: Config) -> list[bool]:
    """Which layers are full attention: `layer_types` where the config lists them, else
    every `full_attention_interval`-th layer (transformers' default, 4)."""
    layers = cfg.positive("num_hidden_layers")
    types = cfg.data.get("layer_types")
    if types is None:
        interval = cfg.positive("full_attention_interval", 4)
        return [(layer + 1) % interval == 0 for layer in range(layers)]
    if not isinstance(types, list) or len(types) != layers or \
            not set(types) <= {"linear_attention", "full_attention"}:
        raise ModelError(f"{cfg.path}: 'layer_types' is {types!r}; a list of "
                         "\"linear_attention\" or \"full_attention\", one for each of the "
                         f"{layers} layers, is needed")
    return [kind == "full_attention" for kind in types]


def tensors(cfg: Config) -> dict[str, Expected]:
    t = Tensors(cfg)
    decoder.embeddings(t, cfg)
    hidden = dim(cfg.positive("hidden_size"), "hidden_size")
    heads, kv, head_dim = cfg.positive("num_attention_heads"), cfg.kv_heads(), cfg.head_dim()
    k_heads, v_heads = cfg.positive("linear_num_key_heads"), cfg.positive("linear_num_value_heads")
    k_dim, v_dim = cfg.positive("linear_key_head_dim"), cfg.positive("linear_value_head_dim")
    keys, values = k_heads * k_dim, v_heads * v_dim
    for layer, (full, sparse) in enumerate(zip(full_attention_layers(cfg), sparse_layers(cfg))):
        prefix = f"model.layers.{layer}."
        if full:
            a = prefix + "self_attn."
            t.add(a + "q_proj.weight", dim(2 * heads * head_dim,
                                           "2 * num_attention_heads * head_dim"), hidden)
            t.add(a + "k_proj.weight", dim(kv * head_dim, "num_key_value_heads * head_dim"),
                  hidden)
            t.add(a + "v_proj.weight", dim(kv * head_dim, "num_key_value_heads * head_dim"),
                  hidden)
            t.add(a + "o_proj.weight", hidden, dim(heads * head_dim,
                                                   "num_attention_heads * head_dim"))
            t.add(a + "q_norm.weight", dim(head_dim, "head_dim"))
            t.add(a + "k_norm.weight", dim(head_dim, "head_dim"))
        else:
            a = prefix + LINEAR
            t.add(a + "in_proj_qkvz.weight",
                  dim(2 * keys + 2 * values, "2 * linear_num_key_heads * linear_key_head_dim + "
                                             "2 * linear_num_value_heads * "
                                             "linear_value_head_dim"), hidden)
            t.add(a + "in_proj_ba.weight", dim(2 * v_heads, "2 * linear_num_value_heads"),
                  hidden)
            t.add(a + "conv1d.weight", dim(2 * keys + values, "2 * linear_num_key_heads * "
                                                              "linear_key_head_dim + "
                                                              "linear_num_value_heads * "
                                                              "linear_value_head_dim"),
                  dim(1, "1"), dim(cfg.positive("linear_conv_kernel_dim"),
                                   "linear_conv_kernel_dim"))
            t.add(a + "dt_bias", dim(v_heads, "linear_num_value_heads"))
            t.add(a + "A_log", dim(v_heads, "linear_num_value_heads"))
            t.add(a + "norm.weight", dim(v_dim, "linear_value_head_dim"))
            t.add(a + "out_proj.weight", hidden,
                  dim(values, "linear_num_value_heads * linear_value_head_dim"))
        if sparse:
            gated_shared_expert_moe(t, cfg, prefix + "mlp.")
        else:
            decoder.mlp(t, cfg, prefix + "mlp.")
        decoder.norms(t, cfg, prefix)
    decoder.head(t, cfg)
    return t.expected


def to_paddleformers(cfg: Config, mesh: Mesh) -> TargetMapping:
    paddleformers.check_heads(cfg, mesh)
    if cfg.flag("attention_bias"):
        raise ModelError(f"{cfg.path}: attention_bias is true; PaddleFormers 1.2.0 maps the "
                         "q/k/v biases of Qwen3-Next but not o_proj's",
                         hint="Qwen3-Next's releases have no attention bias; check the "
                              "config.")
    heads = cfg.positive("num_attention_heads")
    m = TargetMapping(notes=[f"q_proj holds each head's query and gate: fused as {2 * heads} "
                             f"heads of head_dim, the bytes of PaddleFormers' num_heads={heads}"])
    layer = f"model.layers.{LAYER}."
    paddleformers.embedding_and_head(m, cfg, embedding=paddleformers.CLASSIC_EMBEDDING,
                                     head=paddleformers.CLASSIC_HEAD)
    paddleformers.layer_norms(m, layer, layer)
    full = full_attention_layers(cfg)
    if any(full):
        # Each head's query and gate are two head_dim blocks side by side: as 2 * heads heads
        # they group by key/value head exactly as PaddleFormers' num_heads=heads does, and
        # the way back splits them again (a split that assumes one head size can).
        a = layer + "self_attn."
        m.add(fused_qkv(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight",
                        a + "qkv_proj.weight", 2 * heads, cfg.kv_heads()),
              linear(a + "o_proj.weight", a + "o_proj.weight"),
              rename(a + "q_norm.weight", a + "q_norm.weight"),
              rename(a + "k_norm.weight", a + "k_norm.weight"))
    if not all(full):
        a = layer + LINEAR
        for name in ("in_proj_qkvz", "in_proj_ba", "out_proj"):
            m.add(linear(f"{a}{name}.weight", f"{a}{name}.weight"))
        for name in ("conv1d.weight", "dt_bias", "A_log", "norm.weight"):
            m.add(rename(a + name, a + name))
    sparse = sparse_layers(cfg)
    mlp = layer + "mlp."
    if any(sparse):
        m.add(linear(mlp + "gate.weight", mlp + "gate.weight", float32=True),
              linear(mlp + "shared_expert_gate.weight", mlp + "shared_expert_gate.weight"))
        paddleformers.experts(m, f"{mlp}experts.{EXPERT}.", f"{mlp}experts.{EXPERT}.")
        paddleformers.fused_mlp(m, mlp + "shared_expert.", mlp + "shared_expert.")
    if not all(sparse):
        paddleformers.fused_mlp(m, mlp, mlp)
    experts = expert_count(cfg) if any(sparse) else 0
    m.splits = paddleformers.splits(cfg, mesh, embedding=paddleformers.CLASSIC_EMBEDDING,
                                    lm_head=paddleformers.CLASSIC_HEAD, experts=experts)
    if not experts:
        paddleformers.no_expert_parallel(cfg, mesh)
    return m


FAMILY = Family("qwen3_next", ("qwen3_next",), tensors, {"paddleformers": to_paddleformers},
                "Qwen3-Next: gated linear attention, gated full attention, shared expert")
