"""Qwen3: grouped-query attention with per-head q/k norms (and q/k/v/o biases when
`attention_bias`), a gated MLP, tied or untied embeddings, optional sliding-window layers.

paddleformers: built with PaddleFleet like Qwen2; the q/k norms are named q_layernorm and
k_layernorm. (PaddleFormers 1.2.0 writes no statement for `attention_bias` biases; they
are fused like Qwen2's, and o_proj's kept whole, as its attention layer holds them.)

megatron: Megatron-Core's GPTModel (`aoa.models.megatron`) with q_layernorm and k_layernorm.
"""

from __future__ import annotations

from aoa.models import decoder, megatron, paddleformers
from aoa.models.base import LAYER, Config, Expected, Family, Mesh, TargetMapping, Tensors

QK_NORMS = ("q_layernorm", "k_layernorm")


def tensors(cfg: Config) -> dict[str, Expected]:
    t = Tensors(cfg)
    decoder.embeddings(t, cfg)
    bias = cfg.flag("attention_bias")
    for layer in range(cfg.positive("num_hidden_layers")):
        prefix = f"model.layers.{layer}."
        decoder.attention(t, cfg, prefix + "self_attn.", qkv_bias=bias, o_bias=bias,
                          qk_norm=True)
        decoder.mlp(t, cfg, prefix + "mlp.")
        decoder.norms(t, cfg, prefix)
    decoder.head(t, cfg)
    return t.expected


def to_paddleformers(cfg: Config, mesh: Mesh) -> TargetMapping:
    paddleformers.check_heads(cfg, mesh)
    paddleformers.no_expert_parallel(cfg, mesh)
    m = TargetMapping()
    layer = f"model.layers.{LAYER}."
    bias = cfg.flag("attention_bias")
    paddleformers.embedding_and_head(m, cfg, embedding=paddleformers.FLEET_EMBEDDING,
                                     head=paddleformers.FLEET_HEAD)
    paddleformers.layer_norms(m, layer, layer)
    paddleformers.fused_attention(m, cfg, layer, layer, qkv_bias=bias, o_bias=bias,
                                  qk_norm=QK_NORMS)
    paddleformers.fused_mlp(m, layer + "mlp.", layer + "mlp.")
    m.splits = paddleformers.splits(cfg, mesh, embedding=paddleformers.FLEET_EMBEDDING,
                                    lm_head=paddleformers.FLEET_HEAD)
    return m


def megatron_decoder(cfg: Config) -> megatron.Decoder:
    bias = cfg.flag("attention_bias")
    return megatron.Decoder(qkv_bias=bias, o_bias=bias, qk_norm=True)


FAMILY = Family("qwen3", ("qwen3",), tensors,
                {"paddleformers": to_paddleformers,
                 "megatron": megatron.target(megatron_decoder)},
                "Qwen3: attention with q/k norms, gated MLP")
