"""aoa.load: a checkpoint through a mapping into numpy arrays, torch tensors and plain
buffers, checked byte for byte against numpy computing the same layout directly."""

from __future__ import annotations

import array

import ml_dtypes
import numpy as np
import pytest
from safetensors_files import save_folder
from sharding import shard_buffers

import aoa
from aoa import demo
from aoa.jobs.job import derived_outputs
from aoa.mapping import MappingText
from aoa.mesh_layout import read_mesh_layout
from aoa.storage import open_source

MAPPING = """\
w^T -> wt
a, b -> ab, axis=1
c -> c1, c2, axis=0
h -> hf, dtype='float32'
n -> n
"""


@pytest.fixture
def small(tmp_path):
    """A small checkpoint and what MAPPING makes of it, computed with numpy."""
    rng = np.random.default_rng(1)
    source = {
        "w": rng.standard_normal((3, 5), dtype=np.float32),
        "a": rng.standard_normal((4, 2), dtype=np.float32),
        "b": rng.standard_normal((4, 3), dtype=np.float32),
        "c": rng.standard_normal((6, 4), dtype=np.float32),
        "h": rng.standard_normal(8, dtype=np.float32).astype(ml_dtypes.bfloat16),
        "n": np.arange(4, dtype=np.int32).reshape(2, 2),
    }
    expected = {
        "wt": source["w"].T, "ab": np.concatenate([source["a"], source["b"]], axis=1),
        "c1": source["c"][:3], "c2": source["c"][3:], "hf": source["h"].astype(np.float32),
        "n": source["n"],
    }
    return save_folder(tmp_path, source), {k: np.ascontiguousarray(v)
                                                 for k, v in expected.items()}


def empty_like(expected: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: np.full(v.shape, 99, v.dtype) for k, v in expected.items()}


def assert_same_bytes(got, want) -> None:
    assert got.shape == want.shape
    assert np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(want).tobytes()


# -- numpy ---------------------------------------------------------------------------------


def test_numpy_arrays_filled_in_place(small):
    folder, expected = small
    into = empty_like(expected)
    pointers = {k: v.ctypes.data for k, v in into.items()}
    loaded = aoa.load(MAPPING, source=folder, into=into, progress=False)
    for key, want in expected.items():
        assert_same_bytes(into[key], want)
        assert into[key].ctypes.data == pointers[key]
    assert loaded.nbytes == sum(v.nbytes for v in expected.values())
    assert sorted(loaded.plan.destinations[i].key for i in loaded.filled) == sorted(expected)


def test_mapping_as_a_file_a_list_or_an_open_checkpoint(small, tmp_path):
    folder, expected = small
    path = tmp_path / "m.aoa"
    path.write_text(MAPPING)
    with open_source(folder) as checkpoint:
        for mapping in (path, str(path), MAPPING.splitlines()):
            into = empty_like(expected)
            aoa.load(mapping, source=checkpoint, into=into, progress=False)
            for key, want in expected.items():
                assert_same_bytes(into[key], want)


def test_strided_numpy_destination(small):
    folder, expected = small
    into = empty_like(expected)
    base = np.zeros((5, 3), np.float32).T.copy().T  # Fortran order: not C-contiguous
    assert not base.flags.c_contiguous
    into["wt"] = base
    aoa.load(MAPPING, source=folder, into=into, progress=False)
    assert_same_bytes(base, expected["wt"])


def test_buffer_protocol_destinations(small):
    folder, expected = small
    into: dict[str, object] = empty_like(expected)
    raw = bytearray(expected["n"].nbytes)
    into["n"] = memoryview(raw).cast("B").cast("i", (2, 2))
    floats = array.array("f", [0.0] * 8)
    into["hf"] = floats
    aoa.load(MAPPING, source=folder, into=into, progress=False)
    assert bytes(raw) == expected["n"].tobytes()
    assert floats.tobytes() == expected["hf"].tobytes()


