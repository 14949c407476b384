"""`--to megatron`: Hugging Face checkpoints into Megatron-Core's GPTModel layout, written as
its distributed checkpoint (`torch_dist`), and back.

Without Megatron: the tensors and sharded objects aoa writes are those Megatron-Core 0.16.1
asks of a checkpoint of the same config (golden cases frozen by bench/megatron_golden.py
from the ``sharded_state_dict`` of the GPTModel it builds), each rank's file holds what
that rank would save, and every round trip gives the original bytes back. With Megatron
(marked slow): Megatron-Core loads aoa's output into its GPTModel and its logits on a
fixed input are transformers' on the same weights.
"""

from __future__ import annotations

import io
import json
import subprocess
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from frameworks import MEGATRON_PYTHON
from safetensors.numpy import load_file, save_file

from aoa.cli import main
from aoa.models import Config, ModelError, family_of, mapping_for
from aoa.storage.dcp import read_metadata
from aoa.storage.formats import open_source

GOLDEN = Path(__file__).parent / "golden" / "megatron"
CASES = sorted(path.stem for path in GOLDEN.glob("*.json"))
BENCH = Path(__file__).parent.parent / "bench"


def golden(case: str) -> dict:
    return json.loads((GOLDEN / f"{case}.json").read_text())


def experts(config: dict) -> int:
    return (config.get("num_experts") or config.get("num_local_experts")
            or config.get("n_routed_experts") or 0)


def write_hf(folder: Path, config: dict, dtype: str = "float32", seed: int = 0) -> None:
    """A Hugging Face folder of random tensors of the shapes the family lists for the
    config (the round-trip tests in test_models_round_trip.py check those lists against
    transformers' own checkpoints)."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(seed)
    expected = family_of(Config(config)).tensors(Config(config))
    arrays = {key: rng.standard_normal(spec.shape, dtype=np.float32) for key, spec in
              expected.items()}
    if dtype == "bfloat16":
        arrays = {key: value.astype(ml_dtypes.bfloat16) for key, value in arrays.items()}
    save_file(arrays, str(folder / "model.safetensors"))


def hf_bytes(folder: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        for key, value in load_file(str(file)).items():
            out[key] = (str(value.dtype), value.shape, value.tobytes())
    return out


def convert(*arguments: str) -> None:
    status = main(["convert", *arguments, "--quiet"])
    assert status == 0


def stored(folder: Path) -> tuple[dict[str, list[int]], list[str]]:
    """The keys and global shapes a checkpoint stores, and its objects' keys."""
    with open_source(folder) as source:
        assert source.format == "torch_dist"
        return ({key: list(shards[0].global_shape) for key, shards in source.shards.items()},
                sorted(source.objects()))


def to_megatron(tmp_path: Path, case: str, tp: int, *options: str, ep: int = 1,
                dtype: str = "float32") -> tuple[Path, Path]:
    hf, out = tmp_path / "hf", tmp_path / f"megatron-tp{tp}-ep{ep}"
    if not hf.exists():
        write_hf(hf, golden(case)["config"], dtype)
    convert("--source", str(hf), "--output", str(out), "--to", "megatron", "--tp", str(tp),
            "--ep", str(ep), *options)
    return hf, out


def back_to_hf(tmp_path: Path, folder: Path, hf: Path) -> None:
    back = tmp_path / f"back-{folder.name}"
    convert("--source", str(folder), "--output", str(back), "--to", "hf")
    assert hf_bytes(back) == hf_bytes(hf)


# ----------------------------------------------------------- names and shapes, round trips


@pytest.mark.parametrize("case", CASES)
def test_local_modules_store_what_megatron_asks_for(tmp_path, case):
    """With --transformer-impl local (the model Megatron builds here), the keys, global
    shapes and sharded objects are exactly those of its sharded_state_dict."""
    ep = 2 if experts(golden(case)["config"]) else 1
    hf, out = to_megatron(tmp_path, case, 2, "--transformer-impl", "local", ep=ep)
    tensors, objects = stored(out)
    want = golden(case)["sharded"]
    assert tensors == want["tensors"]
    assert objects == want["objects"]
    back_to_hf(tmp_path, out, hf)


