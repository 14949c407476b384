"""A safetensors header in the compact form the safetensors library writes, and DCP's
sharding info in the form `json.dumps` writes it, read without a JSON parser.

torch's and Hugging Face's safetensors (serde) write ``{"__metadata__":{..},"K":{"dtype":
"BF16","shape":[64,32],"data_offsets":[a,b]},...}`` then spaces: no whitespace, metadata
first, the three fields in that order. For a header of 31k tiny tensors `json.loads` makes
a dict and two lists per entry, most of the time of opening a checkpoint. Here one regular
expression cuts every entry into its texts (no Python call per entry) and the matches are
checked to tile the text exactly, so the whole header is that form of what is returned.

Anything else (other spacing or order, an escape or control character, a number JSON would
not write as it is here) returns None: the caller reads the text with a JSON parser, whose
checks and errors are unchanged. An ASCII text is cut in one native pass first
(`aoa._core.compact_entries`, `saved_offsets_of`: ~45 ms to a few for a rank file of 31k
entries), the regular expressions reading what it leaves (non-ASCII names, numbers past
int64); both read the same form into the same columns. The caller checks the values
(dtypes, sizes, offsets). DCP_SHARDING_INFO (``{"K": {"saved_offsets": [0, 64]}, ...}``,
31k entries as well) is read the same way (`read_saved_offsets`).
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Sequence

from aoa import _core
from aoa.inputs import is_text

_METADATA_OPENS = '{"__metadata__":'
_METADATA_KEY = "__metadata__"
_JSON_SPACE = " \t\n\r"
#: One entry; its groups: name, dtype, shape, first and last data offset (numbers as JSON
#: writes them; a shape's are checked after the match). `split` by it, the texts between
#: entries must be commas: the entries then tile the text.
_ENTRY = re.compile(r'"([^"]*)":\{"dtype":"([^"]*)","shape":\[([0-9,]*)\],'
                    r'"data_offsets":\[(0|[1-9][0-9]*),(0|[1-9][0-9]*)\]\}')
#: One entry of sharding info (`, ` between two); groups: name, offsets.
_SAVED = re.compile(r'"([^"]*)": \{"saved_offsets": \[([0-9, ]*)\]\}')
#: What comes between a key of sharding info and its offsets, and between entries.
_SAVED_OPENS = '": {"saved_offsets": ['
_SAVED_NEXT = ']}, "'
#: Saved offsets as `json.dumps` writes them (checked number by number after the match).
_BRACKETED = re.compile(r"\[([0-9, ]*)\]")
_CONTROL_BYTES = bytes(range(0x20))
#: The header's last characters, where its padding is looked for: JSON allows any amount of
#: whitespace there, writers pad to 8 bytes (more whitespace goes to the JSON parser).
_TAIL = 64
_METADATA_DECODER = json.JSONDecoder(object_pairs_hook=tuple)

#: metadata, then the columns: names, dtype codes, shapes, first and last data offsets
CompactHeader = tuple[dict[str, str], list[str], list[str], list[tuple[int, ...]],
                      list[int], list[int]]


def read_compact_header(text: str) -> CompactHeader | None:
    """The metadata and entry columns of ``text``, if it is a header in the compact form
    whose metadata is an object of strings; else None (read it with a JSON parser)."""
    body_opens, metadata = _metadata(text)
    if body_opens is None:
        return None
    tail = text[-_TAIL:]  # the padding after the header's `}` (spaces to 8 bytes)
    body_ends = len(text) - (len(tail) - len(tail.rstrip(_JSON_SPACE))) - 1
    if text[body_ends - 1:body_ends + 1] != "}}" or text.find("\\", body_opens, body_ends) >= 0:
        return None  # (an escape in a name: its text is not the name)
    native = _core.compact_entries(text, body_opens, body_ends)  # an ASCII text, in one pass
    if native is not None:
        listed = native[0]
        if len(set(listed)) != len(listed) or _METADATA_KEY in listed:
            return None
        return (metadata, *native)
    # [between, name, dtype, shape, first, last, between, ...]: no call per entry
    cut = _ENTRY.split(text[body_opens:body_ends])
    names, codes, shapes, begins, ends = (cut[group::_ENTRY_GROUPS + 1]
                                          for group in range(1, _ENTRY_GROUPS + 1))
    if not names or not _apart(cut[::_ENTRY_GROUPS + 1], ","):
        return None  # text between or around the entries, or two not parted by a comma
    if not _plain(names) or len(set(names)) != len(names) or _METADATA_KEY in names:
        return None
    try:
        boxes = {shape: tuple(map(int, shape.split(","))) if shape else ()
                 for shape in dict.fromkeys(shapes)}
        last = _numbers(ends)
        # listed back to back (as writers do), each entry begins where the one before ends
        first = ([0, *last[:-1]] if begins[0] == "0" and begins[1:] == ends[:-1]
                 else _numbers(begins))
    except ValueError:  # an empty extent, or a number past Python's 4300 digits
        return None
    if not all(map(_as_written, boxes.values(), boxes)):
        return None  # a leading zero
    return metadata, names, codes, list(map(boxes.__getitem__, shapes)), first, last


_ENTRY_GROUPS = _ENTRY.groups


def _numbers(texts: list[str]) -> list[int]:
    """Texts of digits (as JSON writes numbers) as ints, read by the JSON parser in one
    call: a third quicker than `int` on each."""
    numbers: list[int] = json.loads(f"[{','.join(texts)}]")
    return numbers


def _apart(between: list[str], separator: str) -> bool:
    """Whether the texts around and between the matches of a `split` are nothing at the
    ends and ``separator`` between any two."""
    return (between[0] == between[-1] == ""
            and between.count(separator) == len(between) - 2)


def read_saved_offsets(text: str, names: Sequence[str] = ()
                       ) -> tuple[list[str], list[tuple[int, ...]]] | None:
    """The keys of sharding info ``text`` and each one's saved offsets (equal ones one
    object), if it is in `json.dumps`'s form with each key once; else None (read it with a
    JSON parser). ``names``: distinct names (a header's); keys listed as they are need not
    be checked to be distinct again."""
    if not (text.startswith('{"') and text.endswith("]}}")) or "\\" in text:
        return None
    native = _core.saved_offsets_of(text, names)
    if native is not None:  # (an ASCII text listing plain names, read in one pass)
        return list(names), native
    listed = _offsets_of_names(text, names)
    if listed is not None:
        keys, offsets = list(names), listed
    else:
        cut = _SAVED.split(text[1:-1])  # [between, key, offsets, between, ...]
        keys, offsets = cut[1::3], cut[2::3]
        if not keys or not _apart(cut[::3], ", ") or not _plain(keys) or (
                keys != names and len(set(keys)) != len(keys)):
            return None
    try:
        boxes = {box: tuple(map(int, box.split(", "))) if box else ()
                 for box in dict.fromkeys(offsets)}
    except ValueError:  # an empty number, or one past Python's 4300 digits
        return None
    if not all(map(_as_written, boxes.values(), boxes, itertools.repeat(", "))):
        return None  # a leading zero, or other spacing
    return keys, list(map(boxes.__getitem__, offsets))


def _offsets_of_names(text: str, names: Sequence[str]) -> list[str] | None:
    """The texts of the saved offsets of sharding info ``text`` (its outer form checked),
    if it lists exactly ``names`` (distinct), in their order; else None. The offsets are
    found by their brackets on their own (a name holding brackets upsets the count), then
    the text is put together again from the names and those offsets and compared: less
    work than cutting every key out of the text and comparing the keys with the names."""
    count = len(names)
    offsets = _BRACKETED.findall(text) if count else []
    if not count or len(offsets) != count:
        return None
    parts: list[str] = ["", _SAVED_OPENS, "", _SAVED_NEXT] * count
    parts[::4] = names
    parts[2::4] = offsets
    parts[-1] = "]}}"
    # (a name holding a quote would stand for other keys)
    if '{"' + "".join(parts) != text or not _plain(names, '"'):
        return None
    return offsets


def _metadata(text: str) -> tuple[int | None, dict[str, str]]:
    """Where the entries of ``text`` start (None if not in the form) and its metadata."""
    if not text.startswith(_METADATA_OPENS):
        return (1, {}) if text.startswith('{"') else (None, {})
    try:
        pairs, end = _METADATA_DECODER.raw_decode(text, len(_METADATA_OPENS))
    except ValueError:
        return None, {}
    if type(pairs) is not tuple:
        return None, {}
    metadata = dict(pairs)
    if (len(metadata) != len(pairs) or not all(type(value) is str for value in metadata.values())
            or text[end:end + 1] != ","
            or not all(string.isascii() or is_text(string)  # (a lone surrogate escaped)
                       for string in itertools.chain(metadata, metadata.values()))):
        return None, {}
    return end + 1, metadata


def _plain(names: Sequence[str], unquoted: str = "") -> bool:
    """Names with no control character (JSON refuses them raw; the text has no escape),
    and with no ``unquoted`` where given (a quote: a text put together from the names would
    read as other keys). In UTF-8 no byte of a longer character is one: dropping them from
    the bytes is a tight C loop, several times quicker than `str.isprintable` on a megabyte
    of names."""
    joined = "".join(names)
    if unquoted and unquoted in joined:
        return False
    encoded = joined.encode("utf-8", "surrogatepass")
    return len(encoded.translate(None, _CONTROL_BYTES)) == len(encoded)


def _as_written(box: tuple[int, ...], text: str, separator: str = ",") -> bool:
    """Whether ``text`` is ``box`` as JSON writes it (no leading zero, no other spacing)."""
    return separator.join(map(str, box)) == text

