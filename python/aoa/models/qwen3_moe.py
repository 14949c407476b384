"""Qwen3-MoE: Qwen3 attention (q/k norms; biases when `attention_bias`), sparse layers of
routed experts without a shared one; dense layers where `mlp_only_layers` or
`decoder_sparse_step` say so.

paddleformers: PaddleFleet names; the router kept in float32; each expert's gate and up side
by side in up_gate_proj. (PaddleFormers 1.2.0 writes no statement for dense layers; they are
fused like Qwen3's MLP.)

megatron: Megatron-Core's GPTModel (`aoa.models.megatron`): q/k norms, the router, experts
(grouped or sequential); dense layers among sparse ones keep per-layer keys.
"""

from __future__ import annotations

from aoa.models import decoder, megatron, paddleformers
from aoa.models.base import (
    EXPERT,
    LAYER,
    Config,
    Expected,
    Family,
    Mesh,
    TargetMapping,
    Tensors,
    dim,
    rename,
)
from aoa.models.qwen2_moe import expert_count, sparse_layers
from aoa.models.qwen3 import QK_NORMS


def tensors(cfg: Config) -> dict[str, Expected]:
    t = Tensors(cfg)
    decoder.embeddings(t, cfg)
    hidden = dim(cfg.positive("hidden_size"), "hidden_size")
    bias = cfg.flag("attention_bias")
    for layer, sparse in enumerate(sparse_layers(cfg)):
        prefix = f"model.layers.{layer}."
        decoder.attention(t, cfg, prefix + "self_attn.", qkv_bias=bias, o_bias=bias,
                          qk_norm=True)
        if sparse:
            experts = expert_count(cfg)
            t.add(prefix + "mlp.gate.weight", dim(experts, "num_experts"), hidden)
            for expert in range(experts):
                decoder.mlp(t, cfg, f"{prefix}mlp.experts.{expert}.", "moe_intermediate_size")
        else:
            decoder.mlp(t, cfg, prefix + "mlp.")
        decoder.norms(t, cfg, prefix)
    decoder.head(t, cfg)
    return t.expected


def to_paddleformers(cfg: Config, mesh: Mesh) -> TargetMapping:
    paddleformers.check_heads(cfg, mesh)
    m = TargetMapping()
    layer = f"model.layers.{LAYER}."
    bias = cfg.flag("attention_bias")
    paddleformers.embedding_and_head(m, cfg, embedding=paddleformers.FLEET_EMBEDDING,
                                     head=paddleformers.FLEET_HEAD)
    paddleformers.layer_norms(m, layer, layer)
    paddleformers.fused_attention(m, cfg, layer, layer, qkv_bias=bias, o_bias=bias,
                                  qk_norm=QK_NORMS)
    sparse = sparse_layers(cfg)
    if any(sparse):
        mlp = layer + "mlp."
        m.add(rename(mlp + "gate.weight", mlp + "gate.weight", float32=True))
        paddleformers.experts(m, f"{mlp}experts.{EXPERT}.", f"{mlp}experts.{EXPERT}.")
    if not all(sparse):
        paddleformers.fused_mlp(m, layer + "mlp.", layer + "mlp.")
    m.splits = paddleformers.splits(cfg, mesh, embedding=paddleformers.FLEET_EMBEDDING,
                                    lm_head=paddleformers.FLEET_HEAD,
                                    experts=expert_count(cfg) if any(sparse) else 0)
    if not any(sparse):
        paddleformers.no_expert_parallel(cfg, mesh)
    return m


def megatron_decoder(cfg: Config) -> megatron.Decoder:
    bias = cfg.flag("attention_bias")
    return megatron.Decoder(qkv_bias=bias, o_bias=bias, qk_norm=True,
                            sparse=sparse_layers(cfg), experts=expert_count(cfg))


FAMILY = Family("qwen3_moe", ("qwen3_moe",), tensors,
                {"paddleformers": to_paddleformers,
                 "megatron": megatron.target(megatron_decoder)},
                "Qwen3-MoE: routed experts, q/k norms")
