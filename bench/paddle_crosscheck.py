"""Freeze PaddlePaddle 3.3.1's answers on realistic mappings as golden example cases.

Mappings in the style of real checkpoints (Qwen3 TP2/TP4, Phi-3, Qwen3-MoE grouped GEMM,
Kimi-K2, GPT-OSS, LoRA save, optimizer states) and single features (quirks Q5-Q7, Q21, Q28
among them: what aoa must compute as Paddle does) are written
in the format of examples/README.md to ``tests/golden/paddle_crosscheck/<name>/`` as
``case.json`` (statements, shard layouts, queries, Paddle's entries) and ``arrays.npz``
(random source tensors and every destination shard assembled from Paddle's entries).

This script needs aoa importable (it runs under the project's ``.venv``) and the Paddle
virtual environment of bench/README.md: Paddle is asked in a subprocess, through
bench/paddle_reference.py, by ``--paddle-python`` (default /work/paddle-venv/bin/python).
The tests (tests/test_examples.py) then check aoa's bytes against these frozen answers
without Paddle.

    .venv/bin/python bench/paddle_crosscheck.py                        # all cases
    .venv/bin/python bench/paddle_crosscheck.py --only phi3 --output /tmp/golden

The source tensors come from one random stream (``default_rng(0)``) drawn in the order of
``CASES``, so a rerun writes the same arrays; ``--only`` still draws every earlier case.
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

import aoa
from aoa.dtypes import numpy_dtype

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = ROOT / "tests" / "golden" / "paddle_crosscheck"
DEFAULT_PADDLE_PYTHON = "/work/paddle-venv/bin/python"
PADDLE_REFERENCE = ROOT / "bench" / "paddle_reference.py"
SEED = 0

Shard = dict[str, Any]
Layout = dict[str, list[Shard]]
Case = tuple[list[str], Layout, Layout | None]

# Attention of the small transformer models: 4 query heads, 2 key/value heads of dim 2.
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 2
HIDDEN = HEADS * HEAD_DIM
QKV = (HEADS + 2 * KV_HEADS) * HEAD_DIM
FFN = 8
LAYERS = 2


def sharded(
    key: str, shape: list[int], shards: int = 1, axis: int = 0, dtype: str = "float32"
) -> list[Shard]:
    """``shape`` split into ``shards`` equal pieces along ``axis``, as shard descriptions."""
    step = shape[axis] // shards
    pieces = []
    for index in range(shards):
        local_shape = list(shape)
        local_shape[axis] = step
        global_offset = [0] * len(shape)
        global_offset[axis] = index * step
        pieces.append(
            {
                "key": key,
                "local_shape": local_shape,
                "global_shape": list(shape),
                "global_offset": global_offset,
                "dtype": dtype,
            }
        )
    return pieces


def layout(*tensors: list[Shard]) -> Layout:
    """A source or destination description from the shard lists of ``sharded``."""
    return {shards[0]["key"]: shards for shards in tensors}


# --- model families ----------------------------------------------------------------------


def qwen3(tensor_parallel: int) -> Case:
    """HF q/k/v (weights and biases) and gate/up into fused Paddle tensors, then a cast."""
    source: Layout = {}
    destination: Layout = {}
    for layer in range(LAYERS):
        hf = f"model.layers.{layer}."
        for key, shape in (
            ("self_attn.q_proj.weight", [HEADS * HEAD_DIM, HIDDEN]),
            ("self_attn.k_proj.weight", [KV_HEADS * HEAD_DIM, HIDDEN]),
            ("self_attn.v_proj.weight", [KV_HEADS * HEAD_DIM, HIDDEN]),
            ("self_attn.q_proj.bias", [HEADS * HEAD_DIM]),
            ("self_attn.k_proj.bias", [KV_HEADS * HEAD_DIM]),
            ("self_attn.v_proj.bias", [KV_HEADS * HEAD_DIM]),
            ("mlp.gate_proj.weight", [FFN, HIDDEN]),
            ("mlp.up_proj.weight", [FFN, HIDDEN]),
        ):
            source[hf + key] = sharded(hf + key, shape)
        paddle = f"layers.{layer}."
        destination |= layout(
            sharded(f"{paddle}self_attn.qkv_proj.weight", [HIDDEN, QKV], tensor_parallel, 1),
            sharded(f"{paddle}self_attn.qkv_proj.bias", [QKV], tensor_parallel, 0),
            sharded(
                f"{paddle}mlp.up_gate_proj.weight",
                [HIDDEN, 2 * FFN],
                tensor_parallel,
                1,
                "bfloat16",
            ),
        )
    hf = "model.layers.$LAYER_ID."
    paddle = "layers.$LAYER_ID."
    heads = f"num_heads={HEADS}, num_key_value_groups={KV_HEADS}"
    statements = [
        f"{hf}self_attn.q_proj.weight^T, {hf}self_attn.k_proj.weight^T, "
        f"{hf}self_attn.v_proj.weight^T -> {paddle}self_attn.qkv_proj.weight, fused_qkv, {heads}",
        f"{hf}self_attn.q_proj.bias, {hf}self_attn.k_proj.bias, {hf}self_attn.v_proj.bias "
        f"-> {paddle}self_attn.qkv_proj.bias, fused_qkv, {heads}, axis=0",
        f"{hf}mlp.gate_proj.weight^T, {hf}mlp.up_proj.weight^T "
        f"-> {paddle}mlp.up_gate_proj.weight, fused_ffn",
    ]
    for layer in range(LAYERS):
        fused = f"layers.{layer}.mlp.up_gate_proj.weight"
        statements.append(f"{fused} -> {fused}, dtype='bfloat16'")
    return statements, source, destination


def phi3() -> Case:
    """Phi-3's fused HF qkv and gate_up, transposed and re-laid out for TP2, layer by layer."""
    source: Layout = {}
    destination: Layout = {}
    statements = []
    for layer in range(LAYERS):
        hf = f"model.layers.{layer}."
        paddle = f"layers.{layer}."
        source |= layout(sharded(f"{hf}self_attn.qkv_proj.weight", [QKV, HIDDEN]))
        destination |= layout(sharded(f"{paddle}self_attn.qkv_proj.weight", [HIDDEN, QKV], 2, 1))
        source |= layout(sharded(f"{hf}mlp.gate_up_proj.weight", [2 * FFN, HIDDEN]))
        destination |= layout(sharded(f"{paddle}mlp.gate_up_proj.weight", [HIDDEN, 2 * FFN], 2, 1))
        statements += [
            f"{hf}self_attn.qkv_proj.weight^T -> {paddle}self_attn.qkv_proj.weight, "
            f"fused_qkv_old, num_heads={HEADS}, num_key_value_groups={KV_HEADS}, axis=1",
            f"{hf}mlp.gate_up_proj.weight^T -> {paddle}mlp.gate_up_proj.weight, fused_ffn",
        ]
    return statements, source, destination


