"""fp8 releases (DeepSeek-V3, Kimi-K2): a tiny DeepSeek-V3-like checkpoint built here with
ml_dtypes (transformers builds no fp8 model on a CPU) with float8_e4m3fn projections and a
float32 ``weight_scale_inv`` per block, converted to paddleformers dequantized
(``--dtype bfloat16``) and kept in fp8, and back. Every dequantized tensor is compared byte
for byte with the definition written here in numpy (value times its block's scale, in
float32, rounded once to bfloat16); every kept one with the original bytes.

The block is 4 x 2 (not square, so a transposed weight's block grid must be transposed too)
and the tensors' sizes leave partial last blocks.
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from frameworks import PADDLE_PYTHON, paddle_load

import aoa
from aoa.cli import main
from aoa.models import FAMILIES, Config
from aoa.storage.formats import open_source
from aoa.storage.safetensors import SafetensorsFile, write_safetensors

BLOCK = (4, 2)
CONFIG = {"model_type": "deepseek_v3", "vocab_size": 64, "hidden_size": 16,
          "intermediate_size": 32, "moe_intermediate_size": 8, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 4, "first_k_dense_replace": 1,
          "n_routed_experts": 4, "n_shared_experts": 1, "q_lora_rank": 8,
          "kv_lora_rank": 4, "qk_rope_head_dim": 2, "qk_nope_head_dim": 2, "v_head_dim": 2,
          "num_nextn_predict_layers": 1, "tie_word_embeddings": False,
          "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
                                  "quant_method": "fp8", "weight_block_size": list(BLOCK)}}
PLAIN = {k: v for k, v in CONFIG.items() if k != "quantization_config"}


def is_fp8(key: str) -> bool:
    """As in DeepSeek-V3's release: the projections of the layers; not the routers, norms,
    embeddings, head or the MTP layer's eh_proj."""
    return key.startswith("model.layers.") and key.endswith(
        ("_proj.weight", "_proj_with_mqa.weight")) and "eh_proj" not in key


def transposed(key: str) -> bool:
    """paddleformers keeps linear weights (and their scales) as [in, out]."""
    return not any(name in key for name in ("embed_tokens", "lm_head", "shared_head.head",
                                            "norm", "bias"))