class DlpackOnly:
    """An object that offers its bytes by DLPack alone."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    def __dlpack__(self, **kwargs):
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


def test_dlpack_destination(small):
    folder, expected = small
    into: dict[str, object] = empty_like(expected)
    target = np.zeros((5, 3), np.float32)
    into["wt"] = DlpackOnly(target)
    aoa.load(MAPPING, source=folder, into=into, progress=False)
    assert_same_bytes(target, expected["wt"])


def test_numpy_backend_gives_the_same_bytes(small):
    folder, expected = small
    into = empty_like(expected)
    aoa.load(MAPPING, source=folder, into=into, progress=False, backend="numpy")
    for key, want in expected.items():
        assert_same_bytes(into[key], want)


# -- shards --------------------------------------------------------------------------------


@pytest.fixture
def llama(tmp_path):
    """The demo's Llama-like checkpoint and its tensor-parallel-2 destination layout."""
    hf = demo.make_checkpoint(tmp_path)
    mapping = demo.data_file("llama_fused_tp2.aoa")
    with open_source(tmp_path) as checkpoint:
        outputs = derived_outputs(MappingText(mapping.read_text()), checkpoint.shards)
    shards = read_mesh_layout(demo.data_file("llama_tp2.toml")).shards(outputs)
    ranks = [shards.of_rank(rank) for rank in range(len(shards.ranks))]
    return tmp_path, hf, mapping, shards.by_key, ranks


def test_both_tensor_parallel_shards_in_one_process(llama):
    folder, hf, mapping, _, ranks = llama
    into = shard_buffers([s for shards in ranks for s in shards])
    aoa.load(mapping, source=folder, into=into, progress=False)
    for rank in range(2):
        for key, want in demo.expected_shards(hf, rank).items():
            assert_same_bytes(into[key][rank].buffer, want)


def test_one_rank_with_the_whole_layout_given(llama):
    folder, hf, mapping, destination, ranks = llama
    into = shard_buffers(ranks[1])
    loaded = aoa.load(mapping, source=folder, into=into, destination=destination,
                      progress=False)
    for key, want in demo.expected_shards(hf, 1).items():
        assert_same_bytes(into[key][0].buffer, want)
    assert len(loaded.filled) == len(ranks[1])
    assert len(loaded.plan.destinations) == sum(len(r) for r in ranks)


def test_one_rank_without_the_layout_is_refused(llama):
    folder, _, mapping, _, ranks = llama
    with pytest.raises(aoa.ValidationError) as error:
        aoa.load(mapping, source=folder, into=shard_buffers(ranks[1]), progress=False)
    assert error.value.message == (
        "the buffers for 'embed_tokens.weight' cover 131072 of the 262144 elements of its "
        "global shape [1024, 256]")
    assert error.value.hint.startswith("Give the whole destination layout with destination=")


# -- torch ---------------------------------------------------------------------------------


def test_torch_cpu_tensors(llama):
    torch = pytest.importorskip("torch")
    folder, hf, mapping, _, ranks = llama
    into: dict[str, list[aoa.Shard]] = {}
    for s in (s for shards in ranks for s in shards):
        tensor = torch.full(s.local_shape, 7, dtype=getattr(torch, s.dtype or "float32"))
        into.setdefault(s.key, []).append(aoa.Shard(tensor, s.global_shape, s.global_offset))
    pointers = {k: [s.buffer.data_ptr() for s in v] for k, v in into.items()}
    aoa.load(mapping, source=folder, into=into, progress=False)
    for rank in range(2):
        for key, want in demo.expected_shards(hf, rank).items():
            tensor = into[key][rank].buffer
            assert str(tensor.dtype) == f"torch.{want.dtype}"
            got = tensor.view(torch.uint8).numpy() if tensor.dim() else tensor.numpy()
            assert got.tobytes() == np.ascontiguousarray(want).tobytes()
            assert tensor.data_ptr() == pointers[key][rank]


