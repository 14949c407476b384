"""The ``dcp-safetensors`` format: one safetensors file per rank, as PyTorch DCP's Hugging
Face storage writes them.

Rank r of n writes ``rank-0000r-of-0000n.safetensors`` holding its shards under their keys;
the file's metadata ``DCP_SHARDING_INFO`` gives each shard's global offset (and
``DCP_VERSION``, as DCP writes it). No index: a reader takes every ``*.safetensors`` of the
folder, and the global shape is where the furthest chunk ends. Read by the safetensors
folder reader (`aoa.storage.safetensors_folder`).
"""

from __future__ import annotations

import functools
import json
import json.encoder
import operator
from collections.abc import Sequence

from aoa.layout import ShardDesc, shards_nbytes
from aoa.storage.formats import Destination, FileLayout, Format, OutputFile
from aoa.storage.safetensors import file_layout
from aoa.storage.safetensors_folder import (
    INDEX_NAME,
    OFFSETS_KEY,
    SHARDING_KEY,
    is_sharded,
    open_folder,
)

#: Written beside the sharding info, as DCP's Hugging Face storage writer does.
_DCP_VERSION = {"DCP_VERSION": "1.0"}


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

    def layout(self, file: OutputFile) -> FileLayout:
        """The rank's shards under their keys, each one's global offset in the metadata."""
        shards = list(map(self.shards.__getitem__, file.shards))
        keys = list(map(_KEY, shards))
        key_texts = list(map(self._key_texts.__getitem__, keys))
        info = sharding_info(shards, key_texts)
        metadata = {SHARDING_KEY: info, **_DCP_VERSION}
        # keys below DEL read the same ASCII-escaped or not: the header takes their texts
        joined = "".join(keys)
        same = joined.isascii() and "\x7f" not in joined
        return file_layout(shards, file.shards, self.folder / file.filename, metadata,
                           keys=keys, key_texts=key_texts if same else None,
                           metadata_json=_metadata_json(info))


    @functools.cached_property
    def _key_texts(self) -> dict[str, str]:
        """Each key as ``json.dumps`` writes it (ASCII-escaped), made once for all the files:
        the ranks' files hold the same keys (61x256 to TP4: 31k keys in 125k shards)."""
        keys = dict.fromkeys(map(_KEY, self.shards))
        return dict(zip(keys, map(json.encoder.encode_basestring_ascii,  # type: ignore[attr-defined]
                                  keys)))


def sharding_info(shards: Sequence[ShardDesc], key_texts: Sequence[str] | None = None) -> str:
    """``DCP_SHARDING_INFO`` of a file holding ``shards`` (each key once): the text
    ``json.dumps`` makes of ``{key: {"saved_offsets": global offset}}``, as DCP writes it,
    put together column by column (a rank of 30k shards in milliseconds). ``key_texts``:
    each key as ``json.dumps`` writes it (ASCII-escaped), where the caller has them."""
    if key_texts is None:
        key_texts = list(map(json.encoder.encode_basestring_ascii,  # type: ignore[attr-defined]
                             map(_KEY, shards)))
    offsets = list(map(_GLOBAL_OFFSET, shards))
    value = {offset: f': {{"{OFFSETS_KEY}": [{", ".join(map(str, offset))}]}}, '
             for offset in set(offsets)}
    parts = ["{"] * (2 * len(offsets) + 1)  # "{", then each key and its value
    parts[1::2] = key_texts
    parts[2::2] = map(value.__getitem__, offsets)
    return "".join(parts)[:-2] + "}" if offsets else "{}"


def _metadata_json(info: str) -> str:
    """What ``json.dumps`` (compact, not ASCII-escaped) makes of the file's metadata, the
    sharding info ``info`` escaped without a pass to find what needs it: being ASCII-escaped
    JSON, it holds no control character and nothing beyond ASCII, only quotes and
    backslashes to escape."""
    escaped = info.replace("\\", "\\\\").replace('"', '\\"')
    return (f'{{"{SHARDING_KEY}":"{escaped}",'
            + json.dumps(_DCP_VERSION, separators=(",", ":"))[1:])


_KEY = operator.attrgetter("key")
_GLOBAL_OFFSET = operator.attrgetter("global_offset")


FORMAT = Format("dcp-safetensors", "safetensors files with PyTorch DCP's DCP_SHARDING_INFO, "
                "one per rank", is_sharded, open_folder, DcpSafetensorsDestination)
