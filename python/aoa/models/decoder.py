"""The tensors of a standard decoder-only checkpoint in Hugging Face names, shared by the
families: embeddings, attention (grouped-query, optional biases and q/k norms), dense MLPs,
norms and the head. Each dimension says which config.json field it comes from, so a
checkpoint that does not fit its config is reported in the config's words."""

from __future__ import annotations

from aoa.models.base import Config, Tensors, dim


def embeddings(t: Tensors, cfg: Config) -> None:
    t.add("model.embed_tokens.weight", dim(cfg.positive("vocab_size"), "vocab_size"),
          dim(cfg.positive("hidden_size"), "hidden_size"))


def head(t: Tensors, cfg: Config, *, tied_default: bool = False) -> None:
    """The final norm and, unless the embeddings are tied, lm_head."""
    hidden = dim(cfg.positive("hidden_size"), "hidden_size")
    t.add("model.norm.weight", hidden)
    if not cfg.flag("tie_word_embeddings", tied_default):
        t.add("lm_head.weight", dim(cfg.positive("vocab_size"), "vocab_size"), hidden)


def attention(t: Tensors, cfg: Config, prefix: str, *, qkv_bias: bool, o_bias: bool,
              qk_norm: bool = False) -> None:
    """q/k/v/o projections of ``prefix`` (``model.layers.N.self_attn.``)."""
    heads, kv, head_dim = cfg.positive("num_attention_heads"), cfg.kv_heads(), cfg.head_dim()
    hidden = dim(cfg.positive("hidden_size"), "hidden_size")
    q_out = dim(heads * head_dim, "num_attention_heads * head_dim")
    kv_out = dim(kv * head_dim, "num_key_value_heads * head_dim")
    t.add(prefix + "q_proj.weight", q_out, hidden)
    t.add(prefix + "k_proj.weight", kv_out, hidden)
    t.add(prefix + "v_proj.weight", kv_out, hidden)
    if qkv_bias:
        t.add(prefix + "q_proj.bias", q_out)
        t.add(prefix + "k_proj.bias", kv_out)
        t.add(prefix + "v_proj.bias", kv_out)
    t.add(prefix + "o_proj.weight", hidden, q_out)
    if o_bias:
        t.add(prefix + "o_proj.bias", hidden)
    if qk_norm:
        t.add(prefix + "q_norm.weight", dim(head_dim, "head_dim"))
        t.add(prefix + "k_norm.weight", dim(head_dim, "head_dim"))


def mlp(t: Tensors, cfg: Config, prefix: str, size_field: str = "intermediate_size", *,
        size: int | None = None, bias: bool = False, names: tuple[str, str, str] = (
            "gate_proj", "up_proj", "down_proj")) -> None:
    """A gated MLP (``prefix`` ends with a dot): gate and up [I, hidden], down [hidden, I]."""
    hidden = dim(cfg.positive("hidden_size"), "hidden_size")
    inner = dim(cfg.positive(size_field) if size is None else size, size_field)
    gate, up, down = names
    t.add(prefix + gate + ".weight", inner, hidden)
    t.add(prefix + up + ".weight", inner, hidden)
    t.add(prefix + down + ".weight", hidden, inner)
    if bias:
        t.add(prefix + gate + ".bias", inner)
        t.add(prefix + up + ".bias", inner)
        t.add(prefix + down + ".bias", hidden)


def norms(t: Tensors, cfg: Config, prefix: str,
          names: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")) -> None:
    hidden = dim(cfg.positive("hidden_size"), "hidden_size")
    for name in names:
        t.add(f"{prefix}{name}.weight", hidden)
