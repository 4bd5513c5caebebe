"""Pull lanes' shared pieces (``scheduler.runtime.pull_lanes``) over two real device contexts in one
process: a process maps its own shared blocks through /proc/<pid>/fd exactly as a peer actor does.
A receiver's wait returns once the sender's count reaches it, fails at once on FAILED, and stops
at the deadline; counts of an earlier iteration never satisfy a later one; ring slots are the
sender's memory."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from reshard.runtime.backends.gloo import GlooBackend
from reshard.runtime.device.context import DeviceContext
from reshard.runtime.device_options import DeviceOptions
from scheduler.runtime.pull_lanes import FAILED, SLOTS, LaneBoard, PeerCell, SendRing, peer_slots

pytestmark = pytest.mark.dist

LANE = (0, 1)


def _contexts():
    make = [DeviceContext(d, GlooBackend(), DeviceOptions(device_type="cpu")) for d in (0, 1)]
    if any(c.shared is None for c in make):
        pytest.skip("no memfd shared memory on this machine")
    return make


def _boards(sender_ctx, receiver_ctx):
    send = LaneBoard(sender_ctx, [(LANE, "send")])
    recv = LaneBoard(receiver_ctx, [(LANE, "recv")])
    sender_info = {"board": send.handle, "cells": send.index}
    receiver_info = {"board": recv.handle, "cells": recv.index}
    published = PeerCell(receiver_ctx, 0, sender_info, LANE, "send")  # what the receiver waits on
    consumed = PeerCell(sender_ctx, 1, receiver_info, LANE, "recv")  # what the sender waits on
    return send, recv, published, consumed


def test_a_wait_returns_once_the_peer_posts_the_count():
    sender_ctx, receiver_ctx = _contexts()
    send, _, published, _ = _boards(sender_ctx, receiver_ctx)
    send.post(LANE, "send", 3, 1)
    with pytest.raises(TimeoutError):  # count 1 of iteration 3 is not count 2
        published.wait(3, 2, lambda: 0.0, "recv F1 0->1")
    waiting = threading.Event()
    done = threading.Event()

    def receiver():
        waiting.set()
        published.wait(3, 2, lambda: 30.0, "recv F1 0->1")
        done.set()

    t = threading.Thread(target=receiver)
    t.start()
    assert waiting.wait(30)
    send.post(LANE, "send", 3, 2)
    t.join(30)
    assert done.is_set()


def test_an_earlier_iteration_never_satisfies_a_later_one_and_failed_fails_at_once():
    sender_ctx, receiver_ctx = _contexts()
    send, recv, published, consumed = _boards(sender_ctx, receiver_ctx)
    send.post(LANE, "send", 4, 1000)  # a big count of iteration 4
    with pytest.raises(TimeoutError, match="device 0 had not got there by the iteration deadline"):
        published.wait(5, 1, lambda: 0.0, "recv F0 0->1")
    recv.post(LANE, "recv", 5, FAILED)
    with pytest.raises(RuntimeError, match="device 1's side of the lane failed"):
        consumed.wait(5, 1, lambda: 30.0, "send F2 0->1")
    recv.post(LANE, "recv", 6, 1)  # the next iteration's count goes past the failed one
    consumed.wait(6, 1, lambda: 30.0, "send F0 0->1")


def test_ring_slots_are_the_senders_memory():
    sender_ctx, receiver_ctx = _contexts()
    ring = SendRing(sender_ctx, (3, 4), "float32")
    assert len(ring.slots) == SLOTS
    mapped = peer_slots(receiver_ctx, 0, ring.handles, "float32")
    for k in range(SLOTS):
        torch.from_numpy(ring.slots[k]).copy_(torch.full((3, 4), float(k + 1)))
        assert np.array_equal(mapped[k], np.full((3, 4), k + 1, np.float32))
        assert not mapped[k].flags.writeable  # peers map it read-only