def test_torch_strided_tensor_and_grad(small):
    torch = pytest.importorskip("torch")
    folder, expected = small
    into: dict[str, object] = empty_like(expected)
    strided = torch.zeros(3, 5).t()  # the transpose of a contiguous tensor
    into["wt"] = strided
    parameter = torch.nn.Parameter(torch.zeros(4, 5))
    into["ab"] = parameter
    aoa.load(MAPPING, source=folder, into=into, progress=False)
    assert_same_bytes(strided.numpy(), expected["wt"])
    assert_same_bytes(parameter.detach().numpy(), expected["ab"])


# -- errors --------------------------------------------------------------------------------


def _renamed(into):
    into["wtt"] = into.pop("wt")


def _without_c2(into):
    del into["c2"]


def _transposed(into):
    into["wt"] = np.zeros((3, 5), np.float32)


def _shards_of_a_wider_tensor(into):
    into["wt"] = [aoa.Shard(np.zeros((5, 2), np.float32), (5, 4), (0, 0)),
                  aoa.Shard(np.zeros((5, 2), np.float32), (5, 4), (0, 2))]


def _bfloat16(into):
    into["hf"] = np.zeros(8, ml_dtypes.bfloat16)


@pytest.mark.parametrize(("change", "message", "hint"), [
    (_renamed, "'wtt' has a buffer, but no statement writes it and the source has no key "
     "of that name", "Did you mean 'wt', which the mapping makes and no buffer is given for?"),
    (_without_c2, "the mapping makes 'c2', but no buffer is given for it", None),
    (_transposed, "the buffer for 'wt' has shape [3, 5], but the mapping makes [5, 3]", None),
    (_shards_of_a_wider_tensor,
     "the buffer for 'wt' is a shard of global shape [5, 4], but the mapping makes [5, 3]",
     None),
    (_bfloat16, "the buffer for 'hf' is bfloat16, but the mapping makes float32",
     "Give a float32 buffer, or cast in the mapping: `... -> hf, dtype='bfloat16'`."),
], ids=["unknown-key", "missing-buffer", "wrong-shape", "wrong-global-shape", "wrong-dtype"])
def test_buffers_that_disagree_with_the_mapping(small, change, message, hint):
    folder, expected = small
    into: dict[str, object] = empty_like(expected)
    change(into)
    with pytest.raises(aoa.ValidationError) as error:
        aoa.load(MAPPING, source=folder, into=into, progress=False)
    assert error.value.message == message
    if hint is not None:
        assert error.value.hint == hint


def test_shard_past_its_global_shape(small):
    folder, expected = small
    into: dict[str, object] = empty_like(expected)
    into["wt"] = aoa.Shard(np.zeros((5, 3), np.float32), (5, 3), (1, 0))
    with pytest.raises(aoa.UsageError) as error:
        aoa.load(MAPPING, source=folder, into=into, progress=False)
    assert error.value.message == (
        "the buffer for 'wt' reaches past its global shape on axis 0: offset 1 + size 5 > 5")


@pytest.mark.parametrize(("buffer", "message"), [
    (np.frombuffer(bytes(60), np.float32).reshape(5, 3),
     "the buffer for 'wt' is read-only (numpy array)"),
    (bytes(60), "the buffer for 'wt' is read-only (bytes)"),
    (np.zeros((5, 3), np.complex64),
     "the buffer for 'wt' has dtype complex64, which aoa does not know"),
    ([[0.0] * 3] * 5, "the buffer for 'wt' is a list, which aoa cannot fill"),
    ("text", "the buffer for 'wt' is a str, which aoa cannot fill"),
])
def test_buffers_aoa_cannot_fill(small, buffer, message):
    folder, expected = small
    into: dict[str, object] = empty_like(expected)
    into["wt"] = buffer
    with pytest.raises(aoa.UsageError) as error:
        aoa.load(MAPPING, source=folder, into=into, progress=False)
    assert error.value.message == message