def qwen3_moe_grouped() -> Case:
    """Four experts' weights concatenated into grouped-GEMM tensors; the router cast."""
    experts = range(4)
    source: Layout = {}
    for expert in experts:
        for projection in ("gate", "up", "down"):
            key = f"model.layers.0.mlp.experts.{expert}.{projection}_proj.weight"
            source[key] = sharded(key, [4, 4])
    source |= layout(sharded("model.layers.0.mlp.gate.weight", [4, 8], dtype="bfloat16"))
    destination = layout(
        sharded("layers.0.mlp.gate.weight", [8, 4]),
        sharded("w1", [16, 4], 2, 0),
        sharded("w2", [16, 4], 2, 0),
    )
    gates = ",".join(f"model.layers.0.mlp.experts.{e}.gate_proj.weight" for e in experts)
    downs = ",".join(f"model.layers.0.mlp.experts.{e}.down_proj.weight" for e in experts)
    statements = [
        "model.layers.$LAYER_ID.mlp.gate.weight^T -> layers.$LAYER_ID.mlp.gate.weight, "
        "dtype='float32'",
        # Deliberately one string: the two statements glued with no separator, as a hurried
        # configuration writes them ("... axis=0model.layers...").
        f"{gates} -> w1, axis=0{downs} -> w2, axis=0",
    ]
    return statements, source, destination


