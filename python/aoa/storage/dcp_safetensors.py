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
import operator
from collections.abc import Sequence

from aoa.layout import ShardDesc, shards_nbytes
from aoa.storage.formats import Destination, FileLayout, Format, OutputFile
from aoa.storage.safetensors import file_layout, header_entries, header_texts
from aoa.storage.safetensors_folder import (
    INDEX_NAME,
    OFFSETS_KEY,
    SHARDING_KEY,
    is_sharded,
    open_folder,
)

#: Written beside the sharding info, as DCP's Hugging Face storage writer does.
_DCP_VERSION = {"DCP_VERSION": "1.0"}
#: How `header_texts` writes a rank file's metadata JSON around its sharding info (a JSON
#: string in it, quotes escaped), as `_metadata_json` writes it.
_METADATA_PARTS = ('\\"', OFFSETS_KEY, f'{{"{SHARDING_KEY}":"{{',
                   '}",' + json.dumps(_DCP_VERSION, separators=(",", ":"))[1:])


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
        """The rank's shards under their keys, each one's global offset in the metadata: the
        header's entries and the sharding info made in one native pass where the keys are
        plain (`header_texts`), else by `json`."""
        shards = list(map(self.shards.__getitem__, file.shards))
        keys = list(map(_KEY, shards))
        path = self.folder / file.filename
        made = header_texts(shards, _METADATA_PARTS)
        if made is None:
            return file_layout(shards, file.shards, path, keys=keys,
                               metadata_json=_metadata_json(sharding_info(shards)))
        entries, metadata = made
        return file_layout(shards, file.shards, path, keys=keys,
                           entries=header_entries(path, shards, keys, entries),
                           metadata_json=metadata)


def sharding_info(shards: Sequence[ShardDesc]) -> str:
    """``DCP_SHARDING_INFO`` of a file holding ``shards`` (each key once): the text
    ``json.dumps`` makes of ``{key: {"saved_offsets": global offset}}``, as DCP writes it."""
    return json.dumps({shard.key: {OFFSETS_KEY: list(shard.global_offset)} for shard in shards})


def _metadata_json(info: str) -> str:
    """A rank file's metadata as ``json.dumps`` writes it (compact, not ASCII-escaped), its
    sharding info ``info``."""
    return json.dumps({SHARDING_KEY: info, **_DCP_VERSION}, separators=(",", ":"),
                      ensure_ascii=False)


_KEY = operator.attrgetter("key")


FORMAT = Format("dcp-safetensors", "safetensors files with PyTorch DCP's DCP_SHARDING_INFO, "
                "one per rank", is_sharded, open_folder, DcpSafetensorsDestination)
