"""The restricted pickle machine and the pickle writer, checked against Python's pickle."""

from __future__ import annotations

import collections
import pickle
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aoa.errors import StorageError
from aoa.storage import pickler, unpickler

leaves = (st.none() | st.booleans() | st.integers(-(2**80), 2**80)
          | st.floats(allow_nan=False) | st.text(max_size=300))
plain = st.recursive(
    leaves,
    lambda children: (st.lists(children, max_size=5) | st.tuples(children, children)
                      | st.tuples() | st.dictionaries(st.text(max_size=5), children, max_size=5)
                      | st.frozensets(st.integers(), max_size=4)),
    max_leaves=40,
)


@settings(max_examples=150, deadline=None)
@given(value=plain, protocol=st.integers(0, 5))
def test_plain_values_load_as_python_loads_them(value, protocol):
    data = pickle.dumps(value, protocol=protocol)
    assert unpickler.load(data, "x.pkl", {}) == pickle.loads(data)


@settings(max_examples=100, deadline=None)
@given(value=plain.filter(lambda v: not _has_frozenset(v)), protocol=st.sampled_from([2, 4]))
def test_written_pickles_load_in_python(value, protocol):
    assert pickle.loads(pickler.dumps(value, protocol=protocol).bytes()) == value


def _has_frozenset(value) -> bool:
    if isinstance(value, frozenset):
        return True
    if isinstance(value, (list, tuple)):
        return any(map(_has_frozenset, value))
    if isinstance(value, dict):
        return any(map(_has_frozenset, value.values()))
    return False


def test_payloads_stay_in_place_with_their_offsets():
    big = bytes(range(256)) * 1000
    data = pickle.dumps({"small": b"ab", "big": big, "list": [b"x" * 70000]}, protocol=4)
    loaded = unpickler.load(data, "x.pkl", {})
    payload = loaded["big"]
    assert isinstance(payload, unpickler.Payload)
    assert data[payload.offset:payload.offset + payload.nbytes] == big
    assert bytes(payload.data) == big
    assert payload.data.readonly
    assert bytes(loaded["small"].data) == b"ab"
    assert bytes(loaded["list"][0].data) == b"x" * 70000


def test_holes_are_aligned_and_filled_in_place():
    hole = pickler.Hole(10)
    laid = pickler.dumps({"t": hole, "after": [1, 2]}, base=13)
    assert (13 + laid.offset(hole)) % pickler.PAYLOAD_ALIGNMENT == 0
    data = bytearray(laid.bytes())
    data[laid.offset(hole):laid.offset(hole) + 10] = b"0123456789"
    assert pickle.loads(bytes(data)) == {"t": b"0123456789", "after": [1, 2]}
    assert pickle.loads(bytes(data))["t"] == b"0123456789"


class Point:
    def __init__(self, x: int) -> None:
        self.x = x


def test_named_classes_become_records():
    allowed = unpickler.records(f"{__name__}.Point")
    loaded = unpickler.load(pickle.dumps([Point(3), Point(4)], protocol=2), "p.pkl", allowed)
    assert [unpickler.fields(p, f"{__name__}.Point", "p.pkl", "point") for p in loaded] == [
        {"x": 3}, {"x": 4}]


def test_a_callable_of_our_own_is_called():
    data = pickle.dumps(collections.OrderedDict(a=1), protocol=2)
    assert unpickler.load(data, "o.pkl", {("collections", "OrderedDict"): dict}) == {"a": 1}


@pytest.mark.parametrize("protocol", [0, 2, 4])
def test_a_forbidden_class_is_refused_by_name_and_file(protocol):
    data = pickle.dumps(collections.Counter(a=1), protocol=protocol)
    with pytest.raises(StorageError) as caught:
        unpickler.load(data, Path("ckpt/0.metadata"), {("collections", "OrderedDict"): dict})
    assert caught.value.message == (
        "ckpt/0.metadata: the pickle asks for 'collections.Counter', which aoa does not load")


def test_a_function_call_is_never_run(tmp_path):
    marker = tmp_path / "ran"
    data = pickle.dumps(_Exploit(str(marker)), protocol=2)
    with pytest.raises(StorageError, match=r"'posix\.system'|'os\.system'"):
        unpickler.load(data, "evil.pkl", unpickler.records("collections.OrderedDict"))
    assert not marker.exists()


class _Exploit:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        import os
        return (os.system, (f"touch {self.path}",))


@pytest.mark.parametrize("cut", [1, 5, 20, -2])
def test_a_truncated_pickle_is_an_error_naming_the_file(cut):
    data = pickle.dumps({"weight": b"x" * 100, "n": [1, 2, 3]}, protocol=4)
    with pytest.raises(StorageError, match=r"^error: x\.distcp: truncated"):
        unpickler.load(data[:cut], "x.distcp", {})


def test_a_payload_running_past_the_end_is_an_error():
    data = bytearray(pickle.dumps(b"x" * 1000, protocol=4))
    at = data.index(b"B" + (1000).to_bytes(4, "little")) + 1
    data[at:at + 4] = (10**9).to_bytes(4, "little")
    with pytest.raises(StorageError, match="truncated: the pickle needs 1000000000 bytes"):
        unpickler.load(bytes(data), "x.distcp", {})


