"""A GPU device's shard memory (``reshard.runtime.device.gpu_memory.GpuBlocks``) in this process:
the shards of one call are pieces of one block, and the block goes back to the pool exactly when
its last piece is released (a piece released twice counts once; one begun again counts again)."""

from __future__ import annotations

import itertools

import pytest

from reshard.runtime.device.gpu_memory import ALIGN, GpuBlocks

pytestmark = pytest.mark.gpu(1)


@pytest.fixture
def blocks():
    b = GpuBlocks(0, keep_bytes=1 << 30)
    yield b
    b.close()


def test_a_calls_shards_are_pieces_of_one_block_idle_once_the_last_is_released(blocks):
    pieces = blocks.allocate_many([100, 300, ALIGN])
    descs = [blocks.begin(p) for p in pieces]
    assert len({d[2] for d in descs}) == 1  # one IPC handle for the three
    assert [d[4] for d in descs] == [0, ALIGN, 3 * ALIGN]  # offsets in it, aligned
    base = pieces[0].data.ptr
    for p in pieces[:2]:
        assert blocks.release(p)
    assert blocks.release(pieces[1])  # again: still one piece held
    assert blocks.idle_bytes == 0 and blocks.descriptor(pieces[2]) is not None
    assert blocks.release(pieces[2])
    assert blocks.idle_bytes == 4 * ALIGN
    again = blocks.allocate_many([4 * ALIGN])
    assert again[0].data.ptr == base and blocks.idle_bytes == 0  # the same block, from the pool


def test_a_piece_begun_again_after_its_release_keeps_its_block_held(blocks):
    first, second = blocks.allocate_many([64, 64])
    blocks.begin(first)
    blocks.begin(second)
    assert blocks.release(first)
    assert blocks.begin(first) is not None  # shared anew: a fresh tenure
    assert blocks.release(second)
    assert blocks.idle_bytes == 0
    assert blocks.release(first)
    assert blocks.idle_bytes == 2 * ALIGN


def test_many_pieces_are_released_one_by_one(blocks):
    """18,432 pieces (a MoE model's expert weights in one call): the block is idle after the last."""
    n = 18_432
    pieces = blocks.allocate_many([32] * n)
    for p in pieces[:-1]:
        blocks.release(p)
    assert blocks.idle_bytes == 0
    blocks.release(pieces[-1])
    assert blocks.idle_bytes == n * ALIGN


def test_blocks_nobody_uses_any_more_are_found_and_reused(blocks):
    """Arrays of ``DeviceContext.empty`` its user let go of: their blocks go back to the pool at a
    look over every block (``_reclaim``), and a new array of that size reuses one."""
    dropped = {blocks.allocate(4096).data.ptr for _ in range(4)}
    assert blocks.allocate(4096).data.ptr in dropped


def test_making_blocks_one_by_one_looks_over_them_a_logarithmic_number_of_times(blocks, monkeypatch):
    """A look passes over every block: made once per new block, a model's tensors shared one at a
    time would cost time quadratic in their number. A look is due once half as many new blocks as
    the device has were made since the last."""
    looks = []
    reclaim = blocks._reclaim
    monkeypatch.setattr(blocks, "_reclaim", lambda: looks.append(len(blocks.blocks)) or reclaim())
    live = [blocks.allocate(512) for _ in range(2000)]
    assert len(blocks.blocks) == len(live) and len(looks) <= 25
    assert all(b >= 1.5 * a for a, b in itertools.pairwise(looks[2:]))  # the blocks between two looks grow


def test_where_cuda_has_no_memory_left_a_block_nobody_uses_is_reused_first(blocks):
    """The one block nobody uses any more, between two looks: an allocation CUDA refuses looks at
    once and reuses it; with none to reuse, CUDA's error reaches the caller. (The stand-in bounds
    the device's memory; a GPU's is not bounded on request.)"""
    import cupy

    if not getattr(cupy, "_standin", False):
        pytest.skip("bounds the device's memory through the CPU stand-in's control")
    from cupy import _control
    from cupy.cuda import runtime

    first = blocks.allocate(1 << 20)
    ptr = first.data.ptr
    live = [blocks.allocate(512)]
    while not (len(blocks.blocks) >= 3 and blocks._unlooked == 1):  # just past a look: the next is not due
        live.append(blocks.allocate(512))
    del first
    with _control.device_memory(headroom=1 << 19):  # no room for another MiB
        assert blocks.allocate(1 << 20).data.ptr == ptr
        with pytest.raises(runtime.CUDARuntimeError, match="cudaErrorMemoryAllocation"):
            blocks.allocate(1 << 21)


def test_a_runs_new_shards_begun_at_once_get_what_begin_gives_each(blocks):
    """``begin_many``: pieces of one block and one of another get fresh tenures (one begun already
    keeps its own), and an array that is no piece of ours has no descriptor."""
    import cupy

    first = blocks.allocate_many([100, 300, ALIGN])
    (other,) = blocks.allocate_many([64])
    early = blocks.begin(first[1])
    descs = blocks.begin_many([*first, other, cupy.zeros(8, "float32")], [False, True, False, False, False])
    assert descs[1] == early and descs[4] is None
    assert [d[4] for d in descs[:4]] == [0, ALIGN, 3 * ALIGN, 0]
    assert descs[3][2] != descs[0][2]  # the other block's handle
    assert len({(d[7], d[8]) for d in descs[:4]}) == 4  # a slot and tenure each
    assert descs == [blocks.descriptor(a) for a in [*first, other]] + [None]
