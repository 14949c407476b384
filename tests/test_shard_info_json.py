"""Shard-info JSON (``--source``/``--destination`` files, case.json) is read in bulk where it
is plain; these check that the bulk path makes exactly what checking each description makes,
and refuses with the same message whatever is wrong."""

from __future__ import annotations

import json

import pytest
from fuzzing import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st

import aoa
from aoa.errors import quote
from aoa.inputs import load_json
from aoa.layout import ShardDesc, normalize_shard_info, sharded_alike
from aoa.limits import MAX_BYTES
from aoa.mapping import read_shard_info
from aoa.passes.context import Shardings
from aoa.shard_info_json import read_regular_shard_info

numbers = st.one_of(st.integers(-2, 9), st.sampled_from([True, 2.0, "3", None, 2**62]))
dtypes = st.sampled_from([None, "float32", "bfloat16", "float8_e4m3fn", "float33", 5, ["x"]])


@st.composite
def shard_dicts(draw, key):
    rank = draw(st.integers(0, 3))
    total = draw(st.lists(st.integers(0, 9), min_size=rank, max_size=rank))
    offset = [draw(st.integers(0, t)) for t in total]
    local = [draw(st.integers(0, t - o)) for o, t in zip(offset, total)]
    shard = {"key": key, "local_shape": local, "global_shape": total,
             "global_offset": offset, "dtype": draw(dtypes)}
    if draw(st.integers(0, 3)) == 0:  # something unusual about it
        field = draw(st.sampled_from(["local_shape", "global_shape", "global_offset", "key"]))
        if field == "key":
            shard["key"] = draw(st.sampled_from(["other", 3, "k\ud800"]))
        elif shard[field] and draw(st.booleans()):
            shard[field][draw(st.integers(0, len(shard[field]) - 1))] = draw(numbers)
        else:
            shard[field] = draw(st.sampled_from([(1, 2), "ab", 7, [1] * 4]))
    if draw(st.integers(0, 9)) == 0:
        del shard[draw(st.sampled_from(["key", "local_shape", "global_shape", "dtype"]))]
    return shard


@st.composite
def shard_infos(draw):
    keys = draw(st.lists(st.sampled_from(["a", "b.weight", "c\u00e9", "d\ud800"]),
                         unique=True, max_size=3))
    return {key: draw(st.lists(shard_dicts(key), max_size=3)) for key in keys}


def one_by_one(info: dict) -> dict[str, list[ShardDesc]] | str:
    """Each description made and checked on its own (what the bulk path stands in for);
    the message of the first refusal, in the order the bulk path meets them."""
    try:
        result = {}
        for key, shards in info.items():
            made = [ShardDesc.from_json(shard) for shard in shards]
            if not made:
                return f"destination shard info lists no shard of {quote(key)}"
            for shard in made:
                if shard.key != key:
                    raise aoa.UsageError(f"destination shard listed under {quote(key)} "
                                         f"describes {quote(shard.key)}")
            result[key] = made
        return result
    except aoa.UsageError as error:
        return error.message


def bulk(info: dict) -> dict[str, list[ShardDesc]] | str:
    try:
        return normalize_shard_info(json.loads(json.dumps(info)), "destination")
    except aoa.UsageError as error:
        return error.message


@fuzz_settings
@given(shard_infos())
def test_bulk_reading_makes_and_refuses_what_checking_each_does(info):
    expected = one_by_one(json.loads(json.dumps(info)))
    found = bulk(info)
    assert found == expected
    if isinstance(found, dict):
        for shards in found.values():
            for shard in shards:
                assert all(type(n) is int for n in shard.local_shape + shard.global_shape
                           + shard.global_offset)
                assert type(shard.local_shape) is tuple


def test_a_shape_too_big_is_refused_in_bulk_too():
    info = {"w": [{"key": "w", "local_shape": [1], "global_shape": [MAX_BYTES],
                   "global_offset": [0], "dtype": "float32"}]}
    with pytest.raises(aoa.UsageError) as caught:
        normalize_shard_info(info, "destination")
    assert caught.value.message == ("shard of 'w': its global shape [9223372036854775807] "
                                    "would hold more than 9223372036854775807 bytes (2**63 - 1)")


