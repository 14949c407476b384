"""The ``dcp-safetensors`` format: one safetensors file per rank, as PyTorch DCP's Hugging
Face storage writes them.

Rank r of n writes ``rank-0000r-of-0000n.safetensors`` holding its shards under their keys;
the file's metadata ``DCP_SHARDING_INFO`` gives each shard's global offset (and
``DCP_VERSION``, as DCP writes it). No index: a reader takes every ``*.safetensors`` of the
folder, and the global shape is where the furthest chunk ends. Read by the safetensors
folder reader (`aoa.storage.safetensors_folder`).
"""

from __future__ import annotations

import json
import json.encoder
import operator
from collections.abc import Sequence
from pathlib import Path

from aoa.layout import ShardDesc, shards_nbytes
from aoa.storage.formats import Destination, FileLayout, Format, OutputFile
from aoa.storage.safetensors import HeaderEntries, file_layout, header_entries
from aoa.storage.safetensors_folder import (
    INDEX_NAME,
    OFFSETS_KEY,
    SHARDING_KEY,
    is_sharded,
    open_folder,
)

#: Written beside the sharding info, as DCP's Hugging Face storage writer does.
_DCP_VERSION = {"DCP_VERSION": "1.0"}
#: The characters JSON writes as themselves: printable ASCII but quotes and backslashes.
_PLAIN_JSON = bytes(c for c in range(0x20, 0x7F) if chr(c) not in '"\\')


class DcpSafetensorsDestination(Destination):
    """One file per rank, each shard with its global offset in the file's metadata."""

    format = "dcp-safetensors"
    sharded = True
    patterns = ("*.safetensors", INDEX_NAME)

    @classmethod
    def plan_files(cls, shards: Sequence[ShardDesc], ranks: Sequence[Sequence[int]] | None,
                   *, max_file_bytes: int | None = None) -> list[OutputFile]:
        """``rank-00000-of-00004.safetensors`` ... (ranks counted from 0); without ranks, one
        rank holds every shard."""
        groups = [range(len(shards))] if ranks is None else ranks
        nbytes = shards_nbytes(shards)
        count = len(groups)
        return [OutputFile(f"rank-{rank:05d}-of-{count:05d}.safetensors", tuple(indices),
                           sum(map(nbytes.__getitem__, indices)))
                for rank, indices in enumerate(groups)]

    #: the last rank's header entries, and the keys and shards they were made for
    _alike: tuple[list[str], _Specs, HeaderEntries] | None = None

    def layout(self, file: OutputFile) -> FileLayout:
        """The rank's shards under their keys, each one's global offset in the metadata."""
        shards = list(map(self.shards.__getitem__, file.shards))
        keys = list(map(_KEY, shards))
        path = self.folder / file.filename
        return file_layout(shards, file.shards, path, keys=keys,
                           entries=self._entries(path, shards, keys),
                           metadata_json=self._metadata_json(shards, keys))

    def _entries(self, path: Path, shards: list[ShardDesc], keys: list[str]) -> HeaderEntries:
        """The header's entries of the rank holding ``shards``: the last rank's again where
        it held the same keys, shapes and dtypes in the same order, as the ranks of a
        tensor-parallel output mostly do (61x256 to TP4: three of four ranks). Shapes and
        dtypes are listed only for ranks whose keys match (not for the first file, whose
        layout the disk waits for)."""
        specs = _Specs(shards)
        alike = self._alike
        if alike is not None and alike[0] == keys and alike[1] == specs:
            return alike[2]
        # keys below DEL read the same ASCII-escaped or not: the header takes their texts
        joined = "".join(keys)
        texts = (self._key_texts(keys) if joined.isascii() and "\x7f" not in joined
                 else None)
        entries = header_entries(path, shards, keys, texts)
        self._alike = (keys, specs, entries)
        return entries

    def _metadata_json(self, shards: list[ShardDesc], keys: list[str]) -> str:
        """The file's metadata as ``json.dumps`` writes it (compact, not ASCII-escaped):
        `sharding_info` as a JSON string, put together from pieces escaped beforehand (the
        keys' texts, escaped once for ranks holding the same keys) rather than escaped in a
        pass over the whole text."""
        parts = _sharding_parts(shards, self._escaped_key_texts(keys), '\\"')
        return "".join((f'{{"{SHARDING_KEY}":"{{', *parts, '}",',
                        json.dumps(_DCP_VERSION, separators=(",", ":"))[1:]))

    #: the keys `_key_texts` and `_escaped_key_texts` last made texts of, and those texts
    _texts_alike: tuple[list[str], list[str]] | None = None
    _escaped_alike: tuple[list[str], list[str]] | None = None

    def _key_texts(self, keys: list[str]) -> list[str]:
        """Each key as ``json.dumps`` writes it (ASCII-escaped), made again only for a rank
        holding other keys than the last one (61x256 to TP4: two of four ranks), and only
        for its keys (31k, not the 125k shards of all the ranks)."""
        alike = self._texts_alike
        if alike is not None and alike[0] == keys:
            return alike[1]
        joined = "".join(keys)
        if not keys:
            texts = []
        elif joined.isascii() and not joined.encode().translate(None, _PLAIN_JSON):
            # each reads as itself between quotes: one join and one split (no key holds a
            # newline), not an encoder call per key
            texts = ('"' + '"\n"'.join(keys) + '"').split("\n")
        else:
            texts = list(map(json.encoder.encode_basestring_ascii,  # type: ignore[attr-defined]
                             keys))
        self._texts_alike = (keys, texts)
        return texts

    def _escaped_key_texts(self, keys: list[str]) -> list[str]:
        """Each key's `_key_texts` escaped as it reads inside a JSON string (quotes and
        backslashes; an ASCII-escaped text holds nothing else to escape, and no newline: one
        join, two replaces and a split for them all), made again only for other keys."""
        alike = self._escaped_alike
        if alike is not None and alike[0] == keys:
            return alike[1]
        escaped = ("\n".join(self._key_texts(keys)).replace("\\", "\\\\")
                   .replace('"', '\\"').split("\n") if keys else [])
        self._escaped_alike = (keys, escaped)
        return escaped


