"""Conventions of the `paddleformers` target that the families share: how PaddleFormers 1.2.0
lays its parameters out under tensor, expert and pipeline parallelism, and what it refuses.

Read from PaddleFormers' sources (its `_gen_aoa_config` statements, `GeneralLinear`'s
`tp_plan`, `VocabParallelEmbedding`, `LMHead`): Paddle linear weights are [in, out];
column-parallel ones (q/k/v, fused qkv, gate/up) split the output axis (1) and their biases
axis 0; row-parallel ones (o_proj, down_proj) split the input axis (0) and keep their bias
whole; the embedding and the head split the vocabulary (axis 0); norms and routers are
whole on every rank. Experts are whole tensors placed by expert number on the expert-parallel
ranks (PaddleFormers concatenates an expert's gate and up plainly, so it never splits one);
decoder layers are placed on pipeline stages as Paddle segments them, the embedding on the
first stage and the final norm and head on the last.
"""

from __future__ import annotations

from aoa.models.base import (
    FIRST,
    LAST,
    Config,
    Mesh,
    ModelError,
    Split,
    Step,
    TargetMapping,
    by_expert,
    by_layer,
    concat_linears,
    fused_ffn,
    fused_qkv,
    linear,
    rename,
)

#: Column-parallel projections (weights split axis 1, biases axis 0).
COLUMN = ("q_proj", "k_proj", "v_proj", "qkv_proj", "gate_proj", "up_proj", "up_gate_proj",
          "gate_up_proj", "q_b_proj", "kv_b_proj")
#: Row-parallel projections (weights split axis 0, biases whole).
ROW = ("o_proj", "down_proj")


def splits(cfg: Config, mesh: Mesh, *, embedding: str, lm_head: str, experts: int = 0,
           vocab_parallel: bool = True, extra: tuple[Split, ...] = ()) -> list[Split]:
    """The layout rules of a PaddleFormers model, first match first."""
    layers = by_layer(cfg.positive("num_hidden_layers"))
    rules: list[Split] = list(extra)
    if experts:
        if mesh.ep > 1 and experts % mesh.ep:
            raise ModelError(f"--ep {mesh.ep} does not divide the {experts} experts")
        rules.append(Split("model.layers.*.experts.*", ep=by_expert(experts), pp=layers))
    for name in COLUMN:
        rules.append(Split(f"model.layers.*.{name}.weight", tp=1, pp=layers))
        rules.append(Split(f"model.layers.*.{name}.bias", tp=0, pp=layers))
    for name in ROW:
        rules.append(Split(f"model.layers.*.{name}.weight", tp=0, pp=layers))
    rules.append(Split("model.layers.*", pp=layers))
    rules.append(Split(embedding, tp=0 if vocab_parallel else None, pp=FIRST))
    rules.append(Split(lm_head, tp=0, pp=LAST))
    rules.append(Split("*", pp=LAST))  # the final norm
    return rules


def check_heads(cfg: Config, mesh: Mesh, *, heads: int | None = None,
                kv_heads: int | None = None) -> None:
    """PaddleFormers gives each tensor-parallel rank whole query heads and whole key/value
    heads (a fused qkv split elsewhere would cut a group in two)."""
    heads = cfg.positive("num_attention_heads") if heads is None else heads
    kv_heads = cfg.kv_heads() if kv_heads is None else kv_heads
    for count, name in ((heads, "num_attention_heads"), (kv_heads, "num_key_value_heads")):
        if count % mesh.tp:
            raise ModelError(f"--tp {mesh.tp} does not divide {name} {count} of {cfg.path}",
                             hint="PaddleFormers gives every tensor-parallel rank whole "
                                  "heads; choose a degree that divides both head counts.")


def no_expert_parallel(cfg: Config, mesh: Mesh) -> None:
    if mesh.ep > 1:
        raise ModelError(f"--ep {mesh.ep}: {cfg.model_type} has no experts to place")


# --- statements the families share ---------------------------------------------------------

