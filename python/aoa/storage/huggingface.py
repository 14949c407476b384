"""The ``safetensors`` format: Hugging Face folders of whole tensors.

Written as ``model.safetensors``, or, past ``max_file_bytes`` of tensor data (5 GB by
default, as Hugging Face shards), ``model-00001-of-00003.safetensors`` ... and a
``model.safetensors.index.json`` naming the file of each key. Read by the safetensors folder
reader (`aoa.storage.safetensors_folder`), which also reads DCP-sharded files.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from aoa.errors import StorageError, UsageError
from aoa.layout import ShardDesc
from aoa.storage.formats import DEFAULT_MAX_FILE_BYTES, Destination, FileLayout, Format, OutputFile
from aoa.storage.safetensors import file_layout
from aoa.storage.safetensors_folder import INDEX_NAME, SINGLE_NAME, claims, open_folder


class HuggingFaceDestination(Destination):
    """Whole tensors in files of at most ``max_file_bytes``, and an index when several."""

    format = "safetensors"
    sharded = False
    patterns = ("*.safetensors", INDEX_NAME)

    @classmethod
    def plan_files(cls, shards: Sequence[ShardDesc], ranks: Sequence[Sequence[int]] | None,
                   *, max_file_bytes: int | None = None) -> list[OutputFile]:
        """Split ``shards``, in order, into files; one file is ``model.safetensors``,
        several are numbered."""
        if ranks is not None:
            raise UsageError("the safetensors format (Hugging Face) holds whole tensors, not "
                             "one file per rank",
                             hint="Write a sharded format (--output-format dcp-safetensors), "
                                  "or convert without a layout to get whole tensors.")
        limit = DEFAULT_MAX_FILE_BYTES if max_file_bytes is None else max_file_bytes
        groups: list[list[int]] = [[]]
        sizes = [0]
        names: set[str] = set()
        for index, shard in enumerate(shards):
            if shard.local_shape != shard.global_shape:
                raise UsageError(f"the safetensors format (Hugging Face) holds whole tensors, "
                                 f"but '{shard.key}' is a shard of {list(shard.global_shape)}",
                                 hint="Write a sharded format (--output-format "
                                      "dcp-safetensors).")
            if shard.key in names:
                raise StorageError(f"tensor '{shard.key}' appears twice among the destination "
                                   "tensors")
            names.add(shard.key)
            nbytes = shard.nbytes
            if groups[-1] and sizes[-1] + nbytes > limit:
                groups.append([])
                sizes.append(0)
            groups[-1].append(index)
            sizes[-1] += nbytes
        if len(groups) == 1:
            return [OutputFile(SINGLE_NAME, tuple(groups[0]), sizes[0])]
        count = len(groups)
        return [OutputFile(f"model-{number:05d}-of-{count:05d}.safetensors", tuple(group), size)
                for number, (group, size) in enumerate(zip(groups, sizes), start=1)]

    def layout(self, file: OutputFile) -> FileLayout:
        return file_layout(list(map(self.shards.__getitem__, file.shards)), file.shards,
                           self.folder / file.filename)

    def index(self) -> dict[str, bytes]:
        """``model.safetensors.index.json``, naming the file of each key; none for a
        checkpoint of one ``model.safetensors``."""
        if len(self.files) == 1 and self.files[0].filename == SINGLE_NAME:
            return {}
        index = {
            "metadata": {"total_size": sum(file.nbytes for file in self.files)},
            "weight_map": {self.shards[i].key: file.filename
                           for file in self.files for i in file.shards},
        }
        return {INDEX_NAME: (json.dumps(index, indent=2) + "\n").encode()}


FORMAT = Format("safetensors", "Hugging Face safetensors folders (whole tensors)", claims,
                open_folder, HuggingFaceDestination)