#: latent attention's local modules keep their norms as modules; Transformer Engine's up
#: projections and a dense layer's linear_fc1 hold them (Megatron-Core's gpt_layer_specs)
LATENT_NORMS = {"self_attention.q_layernorm.weight": "self_attention.linear_q_up_proj."
                                                     "layer_norm_weight",
                "self_attention.kv_layernorm.weight": "self_attention.linear_kv_up_proj."
                                                      "layer_norm_weight"}


def transformer_engine_names(case: str) -> dict[str, list[int]]:
    """Megatron's keys with Transformer Engine modules: a layer with experts keeps its norm
    before the MLP as pre_mlp_layernorm (the local modules store it under linear_fc1, as
    the golden cases show); with latent attention, the low-rank norms and a dense layer's
    norm before its MLP are held by the linears after them (read from Megatron-Core's
    gpt_layer_specs)."""
    sharded = golden(case)["sharded"]["tensors"]
    latent = "kv_lora_rank" in golden(case)["config"]
    out = {}
    for key, shape in sharded.items():
        prefix = key.rsplit("mlp.linear_fc1.layer_norm_weight", 1)[0]
        if key.endswith("mlp.linear_fc1.layer_norm_weight") and any(
                k.startswith(prefix + "mlp.router") for k in sharded):
            key = prefix + "pre_mlp_layernorm.weight"
        out[_latent_name(key, sharded) if latent else key] = shape
    return out


def _latent_name(key: str, sharded: dict[str, list[int]]) -> str:
    for local, held in LATENT_NORMS.items():
        if key.endswith(local):
            return key.removesuffix(local) + held
    prefix = key.removesuffix("pre_mlp_layernorm.weight")
    if prefix != key and not any(k.startswith(prefix + "mlp.router") for k in sharded):
        return prefix + "mlp.linear_fc1.layer_norm_weight"
    return key


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("tp", [1, 2])
def test_transformer_engine_round_trip(tmp_path, case, tp):
    """The default modules: the same tensors (the MoE pre-MLP norm under its own name),
    every sharded object the local modules ask for and Transformer Engine's beside them
    (its attention, norms), and the original bytes back."""
    hf, out = to_megatron(tmp_path, case, tp)
    tensors, objects = stored(out)
    assert tensors == transformer_engine_names(case)
    assert set(golden(case)["sharded"]["objects"]) < set(objects)
    assert any("core_attention._extra_state" in key for key in objects)
    back_to_hf(tmp_path, out, hf)


@pytest.mark.parametrize("case", [c for c in CASES if experts(golden(c)["config"])])
@pytest.mark.parametrize("kind", ["grouped", "sequential"])
def test_expert_parallel_round_trip(tmp_path, case, kind):
    hf, out = to_megatron(tmp_path, case, 2, "--experts", kind, ep=2)
    assert stored(out)[0] == transformer_engine_names(case)
    back_to_hf(tmp_path, out, hf)


def test_sharded_objects_are_what_megatron_writes_for_none(tmp_path):
    import torch

    _, out = to_megatron(tmp_path, "llama", 1)
    with open_source(out) as source:
        values = {torch.load(io.BytesIO(data), weights_only=True)[0] is None
                  for data in source.objects().values()}
    assert values == {True}


def _chunks(folder: Path) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    """Each stored key's chunks: which file, at which global offset."""
    tensors, _ = read_metadata(memoryview((folder / ".metadata").read_bytes()),
                               folder / ".metadata")
    return {key: sorted((c.file, c.offsets) for c in tensor.chunks)
            for key, tensor in tensors.items()}


