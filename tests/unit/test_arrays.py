"""``arrays.copy_many``: the copies of a commit or a direct write's thousands of small outputs."""

from __future__ import annotations

import numpy as np
import pytest

from reshard.runtime import arrays

pytestmark = pytest.mark.unit


def test_copy_many_copies_every_pair_bit_exact_into_contiguous_and_strided_targets():
    rng = np.random.default_rng(0)
    srcs = [rng.integers(-(2**15), 2**15, size=shape, dtype=np.int16) for shape in [(), (3,), (4, 5), (2, 3, 4)] * 50]
    strided = [np.zeros((*s.shape, 2), np.int16)[..., 0] for s in srcs[::2]]  # every other element of a block
    assert not any(d.flags.c_contiguous for d in strided if d.size > 1)
    dsts = [strided[i // 2] if i % 2 == 0 else np.zeros_like(s) for i, s in enumerate(srcs)]
    arrays.copy_many(dsts, srcs)
    assert all(d.tobytes() == s.tobytes() for d, s in zip(dsts, srcs, strict=True))


def test_copy_many_refuses_a_cast_and_a_length_mismatch():
    with pytest.raises(TypeError):
        arrays.copy_many([np.zeros(3, np.float64)], [np.ones(3, np.float32)])
    with pytest.raises(ValueError, match="2 targets for 1 sources"):
        arrays.copy_many([np.zeros(3), np.zeros(3)], [np.ones(3)])


def test_copy_many_copies_other_kinds_pair_by_pair():
    torch = pytest.importorskip("torch")
    dsts = [torch.zeros(4, dtype=torch.bfloat16), np.zeros(4, np.float32)]
    srcs = [torch.arange(4, dtype=torch.bfloat16), np.arange(4, dtype=np.float32)]
    arrays.copy_many(dsts, srcs)
    assert torch.equal(dsts[0], srcs[0]) and (dsts[1] == srcs[1]).all()
