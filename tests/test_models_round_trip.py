"""Every family transformers can build: a tiny random model saved with save_pretrained,
converted to paddleformers at TP 1, 2 and 4 (and EP 2 for MoE), resharded, converted back
with --to hf and loaded with from_pretrained: every tensor byte-identical, the logits on a
fixed input bit-identical."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest
from frameworks import PADDLE_PYTHON, ROOT
from models_support import IDS, MODELS, aoa, build, logits, tensors

pytestmark = pytest.mark.slow


def round_trip(name, tmp_path, *degrees: str, ep: int = 1, pp: int = 1, dtype=None):
    import torch  # here, not at the top: collecting the default suite stays cheap
    import transformers

    dtype = dtype or torch.float32
    build(name, tmp_path / "hf", dtype)
    hf = tensors(tmp_path / "hf")
    folder = tmp_path / "hf"
    for index, tp in enumerate(degrees):
        out = tmp_path / f"pf{index}"
        arguments = ["convert", "--source", str(folder), "--output", str(out), "--to",
                     "paddleformers", "--tp", tp]
        if ep > 1:
            arguments += ["--ep", str(ep)]
        if pp > 1:
            arguments += ["--pp", str(pp)]
        status, err = aoa(*arguments)
        assert status == 0, err
        folder = out
    status, err = aoa("convert", "--source", str(folder), "--output", str(tmp_path / "back"),
                      "--to", "hf")
    assert status == 0, err
    back = tensors(tmp_path / "back")
    assert back.keys() == hf.keys()
    for key, value in hf.items():
        assert back[key] == value, key
    model_class = getattr(transformers, MODELS[name][1])
    # Both loaded the same way (a model may keep some modules in float32 when loading).
    original = model_class.from_pretrained(tmp_path / "hf", dtype=dtype).eval()
    loaded = model_class.from_pretrained(tmp_path / "back", dtype=dtype).eval()
    assert torch.equal(logits(loaded), logits(original))
    return json.loads((tmp_path / "pf0" / "aoa-conversion.json").read_text())


def test_llama_tp2_round_trip(tmp_path):
    record = round_trip("llama", tmp_path, "2")
    assert record["family"] == "llama" and record["target"] == "paddleformers"
    assert record["mesh"] == {"tp": 2, "ep": 1, "pp": 1}
    assert "model.layers.$LAYER_ID.self_attn.q_proj.weight^T" in record["mapping"]


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("tp", ["1", "2", "4"])
def test_round_trip(name, tp, tmp_path):
    round_trip(name, tmp_path, tp)


@pytest.mark.parametrize("name", sorted(n for n, spec in MODELS.items() if spec[3] >= 2))
def test_expert_parallel_round_trip(name, tmp_path):
    round_trip(name, tmp_path, "2", ep=2)


@pytest.mark.parametrize("name", ["qwen3", "phi3", "qwen2_moe", "gemma3_text", "ernie4_5",
                                  "qwen3_next"])
def test_reshard_tp2_to_tp4_then_back(name, tmp_path):
    """A fused layout written at TP 2, laid out again at TP 4, comes back whole."""
    round_trip(name, tmp_path, "2", "4")


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3", "ernie4_5_moe", "deepseek_v32",
                                  "qwen3_next"])
def test_bfloat16_round_trip_keeps_router_float32(name, tmp_path):
    """bf16 weights stay bf16; the router PaddleFormers keeps in float32 is widened on the
    way there and narrowed back exactly."""
    import torch

    from aoa.storage.formats import open_source

    round_trip(name, tmp_path, "2", dtype=torch.bfloat16)
    with open_source(tmp_path / "pf0") as pf:  # Paddle FlexCheckpoint, read by its metadata
        dtypes = {key: {shard.dtype for shard in shards} for key, shards in pf.shards.items()}
    gates = [v for k, v in dtypes.items() if k.endswith("mlp.gate.weight")]
    assert gates and all(v == {"float32"} for v in gates)
    embed = "model.embedding.embed_tokens.weight" if name in ("qwen3_moe", "deepseek_v32") \
        else "model.embed_tokens.weight"
    assert dtypes[embed] == {"bfloat16"}
    if name == "ernie4_5_moe":  # the router's correction bias too
        biases = [v for k, v in dtypes.items() if k.endswith("e_score_correction_bias")]
        assert biases and all(v == {"float32"} for v in biases)


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3", "gemma3_text", "ernie4_5_moe",
                                  "deepseek_v32"])
def test_pipeline_round_trip(name, tmp_path):
    """Layers placed on two pipeline stages (and experts on two expert-parallel ranks)."""
    round_trip(name, tmp_path, "2", ep=2 if MODELS[name][3] else 1, pp=2)


@pytest.mark.skipif(PADDLE_PYTHON is None, reason="PaddlePaddle 3.3.1 venv not here")
@pytest.mark.parametrize(("name", "module", "model_class"), [
    ("ernie4_5", "ernie4_5", "Ernie4_5ForCausalLM"),
    ("ernie4_5_untied", "ernie4_5", "Ernie4_5ForCausalLM"),
    ("llama", "llama", "LlamaForCausalLM"),
    ("llama_tied_biases", "llama", "LlamaForCausalLM"),
    ("gemma3_text", "gemma3_text", "Gemma3ForCausalLM"),
    ("phi3", "phi3", "Phi3ForCausalLM"),
])
def test_paddleformers_model_runs_what_was_written(name, module, model_class, tmp_path):
    """PaddleFormers' own model, its parameters read by Paddle's load_state_dict from what
    `--to paddleformers` wrote, gives transformers' logits (float32, two frameworks'
    arithmetic: within 1e-4). The families whose PaddleFormers model runs here: the others
    need PaddleFleet, and PaddleFormers' GPT-OSS computes other logits than transformers'
    from the same weights (its first layer's output differs; its statements rename them)."""
    model = build(name, tmp_path / "hf")
    status, err = aoa("convert", "--source", str(tmp_path / "hf"), "--output",
                      str(tmp_path / "pf"), "--to", "paddleformers")
    assert status == 0, err
    out = tmp_path / "logits.npy"
    result = subprocess.run([str(PADDLE_PYTHON), str(ROOT / "bench" / "paddleformers_forward.py"),
                             module, model_class, str(tmp_path / "pf"), json.dumps(IDS),
                             str(out)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    np.testing.assert_allclose(np.load(out), logits(model).numpy(), rtol=0, atol=1e-4)