def fp8_folder(folder: Path, *, config: dict = CONFIG, drop: str | None = None
               ) -> dict[str, np.ndarray]:
    """A Hugging Face folder as DeepSeek-V3 ships it, random values: fp8 projections (no
    NaN) with float32 scales, bfloat16 elsewhere, the router's correction bias float32."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer.json").write_text("{}")
    family = next(f for f in FAMILIES if f.name == config["model_type"])
    rng = np.random.default_rng(0)
    tensors: dict[str, np.ndarray] = {}
    plain = {k: v for k, v in config.items() if k != "quantization_config"}
    for key, spec in family.tensors(Config(plain)).items():
        if is_fp8(key):
            stored = rng.integers(0, 256, spec.shape, dtype=np.uint8)
            stored[(stored & 0x7F) == 0x7F] = 0x38  # no NaN
            tensors[key] = stored.view(ml_dtypes.float8_e4m3fn)
            grid = tuple(-(-n // b) for n, b in zip(spec.shape, BLOCK))
            tensors[key + "_scale_inv"] = rng.uniform(0.01, 2, grid).astype(np.float32)
        elif key.endswith("e_score_correction_bias"):
            tensors[key] = rng.standard_normal(spec.shape).astype(np.float32)
        else:
            tensors[key] = rng.standard_normal(spec.shape).astype(ml_dtypes.bfloat16)
    if drop is not None:
        del tensors[drop]

    def fill(views):
        for name, view in views.items():
            np.frombuffer(view, np.uint8)[:] = tensors[name].view(np.uint8).reshape(-1)

    write_safetensors(folder / "model.safetensors",
                      [aoa.ShardDesc.full(k, v.shape, _name(v.dtype)) for k, v in
                       tensors.items()], None, fill)
    return tensors


def _name(dtype: np.dtype) -> str:
    return {np.dtype(np.float32): "float32", np.dtype(ml_dtypes.bfloat16): "bfloat16",
            np.dtype(ml_dtypes.float8_e4m3fn): "float8_e4m3fn"}[np.dtype(dtype)]


def dequantized(tensors: dict[str, np.ndarray], key: str) -> np.ndarray:
    """The definition: float32(value) * float32(its block's scale), once to bfloat16."""
    weight = tensors[key].astype(np.float32)
    scales = tensors[key + "_scale_inv"]
    spread = np.repeat(np.repeat(scales, BLOCK[0], 0), BLOCK[1], 1)
    return (weight * spread[:weight.shape[0], :weight.shape[1]]).astype(ml_dtypes.bfloat16)


def whole(folder: Path) -> dict[str, np.ndarray]:
    """Every tensor of a converted folder, its shards put together."""
    out: dict[str, np.ndarray] = {}
    with open_source(folder) as source:
        for key, shards in source.shards.items():
            from aoa.dtypes import numpy_dtype

            dtype = numpy_dtype(shards[0].dtype)
            array = np.zeros(shards[0].global_shape, dtype)
            for shard in shards:
                box = tuple(slice(o, o + n)
                            for o, n in zip(shard.global_offset, shard.local_shape))
                array[box] = np.frombuffer(source.buffer(shard), dtype).reshape(
                    shard.local_shape)
            out[key] = array
    return out


def run(*arguments: str, capsys) -> tuple[int, str]:
    status = main([*arguments, "--quiet"] if arguments[0] == "convert" else list(arguments))
    return status, capsys.readouterr().err


def convert(source: Path, output: Path, *extra: str, capsys) -> None:
    status, err = run("convert", "--source", str(source), "--output", str(output), *extra,
                      capsys=capsys)
    assert status == 0, err


def target_key(key: str) -> str:
    return key  # DeepSeek-V3 keeps its names in paddleformers


def test_dequantized_to_paddleformers_and_back(tmp_path, capsys):
    tensors = fp8_folder(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "pf", "--to", "paddleformers", "--tp", "2", "--ep",
            "2", "--dtype", "bfloat16", capsys=capsys)
    out = whole(tmp_path / "pf")
    assert not any(key.endswith("_scale_inv") for key in out)
    for key in tensors:
        if is_fp8(key):
            want = dequantized(tensors, key)
            assert out[key].dtype == ml_dtypes.bfloat16, key
            assert out[key].tobytes() == np.ascontiguousarray(want.T).tobytes(), key
    config = json.loads((tmp_path / "pf" / "config.json").read_text())
    assert "quantization_config" not in config and config["hidden_size"] == 16
    record = json.loads((tmp_path / "pf" / "aoa-conversion.json").read_text())
    assert record["dequantized"]["block"] == list(BLOCK)
    assert record["dequantized"]["from"] == ["float8_e4m3fn"]
    assert "fp8" not in record

    convert(tmp_path / "pf", tmp_path / "back", "--to", "hf", capsys=capsys)
    with SafetensorsFile.open(tmp_path / "back" / "model.safetensors") as f:
        assert set(f.tensors) == {k for k in tensors if not k.endswith("_scale_inv")}
        for key, value in tensors.items():
            if key.endswith("_scale_inv"):
                continue
            want = dequantized(tensors, key) if is_fp8(key) else value
            assert f.array(key).tobytes() == want.tobytes(), key
            assert f.array(key).dtype == want.dtype, key


@pytest.mark.parametrize(("model_type", "extra"), [
    ("deepseek_v32", {"index_n_heads": 2, "index_head_dim": 4}),
    ("kimi_k2", {"num_nextn_predict_layers": 0})])
def test_paddlefleet_builds_of_the_fp8_releases_dequantized_and_back(tmp_path, capsys,
                                                                     model_type, extra):
    """DeepSeek-V3.2 and Kimi-K2 as they ship (fp8 projections; V3.2's indexer's among
    them): dequantized to paddleformers and back gives the dequantized values (V3.2's
    router correction bias, which PaddleFormers keeps in float32 for Kimi-K2 only, narrowed
    to bfloat16 with the rest). Kept in fp8 they are refused: the fused gate/up of their
    dense layers cannot carry block scales."""
    config = {**CONFIG, "model_type": model_type, **extra}
    tensors = fp8_folder(tmp_path / "hf", config=config)
    convert(tmp_path / "hf", tmp_path / "bf16", "--to", "paddleformers", "--tp", "2", "--ep",
            "2", "--dtype", "bfloat16", capsys=capsys)
    convert(tmp_path / "bf16", tmp_path / "back", "--to", "hf", capsys=capsys)
    with SafetensorsFile.open(tmp_path / "back" / "model.safetensors") as f:
        assert set(f.tensors) == {k for k in tensors if not k.endswith("_scale_inv")}
        for key, value in tensors.items():
            if key.endswith("e_score_correction_bias") and model_type == "deepseek_v32":
                value = value.astype(ml_dtypes.bfloat16).astype(np.float32)
            if not key.endswith("_scale_inv"):
                want = dequantized(tensors, key) if is_fp8(key) else value
                assert f.array(key).tobytes() == want.tobytes(), key
    status, err = run("convert", "--source", str(tmp_path / "hf"), "--output",
                      str(tmp_path / "fp8"), "--to", "paddleformers", capsys=capsys)
    assert status == 1
    assert ("error: 'model.layers.0.mlp.gate_proj.weight' is stored in fp8 and goes into the "
            "fused 'model.layers.0.mlp.up_gate_proj.weight', which its scales cannot follow"
            ) in err


def test_kept_in_fp8_with_scales_beside_and_back(tmp_path, capsys):
    tensors = fp8_folder(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "pf", "--to", "paddleformers", "--tp", "2", "--ep",
            "2", capsys=capsys)
    out = whole(tmp_path / "pf")
    for key, value in tensors.items():
        if key.endswith("mlp.gate.weight"):  # PaddleFormers keeps routers in float32
            value = value.astype(np.float32)
        assert out[key].dtype == value.dtype, key
        want = value.T if transposed(key) else value
        assert out[key].tobytes() == np.ascontiguousarray(want).tobytes(), key
    config = json.loads((tmp_path / "pf" / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == list(BLOCK)
    with open_source(tmp_path / "pf") as written:  # as split on the mesh
        q_b = written.shards["model.layers.0.self_attn.q_b_proj.weight"]
        scales = written.shards["model.layers.0.self_attn.q_b_proj.weight_scale_inv"]
        assert [s.local_shape for s in q_b] == [(8, 8)] * 2  # halves of [8, 16] ...
        assert [s.local_shape for s in scales] == [(4, 2)] * 2  # ... and of [4, 4]
        assert [s.global_offset[1] // 4 for s in q_b] == [s.global_offset[1] for s in scales]

    convert(tmp_path / "pf", tmp_path / "tp1", "--to", "paddleformers", capsys=capsys)
    convert(tmp_path / "tp1", tmp_path / "back", "--to", "hf", capsys=capsys)
    with SafetensorsFile.open(tmp_path / "back" / "model.safetensors") as f:
        assert set(f.tensors) == set(tensors)
        for key, value in tensors.items():
            assert f.array(key).dtype == value.dtype, key
            assert f.array(key).tobytes() == value.tobytes(), key


def test_dequantized_to_megatron_and_back(tmp_path, capsys):
    """The same dequantization for another target; kept in fp8 Megatron's fused gate and up
    (linear_fc1) are refused, their scales could not follow."""
    tensors = fp8_folder(tmp_path / "hf", config={**CONFIG, "num_nextn_predict_layers": 0})
    convert(tmp_path / "hf", tmp_path / "mg", "--to", "megatron", "--tp", "2", "--dtype",
            "bfloat16", capsys=capsys)
    convert(tmp_path / "mg", tmp_path / "back", "--to", "hf", capsys=capsys)
    with SafetensorsFile.open(tmp_path / "back" / "model.safetensors") as f:
        assert set(f.tensors) == {k for k in tensors if not k.endswith("_scale_inv")}
        for key in f.tensors:
            want = dequantized(tensors, key) if is_fp8(key) else tensors[key]
            assert f.array(key).tobytes() == want.tobytes(), key
    status, err = run("convert", "--source", str(tmp_path / "hf"), "--output",
                      str(tmp_path / "kept"), "--to", "megatron", capsys=capsys)
    assert status == 1
    assert ("error: 'model.layers.$LAYER_ID.mlp.gate_proj.weight' is stored in fp8 and goes "
            "into the fused 'decoder.layers.$LAYER_ID.mlp.linear_fc1.weight', which its scales "
            "cannot follow\n  hint: Dequantize with --dtype bfloat16.") in err


def test_a_folder_kept_in_fp8_dequantizes_when_laid_out_again(tmp_path, capsys):
    tensors = fp8_folder(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "fp8", "--to", "paddleformers", "--tp", "2",
            capsys=capsys)
    convert(tmp_path / "fp8", tmp_path / "bf16", "--to", "paddleformers", "--dtype",
            "bfloat16", capsys=capsys)
    convert(tmp_path / "hf", tmp_path / "direct", "--to", "paddleformers", "--dtype",
            "bfloat16", capsys=capsys)
    again, direct = whole(tmp_path / "bf16"), whole(tmp_path / "direct")
    assert set(again) == set(direct)
    for key, value in direct.items():
        assert again[key].tobytes() == value.tobytes(), key
    assert direct["model.layers.1.mlp.experts.3.down_proj.weight"].tobytes() == \
        np.ascontiguousarray(dequantized(
            tensors, "model.layers.1.mlp.experts.3.down_proj.weight").T).tobytes()
    record = json.loads((tmp_path / "bf16" / "aoa-conversion.json").read_text())
    assert "dequantized" in record and "fp8" not in record


def test_a_split_through_scale_blocks_is_refused(tmp_path, capsys):
    fp8_folder(tmp_path / "hf")
    status, err = run("convert", "--source", str(tmp_path / "hf"), "--output",
                      str(tmp_path / "pf"), "--to", "paddleformers", "--tp", "4",
                      capsys=capsys)
    assert status == 1, err
    # the dense MLP splits in whole blocks, the shared expert's do not (routed experts stay
    # whole on every tensor-parallel rank)
    assert ("error: the mesh (--tp 4, --ep 1, --pp 1) cuts "
            "'model.layers.1.mlp.shared_experts.gate_proj.weight' ([16, 8]) along axis 1 into "
            "parts of 2, through its fp8 scale blocks of 4") in err
    assert "hint: Choose degrees whose parts are whole blocks of 4, or dequantize" in err
    assert not (tmp_path / "pf").exists() or not any((tmp_path / "pf").iterdir())
    # dequantized, the same degree is fine
    convert(tmp_path / "hf", tmp_path / "bf16", "--to", "paddleformers", "--tp", "4",
            "--dtype", "bfloat16", capsys=capsys)


def test_a_weight_without_its_scales_is_an_error(tmp_path, capsys):
    fp8_folder(tmp_path / "hf", drop="model.layers.0.self_attn.o_proj.weight_scale_inv")
    status, err = run("convert", "--source", str(tmp_path / "hf"), "--output",
                      str(tmp_path / "pf"), "--to", "paddleformers", "--dtype", "bfloat16",
                      capsys=capsys)
    assert status == 1
    assert ("1 weight(s) stored in fp8 have no scales: "
            "'model.layers.0.self_attn.o_proj.weight' lacks "
            "'model.layers.0.self_attn.o_proj.weight_scale_inv'") in err
    assert not (tmp_path / "pf").exists()


def test_scales_without_an_fp8_config_are_named(tmp_path, capsys):
    fp8_folder(tmp_path / "hf", config=PLAIN)
    status, err = run("convert", "--source", str(tmp_path / "hf"), "--output",
                      str(tmp_path / "pf"), "--to", "paddleformers", capsys=capsys)
    assert status == 1 and "does not know" in err and "_scale_inv" in err
    assert "These look like fp8 scales, but" in err and "has no fp8 quantization_config" in err


def test_an_edited_mapping_is_refused_for_fp8(tmp_path, capsys):
    fp8_folder(tmp_path / "hf")
    edited = tmp_path / "edited.aoa"
    edited.write_text("model.norm.weight -> model.norm.weight\n")
    status, err = run("convert", "--source", str(tmp_path / "hf"), "--output",
                      str(tmp_path / "pf"), "--to", "paddleformers", "--mapping",
                      str(edited), capsys=capsys)
    assert status == 1 and "an edited mapping cannot be checked" in err


def test_the_mapping_says_what_happens_to_the_scales(tmp_path):
    from aoa.models.convert import plan_job

    fp8_folder(tmp_path / "hf")
    with open_source(tmp_path / "hf") as checkpoint:
        kept = plan_job(tmp_path / "hf", checkpoint, target="paddleformers").text
        job = plan_job(tmp_path / "hf", checkpoint, target="paddleformers", dtype="bfloat16")
        dequant, described = job.text, job.conversion.plan.describe()
    a = "model.layers.$LAYER_ID.self_attn."
    assert f"{a}o_proj.weight_scale_inv^T -> {a}o_proj.weight_scale_inv\n" in kept
    assert "# fp8 weights kept, each <weight>_scale_inv (one scale per block of 4 x 2)" in kept
    assert f"{a}o_proj.weight^T -> {a}o_proj.weight, dtype='bfloat16'\n" in dequant
    assert "# fp8 weights dequantized in the copy: each times its <weight>_scale_inv" in dequant
    statements = [line for line in dequant.splitlines() if not line.startswith("#")]
    assert not any("_scale_inv" in line for line in statements)
    assert ("    [0:8, 0:16] <- model.layers.0.self_attn.o_proj.weight[0:16, 0:8]  (permute "
            "[1, 0]; times the scales of 'model.layers.0.self_attn.o_proj.weight_scale_inv' "
            "per block of 4 x 2; cast float8_e4m3fn -> bfloat16)\n") in described


@pytest.mark.parametrize("block", [None, [128], "128x128"])
def test_a_quantization_config_must_give_its_block(tmp_path, capsys, block):
    config = {**CONFIG, "quantization_config": {"quant_method": "fp8",
                                                 "weight_block_size": block}}
    fp8_folder(tmp_path / "hf", config=config)
    status, err = run("convert", "--source", str(tmp_path / "hf"), "--output",
                      str(tmp_path / "pf"), "--to", "paddleformers", capsys=capsys)
    assert status == 1 and f"weight_block_size is {block!r}" in err


@pytest.mark.slow
@pytest.mark.skipif(PADDLE_PYTHON is None, reason="PaddlePaddle 3.3.1 venv not here")
@pytest.mark.parametrize(("mesh", "dtype"), [(["--ep", "2"], None),
                                             (["--tp", "2", "--ep", "2"], "bfloat16")],
                         ids=["kept fp8", "dequantized"])
def test_paddle_loads_the_fp8_release_converted(tmp_path, capsys, mesh, dtype):
    """Paddle 3.3.1's load_state_dict reads the Paddle FlexCheckpoint `--to paddleformers`
    writes by default: fp8 weights and their scales (kept), or the dequantized weights.

    Kept fp8 is loaded from an expert split only: Paddle 3.3.1 cannot put together whole
    tensors from fp8 boxes split along columns, its own saves' included (its resharder
    reads fp8 boxes as int8 and refuses to assign them); at the degree they were written,
    the boxes load as they are."""
    tensors = fp8_folder(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "pf", "--to", "paddleformers", *mesh,
            *(["--dtype", dtype] if dtype else []), capsys=capsys)
    want = {}
    for key, value in tensors.items():
        if dtype and key.endswith("_scale_inv"):
            continue
        if dtype and is_fp8(key):
            value = dequantized(tensors, key)
        if key.endswith("mlp.gate.weight"):  # PaddleFormers keeps routers in float32
            value = value.astype(np.float32)
        want[key] = np.ascontiguousarray(value.T if transposed(key) else value)
    loaded = paddle_load(tmp_path / "pf", {key: (value.shape, str(value.dtype))
                                           for key, value in want.items()}, tmp_path)
    assert loaded == {key: value.tobytes() for key, value in want.items()}