def kimi_k2() -> Case:
    """The router gate cast with src_dtype/dst_dtype; TP2 gate and up fused, odd spacing."""
    mlp = "model.layers.0.mlp."
    source = layout(
        sharded(f"{mlp}gate.weight", [4, 4], dtype="bfloat16"),
        sharded(f"{mlp}gate_proj.weight", [4, 4], 2, 0),
        sharded(f"{mlp}up_proj.weight", [4, 4], 2, 0),
    )
    destination = layout(
        sharded(f"{mlp}gate.weight", [4, 4]),
        sharded(f"{mlp}up_gate_proj.weight", [4, 8], 2, 1),
    )
    statements = [
        f"{mlp}gate.weight -> {mlp}gate.weight, src_dtype='bfloat16',dst_dtype='float32'",
        f"{mlp}gate_proj.weight^T ,{mlp}up_proj.weight^T ->  {mlp}up_gate_proj.weight, fused_ffn",
    ]
    return statements, source, destination


def gpt_oss_add() -> Case:
    """An empty destination declared with ``_``; the weight reshards by the identity."""
    source = layout(sharded("w", [4, 4], 2, 1))
    destination = layout(sharded("rotary.inv_freq", [2]), sharded("w", [4, 4], 4, 0))
    return ["_ -> rotary.inv_freq"], source, destination


def lora_save_full() -> Case:
    """A full export (no destination): one weight dropped, one renamed, one kept."""
    source = layout(sharded("a", [2, 2]), sharded("b", [2, 2]), sharded("c", [3]))
    return ["a -> _", "b -> b_new"], source, None


# --- single features ---------------------------------------------------------------------


def rebind_then_fused() -> Case:
    source = layout(sharded("w", [8, 2], 2, 0))
    destination = layout(sharded("d", [2, 8], 4, 1))
    return ["w^T -> w", "w -> d, fused_ffn"], source, destination


def star_right_split() -> Case:
    source = layout(*(sharded(f"e.{index}.w", [2, 2]) for index in (0, 1, 2, 10)))
    destination = layout(*(sharded(f"f.{index}.w", [2, 2]) for index in range(4)))
    return ["e.*.w -> y, axis=0", "y -> f.*.w, axis=0"], source, destination


def cast_chain() -> Case:
    source = layout(sharded("a", [4, 4]))
    destination = layout(sharded("b", [4, 4], 2, 1))
    return ["a -> a, dtype='float16'", "a -> b, dtype='float32'"], source, destination


def bf16_cast_tp() -> Case:
    source = layout(sharded("a", [4, 6], 2, 0))
    destination = layout(sharded("b", [6, 4], 3, 0, "bfloat16"))
    return ["a^T -> b, dtype='bfloat16'"], source, destination


def qkv_old_merge_tp2() -> Case:
    source = layout(sharded("q", [2, 8]), sharded("k", [2, 4]), sharded("v", [2, 4]))
    destination = layout(sharded("qkv", [2, 16], 2, 1))
    statements = ["q, k, v -> qkv, fused_qkv_old, num_heads=4, num_key_value_groups=2"]
    return statements, source, destination


def ffn_merge_tp4_axis0() -> Case:
    source = layout(sharded("g", [8, 2]), sharded("u", [8, 2]))
    destination = layout(sharded("f", [16, 2], 4, 0))
    return ["g, u -> f, fused_ffn, axis=0"], source, destination


