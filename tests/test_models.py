"""The model library without transformers: mappings made from config.json, the layout they
give, and the mistakes a conversion refuses with a clear error and nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from frameworks import PADDLE_PYTHON, paddle_load

import aoa
from aoa.cli import main
from aoa.dtypes import numpy_dtype
from aoa.models import FAMILIES, Config, Mesh, ModelError, known_model_types, mapping_for
from aoa.storage.formats import open_source
from aoa.storage.safetensors import SafetensorsFile, write_safetensors

LLAMA = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4,
         "tie_word_embeddings": False}
QWEN3 = {**LLAMA, "model_type": "qwen3", "head_dim": 4}


def hf_folder(folder: Path, config: dict, *, drop: str | None = None,
              extra: str | None = None, seed: int = 0) -> dict[str, np.ndarray]:
    """A Hugging Face folder holding exactly the tensors the family lists for ``config``
    (minus ``drop``, plus ``extra``), random float32."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer.json").write_text("{}")
    cfg = Config(config)
    family = next(f for f in FAMILIES if cfg.model_type in f.model_types)
    shapes = {k: v.shape for k, v in family.tensors(cfg).items() if k != drop}
    if extra:
        shapes[extra] = (2,)
    rng = np.random.default_rng(seed)
    tensors = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    write_model(folder, tensors)
    return tensors


def write_model(folder: Path, tensors: dict[str, np.ndarray]) -> None:
    """``folder``/model.safetensors holding ``tensors`` as they are."""
    def fill(views):
        for name, view in views.items():
            np.frombuffer(view, np.uint8)[:] = tensors[name].view(np.uint8).reshape(-1)

    write_safetensors(folder / "model.safetensors",
                      [aoa.ShardDesc.full(k, v.shape, str(v.dtype)) for k, v in tensors.items()],
                      None, fill)


