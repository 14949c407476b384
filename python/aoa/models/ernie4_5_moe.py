"""ERNIE-4.5-MoE: ERNIE-4.5's attention, dense layers before `moe_layer_start_index` (and
off `moe_layer_interval`), then sparse layers of routed experts with a router, its
correction bias (`moe_statics`) and `moe_num_shared_experts` shared experts fused into one;
`num_nextn_predict_layers` multi-token-prediction blocks beside the layers (transformers
does not save them; a checkpoint without them converts without, with a note).

paddleformers: PaddleFormers' Ernie4_5_MoeForCausalLM: attention and dense MLPs as
ERNIE-4.5's; the router transposed to [hidden, experts] and kept in float32 with its
correction bias; each expert's gate and up in up_gate_proj (whole, never split by tensor
parallelism), the shared experts' fused per rank. An MTP block is a dense decoder layer
under `model.mtp_block.N.` with its two norms and its [2 * hidden, hidden] linear_proj
beside it, all on the last pipeline stage.

`use_bias` is refused, as for ERNIE-4.5; so is an MTP block that would be sparse (its layer
number among the sparse ones): PaddleFormers 1.2.0 maps it as a dense layer.
"""

from __future__ import annotations

from aoa.models import decoder, paddleformers
from aoa.models.base import (
    EXPERT,
    LAST,
    LAYER,
    Config,
    Expected,
    Family,
    Mesh,
    ModelError,
    Split,
    TargetMapping,
    Tensors,
    dim,
    linear,
    rename,
)
from aoa.models.ernie4_5 import TIED, no_biases, norms_and_attention

MTP = "num_nextn_predict_layers"
EXPERTS = "moe_num_experts"
SHARED = "moe_num_shared_experts"


def sparse_layers(cfg: Config) -> list[bool]:
    """Which decoder layers hold experts, as transformers' Ernie4_5_MoeDecoderLayer decides:
    every `moe_layer_interval`-th from `moe_layer_start_index` to `moe_layer_end_index`
    (-1: the last layer)."""
    layers = cfg.positive("num_hidden_layers")
    start = cfg.count("moe_layer_start_index", 0)
    end = cfg.data.get("moe_layer_end_index", -1)
    end = layers - 1 if end in (-1, None) else cfg.count("moe_layer_end_index")
    interval = cfg.positive("moe_layer_interval", 1)
    return [(i + 1) % interval == 0 and start <= i <= end for i in range(layers)]


def tensors(cfg: Config) -> dict[str, Expected]:
    t = Tensors(cfg)
    decoder.embeddings(t, cfg)
    hidden = dim(cfg.positive("hidden_size"), "hidden_size")
    bias = cfg.flag("use_bias")
    for layer, sparse in enumerate(sparse_layers(cfg)):
        prefix = f"model.layers.{layer}."
        decoder.attention(t, cfg, prefix + "self_attn.", qkv_bias=bias, o_bias=bias)
        if sparse:
            experts = dim(cfg.positive(EXPERTS), EXPERTS)
            t.add(prefix + "mlp.gate.weight", experts, hidden)
            t.add(prefix + "mlp.moe_statics.e_score_correction_bias", dim(1, "1"), experts)
            for expert in range(experts.size):
                decoder.mlp(t, cfg, f"{prefix}mlp.experts.{expert}.", "moe_intermediate_size",
                            bias=bias)
            shared = cfg.count(SHARED, 0)
            if shared:
                decoder.mlp(t, cfg, prefix + "mlp.shared_experts.",
                            f"moe_intermediate_size * {SHARED}",
                            size=cfg.positive("moe_intermediate_size") * shared, bias=bias)
        else:
            decoder.mlp(t, cfg, prefix + "mlp.", bias=bias)
        decoder.norms(t, cfg, prefix)
    t.group = MTP
    for block in range(cfg.count(MTP, 0)):
        prefix = f"model.mtp_block.{block}."
        decoder.attention(t, cfg, prefix + "self_attn.", qkv_bias=bias, o_bias=bias)
        decoder.mlp(t, cfg, prefix + "mlp.", bias=bias)
        decoder.norms(t, cfg, prefix)
        t.add(f"model.mtp_emb_norm.{block}.weight", hidden)
        t.add(f"model.mtp_hidden_norm.{block}.weight", hidden)
        t.add(f"model.mtp_linear_proj.{block}.weight", hidden,
              dim(2 * hidden.size, "2 * hidden_size"))
    t.group = None
    decoder.head(t, cfg, tied_default=TIED)
    return t.expected


def to_paddleformers(cfg: Config, mesh: Mesh) -> TargetMapping:
    no_biases(cfg)
    paddleformers.check_heads(cfg, mesh)
    sparse = sparse_layers(cfg)
    blocks = cfg.count(MTP, 0)
    if any(sparse[:blocks]) or blocks > len(sparse):
        raise ModelError(f"{cfg.path}: {MTP} is {blocks}, and an MTP block numbered among the "
                         "sparse layers would hold experts",
                         hint="PaddleFormers 1.2.0 maps every MTP block as a dense layer; "
                              "aoa maps those only.")
    m = TargetMapping()
    layer = f"model.layers.{LAYER}."
    paddleformers.embedding_and_head(m, cfg, embedding=paddleformers.CLASSIC_EMBEDDING,
                                     head=paddleformers.CLASSIC_HEAD, tied_default=TIED)
    norms_and_attention(m, cfg, layer)
    if not all(sparse):
        paddleformers.fused_mlp(m, layer + "mlp.", layer + "mlp.")
    experts = cfg.positive(EXPERTS) if any(sparse) else 0
    if experts:
        mlp = layer + "mlp."
        m.add(linear(mlp + "gate.weight", mlp + "gate.weight", float32=True),
              rename(mlp + "moe_statics.e_score_correction_bias",
                     mlp + "moe_statics.e_score_correction_bias", float32=True))
        paddleformers.experts(m, f"{mlp}experts.{EXPERT}.", f"{mlp}experts.{EXPERT}.")
        if cfg.count(SHARED, 0):
            paddleformers.fused_mlp(m, mlp + "shared_experts.", mlp + "shared_experts.")
    extra: list[Split] = []
    if blocks:
        block = f"model.mtp_block.{LAYER}."
        norms_and_attention(m, cfg, block)
        paddleformers.fused_mlp(m, block + "mlp.", block + "mlp.")
        for name in ("mtp_emb_norm", "mtp_hidden_norm"):
            m.add(rename(f"model.{name}.{LAYER}.weight", f"model.{name}.{LAYER}.weight"))
        m.add(linear(f"model.mtp_linear_proj.{LAYER}.weight",
                     f"model.mtp_linear_proj.{LAYER}.weight"))
        # the block's projections split as a layer's are; everything of MTP on the last stage
        extra = [Split(f"model.mtp_block.*.{name}.weight", tp=axis, pp=LAST)
                 for names, axis in ((paddleformers.COLUMN, 1), (paddleformers.ROW, 0))
                 for name in names]
    m.splits = paddleformers.splits(cfg, mesh, embedding=paddleformers.CLASSIC_EMBEDDING,
                                    lm_head=paddleformers.CLASSIC_HEAD, experts=experts,
                                    extra=tuple(extra))
    if not experts:
        paddleformers.no_expert_parallel(cfg, mesh)
    return m


FAMILY = Family("ernie4_5_moe", ("ernie4_5_moe",), tensors,
                {"paddleformers": to_paddleformers},
                "ERNIE-4.5-MoE: routed and shared experts, dense first layers, MTP blocks")