def layer_offset_concat() -> Case:
    source = layout(*(sharded(f"layers.{layer}.w", [2]) for layer in (1, 2, 3)))
    destination = layout(*(sharded(f"layers.{layer}.v", [2]) for layer in (0, 1, 2)))
    return ["layers.$LAYER_ID_OFFSET.w -> layers.$LAYER_ID_OFFSET.v"], source, destination


def array_split() -> Case:
    source = layout(sharded("w", [2, 8], 2, 1))
    destination = layout(sharded("q", [2, 8], 2, 1))
    return ["w -> p[0:4], axis=1", "p_3, p_2, p_1, p_0 -> q, axis=1"], source, destination


def permute3d_tp() -> Case:
    source = layout(sharded("x", [2, 4, 6], 2, 2))
    destination = layout(sharded("y", [6, 2, 4], 3, 0))
    return ["x -> y, permute='[2, 0, 1]'"], source, destination


def opt_states() -> Case:
    source = layout(
        sharded("w", [2, 6], 2, 0, "bfloat16"),
        sharded("w.moment1_0", [2, 6], 2, 0),
        sharded("w.w_0", [2, 6], 2, 0),
        sharded("w.beta1_pow_acc_0", [1]),
    )
    destination = layout(
        sharded("v", [6, 2], 2, 0, "bfloat16"),
        sharded("v.moment1_0", [6, 2], 2, 0),
        sharded("v.w_0", [6, 2], 2, 1),
        sharded("v.beta1_pow_acc_0", [1]),
    )
    return ["w^T -> v"], source, destination


def alias_into_destination() -> Case:
    source = layout(sharded("a", [2, 2]))
    return ["a -> b, axis=1"], source, layout(sharded("b", [2, 2]))


def underscore_in_split() -> Case:
    return ["a -> _, b, axis=0"], layout(sharded("a", [4, 2])), None


def delete_intermediate() -> Case:
    return ["a -> t", "t -> _"], layout(sharded("a", [2, 2])), None


def full_export_order() -> Case:
    source = layout(sharded("a", [4]), sharded("b", [2]), sharded("c", [3]))
    return ["a -> t", "t -> u, v, axis=0"], source, None


def rename_chain() -> Case:
    source = layout(sharded("a", [4, 2], 2, 0))
    return ["a -> b", "b -> c", "c -> d"], source, layout(sharded("d", [4, 2], 2, 1))


def split_reuse() -> Case:
    destination = layout(sharded("p", [2, 2]), sharded("q", [2, 2]), sharded("r", [2, 2]))
    statements = ["s -> x, y, axis=1", "x -> p", "x -> q", "y^T -> r"]
    return statements, layout(sharded("s", [2, 4])), destination


def star_full_export() -> Case:
    source = layout(*(sharded(f"l.{i}.w", [1, 2]) for i in range(3)))
    return ["l.*.w -> all, axis=0"], source, None


def expert_template() -> Case:
    source = layout(*(sharded(f"e.{i}.w", [2, 3]) for i in range(3)))
    destination = layout(*(sharded(f"f.{i}.w", [3, 2], 3, 0) for i in range(3)))
    return ["e.$EXPERT_ID.w^T -> f.$EXPERT_ID.w"], source, destination


