"""The bounds aoa puts on what it is given, in one place.

A mapping, a shard description or a file header can ask for more than any real model
needs: a range of 10**20 names, a tensor with 100 axes, an offset past 2**63. Each bound
here is checked before the work it limits is done, so such input is an error in
milliseconds instead of minutes of work, a MemoryError or an int64 wrap-around in the
kernel. Every bound is far above the largest models there are (hundreds of layers, a few
hundred experts or heads, tensors of billions of elements).
"""

from __future__ import annotations

import os

#: Digits of a number in AOA text (axis=, num_heads=, NAME[a:b]): any count that fits int64.
MAX_NUMBER_DIGITS = 18

#: Names one macro may make from one written name or attribute: `NAME[a:b]` (b - a),
#: `num_heads` and `num_key_value_groups` of the fused QKV macros, the pieces `fused_ffn`
#: cuts a tensor into (the least common multiple of the two shard counts).
MAX_MACRO_NAMES = 1 << 14

#: Statements a `$LAYER_ID` / `$EXPERT_ID` template may expand to: the product of the ids
#: found for each placeholder (layers times experts).
MAX_TEMPLATE_INSTANCES = 1 << 20

#: Pieces (source boxes) one concat or split may make: concatenating a tensor with itself
#: doubles its pieces, so a few dozen statements could otherwise ask for 2**40; a split
#: cuts every piece it crosses. (A fused QKV of the most heads allowed has 3 * 2**14.)
MAX_PIECES = 1 << 16

#: Axes of a tensor: numpy's limit (a safetensors file or shard description with more
#: could not be read back into an array).
MAX_DIMS = 64

#: Bytes of one tensor, and so every extent, offset and element count: int64, as the kernel,
#: numpy and the safetensors format count them.
MAX_BYTES = 2**63 - 1

#: A count in a model's config.json (layers, experts, heads, hidden and vocabulary sizes):
#: real ones are at most a few hundred thousand (vocabularies).
MAX_CONFIG_COUNT = 1 << 24

#: Layers and experts a config.json may count: the library makes tensors and steps for
#: each one by one.
MAX_MODEL_UNITS = 1 << 14

#: Tensors a config.json may describe (layers times experts): the largest MoE models have
#: under 100k.
MAX_MODEL_TENSORS = 1 << 20

#: Ranks of a destination mesh (files of a sharded output: one per rank).
MAX_RANKS = 1 << 16


def shape_problem(shape: tuple[int, ...], itemsize: int) -> str | None:
    """Why a tensor of this shape (non-negative integers) cannot be handled, or None.

    Counted as the safetensors format checks it: the product of the extents, zero extents
    left out (a tensor of [2**40, 2**40, 0] holds nothing, but a reader multiplying its
    extents in order overflows before it reaches the 0), times the item size."""
    if len(shape) > MAX_DIMS:
        return f"has {len(shape)} axes, more than {MAX_DIMS}"
    size = itemsize
    for extent in shape:
        size *= extent or 1
        if size > MAX_BYTES:
            return f"would hold more than {MAX_BYTES} bytes (2**63 - 1)"
    return None


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, where the system has one): the
    bound on the threads every part of aoa starts."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
