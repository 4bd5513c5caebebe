"""Many box copies in one kernel (``reshard.runtime.device.box_copies``): every random box between
strided views lands exactly where a plain assignment puts it. On a GPU the kernel runs; on the CPU
stand-in (no kernels compile) the same table runs as assignments."""

from __future__ import annotations

import numpy as np
import pytest

from reshard.runtime.device import box_copies

pytestmark = pytest.mark.gpu(1)


def _case(rng):
    import cupy

    ndim = int(rng.integers(1, 7))
    full = tuple(int(n) for n in rng.integers(1, 6, ndim))
    dtype = rng.choice([np.uint8, np.uint16, np.uint32, np.uint64])
    src = cupy.asarray(rng.integers(0, 250, full).astype(dtype))
    dst = cupy.zeros(tuple(n + 2 for n in full), dtype)
    lo = [int(rng.integers(0, n)) for n in full]
    box = [(a, int(a + rng.integers(0, n - a + 1))) for n, a in zip(full, lo, strict=True)]
    at = [int(rng.integers(0, 3)) for _ in full]
    sv = src[tuple(slice(a, b) for a, b in box)]
    dv = dst[tuple(slice(o, o + b - a) for o, (a, b) in zip(at, box, strict=True))]
    expect = np.zeros(dst.shape, dtype)
    expect[tuple(slice(o, o + b - a) for o, (a, b) in zip(at, box, strict=True))] = src.get()[
        tuple(slice(a, b) for a, b in box)
    ]
    return sv, dv, dst, expect


def test_random_boxes_in_one_table_land_exactly():
    rng = np.random.default_rng(7)
    cases = [_case(rng) for _ in range(200)]
    table = box_copies.Table()
    bases = []
    for i, (sv, dv, _, _) in enumerate(cases):
        dbase, sbase, copies = box_copies.of_views(dv, sv)
        bases += [sbase, dbase]
        for c in copies:
            table.add(2 * i, 2 * i + 1, c)
    table.launch(bases)  # one launch for all of them
    for _, _, dst, expect in cases:
        np.testing.assert_array_equal(dst.get(), expect)


def test_a_big_contiguous_copy_and_an_unaligned_one():
    import cupy

    n = 64 << 20
    src = cupy.arange(n // 4, dtype=cupy.uint32)
    dst = cupy.zeros(n + 3, dtype=cupy.uint8)
    table = box_copies.Table()
    for c in box_copies.describe((n,), 1, 0, (1,), 3, (1,)):  # 3 bytes off: no 16- or 8-byte stores
        table.add(0, 1, c)
    for c in box_copies.describe((n,), 1, 0, (1,), 0, (1,)):
        table.add(0, 2, c)
    aligned = cupy.zeros(n, dtype=cupy.uint8)
    table.launch([src.data.ptr, dst.data.ptr, aligned.data.ptr])
    assert bool((dst[3:] == src.view(cupy.uint8)).all()) and bool((aligned == src.view(cupy.uint8)).all())


def test_more_outer_dimensions_than_a_row_holds_are_unrolled():
    """Six dimensions strided on both sides: the innermost element run, four outer dimensions per
    copy, and one copy per index of the two outermost (2 x 3)."""
    shape = (2, 3, 2, 3, 2, 3)
    src = (4000, 1200, 400, 120, 40, 12)  # every dimension strided: nothing merges
    dst = (3000, 900, 300, 90, 30, 8)
    copies = box_copies.describe(shape, 4, 0, src, 0, dst)
    assert len(copies) == 2 * 3 and all(len(c.extents) == box_copies.OUTER and c.inner == 4 for c in copies)
    assert sum(c.nbytes for c in copies) == 2 * 3 * 2 * 3 * 2 * 3 * 4
    assert sorted(c.src for c in copies) == sorted(i * 4000 + j * 1200 for i in range(2) for j in range(3))


def test_contiguous_boxes_merge_into_one_row():
    (copy,) = box_copies.describe((4, 8, 16), 2, 64, (256, 32, 2), 0, (256, 32, 2))
    assert copy.inner == 4 * 8 * 16 * 2 and copy.extents == (1,) * box_copies.OUTER and copy.src == 64


def test_a_commit_copies_staged_results_into_strided_and_contiguous_outputs_by_one_table():
    """``copy_views`` (a commit's copies on a GPU device): each staged result lands in its output,
    a column block of a wider tensor (a fused weight's region) as well as a whole tensor, nothing
    around them touched."""
    import cupy

    wide = cupy.zeros((6, 10), np.float32)
    whole = cupy.zeros((4, 3), np.float32)
    srcs = [cupy.asarray(np.arange(24, dtype=np.float32).reshape(6, 4) + 1), cupy.full((4, 3), 7.0, np.float32)]
    box_copies.copy_views([wide[:, 3:7], whole], srcs)
    expect = np.zeros((6, 10), np.float32)
    expect[:, 3:7] = np.arange(24, dtype=np.float32).reshape(6, 4) + 1
    np.testing.assert_array_equal(wide.get(), expect)
    np.testing.assert_array_equal(whole.get(), np.full((4, 3), 7.0, np.float32))
