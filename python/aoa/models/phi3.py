"""Phi-3: q, k, v already fused in Hugging Face as qkv_proj [Q | K | V], gate and up as
gate_up_proj [gate | up].

paddleformers: PaddleFormers' Phi3ForCausalLM keeps both fused, re-laid per tensor-parallel
rank: qkv_proj as [Q_r | K_r | V_r] and gate_up_proj as [gate_r | up_r], each transposed to
[in, out]. (PaddleFormers' own way back de-fuses gate_up_proj on the wrong axis; this one
de-fuses before transposing back.)
"""

from __future__ import annotations

from aoa.models import decoder, paddleformers
from aoa.models.base import (
    LAYER,
    Config,
    Expected,
    Family,
    Mesh,
    TargetMapping,
    Tensors,
    dim,
    fused_ffn_of_fused,
    fused_qkv_per_rank,
    linear,
)


def tensors(cfg: Config) -> dict[str, Expected]:
    t = Tensors(cfg)
    decoder.embeddings(t, cfg)
    hidden = dim(cfg.positive("hidden_size"), "hidden_size")
    heads, kv, head_dim = cfg.positive("num_attention_heads"), cfg.kv_heads(), cfg.head_dim()
    inner = cfg.positive("intermediate_size")
    for layer in range(cfg.positive("num_hidden_layers")):
        prefix = f"model.layers.{layer}."
        t.add(prefix + "self_attn.qkv_proj.weight",
              dim((heads + 2 * kv) * head_dim,
                  "(num_attention_heads + 2 * num_key_value_heads) * head_dim"), hidden)
        t.add(prefix + "self_attn.o_proj.weight", hidden,
              dim(heads * head_dim, "num_attention_heads * head_dim"))
        t.add(prefix + "mlp.gate_up_proj.weight", dim(2 * inner, "2 * intermediate_size"),
              hidden)
        t.add(prefix + "mlp.down_proj.weight", hidden, dim(inner, "intermediate_size"))
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
    m.add(fused_qkv_per_rank(layer + "self_attn.qkv_proj.weight",
                             layer + "self_attn.qkv_proj.weight",
                             cfg.positive("num_attention_heads"), cfg.kv_heads()),
          linear(layer + "self_attn.o_proj.weight", layer + "self_attn.o_proj.weight"),
          fused_ffn_of_fused(layer + "mlp.gate_up_proj.weight", layer + "mlp.gate_up_proj.weight"),
          linear(layer + "mlp.down_proj.weight", layer + "mlp.down_proj.weight"))
    m.splits = paddleformers.splits(cfg, mesh, embedding=paddleformers.CLASSIC_EMBEDDING,
                                    lm_head=paddleformers.CLASSIC_HEAD)
    return m


FAMILY = Family("phi3", ("phi3",), tensors, {"paddleformers": to_paddleformers},
                "Phi-3: q/k/v and gate/up fused in Hugging Face")
