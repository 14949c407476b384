"""Fuzz the front end: whatever the statements, shard descriptions or files, aoa either
compiles a plan that runs or raises an AoaError. Any other exception fails the test.

Statement text is built from the pieces AOA programs are made of (names, templates,
attributes, numbers at the edges), mangled at random now and then; JSON files are any JSON,
and the shapes a mapping or shard-info file takes with wrong values inside. A plan that
compiles is run by the numpy reference and the C++ kernel, which must agree byte for byte.
Run many more cases with ``AOA_FUZZ_EXAMPLES`` (tests/fuzzing.py).
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import numpy as np
import pytest
from fuzzing import NUMBERS, deeply_nested, dumps, fuzz_settings, json_values
from hypothesis import given
from hypothesis import strategies as st

import aoa
from aoa import cli
from aoa.dtypes import NUMPY_DTYPES, numpy_dtype
from aoa.errors import AoaError
from aoa.runtime import cpp_backend, numpy_backend
from aoa.runtime.lower import kernel_copies

#: Source keys the statements name, and their global shapes.
SOURCE_SHAPES = {
    "w": (4, 6), "a": (8, 6), "b": (8, 6), "v": (6,), "s": (), "z": (0, 3),
    "l.0.w": (4, 4), "l.1.w": (4, 4), "l.2.w": (4, 4),
    "l.0.e.0.w": (2, 4), "l.0.e.1.w": (2, 4), "l.1.e.0.w": (2, 4),
    "e.0.w": (4, 2), "e.1.w": (4, 2), "p_0": (2, 6), "p_1": (2, 6),
    "w.w_0": (4, 6), "w.moment1_0": (4, 6), "w.beta1_pow_acc_0": (1,),
    "qkv": (8, 16), "ffn": (4, 8),
}
DTYPES = sorted(NUMPY_DTYPES)

NAMES = [
    *SOURCE_SHAPES, "t", "u", "d", "_", "w^T", "a^T", "t^T", "qkv^T", "l.$LAYER_ID.w",
    "l.$LAYER_ID.e.$EXPERT_ID.w", "m.$LAYER_ID.e.$EXPERT_ID.w", "l.$LAYER_ID_OFFSET.w",
    "m.$LAYER_ID_OFFSET.w", "m.$LAYER_ID.w", "e.*.w", "f.*.w", "p[0:2]", "q[0:3]", "q[1:9]",
    "p[0:99999999999999999999]", "r[0:10000000]", "x.$LAYER_ID.$LAYER_ID",
    "$LAYER_ID", "*", "**", "w^T^T", "fused_ffn", "axis",
]

ATTRIBUTES = [
    "axis=0", "axis=1", "axis=2", "axis=" + "9" * 4301, "axis=99999999999999999999",
    "permute='[1, 0]'", "permute='[]'", "permute='[0, \"x\"]'", "permute='[[[[1]]]]'",
    "permute='[" + "[" * 200 + "]'", "permute='[2, 0, 1]'", "permute='(1, 0)'",
    "permute='[-1, 0]'", "permute='[1e9, 0]'", "transpose='[1, 0]'", "dtype='bfloat16'",
    "dtype='float8_e4m3fn'", "dtype='float33'", "dtype=3", "dtype='\\ud800'",
    "src_dtype='float32'", "dst_dtype='float16'", "fused_ffn", "fused_qkv", "fused_qkv_old",
    "num_heads=4", "num_heads=2", "num_heads=0", "num_heads=" + "9" * 30,
    "num_key_value_groups=2", "num_key_value_groups=1", "num_key_value_groups=999999999",
    "num_heads='4'", "unknown=1",
]

JUNK = st.text(alphabet="->,=[]:'\"#$*^T_.0123456789 \t\r\nabz\x00\u00e9\ud800", max_size=6)


@st.composite
def statement_text(draw) -> str:
    left = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=3))
    right = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=4))
    attributes = draw(st.lists(st.sampled_from(ATTRIBUTES), max_size=3))
    text = f"{', '.join(left)} -> {', '.join(right + attributes)}"
    if draw(st.integers(0, 5)) == 0:  # mangle: insert junk somewhere
        at = draw(st.integers(0, len(text)))
        text = text[:at] + draw(JUNK) + text[at:]
    return text


#: Names a statement may write: temporaries, and keys the destinations use.
WRITTEN = ["t", "u", "d", "v", "w", "qkv", "ffn", "q_0", "q_1", "m.0.w", "l.0.w"]


@st.composite
def well_formed_statement(draw, ranks=(0, 1, 2, 3)) -> str:
    """A statement of one kind, mostly over names that exist: what real mappings hold."""
    read = st.sampled_from(sorted(SOURCE_SHAPES) + ["t", "u"])
    write = st.sampled_from(WRITTEN)
    x, y, out, out2 = draw(read), draw(read), draw(write), draw(write)
    axis = draw(st.integers(0, 2))
    kind = draw(st.sampled_from([
        "rename", "split", "concat", "permute", "transpose", "cast", "cast2", "delete",
        "add", "ffn", "ffn_split", "ffn_join", "qkv_old", "qkv", "layers", "experts", "star",
        "array", "offset"]))
    heads, groups = draw(st.sampled_from([(4, 2), (2, 2), (4, 1), (8, 2), (2, 1)]))
    heads_attributes = f"num_heads={heads}, num_key_value_groups={groups}"
    permutation = list(draw(st.permutations(range(draw(st.sampled_from(ranks))))))
    dtype = draw(st.sampled_from(sorted(NUMPY_DTYPES)))
    return {
        "rename": f"{x} -> {out}",
        "split": f"{x} -> {out}, {out2}, axis={axis}",
        "concat": f"{x}, {y} -> {out}, axis={axis}",
        "permute": f"{x} -> {out}, permute='{permutation}'",
        "transpose": f"{x}^T -> {out}",
        "cast": f"{x} -> {out}, dtype='{dtype}'",
        "cast2": f"{x} -> {out}, src_dtype='float32', dst_dtype='bfloat16'",
        "delete": f"{x} -> _",
        "add": f"_ -> {out}",
        "ffn": f"{x} -> {out}, fused_ffn",
        "ffn_split": f"{x} -> {out}, {out2}, fused_ffn",
        "ffn_join": f"{x}, {y} -> {out}, fused_ffn",
        "qkv_old": f"{x} -> {out}, fused_qkv_old, {heads_attributes}",
        "qkv": f"{x}, {y}, w -> {out}, fused_qkv, {heads_attributes}",
        "layers": "l.$LAYER_ID.w -> m.$LAYER_ID.w",
        "experts": "l.$LAYER_ID.e.$EXPERT_ID.w -> m.$EXPERT_ID.e.$LAYER_ID.w",
        "star": f"e.*.w -> {out}, axis={axis}",
        "array": f"p[0:2] -> {out}, axis={axis}",
        "offset": "l.$LAYER_ID_OFFSET.w -> m.$LAYER_ID_OFFSET.w",
    }[kind]


PROGRAMS = st.one_of(
    st.lists(well_formed_statement(), min_size=1, max_size=6).map("\n".join),
    st.lists(well_formed_statement(), min_size=1, max_size=6),
    st.lists(st.one_of(well_formed_statement(), statement_text()), min_size=1,
             max_size=5).map("\n".join),
    st.lists(statement_text(), min_size=1, max_size=5),
    st.text(max_size=40),
)


@st.composite
def shard_info(draw, keys, shapes) -> dict[str, list[aoa.ShardDesc]]:
    """Shards of each key: whole, or split evenly along one axis."""
    info = {}
    for key in keys:
        shape = shapes[key]
        dtype = draw(st.sampled_from([*DTYPES, None]))
        count, axis = 1, 0
        if shape:
            axis = draw(st.integers(0, len(shape) - 1))
            count = draw(st.sampled_from([n for n in (1, 2, 4) if shape[axis] % n == 0]))
        step = shape[axis] // count if shape else 0
        shards = []
        for i in range(count):
            local, offset = list(shape), [0] * len(shape)
            if shape:
                local[axis], offset[axis] = step, i * step
            shards.append(aoa.ShardDesc(key, tuple(local), shape, tuple(offset), dtype))
        info[key] = shards
    return info


@st.composite
def sources(draw):
    left_out = draw(st.lists(st.sampled_from(sorted(SOURCE_SHAPES)), max_size=3))
    return draw(shard_info([k for k in SOURCE_SHAPES if k not in left_out], SOURCE_SHAPES))


@st.composite
def destinations(draw):
    if draw(st.booleans()):
        return None
    shapes = {key: draw(st.sampled_from([(4, 6), (6, 4), (8, 6), (16, 6), (6,), (8, 16),
                                         (16, 8), (4, 4), (2, 4)]))
              for key in ("d", "t", "w", "v", "qkv", "ffn", "l.0.w", "q_0", "m.0.w")}
    keys = draw(st.lists(st.sampled_from(sorted(shapes)), unique=True, max_size=4))
    return draw(shard_info(keys, shapes))


def run_plan(plan: aoa.Plan, seed: int) -> None:
    """Run ``plan`` through both backends on random source bytes; they must agree."""
    rng = np.random.default_rng(seed)
    sources = [rng.integers(0, 256, s.numel * numpy_dtype(s.dtype).itemsize, np.uint8)
               for s in plan.sources]
    copies = kernel_copies(plan)
    results = []
    for backend in (numpy_backend, cpp_backend):
        destinations = [np.zeros(d.numel * numpy_dtype(d.dtype).itemsize, np.uint8)
                        for d in plan.destinations]
        try:
            backend.execute_copies(copies, sources, destinations)
        except AoaError as error:
            results.append(str(error))
            continue
        results.append([d.tobytes() for d in destinations])
    assert results[0] == results[1]


@fuzz_settings
@given(PROGRAMS, sources(), destinations(), st.booleans(), st.integers(0, 2**32 - 1))
def test_fuzz_compile_raises_only_aoa_errors(statements, source, destination, reverse, seed):
    try:
        plan = aoa.compile(statements, source, destination, reverse=reverse)
    except AoaError:
        return
    run_plan(plan, seed)


# --- files given to the command line -----------------------------------------------------

SHARD_FIELDS = st.fixed_dictionaries(
    {},
    optional={"key": st.one_of(st.sampled_from(["w", "a"]), json_values()),
              "local_shape": st.one_of(st.lists(NUMBERS, max_size=3), json_values()),
              "global_shape": st.one_of(st.lists(NUMBERS, max_size=3), json_values()),
              "global_offset": st.one_of(st.lists(NUMBERS, max_size=3), json_values()),
              "dtype": st.one_of(st.sampled_from([*DTYPES, "float33"]), json_values())},
)

ANY_JSON = json_values()


@st.composite
def shard_info_json(draw):
    """Shard info of the fuzzed sources as JSON, one field of one shard maybe replaced."""
    info = {key: [shard.to_json() for shard in shards]
            for key, shards in draw(sources()).items()}
    if info and draw(st.booleans()):
        shard = draw(st.sampled_from(sorted(info)))
        field = draw(st.sampled_from(["key", "local_shape", "global_shape", "global_offset",
                                      "dtype"]))
        info[shard][0][field] = draw(st.one_of(ANY_JSON, st.lists(NUMBERS, max_size=3)))
    return info


SHARD_INFO_JSON = st.one_of(
    shard_info_json(),
    json_values(),
    st.dictionaries(st.sampled_from(["w", "a", "\ud800"]),
                    st.one_of(SHARD_FIELDS, st.lists(SHARD_FIELDS, max_size=3)), max_size=2),
)

MAPPING_JSON = st.one_of(
    st.lists(well_formed_statement(), min_size=1, max_size=6),
    json_values(),
    st.lists(st.one_of(statement_text(), json_values()), max_size=3),
    st.fixed_dictionaries({}, optional={
        "aoa_statements": st.one_of(st.lists(st.one_of(statement_text(), json_values()),
                                             max_size=3), json_values()),
        "aoa_config_reverse": json_values()}),
)


def file_content(value) -> bytes:
    """``value`` as the bytes of a file: bytes as they are, anything else as JSON."""
    return value if isinstance(value, bytes) else dumps(value).encode("utf-8", "surrogatepass")


def run_cli(arguments: list[str]) -> int:
    """``aoa`` with these arguments; raises whatever escapes it."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return cli.main(arguments)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """One folder for all cases: making and removing a folder per case costs more than it."""
    return tmp_path_factory.mktemp("fuzz")


@fuzz_settings
@given(
    mapping=st.one_of(MAPPING_JSON, st.binary(max_size=20),
                      st.sampled_from([deeply_nested(100_000, True),
                                       deeply_nested(100_000, False)]).map(str.encode)),
    mapping_suffix=st.sampled_from([".json", ".aoa"]),
    source=st.one_of(SHARD_INFO_JSON, st.binary(max_size=20),
                     st.sampled_from([deeply_nested(100_000, True)]).map(str.encode)),
    command=st.sampled_from(["check", "explain", "compile"]),
)
def test_fuzz_command_line_files_raise_only_aoa_errors(folder, mapping, mapping_suffix, source,
                                                       command):
    mapping_path = folder / f"mapping{mapping_suffix}"
    mapping_path.write_bytes(file_content(mapping))
    source_path = folder / "source.json"
    source_path.write_bytes(file_content(source))
    arguments = [command, str(mapping_path), "--source", str(source_path)]
    assert run_cli(arguments) in (cli.EXIT_OK, cli.EXIT_ERRORS, cli.EXIT_USAGE)


# --- plans read back from JSON ------------------------------------------------------------

PLAN = aoa.compile(["w -> t, u, axis=1", "u, t -> d, axis=1", "a^T -> v, dtype='bfloat16'"],
                   {"w": [aoa.ShardDesc("w", (2, 6), (4, 6), (2 * i, 0), "float32")
                          for i in range(2)],
                    "a": [aoa.ShardDesc.full("a", (8, 6), "float16")]},
                   {"d": [aoa.ShardDesc("d", (4, 3), (4, 6), (0, 3 * i), "float32")
                          for i in range(2)],
                    "v": [aoa.ShardDesc.full("v", (6, 8), "bfloat16")]}).to_json()


@st.composite
def plan_json(draw):
    """The JSON of a small real plan, with a few values anywhere in it replaced."""
    plan = json.loads(json.dumps(PLAN))
    for _ in range(draw(st.integers(1, 3))):
        container, path = plan, []
        while isinstance(container, (dict, list)) and container and draw(st.integers(0, 3)):
            key = draw(st.sampled_from(sorted(container) if isinstance(container, dict)
                                       else range(len(container))))
            path.append((container, key))
            container = container[key]
        if path:
            parent, key = path[-1]
            parent[key] = draw(st.one_of(NUMBERS, ANY_JSON, st.integers(0, 9)))
    return plan


@fuzz_settings
@given(plan_json(), st.integers(0, 2**32 - 1))
def test_fuzz_plan_json_raises_only_aoa_errors(data, seed):
    try:
        plan = aoa.Plan.loads(dumps(data))
    except AoaError:
        return
    run_plan(plan, seed)
