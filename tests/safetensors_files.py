"""Safetensors fixtures from numpy, written and read back by the `safetensors` package itself
(never by aoa), so that a test reading them checks aoa against the reference. Any dtype,
bfloat16 and fp8 included: the package's format-level ``serialize_file`` and ``deserialize``
take raw bytes and a dtype name."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import safetensors

from aoa.dtypes import NUMPY_DTYPES, SAFETENSORS_NAMES

#: numpy dtype -> safetensors code
CODES = {dtype: SAFETENSORS_NAMES[name] for name, dtype in NUMPY_DTYPES.items()}
NUMPY_OF_CODE = {code: dtype for dtype, code in CODES.items()}


def dtype_name(array: np.ndarray) -> str:
    """The dtype of ``array`` by aoa's (Paddle's) name."""
    return next(name for name, dtype in NUMPY_DTYPES.items() if dtype == array.dtype)


def save(path: Path, arrays: dict[str, np.ndarray], metadata: dict[str, str] | None = None
         ) -> Path:
    """``arrays`` in one safetensors file at ``path``."""
    contiguous = {name: np.require(array, requirements="C") for name, array in arrays.items()}
    specs = {name: safetensors.TensorSpec(dtype=dtype_name(array), shape=list(array.shape),
                                          data_ptr=array.ctypes.data, data_len=array.nbytes)
             for name, array in contiguous.items()}  # ``contiguous`` holds the bytes
    safetensors.serialize_file(specs, str(path), metadata=metadata)
    return path


def save_folder(folder: Path, arrays: dict[str, np.ndarray]) -> Path:
    """A Hugging Face folder of one ``model.safetensors`` (made if missing)."""
    folder.mkdir(parents=True, exist_ok=True)
    save(folder / "model.safetensors", arrays)
    return folder


def dcp_file(path: Path, chunks: dict[str, tuple[np.ndarray, list[int]]]) -> Path:
    """A file as PyTorch DCP's Hugging Face storage writes it: chunks and their offsets."""
    info = {key: {"saved_offsets": offset} for key, (_, offset) in chunks.items()}
    return save(path, {key: array for key, (array, _) in chunks.items()},
                {"DCP_SHARDING_INFO": json.dumps(info), "DCP_VERSION": "1.0"})


def hf_index(folder: Path, weight_map: dict[str, str]) -> None:
    """A ``model.safetensors.index.json`` with this weight map."""
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def read_back(path: Path) -> dict[str, np.ndarray]:
    """The tensors of a safetensors file, as the reference parser finds them."""
    return {name: np.frombuffer(bytes(info["data"]), NUMPY_OF_CODE[info["dtype"]])
            .reshape(info["shape"])
            for name, info in safetensors.deserialize(path.read_bytes())}