def keyword_names() -> Case:
    """Tensors spelled as attribute keywords, in templates as Paddle's macros read them."""
    source = layout(
        *(sharded(f"layers.{i}.w", [2, 3]) for i in (0, 1)),
        *(sharded(f"layers.{i}.u", [3, 2]) for i in (1, 2)),
        *(sharded(f"layers.0.experts.{e}.v", [2, 2]) for e in (0, 1)),
        sharded("axis", [2, 3]), sharded("dtype", [3, 2]), sharded("num_heads", [2, 2]),
        sharded("permute", [2, 4], 2, 1),
    )
    destination = layout(
        *(sharded(f"x.{i}.w", [4, 3], 2, 0) for i in (0, 1)),
        *(sharded(f"y.{i}.u", [3, 4], 2, 1) for i in (0, 1)),
        *(sharded(f"e.0.{e}.v", [4, 2]) for e in (0, 1)),
        sharded("p", [4, 2], 2, 0),
    )
    statements = [
        "layers.$LAYER_ID.w, axis -> x.$LAYER_ID.w, axis=0",
        "layers.$LAYER_ID_OFFSET.u, dtype -> y.$LAYER_ID_OFFSET.u, axis=1",
        "layers.$LAYER_ID.experts.$EXPERT_ID.v, num_heads -> e.$LAYER_ID.$EXPERT_ID.v, axis=0",
        "permute^T -> p",
    ]
    return statements, source, destination


def cast_then_concat() -> Case:
    source = layout(sharded("a", [2, 4]), sharded("b", [2, 4]))
    destination = layout(sharded("d", [4, 4], 2, 1, "float16"))
    statements = ["a -> a16, dtype='float16'", "a16, b -> c, axis=0",
                  "c -> d, dtype='float16'"]
    return statements, source, destination


# The order is that of the random stream: a new case goes at the end.
CASES: dict[str, Callable[[], Case]] = {
    "qwen3_tp2": lambda: qwen3(tensor_parallel=2),
    "qwen3_tp4": lambda: qwen3(tensor_parallel=4),
    "phi3": phi3,
    "qwen3_moe_grouped": qwen3_moe_grouped,
    "kimi_k2": kimi_k2,
    "gpt_oss_add": gpt_oss_add,
    "lora_save_full": lora_save_full,
    "rebind_then_fused": rebind_then_fused,
    "star_right_split": star_right_split,
    "cast_chain": cast_chain,
    "bf16_cast_tp": bf16_cast_tp,
    "qkv_old_merge_tp2": qkv_old_merge_tp2,
    "ffn_merge_tp4_axis0": ffn_merge_tp4_axis0,
    "layer_offset_concat": layer_offset_concat,
    "array_split": array_split,
    "permute3d_tp": permute3d_tp,
    "opt_states": opt_states,
    "alias_into_destination": alias_into_destination,
    "underscore_in_split": underscore_in_split,
    "delete_intermediate": delete_intermediate,
    "full_export_order": full_export_order,
    "rename_chain": rename_chain,
    "split_reuse": split_reuse,
    "star_full_export": star_full_export,
    "expert_template": expert_template,
    "keyword_names": keyword_names,
    "cast_then_concat": cast_then_concat,
}

