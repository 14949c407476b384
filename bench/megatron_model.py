"""Megatron-Core's side of the `--to megatron` tests: a GPTModel built from a Hugging Face
config.json, loaded from a checkpoint aoa wrote, run on a fixed input.

    /work/megatron-venv/bin/python bench/megatron_model.py JOBS.json

``JOBS.json`` is a list of ``{"config": config.json, "out": OUT.json}`` and, to load and run,
``"checkpoint": DIR``. For each, the script builds the model Megatron-Core builds for that
config with its local (non-Transformer-Engine) modules on the CPU (tensor, pipeline and
expert parallel 1; gloo) and writes to ``OUT.json`` its ``sharded_state_dict``: every
tensor's key and global shape, every sharded object's unique key (the names and shapes a
Megatron checkpoint of this model must hold). With a checkpoint it then loads it with
``dist_checkpointing.load(model.sharded_state_dict(), DIR)`` (the call Megatron-LM's loader
makes) and adds the logits on ``IDS``. One process runs every job: importing Megatron takes
most of the time.

The config translation covers the families the tests convert (Llama, Mistral, Qwen2,
Qwen3, Qwen2-MoE, Qwen3-MoE, Mixtral, DeepSeek-V3, GLM-4.5): RMSNorm, SwiGLU, rotary embeddings,
grouped-query or latent attention, q/k norms, biases, routers that normalize their top-k
(or not), sigmoid routers with an expert bias, shared experts with or without a sigmoid
gate, dense layers among sparse ones (``moe_layer_freq`` as a list).
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from torch_checkpoints import _free_port, _init, _patch_megatron_for_cpu

IDS = [[3, 17, 42, 99, 5, 64, 8, 21, 100, 7, 1, 2]]


def transformer_config(hf: dict):
    from megatron.core.transformer.transformer_config import TransformerConfig

    layers = hf["num_hidden_layers"]
    heads = hf["num_attention_heads"]
    kind = hf["model_type"]
    experts = hf.get("num_experts") or hf.get("num_local_experts") or hf.get("n_routed_experts")
    arguments = dict(
        num_layers=layers, hidden_size=hf["hidden_size"], num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads,
        kv_channels=hf.get("head_dim") or hf["hidden_size"] // heads,
        ffn_hidden_size=hf["intermediate_size"], gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, normalization="RMSNorm",
        layernorm_epsilon=hf.get("rms_norm_eps", 1e-6),
        add_bias_linear=bool(hf.get("attention_bias") or hf.get("mlp_bias")),
        add_qkv_bias=(kind in ("qwen2", "qwen2_moe") and hf.get("qkv_bias", True))
        or bool(hf.get("attention_bias")),
        qk_layernorm=kind in ("qwen3", "qwen3_moe"), hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, bias_activation_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False)
    if experts:
        sparse = _sparse_layers(hf, experts)
        arguments.update(
            num_moe_experts=experts,
            moe_ffn_hidden_size=hf.get("moe_intermediate_size") or hf["intermediate_size"],
            moe_router_topk=hf["num_experts_per_tok"], moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0, moe_token_dispatcher_type="allgather",
            moe_router_pre_softmax=not (kind == "mixtral" or hf.get("norm_topk_prob")),
            moe_layer_freq=[int(s) for s in sparse] if len(set(sparse)) > 1 else 1)
        if hf.get("shared_expert_intermediate_size"):
            arguments.update(moe_shared_expert_intermediate_size=hf[
                "shared_expert_intermediate_size"], moe_shared_expert_gate=True)
    if kind in ("deepseek_v3", "glm4_moe"):
        arguments.update(_sigmoid_router(hf))
    if kind == "glm4_moe":  # q/k/v biases only; q/k norms when use_qk_norm
        arguments.update(add_bias_linear=False, add_qkv_bias=bool(hf.get("attention_bias")),
                         qk_layernorm=bool(hf.get("use_qk_norm")))
    if kind == "deepseek_v3":
        return _latent_attention_config(hf, arguments)
    return TransformerConfig(**arguments)


def _sigmoid_router(hf: dict) -> dict:
    """DeepSeek-V3's and GLM-4.5's router: sigmoid scores, top-k chosen with the expert bias
    added, group-limited where the config groups experts, normalized and scaled; shared
    experts without a gate."""
    groups = hf.get("n_group") or 1
    return dict(
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_pre_softmax=False, moe_router_dtype="fp32",
        moe_router_topk_scaling_factor=hf.get("routed_scaling_factor") or None,
        moe_router_num_groups=groups if groups > 1 else None,
        moe_router_group_topk=hf.get("topk_group") if groups > 1 else None,
        moe_ffn_hidden_size=hf["moe_intermediate_size"],
        moe_shared_expert_intermediate_size=hf["moe_intermediate_size"] * hf["n_shared_experts"]
        if hf.get("n_shared_experts") else None)


def _latent_attention_config(hf: dict, arguments: dict):
    """DeepSeek-V3 as Megatron-Core's MLATransformerConfig: the low-rank norms as its
    qk_layernorm, plain rotary embeddings (the tiny configs have no YaRN scaling)."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    arguments.update(
        num_query_groups=hf["num_attention_heads"], kv_channels=None, qk_layernorm=True,
        add_qkv_bias=False, add_bias_linear=False, q_lora_rank=hf.get("q_lora_rank"),
        kv_lora_rank=hf["kv_lora_rank"], qk_head_dim=hf["qk_nope_head_dim"],
        qk_pos_emb_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"],
        rope_type="rope", rotary_base=_rope("rope_theta", hf, 10000))
    return MLATransformerConfig(**arguments)