def test_the_end_bound_is_kept():
    data = pickle.dumps([1, 2, 3], protocol=2) + pickle.dumps("second", protocol=2)
    first = len(pickle.dumps([1, 2, 3], protocol=2))
    assert unpickler.load(data, "x", {}, end=first) == [1, 2, 3]
    assert unpickler.load(data, "x", {}, start=first) == "second"
    with pytest.raises(StorageError, match="truncated"):
        unpickler.load(data, "x", {}, end=first - 1)


def test_build_on_a_plain_value_is_refused():
    data = b"\x80\x02]}b."  # BUILD a list with a dict
    with pytest.raises(StorageError, match="BUILD on a list"):
        unpickler.load(data, "x", {})


# -- load_metadata: Python's C unpickler, restricted, with the machine behind it for errors ---

@settings(max_examples=100, deadline=None)
@given(value=plain, protocol=st.integers(0, 5))
def test_metadata_reads_plain_values_as_the_machine_does(value, protocol):
    data = pickle.dumps(value, protocol=protocol)
    assert unpickler.load_metadata(data, "x", {}) == unpickler.load(data, "x", {})


@pytest.mark.parametrize("fixture", ["dcp/tp2/.metadata", "dcp/fsdp4/.metadata",
                                     "torch_dist/tp2/.metadata", "paddle/tp2/0.metadata",
                                     "paddle/flat4/0.metadata"])
def test_metadata_files_read_as_the_machine_reads_them(fixture):
    from aoa.storage import dcp, paddle

    allowed = paddle.ALLOWED if fixture.startswith("paddle") else dcp.ALLOWED
    data = (Path(__file__).parent.parent / "fixtures" / fixture).read_bytes()
    assert repr(unpickler.load_metadata(data, "m", allowed)) == repr(
        unpickler.load(data, "m", allowed))


@pytest.mark.parametrize("protocol", [0, 2, 4])
def test_metadata_refuses_a_forbidden_class_with_the_machines_message(protocol):
    data = pickle.dumps(collections.Counter(a=1), protocol=protocol)
    with pytest.raises(StorageError) as caught:
        unpickler.load_metadata(data, Path("ckpt/0.metadata"),
                                {("collections", "OrderedDict"): dict})
    assert caught.value.message == (
        "ckpt/0.metadata: the pickle asks for 'collections.Counter', which aoa does not load")


def test_metadata_never_runs_a_function(tmp_path):
    marker = tmp_path / "ran"
    with pytest.raises(StorageError, match=r"'posix\.system'|'os\.system'"):
        unpickler.load_metadata(pickle.dumps(_Exploit(str(marker)), protocol=2), "evil.pkl",
                                unpickler.records("collections.OrderedDict"))
    assert not marker.exists()


def test_metadata_cannot_rename_a_shared_record_class():
    allowed = unpickler.records("torch.Size")
    # GLOBAL torch.Size, then BUILD it with the slot state {"module": "os"}
    data = b"\x80\x02ctorch\nSize\nN}X\x06\x00\x00\x00moduleX\x02\x00\x00\x00oss\x86b."
    with pytest.raises(StorageError, match=r"BUILD on a torch\.Size"):
        unpickler.load_metadata(data, "x", allowed)
    assert allowed[("torch", "Size")].module == "torch"


def test_metadata_refuses_a_record_built_twice():
    allowed = unpickler.records(f"{__name__}.Point")
    data = bytearray(pickle.dumps(Point(3), protocol=2))
    assert data.endswith(b"b.")
    data[-1:] = b"}b."  # a second BUILD with an empty state
    with pytest.raises(StorageError, match=r"BUILD twice on a .*Point"):
        unpickler.load_metadata(bytes(data), "x", allowed)


@pytest.mark.parametrize("cut", [1, 5, 20, -2])
def test_metadata_cut_short_is_the_machines_error(cut):
    data = pickle.dumps({"n": [1, 2, 3], "s": "x" * 100}, protocol=4)
    with pytest.raises(StorageError, match=r"^error: x\.metadata: truncated"):
        unpickler.load_metadata(data[:cut], "x.metadata", {})


@pytest.mark.parametrize("length", [0, 254, 255, 256, 4351, 4352, 4353, (1 << 20) - 1])
def test_a_text_line_of_any_length_up_to_a_mebibyte_is_read(length):
    """The end of line is looked for in windows that grow from 256 bytes; a pickle's bytes
    may go on past it (a legacy torch.save file's tensors)."""
    text = "x" * length
    data = b"V" + text.encode() + b"\n." + bytes(1 << 21)
    assert unpickler.load(data, "f", {}) == text


def test_a_text_line_longer_than_a_mebibyte_is_refused():
    data = b"V" + b"x" * (1 << 20) + b"\n."
    with pytest.raises(StorageError) as caught:
        unpickler.load(data, "f", {})
    assert caught.value.message == "f: bad pickle at byte 1: a text argument has no end of line"