DESCRIPTIONS = {
    "qwen3_tp2": "Qwen3-style layer: q/k/v weights and biases fused with fused_qkv (GQA), "
    "gate/up fused with fused_ffn, a bfloat16 cast rebinding each fused key "
    "(from_pretrained style), tensor-parallel 2.",
    "qwen3_tp4": "The same Qwen3-style mapping into tensor-parallel 4.",
    "phi3": "Phi-3-style per-layer fused_qkv_old (axis=1) and fused_ffn on transposed HF "
    "tensors, into tensor-parallel 2.",
    "qwen3_moe_grouped": "Qwen3-MoE grouped GEMM: expert weights concatenated with two "
    "statements glued by a missing comma, and a transposed gate cast to float32.",
    "kimi_k2": "Kimi-K2: src_dtype/dst_dtype cast of the router gate and fused_ffn of TP2 "
    "sources with ^T and odd spacing.",
    "gpt_oss_add": "GPT-OSS: `_ -> rotary.inv_freq` declares an empty destination; the "
    "weight reshards TP2 columns -> TP4 rows by the implicit identity.",
    "lora_save_full": "LoRA save: `a -> _` drops a frozen weight, `b -> b_new` renames, no "
    "destination (full export).",
    "rebind_then_fused": "`w^T -> w` rebinding a source name, then fused_ffn from it into TP4.",
    "star_right_split": "`*` on both sides: a numeric-order concat and a split into "
    "destination keys.",
    "cast_chain": "float16 then float32 casts: the values are rounded to float16 on the way.",
    "bf16_cast_tp": "A transpose and a bfloat16 cast between TP2 and TP3 layouts.",
    "qkv_old_merge_tp2": "fused_qkv_old merge of q, k, v into the per-rank layout of a TP2 "
    "destination.",
    "ffn_merge_tp4_axis0": "fused_ffn merge of gate and up along axis 0 into TP4.",
    "layer_offset_concat": "$LAYER_ID_OFFSET maps layers 1..3 onto 0..2.",
    "array_split": "`p[0:4]` split and a reversed concat of the pieces, TP2 both sides.",
    "permute3d_tp": "A 3-D permute between differently sharded layouts.",
    "opt_states": "Optimizer states (.moment1_0, .w_0, beta pow) follow a transpose, with "
    "their own destination shardings.",
    "alias_into_destination": "`a -> b, axis=1` with one name a side is an alias (Q5); with "
    "a destination b gets a's bytes.",
    "underscore_in_split": "`_` inside a split is an ordinary name and becomes an output (Q6).",
    "delete_intermediate": "`t -> _` on an intermediate has no effect without a destination "
    "(Q7).",
    "full_export_order": "Without a destination the outputs are the unconsumed inputs, then "
    "the unconsumed intermediates.",
    "rename_chain": "Three renames in a row, resharded from rows to columns.",
    "split_reuse": "One split piece read twice and the other transposed (tied reads).",
    "star_full_export": "`*` collected into a concat, exported without a destination.",
    "expert_template": "$EXPERT_ID alone, transposed, into 3 row shards per expert.",
    "keyword_names": "Tensors named `axis`, `dtype`, `num_heads` and `permute` (Q21): in a "
    "$LAYER_ID, $LAYER_ID_OFFSET or $EXPERT_ID template from such a name on, names are taken "
    "as written, so one tensor joins every instance.",
    "cast_then_concat": "A float16 cast tensor joined with a float32 one (a cast keeps the "
    "recorded dtype, Q28), then the whole cast to float16.",
}

WHY = "Paddle 3.3.1 computes it correctly (policy 0.1); frozen from bench/paddle_reference.py"


# --- asking Paddle and assembling its answer ---------------------------------------------


def ask_paddle(case: dict[str, Any], paddle_python: str) -> list[list[dict[str, Any]]]:
    """Paddle's entries for every query of ``case``, through bench/paddle_reference.py."""
    with tempfile.TemporaryDirectory() as folder:
        case_file = Path(folder) / "case.json"
        case_file.write_text(json.dumps(case))
        result = subprocess.run(
            [paddle_python, str(PADDLE_REFERENCE), str(case_file)],
            capture_output=True,
            text=True,
        )
    if result.returncode != 0:
        sys.exit(f"{case['name']}: paddle_reference.py failed:\n{result.stderr}")
    answer = json.loads(result.stdout)
    if answer["status"] != "ok":
        sys.exit(f"{case['name']}: Paddle raised {answer.get('paddle_error')}")
    return answer["entries"]


def box(offset: list[int], shape: list[int]) -> tuple[slice, ...]:
    return tuple(slice(start, start + size) for start, size in zip(offset, shape))


def postprocess(value: np.ndarray, step: str) -> np.ndarray:
    """One of Paddle's postprocess steps: a permutation such as ``[1, 0]`` or a dtype name."""
    try:
        permutation = ast.literal_eval(step)
    except (ValueError, SyntaxError):
        permutation = None
    if isinstance(permutation, list):
        return np.transpose(value, permutation)
    return value.astype(numpy_dtype(step))