def test_the_compiler_still_validates(small):
    folder, expected = small
    into = empty_like(expected)
    with pytest.raises(aoa.ShapeError):
        aoa.load("w -> x, y, axis=1", source=folder, into=into, progress=False)


def test_load_compiles_twice(small, monkeypatch):
    """Once on its own, to check the buffers against what the mapping makes; once against
    the buffers' shards, to plan (see aoa/jobs/job.py)."""
    from aoa.jobs import job

    calls = []
    analyze = job.analyze
    monkeypatch.setattr(job, "analyze", lambda *a, **k: calls.append(1) or analyze(*a, **k))
    folder, expected = small
    aoa.load(MAPPING, source=folder, into=empty_like(expected), progress=False)
    assert len(calls) == 2


# -- one source into several destinations; tied weights ---------------------------------------


@pytest.fixture
def embedding(tmp_path):
    rng = np.random.default_rng(6)
    arrays = {"embed": rng.standard_normal((6, 4), dtype=np.float32),
              "head": rng.standard_normal((6, 4), dtype=np.float32)}
    return save_folder(tmp_path, arrays), arrays


@pytest.mark.parametrize("mapping", ["embed -> embed\nembed -> lm_head",
                                     "embed -> lm_head\nembed -> embed",
                                     "embed -> lm_head"],
                         ids=["kept-first", "kept-last", "kept-by-name"])
def test_one_source_into_two_destinations_in_any_order(embedding, mapping):
    folder, arrays = embedding
    into = {"embed": np.zeros((6, 4), np.float32), "lm_head": np.zeros((6, 4), np.float32),
            "head": np.zeros((6, 4), np.float32)}
    aoa.load(mapping + "\nhead -> head", source=folder, into=into, progress=False)
    assert_same_bytes(into["embed"], arrays["embed"])
    assert_same_bytes(into["lm_head"], arrays["embed"])
    assert_same_bytes(into["head"], arrays["head"])


def test_buffers_of_one_memory_are_filled_once_as_the_first_key_made(embedding):
    """Tied weights: one array under two keys. The source holds both tensors (an untied
    save); the first key the mapping makes decides, as transformers ties after loading."""
    folder, arrays = embedding
    shared = np.zeros((6, 4), np.float32)
    loaded = aoa.load("head -> lm_head\nembed -> embed", source=folder,
                      into={"embed": shared, "lm_head": shared}, progress=False)
    assert_same_bytes(shared, arrays["embed"])
    assert [loaded.plan.destinations[i].key for i in loaded.filled] == ["embed"]
    assert loaded.notes[0] == ("note: the buffer for 'lm_head' is the same memory as the one "
                               "for 'embed' (tied weights): filled once, as 'embed'")


def test_a_tied_key_the_mapping_does_not_make_is_filled_through_its_twin(embedding):
    folder, arrays = embedding
    shared = np.zeros((6, 4), np.float32)
    aoa.load("embed -> embed\nhead -> _", source=folder,
             into={"lm_head": shared, "embed": shared}, progress=False)
    assert_same_bytes(shared, arrays["embed"])


def test_buffers_of_one_memory_for_different_boxes_are_refused(embedding):
    folder, _ = embedding
    half = np.zeros((3, 4), np.float32)
    with pytest.raises(aoa.ValidationError) as error:
        aoa.load("embed -> lm_head\nhead -> _", source=folder, progress=False,
                 into={"embed": aoa.Shard(half, (6, 4), (0, 0)),
                       "lm_head": aoa.Shard(half, (6, 4), (3, 0))})
    assert error.value.message == ("the buffers for 'embed' and 'lm_head' are the same "
                                   "memory, but stand for different boxes of their tensors")


def test_tied_buffers_that_nothing_fills_are_refused(embedding):
    folder, _ = embedding
    shared = np.zeros((6, 4), np.float32)
    with pytest.raises(aoa.ValidationError) as error:
        aoa.load("embed -> _\nhead -> _", source=folder, progress=False,
                 into={"x": shared, "y": shared})
    assert error.value.message == (
        "the buffers for 'x' and 'y' are the same memory (tied weights), but the mapping "
        "makes none of them, and the source has no key of those names")