@pytest.mark.parametrize("change", [
    {"local_shape": [-1, 4]}, {"global_offset": [-1, 0]}, {"local_shape": [3, 4]},
    {"global_offset": [0, 1]}, {"global_shape": [4]}, {"local_shape": [True, 4]},
    {"global_offset": [0.0, 0]}, {"dtype": "float33"}, {"dtype": 4}, {"dtype": ["x"]}, {"key": "v"},
])
def test_each_kind_of_wrong_shard_among_right_ones_is_refused_as_alone(change):
    right = {"key": "w", "local_shape": [2, 4], "global_shape": [4, 4],
             "global_offset": [2, 0], "dtype": "bfloat16"}
    info = {"w": [dict(right, global_offset=[0, 0]), dict(right, **change)]}
    expected = one_by_one(info)
    assert isinstance(expected, str)
    assert bulk(info) == expected


# -- the regular form `json.dumps` writes, read without a JSON parser ------------------------


def parsed_and_checked(text: str, where: str = "info.json") -> dict[str, list[ShardDesc]] | str:
    """What reading ``text`` with `json.loads` and checking each description gives."""
    try:
        data = load_json(text, where)
        if not isinstance(data, dict):
            return "expected an object mapping keys to lists of shards"
        return normalize_shard_info(data, "destination")
    except aoa.UsageError as error:
        return error.message


def read_as_the_command_does(tmp_path, text: str) -> dict[str, list[ShardDesc]] | str:
    path = tmp_path / "info.json"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    try:
        return read_shard_info(path, "destination")
    except aoa.UsageError as error:
        return error.message.removeprefix(f"{path}: ")


def assert_read_as_parsed(text: str) -> dict[str, list[ShardDesc]] | None:
    """The regular form's reader gives what parsing gives, or leaves the text to it."""
    found = read_regular_shard_info(text)
    if found is not None:
        expected = parsed_and_checked(text)
        assert found == expected
        assert list(found) == list(expected)
        # which keys are sharded alike, as the reader knew it, is what a compile finds
        assert sharded_alike(found) is not None
        assert Shardings().of_keys(found) == Shardings().of_keys(dict(found))
        for shards in found.values():
            for shard in shards:
                assert type(shard) is ShardDesc and type(shard.local_shape) is tuple
                assert all(type(n) is int for n in shard.local_shape + shard.global_shape
                           + shard.global_offset)
    return found


plain_keys = st.text(st.characters(codec="utf-8", exclude_characters='"\\'), max_size=6)


@st.composite
def regular_infos(draw):
    """Shard info every description of which passes the checks, keys written as they are."""
    info = {}
    for key in draw(st.lists(plain_keys.filter(lambda k: not any(c < " " for c in k)),
                             unique=True, min_size=1, max_size=4)):
        rank = draw(st.integers(0, 3))
        total = draw(st.lists(st.integers(0, 12), min_size=rank, max_size=rank))
        dtype = draw(st.sampled_from([None, "float32", "bfloat16", "int8"]))
        shards = []
        for _ in range(draw(st.integers(1, 3))):
            offset = [draw(st.integers(0, t)) for t in total]
            local = [draw(st.integers(0, t - o)) for o, t in zip(offset, total)]
            shard = {"key": key, "local_shape": local, "global_shape": total,
                     "global_offset": offset, "dtype": dtype}
            if dtype is None and draw(st.booleans()):
                del shard["dtype"]
            shards.append(shard)
        info[key] = shards
    return info


@fuzz_settings
@given(regular_infos())
def test_what_json_dumps_writes_is_read_without_parsing_as_parsing_reads_it(info):
    text = json.dumps(info, ensure_ascii=False)
    assert assert_read_as_parsed(text) is not None
    assert assert_read_as_parsed(text + "\n") is not None


@fuzz_settings
@given(shard_infos())
def test_the_regular_form_of_wrong_shards_is_left_to_parsing(info):
    for text in (json.dumps(info), json.dumps(info, ensure_ascii=False, allow_nan=False)):
        found = assert_read_as_parsed(text)
        if isinstance(parsed_and_checked(text), str):
            assert found is None


