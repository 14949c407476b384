"""Freeze what PaddleFormers 1.2.0's own statements make of Hugging Face checkpoints, run
through PaddlePaddle 3.3.1's AOA engine, as golden cases for the model library.

For each case (a family, a config variant, degrees) this script

1. builds the config.json with transformers' config class and random source tensors of the
   Hugging Face layout (the tensors aoa.models lists for the config; the round-trip tests
   check those lists against transformers' own checkpoints);
2. asks PaddleFormers for its `_gen_aoa_config` and `_gen_inv_aoa_config` statements
   (bench/paddleformers_statements.py, in the Paddle environment);
3. lays the paddleformers tensors out on the mesh with aoa.models' layout, asks Paddle's
   engine (bench/paddle_reference.py) where every destination shard comes from under
   PaddleFormers' forward statements, and builds each shard from the source arrays as Paddle
   says;
4. runs PaddleFormers' inverse statements the same way, from those shards back to full
   Hugging Face tensors, and records whether they give the original bytes back (a true
   inverse) and, if not, which tensors differ.

It writes ``tests/golden/paddleformers/<case>/case.json`` and ``arrays.npz``;
tests/test_models_golden.py checks aoa's mappings against them without Paddle.

    .venv/bin/python bench/paddleformers_golden.py                 # all cases
    .venv/bin/python bench/paddleformers_golden.py --only qwen3_tp2

Nothing of PaddleFormers' code is copied: its classes are asked, in a separate process.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import transformers
from paddle_crosscheck import DEFAULT_PADDLE_PYTHON, ask_paddle, assemble

import aoa
from aoa.dtypes import numpy_dtype
from aoa.jobs.job import derived_outputs
from aoa.layout import ShardDesc
from aoa.mapping import MappingText
from aoa.models import Config, Mesh, family_of, mapping_for

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = ROOT / "tests" / "golden" / "paddleformers"
STATEMENTS = ROOT / "bench" / "paddleformers_statements.py"
#: paddle_reference.py with PaddleFormers' macros (fused_in_proj) registered
REFERENCE_WITH_MACROS = ROOT / "bench" / "paddleformers_reference.py"
SEED = 0

#: 8 query heads and 4 key/value heads of 2 (TP 4 divides both), small everything else.
SMALL = dict(vocab_size=32, hidden_size=16, num_attention_heads=8, num_key_value_heads=4,
             head_dim=2, intermediate_size=16, num_hidden_layers=2)
MOE = dict(moe_intermediate_size=8, num_experts_per_tok=2)
ROUTED = dict(n_routed_experts=4, n_shared_experts=1, n_group=1, topk_group=1, **MOE)

#: DeepSeek-V3.2: V3's latent attention with its indexer, a dense first layer.
DEEPSEEK_V32 = dict(num_hidden_layers=2, first_k_dense_replace=1, q_lora_rank=8, kv_lora_rank=4,
                    qk_rope_head_dim=2, qk_nope_head_dim=2, v_head_dim=2, num_key_value_heads=8,
                    index_n_heads=2, index_head_dim=4, index_topk=4, num_nextn_predict_layers=0,
                    **ROUTED)

#: Kimi-K2: DeepSeek-V3's architecture, a dense first layer, no MTP layer.
KIMI_K2 = dict(num_hidden_layers=2, first_k_dense_replace=1, q_lora_rank=8, kv_lora_rank=4,
               qk_rope_head_dim=2, qk_nope_head_dim=2, v_head_dim=2, num_key_value_heads=8,
               num_nextn_predict_layers=0, **ROUTED)

#: Qwen3-Next: a linear-attention layer, then a full-attention one; experts and a shared one.
QWEN3_NEXT = dict(full_attention_interval=2, num_experts=4, shared_expert_intermediate_size=16,
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=4,
                  linear_value_head_dim=4, linear_conv_kernel_dim=4, **MOE)

#: ERNIE-4.5-MoE: a dense first layer, then experts and a shared expert.
ERNIE_MOE = dict(moe_num_experts=4, moe_k=2, moe_num_shared_experts=1, moe_intermediate_size=8,
                 moe_layer_start_index=1)

#: name -> (PaddleFormers module, class, transformers config class, arguments, mesh, dtype)
CASES: dict[str, tuple[str, str, str, dict[str, Any], Mesh, str]] = {
    "llama_tp2": ("llama", "LlamaForCausalLM", "LlamaConfig", {}, Mesh(tp=2), "float32"),
    "llama_tied_tp4": ("llama", "LlamaForCausalLM", "LlamaConfig",
                       dict(tie_word_embeddings=True), Mesh(tp=4), "float32"),
    "qwen2_tp2": ("qwen2", "Qwen2ForCausalLM", "Qwen2Config", {}, Mesh(tp=2), "float32"),
    "qwen2_tied_tp4": ("qwen2", "Qwen2ForCausalLM", "Qwen2Config",
                       dict(tie_word_embeddings=True), Mesh(tp=4), "float32"),
    "qwen3_tp2": ("qwen3", "Qwen3ForCausalLM", "Qwen3Config", {}, Mesh(tp=2), "float32"),
    "qwen3_tied_tp4": ("qwen3", "Qwen3ForCausalLM", "Qwen3Config",
                       dict(tie_word_embeddings=True), Mesh(tp=4), "float32"),
    "qwen2_moe_tp2_ep2": ("qwen2_moe", "Qwen2MoeForCausalLM", "Qwen2MoeConfig",
                          dict(num_experts=4, shared_expert_intermediate_size=16, **MOE),
                          Mesh(tp=2, ep=2), "float32"),
    "qwen3_moe_bf16_tp2_ep2": ("qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3MoeConfig",
                               dict(num_experts=4, **MOE), Mesh(tp=2, ep=2), "bfloat16"),
    "deepseek_v3_tp2_ep2": ("deepseek_v3", "DeepseekV3ForCausalLM", "DeepseekV3Config",
                            dict(num_hidden_layers=3, first_k_dense_replace=1, q_lora_rank=8,
                                 kv_lora_rank=4, qk_rope_head_dim=2, qk_nope_head_dim=2,
                                 v_head_dim=2, num_key_value_heads=8,
                                 num_nextn_predict_layers=0, **ROUTED),
                            Mesh(tp=2, ep=2), "float32"),
    # experts whole on every tensor-parallel rank where there is no expert parallelism
    "deepseek_v3_tp2": ("deepseek_v3", "DeepseekV3ForCausalLM", "DeepseekV3Config",
                        dict(num_hidden_layers=2, first_k_dense_replace=1, q_lora_rank=8,
                             kv_lora_rank=4, qk_rope_head_dim=2, qk_nope_head_dim=2,
                             v_head_dim=2, num_key_value_heads=8, num_nextn_predict_layers=0,
                             **ROUTED),
                        Mesh(tp=2), "float32"),
    "deepseek_v32_mtp_bf16_tp2_ep2": ("deepseek_v32", "DeepseekV32ForCausalLM",
                                      "DeepseekV32Config", dict(DEEPSEEK_V32,
                                                                num_nextn_predict_layers=1),
                                      Mesh(tp=2, ep=2), "bfloat16"),
    "deepseek_v32_bf16_tp4": ("deepseek_v32", "DeepseekV32ForCausalLM", "DeepseekV32Config",
                              dict(DEEPSEEK_V32, num_hidden_layers=3, n_shared_experts=2),
                              Mesh(tp=4), "bfloat16"),
    "kimi_k2_bf16_tp2_ep2": ("kimi_k2", "KimiK2ForCausalLM", "DeepseekV3Config",
                             dict(KIMI_K2, model_type="kimi_k2"), Mesh(tp=2, ep=2), "bfloat16"),
    "qwen3_next_tp2_ep2": ("qwen3_next", "Qwen3NextForCausalLM", "Qwen3NextConfig",
                           dict(QWEN3_NEXT), Mesh(tp=2, ep=2), "float32"),
    "qwen3_next_bf16_tp4": ("qwen3_next", "Qwen3NextForCausalLM", "Qwen3NextConfig",
                            dict(QWEN3_NEXT, num_hidden_layers=4), Mesh(tp=4), "bfloat16"),
    "qwen3_moe_tp2": ("qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3MoeConfig",
                      dict(num_experts=4, **MOE), Mesh(tp=2), "float32"),
    "glm4_moe_mtp_tp2_ep2": ("glm4_moe", "Glm4MoeForCausalLM", "Glm4MoeConfig",
                             dict(num_hidden_layers=2, first_k_dense_replace=1,
                                  use_qk_norm=True, num_nextn_predict_layers=1, **ROUTED),
                             Mesh(tp=2, ep=2), "float32"),
    "gpt_oss_tp2": ("gpt_oss", "GptOssForCausalLM", "GptOssConfig",
                    dict(num_local_experts=4, num_experts_per_tok=2), Mesh(tp=2), "float32"),
    "gemma3_text_tp2": ("gemma3_text", "Gemma3ForCausalLM", "Gemma3TextConfig", {},
                        Mesh(tp=2), "float32"),
    "phi3_tp2": ("phi3", "Phi3ForCausalLM", "Phi3Config", dict(pad_token_id=0), Mesh(tp=2),
                 "float32"),
    "phi3_tp4": ("phi3", "Phi3ForCausalLM", "Phi3Config", dict(pad_token_id=0), Mesh(tp=4),
                 "float32"),
    "ernie4_5_tied_tp2": ("ernie4_5", "Ernie4_5ForCausalLM", "Ernie4_5Config", {}, Mesh(tp=2),
                          "float32"),
    "ernie4_5_bf16_tp4": ("ernie4_5", "Ernie4_5ForCausalLM", "Ernie4_5Config",
                          dict(tie_word_embeddings=False), Mesh(tp=4), "bfloat16"),
    "ernie4_5_moe_mtp_tp2_ep2": ("ernie4_5_moe", "Ernie4_5_MoeForCausalLM",
                                 "Ernie4_5_MoeConfig", dict(ERNIE_MOE, num_nextn_predict_layers=1),
                                 Mesh(tp=2, ep=2), "float32"),
    "ernie4_5_moe_bf16_tp4": ("ernie4_5_moe", "Ernie4_5_MoeForCausalLM", "Ernie4_5_MoeConfig",
                              dict(ERNIE_MOE, num_hidden_layers=3, moe_layer_interval=2,
                                   tie_word_embeddings=False, num_nextn_predict_layers=0),
                              Mesh(tp=4), "bfloat16"),
}


def config_dict(config_class: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """The config.json transformers writes; a `model_type` among the arguments replaces the
    class's (Kimi-K2 ships DeepSeek-V3's config under its own)."""
    given = dict(arguments)
    model_type = given.pop("model_type", None)
    config = json.loads(getattr(transformers, config_class)(**{**SMALL, **given})
                        .to_json_string())
    return config if model_type is None else {**config, "model_type": model_type}


def paddleformers_statements(module: str, model_class: str, config: dict[str, Any],
                             paddle_python: str) -> dict[str, list[str]]:
    with tempfile.TemporaryDirectory() as folder:
        request = Path(folder) / "request.json"
        request.write_text(json.dumps({"module": module, "class": model_class,
                                       "config": config}))
        result = subprocess.run([paddle_python, str(STATEMENTS), str(request)],
                                capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"{module}: paddleformers_statements.py failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout)


def full(key: str, shape, dtype: str) -> dict[str, Any]:
    return ShardDesc.full(key, shape, dtype).to_json()


def freeze(name: str, rng: np.random.Generator, output: Path, paddle_python: str) -> str:
    module, model_class, config_class, arguments, mesh, dtype = CASES[name]
    config = config_dict(config_class, arguments)
    cfg = Config(config, "config.json")
    expected = family_of(cfg).tensors(cfg)
    if module == "glm4_moe":  # PaddleFormers shares these with the main model
        expected = {k: v for k, v in expected.items()
                    if not k.endswith(("layers.2.embed_tokens.weight",
                                       "shared_head.head.weight"))}
    source = {key: [full(key, spec.shape, dtype)] for key, spec in expected.items()}
    arrays = {f"src::{key}": rng.standard_normal(spec.shape).astype(numpy_dtype(dtype))
              for key, spec in expected.items()}
    statements = paddleformers_statements(module, model_class, config, paddle_python)

    # aoa's paddleformers tensors laid out on the mesh: Paddle is asked for each shard under
    # PaddleFormers' statements. PaddleFormers' own names are those its statements export
    # plus those Paddle answers for (a full export leaves out `a -> a` read again later, as
    # PaddleFormers' tied Llama does; its model asks for them all).
    source_info = {k: [ShardDesc.from_json(s) for s in v] for k, v in source.items()}
    ours = mapping_for(cfg.with_checkpoint(frozenset(expected)), "paddleformers", mesh)
    outputs = derived_outputs(MappingText(ours.forward), source_info)
    exported = set(derived_outputs(MappingText(statements["forward"]), source_info))
    by_key = ours.layout.shards(outputs).by_key
    destination = {key: [s.to_json() for s in shards] for key, shards in by_key.items()}
    queries = [shard for shards in destination.values() for shard in shards]
    case: dict[str, Any] = {"name": name, "aoa_statements": statements["forward"],
                            "reverse": False, "source": source, "destination": destination,
                            "queries": queries}
    entries = ask_paddle(case, paddle_python)
    answered = {query["key"] for query, found in zip(queries, entries) if found}
    expected_arrays = []
    targets: dict[str, np.ndarray] = {}
    for index, (query, query_entries) in enumerate(zip(queries, entries)):
        npz_key = f"dst::{index}::{query['key']}"
        shard = assemble(query, query_entries, arrays)
        arrays[npz_key] = shard
        expected_arrays.append({"npz_key": npz_key, "query": index})
        whole = targets.setdefault(query["key"], np.zeros(
            query["global_shape"], numpy_dtype(query["dtype"])))
        box = tuple(slice(o, o + n) for o, n in zip(query["global_offset"],
                                                     query["local_shape"]))
        whole[box] = shard

    inverse = check_inverse(name, statements["inverse"], destination, targets, arrays,
                            source, paddle_python)
    bfloat16_keys = [k for k, a in arrays.items() if a.dtype == ml_dtypes.bfloat16]
    stored = {k: a.view(np.uint16) if k in bfloat16_keys else a for k, a in arrays.items()}
    record = {
        "name": name, "config": config, "mesh": mesh.to_json(),
        "paddleformers": {"module": module, "class": model_class, **statements},
        "paddleformers_keys": sorted(exported | answered),
        "source": source, "destination": destination, "queries": queries,
        "entries": entries, "arrays": expected_arrays, "bfloat16_as_uint16": bfloat16_keys,
        "paddleformers_inverse": inverse,
    }
    folder = output / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "case.json").write_text(json.dumps(record, indent=1) + "\n")
    np.savez_compressed(folder / "arrays.npz", **stored)
    verdict = "true inverse" if inverse["true"] else (
        f"NOT a true inverse: {inverse.get('error') or ', '.join(inverse['wrong'][:4])}")
    return f"{len(queries)} shards; PaddleFormers' way back: {verdict}"


def check_inverse(name: str, statements: list[str], destination: dict, targets: dict,
                  arrays: dict, hf_source: dict, paddle_python: str) -> dict[str, Any]:
    """Run PaddleFormers' inverse statements from the shards back to whole Hugging Face
    tensors; which come back other than they were."""
    queries = [shards[0] for shards in hf_source.values()]
    case = {"name": name + " (inverse)", "aoa_statements": statements, "reverse": False,
            "source": destination, "destination": hf_source, "queries": queries}
    try:
        entries = ask_paddle(case, paddle_python)
    except SystemExit as error:
        return {"true": False, "error": str(error).splitlines()[-1][-300:], "wrong": []}
    sources = {f"src::{key}": value for key, value in targets.items()}
    wrong = []
    for query, query_entries in zip(queries, entries):
        got = assemble(query, query_entries, sources) if query_entries else None
        want = arrays[f"src::{query['key']}"]
        if got is None or got.tobytes() != want.tobytes():
            wrong.append(query["key"])
    return {"true": not wrong, "wrong": wrong}


# --- fused_in_proj: PaddleFormers' own macro, run as PaddleFormers registers it ---------

#: Qwen3.5's linear attention: 2 key heads and 4 value heads of 4, hidden 16, kernel 3.
QWEN3_5 = {"model_type": "qwen3_5", "text_config": {
    "model_type": "qwen3_5_text", "num_hidden_layers": 2,
    "layer_types": ["linear_attention", "full_attention"], "hidden_size": 16,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 4,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 4,
    "linear_value_head_dim": 4, "linear_conv_kernel_dim": 3, "intermediate_size": 16,
    "vocab_size": 32}}
STATEMENT_CASES = {"qwen3_5_linear_attention_tp2": 2, "qwen3_5_linear_attention_tp4": 4}


def ask_with_macros(case: dict[str, Any], paddle_python: str) -> list:
    with tempfile.TemporaryDirectory() as folder:
        case_file = Path(folder) / "case.json"
        case_file.write_text(json.dumps(case))
        result = subprocess.run([paddle_python, str(REFERENCE_WITH_MACROS), str(case_file)],
                                capture_output=True, text=True)
    answer = json.loads(result.stdout) if result.returncode == 0 else None
    if answer is None or answer["status"] != "ok":
        sys.exit(f"{case['name']}: Paddle with PaddleFormers' macros failed:\n"
                 f"{(answer or {}).get('paddle_error') or result.stderr[-3000:]}")
    return answer["entries"]


def freeze_statements(name: str, rng: np.random.Generator, output: Path,
                      paddle_python: str) -> str:
    """PaddleFormers' statements for Qwen3.5's first layer (linear attention), fused_in_proj
    and all, run by Paddle with PaddleFormers' macro; aoa must give the same bytes."""
    tp = STATEMENT_CASES[name]
    statements = [s for s in paddleformers_statements(
        "qwen3_5", "Qwen3_5ForConditionalGeneration", QWEN3_5, paddle_python)["forward"]
        if ".layers.0.linear_attn." in s]
    hf = "model.language_model.layers.0.linear_attn."
    pf = "model.language_model.layers.0.self_attn."
    shapes = {"in_proj_qkv.weight": (32, 16), "in_proj_z.weight": (16, 16),
              "in_proj_b.weight": (4, 16), "in_proj_a.weight": (4, 16),
              "conv1d.weight": (32, 1, 3), "dt_bias": (4,), "A_log": (4,),
              "norm.weight": (4,), "out_proj.weight": (16, 16)}
    source = {hf + k: [full(hf + k, shape, "float32")] for k, shape in shapes.items()}
    arrays = {f"src::{hf}{k}": rng.standard_normal(shape).astype(np.float32)
              for k, shape in shapes.items()}

    def split(key: str, shape: tuple[int, ...], axis: int | None, dtype: str) -> list:
        parts = 1 if axis is None else tp
        out = []
        for r in range(parts):
            local, offset = list(shape), [0] * len(shape)
            if axis is not None:
                local[axis] //= tp
                offset[axis] = r * local[axis]
            out.append(ShardDesc(key, tuple(local), shape, tuple(offset), dtype).to_json())
        return out

    destination = {pf + k: split(pf + k, shape, axis, dtype) for k, shape, axis, dtype in (
        ("in_proj.weight", (16, 56), 1, "float32"), ("conv1d.weight", (32, 1, 3), 0, "bfloat16"),
        ("dt_bias", (4,), None, "float32"), ("A_log", (4,), None, "float32"),
        ("out_norm.weight", (4,), None, "bfloat16"), ("out_proj.weight", (16, 16), 0, "float32"))}
    queries = [shard for shards in destination.values() for shard in shards]
    case = {"name": name, "aoa_statements": statements, "reverse": False, "source": source,
            "destination": destination, "queries": queries}
    entries = ask_with_macros(case, paddle_python)
    expected_arrays = []
    for index, (query, query_entries) in enumerate(zip(queries, entries)):
        npz_key = f"dst::{index}::{query['key']}"
        arrays[npz_key] = assemble(query, query_entries, arrays)
        expected_arrays.append({"npz_key": npz_key, "query": index})
    bfloat16_keys = [k for k, a in arrays.items() if a.dtype == ml_dtypes.bfloat16]
    stored = {k: a.view(np.uint16) if k in bfloat16_keys else a for k, a in arrays.items()}
    record = {"name": name, "kind": "statements", "config": QWEN3_5, "mesh": {"tp": tp},
              "paddleformers": {"module": "qwen3_5", "class": "Qwen3_5ForConditionalGeneration",
                                "forward": statements},
              "source": source, "destination": destination, "queries": queries,
              "entries": entries, "arrays": expected_arrays,
              "bfloat16_as_uint16": bfloat16_keys}
    folder = output / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "case.json").write_text(json.dumps(record, indent=1) + "\n")
    np.savez_compressed(folder / "arrays.npz", **stored)
    return f"{len(queries)} shards, {len(statements)} statements of PaddleFormers"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", choices=[*CASES, *STATEMENT_CASES],
                        metavar="NAME")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument("--paddle-python", default=DEFAULT_PADDLE_PYTHON)
    args = parser.parse_args()
    if not Path(args.paddle_python).exists():
        sys.exit(f"no Paddle Python at {args.paddle_python}; see bench/README.md")
    for index, name in enumerate(CASES):
        if args.only and name not in args.only:
            continue
        rng = np.random.default_rng([SEED, index])
        print(f"{name}: {freeze(name, rng, args.output, args.paddle_python)}", flush=True)
    for index, name in enumerate(STATEMENT_CASES, start=len(CASES)):
        if args.only and name not in args.only:
            continue
        rng = np.random.default_rng([SEED, index])
        print(f"{name}: {freeze_statements(name, rng, args.output, args.paddle_python)}",
              flush=True)
    aoa.__name__  # noqa: B018 - the package must import before the cases are built


if __name__ == "__main__":
    main()
