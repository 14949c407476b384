"""Qwen2-MoE: Qwen2 attention (q/k/v biases when `qkv_bias`), sparse layers with routed
experts, one shared expert and its sigmoid gate; dense layers where `mlp_only_layers` or
`decoder_sparse_step` say so.

paddleformers: PaddleFleet names; the router and the shared expert's gate are kept in
float32 (the gate transposed to [hidden, 1]); each expert's gate and up side by side in
up_gate_proj; the shared expert fused per rank like a dense MLP and renamed shared_experts.

megatron: Megatron-Core's GPTModel (`aoa.models.megatron`): the router, experts, the shared
expert as shared_experts (its sigmoid gate as gate_weight); dense layers keep per-layer keys.
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
    linear,
    rename,
)


def expert_count(cfg: Config) -> int:
    """num_experts (transformers 5 saves it as num_local_experts)."""
    return cfg.either("num_experts", "num_local_experts")


def sparse_layers(cfg: Config) -> list[bool]:
    """Which layers have experts, as transformers decides it."""
    experts = expert_count(cfg)
    step = cfg.positive("decoder_sparse_step", 1)
    dense = set(cfg.counts("mlp_only_layers", []))
    return [layer not in dense and experts > 0 and (layer + 1) % step == 0
            for layer in range(cfg.positive("num_hidden_layers"))]


def gated_shared_expert_moe(t: Tensors, cfg: Config, prefix: str) -> None:
    """A sparse MLP of ``prefix`` (`model.layers.N.mlp.`): the router, the routed experts,
    one shared expert and its sigmoid gate (Qwen2-MoE's, Qwen3-Next's)."""
    hidden = dim(cfg.positive("hidden_size"), "hidden_size")
    experts = expert_count(cfg)
    t.add(prefix + "gate.weight", dim(experts, "num_experts"), hidden)
    for expert in range(experts):
        decoder.mlp(t, cfg, f"{prefix}experts.{expert}.", "moe_intermediate_size")
    decoder.mlp(t, cfg, prefix + "shared_expert.", "shared_expert_intermediate_size")
    t.add(prefix + "shared_expert_gate.weight", dim(1, "one gate"), hidden)


def tensors(cfg: Config) -> dict[str, Expected]:
    t = Tensors(cfg)
    decoder.embeddings(t, cfg)
    for layer, sparse in enumerate(sparse_layers(cfg)):
        prefix = f"model.layers.{layer}."
        decoder.attention(t, cfg, prefix + "self_attn.", qkv_bias=cfg.flag("qkv_bias", True),
                          o_bias=False)
        if sparse:
            gated_shared_expert_moe(t, cfg, prefix + "mlp.")
        else:
            decoder.mlp(t, cfg, prefix + "mlp.")
        decoder.norms(t, cfg, prefix)
    decoder.head(t, cfg)
    return t.expected


def to_paddleformers(cfg: Config, mesh: Mesh) -> TargetMapping:
    paddleformers.check_heads(cfg, mesh)
    m = TargetMapping()
    layer = f"model.layers.{LAYER}."
    paddleformers.embedding_and_head(m, cfg, embedding=paddleformers.FLEET_EMBEDDING,
                                     head=paddleformers.FLEET_HEAD)
    paddleformers.layer_norms(m, layer, layer)
    paddleformers.fused_attention(m, cfg, layer, layer, qkv_bias=cfg.flag("qkv_bias", True))
    sparse = sparse_layers(cfg)
    if any(sparse):
        mlp = layer + "mlp."
        m.add(rename(mlp + "gate.weight", mlp + "gate.weight", float32=True))
        paddleformers.experts(m, f"{mlp}experts.{EXPERT}.", f"{mlp}experts.{EXPERT}.")
        paddleformers.fused_mlp(m, mlp + "shared_expert.", mlp + "shared_experts.")
        m.add(linear(mlp + "shared_expert_gate.weight", mlp + "shared_experts.gate_weight",
                     float32=True))
    if not all(sparse):
        paddleformers.fused_mlp(m, layer + "mlp.", layer + "mlp.")
    m.splits = paddleformers.splits(cfg, mesh, embedding=paddleformers.FLEET_EMBEDDING,
                                    lm_head=paddleformers.FLEET_HEAD,
                                    experts=expert_count(cfg) if any(sparse) else 0)
    if not any(sparse):
        paddleformers.no_expert_parallel(cfg, mesh)
    return m


def megatron_decoder(cfg: Config) -> megatron.Decoder:
    return megatron.Decoder(qkv_bias=cfg.flag("qkv_bias", True), sparse=sparse_layers(cfg),
                            experts=expert_count(cfg), shared_expert="shared_expert.",
                            shared_gate="shared_expert_gate.weight")


FAMILY = Family("qwen2_moe", ("qwen2_moe",), tensors,
                {"paddleformers": to_paddleformers,
                 "megatron": megatron.target(megatron_decoder)},
                "Qwen2-MoE: routed experts, a gated shared expert")
