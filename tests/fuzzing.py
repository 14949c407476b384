"""What the fuzz tests share: how many cases to run, and JSON values of any shape.

The suite runs a modest number of cases per fuzz test; set ``AOA_FUZZ_EXAMPLES`` to run
many more, e.g. ``AOA_FUZZ_EXAMPLES=20000 python -m pytest -q -k fuzz``.
"""

from __future__ import annotations

import json
import os
import sys

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

#: Cases per fuzz test: small in the suite, as many as asked for when hunting.
EXAMPLES = int(os.environ.get("AOA_FUZZ_EXAMPLES", "150"))

fuzz_settings = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.filter_too_much],
)

#: Numbers where bugs live: small mostly, boundaries of int64 and uint64, and beyond.
_SMALL = st.integers(-3, 9)
_EDGES = st.sampled_from([2**31, 2**32, 2**53 + 1, 2**62, 2**63 - 1, 2**63, 2**64 - 1, 2**64,
                          10**30, -(2**63)])
_HUGE = st.integers(4300, 4400).map(lambda digits: 10**digits)  # past Python's int <-> str limit
NUMBERS = st.integers(0, 99).flatmap(  # weighted: one in fifty past the digit limit
    lambda k: _SMALL if k < 60 else _EDGES if k < 85 else st.integers() if k < 98 else _HUGE)

SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, st.floats(allow_nan=True),
                    st.text(max_size=8))


def json_values(leaves=SCALARS, max_leaves: int = 12):
    """Any JSON value (lists and objects nested a few deep), from ``leaves``."""
    return st.recursive(
        leaves,
        lambda inner: st.one_of(st.lists(inner, max_size=4),
                                st.dictionaries(st.text(max_size=6), inner, max_size=4)),
        max_leaves=max_leaves,
    )


def deeply_nested(depth: int, as_object: bool) -> str:
    """JSON text nested ``depth`` deep: more than any recursive parser can take."""
    return ('{"a":' * depth + "1" + "}" * depth) if as_object else ("[" * depth + "]" * depth)


def dumps(value, compact: bool = False) -> str:
    """``value`` as JSON, numbers of any length included (Python's limit of 4300 digits is
    lifted while writing them: the readers under test must refuse them, not the fuzzer);
    ``compact``: with no spaces, as the safetensors library writes headers."""
    limit = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        return json.dumps(value, separators=(",", ":") if compact else None)
    finally:
        sys.set_int_max_str_digits(limit)