def _rope(name: str, hf: dict, default: float) -> float:
    """A rotary embedding's setting, top-level or (transformers 5) in rope_parameters."""
    return hf.get(name) or (hf.get("rope_parameters") or {}).get(name, default)


def _sparse_layers(hf: dict, experts: int) -> list[bool]:
    if "first_k_dense_replace" in hf:
        return [layer >= hf["first_k_dense_replace"] for layer in range(hf["num_hidden_layers"])]
    step = hf.get("decoder_sparse_step") or 1
    dense = set(hf.get("mlp_only_layers") or [])
    return [layer not in dense and experts > 0 and (layer + 1) % step == 0
            for layer in range(hf["num_hidden_layers"])]


def _latent_core_attention():
    """Megatron-Core 0.16.1's local DotProductAttention does not take latent attention's
    separate key and value widths (only Transformer Engine's does, which needs a GPU): this
    stand-in computes softmax(q k^T * softmax_scale) v with the mask and scale Megatron's
    MLASelfAttention hands it. It has no parameters and no state, so the names, shapes and
    sharded objects stay Megatron's; projections, norms, rotary embedding, router and
    experts stay Megatron's code."""
    from megatron.core.transformer.module import MegatronModule

    class LatentCoreAttention(MegatronModule):
        def __init__(self, config, *, softmax_scale, **unused):
            super().__init__(config)
            self.softmax_scale = softmax_scale

        def forward(self, query, key, value, attention_mask, **unused):
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, n, s, d]
            scores = (q @ k.transpose(-1, -2)) * self.softmax_scale
            scores = scores.masked_fill(attention_mask, float("-inf"))
            out = scores.softmax(-1) @ v
            return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)

    return LatentCoreAttention


def gpt_model(hf: dict):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
    )

    config = transformer_config(hf)
    if config.num_moe_experts:
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                          normalization="RMSNorm")
    else:
        spec = get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm,
                                        multi_latent_attention=config.multi_latent_attention,
                                        normalization="RMSNorm")
    if config.multi_latent_attention:
        core = _latent_core_attention()
        for layer in getattr(spec, "layer_specs", None) or [spec]:
            layer.submodules.self_attention.submodules.core_attention = core
    return GPTModel(config, spec, vocab_size=hf["vocab_size"], max_sequence_length=64,
                    position_embedding_type="rope",
                    rotary_base=int(_rope("rope_theta", hf, 10000)),
                    rotary_percent=_rope("partial_rotary_factor", hf, 1.0),
                    share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings")),
                    ).eval()


def sharded(model) -> dict:
    """The model's sharded state dict: tensors' keys and global shapes, objects' unique
    keys (a factory, linear_fc1's gate and up, as the tensors it builds)."""
    from megatron.core.dist_checkpointing import ShardedObject
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    tensors, objects = {}, set()
    for value in model.sharded_state_dict().values():
        if isinstance(value, ShardedObject):
            objects.add(value.unique_key)
            continue
        built = value.build() if isinstance(value, ShardedTensorFactory) else [value]
        for tensor in built if isinstance(built, list) else [built]:
            tensors[tensor.key] = list(tensor.global_shape)
    return {"tensors": dict(sorted(tensors.items())), "objects": sorted(objects)}


def run(job: dict) -> None:
    from megatron.core import dist_checkpointing

    hf = json.loads(Path(job["config"]).read_text())
    model = gpt_model(hf)
    result = sharded(model)
    if "checkpoint" not in job:
        Path(job["out"]).write_text(json.dumps(result, indent=1) + "\n")
        return
    loaded = dist_checkpointing.load(model.sharded_state_dict(), job["checkpoint"])
    missing, unexpected = model.load_state_dict(loaded, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise SystemExit(f"{job['checkpoint']}: missing {missing}, unexpected {unexpected}")
    ids = torch.tensor(IDS)
    length = ids.shape[1]
    positions = torch.arange(length).unsqueeze(0)
    causal = torch.triu(torch.ones(1, 1, length, length), diagonal=1).bool()  # True: masked
    with torch.no_grad():
        logits = model(ids, positions, attention_mask=causal)
    result["logits"] = logits.float().numpy().tolist()
    Path(job["out"]).write_text(json.dumps(result) + "\n")


def main() -> None:
    _patch_megatron_for_cpu()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.moe import moe_utils

    # Attention forks the CUDA RNG around its (zero) dropout; there is no CUDA RNG here.
    CudaRNGStatesTracker.fork = lambda self, *args, **kwargs: contextlib.nullcontext()
    # Megatron-Core 0.16 names Transformer Engine's GEMM in the router even when Transformer
    # Engine is not installed (its import fails, the name stays undefined): say it is absent.
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    # Its latent attention finds Transformer Engine "present" through mock classes it cannot
    # test instances against: say it is absent.
    multi_latent_attention.HAVE_TE = False

    _init(0, 1, _free_port())
    parallel_state.initialize_model_parallel(1, 1)
    for job in json.loads(Path(sys.argv[1]).read_text()):
        run(job)
        print(f"{job.get('checkpoint', job['config'])}: {job['out']}", flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
