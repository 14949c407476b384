"""Kimi-K2: DeepSeek-V3's architecture and tensors under its own `model_type` (Moonshot's
config.json says `kimi_k2` so that engines tell the two apart; other tools ask the user to
edit it to `deepseek_v3`).

paddleformers: PaddleFormers 1.2.0's KimiK2ForCausalLM, a PaddleFleet build like
DeepSeek-V3.2's without the indexer: the PaddleFleet names of the embedding and the head,
each latent-attention projection transposed, gate and up fused per rank in the dense and
shared MLPs, each expert's side by side (whole), the router untransposed with its
correction bias, both kept in float32. (PaddleFormers' statements fuse layer 0 alone as the
dense layer; aoa fuses each of the `first_k_dense_replace` dense layers.) It writes no
multi-token-prediction layer: a checkpoint that holds them is refused.

megatron: as DeepSeek-V3 (`aoa.models.deepseek_v3`).
"""

from __future__ import annotations

from aoa.models import deepseek_v3, paddleformers
from aoa.models.base import Config, Family, Mesh, ModelError, TargetMapping
from aoa.models.deepseek_v32 import decoder_layer
from aoa.models.glm4_moe import MTP


def to_paddleformers(cfg: Config, mesh: Mesh) -> TargetMapping:
    heads = cfg.positive("num_attention_heads")
    paddleformers.check_heads(cfg, mesh, heads=heads, kv_heads=heads)
    if cfg.count(MTP, 0):
        raise ModelError(f"{cfg.path}: {MTP} is {cfg.count(MTP, 0)}; PaddleFormers 1.2.0 "
                         "writes no multi-token-prediction layer of Kimi-K2",
                         hint="Kimi-K2's release has none; convert without them (set it to 0 "
                              "and drop their tensors).")
    if cfg.optional_count("q_lora_rank") is None or cfg.flag("attention_bias"):
        raise ModelError(f"{cfg.path}: PaddleFormers 1.2.0 maps Kimi-K2's attention through "
                         "q_a_proj and q_b_proj, without biases",
                         hint="Kimi-K2's release has a q_lora_rank and no attention bias; "
                              "check the config.")
    m = TargetMapping()
    paddleformers.embedding_and_head(m, cfg, embedding=paddleformers.FLEET_EMBEDDING,
                                     head=paddleformers.FLEET_HEAD)
    dense = cfg.count("first_k_dense_replace", 0)
    shared = cfg.count("n_shared_experts", 0) > 0
    for layer in range(cfg.positive("num_hidden_layers")):
        hf = f"model.layers.{layer}."
        decoder_layer(m, hf, hf, sparse=layer >= dense, shared=shared, indexer=False,
                      bias_float32=True)
    m.splits = paddleformers.splits(cfg, mesh, embedding=paddleformers.FLEET_EMBEDDING,
                                    lm_head=paddleformers.FLEET_HEAD,
                                    experts=cfg.positive("n_routed_experts"))
    return m


FAMILY = Family("kimi_k2", ("kimi_k2",), deepseek_v3.tensors,
                {"paddleformers": to_paddleformers,
                 "megatron": deepseek_v3.FAMILY.targets["megatron"]},
                "Kimi-K2: DeepSeek-V3's architecture under its own model_type")
