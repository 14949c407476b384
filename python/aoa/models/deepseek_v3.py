"""DeepSeek-V3: multi-head latent attention (q through a low-rank
q_a/q_b pair when `q_lora_rank`, k/v through kv_a_proj_with_mqa and kv_b_proj), dense MLPs
in the first `first_k_dense_replace` layers, then routed experts with a bias-corrected router
and shared experts; `num_nextn_predict_layers` multi-token-prediction layers after the last
decoder layer (transformers does not save them; a checkpoint without them converts without).

paddleformers: PaddleFormers' DeepseekV3ForCausalLM keeps every projection apart and
transposes each linear weight; the router weight is transposed to [hidden, experts] and kept
in float32 with its correction bias. A multi-token-prediction layer keeps its names; its
eh_proj is transposed like every linear weight (PaddleFormers 1.2.0 writes no statement for
it, which its [2h, h] parameter cannot load), and its embed_tokens and shared_head, which
PaddleFormers shares with the main model, are carried as they are so the way back is whole.

megatron: Megatron-Core's GPTModel with latent attention (`aoa.models.megatron`): the
projections as linear_q_proj or linear_q_down_proj/linear_q_up_proj, linear_kv_down_proj,
linear_kv_up_proj; the router with its score correction as expert_bias (float32, as Megatron
keeps it); shared experts; dense first layers keep per-layer keys. Megatron's
multi-token-prediction layers are not written: a checkpoint that holds them is refused.
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
    ModelError,
    TargetMapping,
    Tensors,
    dim,
    linear,
    rename,
)

MTP = "num_nextn_predict_layers"


def tensors(cfg: Config) -> dict[str, Expected]:
    t = Tensors(cfg)
    decoder.embeddings(t, cfg)
    layers = cfg.positive("num_hidden_layers")
    hidden = dim(cfg.positive("hidden_size"), "hidden_size")
    vocab = dim(cfg.positive("vocab_size"), "vocab_size")
    for layer in range(layers + cfg.count(MTP, 0)):
        prefix = f"model.layers.{layer}."
        t.group = MTP if layer >= layers else None
        attention(t, cfg, prefix + "self_attn.")
        if layer < cfg.count("first_k_dense_replace", 0):
            decoder.mlp(t, cfg, prefix + "mlp.")
        else:
            routed_experts(t, cfg, prefix + "mlp.")
        decoder.norms(t, cfg, prefix)
        if layer >= layers:
            t.add(prefix + "enorm.weight", hidden)
            t.add(prefix + "hnorm.weight", hidden)
            t.add(prefix + "eh_proj.weight", hidden, dim(2 * hidden.size, "2 * hidden_size"))
            t.add(prefix + "embed_tokens.weight", vocab, hidden)
            t.add(prefix + "shared_head.norm.weight", hidden)
            t.add(prefix + "shared_head.head.weight", vocab, hidden)
    t.group = None
    decoder.head(t, cfg)
    return t.expected


def routed_experts(t: Tensors, cfg: Config, prefix: str) -> None:
    """A sparse MLP of ``prefix`` (`model.layers.N.mlp.`): the router with its correction
    bias, the routed experts and, where `n_shared_experts` says, the shared experts in one."""
    hidden = dim(cfg.positive("hidden_size"), "hidden_size")
    experts = dim(cfg.positive("n_routed_experts"), "n_routed_experts")
    t.add(prefix + "gate.weight", experts, hidden)
    t.add(prefix + "gate.e_score_correction_bias", experts)
    for expert in range(experts.size):
        decoder.mlp(t, cfg, f"{prefix}experts.{expert}.", "moe_intermediate_size")
    shared = cfg.count("n_shared_experts", 0)
    if shared:
        decoder.mlp(t, cfg, prefix + "shared_experts.", "moe_intermediate_size * "
                    "n_shared_experts", size=cfg.positive("moe_intermediate_size") * shared)


def attention(t: Tensors, cfg: Config, prefix: str) -> None:
    heads = cfg.positive("num_attention_heads")
    hidden = dim(cfg.positive("hidden_size"), "hidden_size")
    nope, rope = cfg.positive("qk_nope_head_dim"), cfg.positive("qk_rope_head_dim")
    value, kv_rank = cfg.positive("v_head_dim"), cfg.positive("kv_lora_rank")
    bias = cfg.flag("attention_bias")
    q_out = dim(heads * (nope + rope), "num_attention_heads * (qk_nope_head_dim + "
                                       "qk_rope_head_dim)")
    q_rank = cfg.optional_count("q_lora_rank")
    if q_rank:
        t.add(prefix + "q_a_proj.weight", dim(q_rank, "q_lora_rank"), hidden)
        if bias:
            t.add(prefix + "q_a_proj.bias", dim(q_rank, "q_lora_rank"))
        t.add(prefix + "q_a_layernorm.weight", dim(q_rank, "q_lora_rank"))
        t.add(prefix + "q_b_proj.weight", q_out, dim(q_rank, "q_lora_rank"))
    else:
        t.add(prefix + "q_proj.weight", q_out, hidden)
    kv_a = dim(kv_rank + rope, "kv_lora_rank + qk_rope_head_dim")
    t.add(prefix + "kv_a_proj_with_mqa.weight", kv_a, hidden)
    if bias:
        t.add(prefix + "kv_a_proj_with_mqa.bias", kv_a)
    t.add(prefix + "kv_a_layernorm.weight", dim(kv_rank, "kv_lora_rank"))
    t.add(prefix + "kv_b_proj.weight",
          dim(heads * (nope + value), "num_attention_heads * (qk_nope_head_dim + v_head_dim)"),
          dim(kv_rank, "kv_lora_rank"))
    t.add(prefix + "o_proj.weight", hidden,
          dim(heads * value, "num_attention_heads * v_head_dim"))
    if bias:
        t.add(prefix + "o_proj.bias", hidden)


def to_paddleformers(cfg: Config, mesh: Mesh) -> TargetMapping:
    heads = cfg.positive("num_attention_heads")
    paddleformers.check_heads(cfg, mesh, heads=heads, kv_heads=heads)
    m = TargetMapping()
    layer = f"model.layers.{LAYER}."
    a = layer + "self_attn."
    paddleformers.embedding_and_head(m, cfg, embedding=paddleformers.CLASSIC_EMBEDDING,
                                     head=paddleformers.CLASSIC_HEAD)
    paddleformers.layer_norms(m, layer, layer)
    if cfg.optional_count("q_lora_rank"):
        m.add(linear(a + "q_a_proj.weight", a + "q_a_proj.weight"),
              rename(a + "q_a_layernorm.weight", a + "q_a_layernorm.weight"),
              linear(a + "q_b_proj.weight", a + "q_b_proj.weight"))
        if cfg.flag("attention_bias"):
            m.add(rename(a + "q_a_proj.bias", a + "q_a_proj.bias"))
    else:
        m.add(linear(a + "q_proj.weight", a + "q_proj.weight"))
    m.add(linear(a + "kv_a_proj_with_mqa.weight", a + "kv_a_proj_with_mqa.weight"),
          rename(a + "kv_a_layernorm.weight", a + "kv_a_layernorm.weight"),
          linear(a + "kv_b_proj.weight", a + "kv_b_proj.weight"),
          linear(a + "o_proj.weight", a + "o_proj.weight"))
    if cfg.flag("attention_bias"):
        m.add(rename(a + "kv_a_proj_with_mqa.bias", a + "kv_a_proj_with_mqa.bias"),
              rename(a + "o_proj.bias", a + "o_proj.bias"))
    mlp = layer + "mlp."
    layers = cfg.positive("num_hidden_layers")
    if cfg.count("first_k_dense_replace", 0):
        separate_mlp(m, mlp, mlp)
    if cfg.count("first_k_dense_replace", 0) < layers + cfg.count(MTP, 0):
        m.add(linear(mlp + "gate.weight", mlp + "gate.weight", float32=True),
              rename(mlp + "gate.e_score_correction_bias", mlp + "gate.e_score_correction_bias",
                     float32=True))
        separate_mlp(m, f"{mlp}experts.{EXPERT}.", f"{mlp}experts.{EXPERT}.")
        if cfg.count("n_shared_experts", 0):
            separate_mlp(m, mlp + "shared_experts.", mlp + "shared_experts.")
    if cfg.count(MTP, 0):
        m.add(rename(layer + "enorm.weight", layer + "enorm.weight"),
              rename(layer + "hnorm.weight", layer + "hnorm.weight"),
              linear(layer + "eh_proj.weight", layer + "eh_proj.weight"),
              rename(layer + "embed_tokens.weight", layer + "embed_tokens.weight"),
              rename(layer + "shared_head.norm.weight", layer + "shared_head.norm.weight"),
              rename(layer + "shared_head.head.weight", layer + "shared_head.head.weight"))
    m.splits = paddleformers.splits(cfg, mesh, embedding=paddleformers.CLASSIC_EMBEDDING,
                                    lm_head=paddleformers.CLASSIC_HEAD,
                                    experts=cfg.positive("n_routed_experts"))
    return m


def separate_mlp(m: TargetMapping, hf: str, target: str) -> None:
    for proj in ("gate_proj", "up_proj", "down_proj"):
        m.add(linear(f"{hf}{proj}.weight", f"{target}{proj}.weight"))


def without_mtp_layers(cfg: Config) -> list[str]:
    """The megatron target does not map multi-token-prediction layers: a checkpoint that
    holds them is refused (one transformers saved has none, whatever num_nextn_predict_layers
    says); with no checkpoint at hand, the notes to print."""
    mtp = cfg.count(MTP, 0)
    if mtp and cfg.present is not None:
        raise ModelError(f"{cfg.path}: the checkpoint holds {mtp} multi-token-prediction "
                         "layer(s), which --to megatron does not write",
                         hint="Convert the model without them (drop their tensors), or with "
                              "--to paddleformers.")
    return [f"the {mtp} multi-token-prediction layer(s) of {MTP} are not mapped"] if mtp \
        else []


def megatron_decoder(cfg: Config) -> megatron.Decoder:
    notes = without_mtp_layers(cfg)
    layers = cfg.positive("num_hidden_layers")
    dense = cfg.count("first_k_dense_replace", 0)
    return megatron.Decoder(sparse=[layer >= dense for layer in range(layers)],
                            experts=cfg.positive("n_routed_experts"),
                            shared_expert="shared_experts." if cfg.count("n_shared_experts", 0)
                            else None,
                            expert_bias="gate.e_score_correction_bias", latent_attention=True,
                            notes=notes)


FAMILY = Family("deepseek_v3", ("deepseek_v3",), tensors,
                {"paddleformers": to_paddleformers,
                 "megatron": megatron.target(megatron_decoder)},
                "DeepSeek-V3: latent attention, shared and routed experts, MTP layers")