def sharding_info(shards: Sequence[ShardDesc]) -> str:
    """``DCP_SHARDING_INFO`` of a file holding ``shards`` (each key once): the text
    ``json.dumps`` makes of ``{key: {"saved_offsets": global offset}}``, as DCP writes it,
    put together column by column (the layouts put the same pieces inside the metadata's
    JSON string, `DcpSafetensorsDestination._metadata_json`)."""
    key_texts = list(map(json.encoder.encode_basestring_ascii,  # type: ignore[attr-defined]
                         map(_KEY, shards)))
    return "".join(("{", *_sharding_parts(shards, key_texts, '"'), "}"))


def _sharding_parts(shards: Sequence[ShardDesc], key_texts: Sequence[str], quote: str
                    ) -> list[str]:
    """The text of `sharding_info` between its braces, in pieces: each key's text and its
    value, a quote written as ``quote`` (``\\"`` inside a JSON string, where ``key_texts``
    are escaped alike)."""
    offsets = list(map(_GLOBAL_OFFSET, shards))
    parts = [""] * (2 * len(offsets))
    parts[0::2] = key_texts
    parts[1::2] = map(_OffsetTexts(quote).__getitem__, offsets)
    if parts:
        parts[-1] = parts[-1][:-2]  # no ", " after the last
    return parts


class _Specs:
    """A rank's shards compared by local shape and dtype, in order; the lists made when
    first compared, once."""

    def __init__(self, shards: list[ShardDesc]) -> None:
        self._shards = shards
        self._lists: tuple[list[tuple[int, ...]], list[str | None]] | None = None

    def lists(self) -> tuple[list[tuple[int, ...]], list[str | None]]:
        if self._lists is None:
            self._lists = (list(map(_LOCAL_SHAPE, self._shards)),
                           list(map(_DTYPE, self._shards)))
        return self._lists

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Specs):
            return NotImplemented
        return len(self._shards) == len(other._shards) and self.lists() == other.lists()

    __hash__ = None  # type: ignore[assignment]


class _OffsetTexts(dict[tuple[int, ...], str]):
    """Each global offset's value in `sharding_info`, made when first asked for: a rank's
    shards have a few offsets (61x256 to TP4: 2-4), found in the one pass that looks them
    up."""

    def __init__(self, quote: str) -> None:
        super().__init__()
        self._quote = quote

    def __missing__(self, offset: tuple[int, ...]) -> str:
        quote = self._quote
        text = self[offset] = (f': {{{quote}{OFFSETS_KEY}{quote}: '
                               f'[{", ".join(map(str, offset))}]}}, ')
        return text


_KEY = operator.attrgetter("key")
_DTYPE = operator.attrgetter("dtype")
_LOCAL_SHAPE = operator.attrgetter("local_shape")
_GLOBAL_OFFSET = operator.attrgetter("global_offset")


FORMAT = Format("dcp-safetensors", "safetensors files with PyTorch DCP's DCP_SHARDING_INFO, "
                "one per rank", is_sharded, open_folder, DcpSafetensorsDestination)
