"""A device's communicator cache: an abort that names a generation tears down that generation
only, so a late abort of a failed run never undoes the groups its retry has set up."""

from __future__ import annotations

from reshard.runtime.backends.gloo import GlooBackend
from reshard.runtime.device.group_cache import GroupCache
from reshard.runtime.messages import group_key


def test_an_abort_of_an_older_generation_leaves_the_newer_one():
    backend = GlooBackend(host="127.0.0.1")  # a real store: aborts are written into it
    key = group_key((0, 1))
    old, new = backend.rendezvous([key[1]], {})[0], backend.rendezvous([key[1]], {})[0]
    cache = GroupCache(backend, device=0, timeout_s=5.0)
    cache.apply(sets=[(key, 1, old.info)])
    cache.apply(drops=[(key, 1)], sets=[(key, 2, new.info)])  # the retry's generation

    cache.abort_generations([(key, 1)], "the controller aborted the failed run")
    assert cache.generation(key) == 2
    store = backend._master
    assert not store.check([new.info["prefix"] + "abort"])

    cache.abort_generations([(key, 2)], "its own run failed")
    assert cache.generation(key) is None
    assert (
        store.get(new.info["prefix"] + "abort") == b"device 0: its own run failed"
    )  # members waiting to join are told


def test_abort_without_a_generation_tears_down_whatever_is_there():
    backend = GlooBackend(host="127.0.0.1")
    key = group_key((0, 1))
    cache = GroupCache(backend, device=0, timeout_s=5.0)
    cache.apply(sets=[(key, 7, backend.rendezvous([key[1]], {})[0].info)])
    cache.abort([key])
    assert cache.generation(key) is None