@fuzz_settings
@given(regular_infos(), st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(
    ["", " ", "\n", '"', "\\", ",", ":", "[", "]", "{", "}", "0", "1", "9", "-", "a", "null",
     ", ", "}, {", '"key": ', ", 0", "e"])), min_size=1, max_size=3), st.booleans())
def test_an_edited_text_is_read_as_parsing_reads_it_or_left_to_it(info, edits, insert):
    """Characters put in or replaced anywhere: the reader never skips or misreads a part."""
    text = json.dumps(info, ensure_ascii=False)
    for position, characters in edits:
        position %= len(text) + 1
        end = position if insert else position + len(characters)
        text = text[:position] + characters + text[end:]
    assert_read_as_parsed(text)


@pytest.mark.parametrize("text", [
    '{"1": [{"key": "1", "local_shape": [1], "global_shape": [11], "global_offset": [10], '
    '"dtype": null}]}',  # the key is also a digit of the boxes
    '{"shape": [{"key": "shape", "local_shape": [2], "global_shape": [2], '
    '"global_offset": [0]}]}',  # ... or a part of the field names
    '{"": [{"key": "", "local_shape": [], "global_shape": [], "global_offset": [], '
    '"dtype": "int8"}]}',
    '{"w": [{"key": "w", "local_shape": [1], "global_shape": [2], "global_offset": [0], '
    '"dtype": "int8"}, {"key": "w", "local_shape": [1], "global_shape": [2], '
    '"global_offset": [1], "dtype": "int8"}], "v": [{"key": "v", "local_shape": [1], '
    '"global_shape": [1], "global_offset": [0], "dtype": "int8"}]}\n',
])
def test_keys_that_the_text_holds_elsewhere_are_read_right(text, tmp_path):
    assert assert_read_as_parsed(text) is not None
    assert read_as_the_command_does(tmp_path, text) == parsed_and_checked(text)


W = '{"key": "w", "local_shape": [1], "global_shape": [2], "global_offset": [0]}'


def shard(old: str, new: str) -> str:
    return W.replace(old, new)


def info_of(*shards: str, key: str = "w") -> str:
    return '{"' + key + '": [' + ", ".join(shards) + "]}"


@pytest.mark.parametrize("text", [
    info_of(W)[:-1] + ', "w": [' + W + ", " + W + "]}",  # listed twice: the last list counts
    info_of(W, key="v"),  # a shard listed under another key
    info_of(shard("[0]", "[-1]")), info_of(shard("[0]", "[2]")), info_of(shard("[0]", "[00]")),
    info_of(shard("[0]", "[0.0]")), info_of(shard("[2]", "[2, 1]")),
    info_of(shard("}", ', "dtype": "float33"}')), info_of(shard("}", ', "dtype": ""}')),
    info_of(shard("}", ', "dtype": 5}')), info_of(shard("[2]", f"[{2**62}]")),
    info_of(shard("[2]", "[12345678901234567890]")),
    info_of(shard("}", ', "dtype": "int8", "x": 1}')),
    info_of(W, ""), '{"w": []}', "{}", "[]", info_of(W) + " x", " " + info_of(W) + "x",
    info_of(W)[:-1] + ',"v": [' + W + "]}", info_of(W).replace(": ", ":"),
    info_of(shard(", ", ",")), info_of(W, key="w\\u0077"),
    info_of(shard('"w"', '"w\x01"'), key="w\x01"),
    '{"}], ' + info_of(W)[1:],  # an empty text between keys: no key, no list
])
def test_other_texts_are_left_to_parsing(text, tmp_path):
    assert read_regular_shard_info(text) is None
    assert read_as_the_command_does(tmp_path, text) == parsed_and_checked(
        text, str(tmp_path / "info.json"))


