"""Shard-info JSON in the form `json.dumps` writes it, read without a JSON parser.

A `--destination` of a big MoE holds 125k shard descriptions in 20 MB; `json.loads` makes a
dict and three lists of each, and checking them costs as much again. Written by
`json.dumps` (default separators, no indent), each key's text is regular:
``"K": [{"key": "K", "local_shape": [..], "global_shape": [..], "global_offset": [..],
"dtype": ".."}, ...]``, and with its key taken out it is one of a few *templates* (the
experts of a layer, the layers of a model share one). Each template is parsed and checked
once; each key's text is then checked to be exactly its template with the key put back
in (a key whose text holds it elsewhere too, as `1` or `shape` may, is split on its own),
so the whole text is that form of what is returned: nothing is skipped or misread.

Anything else (other spacing, escapes, another field order, a key listed twice, a shard
that fails a check, keys that share few templates) returns None: the caller reads the text
with `json.loads` and checks each description, whose errors say what is wrong and where.
"""

from __future__ import annotations

import itertools
import operator
import re
from collections.abc import Sequence

from aoa.dtypes import is_known, itemsize
from aoa.inputs import is_text
from aoa.layout import ShardDesc, ShardRow
from aoa.limits import shape_problem

_JSON_SPACE = " \t\n\r"
_INTEGER = r"(?:0|[1-9][0-9]{0,18})"  # 19 digits at most: anything larger is refused anyway
_INTEGERS = rf"((?:{_INTEGER}(?:, {_INTEGER})*)?)"
#: A shard's text after its key: boxes, dtype (null, a string or left out), and `}, ` where
#: another shard of the key follows (the last one's `}` goes with the text between keys).
_BODY = re.compile(
    rf'{_INTEGERS}\], "global_shape": \[{_INTEGERS}\], "global_offset": \[{_INTEGERS}\]'
    r'(?:, "dtype": (?:null|"([^"\\\x00-\x1f]*)"))?(\}, )?')
_CONTROL = re.compile(r"[\x00-\x1f]")
#: Between two keys' lists; a key's text with the key taken out starts with `_LIST_OPENS`,
#: and each of its shards with `_SHARD_OPENS`.
_BETWEEN_KEYS = '}], "'
_LIST_OPENS = '": ['
_SHARD_OPENS, _KEY_CLOSES = '{"key": "', '", "local_shape": ['

#: Up to this many templates are always parsed; more only where keys share them four to one
#: or more (a template parsed here costs about what json.loads takes for two keys' text).
_FEW_TEMPLATES = 64
#: The end of a key's text by which its template is guessed.
_GUESS_BY = slice(-64, None)
#: A template's pieces (its key's text is the key joined with them) and its shards' boxes.
_Template = tuple[list[str], list[ShardRow]]


#: Shard info as rows: its keys, and each key's rows (keys sharded alike share one list).
ShardRows = tuple[list[str], list[list[ShardRow]]]


def read_regular_shard_info(text: str) -> dict[str, list[ShardDesc]] | None:
    """The shard info ``text`` holds, if it is in `json.dumps`'s form and every description
    passes `ShardDesc`'s checks; else None (read it with a JSON parser)."""
    rows = regular_shard_rows(text)
    return None if rows is None else ShardDesc.grouped_unchecked(*rows)


