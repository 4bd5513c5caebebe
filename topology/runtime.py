"""Runtime layer of the topology: what the connected Ray cluster says about its nodes, the
job-wide host id of each node, and the link figures measured between nodes in this process.

Host ids. Every process of a job must number hosts alike, so a node's host id is claimed once per
Ray session in Ray's internal key-value store (namespace ``reshard``): the lowest free number
under ``hosts/<n>``, recorded under ``hosts-by-name/node:<node id>``. This is the protocol of the
device runtime's registry (``reshard.runtime.driver.device_registry``: ``host_of_node``, which also claims
numbers for logical hosts from the same counter), so ``Cluster.from_ray`` and the meshes agree.
"""

from __future__ import annotations

import itertools
import threading

import ray

from topology.links import LinkFigures

KV_NAMESPACE = "reshard"
_LINKS_LOCK = threading.Lock()
_LINKS: dict[frozenset, LinkFigures] = {}  # node set -> its latest measurement, latest last
_LINKS_GENERATION = [0]


def record_links(links) -> None:
    """Remember measured ``LinkFigures`` (``reshard.runtime.probe_links`` records its result)."""
    with _LINKS_LOCK:
        key = frozenset(links.node_ids)
        _LINKS.pop(key, None)
        _LINKS[key] = links
        _LINKS_GENERATION[0] += 1


def cached_links(node_ids):
    """The latest recorded ``LinkFigures`` that covers every node of ``node_ids``, or None."""
    with _LINKS_LOCK:
        for links in reversed(list(_LINKS.values())):
            if links.covers(node_ids):
                return links
    return None


def forget_links() -> None:
    """Forget every recorded measurement (planning goes back to guessed figures)."""
    with _LINKS_LOCK:
        _LINKS.clear()
        _LINKS_GENERATION[0] += 1


def links_generation() -> int:
    """Changes whenever measurements are recorded or forgotten (planning caches key on it)."""
    return _LINKS_GENERATION[0]


def alive_ray_nodes() -> list[dict]:
    """``ray.nodes()`` of the connected cluster (``Cluster.from_ray`` keeps the alive ones)."""
    if not ray.is_initialized():
        raise RuntimeError("Cluster.from_ray() describes the connected Ray cluster: call ray.init() first")
    return ray.nodes()


def node_host_ids(node_ids) -> dict[str, int]:
    """The job-wide host id of each Ray node in ``node_ids``, claimed in this order when new."""
    return {n: claim_named("hosts", f"node:{n}") for n in node_ids}


def _kv():
    from ray.experimental import internal_kv

    return internal_kv


def claim(kind: str, value: str) -> int:
    """The lowest free number of ``kind`` in the session's key-value store, claimed for ``value``.

    Numbers are never given back, so the scan starts at a hint (``<kind>-next``): one past a number
    some process claimed. Every number below any hint ever written was claimed when it was written,
    so a stale hint only costs a few tries, never a gap; a claim costs O(1) store calls, not
    O(numbers claimed so far)."""
    kv = _kv()
    hint = kv._internal_kv_get(f"{kind}-next", namespace=KV_NAMESPACE)
    for n in itertools.count(int(hint) if hint else 0):
        if not kv._internal_kv_put(f"{kind}/{n}", value, overwrite=False, namespace=KV_NAMESPACE):
            kv._internal_kv_put(f"{kind}-next", str(n + 1), overwrite=True, namespace=KV_NAMESPACE)
            return n
    raise AssertionError("unreachable")


def claim_named(kind: str, name: str) -> int:
    """The number of ``name`` of ``kind``: claimed once per session, the same in every process."""
    kv = _kv()
    key = f"{kind}-by-name/{name}"
    found = kv._internal_kv_get(key, namespace=KV_NAMESPACE)
    if found is not None:
        return int(found)
    n = claim(kind, name)
    if kv._internal_kv_put(key, str(n), overwrite=False, namespace=KV_NAMESPACE):
        n = int(kv._internal_kv_get(key, namespace=KV_NAMESPACE))  # another process was first
    return n


def publish(key: str, value: bytes) -> None:
    """Put ``value`` under ``key`` in the session's key-value store (any process of the job reads it)."""
    _kv()._internal_kv_put(key, value, overwrite=True, namespace=KV_NAMESPACE)


def unpublish(key: str) -> None:
    """Remove what ``publish`` put under ``key``."""
    _kv()._internal_kv_del(key, namespace=KV_NAMESPACE)


def lookup(key: str) -> bytes | None:
    """What ``publish`` put under ``key`` in this session, or None."""
    return _kv()._internal_kv_get(key, namespace=KV_NAMESPACE)
