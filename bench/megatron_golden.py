"""Freeze the names and shapes Megatron-Core asks of a checkpoint, as golden cases for the
`megatron` target.

For each case (a family and a config variant, tiny) this script builds the config.json
with transformers' own config class, asks Megatron-Core 0.16.1 (bench/megatron_model.py in
its environment) for the ``sharded_state_dict`` of the GPTModel it builds for that config
with its local modules (the only ones that build without Transformer Engine and a GPU), and
writes ``tests/golden/megatron/<case>.json``: the config and every tensor key with its global
shape and every sharded object's unique key. tests/test_models_megatron.py checks what
``aoa convert --to megatron`` writes against them without Megatron, and converts the same
configs for the logits check where Megatron is installed.

    .venv/bin/python bench/megatron_golden.py [--megatron-python PYTHON] [--only CASE]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import transformers

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "golden" / "megatron"
#: 8 query heads, 4 key/value heads of 4: TP 2 and 4 divide both, and the vocabulary.
ATTENTION = dict(vocab_size=128, hidden_size=32, num_attention_heads=8, num_key_value_heads=4,
                 head_dim=4, intermediate_size=64, num_hidden_layers=2)
MOE = dict(moe_intermediate_size=16, num_experts_per_tok=2)

#: a sigmoid router with one expert group; no multi-token-prediction layer (transformers
#: neither makes nor saves one); latent attention's heads are all key/value heads
SIGMOID_ROUTER = dict(n_routed_experts=4, n_shared_experts=1, n_group=1, topk_group=1,
                      norm_topk_prob=True, routed_scaling_factor=2.5,
                      num_nextn_predict_layers=0, **MOE)
LATENT = dict(SIGMOID_ROUTER, num_key_value_heads=8, q_lora_rank=16, kv_lora_rank=16,
              qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4)

#: case -> (transformers config class, arguments)
CASES: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", {}),
    "llama_tied_biases": ("LlamaConfig", dict(tie_word_embeddings=True, attention_bias=True,
                                              mlp_bias=True)),
    "mistral": ("MistralConfig", dict(sliding_window=None)),
    "qwen2_tied": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", {}),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=4, norm_topk_prob=True, **MOE)),
    "qwen3_moe_dense_layer": ("Qwen3MoeConfig", dict(num_experts=4, decoder_sparse_step=2,
                                                     **MOE)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=4, shared_expert_intermediate_size=32,
                                         **MOE)),
    "qwen2_moe_dense_layer": ("Qwen2MoeConfig", dict(num_experts=4, mlp_only_layers=[0],
                                                     shared_expert_intermediate_size=32,
                                                     qkv_bias=False, **MOE)),
    "deepseek_v3": ("DeepseekV3Config", dict(LATENT, first_k_dense_replace=1)),
    "deepseek_v3_no_q_lora": ("DeepseekV3Config", dict(LATENT, q_lora_rank=None,
                                                       first_k_dense_replace=0)),
    "glm4_moe": ("Glm4MoeConfig", dict(SIGMOID_ROUTER, first_k_dense_replace=1,
                                       attention_bias=True, use_qk_norm=True,
                                       partial_rotary_factor=0.5)),
}


def config(case: str) -> dict:
    config_class, arguments = CASES[case]
    made = getattr(transformers, config_class)(**{**ATTENTION, **arguments})
    return json.loads(made.to_json_string())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--megatron-python", default="/work/megatron-venv/bin/python")
    parser.add_argument("--only", action="append", choices=sorted(CASES))
    args = parser.parse_args()
    cases = args.only or sorted(CASES)
    GOLDEN.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        jobs = []
        for case in cases:
            folder = Path(work) / case
            folder.mkdir()
            (folder / "config.json").write_text(json.dumps(config(case)))
            jobs.append({"config": str(folder / "config.json"),
                         "out": str(folder / "sharded.json")})
        (Path(work) / "jobs.json").write_text(json.dumps(jobs))
        subprocess.run([args.megatron_python, str(ROOT / "bench" / "megatron_model.py"),
                        str(Path(work) / "jobs.json")], check=True)
        for case, job in zip(cases, jobs):
            golden = {"config": config(case),
                      "sharded": json.loads(Path(job["out"]).read_text())}
            (GOLDEN / f"{case}.json").write_text(json.dumps(golden, indent=1) + "\n")
            print(f"{GOLDEN / case}.json: {len(golden['sharded']['tensors'])} tensors, "
                  f"{len(golden['sharded']['objects'])} objects", file=sys.stderr)


if __name__ == "__main__":
    main()