def assert_holds_exactly(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """The safetensors file ``path`` holds ``tensors`` and nothing else, byte for byte."""
    with SafetensorsFile.open(path) as f:
        assert set(f.tensors) == set(tensors)
        for key, value in tensors.items():
            assert f.array(key).tobytes() == value.tobytes(), key


def run(*arguments: str, capsys) -> tuple[int, str, str]:
    status = main(list(arguments))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_every_family_maps_its_config():
    assert {"llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral",
            "deepseek_v3", "glm4_moe", "gpt_oss", "gemma3_text", "phi3", "ernie4_5"} <= set(
        known_model_types())


def test_mapping_text_is_what_a_person_writes():
    mapping = mapping_for(QWEN3, "paddleformers", Mesh(tp=2))
    lines = [line for line in mapping.forward.splitlines() if not line.startswith("#")]
    assert ("model.layers.$LAYER_ID.self_attn.q_proj.weight^T, "
            "model.layers.$LAYER_ID.self_attn.k_proj.weight^T, "
            "model.layers.$LAYER_ID.self_attn.v_proj.weight^T -> "
            "model.layers.$LAYER_ID.self_attn.qkv_proj.weight, fused_qkv, num_heads=8, "
            "num_key_value_groups=4") in lines
    assert ("model.layers.$LAYER_ID.mlp.gate_proj.weight^T, "
            "model.layers.$LAYER_ID.mlp.up_proj.weight^T -> "
            "model.layers.$LAYER_ID.mlp.up_gate_proj.weight, fused_ffn") in lines
    assert "lm_head.weight -> model.lm_head.weight" in lines
    rules = {rule.match: rule.axes for rule in mapping.layout.rules}
    assert rules["model.layers.*.qkv_proj.weight"] == {"tp": 1}
    assert rules["model.layers.*.o_proj.weight"] == {"tp": 0}
    assert rules["model.embedding.embed_tokens.weight"] == {"tp": 0}


def test_dtype_adds_casts_and_keeps_routers_float32():
    moe = {**QWEN3, "model_type": "qwen3_moe", "num_experts": 4, "moe_intermediate_size": 16}
    text = mapping_for(moe, "paddleformers", dtype="bfloat16").forward
    assert ("model.layers.$LAYER_ID.mlp.gate.weight -> model.layers.$LAYER_ID.mlp.gate.weight,"
            " dtype='float32'") in text
    assert ("model.layers.$LAYER_ID.self_attn.qkv_proj.weight -> "
            "model.layers.$LAYER_ID.self_attn.qkv_proj.weight, dtype='bfloat16'") in text


def test_expert_and_pipeline_placement():
    moe = {**QWEN3, "model_type": "qwen3_moe", "num_experts": 4, "moe_intermediate_size": 16,
           "num_hidden_layers": 4}
    mapping = mapping_for(moe, "paddleformers", Mesh(tp=2, ep=2, pp=2))
    outputs = {key: (spec_shape, "float32") for key, spec_shape in {
        "model.layers.3.mlp.experts.1.up_gate_proj.weight": (32, 32),
        "model.layers.0.mlp.experts.2.down_proj.weight": (16, 32),
        "model.layers.1.self_attn.qkv_proj.weight": (32, 64),
        "model.embedding.embed_tokens.weight": (64, 32),
        "model.lm_head.weight": (64, 32)}.items()}
    shards = mapping.layout.shards(outputs)
    listed = [s for key_shards in shards.by_key.values() for s in key_shards]
    ranks = [[listed[i] for i in rank] for rank in shards.ranks]
    held = [{s.key for s in rank} for rank in ranks]
    # ranks: pp outermost, then ep, then tp; layers 0-1 on stage 0, layers 2-3 on stage 1;
    # experts 0-1 on ep 0, experts 2-3 on ep 1; both tp ranks hold a whole expert
    assert mapping.layout.mesh == {"pp": 2, "ep": 2, "tp": 2}
    expert = "model.layers.3.mlp.experts.1.up_gate_proj.weight"
    assert [r for r, keys in enumerate(held) if expert in keys] == [4, 5]
    expert = "model.layers.0.mlp.experts.2.down_proj.weight"
    assert [r for r, keys in enumerate(held) if expert in keys] == [2, 3]
    qkv = "model.layers.1.self_attn.qkv_proj.weight"
    assert [r for r, keys in enumerate(held) if qkv in keys] == [0, 1, 2, 3]
    assert [r for r, keys in enumerate(held)
            if "model.embedding.embed_tokens.weight" in keys] == [0, 1, 2, 3]
    assert [r for r, keys in enumerate(held) if "model.lm_head.weight" in keys] == [4, 5, 6, 7]
    shards = {(s.key, s.global_offset) for rank in ranks for s in rank}
    assert (qkv, (0, 32)) in shards  # split by tp on axis 1


@pytest.mark.parametrize(("model_type", "expert"), [
    ("qwen3_moe", "up_gate_proj"), ("deepseek_v3", "gate_proj"), ("ernie4_5_moe", "up_gate_proj")])
def test_experts_stay_whole_under_tensor_parallelism_without_expert_parallelism(model_type,
                                                                                 expert):
    """PaddleFormers builds its experts at tensor parallelism 1: at --tp 2 --ep 1 both ranks
    hold each expert whole (the rule for every layer's projections must not reach them),
    while o_proj is split."""
    config = {**QWEN3, "model_type": model_type, "num_experts": 4, "n_routed_experts": 4,
              "moe_num_experts": 4, "moe_intermediate_size": 16, "moe_layer_start_index": 1,
              "first_k_dense_replace": 1, "q_lora_rank": None, "kv_lora_rank": 8,
              "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 4}
    mapping = mapping_for(config, "paddleformers", Mesh(tp=2))
    key = f"model.layers.1.mlp.experts.3.{expert}.weight"
    o_proj = "model.layers.1.self_attn.o_proj.weight"
    shards = mapping.layout.shards({key: ((32, 32), "float32"), o_proj: ((32, 32), "float32")})
    assert [(s.global_offset, s.local_shape) for s in shards.by_key[key]] == \
        [((0, 0), (32, 32))] * 2
    assert [(s.global_offset, s.local_shape) for s in shards.by_key[o_proj]] == \
        [((0, 0), (16, 32)), ((16, 0), (16, 32))]


def test_unknown_family_lists_the_known_ones():
    with pytest.raises(ModelError) as error:
        mapping_for({**LLAMA, "model_type": "bert"}, "paddleformers")
    assert ("model_type 'bert' is not a family aoa knows (known: deepseek_v3, deepseek_v32, "
            "ernie4_5, ernie4_5_moe, gemma3_text, glm4_moe, gpt_oss, kimi_k2, llama, mistral, "
            "mixtral, phi3, qwen2, qwen2_moe, qwen3, qwen3_moe, qwen3_next)") in str(error.value)
    assert "Write the mapping by hand" in error.value.render()


def test_missing_config_field_is_named():
    config = dict(LLAMA)
    del config["num_hidden_layers"]
    with pytest.raises(ModelError, match="the llama family needs 'num_hidden_layers', which "
                                         "the file does not have"):
        mapping_for(config, "paddleformers")


MIXTRAL = {**LLAMA, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2}


@pytest.mark.parametrize("config, field, value, most", [
    (LLAMA, "num_hidden_layers", 2**40, "16,384"),
    (MIXTRAL, "num_local_experts", 2**63, "16,384"),
    (LLAMA, "hidden_size", 2**63, "16,777,216"),
    ({**QWEN3, "model_type": "ernie4_5_moe", "moe_num_experts": 4, "moe_intermediate_size": 8,
      "moe_layer_start_index": 1}, "moe_num_experts", 2**40, "16,384"),
])
def test_a_count_past_aoa_s_bound_is_refused_before_any_work(config, field, value, most):
    target = "paddleformers" if config["model_type"] == "ernie4_5_moe" else "megatron"
    with pytest.raises(ModelError) as error:
        len(mapping_for({**config, field: value}, target).source_tensors)
    assert error.value.message == (f"config.json: '{field}' is {value}, more than aoa takes "
                                   f"({most})")


def test_counts_that_make_too_many_tensors_are_refused(monkeypatch):
    most = len(mapping_for(MIXTRAL, "paddleformers").source_tensors)
    monkeypatch.setattr("aoa.models.base.MAX_MODEL_TENSORS", most)
    assert len(mapping_for(MIXTRAL, "paddleformers").source_tensors) == most
    with pytest.raises(ModelError) as error:
        len(mapping_for({**MIXTRAL, "num_hidden_layers": 3}, "paddleformers").source_tensors)
    assert error.value.message == (f"config.json: its counts make more than {most} tensors, "
                                   "more than aoa maps for one model")


def test_tensor_parallel_must_divide_heads():
    with pytest.raises(ModelError, match="--tp 8 does not divide num_key_value_heads 4"):
        mapping_for(LLAMA, "paddleformers", Mesh(tp=8))


@pytest.fixture
def hf(tmp_path):
    tensors = hf_folder(tmp_path / "hf", LLAMA)
    return tmp_path / "hf", tensors


def held(folder: Path) -> dict[tuple[str, tuple[int, ...]], np.ndarray]:
    """Every box a converted folder holds, read in whatever format it is written: (key,
    global offset) -> the box's values."""
    boxes = {}
    with open_source(folder) as source:
        for key, shards in source.shards.items():
            for shard in shards:
                boxes[key, shard.global_offset] = np.frombuffer(
                    bytes(source.buffer(shard)), numpy_dtype(shard.dtype or "float32")
                ).reshape(shard.local_shape)
    return boxes


def test_convert_writes_shards_side_files_and_record(hf, tmp_path, capsys):
    folder, tensors = hf
    status, _, err = run("convert", "--source", str(folder), "--output",
                         str(tmp_path / "pf"), "--to", "paddleformers", "--tp", "2",
                         "--quiet", capsys=capsys)
    assert status == 0, err
    names = sorted(p.name for p in (tmp_path / "pf").iterdir())
    assert names == ["0.metadata", "0_0.distcp", "1_0.distcp", "aoa-conversion.json",
                     "config.json", "tokenizer.json"]  # Paddle FlexCheckpoint, PaddleFormers' own
    record = json.loads((tmp_path / "pf" / "aoa-conversion.json").read_text())
    assert record["family"] == "llama" and record["mesh"] == {"tp": 2, "ep": 1, "pp": 1}
    assert record["format"] == "paddle"
    assert record["dtype"] is None and record["aoa_version"]
    assert record["mapping"] == mapping_for(LLAMA, "paddleformers", Mesh(tp=2)).forward
    boxes = held(tmp_path / "pf")
    q = boxes["model.layers.1.self_attn.q_proj.weight", (0, 16)]
    down = boxes["model.layers.1.mlp.down_proj.weight", (32, 0)]
    assert np.array_equal(q, tensors["model.layers.1.self_attn.q_proj.weight"].T[:, 16:])
    assert np.array_equal(down, tensors["model.layers.1.mlp.down_proj.weight"].T[32:])


@pytest.mark.slow
@pytest.mark.skipif(PADDLE_PYTHON is None, reason="PaddlePaddle 3.3.1 venv not here")
def test_paddle_loads_the_paddleformers_output_as_it_is(hf, tmp_path, capsys):
    """Paddle 3.3.1's load_state_dict reads what `--to paddleformers` writes (by default
    Paddle FlexCheckpoint), each tensor as PaddleFormers holds it: the layers' linear weights
    transposed to [in, out], the rest as Hugging Face stores it."""
    folder, tensors = hf
    status, _, err = run("convert", "--source", str(folder), "--output",
                         str(tmp_path / "pf"), "--to", "paddleformers", "--tp", "2",
                         "--quiet", capsys=capsys)
    assert status == 0, err
    loaded = paddle_load(tmp_path / "pf", {key: (value.shape[::-1] if _linear(key) else
                                                 value.shape, str(value.dtype))
                                           for key, value in tensors.items()}, tmp_path)
    assert loaded == {key: np.ascontiguousarray(value.T if _linear(key) else value).tobytes()
                      for key, value in tensors.items()}


def _linear(key: str) -> bool:
    return key.startswith("model.layers.") and key.endswith("_proj.weight")


def test_edited_mapping_is_used(hf, tmp_path, capsys):
    folder, _ = hf
    status, text, _ = run("mapping", "--config", str(folder / "config.json"), "--to",
                          "paddleformers", capsys=capsys)
    assert status == 0 and "# layout (TOML" in text
    edited = text.replace("model.norm.weight -> model.norm.weight",
                          "model.norm.weight -> model.norm.weight, dtype='float16'")
    (tmp_path / "edited.aoa").write_text(edited)
    status, _, err = run("convert", "--source", str(folder), "--output", str(tmp_path / "pf"),
                         "--to", "paddleformers", "--mapping", str(tmp_path / "edited.aoa"),
                         "--quiet", capsys=capsys)
    assert status == 0, err
    assert held(tmp_path / "pf")["model.norm.weight", (0,)].dtype == np.float16
    record = json.loads((tmp_path / "pf" / "aoa-conversion.json").read_text())
    assert record["mapping"] == edited and record["mapping_origin"].endswith("edited.aoa")


@pytest.mark.parametrize(("config", "drop", "extra", "message"), [
    ({**LLAMA, "num_key_value_heads": 2}, None, None,
     "'model.layers.0.self_attn.k_proj.weight' has shape [16, 32], but "),
    (LLAMA, "model.layers.1.mlp.up_proj.weight", None,
     "the checkpoint lacks 1 tensor(s) that the llama family has for "),
    (LLAMA, None, "model.layers.0.mlp.gate_proj.bias",
     "the checkpoint holds 1 tensor(s) the llama family does not know for "),
])
def test_mistakes_are_clear_errors_and_write_nothing(tmp_path, capsys, config, drop, extra,
                                                     message):
    folder = tmp_path / "hf"
    hf_folder(folder, LLAMA, drop=drop, extra=extra)
    (folder / "config.json").write_text(json.dumps(config))
    status, _, err = run("convert", "--source", str(folder), "--output", str(tmp_path / "pf"),
                         "--to", "paddleformers", "--tp", "2", "--quiet", capsys=capsys)
    assert status == 1
    assert message in err
    assert not (tmp_path / "pf").exists()


def test_wrong_head_count_names_the_config_fields(tmp_path, capsys):
    hf_folder(tmp_path / "hf", LLAMA)
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**LLAMA, "num_key_value_heads": 2}))
    _, _, err = run("convert", "--source", str(tmp_path / "hf"), "--output",
                    str(tmp_path / "pf"), "--to", "paddleformers", "--quiet", capsys=capsys)
    assert ("gives [8 (num_key_value_heads * head_dim), 32 (hidden_size)]" in err)


