"""A restricted pickle machine: reads the pickles checkpoints are made of, runs none of them.

Paddle's ``.metadata`` and ``.distcp``, PyTorch DCP's ``.metadata`` and the ``data.pkl`` inside
every ``torch.save`` file are pickles. Python's own unpickler would import and call whatever a
pickle names; this one walks the opcodes itself and builds only plain values (None, bools,
numbers, strings, tuples, lists, dicts, sets) and objects of the classes the caller names:

* a `RecordClass` builds a `Record`: the class's name, the arguments and the state the
  pickle gave it, nothing run. The format module then reads its records into its own
  dataclasses, checking every field (``fields``, ``int_tuple`` help).
* a callable of aoa's own (``dict`` for ``collections.OrderedDict``) is called.

Any other global is refused with its name and the file. Bytes payloads are not copied: each
becomes a `Payload`, its offset in the file and a view of its bytes in the file's mapping, so
a tensor stored inside a pickle is read in place (Paddle's ``.distcp``).

Metadata pickles, which hold no tensor bytes, are read by `load_metadata`: Python's own C
unpickler, allowed the same globals and nothing else, with this machine behind it for the
errors.
"""

from __future__ import annotations

import _compat_pickle
import codecs
import io
import pickle
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aoa.errors import StorageError

_UNSIGNED = {1: "<B", 2: "<H", 4: "<I", 8: "<Q"}
_HINT = ("aoa never runs code from a checkpoint: it reads only the classes of the formats it "
         "knows.")


@dataclass(frozen=True, slots=True)
class Payload:
    """Bytes held by a pickle, left where they lie: ``offset`` in the file, ``data`` a
    read-only view of them (no copy)."""

    offset: int
    data: memoryview

    @property
    def nbytes(self) -> int:
        return len(self.data)


class RecordClass(type):
    """A class (or function, or constant) a pickle may name: ``module.name``. Called or
    instantiated, it makes a `Record`; named as a value (``torch.float32``), it is itself.

    It is a type, one per name, so that Python's own unpickler can instantiate it too
    (`load_metadata`): NEWOBJ takes only types, and its ``__new__`` makes the `Record`."""

    module: str
    name: str

    def __new__(mcs, module: str, name: str) -> RecordClass:
        cls = super().__new__(mcs, name, (), {"__new__": _new_record, "__slots__": ()})
        type.__setattr__(cls, "module", module)
        type.__setattr__(cls, "name", name)
        return cls

    def __setattr__(cls, name: str, value: Any) -> None:
        """Read-only: a pickle's BUILD must not rename the classes every later read shares."""
        raise TypeError(f"{cls.qualname} is read-only")

    def __init__(cls, module: str, name: str) -> None:
        super().__init__(name, (), {})

    @property
    def qualname(cls) -> str:
        return f"{cls.module}.{cls.name}"

    def __repr__(cls) -> str:
        return f"RecordClass(module={cls.module!r}, name={cls.name!r})"


def _new_record(cls: RecordClass, *args: Any) -> Record:
    return Record(cls, args)


class Record:
    """What a pickle built from a `RecordClass`: the arguments it was called with and, after
    a BUILD, the state it was given."""

    __slots__ = ("args", "cls", "state")

    def __init__(self, cls: RecordClass, args: tuple) -> None:
        self.cls = cls
        self.args = args
        self.state: Any = None

    def __setstate__(self, state: Any) -> None:
        if self.state is not None:
            raise ValueError(f"BUILD twice on a {self.cls.qualname}")
        self.state = state

    def __repr__(self) -> str:
        return f"Record({self.cls.qualname}, args={self.args!r}, state={self.state!r})"


#: What a global may resolve to: a record class, or a callable of aoa's own.
Allowed = Mapping[tuple[str, str], RecordClass | Callable[..., Any]]