def test_lists_of_shard_descriptions_are_taken_in_new_lists_and_checked_as_before():
    w = [ShardDesc("w", (1,), (2,), (0,)), ShardDesc("w", (1,), (2,), (1,))]
    v = [ShardDesc.full("v", (3,), "int8")]
    info = {"w": w, "v": v}
    found = normalize_shard_info(info, "destination")
    assert found == info and found["w"] is not w and list(found) == ["w", "v"]
    for wrong, message in [
        ({"w": w, "v": []}, "destination shard info lists no shard of 'v'"),
        ({"w": w, "u": v}, "destination shard listed under 'u' describes 'v'"),
        ({"w": [w[0], {"key": "x", "local_shape": [1], "global_shape": [1],
                       "global_offset": [0]}]}, "destination shard listed under 'w' describes 'x'"),
    ]:
        with pytest.raises(aoa.UsageError) as caught:
            normalize_shard_info(wrong, "destination")
        assert caught.value.message == message
    mixed = normalize_shard_info({"w": (w[0], w[1].to_json())}, "destination")
    assert mixed == {"w": w}


def test_keys_of_their_own_templates_are_left_to_parsing_and_read_right(tmp_path):
    """Each key of another shape: a template each, more costly to parse here than with
    json.loads; 4 keys a template (the same shapes again and again) are read here."""
    info = {f"w{i}": [{"key": f"w{i}", "local_shape": [i // 4 + 1], "global_shape": [i // 4 + 1],
                       "global_offset": [0], "dtype": "int8"}] for i in range(400)}
    several = json.dumps(info)
    assert assert_read_as_parsed(several) is not None
    own = json.dumps({key: [dict(shards[0], local_shape=[n], global_shape=[n])]
                      for n, (key, shards) in enumerate(info.items(), start=1)})
    assert read_regular_shard_info(own) is None
    assert read_as_the_command_does(tmp_path, own) == parsed_and_checked(own)


def test_templates_that_end_alike_are_told_apart():
    """Keys whose texts end alike (the last shard) but differ before it: a template is
    guessed by a text's end, then checked, so each key is read with its own boxes."""
    def shards(first: int) -> list[dict]:
        return [{"key": key, "local_shape": [1], "global_shape": [3], "global_offset": [at],
                 "dtype": "int8"} for at in (first, 2)]
    info = {}
    for key, first in [("u", 0), ("w", 1), ("x", 0), ("ab", 1), ("z", 0)]:
        info[key] = shards(first)
    found = assert_read_as_parsed(json.dumps(info))
    assert found is not None
    assert [[shard.global_offset for shard in shards] for shards in found.values()] == [
        [(0,), (2,)], [(1,), (2,)], [(0,), (2,)], [(1,), (2,)], [(0,), (2,)]]
    assert sharded_alike(found) == (list(info), [0, 1, 0, 1, 0], [found["u"], found["w"]])


def test_what_the_reader_knew_is_used_only_while_the_info_is_as_read():
    """Keys sharded alike, as the reader found them, stand in for a compile's own look only
    while the dict holds the very shards read: any change and the compile looks itself."""
    shards = ('{"key": "K", "local_shape": [1], "global_shape": [2], "global_offset": [0]}, '
              '{"key": "K", "local_shape": [1], "global_shape": [2], "global_offset": [1]}')
    # keys that no field name holds: each key's text is the one template with the key in it
    text = "{" + ", ".join(f'"{key}": [{shards.replace("K", key)}]' for key in "uwx") + "}"
    whole = ShardDesc("w", (2,), (2,), (0,))
    changes = [
        lambda info: info["w"].__setitem__(1, ShardDesc("w", (1,), (2,), (0,))),
        lambda info: info.__setitem__("w", [whole]),
        lambda info: info["w"].append(whole),
        lambda info: info.__setitem__("w", tuple(info["w"])),
        lambda info: info.pop("u"),
        lambda info: info.__setitem__("v", [ShardDesc("v", (2,), (2,), (0,))]),
        lambda info: info.update(w=info.pop("w")),  # the same lists, keys in another order
    ]
    for change in changes:
        info = read_regular_shard_info(text)
        assert info is not None
        assert sharded_alike(info) == (["u", "w", "x"], [0, 0, 0], [info["u"]])
        change(info)
        assert sharded_alike(info) is None
        assert Shardings().of_keys(info) == Shardings().of_keys(dict(info))
        normalized = normalize_shard_info(info, "destination")
        assert normalized == {key: list(shards) for key, shards in info.items()}
        assert sharded_alike(normalized) is None
