"""The aoa copy kernel (cpp/bindings.cpp): strided region copies with fused casts; records
made in bulk (cpp/records.cpp); safetensors header texts (cpp/header_text.cpp)."""

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

#: dtype name (Paddle's) -> the code the copy table uses for it (enum aoa::Dtype)
DTYPE_CODES: dict[str, int]

class CopyError(ValueError):
    """A copy table the kernel refuses; the message names the copy. Nothing was written."""

class BusError(RuntimeError):
    """Memory behind a buffer vanished while the copies ran (a mapped file truncated):
    ``args`` are (message, role, index, offset): "source" or "destination" (None: in
    neither), the buffer's index and the byte offset in it. The copies stopped there."""

def execute_copies(table: Any, sources: Sequence[Any], destinations: Sequence[Any],
                   threads: int = 1, windows: Any = None, source_windows: Any = None) -> None:
    """Run every copy of ``table`` (a contiguous 1-d int64 buffer of records, see
    cpp/copy_kernel.hpp) from the ``sources`` buffers into the writable ``destinations``
    (or, with ``windows``, a contiguous (n, 3) int64 buffer of rows buffer, offset, bytes:
    those ranges of them, each checked to lie inside its buffer; ``source_windows`` the
    same for the sources), on up to ``threads`` threads, the GIL released. Raises
    CopyError naming the copy before any byte moves, BusError where a buffer's memory
    vanished under the copies."""

def new_records(cls: type[Any], fields: tuple[str, ...], columns: Sequence[Iterable[Any]]
                ) -> list[Any]:
    """Objects of the slotted class ``cls``, one per row of ``columns`` (iterables of one
    length, one per name in ``fields``), each field set through its slot: the class is not
    called, so nothing is checked (for rows checked in bulk)."""

def new_record_groups(cls: type[Any], fields: tuple[str, ...], heads: Sequence[Any],
                      rows: Sequence[Sequence[tuple[Any, ...]]]) -> list[list[Any]]:
    """``[[cls(heads[i], *row) for row in rows[i]] for each i]``, made as `new_records`
    makes them (the class not called): rows are tuples of the fields after the first."""

def header_texts(shards: Sequence[Any], dtypes: dict[str, tuple[str, int]],
                 sharding: tuple[str, str, str, str] | None = None
                 ) -> tuple[bytes, npt.NDArray[np.int64], npt.NDArray[np.int64],
                            bytes | None] | None:
    """For shard descriptions (key, local_shape, dtype, global_offset) stored back to back:
    the safetensors header's entries as ``json.dumps`` writes them (compact, parted by
    commas), each one's bytes and item size, and with ``sharding`` = (quote, offsets key,
    opening, closing) the opening, each key's global offset as DCP's sharding info
    (``QkeyQ: {QoffsetsQ: [a, b]}``, parted by ``, ``), then the closing; texts as bytes.
    None where a shard is not plain: a key other than printable ASCII without quote or
    backslash, a dtype not in ``dtypes`` (dtype -> (code, item size)), a box not a tuple of
    ints in int64, sizes past int64."""

def compact_entries(text: str, start: int, end: int
                    ) -> tuple[list[str], list[str], list[tuple[int, ...]], list[int],
                               list[int]] | None:
    """``text[start:end]`` (an ASCII str) read as safetensors header entries in the compact
    form (``"name":{"dtype":"CODE","shape":[a,b],"data_offsets":[c,d]}`` parted by commas):
    names, codes, shapes, begins, ends, equal codes and shapes one object; numbers without
    leading zeros, within int64; names without backslash or control character. None where
    it is not that."""

def saved_offsets_of(text: str, names: Sequence[str]) -> list[tuple[int, ...]] | None:
    """DCP sharding info ``text`` (an ASCII str) read as ``json.dumps`` writes it, listing
    exactly ``names`` (printable ASCII without quote or backslash) in their order: each
    one's saved offsets (equal ones one object); None where it is not that."""

def shard_nbytes(shards: Sequence[Any], itemsizes: dict[str, int], none_as: str
                 ) -> npt.NDArray[np.int64] | None:
    """Each shard's bytes (the elements of its ``local_shape`` times its dtype's item size;
    a dtype of None counts as ``none_as``) as an int64 array; None where a shard is not
    plain (a dtype not in ``itemsizes``, a shape not a tuple of ints in int64, bytes past
    int64)."""
