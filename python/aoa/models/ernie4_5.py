"""ERNIE-4.5 (dense): grouped-query attention, a gated MLP, embeddings tied by default; the
Llama shape under ERNIE's names.

paddleformers: PaddleFormers' Ernie4_5ForCausalLM fuses q, k, v into qkv_proj grouped by
key/value head and gate and up per rank into up_gate_proj, every linear weight transposed to
[in, out]; the embedding and the head are split by vocabulary, and a tied model gets lm_head
as a copy of the embedding (the way back drops it).

`use_bias` is refused: PaddleFormers 1.2.0 then gives its RMS norms a bias that Hugging
Face's model does not have, and its statements carry only the q/k/v biases, so neither way
would give a whole checkpoint.
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
    TargetMapping,
    Tensors,
)

#: ERNIE-4.5's config.json ties the embeddings unless it says otherwise.
TIED = True


def tensors(cfg: Config) -> dict[str, Expected]:
    t = Tensors(cfg)
    decoder.embeddings(t, cfg)
    bias = cfg.flag("use_bias")
    for layer in range(cfg.positive("num_hidden_layers")):
        prefix = f"model.layers.{layer}."
        decoder.attention(t, cfg, prefix + "self_attn.", qkv_bias=bias, o_bias=bias)
        decoder.mlp(t, cfg, prefix + "mlp.", bias=bias)
        decoder.norms(t, cfg, prefix)
    decoder.head(t, cfg, tied_default=TIED)
    return t.expected


def no_biases(cfg: Config) -> None:
    if cfg.flag("use_bias"):
        raise ModelError(f"{cfg.path}: use_bias is true; aoa maps ERNIE-4.5 to paddleformers "
                         "only without biases",
                         hint="PaddleFormers 1.2.0 gives ERNIE-4.5's norms a bias under "
                              "use_bias that Hugging Face's model lacks, so no mapping "
                              "gives a whole checkpoint either way.")


def norms_and_attention(m: TargetMapping, cfg: Config, layer: str) -> None:
    """The two norms and the fused attention of ``layer`` (`model.layers.$LAYER_ID.`)."""
    paddleformers.layer_norms(m, layer, layer)
    paddleformers.fused_attention(m, cfg, layer, layer, qkv_bias=False)


def to_paddleformers(cfg: Config, mesh: Mesh) -> TargetMapping:
    no_biases(cfg)
    paddleformers.check_heads(cfg, mesh)
    paddleformers.no_expert_parallel(cfg, mesh)
    m = TargetMapping()
    layer = f"model.layers.{LAYER}."
    paddleformers.embedding_and_head(m, cfg, embedding=paddleformers.CLASSIC_EMBEDDING,
                                     head=paddleformers.CLASSIC_HEAD, tied_default=TIED)
    norms_and_attention(m, cfg, layer)
    paddleformers.fused_mlp(m, layer + "mlp.", layer + "mlp.")
    m.splits = paddleformers.splits(cfg, mesh, embedding=paddleformers.CLASSIC_EMBEDDING,
                                    lm_head=paddleformers.CLASSIC_HEAD)
    return m


FAMILY = Family("ernie4_5", ("ernie4_5",), tensors, {"paddleformers": to_paddleformers},
                "ERNIE-4.5: grouped-query attention, gated MLP, tied embeddings")