def test_ernie_with_biases_is_refused_and_says_why(tmp_path, capsys):
    """PaddleFormers' ERNIE-4.5 gives its norms biases Hugging Face's lacks under use_bias."""
    config = {**LLAMA, "model_type": "ernie4_5", "use_bias": True}
    hf_folder(tmp_path / "hf", config)
    status, _, err = run("convert", "--source", str(tmp_path / "hf"), "--output",
                         str(tmp_path / "pf"), "--to", "paddleformers", "--quiet",
                         capsys=capsys)
    assert status == 1
    assert (f"{tmp_path / 'hf' / 'config.json'}: use_bias is true; aoa maps ERNIE-4.5 to "
            "paddleformers only without biases") in err
    assert "gives ERNIE-4.5's norms a bias under use_bias" in err
    assert not (tmp_path / "pf").exists()


def test_output_that_is_not_empty_is_refused(hf, tmp_path, capsys):
    folder, _ = hf
    (tmp_path / "pf").mkdir()
    (tmp_path / "pf" / "notes.txt").write_text("mine")
    status, _, err = run("convert", "--source", str(folder), "--output", str(tmp_path / "pf"),
                         "--to", "paddleformers", "--quiet", capsys=capsys)
    assert status == 1 and "the output folder is not empty" in err
    assert sorted(p.name for p in (tmp_path / "pf").iterdir()) == ["notes.txt"]


