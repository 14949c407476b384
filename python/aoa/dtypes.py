"""Element types by their Paddle names: item sizes, numpy types, safetensors codes.

Everything in aoa names dtypes the way Paddle does (``float32``, ``bfloat16``, ...); this
module is the one place that knows what those names mean for numpy and for safetensors.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

#: Paddle dtype name -> bytes per element. Plain data: compiling needs no numpy, and
#: importing ml_dtypes (bf16, fp8) costs up to a second, so `NUMPY_DTYPES` is made when
#: first used.
ITEMSIZES: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1,
    "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1,
    "bool": 1,
}


@functools.cache
def _numpy_dtypes() -> dict[str, np.dtype]:
    """Paddle dtype name -> numpy dtype (bf16 and fp8 through ml_dtypes)."""
    import ml_dtypes
    import numpy as np

    extra = {"bfloat16": ml_dtypes.bfloat16, "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
             "float8_e5m2": ml_dtypes.float8_e5m2}
    return {name: np.dtype(extra.get(name, name)) for name in ITEMSIZES}


if TYPE_CHECKING:
    #: Paddle dtype name -> numpy dtype, in the order of `ITEMSIZES` (made when first used)
    NUMPY_DTYPES: dict[str, np.dtype]


def __getattr__(name: str) -> object:
    if name == "NUMPY_DTYPES":
        return _numpy_dtypes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: The dtypes a cast (``dtype=``, ``src_dtype=``/``dst_dtype=``) may produce. Paddle 3.3.1
#: allows the first three; aoa adds float64 and the two fp8 formats (spec 0.5).
CAST_TARGETS: tuple[str, ...] = (
    "float16", "float32", "bfloat16", "float64", "float8_e4m3fn", "float8_e5m2",
)

FLOATING = frozenset(CAST_TARGETS)

#: safetensors dtype code <-> Paddle dtype name.
SAFETENSORS_CODES: dict[str, str] = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
    "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool",
}
SAFETENSORS_NAMES: dict[str, str] = {name: code for code, name in SAFETENSORS_CODES.items()}

# (mantissa bits, exponent bits) of the floating formats, to decide exact widenings.
_FLOAT_FORMAT = {
    "float64": (52, 11), "float32": (23, 8), "float16": (10, 5), "bfloat16": (7, 8),
    "float8_e4m3fn": (3, 4), "float8_e5m2": (2, 5),
}


def itemsize(dtype: str) -> int:
    """Bytes per element of ``dtype``."""
    return ITEMSIZES[dtype]


def numpy_dtype(dtype: str | None) -> np.dtype:
    """The numpy dtype for a Paddle name; ``None`` (unspecified) reads as float32, as in Paddle."""
    return _numpy_dtypes()[dtype or "float32"]


def is_known(dtype: str) -> bool:
    return dtype in ITEMSIZES


def is_exact_widening(narrow: str, wide: str) -> bool:
    """True when every value of ``narrow`` is exactly representable in ``wide``.

    Used to drop intermediate casts that cannot change a value (float32 -> float64 -> x).
    """
    if narrow == wide:
        return True
    if narrow in _FLOAT_FORMAT and wide in _FLOAT_FORMAT:
        (nm, ne), (wm, we) = _FLOAT_FORMAT[narrow], _FLOAT_FORMAT[wide]
        # e4m3fn has no infinity and a larger finite range than its exponent width suggests,
        # but all its values still fit any format with more mantissa and exponent bits.
        return nm <= wm and ne <= we and not (narrow == "float8_e5m2" and wide == "float8_e4m3fn")
    if narrow.startswith("int") and wide in _FLOAT_FORMAT:
        bits = 8 * itemsize(narrow)
        return bits <= _FLOAT_FORMAT[wide][0] + 1
    return False