def test_each_rank_file_holds_what_that_megatron_rank_saves(tmp_path):
    """TP 2 x PP 2: layer l on stage l // 1, its own chunk of the stacked tensor; rank r's
    linear_fc1 rows are gate part r and up part r; linear_proj splits its columns; the
    embedding lives on the first stage, the head and the final norm on the last."""
    _, out = to_megatron(tmp_path, "llama", 2, "--pp", "2")
    chunks = _chunks(out)
    inner = golden("llama")["config"]["intermediate_size"]
    assert chunks["decoder.layers.mlp.linear_fc1.weight"] == [
        ("__0_0.distcp", (0, 0, 0)), ("__0_0.distcp", (0, inner, 0)),
        ("__1_0.distcp", (0, inner // 2, 0)), ("__1_0.distcp", (0, inner + inner // 2, 0)),
        ("__2_0.distcp", (1, 0, 0)), ("__2_0.distcp", (1, inner, 0)),
        ("__3_0.distcp", (1, inner // 2, 0)), ("__3_0.distcp", (1, inner + inner // 2, 0))]
    assert chunks["decoder.layers.self_attention.linear_proj.weight"] == [
        ("__0_0.distcp", (0, 0, 0)), ("__1_0.distcp", (0, 0, 16)),
        ("__2_0.distcp", (1, 0, 0)), ("__3_0.distcp", (1, 0, 16))]
    assert chunks["embedding.word_embeddings.weight"] == [("__0_0.distcp", (0, 0)),
                                                          ("__1_0.distcp", (64, 0))]
    assert chunks["output_layer.weight"] == [("__2_0.distcp", (0, 0)),
                                             ("__3_0.distcp", (64, 0))]
    assert chunks["decoder.final_layernorm.weight"] == [("__2_0.distcp", (0,))]


def test_reshard_to_other_degrees_then_back(tmp_path):
    """TP 2 x EP 2 laid out again at TP 1 (torch_dist to torch_dist: the objects carried),
    then back to the original bytes."""
    hf, out = to_megatron(tmp_path, "qwen3_moe", 2, ep=2)
    again = tmp_path / "tp1"
    convert("--source", str(out), "--output", str(again), "--to", "megatron")
    assert stored(again) == stored(out)
    assert len(_chunks(again)["decoder.layers.mlp.experts.experts.linear_fc1.weight"]) == 8
    back_to_hf(tmp_path, again, hf)


def test_other_output_formats_hold_the_module_names(tmp_path):
    """In a format that is not Megatron's own, the keys are the mapping's (the modules'
    names per layer and expert), and the way back reads them as they are."""
    hf = tmp_path / "hf"
    write_hf(hf, golden("qwen3_moe")["config"])
    out = tmp_path / "dcp-safetensors"
    convert("--source", str(hf), "--output", str(out), "--to", "megatron", "--experts",
            "sequential", "--output-format", "dcp-safetensors")
    keys = set(hf_bytes(out))
    assert "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight" in keys
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in keys
    record = json.loads((out / "aoa-conversion.json").read_text())
    assert "stacking" not in record and record["options"] == {
        "transformer_impl": "transformer_engine", "experts": "sequential"}
    back_to_hf(tmp_path, out, hf)


def test_bfloat16_weights(tmp_path):
    hf, out = to_megatron(tmp_path, "mixtral", 2, ep=2, dtype="bfloat16")
    with open_source(out) as source:
        assert {shards[0].dtype for shards in source.shards.values()} == {"bfloat16"}
    back_to_hf(tmp_path, out, hf)


def test_grouped_rows_match_numpy(tmp_path):
    """linear_qkv: for each key/value group its query heads, its key head, its value head;
    linear_fc1: gate rows then up rows (computed here from the Hugging Face tensors)."""
    hf, out = to_megatron(tmp_path, "qwen2_tied", 2)
    source = load_file(str(hf / "model.safetensors"))
    cfg = golden("qwen2_tied")["config"]
    groups, per = cfg["num_key_value_heads"], cfg["num_attention_heads"] // \
        cfg["num_key_value_heads"]
    head = cfg["head_dim"]
    with open_source(out) as stored_source:
        def whole(key: str) -> np.ndarray:
            shards = stored_source.shards[key]
            full = np.zeros(shards[0].global_shape, np.float32)
            for shard in shards:
                box = tuple(slice(o, o + n) for o, n in zip(shard.global_offset,
                                                            shard.local_shape))
                full[box] = np.frombuffer(stored_source.buffer(shard), np.float32).reshape(
                    shard.local_shape)
            return full

        qkv, fc1 = whole("decoder.layers.self_attention.linear_qkv.weight"), \
            whole("decoder.layers.mlp.linear_fc1.weight")
        bias = whole("decoder.layers.self_attention.linear_qkv.bias")
    for layer in range(cfg["num_hidden_layers"]):
        for what, got in (("weight", qkv[layer]), ("bias", bias[layer])):
            q, k, v = (source[f"model.layers.{layer}.self_attn.{n}_proj.{what}"]
                       for n in "qkv")
            rows = []
            for group in range(groups):
                rows += [q[(group * per) * head:(group + 1) * per * head],
                         k[group * head:(group + 1) * head], v[group * head:(group + 1) * head]]
            assert np.array_equal(got, np.concatenate(rows)), (layer, what)
        gate, up = (source[f"model.layers.{layer}.mlp.{n}_proj.weight"] for n in ("gate", "up"))
        assert np.array_equal(fc1[layer], np.concatenate([gate, up]))


def test_latent_attention_bytes_match_numpy(tmp_path):
    """DeepSeek-V3 at TP 2 (Transformer Engine modules): the up projections split their
    rows (whole heads) across ranks, the down projections are whole on each (duplicated
    TELinear), the low-rank norms are held by the up projections, and the router's
    expert_bias is float32 (here from bfloat16); each stored tensor is the source's."""
    hf, out = to_megatron(tmp_path, "deepseek_v3", 2, ep=2, dtype="bfloat16")
    source = load_file(str(hf / "model.safetensors"))
    chunks = _chunks(out)
    layer = "decoder.layers.1.self_attention."
    assert chunks[layer + "linear_kv_up_proj.weight"] == [("__0_0.distcp", (0, 0)),
                                                           ("__1_0.distcp", (32, 0))]
    assert {offsets for _, offsets in chunks[layer + "linear_kv_down_proj.weight"]} == {(0, 0)}
    with open_source(out) as stored_source:
        def whole(key: str) -> np.ndarray:
            shards = stored_source.shards[key]
            dtype = ml_dtypes.bfloat16 if shards[0].dtype == "bfloat16" else np.float32
            full = np.zeros(shards[0].global_shape, dtype)
            for shard in shards:
                box = tuple(slice(o, o + n) for o, n in zip(shard.global_offset,
                                                            shard.local_shape))
                full[box] = np.frombuffer(stored_source.buffer(shard), dtype).reshape(
                    shard.local_shape)
            return full

        pairs = {"linear_q_down_proj.weight": "q_a_proj.weight",
                 "linear_q_up_proj.weight": "q_b_proj.weight",
                 "linear_q_up_proj.layer_norm_weight": "q_a_layernorm.weight",
                 "linear_kv_down_proj.weight": "kv_a_proj_with_mqa.weight",
                 "linear_kv_up_proj.weight": "kv_b_proj.weight",
                 "linear_kv_up_proj.layer_norm_weight": "kv_a_layernorm.weight",
                 "linear_proj.weight": "o_proj.weight"}
        for number in (0, 1):
            for megatron_name, hf_name in pairs.items():
                got = whole(f"decoder.layers.{number}.self_attention.{megatron_name}")
                want = source[f"model.layers.{number}.self_attn.{hf_name}"]
                assert got.dtype == want.dtype and np.array_equal(got, want), megatron_name
        bias = whole("decoder.layers.1.mlp.router.expert_bias")
        want = source["model.layers.1.mlp.gate.e_score_correction_bias"]
        assert bias.dtype == np.float32 and np.array_equal(bias, want.astype(np.float32))
    back_to_hf(tmp_path, out, hf)


# -------------------------------------------------------------------------------- mistakes


def test_a_family_without_the_target_names_the_families_with_it():
    with pytest.raises(ModelError) as caught:
        mapping_for({"model_type": "gemma3_text"}, "megatron")
    assert caught.value.message == (
        "the gemma3_text family has no 'megatron' target (it has paddleformers); the model "
        "types with one: deepseek_v3, glm4_moe, kimi_k2, llama, mistral, mixtral, qwen2, "
        "qwen2_moe, qwen3, qwen3_moe")


def test_multi_token_prediction_layers_are_refused(tmp_path, capsys):
    """A DeepSeek-V3 checkpoint that holds its multi-token-prediction layer: refused, as
    --to megatron does not write Megatron's MTP block; nothing is written."""
    hf = tmp_path / "hf"
    write_hf(hf, dict(golden("deepseek_v3")["config"], num_nextn_predict_layers=1))
    out = tmp_path / "out"
    assert main(["convert", "--source", str(hf), "--output", str(out), "--to", "megatron",
                 "--quiet"]) == 1
    assert ("config.json: the checkpoint holds 1 multi-token-prediction layer(s), which "
            "--to megatron does not write") in capsys.readouterr().err
    assert not out.exists()


def test_mapping_notes_multi_token_prediction_layers_it_leaves_out(capsys, tmp_path):
    config = dict(golden("deepseek_v3")["config"], num_nextn_predict_layers=1)
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["mapping", "--config", str(tmp_path / "config.json"), "--to",
                 "megatron"]) == 0
    text = capsys.readouterr().out
    assert ("# the 1 multi-token-prediction layer(s) of num_nextn_predict_layers are not "
            "mapped") in text
    assert "model.layers.2." not in text


@pytest.mark.parametrize("options, message", [
    ({"transformer_impl": "local", "experts": "grouped"},
     "--experts grouped needs --transformer-impl transformer_engine (TEGroupedMLP)"),
    ({"transformer_impl": "apex"}, "--transformer-impl apex: choose one of "
                                   "transformer_engine, local"),
])
def test_bad_options(options, message):
    with pytest.raises(ModelError) as caught:
        mapping_for(golden("qwen3_moe")["config"], "megatron", options=options)
    assert caught.value.message == message


def test_paddleformers_takes_no_megatron_option():
    with pytest.raises(ModelError) as caught:
        mapping_for(golden("llama")["config"], "paddleformers",
                    options={"transformer_impl": "local"})
    assert caught.value.message == "--to paddleformers takes no option --transformer-impl"


@pytest.mark.parametrize("arguments, message", [
    (["--tp", "3"], "--tp 3 does not divide num_attention_heads 8 of config.json"),
    (["--pp", "3"], "--pp 3 does not divide the 2 layers of config.json"),
    (["--ep", "2"], "--ep 2: llama has no experts to place"),
])
def test_degrees_megatron_cannot_take(arguments, message):
    from aoa.models import Mesh

    mesh = Mesh(**{arguments[0][2:]: int(arguments[1])})
    with pytest.raises(ModelError) as caught:
        mapping_for(golden("llama")["config"], "megatron", mesh)
    assert caught.value.message == message


def test_a_vocabulary_tensor_parallelism_does_not_split(tmp_path):
    from aoa.models import Mesh

    config = dict(golden("llama")["config"], vocab_size=130)
    with pytest.raises(ModelError) as caught:
        mapping_for(config, "megatron", Mesh(tp=4))
    assert caught.value.message == "--tp 4 does not divide vocab_size 130 of config.json"
    assert "make_vocab_size_divisible_by" in caught.value.hint


def test_reshard_with_other_options_is_refused(tmp_path, capsys):
    _, out = to_megatron(tmp_path, "qwen3_moe", 1)
    status = main(["convert", "--source", str(out), "--output", str(tmp_path / "again"),
                   "--to", "megatron", "--experts", "sequential", "--quiet"])
    assert status == 2
    assert (f"{out} was written with --experts grouped; convert it --to hf first, then "
            "--to megatron with other options") in capsys.readouterr().err
    assert not (tmp_path / "again").exists()


def test_options_without_to_are_refused(tmp_path, capsys):
    (tmp_path / "m.aoa").write_text("a -> b\n")
    assert main(["convert", str(tmp_path / "m.aoa"), "--source", str(tmp_path), "--output",
                 str(tmp_path / "out"), "--transformer-impl", "local"]) == 2
    assert "--transformer-impl goes with --to" in capsys.readouterr().err


def test_mapping_prints_megatron_text(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(golden("mixtral")["config"]))
    assert main(["mapping", "--config", str(tmp_path / "config.json"), "--to", "megatron",
                 "--tp", "2", "--ep", "2"]) == 0
    text = capsys.readouterr().out
    assert ("model.layers.$LAYER_ID.block_sparse_moe.experts.$EXPERT_ID.w1.weight, "
            "model.layers.$LAYER_ID.block_sparse_moe.experts.$EXPERT_ID.w3.weight -> "
            "decoder.layers.$LAYER_ID.mlp.experts.linear_fc1.weight$EXPERT_ID, axis=0") in text
    assert "# tp = { axis = 0, blocks = 2 }" in text


# ---------------------------------------------------------------- Megatron-Core itself


@pytest.mark.slow
@pytest.mark.skipif(MEGATRON_PYTHON is None, reason="no Megatron-Core environment "
                    "(/work/megatron-venv, .megatron-venv or AOA_MEGATRON_PYTHON)")
def test_megatron_loads_the_output_and_its_logits_are_transformers(tmp_path):
    """Each case as a transformers model with random weights, converted at TP 2 (EP 2 with
    experts) with the local modules, loaded by Megatron-Core into the GPTModel it builds
    for the config: its sharded_state_dict is the golden one and its logits on a fixed
    input are transformers' (float32, both on the CPU). DeepSeek-V3's core attention is the
    stand-in bench/megatron_model.py gives it (Megatron-Core's local one cannot take latent
    attention); everything else is Megatron's."""
    import torch
    import transformers

    jobs, expected = [], {}
    for case in CASES:
        config = golden(case)["config"]
        model_config = transformers.AutoConfig.for_model(**config)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(model_config).eval()
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.copy_(torch.randn_like(parameter) * 0.5)
            for name, buffer in model.named_buffers():  # DeepSeek's router correction
                if name.endswith("e_score_correction_bias"):
                    buffer.copy_(torch.randn_like(buffer) * 0.5)
            ids = torch.tensor([[3, 17, 42, 99, 5, 64, 8, 21, 100, 7, 1, 2]])
            expected[case] = model(ids).logits.numpy()
        hf = tmp_path / case / "hf"
        model.save_pretrained(hf)
        out = tmp_path / case / "megatron"
        convert("--source", str(hf), "--output", str(out), "--to", "megatron", "--tp", "2",
                "--ep", "2" if experts(config) else "1", "--transformer-impl", "local")
        jobs.append({"checkpoint": str(out), "config": str(hf / "config.json"),
                     "out": str(tmp_path / case / "megatron.json")})
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    result = subprocess.run([str(MEGATRON_PYTHON), str(BENCH / "megatron_model.py"),
                             str(tmp_path / "jobs.json")], capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    for case, job in zip(CASES, jobs):
        got = json.loads(Path(job["out"]).read_text())
        assert {k: got[k] for k in ("tensors", "objects")} == golden(case)["sharded"], case
        logits = np.array(got["logits"], np.float32)
        scale = np.abs(expected[case]).max()
        assert np.abs(logits - expected[case]).max() <= 1e-5 * max(scale, 1.0), case
