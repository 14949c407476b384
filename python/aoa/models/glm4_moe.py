"""GLM-4-MoE (GLM-4.5): grouped-query attention (q/k/v biases when `attention_bias`, q/k
norms when `use_qk_norm`), dense MLPs in the first `first_k_dense_replace` layers, then
routed experts with a bias-corrected router and shared experts; `num_nextn_predict_layers`
multi-token-prediction layers after the last decoder layer (transformers does not save them;
a checkpoint without them converts without).

paddleformers: PaddleFleet names, q/k/v fused by key/value head, dense and shared-expert
gate/up fused per rank, each expert's gate and up side by side, the router in float32. A
multi-token-prediction layer's decoder goes under `transformer_layer.`, its
shared_head.norm becomes its `norm`; its embed_tokens and shared_head.head, which
PaddleFormers shares with the main model, are carried as they are so the way back is whole.
Because a `$LAYER_ID` template would also match those layers, a model with them is mapped
layer by layer, as PaddleFormers does.

megatron: Megatron-Core's GPTModel (`aoa.models.megatron`): q/k/v biases in linear_qkv, q/k
norms, dense first layers, the router with its score correction as expert_bias (float32),
shared experts without a gate. Multi-token-prediction layers as for DeepSeek-V3: refused
where the checkpoint holds them.
"""

from __future__ import annotations

from aoa.models import decoder, deepseek_v3, megatron, paddleformers
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

MTP = "num_nextn_predict_layers"
#: Tensors of a multi-token-prediction layer that a checkpoint may leave out.
MTP_SHARED = ("embed_tokens.weight", "shared_head.head.weight")


def tensors(cfg: Config) -> dict[str, Expected]:
    t = Tensors(cfg)
    decoder.embeddings(t, cfg)
    layers = cfg.positive("num_hidden_layers")
    hidden = dim(cfg.positive("hidden_size"), "hidden_size")
    bias = cfg.flag("attention_bias")
    for layer in range(layers + cfg.count(MTP, 0)):
        prefix = f"model.layers.{layer}."
        t.group = MTP if layer >= layers else None
        decoder.attention(t, cfg, prefix + "self_attn.", qkv_bias=bias, o_bias=False,
                          qk_norm=cfg.flag("use_qk_norm"))
        if layer < cfg.count("first_k_dense_replace", 0):
            decoder.mlp(t, cfg, prefix + "mlp.")
        else:
            experts = cfg.positive("n_routed_experts")
            t.add(prefix + "mlp.gate.weight", dim(experts, "n_routed_experts"), hidden)
            t.add(prefix + "mlp.gate.e_score_correction_bias", dim(experts, "n_routed_experts"))
            for expert in range(experts):
                decoder.mlp(t, cfg, f"{prefix}mlp.experts.{expert}.", "moe_intermediate_size")
            decoder.mlp(t, cfg, prefix + "mlp.shared_experts.",
                        "moe_intermediate_size * n_shared_experts",
                        size=cfg.positive("moe_intermediate_size")
                        * cfg.positive("n_shared_experts"))
        decoder.norms(t, cfg, prefix)
        if layer >= layers:
            mtp_tensors(t, cfg, prefix)
    t.group = None
    decoder.head(t, cfg)
    return t.expected


def mtp_tensors(t: Tensors, cfg: Config, prefix: str) -> None:
    """What a multi-token-prediction layer ``prefix`` holds beside its decoder: its two
    norms, eh_proj, shared_head.norm, and the embedding and head where the checkpoint has
    them (PaddleFormers shares those with the main model)."""
    hidden = dim(cfg.positive("hidden_size"), "hidden_size")
    vocab = dim(cfg.positive("vocab_size"), "vocab_size")
    t.add(prefix + "enorm.weight", hidden)
    t.add(prefix + "hnorm.weight", hidden)
    t.add(prefix + "eh_proj.weight", hidden, dim(2 * hidden.size, "2 * hidden_size"))
    t.add(prefix + "shared_head.norm.weight", hidden)
    for name in MTP_SHARED:
        if cfg.has(prefix + name):
            t.add(prefix + name, vocab, hidden)