def _latin1_bytes(text: str, encoding: str = "latin1") -> bytes:
    """``_codecs.encode(text, "latin1")``: how protocols 0 to 2 pickle bytes; nothing else."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise ValueError("_codecs.encode is read only as protocol 2 writes bytes")
    return text.encode("latin-1")


#: Plain values every pickle may build: how protocols 0 to 3 write sets and bytes.
PLAIN: dict[tuple[str, str], Callable[..., Any]] = {
    ("builtins", "set"): set, ("builtins", "frozenset"): frozenset,
    ("_codecs", "encode"): _latin1_bytes,
}


def records(*qualnames: str) -> dict[tuple[str, str], RecordClass]:
    """Allowed globals, each a record class, from dotted names (``torch.Size``)."""
    table = {}
    for qualname in qualnames:
        module, _, name = qualname.rpartition(".")
        table[(module, name)] = RecordClass(module, name)
    return table


def load(
    data: bytes | bytearray | memoryview,
    where: str | Path,
    allowed: Allowed,
    *,
    start: int = 0,
    end: int | None = None,
    persistent_load: Callable[[Any], Any] | None = None,
) -> Any:
    """The object pickled in ``data[start:end]``; ``where`` names the file in messages.

    Offsets of payloads are positions in ``data``. Raises StorageError for anything that is
    not a well-formed pickle of allowed classes (naming the byte where it went wrong)."""
    return load_one(data, where, allowed, start=start, end=end,
                    persistent_load=persistent_load)[0]


def load_one(
    data: bytes | bytearray | memoryview,
    where: str | Path,
    allowed: Allowed,
    *,
    start: int = 0,
    end: int | None = None,
    persistent_load: Callable[[Any], Any] | None = None,
) -> tuple[Any, int]:
    """`load`, and the byte after the pickle's STOP: where the next pickle of a file that
    holds several one after another begins (torch.save's legacy format)."""
    view = memoryview(data).cast("B") if not isinstance(data, memoryview) else data.cast("B")
    machine = _Machine(view, str(where), {**PLAIN, **allowed}, start,
                       len(view) if end is None else end, persistent_load)
    return machine.run(), machine.pos


def load_metadata(data: bytes | bytearray | memoryview, where: str | Path,
                  allowed: Allowed) -> Any:
    """`load` for metadata pickles, whose bytes are wanted as ``bytes``, not in place.

    Python's own C unpickler reads them, asked for no global but those of ``allowed``
    (Python's "restricting globals"): three to five times faster than `load` on the
    metadata of a checkpoint with many shards. Anything it refuses or fails on is read
    again by `load`, so every error names the file and the byte as `load`'s do."""
    table = {**PLAIN, **allowed}
    try:
        return _RestrictedUnpickler(io.BytesIO(data), table).load()
    except Exception:  # read again below, for the exact error
        pass
    return load(data, where, allowed)


class _RestrictedUnpickler(pickle.Unpickler):
    """Python's unpickler, finding only the globals of a table: it calls nothing else.
    No ``persistent_load``: a persistent id is an error, as in metadata it is."""

    def __init__(self, file: io.BytesIO, allowed: Allowed) -> None:
        super().__init__(file)
        self.allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        found = self.allowed.get((module, name))
        if found is None:  # Python 2 names, as Python's unpickler maps them back
            module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
            found = self.allowed.get((_compat_pickle.IMPORT_MAPPING.get(module, module), name))
        if found is None:
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed")
        return found


class _Machine:
    """The unpickler's state; one method per opcode, found by a table."""

    def __init__(self, data: memoryview, where: str, allowed: Allowed, start: int, end: int,
                 persistent_load: Callable[[Any], Any] | None) -> None:
        if not 0 <= start <= end <= len(data):
            raise StorageError(f"{where}: pickle at bytes [{start}, {end}) lies outside the "
                               f"file ({len(data)} bytes)")
        self.data = data
        self.where = where
        self.allowed = allowed
        self.pos = start
        self.end = end
        self.persistent_load = persistent_load
        self.protocol = 0
        self.stack: list[Any] = []
        self.marks: list[list[Any]] = []
        self.memo: dict[int, Any] = {}
        #: the callables of aoa's own that the pickle may call (ids: they need not hash)
        self.callables = {id(value) for value in allowed.values()
                          if not isinstance(value, RecordClass)}
        #: aoa's own classes whose objects take a state (BUILD) through ``__setstate__``
        self.buildable = tuple(value for value in allowed.values()
                               if isinstance(value, type) and "__setstate__" in vars(value))

    # -- reading ---------------------------------------------------------------------------

    def fail(self, what: str, hint: str | None = None) -> StorageError:
        return StorageError(f"{self.where}: bad pickle at byte {self.pos}: {what}", hint=hint)

    def take(self, count: int) -> memoryview:
        if count < 0 or self.pos + count > self.end:
            raise StorageError(
                f"{self.where}: truncated: the pickle needs {count} bytes at byte {self.pos}, "
                f"past its end at byte {self.end}")
        chunk = self.data[self.pos:self.pos + count]
        self.pos += count
        return chunk

    def unsigned(self, size: int) -> int:
        return int(struct.unpack(_UNSIGNED[size], self.take(size))[0])

    def line_bytes(self) -> bytes:
        """A newline-ended argument of the text opcodes (protocol 0, and GLOBAL in every
        protocol), of at most 1 MiB. The end of line is looked for in windows growing from
        256 bytes: a pickle's end may be a whole file's (torch.save's legacy format), whose
        next megabyte is tensor bytes not to be copied for a name of 20."""
        limit = min(self.end, self.pos + (1 << 20))
        start, window = self.pos, 256
        while start < limit:
            stop = min(limit, start + window)
            found = bytes(self.data[start:stop]).find(b"\n")
            if found >= 0:
                return bytes(self.take(start + found + 1 - self.pos)[:-1])
            start, window = stop, window * 16
        raise self.fail("a text argument has no end of line")

    def line(self) -> str:
        return self.line_bytes().decode("latin-1")

    def pop_mark(self) -> list[Any]:
        if not self.marks:
            raise self.fail("no MARK to pop to")
        items = self.stack
        self.stack = self.marks.pop()
        return items

    def pop(self) -> Any:
        if not self.stack:
            raise self.fail("the stack is empty")
        return self.stack.pop()

    def top(self) -> Any:
        if not self.stack:
            raise self.fail("the stack is empty")
        return self.stack[-1]

    # -- running ---------------------------------------------------------------------------

    def run(self) -> Any:
        table = _OPCODES
        data = self.data
        try:
            while True:
                if self.pos >= self.end:
                    raise StorageError(f"{self.where}: truncated: the pickle ends at byte "
                                       f"{self.end} before its STOP")
                code = data[self.pos]
                self.pos += 1
                handler = table.get(code)
                if handler is None:
                    self.pos -= 1
                    raise self.fail(f"opcode {bytes([code])!r} is not one aoa reads")
                if handler is _stop:
                    if len(self.stack) != 1 or self.marks:
                        raise self.fail("STOP with a stack that does not hold exactly one "
                                        "object")
                    return self.stack[0]
                handler(self)
        except StorageError:
            raise
        except (TypeError, ValueError, KeyError, IndexError, AttributeError,
                OverflowError, UnicodeDecodeError, RecursionError) as error:
            raise self.fail(f"{type(error).__name__}: {error}") from None

    def resolve(self, module: str, name: str) -> Any:
        if self.protocol < 3:  # Python 2 names, as Python's unpickler maps them back
            module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
            module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        found = self.allowed.get((module, name))
        if found is None:
            raise StorageError(
                f"{self.where}: the pickle asks for '{module}.{name}', which aoa does not "
                f"load", hint=_HINT)
        return found

    def call(self, func: Any, args: Any) -> Any:
        if not isinstance(args, tuple):
            raise self.fail(f"arguments of a call are {type(args).__name__}, not a tuple")
        if isinstance(func, RecordClass):
            return Record(func, args)
        if id(func) in self.callables:
            return func(*args)
        raise self.fail(f"calls {_describe(func)}, which is not a class it may build",
                        hint=_HINT)


def _describe(value: Any) -> str:
    return value.qualname if isinstance(value, RecordClass) else type(value).__name__


# -- the opcodes (protocols 0 to 4; protocol 5's out-of-band buffers are refused) -----------

def _proto(m: _Machine) -> None:
    version = m.unsigned(1)
    if version > 5:
        raise m.fail(f"pickle protocol {version} is newer than 5")
    m.protocol = version


def _frame(m: _Machine) -> None:
    size = m.unsigned(8)
    if m.pos + size > m.end:
        raise StorageError(f"{m.where}: truncated: a frame of {size} bytes at byte {m.pos} "
                           f"runs past the pickle's end at byte {m.end}")


def _stop(m: _Machine) -> None:  # handled in run()
    raise AssertionError


def _mark(m: _Machine) -> None:
    m.marks.append(m.stack)
    m.stack = []


def _pop(m: _Machine) -> None:
    if m.stack:
        m.stack.pop()
    else:
        m.pop_mark()


def _pop_mark_op(m: _Machine) -> None:
    m.pop_mark()


def _dup(m: _Machine) -> None:
    m.stack.append(m.top())


def _push(value: Any) -> Callable[[_Machine], None]:
    def push(m: _Machine) -> None:
        m.stack.append(value)
    return push


def _binint(m: _Machine) -> None:
    m.stack.append(int(struct.unpack("<i", m.take(4))[0]))


def _unsigned_int(size: int) -> Callable[[_Machine], None]:
    def read(m: _Machine) -> None:
        m.stack.append(m.unsigned(size))
    return read


def _long_bytes(size: int) -> Callable[[_Machine], None]:
    def read(m: _Machine) -> None:
        count = m.unsigned(size)
        if count > 1 << 16:
            raise m.fail(f"an integer of {count} bytes")
        m.stack.append(int.from_bytes(m.take(count), "little", signed=True))
    return read


def _int_text(m: _Machine) -> None:
    text = m.line()
    if text in ("00", "01"):
        m.stack.append(text == "01")
    else:
        m.stack.append(int(text, 10))


def _long_text(m: _Machine) -> None:
    m.stack.append(int(m.line().rstrip("L"), 10))


def _binfloat(m: _Machine) -> None:
    m.stack.append(float(struct.unpack(">d", m.take(8))[0]))


def _float_text(m: _Machine) -> None:
    m.stack.append(float(m.line()))


def _unicode(size: int) -> Callable[[_Machine], None]:
    def read(m: _Machine) -> None:
        count = m.unsigned(size)
        m.stack.append(str(m.take(count), "utf-8", "surrogatepass"))
    return read


def _unicode_text(m: _Machine) -> None:
    m.stack.append(codecs.decode(m.line_bytes(), "raw-unicode-escape"))


def _payload(size: int) -> Callable[[_Machine], None]:
    def read(m: _Machine) -> None:
        count = m.unsigned(size)
        offset = m.pos
        m.stack.append(Payload(offset, m.take(count).toreadonly()))
    return read


def _latin1(size: int) -> Callable[[_Machine], None]:
    """Python 2's str, read as Python 3 reads it with ``encoding="latin1"`` (as Paddle does)."""
    def read(m: _Machine) -> None:
        count = m.unsigned(size)
        m.stack.append(str(m.take(count), "latin-1"))
    return read


def _tuple(m: _Machine) -> None:
    items = tuple(m.pop_mark())  # before m.stack is looked up: popping the mark replaces it
    m.stack.append(items)


def _tuple_n(count: int) -> Callable[[_Machine], None]:
    def build(m: _Machine) -> None:
        if len(m.stack) < count:
            raise m.fail(f"TUPLE{count} with {len(m.stack)} objects on the stack")
        items = tuple(m.stack[-count:]) if count else ()
        del m.stack[len(m.stack) - count:]
        m.stack.append(items)
    return build


def _list(m: _Machine) -> None:
    items = m.pop_mark()
    m.stack.append(items)


def _dict(m: _Machine) -> None:
    items = m.pop_mark()
    if len(items) % 2:
        raise m.fail("DICT with an odd number of items")
    m.stack.append({items[i]: items[i + 1] for i in range(0, len(items), 2)})


def _append(m: _Machine) -> None:
    value = m.pop()
    target = m.top()
    if not isinstance(target, list):
        raise m.fail(f"APPEND to a {_describe(target)}, not a list")
    target.append(value)


def _appends(m: _Machine) -> None:
    items = m.pop_mark()
    target = m.top()
    if not isinstance(target, list):
        raise m.fail(f"APPENDS to a {_describe(target)}, not a list")
    target.extend(items)


def _setitem(m: _Machine) -> None:
    value = m.pop()
    key = m.pop()
    target = m.top()
    if not isinstance(target, dict):
        raise m.fail(f"SETITEM on a {_describe(target)}, not a dict")
    target[key] = value


def _setitems(m: _Machine) -> None:
    items = m.pop_mark()
    target = m.top()
    if not isinstance(target, dict) or len(items) % 2:
        raise m.fail(f"SETITEMS on a {_describe(target)} with {len(items)} items")
    for i in range(0, len(items), 2):
        target[items[i]] = items[i + 1]


def _additems(m: _Machine) -> None:
    items = m.pop_mark()
    target = m.top()
    if not isinstance(target, set):
        raise m.fail(f"ADDITEMS to a {_describe(target)}, not a set")
    target.update(items)


def _frozenset(m: _Machine) -> None:
    items = frozenset(m.pop_mark())
    m.stack.append(items)


def _empty_set(m: _Machine) -> None:
    m.stack.append(set())


def _empty_list(m: _Machine) -> None:
    m.stack.append([])


def _empty_dict(m: _Machine) -> None:
    m.stack.append({})


def _byte(m: _Machine) -> int:
    """The one-byte argument of the opcode just read."""
    if m.pos >= m.end:
        raise StorageError(f"{m.where}: truncated: the pickle ends at byte {m.end} inside "
                           "an opcode")
    value = m.data[m.pos]
    m.pos += 1
    return value


def _binint1(m: _Machine) -> None:
    m.stack.append(_byte(m))


def _short_unicode(m: _Machine) -> None:
    count = _byte(m)
    m.stack.append(str(m.take(count), "utf-8", "surrogatepass"))


def _binput(m: _Machine) -> None:
    index = _byte(m)
    if not m.stack:
        raise m.fail("the stack is empty")
    m.memo[index] = m.stack[-1]


def _binget(m: _Machine) -> None:
    index = _byte(m)
    if index not in m.memo:
        raise m.fail(f"memo entry {index} was never stored")
    m.stack.append(m.memo[index])


def _memo_put(m: _Machine, index: int) -> None:
    m.memo[index] = m.top()


def _memo_get(m: _Machine, index: int) -> None:
    if index not in m.memo:
        raise m.fail(f"memo entry {index} was never stored")
    m.stack.append(m.memo[index])


def _put_text(m: _Machine) -> None:
    _memo_put(m, int(m.line()))


def _get_text(m: _Machine) -> None:
    _memo_get(m, int(m.line()))


def _memo_op(op: Callable[[_Machine, int], None], size: int) -> Callable[[_Machine], None]:
    def run(m: _Machine) -> None:
        op(m, m.unsigned(size))
    return run


def _memoize(m: _Machine) -> None:
    if not m.stack:
        raise m.fail("the stack is empty")
    m.memo[len(m.memo)] = m.stack[-1]


def _global(m: _Machine) -> None:
    module = m.line()
    name = m.line()
    m.stack.append(m.resolve(module, name))


def _stack_global(m: _Machine) -> None:
    name = m.pop()
    module = m.pop()
    if not isinstance(module, str) or not isinstance(name, str):
        raise m.fail("STACK_GLOBAL with a module or name that is not a string")
    m.stack.append(m.resolve(module, name))


def _reduce(m: _Machine) -> None:
    args = m.pop()
    func = m.pop()
    m.stack.append(m.call(func, args))


def _newobj(m: _Machine) -> None:
    args = m.pop()
    cls = m.pop()
    m.stack.append(m.call(cls, args))


def _newobj_ex(m: _Machine) -> None:
    kwargs = m.pop()
    args = m.pop()
    cls = m.pop()
    if kwargs:
        raise m.fail("NEWOBJ_EX with keyword arguments")
    m.stack.append(m.call(cls, args))


def _build(m: _Machine) -> None:
    state = m.pop()
    target = m.top()
    if isinstance(target, Record):
        if target.state is not None:
            raise m.fail(f"BUILD twice on a {target.cls.qualname}")
        target.state = state
    elif isinstance(target, m.buildable):
        target.__setstate__(state)  # type: ignore[attr-defined]
    else:
        raise m.fail(f"BUILD on a {_describe(target)}, which takes no state")


def _binpersid(m: _Machine) -> None:
    pid = m.pop()
    if m.persistent_load is None:
        raise m.fail("a persistent id, which this file does not use")
    m.stack.append(m.persistent_load(pid))


_OPCODES: dict[int, Callable[[_Machine], None]] = {
    ord(code): handler for code, handler in {
        b"\x80": _proto, b"\x95": _frame, b".": _stop, b"(": _mark, b"0": _pop,
        b"1": _pop_mark_op, b"2": _dup,
        b"N": _push(None), b"\x88": _push(True), b"\x89": _push(False),
        b"J": _binint, b"K": _binint1, b"M": _unsigned_int(2),
        b"\x8a": _long_bytes(1), b"\x8b": _long_bytes(4), b"I": _int_text, b"L": _long_text,
        b"G": _binfloat, b"F": _float_text,
        b"X": _unicode(4), b"\x8c": _short_unicode, b"\x8d": _unicode(8), b"V": _unicode_text,
        b"B": _payload(4), b"C": _payload(1), b"\x8e": _payload(8),
        b"\x96": _payload(8), b"T": _latin1(4), b"U": _latin1(1),
        b")": _tuple_n(0), b"\x85": _tuple_n(1), b"\x86": _tuple_n(2), b"\x87": _tuple_n(3),
        b"t": _tuple, b"]": _empty_list, b"l": _list, b"a": _append, b"e": _appends,
        b"}": _empty_dict, b"d": _dict, b"s": _setitem, b"u": _setitems,
        b"\x8f": _empty_set, b"\x90": _additems, b"\x91": _frozenset,
        b"p": _put_text, b"q": _binput, b"r": _memo_op(_memo_put, 4),
        b"\x94": _memoize, b"g": _get_text, b"h": _binget,
        b"j": _memo_op(_memo_get, 4),
        b"c": _global, b"\x93": _stack_global, b"R": _reduce, b"\x81": _newobj,
        b"\x92": _newobj_ex, b"b": _build, b"Q": _binpersid,
    }.items()
}


# -- reading records into the format's own dataclasses ---------------------------------------

def is_record(value: Any, qualname: str) -> bool:
    return isinstance(value, Record) and value.cls.qualname == qualname


def fields(value: Any, qualnames: str | tuple[str, ...], where: str | Path,
           what: str) -> dict[str, Any]:
    """The state dict of a record of one of ``qualnames`` (a dataclass as pickled)."""
    names = (qualnames,) if isinstance(qualnames, str) else qualnames
    if not isinstance(value, Record) or value.cls.qualname not in names:
        raise StorageError(f"{where}: {what} is {shown(value)}, not a {names[0]}")
    state = value.state
    if isinstance(state, tuple) and len(state) == 2 and state[0] is None:
        state = state[1]  # a dataclass with __slots__ pickles (None, slot state)
    if state is None:
        return {}
    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
        raise StorageError(f"{where}: {what} ({value.cls.name}) has state {shown(state)}, "
                           "not an object of named fields")
    return state


def int_tuple(value: Any, where: str | Path, what: str, *, size: int | None = None
              ) -> tuple[int, ...]:
    """A tuple or list of non-negative ints (``torch.Size`` included), checked."""
    if is_record(value, "torch.Size") and len(value.args) == 1:
        value = value.args[0]
    if not isinstance(value, (tuple, list)) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in value):
        raise StorageError(f"{where}: {what} is {shown(value)}, not non-negative integers")
    if size is not None and len(value) != size:
        raise StorageError(f"{where}: {what} has {len(value)} axes, not {size}")
    return tuple(value)


def string(value: Any, where: str | Path, what: str) -> str:
    if not isinstance(value, str):
        raise StorageError(f"{where}: {what} is {shown(value)}, not a string")
    return value


def shown(value: Any) -> str:
    """A value of a pickle as a message names it: short, and a record by its class."""
    if isinstance(value, Record):
        return f"a {value.cls.qualname}"
    if isinstance(value, Payload):
        return f"{value.nbytes} bytes"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
