"""Mixtral: grouped-query attention, sparse layers of routed experts (w1 gate, w3 up, w2
down) behind `block_sparse_moe`.

paddleformers: PaddleFormers 1.2.0 has no Mixtral; it is laid out as its Qwen3-MoE, the same
architecture without q/k norms: PaddleFleet names, q/k/v fused by key/value head, the router
in float32 under `mlp.gate`, each expert's gate (w1) and up (w3) side by side in up_gate_proj.

megatron: Megatron-Core's GPTModel (`aoa.models.megatron`): the router, each expert's w1
and w3 as linear_fc1's gate and up rows, w2 as linear_fc2.
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

EXPERT_NAMES = ("w1", "w3", "w2")  # gate, up, down


def tensors(cfg: Config) -> dict[str, Expected]:
    t = Tensors(cfg)
    decoder.embeddings(t, cfg)
    hidden = dim(cfg.positive("hidden_size"), "hidden_size")
    experts = cfg.positive("num_local_experts")
    for layer in range(cfg.positive("num_hidden_layers")):
        prefix = f"model.layers.{layer}."
        decoder.attention(t, cfg, prefix + "self_attn.", qkv_bias=False, o_bias=False)
        t.add(prefix + "block_sparse_moe.gate.weight", dim(experts, "num_local_experts"),
              hidden)
        for expert in range(experts):
            decoder.mlp(t, cfg, f"{prefix}block_sparse_moe.experts.{expert}.",
                        names=EXPERT_NAMES)
        decoder.norms(t, cfg, prefix)
    decoder.head(t, cfg)
    return t.expected


def to_paddleformers(cfg: Config, mesh: Mesh) -> TargetMapping:
    paddleformers.check_heads(cfg, mesh)
    m = TargetMapping(notes=["PaddleFormers 1.2.0 has no Mixtral: laid out as its Qwen3-MoE"])
    layer = f"model.layers.{LAYER}."
    moe = layer + "block_sparse_moe."
    paddleformers.embedding_and_head(m, cfg, embedding=paddleformers.FLEET_EMBEDDING,
                                     head=paddleformers.FLEET_HEAD)
    paddleformers.layer_norms(m, layer, layer)
    paddleformers.fused_attention(m, cfg, layer, layer, qkv_bias=False)
    m.add(rename(moe + "gate.weight", layer + "mlp.gate.weight", float32=True))
    paddleformers.experts(m, f"{moe}experts.{EXPERT}.", f"{layer}mlp.experts.{EXPERT}.",
                          names=EXPERT_NAMES)
    m.splits = paddleformers.splits(cfg, mesh, embedding=paddleformers.FLEET_EMBEDDING,
                                    lm_head=paddleformers.FLEET_HEAD,
                                    experts=cfg.positive("num_local_experts"))
    return m


def megatron_decoder(cfg: Config) -> megatron.Decoder:
    layers = cfg.positive("num_hidden_layers")
    return megatron.Decoder(sparse=[True] * layers, experts=cfg.positive("num_local_experts"),
                            moe="block_sparse_moe.", expert_names=EXPERT_NAMES)


FAMILY = Family("mixtral", ("mixtral",), tensors,
                {"paddleformers": to_paddleformers,
                 "megatron": megatron.target(megatron_decoder)},
                "Mixtral: routed experts")