def fleet_mtp(m: TargetMapping, cfg: Config, hf: str) -> None:
    """`mtp_tensors` of the layer ``hf`` in PaddleFleet's names: eh_proj transposed,
    shared_head.norm as the layer's `norm`, the rest as they are."""
    m.add(linear(hf + "eh_proj.weight", hf + "eh_proj.weight"),
          rename(hf + "enorm.weight", hf + "enorm.weight"),
          rename(hf + "hnorm.weight", hf + "hnorm.weight"),
          rename(hf + "shared_head.norm.weight", hf + "norm.weight"))
    for name in MTP_SHARED:
        if cfg.has(hf + name):
            m.add(rename(hf + name, hf + name))


def to_paddleformers(cfg: Config, mesh: Mesh) -> TargetMapping:
    paddleformers.check_heads(cfg, mesh)
    m = TargetMapping()
    paddleformers.embedding_and_head(m, cfg, embedding=paddleformers.FLEET_EMBEDDING,
                                     head=paddleformers.FLEET_HEAD)
    layers = cfg.positive("num_hidden_layers")
    mtp = cfg.count(MTP, 0)
    dense = cfg.count("first_k_dense_replace", 0)
    if mtp:
        for layer in range(layers + mtp):
            hf = f"model.layers.{layer}."
            target = hf + ("transformer_layer." if layer >= layers else "")
            decoder_layer(m, cfg, hf, target, sparse=layer >= dense)
            if layer >= layers:
                fleet_mtp(m, cfg, hf)
    else:
        every = f"model.layers.{LAYER}."
        if dense:
            paddleformers.fused_mlp(m, every + "mlp.", every + "mlp.")
        decoder_layer(m, cfg, every, every, sparse=dense < layers, dense_mlp=False)
    m.splits = paddleformers.splits(cfg, mesh, embedding=paddleformers.FLEET_EMBEDDING,
                                    lm_head=paddleformers.FLEET_HEAD,
                                    experts=cfg.positive("n_routed_experts"))
    return m


def decoder_layer(m: TargetMapping, cfg: Config, hf: str, target: str, *, sparse: bool,
                  dense_mlp: bool = True) -> None:
    """One layer (or, with `$LAYER_ID`, all): norms, attention and its MLP or experts."""
    paddleformers.layer_norms(m, hf, target)
    paddleformers.fused_attention(m, cfg, hf, target, qkv_bias=cfg.flag("attention_bias"),
                                  qk_norm=("q_norm", "k_norm") if cfg.flag("use_qk_norm")
                                  else None)
    if sparse:
        a, b = hf + "mlp.", target + "mlp."
        m.add(rename(a + "gate.weight", b + "gate.weight", float32=True),
              rename(a + "gate.e_score_correction_bias", b + "gate.e_score_correction_bias"))
        paddleformers.fused_mlp(m, a + "shared_experts.", b + "shared_experts.")
        paddleformers.experts(m, f"{a}experts.{EXPERT}.", f"{b}experts.{EXPERT}.")
    elif dense_mlp:
        paddleformers.fused_mlp(m, hf + "mlp.", target + "mlp.")


def megatron_decoder(cfg: Config) -> megatron.Decoder:
    layers = cfg.positive("num_hidden_layers")
    dense = cfg.count("first_k_dense_replace", 0)
    return megatron.Decoder(qkv_bias=cfg.flag("attention_bias"), qk_norm=cfg.flag("use_qk_norm"),
                            sparse=[layer >= dense for layer in range(layers)],
                            experts=cfg.positive("n_routed_experts"),
                            shared_expert="shared_experts.",
                            expert_bias="gate.e_score_correction_bias",
                            notes=deepseek_v3.without_mtp_layers(cfg))


FAMILY = Family("glm4_moe", ("glm4_moe",), tensors, {"paddleformers": to_paddleformers,
                                                     "megatron": megatron.target(megatron_decoder)},
                "GLM-4-MoE: shared and routed experts, MTP layers")
