"""Scaled float8 casts: what a shard's holder gets of the scales, and bad scales refused by name."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard.scaling import Scaled


@st.composite
def blocked_boxes(draw):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, 9)) for _ in range(ndim))
    block = tuple(draw(st.integers(1, 4)) for _ in range(ndim))
    box = []
    for n in shape:
        lo = draw(st.integers(0, n))
        box.append((lo, draw(st.integers(lo, n))))
    return shape, block, tuple(box)


@settings(max_examples=200, deadline=None)
@given(blocked_boxes(), st.integers(0, 2**32 - 1))
def test_a_shard_gets_the_scale_of_each_of_its_elements(case, seed):
    shape, block, box = case
    grid = tuple(-(-n // b) for n, b in zip(shape, block, strict=True))
    scales = np.random.default_rng(seed).uniform(0.01, 4.0, size=grid).astype(np.float32)
    scaled = Scaled("float8_e4m3fn", scales, block=block)
    scaled.check("float32", shape)
    full = scales
    for axis, b in enumerate(block):
        full = np.repeat(full, b, axis=axis)
    want = full[tuple(slice(lo, hi) for lo, hi in box)]
    got = scaled.for_box("float32", box).expanded(want.shape)
    assert np.broadcast_to(got, want.shape).tobytes() == want.tobytes()


def test_one_scale_for_the_tensor_is_rounded_to_float32():
    cast = Scaled("float8_e5m2", 0.1).for_box("bfloat16", ((0, 3),))
    assert cast.scale == float(np.float32(0.1)) and cast.src == "bfloat16"
    assert cast.expanded((3,)) == np.float32(0.1)


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        (("bfloat16", 1.0), {}, "Scaled casts to float8_e4m3fn or float8_e5m2, not bfloat16"),
        (("float8_e4m3fn", 0.0), {}, "positive finite"),
        (("float8_e4m3fn", float("nan")), {}, "positive finite"),
        (("float8_e4m3fn", np.ones(3)), {}, "one scale for the whole tensor.*pass block="),
        (("float8_e4m3fn", np.ones((2, 2))), {"block": (4,)}, r"scales of shape \(2, 2\) for blocks \(4,\)"),
        (("float8_e4m3fn", -np.ones((2, 2))), {"block": (4, 4)}, "positive finite"),
        (("float8_e4m3fn", np.ones((2, 2))), {"block": (0, 4)}, "positive length per dimension"),
    ],
)
def test_bad_scales_are_refused_by_name(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        Scaled(*args, **kwargs)


def test_scales_of_the_wrong_grid_or_source_are_refused_by_name():
    scaled = Scaled("float8_e4m3fn", np.ones((2, 2)), block=(4, 4))
    with pytest.raises(ValueError, match=r"shape \[8, 9\] in blocks \[4, 4\] takes scales of shape \[2, 3\]"):
        scaled.check("float32", (8, 9))
    with pytest.raises(ValueError, match="blocks of 2 dimensions for a tensor of shape"):
        scaled.check("float32", (8,))
    with pytest.raises(ValueError, match="takes one of float64, float32, float16, bfloat16, not int32"):
        scaled.check("int32", (8, 8))
