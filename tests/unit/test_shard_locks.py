"""ShardLocks: a read of a shard waits for a write into it, a write for the reads under way."""

import threading

import pytest

from reshard.errors import ReshardTimeout
from reshard.runtime.deadlines import Deadline
from reshard.runtime.device.shard_locks import ShardLocks


def soon() -> Deadline:
    """30 s from now, made per use (one made at import had passed when a long suite got here)."""
    return Deadline.after(30)


def _wait_until(locks: ShardLocks, **counts) -> None:
    """Until ``locks.state()`` shows ``counts`` (the other thread got there), at most 30 s."""
    with locks._cond:
        assert locks._cond.wait_for(lambda: all(locks.state()[k] == v for k, v in counts.items()), 30), counts


def test_a_read_waits_for_the_write_of_its_shard_and_sees_it_whole():
    locks = ShardLocks(3)
    shard = [0, 0]
    seen = []

    def read():
        with locks.reading("w", soon()):
            seen.append(list(shard))

    with locks.writing(["w"], soon(), "a commit"):
        shard[0] = 1
        reader = threading.Thread(target=read)
        reader.start()
        _wait_until(locks, reads_waiting=1)
        shard[1] = 1
    reader.join(30)
    assert seen == [[1, 1]]
    assert locks.state() == {"shards_written": 0, "reads": 0, "reads_waiting": 0}


def test_a_read_of_another_shard_does_not_wait():
    locks = ShardLocks(0)
    with locks.writing(["w"], soon(), "a commit"), locks.reading("b", Deadline.after(0.001)):
        assert locks.state()["reads"] == 1


def test_a_write_waits_for_the_reads_under_way_and_new_reads_wait_for_it():
    locks = ShardLocks(0)
    reading, let_go, wrote = threading.Event(), threading.Event(), threading.Event()

    def read():
        with locks.reading("w", soon()):
            reading.set()
            let_go.wait(30)

    def write():
        with locks.writing(["w", "b"], soon(), "a commit"):
            wrote.set()

    reader, writer = threading.Thread(target=read), threading.Thread(target=write)
    reader.start()
    assert reading.wait(30)
    writer.start()
    _wait_until(locks, shards_written=2)  # waiting for the read: a new read of w waits too
    with pytest.raises(ReshardTimeout, match=r"device 0: shard 'w' was being written"):
        with locks.reading("w", Deadline.after(0.01)):
            pass
    assert not wrote.is_set()
    let_go.set()
    writer.join(30)
    reader.join(30)
    assert wrote.is_set()
    assert locks.state() == {"shards_written": 0, "reads": 0, "reads_waiting": 0}


def test_writes_do_not_wait_for_each_other():
    locks = ShardLocks(0)
    with locks.writing(["w"], soon(), "one"), locks.writing(["w", None], Deadline.after(0.001), "two"):
        assert locks.state()["shards_written"] == 1
    assert locks.state()["shards_written"] == 0


def test_a_write_whose_reads_outlast_its_deadline_writes_nothing_and_says_so():
    locks = ShardLocks(5)
    with locks.reading("w", soon()):
        with pytest.raises(ReshardTimeout, match=r"device 5: committing r1: reads of its outputs did not end"):
            with locks.writing(["w"], Deadline.after(0.01), "committing r1"):
                raise AssertionError("it wrote")
        assert locks.state()["shards_written"] == 0  # reads are not held back by a write that gave up