def test_unknown_family_on_the_command_line(tmp_path, capsys):
    hf_folder(tmp_path / "hf", LLAMA)
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**LLAMA, "model_type": "bert"}))
    status, _, err = run("convert", "--source", str(tmp_path / "hf"), "--output",
                         str(tmp_path / "pf"), "--to", "paddleformers", capsys=capsys)
    assert status == 1 and "known: deepseek_v3" in err and "hint: Write the mapping" in err
    assert not (tmp_path / "pf").exists()


def test_back_to_hf_and_reshard(hf, tmp_path, capsys):
    folder, tensors = hf
    for source, output, extra in ((folder, "tp2", ["--to", "paddleformers", "--tp", "2"]),
                                  (tmp_path / "tp2", "tp4", ["--to", "paddleformers",
                                                             "--tp", "4"]),
                                  (tmp_path / "tp4", "back", ["--to", "hf"])):
        status, _, err = run("convert", "--source", str(source), "--output",
                             str(tmp_path / output), *extra, "--quiet", capsys=capsys)
        assert status == 0, err
    with SafetensorsFile.open(tmp_path / "back" / "model.safetensors") as f:
        assert set(f.tensors) == set(tensors)
        for key, value in tensors.items():
            assert f.array(key).tobytes() == value.tobytes(), key
    assert not (tmp_path / "back" / "aoa-conversion.json").exists()


