"""GPT-OSS: grouped-query attention with biases and per-head attention sinks, sliding and
full attention layers, routed experts stored as one tensor per kind for all experts
(gate_up_proj [experts, hidden, 2 * intermediate] with gate and up interleaved, down_proj
[experts, intermediate, hidden], and their biases), a router with a bias.

paddleformers: PaddleFormers' GptOssForCausalLM keeps the expert tensors, the router and the
sinks as they are and transposes the attention weights. It keeps every expert on every rank,
so it takes no expert parallelism. Its attention holds the sinks of its own heads only; they
are split like the heads.
"""

from __future__ import annotations

from aoa.models import decoder, paddleformers
from aoa.models.base import (
    LAYER,
    Config,
    Expected,
    Family,
    Mesh,
    ModelError,
    Split,
    TargetMapping,
    Tensors,
    by_layer,
    dim,
    linear,
    rename,
)

EXPERT_TENSORS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


def tensors(cfg: Config) -> dict[str, Expected]:
    t = Tensors(cfg)
    decoder.embeddings(t, cfg)
    hidden = dim(cfg.positive("hidden_size"), "hidden_size")
    experts = dim(cfg.positive("num_local_experts"), "num_local_experts")
    inner = cfg.positive("intermediate_size")
    for layer in range(cfg.positive("num_hidden_layers")):
        prefix = f"model.layers.{layer}."
        decoder.attention(t, cfg, prefix + "self_attn.", qkv_bias=True, o_bias=True)
        t.add(prefix + "self_attn.sinks", dim(cfg.positive("num_attention_heads"),
                                              "num_attention_heads"))
        t.add(prefix + "mlp.router.weight", experts, hidden)
        t.add(prefix + "mlp.router.bias", experts)
        e = prefix + "mlp.experts."
        t.add(e + "gate_up_proj", experts, hidden, dim(2 * inner, "2 * intermediate_size"))
        t.add(e + "gate_up_proj_bias", experts, dim(2 * inner, "2 * intermediate_size"))
        t.add(e + "down_proj", experts, dim(inner, "intermediate_size"), hidden)
        t.add(e + "down_proj_bias", experts, hidden)
        decoder.norms(t, cfg, prefix)
    decoder.head(t, cfg)
    return t.expected


def to_paddleformers(cfg: Config, mesh: Mesh) -> TargetMapping:
    paddleformers.check_heads(cfg, mesh)
    if mesh.ep > 1:
        raise ModelError(f"--ep {mesh.ep}: PaddleFormers' GPT-OSS keeps every expert on every "
                         "rank (one tensor for all experts); it takes no expert parallelism")
    m = TargetMapping()
    layer = f"model.layers.{LAYER}."
    a = layer + "self_attn."
    paddleformers.embedding_and_head(m, cfg, embedding=paddleformers.CLASSIC_EMBEDDING,
                                     head=paddleformers.CLASSIC_HEAD)
    paddleformers.layer_norms(m, layer, layer)
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        m.add(linear(f"{a}{proj}.weight", f"{a}{proj}.weight"),
              rename(f"{a}{proj}.bias", f"{a}{proj}.bias"))
    m.add(rename(a + "sinks", a + "sinks"),
          rename(layer + "mlp.router.weight", layer + "mlp.router.weight"),
          rename(layer + "mlp.router.bias", layer + "mlp.router.bias"))
    for name in EXPERT_TENSORS:
        m.add(rename(f"{layer}mlp.experts.{name}", f"{layer}mlp.experts.{name}"))
    m.splits = paddleformers.splits(
        cfg, mesh, embedding=paddleformers.CLASSIC_EMBEDDING, lm_head=paddleformers.CLASSIC_HEAD,
        extra=(Split("model.layers.*.self_attn.sinks", tp=0,
                     pp=by_layer(cfg.positive("num_hidden_layers"))),))
    return m


FAMILY = Family("gpt_oss", ("gpt_oss",), tensors, {"paddleformers": to_paddleformers},
                "GPT-OSS: attention sinks, experts in one tensor")
