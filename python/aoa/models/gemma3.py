"""Gemma 3 (text): grouped-query attention with q/k norms (biases when `attention_bias`),
four norms per layer, a gated MLP, interleaved sliding-window and full layers (which change
no weight), embeddings tied by default.

paddleformers: PaddleFormers' Gemma3ForCausalLM fuses q, k, v into qkv_proj grouped by
key/value head and gate and up per rank into up_gate_proj; its embedding is not split under
tensor parallelism; a tied model gets lm_head as a copy of the embedding.
"""

from __future__ import annotations

from aoa.models import decoder, paddleformers
from aoa.models.base import LAYER, Config, Expected, Family, Mesh, TargetMapping, Tensors

NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
         "post_feedforward_layernorm")


def tensors(cfg: Config) -> dict[str, Expected]:
    t = Tensors(cfg)
    decoder.embeddings(t, cfg)
    bias = cfg.flag("attention_bias")
    for layer in range(cfg.positive("num_hidden_layers")):
        prefix = f"model.layers.{layer}."
        decoder.attention(t, cfg, prefix + "self_attn.", qkv_bias=bias, o_bias=bias,
                          qk_norm=True)
        decoder.mlp(t, cfg, prefix + "mlp.")
        decoder.norms(t, cfg, prefix, NORMS)
    decoder.head(t, cfg, tied_default=True)
    return t.expected


def to_paddleformers(cfg: Config, mesh: Mesh) -> TargetMapping:
    paddleformers.check_heads(cfg, mesh)
    paddleformers.no_expert_parallel(cfg, mesh)
    m = TargetMapping()
    layer = f"model.layers.{LAYER}."
    bias = cfg.flag("attention_bias")
    paddleformers.embedding_and_head(m, cfg, embedding=paddleformers.CLASSIC_EMBEDDING,
                                     head=paddleformers.CLASSIC_HEAD, tied_default=True)
    paddleformers.layer_norms(m, layer, layer, NORMS)
    paddleformers.fused_attention(m, cfg, layer, layer, qkv_bias=bias, o_bias=bias,
                                  qk_norm=("q_norm", "k_norm"))
    paddleformers.fused_mlp(m, layer + "mlp.", layer + "mlp.")
    m.splits = paddleformers.splits(cfg, mesh, embedding=paddleformers.CLASSIC_EMBEDDING,
                                    lm_head=paddleformers.CLASSIC_HEAD, vocab_parallel=False)
    return m


FAMILY = Family("gemma3_text", ("gemma3_text",), tensors, {"paddleformers": to_paddleformers},
                "Gemma 3: q/k norms, four norms a layer, sliding windows")
