"""Tiny random models of every family, built with transformers' own classes, and the round
trip the model library promises: Hugging Face -> paddleformers -> Hugging Face."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

from aoa.cli import main

# torch and transformers are imported where they are used: collecting the slow tests that
# need them stays cheap for the default suite.

#: Attention every family shares: 8 query heads, 4 key/value heads of 4 (TP 4 divides both).
ATTENTION = dict(vocab_size=128, hidden_size=32, num_attention_heads=8, num_key_value_heads=4,
                 head_dim=4, intermediate_size=64, num_hidden_layers=2)
MOE = dict(moe_intermediate_size=16)

#: Qwen3-Next: linear attention, then full attention every second layer; a shared expert.
QWEN3_NEXT = dict(full_attention_interval=2, num_experts=4, num_experts_per_tok=2,
                  shared_expert_intermediate_size=32, linear_num_key_heads=2,
                  linear_num_value_heads=4, linear_key_head_dim=4, linear_value_head_dim=4,
                  linear_conv_kernel_dim=4, **MOE)

#: name -> (config class, model class, config arguments, expert count for EP)
MODELS: dict[str, tuple[str, str, dict, int]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}, 0),
    "llama_tied_biases": ("LlamaConfig", "LlamaForCausalLM",
                          dict(tie_word_embeddings=True, attention_bias=True, mlp_bias=True), 0),
    "mistral_sliding": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8), 0),
    "qwen2_tied": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True), 0),
    "qwen2_sliding": ("Qwen2Config", "Qwen2ForCausalLM",
                      dict(use_sliding_window=True, sliding_window=8, max_window_layers=1), 0),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}, 0),
    "qwen3_biases_tied": ("Qwen3Config", "Qwen3ForCausalLM",
                          dict(attention_bias=True, tie_word_embeddings=True), 0),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size=32,
                       **MOE), 4),
    "qwen2_moe_dense_layer": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                              dict(num_experts=4, num_experts_per_tok=2, mlp_only_layers=[0],
                                   shared_expert_intermediate_size=32, qkv_bias=False, **MOE),
                              4),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=4, num_experts_per_tok=2, **MOE), 4),
    "qwen3_moe_sparse_step": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                              dict(num_experts=4, num_experts_per_tok=2, decoder_sparse_step=2,
                                   **MOE), 4),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(num_local_experts=4, num_experts_per_tok=2), 4),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=4,
                         n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
                         q_lora_rank=16, kv_lora_rank=8, qk_rope_head_dim=4,
                         qk_nope_head_dim=4, v_head_dim=4, num_key_value_heads=8, **MOE), 4),
    "deepseek_v3_no_q_lora": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                              dict(num_hidden_layers=2, first_k_dense_replace=1,
                                   n_routed_experts=4, n_shared_experts=2, num_experts_per_tok=2,
                                   n_group=1, topk_group=1, q_lora_rank=None, kv_lora_rank=8,
                                   qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4,
                                   attention_bias=True, num_key_value_heads=8, **MOE), 4),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM",
                 dict(num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=4,
                      n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
                      use_qk_norm=True, **MOE), 4),
    "glm4_moe_biases": ("Glm4MoeConfig", "Glm4MoeForCausalLM",
                        dict(first_k_dense_replace=0, n_routed_experts=4, n_shared_experts=1,
                             num_experts_per_tok=2, n_group=1, topk_group=1,
                             attention_bias=True, tie_word_embeddings=True, **MOE), 4),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(num_local_experts=4, num_experts_per_tok=2), 0),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", {}, 0),
    "gemma3_text_untied_biases": ("Gemma3TextConfig", "Gemma3ForCausalLM",
                                  dict(tie_word_embeddings=False, attention_bias=True), 0),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(pad_token_id=0), 0),
    "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM",
                     dict(num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=4,
                          n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
                          q_lora_rank=16, kv_lora_rank=8, qk_rope_head_dim=4,
                          qk_nope_head_dim=4, v_head_dim=4, num_key_value_heads=8,
                          index_n_heads=2, index_head_dim=8, index_topk=4, **MOE), 4),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                   dict(QWEN3_NEXT, num_hidden_layers=4), 4),
    "qwen3_next_dense_tied": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                              dict(QWEN3_NEXT, mlp_only_layers=[0], tie_word_embeddings=True),
                              4),
    "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM", {}, 0),
    "ernie4_5_untied": ("Ernie4_5Config", "Ernie4_5ForCausalLM",
                        dict(tie_word_embeddings=False), 0),
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM",
                     dict(num_hidden_layers=3, moe_num_experts=4, moe_k=2,
                          moe_num_shared_experts=1, moe_layer_start_index=1, **MOE), 4),
    "ernie4_5_moe_interval_untied": ("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM",
                                     dict(num_hidden_layers=4, moe_num_experts=4, moe_k=2,
                                          moe_num_shared_experts=0, moe_layer_start_index=0,
                                          moe_layer_interval=2, tie_word_embeddings=False,
                                          **MOE), 4),
}

IDS = [[3, 17, 42, 99, 5, 64, 8, 21, 100, 7, 1, 2]]


def build(name: str, folder: Path, dtype=None):
    """A tiny random model of ``name`` saved in ``folder``; returns it (eval mode)."""
    import torch
    import transformers

    dtype = dtype or torch.float32
    config_class, model_class, arguments, _ = MODELS[name]
    config = getattr(transformers, config_class)(**{**ATTENTION, **arguments})
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():  # make every parameter random (some start as ones or zeros)
        for parameter in model.parameters():
            parameter.copy_(torch.randn_like(parameter) * 0.5)
    model = model.to(dtype)
    model.save_pretrained(folder)
    return model


def aoa(*arguments: str) -> tuple[int, str]:
    """Run the command line; (exit status, what it printed to stderr)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        status = main([*arguments, "--quiet"] if arguments[0] == "convert" else list(arguments))
    return status, err.getvalue()


def tensors(folder: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """Every tensor of a Hugging Face folder: dtype, shape and raw bytes."""
    import torch
    from safetensors import safe_open

    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                tensor = f.get_tensor(key)
                out[key] = (str(tensor.dtype), tuple(tensor.shape),
                            tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return out


def logits(model):
    import torch

    with torch.no_grad():
        return model(torch.tensor(IDS)).logits