def test_to_hf_needs_a_converted_folder(hf, tmp_path, capsys):
    folder, _ = hf
    status, _, err = run("convert", "--source", str(folder), "--output", str(tmp_path / "x"),
                         "--to", "hf", capsys=capsys)
    assert status == 2 and "not a folder aoa converted" in err


def test_record_must_match_the_files(hf, tmp_path, capsys):
    """A TP-2 folder whose record claims TP 4 is refused, not read with the wrong layout."""
    folder, _ = hf
    run("convert", "--source", str(folder), "--output", str(tmp_path / "pf"), "--to",
        "paddleformers", "--tp", "2", "--quiet", capsys=capsys)
    record_path = tmp_path / "pf" / "aoa-conversion.json"
    record = json.loads(record_path.read_text())
    record["mesh"]["tp"] = 4
    record_path.write_text(json.dumps(record))
    status, _, err = run("convert", "--source", str(tmp_path / "pf"), "--output",
                         str(tmp_path / "back"), "--to", "hf", capsys=capsys)
    assert status == 1 and "is not laid out as the record's mesh" in err
    assert not (tmp_path / "back").exists()


def test_library_call_gives_a_compilable_mapping():
    mapping = mapping_for(LLAMA, "paddleformers")
    source = {k: [aoa.ShardDesc.full(k, v.shape, "float32")]
              for k, v in mapping.source_tensors.items()}
    plan = aoa.compile(mapping.forward, source)
    assert {d.key for d in plan.destinations} == set(mapping.source_tensors)


DEEPSEEK = {"model_type": "deepseek_v3", "vocab_size": 64, "hidden_size": 16,
            "intermediate_size": 32, "moe_intermediate_size": 8, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 4, "first_k_dense_replace": 1,
            "n_routed_experts": 4, "n_shared_experts": 1, "q_lora_rank": 8,
            "kv_lora_rank": 4, "qk_rope_head_dim": 2, "qk_nope_head_dim": 2, "v_head_dim": 2,
            "num_nextn_predict_layers": 1, "tie_word_embeddings": False}
GLM = {"model_type": "glm4_moe", "vocab_size": 64, "hidden_size": 16, "head_dim": 2,
       "intermediate_size": 32, "moe_intermediate_size": 8, "num_hidden_layers": 2,
       "num_attention_heads": 8, "num_key_value_heads": 4, "first_k_dense_replace": 1,
       "n_routed_experts": 4, "n_shared_experts": 1, "use_qk_norm": True,
       "num_nextn_predict_layers": 1, "tie_word_embeddings": False}
DEEPSEEK_V32 = {**DEEPSEEK, "model_type": "deepseek_v32", "index_n_heads": 2,
                "index_head_dim": 4, "num_key_value_heads": 4}
ERNIE_MOE = {"model_type": "ernie4_5_moe", "vocab_size": 64, "hidden_size": 16, "head_dim": 2,
             "intermediate_size": 32, "moe_intermediate_size": 8, "num_hidden_layers": 2,
             "num_attention_heads": 8, "num_key_value_heads": 4, "moe_num_experts": 4,
             "moe_num_shared_experts": 1, "moe_layer_start_index": 1,
             "num_nextn_predict_layers": 1}


def round_trip(tmp_path, capsys, *steps: list[str]) -> str:
    folder, notes = tmp_path / "hf", ""
    for index, extra in enumerate(steps):
        status, _, err = run("convert", "--source", str(folder), "--output",
                             str(tmp_path / f"out{index}"), *extra, "--quiet", capsys=capsys)
        assert status == 0, err
        notes += err
        folder = tmp_path / f"out{index}"
    return notes


@pytest.mark.parametrize("config", [DEEPSEEK, GLM, DEEPSEEK_V32],
                         ids=["deepseek_v3", "glm4_moe", "deepseek_v32"])
