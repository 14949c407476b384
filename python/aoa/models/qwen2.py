"""Qwen2: grouped-query attention with q/k/v biases, a gated MLP, tied or untied embeddings,
optional sliding-window layers (which change no weight).

paddleformers: PaddleFormers builds Qwen2 with PaddleFleet: q, k, v fused into qkv_proj
grouped by key/value head (biases too), gate and up fused per rank into up_gate_proj, the
embedding under `model.embedding.`, the head at `model.lm_head.weight`.

megatron: Megatron-Core's GPTModel (`aoa.models.megatron`) with q/k/v biases in linear_qkv.
"""

from __future__ import annotations

from aoa.models import decoder, megatron, paddleformers
from aoa.models.base import LAYER, Config, Expected, Family, Mesh, TargetMapping, Tensors


def tensors(cfg: Config) -> dict[str, Expected]:
    t = Tensors(cfg)
    decoder.embeddings(t, cfg)
    for layer in range(cfg.positive("num_hidden_layers")):
        prefix = f"model.layers.{layer}."
        decoder.attention(t, cfg, prefix + "self_attn.", qkv_bias=True, o_bias=False)
        decoder.mlp(t, cfg, prefix + "mlp.")
        decoder.norms(t, cfg, prefix)
    decoder.head(t, cfg)
    return t.expected


def to_paddleformers(cfg: Config, mesh: Mesh) -> TargetMapping:
    paddleformers.check_heads(cfg, mesh)
    paddleformers.no_expert_parallel(cfg, mesh)
    m = TargetMapping()
    layer = f"model.layers.{LAYER}."
    paddleformers.embedding_and_head(m, cfg, embedding=paddleformers.FLEET_EMBEDDING,
                                     head=paddleformers.FLEET_HEAD)
    paddleformers.layer_norms(m, layer, layer)
    paddleformers.fused_attention(m, cfg, layer, layer, qkv_bias=True)
    paddleformers.fused_mlp(m, layer + "mlp.", layer + "mlp.")
    m.splits = paddleformers.splits(cfg, mesh, embedding=paddleformers.FLEET_EMBEDDING,
                                    lm_head=paddleformers.FLEET_HEAD)
    return m


FAMILY = Family("qwen2", ("qwen2",), tensors,
                {"paddleformers": to_paddleformers,
                 "megatron": megatron.target(lambda cfg: megatron.Decoder(qkv_bias=True))},
                "Qwen2: attention with q/k/v biases, gated MLP")