def regular_shard_rows(text: str) -> ShardRows | None:
    """`read_regular_shard_info` as rows, its descriptions not made yet: few objects,
    cheap to hand from one process to another (`aoa.forked`)."""
    core = text.strip(_JSON_SPACE)
    if not (core.startswith('{"') and core.endswith("}]}")) or "\\" in core:
        return None
    entries = core.split(_BETWEEN_KEYS)  # each: K": [{"key": "K", ... "dtype": "x"
    entries[0] = entries[0][2:]  # less `{"`
    entries[-1] = entries[-1][:-3]  # less `}]}`
    keys = list(map(operator.itemgetter(0), map(str.partition, entries,
                                                itertools.repeat('"'))))
    if len(set(keys)) != len(keys) or not _plain_keys(keys):
        return None
    # A guess of each key's template: that of the last key whose text ends as its text does
    # (in the last shard's boxes and dtype); the join below checks every guess, so a wrong
    # one costs only the exact look (the key taken out of the text) every key took before.
    ends = list(map(operator.getitem, entries, itertools.repeat(_GUESS_BY)))
    guessed = {end: entries[position].replace(keys[position], "")
               for end, position in dict(zip(ends, range(len(keys)))).items()}
    # parsed one by one here, more templates than this would cost more than json.loads
    most = max(_FEW_TEMPLATES, len(keys) // 4)
    bodies: dict[str, tuple[ShardRow, bool] | None] = {}
    templates = dict.fromkeys(guessed.values())
    if len(templates) > most:
        return None  # (before parsing any)
    parsed = {template: _parse_list(template, "", bodies) for template in templates}
    boxes = []
    for key, entry, end in zip(keys, entries, ends):
        found = parsed[guessed[end]]
        if found is None or key.join(found[0]) != entry:  # a wrong guess, or the key is
            template = entry.replace(key, "")  # elsewhere in its text too
            if template not in parsed:
                parsed[template] = _parse_list(template, "", bodies)
                if len(parsed) > most:
                    return None
            found = parsed[template]
            if found is None or key.join(found[0]) != entry:
                found = _parse_list(entry, key, bodies)
                if found is None:
                    return None
        boxes.append(found[1])
    return keys, boxes


def _plain_keys(keys: Sequence[str]) -> bool:
    """Keys written as they are (no quote: each was cut at its first one; no escape: the
    text has no backslash), holding no control character and no lone surrogate."""
    joined = "".join(keys)
    return ((joined.isprintable() or _CONTROL.search(joined) is None)  # the first is quick
            and (joined.isascii() or is_text(joined)))


def _parse_list(text: str, key: str, bodies: dict[str, tuple[ShardRow, bool] | None]
                ) -> _Template | None:
    """The boxes of a key's text (``key`` ``": [`` then its shards) and its pieces (joined
    by ``key`` they give ``text`` back); None if it is not a list of shards in the form.
    ``bodies``: each shard's text after its key, as `_parse_body` found it."""
    head, *rest = text.split(_SHARD_OPENS + key + _KEY_CLOSES)
    if head != key + _LIST_OPENS or not rest:
        return None
    boxes = []
    last = len(rest) - 1
    for position, body in enumerate(rest):
        if body not in bodies:
            bodies[body] = _parse_body(body)
        found = bodies[body]
        if found is None or found[1] != (position < last):  # `}, ` between shards
            return None
        boxes.append(found[0])
    pieces = ["", _LIST_OPENS + _SHARD_OPENS]
    pieces += [_KEY_CLOSES + body + _SHARD_OPENS for body in rest[:-1]]
    pieces.append(_KEY_CLOSES + rest[-1])
    return pieces, boxes


def _parse_body(body: str) -> tuple[ShardRow, bool] | None:
    """A shard's boxes and dtype, and whether another shard follows, checked as `ShardDesc`
    checks a description; None if it is not one."""
    match = _BODY.fullmatch(body)
    if match is None:
        return None
    local_text, total_text, offset_text, dtype, follows = match.groups()
    local, total, offset = _box(local_text), _box(total_text), _box(offset_text)
    if not (len(local) == len(total) == len(offset)
            and all(map(operator.le, map(operator.add, offset, local), total))):
        return None
    if dtype is not None and not is_known(dtype):
        return None
    if shape_problem(total, itemsize(dtype or "float32")) is not None:
        return None
    return (local, total, offset, dtype), follows is not None


def _box(text: str) -> tuple[int, ...]:
    return tuple(map(int, text.split(", "))) if text else ()