def test_multi_token_prediction_layers_round_trip(tmp_path, capsys, config):
    tensors = hf_folder(tmp_path / "hf", config)
    assert any(k.startswith("model.layers.2.eh_proj") for k in tensors)
    round_trip(tmp_path, capsys, ["--to", "paddleformers", "--tp", "2", "--ep", "2"],
               ["--to", "hf"])
    assert_holds_exactly(tmp_path / "out1" / "model.safetensors", tensors)
    boxes = held(tmp_path / "out0")
    eh = boxes["model.layers.2.eh_proj.weight", (0, 0)]
    assert np.array_equal(eh, tensors["model.layers.2.eh_proj.weight"].T)
    keys = {key for key, _ in boxes}
    if config is GLM:  # the MTP layer's decoder goes under transformer_layer.
        assert "model.layers.2.transformer_layer.self_attn.qkv_proj.weight" in keys
        assert "model.layers.2.norm.weight" in keys
    if config is DEEPSEEK_V32:  # so does V3.2's, with its indexer
        assert ("model.layers.2.transformer_layer.self_attn.core_attention.indexer.wk.weight"
                in keys)
        assert "model.layers.2.norm.weight" in keys


def test_ernie_mtp_block_round_trip(tmp_path, capsys):
    """ERNIE-4.5-MoE's MTP block, norms and linear_proj (beside the layers, not among them)
    go to paddleformers split like a layer on the last stage, and come back whole."""
    tensors = hf_folder(tmp_path / "hf", ERNIE_MOE)
    assert "model.mtp_linear_proj.0.weight" in tensors
    round_trip(tmp_path, capsys, ["--to", "paddleformers", "--tp", "2", "--ep", "2", "--pp",
                                  "2"], ["--to", "hf"])
    assert_holds_exactly(tmp_path / "out1" / "model.safetensors", tensors)
    boxes = held(tmp_path / "out0")
    assert np.array_equal(boxes["model.mtp_linear_proj.0.weight", (0, 0)],
                          tensors["model.mtp_linear_proj.0.weight"].T)
    qkv = {offset for key, offset in boxes if key == "model.mtp_block.0.self_attn.qkv_proj.weight"}
    assert qkv == {(0, 0), (0, 16)}  # split by tp like a layer's


@pytest.mark.parametrize(("config", "key", "dtype", "extra", "message"), [
    (ERNIE_MOE, "model.layers.1.mlp.moe_statics.e_score_correction_bias", np.int32, [],
     "'model.layers.$LAYER_ID.mlp.moe_statics.e_score_correction_bias' is stored as int32; "
     "the paddleformers target keeps it in float32, and no weight of this family is stored "
     "as integers"),
    (LLAMA, "model.norm.weight", np.int8, ["--dtype", "bfloat16"],
     "'model.norm.weight' is stored as int8; the paddleformers target casts it to bfloat16, "
     "and no weight of this family is stored as integers"),
])
def test_an_integer_tensor_the_target_casts_is_refused(tmp_path, capsys, config, key, dtype,
                                                        extra, message):
    """Cast forward it would convert, but the way back could not cast it again: a checkpoint
    that cannot come back is refused before a byte is written."""
    tensors = hf_folder(tmp_path / "hf", config)
    tensors[key] = tensors[key].astype(dtype)
    write_model(tmp_path / "hf", tensors)
    status, _, err = run("convert", "--source", str(tmp_path / "hf"), "--output",
                         str(tmp_path / "pf"), "--to", "paddleformers", *extra, "--quiet",
                         capsys=capsys)
    assert status == 1
    assert message in err
    assert not (tmp_path / "pf").exists()


KIMI_K2 = {**DEEPSEEK, "model_type": "kimi_k2", "num_nextn_predict_layers": 0}


def test_kimi_k2_to_paddleformers_and_back(tmp_path, capsys):
    """Kimi-K2's folder (DeepSeek-V3's tensors under model_type kimi_k2) goes to its
    PaddleFleet layout and comes back byte for byte; the router and its bias in float32."""
    tensors = hf_folder(tmp_path / "hf", KIMI_K2)
    round_trip(tmp_path, capsys, ["--to", "paddleformers", "--tp", "2", "--ep", "2"],
               ["--to", "hf"])
    assert_holds_exactly(tmp_path / "out1" / "model.safetensors", tensors)
    boxes = held(tmp_path / "out0")
    keys = {key for key, _ in boxes}
    assert {"model.embedding.embed_tokens.weight", "model.lm_head.weight",
            "model.layers.0.mlp.up_gate_proj.weight",
            "model.layers.1.mlp.shared_experts.up_gate_proj.weight"} <= keys
    assert np.array_equal(boxes["model.layers.1.mlp.gate.weight", (0, 0)],
                          tensors["model.layers.1.mlp.gate.weight"])  # not transposed


