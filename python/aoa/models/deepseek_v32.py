"""DeepSeek-V3.2: DeepSeek-V3 (latent attention through q_a/q_b, dense first layers, routed
experts with a bias-corrected router and shared experts, MTP layers after the last decoder
layer) plus, in every layer's attention, the indexer of its sparse attention (wq_b, wk, a
LayerNorm k_norm with a bias, weights_proj).

paddleformers: PaddleFormers 1.2.0 builds DeepSeek-V3.2 with PaddleFleet, unlike V3: the
PaddleFleet names of the embedding and the head, gate and up fused per rank in the dense
and shared MLPs, each expert's side by side (whole), the router kept in float32 untransposed
with its correction bias as it is, the indexer under `self_attn.core_attention.indexer.`,
an MTP layer's decoder under `transformer_layer.` with its shared_head.norm as `norm`.
Every linear weight is transposed. PaddleFormers' statements also cast every norm to
bfloat16 (and back to float32 on its way back); aoa keeps each norm's dtype, bfloat16 in
DeepSeek's release, so the way back is exact (pass --dtype bfloat16 for an all-bfloat16
target from another dtype).
"""

from __future__ import annotations

from aoa.models import decoder, deepseek_v3, paddleformers
from aoa.models.base import (
    EXPERT,
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
from aoa.models.glm4_moe import MTP, fleet_mtp, mtp_tensors

INDEXER = "self_attn.indexer."


def sparse_layers(cfg: Config) -> list[bool]:
    """Which decoder layers hold experts: `mlp_layer_types` where the config lists them,
    else every layer from `first_k_dense_replace` on (MTP layers hold experts too)."""
    layers = cfg.positive("num_hidden_layers")
    types = cfg.data.get("mlp_layer_types")
    if types is None:
        dense = cfg.count("first_k_dense_replace", 0)
        return [layer >= dense for layer in range(layers + cfg.count(MTP, 0))]
    if not isinstance(types, list) or len(types) != layers or \
            not set(types) <= {"dense", "sparse"}:
        raise ModelError(f"{cfg.path}: 'mlp_layer_types' is {types!r}; a list of \"dense\" or "
                         f"\"sparse\", one for each of the {layers} layers, is needed")
    return [kind == "sparse" for kind in types] + [True] * cfg.count(MTP, 0)


def tensors(cfg: Config) -> dict[str, Expected]:
    t = Tensors(cfg)
    decoder.embeddings(t, cfg)
    layers = cfg.positive("num_hidden_layers")
    hidden = dim(cfg.positive("hidden_size"), "hidden_size")
    q_rank = dim(cfg.positive("q_lora_rank"), "q_lora_rank")
    index_heads = cfg.positive("index_n_heads")
    index_dim = dim(cfg.positive("index_head_dim"), "index_head_dim")
    for layer, sparse in enumerate(sparse_layers(cfg)):
        prefix = f"model.layers.{layer}."
        t.group = MTP if layer >= layers else None
        deepseek_v3.attention(t, cfg, prefix + "self_attn.")
        t.add(prefix + INDEXER + "wq_b.weight",
              dim(index_heads * index_dim.size, "index_n_heads * index_head_dim"), q_rank)
        t.add(prefix + INDEXER + "wk.weight", index_dim, hidden)
        t.add(prefix + INDEXER + "k_norm.weight", index_dim)
        t.add(prefix + INDEXER + "k_norm.bias", index_dim)
        t.add(prefix + INDEXER + "weights_proj.weight", dim(index_heads, "index_n_heads"),
              hidden)
        if sparse:
            deepseek_v3.routed_experts(t, cfg, prefix + "mlp.")
        else:
            decoder.mlp(t, cfg, prefix + "mlp.")
        decoder.norms(t, cfg, prefix)
        if layer >= layers:
            mtp_tensors(t, cfg, prefix)
    t.group = None
    decoder.head(t, cfg)
    return t.expected


def to_paddleformers(cfg: Config, mesh: Mesh) -> TargetMapping:
    heads = cfg.positive("num_attention_heads")
    paddleformers.check_heads(cfg, mesh, heads=heads, kv_heads=heads)
    if cfg.flag("attention_bias"):
        raise ModelError(f"{cfg.path}: attention_bias is true; PaddleFormers 1.2.0 maps no "
                         "attention bias of DeepSeek-V3.2",
                         hint="DeepSeek's release has none; check the config.")
    m = TargetMapping()
    paddleformers.embedding_and_head(m, cfg, embedding=paddleformers.FLEET_EMBEDDING,
                                     head=paddleformers.FLEET_HEAD)
    layers = cfg.positive("num_hidden_layers")
    for layer, sparse in enumerate(sparse_layers(cfg)):
        hf = f"model.layers.{layer}."
        target = hf + ("transformer_layer." if layer >= layers else "")
        decoder_layer(m, hf, target, sparse=sparse, shared=cfg.count("n_shared_experts", 0) > 0,
                      indexer=True)
        if layer >= layers:
            fleet_mtp(m, cfg, hf)
    m.splits = paddleformers.splits(cfg, mesh, embedding=paddleformers.FLEET_EMBEDDING,
                                    lm_head=paddleformers.FLEET_HEAD,
                                    experts=cfg.positive("n_routed_experts"))
    return m


def decoder_layer(m: TargetMapping, hf: str, target: str, *, sparse: bool, shared: bool,
                  indexer: bool, bias_float32: bool = False) -> None:
    """One PaddleFleet layer: norms, latent attention (with V3.2's indexer), and its MLP or
    experts; ``bias_float32``: the router's correction bias kept in float32 as well."""
    paddleformers.layer_norms(m, hf, target)
    a, b = hf + "self_attn.", target + "self_attn."
    for proj in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
        m.add(linear(f"{a}{proj}.weight", f"{b}{proj}.weight"))
    for norm in ("q_a_layernorm", "kv_a_layernorm"):
        m.add(rename(f"{a}{norm}.weight", f"{b}{norm}.weight"))
    if indexer:
        i, j = hf + INDEXER, target + "self_attn.core_attention.indexer."
        for proj in ("wq_b", "wk", "weights_proj"):
            m.add(linear(f"{i}{proj}.weight", f"{j}{proj}.weight"))
        m.add(rename(i + "k_norm.weight", j + "k_norm.weight"),
              rename(i + "k_norm.bias", j + "k_norm.bias"))
    if sparse:
        a, b = hf + "mlp.", target + "mlp."
        m.add(rename(a + "gate.weight", b + "gate.weight", float32=True),
              rename(a + "gate.e_score_correction_bias", b + "gate.e_score_correction_bias",
                     float32=bias_float32))
        if shared:
            paddleformers.fused_mlp(m, a + "shared_experts.", b + "shared_experts.")
        paddleformers.experts(m, f"{a}experts.{EXPERT}.", f"{b}experts.{EXPERT}.")
    else:
        paddleformers.fused_mlp(m, hf + "mlp.", target + "mlp.")


FAMILY = Family("deepseek_v32", ("deepseek_v32",), tensors,
                {"paddleformers": to_paddleformers},
                "DeepSeek-V3.2: DeepSeek-V3 with the indexer of its sparse attention")
