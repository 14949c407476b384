"""`model_state_keys`: each key less the optimizer suffix `split_optimizer_suffix` finds."""

from __future__ import annotations

from fuzzing import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st

from aoa.layout import OPTIMIZER_SUFFIXES, model_state_keys, split_optimizer_suffix

keys = st.lists(st.tuples(st.sampled_from(["w", "a.b", "", ".w_0"]),
                          st.sampled_from(["", *OPTIMIZER_SUFFIXES])).map("".join), max_size=8)


@fuzz_settings
@given(keys)
def test_model_state_keys_are_the_keys_less_their_suffixes(names):
    info = {key: [] for key in names}
    assert model_state_keys(info) == frozenset(split_optimizer_suffix(key)[0] for key in names)


def test_no_shard_info_has_no_keys():
    assert model_state_keys(None) == frozenset() == model_state_keys({})