def test_kimi_k2_to_megatron_is_deepseek_v3s_mapping():
    kimi = mapping_for({**KIMI_K2, "num_nextn_predict_layers": 0}, "megatron", Mesh(tp=2))
    v3 = mapping_for({**DEEPSEEK, "num_nextn_predict_layers": 0}, "megatron", Mesh(tp=2))
    statements = [line for line in kimi.forward.splitlines() if not line.startswith("#")]
    assert statements == [line for line in v3.forward.splitlines() if not line.startswith("#")]
    assert kimi.layout == v3.layout


def test_kimi_k2_with_mtp_layers_is_refused(tmp_path, capsys):
    hf_folder(tmp_path / "hf", {**KIMI_K2, "num_nextn_predict_layers": 1})
    status, _, err = run("convert", "--source", str(tmp_path / "hf"), "--output",
                         str(tmp_path / "pf"), "--to", "paddleformers", "--quiet", capsys=capsys)
    assert status == 1
    assert (": num_nextn_predict_layers is 1; PaddleFormers 1.2.0 writes no "
            "multi-token-prediction layer of Kimi-K2") in err
    assert not (tmp_path / "pf").exists()


QWEN3_NEXT = {**QWEN3, "model_type": "qwen3_next", "num_experts": 4,
              "moe_intermediate_size": 16, "shared_expert_intermediate_size": 32,
              "linear_num_key_heads": 2, "linear_num_value_heads": 4,
              "linear_key_head_dim": 4, "linear_value_head_dim": 4,
              "linear_conv_kernel_dim": 4, "full_attention_interval": 2}


@pytest.mark.parametrize(("change", "message"), [
    ({"layer_types": ["full_attention"]},
     "config.json: 'layer_types' is ['full_attention']; a list of \"linear_attention\" or "
     "\"full_attention\", one for each of the 2 layers, is needed"),
    ({"attention_bias": True},
     "config.json: attention_bias is true; PaddleFormers 1.2.0 maps the q/k/v biases of "
     "Qwen3-Next but not o_proj's"),
])
def test_qwen3_next_configs_it_cannot_map(change, message):
    with pytest.raises(ModelError) as error:
        mapping_for({**QWEN3_NEXT, **change}, "paddleformers")
    assert error.value.message == message


def test_deepseek_v32_layer_kinds_must_be_one_per_layer():
    with pytest.raises(ModelError) as error:
        mapping_for({**DEEPSEEK_V32, "mlp_layer_types": ["dense"]}, "paddleformers")
    assert error.value.message == ("config.json: 'mlp_layer_types' is ['dense']; a list of "
                                   "\"dense\" or \"sparse\", one for each of the 2 layers, "
                                   "is needed")


def test_an_mtp_block_among_the_sparse_layers_is_refused(tmp_path, capsys):
    config = {**ERNIE_MOE, "moe_layer_start_index": 0}
    hf_folder(tmp_path / "hf", config)
    status, _, err = run("convert", "--source", str(tmp_path / "hf"), "--output",
                         str(tmp_path / "pf"), "--to", "paddleformers", "--quiet", capsys=capsys)
    assert status == 1
    assert (": num_nextn_predict_layers is 1, and an MTP block numbered among the sparse "
            "layers would hold experts") in err
    assert not (tmp_path / "pf").exists()


@pytest.mark.parametrize(("config", "mtp"), [(DEEPSEEK, "model.layers.2."),
                                             (DEEPSEEK_V32, "model.layers.2."),
                                             (ERNIE_MOE, "model.mtp_")],
                         ids=["deepseek_v3", "deepseek_v32", "ernie4_5_moe"])
def test_a_checkpoint_without_its_mtp_layers_converts_with_a_note(tmp_path, capsys, config,
                                                                 mtp):
    full = hf_folder(tmp_path / "all", config)
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    kept = {k: v for k, v in full.items() if not k.startswith(mtp)}
    assert len(kept) < len(full)
    write_model(folder, kept)
    notes = round_trip(tmp_path, capsys, ["--to", "paddleformers", "--tp", "2"],
                       ["--to", "hf"])
    assert "'num_nextn_predict_layers' is 1, but the checkpoint holds none of those layers" \
        in notes
    with SafetensorsFile.open(tmp_path / "out1" / "model.safetensors") as f:
        assert set(f.tensors) == set(kept)


