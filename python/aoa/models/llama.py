"""Llama and Mistral: grouped-query attention (optional biases), a gated MLP (optional
biases), tied or untied embeddings.

paddleformers: PaddleFormers' LlamaForCausalLM keeps q, k, v, gate and up apart; every
linear weight is transposed to [in, out]; a tied model gets lm_head as a copy of the
embedding (and the way back drops it again).

megatron: Megatron-Core's GPTModel (`aoa.models.megatron`); attention biases go to
linear_qkv and linear_proj, MLP biases to linear_fc1 and linear_fc2.
"""

from __future__ import annotations

from aoa.models import decoder, megatron, paddleformers
from aoa.models.base import (
    LAYER,
    Config,
    Expected,
    Family,
    Mesh,
    TargetMapping,
    Tensors,
    linear,
    rename,
)


def tensors(cfg: Config) -> dict[str, Expected]:
    t = Tensors(cfg)
    decoder.embeddings(t, cfg)
    attention_bias = cfg.flag("attention_bias")
    for layer in range(cfg.positive("num_hidden_layers")):
        prefix = f"model.layers.{layer}."
        decoder.attention(t, cfg, prefix + "self_attn.", qkv_bias=attention_bias,
                          o_bias=attention_bias)
        decoder.mlp(t, cfg, prefix + "mlp.", bias=cfg.flag("mlp_bias"))
        decoder.norms(t, cfg, prefix)
    decoder.head(t, cfg)
    return t.expected


def to_paddleformers(cfg: Config, mesh: Mesh) -> TargetMapping:
    paddleformers.check_heads(cfg, mesh)
    paddleformers.no_expert_parallel(cfg, mesh)
    m = TargetMapping()
    layer = f"model.layers.{LAYER}."
    paddleformers.embedding_and_head(m, cfg, embedding=paddleformers.CLASSIC_EMBEDDING,
                                     head=paddleformers.CLASSIC_HEAD)
    paddleformers.layer_norms(m, layer, layer)
    biases = cfg.flag("attention_bias")
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        m.add(linear(f"{layer}self_attn.{proj}.weight", f"{layer}self_attn.{proj}.weight"))
        if biases:
            m.add(rename(f"{layer}self_attn.{proj}.bias", f"{layer}self_attn.{proj}.bias"))
    for proj in ("gate_proj", "up_proj", "down_proj"):
        m.add(linear(f"{layer}mlp.{proj}.weight", f"{layer}mlp.{proj}.weight"))
        if cfg.flag("mlp_bias"):
            m.add(rename(f"{layer}mlp.{proj}.bias", f"{layer}mlp.{proj}.bias"))
    m.splits = paddleformers.splits(cfg, mesh, embedding=paddleformers.CLASSIC_EMBEDDING,
                                    lm_head=paddleformers.CLASSIC_HEAD)
    return m


def megatron_decoder(cfg: Config) -> megatron.Decoder:
    bias = cfg.flag("attention_bias")
    return megatron.Decoder(qkv_bias=bias, o_bias=bias, mlp_bias=cfg.flag("mlp_bias"))


FAMILY = Family("llama", ("llama", "mistral"), tensors,
                {"paddleformers": to_paddleformers,
                 "megatron": megatron.target(megatron_decoder)},
                "Llama, Mistral: grouped-query attention, gated MLP")