def assemble(
    query: Shard, entries: list[dict[str, Any]], arrays: dict[str, np.ndarray]
) -> np.ndarray:
    """The destination shard ``query`` built from the source arrays as Paddle's entries say."""
    shard = np.zeros(query["local_shape"], numpy_dtype(query["dtype"]))
    for entry in entries:
        source, target = entry["source"], entry["target"]
        piece = arrays[f"src::{source['key']}"][box(source["global_offset"], source["local_shape"])]
        for step in entry["postprocess"] or []:
            piece = postprocess(piece, step)
        local_offset = [
            start - origin for start, origin in zip(target["global_offset"], query["global_offset"])
        ]
        shard[box(local_offset, target["local_shape"])] = piece.astype(shard.dtype)
    return shard


def freeze(
    name: str,
    arrays: dict[str, np.ndarray],
    statements: list[str],
    source: Layout,
    destination: Layout | None,
    output: Path,
    paddle_python: str,
) -> int:
    """Ask Paddle about one case and write its folder; returns the number of queries."""
    if destination is not None:
        queries = [shard for shards in destination.values() for shard in shards]
    else:
        queries = [shard.to_json() for shard in aoa.compile(statements, source, None).destinations]
    case: dict[str, Any] = {
        "name": name,
        "what": DESCRIPTIONS[name],
        "aoa_statements": statements,
        "reverse": False,
        "source": source,
        "destination": destination,
        "queries": queries,
    }
    entries = ask_paddle(case, paddle_python)
    expected_arrays = []
    for index, (query, query_entries) in enumerate(zip(queries, entries)):
        npz_key = f"dst::{index}::{query['key']}"
        shard = assemble(query, query_entries, arrays)
        arrays[npz_key] = shard
        expected_arrays.append(
            {
                "npz_key": npz_key,
                "dtype": query["dtype"],
                "stored_as": "uint16" if shard.dtype == ml_dtypes.bfloat16 else str(shard.dtype),
                "shape": list(shard.shape),
            }
        )
    # npz cannot hold bfloat16: such arrays are stored as their bits and listed by name.
    bfloat16_keys = [key for key, array in arrays.items() if array.dtype == ml_dtypes.bfloat16]
    stored = {
        key: array.view(np.uint16) if key in bfloat16_keys else array
        for key, array in arrays.items()
    }
    case["expect"] = {"status": "ok", "entries": entries, "arrays": expected_arrays}
    case["aoa"] = {"class": "match", "why": WHY}
    case["bfloat16_as_uint16"] = bfloat16_keys
    folder = output / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "case.json").write_text(json.dumps(case, indent=1))
    np.savez(folder / "arrays.npz", **stored)
    return len(queries)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only",
        metavar="NAME",
        action="append",
        choices=list(CASES),
        help="freeze only this case (repeatable); default: all of them",
    )
    parser.add_argument(
        "--output",
        metavar="DIR",
        type=Path,
        default=DEFAULT_OUTPUT,
        help="folder that receives <name>/case.json and arrays.npz (default: %(default)s)",
    )
    parser.add_argument(
        "--paddle-python",
        metavar="PYTHON",
        default=DEFAULT_PADDLE_PYTHON,
        help="a Python with paddlepaddle==3.3.1 (default: %(default)s)",
    )
    args = parser.parse_args()
    if not Path(args.paddle_python).exists():
        sys.exit(f"no Paddle Python at {args.paddle_python}; see bench/README.md")
    rng = np.random.default_rng(SEED)
    for name, build in CASES.items():
        statements, source, destination = build()
        # Every case draws its source tensors, selected or not, to keep the stream the same.
        arrays = {
            f"src::{key}": rng.standard_normal(shards[0]["global_shape"]).astype(
                numpy_dtype(shards[0]["dtype"])
            )
            for key, shards in source.items()
        }
        if args.only and name not in args.only:
            continue
        count = freeze(
            name, arrays, statements, source, destination, args.output, args.paddle_python
        )
        print(f"{name}: {count} queries")


if __name__ == "__main__":
    main()
