"""The ``torch_dist`` format: Megatron-Core's distributed checkpoint (``dist_checkpointing.save``
with the ``torch_dist`` backend), read and written without Megatron or torch.

It is a PyTorch DCP checkpoint (`aoa.storage.dcp`: ``.metadata`` and ``__{rank}_{n}.distcp``;
Megatron adds every rank's save plan to the metadata, which is not needed to read it) and two
files of Megatron's own:

* ``metadata.json``: the backends, ``{"sharded_backend": "torch_dist", ...}``;
* ``common.pt``: ``torch.save`` of what is not sharded (arguments, iteration, ...).

Both are carried over verbatim when the destination is ``torch_dist`` too (`Source.extras`);
a checkpoint written from another format gets the standard ``metadata.json`` and a
``common.pt`` holding an empty dict, which Megatron-Core's ``dist_checkpointing.load`` reads
as "nothing common". Megatron's sharded objects (DCP bytes items under their unique keys,
``rng/shard_0_2``, ``decoder.layers.self_attention.linear_qkv._extra_state/shard_3_28``:
RNG states, Transformer Engine's extra state) are carried as the bytes they are, like
DCP's (`aoa.storage.dcp`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar

from aoa.errors import StorageError
from aoa.storage.dcp import METADATA_NAME, DcpDestination, DcpSource, open_dcp
from aoa.storage.formats import Format
from aoa.storage.torch_save import TorchSaveLayout

CONFIG_NAME = "metadata.json"
COMMON_NAME = "common.pt"
#: What Megatron-Core writes into ``metadata.json`` for this backend.
CONFIG = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
          "common_backend": "torch", "common_backend_version": 1}


def read_config(folder: Path) -> dict | None:
    """``metadata.json`` of ``folder`` when it names the torch_dist backend, else None."""
    path = folder / CONFIG_NAME
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    if isinstance(config, dict) and config.get("sharded_backend") == "torch_dist":
        return config
    return None


def claims(path: Path) -> bool:
    """A folder with DCP's ``.metadata`` and Megatron's ``metadata.json``."""
    return path.is_dir() and (path / METADATA_NAME).is_file() and read_config(path) is not None


class TorchDistSource(DcpSource):
    """A DCP source whose Megatron files are carried over."""

    def extras(self) -> dict[str, Path]:
        return {name: self.path / name for name in (CONFIG_NAME, COMMON_NAME)
                if (self.path / name).is_file()}


def open_torch_dist(path: Path) -> TorchDistSource:
    """Open the Megatron-Core ``torch_dist`` checkpoint in folder ``path``."""
    if read_config(path) is None:
        raise StorageError(f"{path}: no {CONFIG_NAME} naming the torch_dist backend "
                           "(Megatron-Core) in this folder")
    source = open_dcp(path, format="torch_dist", source=TorchDistSource)
    assert isinstance(source, TorchDistSource)
    return source


class TorchDistDestination(DcpDestination):
    """A DCP checkpoint, then Megatron's ``metadata.json`` and ``common.pt``."""

    format = "torch_dist"
    patterns: ClassVar[tuple[str, ...]] = ("*.distcp", METADATA_NAME, CONFIG_NAME,
                                           COMMON_NAME)

    def index(self) -> dict[str, bytes]:
        """DCP's ``.metadata``, then Megatron's ``common.pt`` (carried over from the source,
        or empty) and ``metadata.json``."""
        common = self.extras.get(COMMON_NAME)
        config = self.extras.get(CONFIG_NAME)
        try:
            common_bytes = common.read_bytes() if common is not None else _empty_common()
            config_bytes = (config.read_bytes() if config is not None
                            else json.dumps(CONFIG).encode())
        except OSError as error:
            raise StorageError(f"{error.filename}: cannot read: {error.strerror}") from error
        return {**super().index(), COMMON_NAME: common_bytes, CONFIG_NAME: config_bytes}


def sharded_object(value: None = None) -> bytes:
    """The stored bytes of a Megatron sharded object holding ``value``: ``torch.save`` of
    the list of the rank's values, one. ``None`` is what Megatron-Core saves for a module
    with no extra state, and what Transformer Engine's ``set_extra_state`` takes as "no FP8
    state"."""
    layout = TorchSaveLayout([], [value])
    data = bytearray(layout.nbytes)
    layout.write(memoryview(data))
    return bytes(data)


def _empty_common() -> bytes:
    """``torch.save({})``: Megatron's common state, empty."""
    layout = TorchSaveLayout([], {}, archive="common")
    data = bytearray(layout.nbytes)
    layout.write(memoryview(data))
    return bytes(data)


FORMAT = Format("torch_dist", "Megatron-Core torch_dist: DCP plus metadata.json and common.pt",
                claims, open_torch_dist, TorchDistDestination)
