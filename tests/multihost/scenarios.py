"""Driver-side scenarios of the multihost tier: ``python scenarios.py NAME '<kwargs json>'`` runs
inside the head namespace of an emulated cluster (``EmulatedCluster.scenario``), joins it, calls
``NAME(**kwargs)`` and prints the JSON result for the test to check.

To add one: write a function here that takes JSON-able keyword arguments and returns a JSON-able
value (facts for the test to assert on: addresses, node ids, digests, timings), and add it to
``SCENARIOS``. Ray is connected when it runs; hosts are addressed by index through
``host_addresses()`` (host order) and ``node_of``.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time

import numpy as np

from bench.emulate import host_addresses, scenario_main


def node_of(host: int) -> str:
    """Ray node id of emulated host ``host``."""
    return node_of_address(host_addresses()[host])


def node_of_address(address: str) -> str:
    """Ray node id of the alive node at ``address``."""
    import ray

    ids = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeManagerAddress"] == address]
    if len(ids) != 1:
        raise LookupError(f"{len(ids)} alive Ray nodes at {address}")
    return ids[0]


def on_host(actor_class, host: int, **options):
    """``actor_class`` options that pin the actor to host ``host`` (node affinity, not soft)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return actor_class.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_of(host), soft=False), **options)


def _where() -> dict:
    import ray

    st = os.stat("/proc/self/ns/net")
    return {
        "node_ip": ray.util.get_node_ip_address(),
        "node_id": ray.get_runtime_context().get_node_id(),
        "pid": os.getpid(),
        "netns": [st.st_dev, st.st_ino],
    }


def nodes() -> dict:
    """Ray's view of the cluster from the driver, and where the driver itself runs."""
    import ray

    return {
        "nodes": [
            {
                "node_id": n["NodeID"],
                "address": n["NodeManagerAddress"],
                "alive": n["Alive"],
                "resources": n["Resources"],
            }
            for n in ray.nodes()
        ],
        "driver": _where(),
    }


def pinned_actors() -> list[dict]:
    """One actor pinned to each host's node; where each one says it runs (host order)."""
    import ray

    @ray.remote(num_cpus=0)
    class Probe:
        def where(self) -> dict:
            return _where()

    actors = [on_host(Probe, k).remote() for k in range(len(host_addresses()))]
    return ray.get([a.where.remote() for a in actors], timeout=120)


def cross_node_bytes(size_bytes: int, src: int, dst: int, seed: int) -> dict:
    """An actor on ``src`` makes ``size_bytes`` random bytes, an actor on ``dst`` receives them
    through Ray's object store; their digests and the time the transfer took."""
    import ray

    @ray.remote(num_cpus=0)
    class Holder:
        def make(self, n: int, seed: int) -> np.ndarray:
            return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)

        def digest(self, data: np.ndarray) -> dict:
            return {"sha256": hashlib.sha256(data.tobytes()).hexdigest(), "size": int(data.size), **_where()}

    a, b = on_host(Holder, src).remote(), on_host(Holder, dst).remote()
    ray.get([a.__ray_ready__.remote(), b.__ray_ready__.remote()], timeout=120)
    ref = a.make.remote(size_bytes, seed)
    ray.wait([ref], fetch_local=False, timeout=120)
    source = ray.get(a.digest.remote(ref), timeout=120)
    t0 = time.perf_counter()
    received = ray.get(b.digest.remote(ref), timeout=120)
    seconds = time.perf_counter() - t0
    expected = hashlib.sha256(np.random.default_rng(seed).integers(0, 256, size_bytes, dtype=np.uint8).tobytes())
    return {"expected": expected.hexdigest(), "source": source, "received": received, "seconds": seconds}


SCENARIOS = {f.__name__: f for f in (nodes, node_of_address, pinned_actors, cross_node_bytes)}

if __name__ == "__main__":
    sys.exit(scenario_main(SCENARIOS))