#: Names of PaddleFormers' PaddleFleet-built models (Qwen2/3, their MoEs, GLM-4-MoE).
FLEET_EMBEDDING = "model.embedding.embed_tokens.weight"
FLEET_HEAD = "model.lm_head.weight"
#: Names of PaddleFormers' own model classes (Llama, DeepSeek-V3, GPT-OSS, Gemma 3, Phi-3).
CLASSIC_EMBEDDING = "model.embed_tokens.weight"
CLASSIC_HEAD = "lm_head.weight"


def tied_copy(embedding: str, target: str) -> Step:
    """The head as a copy of the tied embedding; the way back drops it (Hugging Face keeps
    only the embedding)."""
    return Step((f"{embedding} -> {target}",), (f"{target} -> _",), (embedding,), (target,))


def embedding_and_head(m: TargetMapping, cfg: Config, *, embedding: str, head: str,
                       tied_default: bool = False) -> None:
    # The copy reads the embedding before it is renamed: a name read again after `a -> a`
    # would be an intermediate, not an output.
    if cfg.flag("tie_word_embeddings", tied_default):
        m.add(tied_copy("model.embed_tokens.weight", head))
    else:
        m.add(rename("lm_head.weight", head))
    m.add(rename("model.embed_tokens.weight", embedding),
          rename("model.norm.weight", "model.norm.weight"))


def fused_attention(m: TargetMapping, cfg: Config, hf: str, target: str, *, qkv_bias: bool,
                    o_bias: bool = False, qk_norm: tuple[str, str] | None = None) -> None:
    """q/k/v fused into qkv_proj grouped by key/value head, o_proj transposed; ``qk_norm``:
    the target names of q_norm and k_norm."""
    heads, kv = cfg.positive("num_attention_heads"), cfg.kv_heads()
    a, b = hf + "self_attn.", target + "self_attn."
    m.add(fused_qkv(f"{a}q_proj.weight", f"{a}k_proj.weight", f"{a}v_proj.weight",
                    f"{b}qkv_proj.weight", heads, kv))
    if qkv_bias:
        m.add(fused_qkv(f"{a}q_proj.bias", f"{a}k_proj.bias", f"{a}v_proj.bias",
                        f"{b}qkv_proj.bias", heads, kv, bias=True))
    m.add(linear(f"{a}o_proj.weight", f"{b}o_proj.weight"))
    if o_bias:
        m.add(rename(f"{a}o_proj.bias", f"{b}o_proj.bias"))
    if qk_norm:
        m.add(rename(f"{a}q_norm.weight", f"{b}{qk_norm[0]}.weight"),
              rename(f"{a}k_norm.weight", f"{b}{qk_norm[1]}.weight"))


def layer_norms(m: TargetMapping, hf: str, target: str,
                names: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")
                ) -> None:
    for name in names:
        m.add(rename(f"{hf}{name}.weight", f"{target}{name}.weight"))


def fused_mlp(m: TargetMapping, hf: str, target: str, *, names: tuple[str, str, str] = (
        "gate_proj", "up_proj", "down_proj")) -> None:
    """A dense MLP: gate and up fused per rank into up_gate_proj, down transposed."""
    gate, up, down = names
    m.add(fused_ffn(f"{hf}{gate}.weight", f"{hf}{up}.weight", f"{target}up_gate_proj.weight"),
          linear(f"{hf}{down}.weight", f"{target}down_proj.weight"))


def experts(m: TargetMapping, hf: str, target: str, *, names: tuple[str, str, str] = (
        "gate_proj", "up_proj", "down_proj")) -> None:
    """Routed experts (``hf`` ends with `experts.$EXPERT_ID.`): gate and up side by side in
    up_gate_proj (whole, never split), down transposed."""
    gate, up, down = names
    m.add(concat_linears((f"{hf}{gate}.weight", f"{hf}{up}.weight"),
                         f"{target}up_gate_proj.weight"),
          linear(f"{hf}{down}.weight", f"{target}down_proj.weight"))
