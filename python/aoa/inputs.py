"""Text and JSON from the files aoa is given, every failure an AoaError naming the file.

A file that cannot be read, is not UTF-8, is not JSON, holds a number Python refuses to
convert (more than 4300 digits) or nests deeper than the parser recurses would otherwise
end in an OSError, UnicodeDecodeError, ValueError or RecursionError. Strings that are not
Unicode text (a lone surrogate escaped as `\\ud800`) are refused too: they cannot be
written to a file or a terminal later.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aoa.errors import AoaError, UsageError


def read_text(path: str | os.PathLike[str], what: str, error: type[AoaError] = UsageError) -> str:
    """The UTF-8 text of ``path``, ``what`` it is named in messages ("mapping", ...)."""
    try:
        data = Path(path).read_bytes()
    except OSError as failure:
        raise error(f"cannot read {what} {path}: {failure.strerror}") from None
    return decode(data, path, what, error)


def decode(data: bytes, path: str | os.PathLike[str], what: str,
           error: type[AoaError] = UsageError) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as failure:
        line = data.count(b"\n", 0, failure.start) + 1
        raise error(f"{path}: the {what} is not UTF-8 text: byte {failure.start} (line {line}) "
                    f"is {data[failure.start:failure.start + 1]!r}") from None


def load_json(text: str, where: str, error: type[AoaError] = UsageError,
              object_pairs_hook: Callable[[list[tuple[str, Any]]], Any] | None = None) -> Any:
    """Parse ``text``; ``where`` names it in messages (a path, or a path and a key)."""
    try:
        value = json.loads(text, object_pairs_hook=object_pairs_hook,
                           parse_constant=_no_constant)
    except json.JSONDecodeError as failure:
        raise error(f"{where}:{failure.lineno}:{failure.colno}: not valid JSON: "
                    f"{failure.msg}") from None
    except RecursionError:
        raise error(f"{where}: not valid JSON: nested too deeply") from None
    except ValueError as failure:  # a number of more than 4300 digits, a duplicate key
        why = ("a number has more than 4300 digits" if "integer string conversion"
               in str(failure) else str(failure))
        raise error(f"{where}: not valid JSON: {why}") from None
    if _SURROGATE_ESCAPE.search(text) and _has_lone_surrogate(value):
        raise error(f"{where}: a string holds an escaped lone surrogate (such as \\ud800), "
                    "which is not Unicode text")
    return value


#: A `\uD800`-`\uDFFF` escape: JSON text without one decodes to strings without surrogates.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _has_lone_surrogate(value: Any) -> bool:
    """Whether any string in ``value`` (keys too) is not Unicode text. Walked with a stack,
    not recursion: the value may be nested as deep as the parser allowed."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if not item.isascii() and not is_text(item):
                return True
        elif isinstance(item, dict):
            stack += item
            stack += item.values()
        elif isinstance(item, (list, tuple)):  # tuple: an object read as its pairs
            stack += item
    return False


def is_text(string: str) -> bool:
    """Whether ``string`` can be written as UTF-8 (holds no lone surrogate)."""
    try:
        string.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")