def _overlapping_views() -> dict[str, tuple]:
    """Pairs of buffers for 'embed' and 'head' ([6, 4] each) that share some memory."""
    flat = np.zeros(40, np.float32)
    wide = np.zeros((6, 8), np.float32)
    reversed_rows = np.zeros((6, 4), np.float32)
    return {"shifted": (flat[:24].reshape(6, 4), flat[16:].reshape(6, 4)),
            "a strided view across another": (wide[:, 2:6], wide[:, ::2]),
            "one reversed over the other": (reversed_rows, reversed_rows[::-1])}


@pytest.mark.parametrize("case", sorted(_overlapping_views()))
def test_buffers_that_share_memory_are_refused_before_a_byte_moves(embedding, case):
    folder, _ = embedding
    embed, head = _overlapping_views()[case]
    with pytest.raises(aoa.ValidationError) as error:
        aoa.load("embed -> embed\nhead -> head", source=folder, progress=False,
                 into={"embed": embed, "head": head})
    assert error.value.message == ("the buffers for 'embed' and 'head' share memory: each "
                                   "would be written over the other")
    assert not embed.any() and not head.any()


def test_boxes_of_one_key_that_share_memory_are_refused(embedding):
    folder, _ = embedding
    rows = np.zeros((5, 4), np.float32)
    with pytest.raises(aoa.ValidationError) as error:
        aoa.load("embed -> embed\nhead -> _", source=folder, progress=False,
                 into={"embed": [aoa.Shard(rows[:3], (6, 4), (0, 0)),
                                 aoa.Shard(rows[2:], (6, 4), (3, 0))]})
    assert error.value.message == ("two buffers for 'embed' (the boxes at [0, 0] and [3, 0]) "
                                   "share memory: each would be written over the other")


def test_interleaved_views_of_one_array_are_filled(embedding):
    """`fused[:, ::2]` and `fused[:, 1::2]`: their byte ranges meet, their elements do not."""
    folder, arrays = embedding
    fused = np.zeros((6, 8), np.float32)
    aoa.load("embed -> embed\nhead -> head", source=folder, progress=False,
             into={"embed": fused[:, ::2], "head": fused[:, 1::2]})
    want = np.empty((6, 8), np.float32)
    want[:, ::2], want[:, 1::2] = arrays["embed"], arrays["head"]
    assert_same_bytes(fused, want)


def test_torch_views_that_share_storage_are_refused(embedding):
    torch = pytest.importorskip("torch")
    folder, _ = embedding
    flat = torch.zeros(40)
    with pytest.raises(aoa.ValidationError) as error:
        aoa.load("embed -> embed\nhead -> head", source=folder, progress=False,
                 into={"embed": flat[:24].view(6, 4), "head": flat[12:36].view(6, 4)})
    assert error.value.message.startswith("the buffers for 'embed' and 'head' share memory")
    assert not flat.any()


def test_tied_qwen2_embeddings_load_into_the_state_dict(tmp_path):
    """transformers saves a tied model's embedding once; `model.state_dict()` holds it under
    both names, as one tensor. The loaded model gives the saved model's logits."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2Config(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    saved = transformers.Qwen2ForCausalLM(config).eval()
    saved.save_pretrained(tmp_path, safe_serialization=True)
    tokens = torch.randint(0, 64, (1, 7))
    for mapping in ([], "model.embed_tokens.weight -> lm_head.weight"):
        fresh = transformers.Qwen2ForCausalLM(config).eval()
        state = fresh.state_dict()
        assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()
        aoa.load(mapping, source=tmp_path, into=state, progress=False)
        with torch.no_grad():
            assert torch.equal(fresh(tokens).logits, saved(tokens).logits)
