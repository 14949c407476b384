"""Input tensors are made when asked for, yet each is the one Paddle's eager pass over the
sorted source keys would make: its shape, its dtype (quirk Q15 for a key that only optimizer
states stand for), and the same object however it is asked for."""

from __future__ import annotations

from sharding import sharded

from aoa.symbolic import InputTensors

SOURCE = {
    "a": sharded("a", (2, 3), 1, 0, "float16"),
    "b.moment1_0": sharded("b.moment1_0", (4,), 1, 0, "float32"),  # b: states only
    "b.beta1_pow_acc_0": sharded("b.beta1_pow_acc_0", (1,), 1, 0, "float32"),
    "c": sharded("c", (5,), 1, 0, "bfloat16"),
    "c.moment2_0": sharded("c.moment2_0", (5,), 1, 0, "float32"),
    "d.beta2_pow_acc_0": sharded("d.beta2_pow_acc_0", (1,), 1, 0, "float32"),  # no input
}


def inputs() -> InputTensors:
    return InputTensors(SOURCE)


def test_each_input_has_the_shape_and_dtype_of_the_eager_pass():
    # sorted: a, b.beta1_pow_acc_0, b.moment1_0, c, c.moment2_0, d.beta2_pow_acc_0; `b` takes
    # the dtype of the model key seen before it, `a` (Q15), and its shape from b.moment1_0
    made = {k: (t.shape, t.dtype, t.keys) for k, t in inputs().items()}
    assert made == {"a": ((2, 3), "float16", ("a",)), "b": ((4,), "float16", ("b",)),
                    "c": ((5,), "bfloat16", ("c",))}


def test_asking_one_by_one_gives_the_same_tensors_as_asking_for_all():
    lazy = inputs()
    c, b, a = lazy.get("c"), lazy["b"], lazy.get("a")
    assert lazy.get("d") is None and "d" not in lazy and "c.moment2_0" not in lazy
    every = dict(lazy.items())
    assert every["a"] is a and every["b"] is b and every["c"] is c
    assert list(every) == ["a", "b", "c"]
    assert (b.shape, b.dtype) == ((4,), "float16")
