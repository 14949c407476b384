"""The executor's unit of work: one strided region copy between two byte buffers.

A plan lowers to a list of these; the numpy reference backend and the C++ kernel both run
exactly this list, so they can be checked against each other byte for byte.

A copy may dequantize as it goes (`BlockScale`): fp8 checkpoints (DeepSeek-V3, Kimi-K2) store
each weight beside a ``weight_scale_inv`` tensor with one scale per block of 128 x 128
values; the value of an element is its stored value times its block's scale.
"""

from __future__ import annotations

from dataclasses import dataclass

from aoa.dtypes import is_known
from aoa.errors import ExecutionError

#: What a dequantizing copy may read, values and scales: the formats float32 holds exactly.
DEQUANTIZED_SOURCES = ("float8_e4m3fn", "float8_e5m2", "bfloat16", "float16", "float32")
SCALE_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class BlockScale:
    """One scale per block of the source: ``value = float32(stored) * float32(scale)``,
    rounded once to float32, then cast on through the copy's ``via`` to its destination
    dtype (DeepSeek-V3's ``weight_dequant``: ``x.float() * s``, stored as bfloat16).

    The scales are a region of source buffer ``source`` (``dtype``); per destination axis
    of the copy, ``blocks`` elements share a scale, the copy's first element is ``phases``
    elements into its block, and ``strides`` are the bytes between the scales of
    neighbouring blocks. ``offset`` is the byte offset of the first element's scale. So
    element ``i`` (an index per axis) reads the scale at
    ``offset + sum((phases[a] + i[a]) // blocks[a] * strides[a])``."""

    source: int
    offset: int
    strides: tuple[int, ...]
    blocks: tuple[int, ...]
    phases: tuple[int, ...]
    dtype: str = "float32"

    def extents(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """How many scales a copy of ``shape`` reads along each axis (0 for an empty one)."""
        if 0 in shape:
            return tuple(0 for _ in shape)
        return tuple((phase + extent - 1) // block + 1
                     for phase, extent, block in zip(self.phases, shape, self.blocks))


@dataclass(frozen=True)
class Copy:
    """``destination[region] = cast(source[region])`` between two flat byte buffers.

    Both regions have ``shape`` (destination axis order). Strides are in bytes, one per
    destination axis; a permutation is folded into ``source_strides``. Values go from
    ``source_dtype`` through each dtype of ``via`` in turn (every step rounds, as numpy's
    ``astype`` does) to ``destination_dtype``. With a ``scale`` the values are first
    dequantized to float32 (`BlockScale`), and the steps start from there.
    """

    source: int
    source_offset: int
    source_strides: tuple[int, ...]
    destination: int
    destination_offset: int
    destination_strides: tuple[int, ...]
    shape: tuple[int, ...]
    source_dtype: str
    destination_dtype: str
    via: tuple[str, ...] = ()
    scale: BlockScale | None = None


def c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    """Byte strides of a C-contiguous array of ``shape``."""
    strides, step = [], itemsize
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def check_fields(index: int, copy: Copy) -> None:
    """Raise ExecutionError unless the dtypes are known and there is one stride per axis
    (what both backends check before they read a copy's numbers)."""
    scale = copy.scale
    for dtype in (copy.source_dtype, *copy.via, copy.destination_dtype,
                  *((scale.dtype,) if scale else ())):
        if not is_known(dtype):
            raise ExecutionError(f"copy {index}: unknown dtype {dtype!r}")
    lists = [("source strides", copy.source_strides),
             ("destination strides", copy.destination_strides)]
    if scale is not None:
        lists += [("scale strides", scale.strides), ("scale blocks", scale.blocks),
                  ("scale phases", scale.phases)]
    for role, numbers in lists:
        if len(numbers) != len(copy.shape):
            raise ExecutionError(
                f"copy {index}: shape {tuple(copy.shape)} and {role} {tuple(numbers)} "
                "differ in length"
            )
