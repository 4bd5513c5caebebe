"""A GPU device's shard memory (``reshard.runtime.device.gpu_memory.GpuBlocks``) in this process:
the shards of one call are pieces of one block, and the block goes back to the pool exactly when
its last piece is released (a piece released twice counts once; one begun again counts again)."""

from __future__ import annotations

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