def test_a_partial_mtp_layer_is_an_error(tmp_path, capsys):
    hf_folder(tmp_path / "hf", DEEPSEEK, drop="model.layers.2.hnorm.weight")
    status, _, err = run("convert", "--source", str(tmp_path / "hf"), "--output",
                         str(tmp_path / "pf"), "--to", "paddleformers", capsys=capsys)
    assert status == 1 and "lacks 1 tensor(s)" in err and "model.layers.2.hnorm.weight" in err


def test_demo_converts_and_comes_back(capsys):
    from aoa import demo

    assert demo.run() == 0
    out = capsys.readouterr().out
    assert "all bytes identical" in out and "every tensor byte-identical" in out


def test_the_output_format_is_one_argument(hf, tmp_path, capsys):
    """Sharded safetensors (one file per rank, DCP's sharding info) instead of Paddle
    FlexCheckpoint files, and back."""
    folder, tensors = hf
    round_trip_steps = (["--to", "paddleformers", "--tp", "2", "--output-format",
                         "dcp-safetensors"], ["--to", "hf"])
    source = folder
    for index, extra in enumerate(round_trip_steps):
        status, _, err = run("convert", "--source", str(source), "--output",
                             str(tmp_path / f"out{index}"), *extra, "--quiet", capsys=capsys)
        assert status == 0, err
        source = tmp_path / f"out{index}"
    assert sorted(p.name for p in (tmp_path / "out0").glob("rank-*")) == [
        "rank-00000-of-00002.safetensors", "rank-00001-of-00002.safetensors"]
    with SafetensorsFile.open(tmp_path / "out0" / "rank-00001-of-00002.safetensors") as f:
        assert np.array_equal(f.array("model.layers.1.mlp.down_proj.weight"),
                              tensors["model.layers.1.mlp.down_proj.weight"].T[32:])
    record = json.loads((tmp_path / "out0" / "aoa-conversion.json").read_text())
    assert record["format"] == "dcp-safetensors"
    with SafetensorsFile.open(tmp_path / "out1" / "model.safetensors") as f:
        for key, value in tensors.items():
            assert f.array(key).tobytes() == value.tobytes(), key


def test_pipeline_stages_hold_their_layers_and_come_back(tmp_path, capsys):
    config = {**LLAMA, "num_hidden_layers": 4}
    tensors = hf_folder(tmp_path / "hf", config)
    round_trip(tmp_path, capsys, ["--to", "paddleformers", "--tp", "2", "--pp", "2",
                                  "--output-format", "dcp-safetensors"], ["--to", "hf"])
    held = []
    for rank in range(4):
        with SafetensorsFile.open(tmp_path / "out0" / f"rank-{rank:05d}-of-00004.safetensors"
                                  ) as f:
            held.append(set(f.tensors))
    assert all("model.embed_tokens.weight" in held[r] for r in (0, 1))
    assert not any("model.embed_tokens.weight" in held[r] for r in (2, 3))
    assert all("lm_head.weight" in held[r] and "model.norm.weight" in held[r] for r in (2, 3))
    assert all("model.layers.1.mlp.down_proj.weight" in held[r] for r in (0, 1))
    assert all("model.layers.2.mlp.down_proj.weight" in held[r] for r in (2, 3))
    assert not any("model.layers.2.mlp.down_proj.weight" in held[r] for r in (0, 1))
    with SafetensorsFile.open(tmp_path / "out1" / "model.safetensors") as f:
        for key, value in tensors.items():
            assert f.array(key).tobytes() == value.tobytes(), key


def test_dtype_narrows_on_the_way_there_and_the_way_back_restores_the_dtype(tmp_path, capsys):
    import ml_dtypes

    config = {**QWEN3, "model_type": "qwen3_moe", "num_experts": 4, "moe_intermediate_size": 16}
    tensors = hf_folder(tmp_path / "hf", config)
    round_trip(tmp_path, capsys, ["--to", "paddleformers", "--tp", "2", "--dtype", "bfloat16"],
               ["--to", "paddleformers", "--tp", "4"], ["--to", "hf"])
    boxes = held(tmp_path / "out1")
    assert boxes["model.layers.0.mlp.gate.weight", (0, 0)].dtype == np.float32
    assert boxes["model.layers.0.self_attn.qkv_proj.weight", (0, 0)].dtype == ml_dtypes.bfloat16
    record = json.loads((tmp_path / "out1" / "aoa-conversion.json").read_text())
    assert record["dtype"] == "bfloat16" and record["mesh"]["tp"] == 4
    with SafetensorsFile.open(tmp_path / "out2" / "model.safetensors") as f:
        for key, value in tensors.items():
            back = f.array(key)
            assert back.dtype == np.float32, key
            want = value if key.endswith("mlp.gate.weight") else \
                value.astype(ml_dtypes.bfloat16).astype(np.float32)
            assert back.tobytes() == want.tobytes(), key
