"""Driver-side scenarios of the library on emulated hosts (``test_runtime.py``):
``python runtime_scenarios.py NAME '<kwargs json>'`` inside an emulated host (``scenario_main``).

``tour`` runs one device pool through everything the tier checks and returns the facts: placement
(``nodes=`` by address and by node id, and without ``nodes``), host ids against the key-value store
and ``Cluster.from_ray``, the probe, bit-exact reshards over 3-4 nodes on both transports and
where pulls happen, the sockets our processes listen on, handles used in a task and an actor on
other nodes (one outliving the driver's reference), and finally a killed device actor. One pool
keeps the tier short: each device actor imports torch. ``bad_input`` checks placement errors and
``elsewhere`` is a driver on host 1 (not the head node) that also tries a handle pickled by an
earlier job.
"""

from __future__ import annotations

import gc
import hashlib
import os
import pickle
import signal
import sys
import time

import numpy as np

from bench.emulate import host_addresses, scenario_main
from bench.sockets import listeners


def node_of(host: int) -> str:
    import ray

    address = host_addresses()[host]
    (node,) = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeManagerAddress"] == address]
    return node


def where(ctx=None) -> dict:
    """This process: node, address, pid, network namespace (also run on device actors: ``ctx``)."""
    import ray

    st = os.stat("/proc/self/ns/net")
    return {
        "node_id": ray.get_runtime_context().get_node_id(),
        "node_ip": ray.util.get_node_ip_address(),
        "pid": os.getpid(),
        "netns": [st.st_dev, st.st_ino],
    }


def shard_digest(ctx, name: str) -> str:
    t = ctx.buffers[name].contiguous()
    return hashlib.sha256(memoryview(t.numpy().reshape(-1).view(np.uint8))).hexdigest()


def digest(array: np.ndarray) -> str:
    return hashlib.sha256(memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))).hexdigest()


def source(rows: int, cols: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, cols), dtype=np.float32)


def _error(fn) -> dict:
    t0 = time.perf_counter()
    try:
        fn()
    except Exception as e:
        return {"type": type(e).__name__, "message": str(e), "seconds": time.perf_counter() - t0}
    return {"type": None, "message": "", "seconds": time.perf_counter() - t0}


def tour(rows: int = 512, cols: int = 256, seed: int = 5) -> dict:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from reshard import DeviceMesh, Layout, Replicate, Shard, distribute, reshard
    from reshard.ir.program import Pull
    from reshard.runtime import lowered_reshard, probe_links, runtime, settle
    from topology import Cluster
    from topology.runtime import node_host_ids

    R = Replicate()
    addrs = host_addresses()
    out: dict = {"driver": where(), "nodes": [node_of(k) for k in range(len(addrs))]}

    # -- placement: by address, by node id, and packed by a placement group
    a = DeviceMesh.create((2, 2), nodes=[addrs[0], addrs[1]])
    b = DeviceMesh.create((2, 2), nodes=[node_of(2), node_of(3)])
    c = DeviceMesh.create((2, 2))
    for key, m in (("a", a), ("b", b), ("c", c)):
        out[key] = {
            "hosts": list(m.host_ids),
            "recorded_nodes": list(m.node_ids),
            "where": m.call(where),
            "repr": repr(m),
        }
    nodes_used = sorted({n for m in (a, b, c) for n in m.node_ids})
    out["kv_host_ids"] = node_host_ids(nodes_used)
    cluster = Cluster.from_ray()
    out["from_ray"] = {"num_hosts": cluster.num_hosts, "host_names": list(cluster.host_names), "name": cluster.name}

    # -- probe: measured figures, then what reshards plan with
    links = probe_links(a, b, size_bytes=4 << 20)
    hosts = dict(zip((*a.device_ids, *b.device_ids), (*a.host_ids, *b.host_ids), strict=True))
    planned = runtime().planning_cluster("gloo", hosts)
    host_ids = sorted(set(hosts.values()))
    probed = Cluster.from_ray()
    out["probe"] = {
        "nodes": list(links.node_ids),
        "nic_GBps": list(links.nic_GBps),
        "intra_host_GBps": links.intra_host_GBps,
        "latency_us": links.latency_us,
        "planning": {"name": planned.name, "nic_GBps": [planned.nic_Bps_of(h) / 1e9 for h in host_ids]},
        "from_ray": {"name": probed.name, "nic_GBps": [probed.nic_Bps_of(h) / 1e9 for h in range(probed.num_hosts)]},
    }

    # -- bit-exact reshards over 3-4 nodes, both transports; where pulls happen. ``span`` shares a's
    # host-1 node (its host-0 devices pull from a's there) and adds a third node; ``c`` is packed
    # wherever Ray's soft SPREAD put it, so it cannot promise either.
    span = DeviceMesh.create((2, 2), nodes=[addrs[1], addrs[2]])
    data = source(rows, cols, seed)
    x = distribute(data, Layout(a, (Shard(0), R)))
    runs = []
    for dst, placements in ((b, (R, Shard(1))), (span, (Shard(1), Shard(0))), (a, (R, Shard(0)))):
        layout = Layout(dst, placements)
        for shared in (True, False):
            for strategy in ("auto", "broadcast", "send_recv"):
                y = reshard(x, a, layout, strategy=strategy, shared_memory=shared)
                compiled = lowered_reshard(x, layout, strategy=strategy, shared_memory=shared)
                node = {i: n for m in (a, b, span) for i, n in zip(m.device_ids, m.node_ids, strict=True)}
                pulls = [
                    (p.device, op.holder)
                    for p in compiled.program.devices
                    for op in (*p.ops, *p.background)
                    if isinstance(op, Pull)
                ]
                runs.append(
                    {
                        "dst": repr(dst),
                        "placements": str(layout),
                        "strategy": strategy,
                        "shared_memory": shared,
                        "nodes": len({node[d] for d in (*a.device_ids, *dst.device_ids)}),
                        "bit_exact": bool(np.array_equal(y.to_numpy(), data)),
                        "pulls": len(pulls),
                        "pulls_across_nodes": sum(node[d] != node[h] for d, h in pulls),
                        "groups_across_nodes": sum(len({node[d] for d in g}) > 1 for g in compiled.groups),
                    }
                )
                y.free()
    out["reshards"] = runs

    # -- the sockets our processes listen on (after gloo groups exist everywhere)
    backend = runtime().backends["gloo"]
    out["store_address"] = list(backend.store_address) if backend.store_address else None
    out["listeners"] = {
        "driver": listeners(),
        "actors": [listeners_of for m in (a, b) for listeners_of in m.call(listeners)],
    }

    # -- handles in a task on another node: reshard, read back, free there
    @ray.remote(num_cpus=0)
    def use_there(t, src, dst) -> dict:
        from reshard import Layout, Replicate, Shard, reshard

        y = reshard(t, src, Layout(dst, (Replicate(), Shard(1))))
        got = digest(y.to_numpy())
        y.free()
        return {"where": where(), "digest": got, "freed": y.freed, "src_read": digest(t.to_numpy())}

    on3 = NodeAffinitySchedulingStrategy(node_of(3), soft=False)
    out["task"] = ray.get(use_there.options(scheduling_strategy=on3).remote(x, a, b), timeout=120)
    out["expected_digest"] = digest(data)

    # -- an actor on another node keeps a tensor after the driver dropped its own reference
    @ray.remote(num_cpus=0)
    class Keeper:
        def hold(self, t) -> dict:
            self.t = t
            return where()

        def read(self) -> str:
            return digest(self.t.to_numpy())

        def move(self, dst) -> str:
            from reshard import Layout, Replicate, reshard

            y = reshard(self.t, self.t.mesh, Layout(dst, (Replicate(), Replicate())))
            got = digest(y.to_numpy())
            y.free()
            return got

        def drop(self) -> None:
            from reshard.runtime import settle

            mesh = self.t.mesh
            del self.t
            gc.collect()
            settle(mesh)

    kept_data = source(rows, cols, seed + 1)
    kept = distribute(kept_data, Layout(b, (Shard(0), Shard(1))))
    name = kept.name
    keeper = Keeper.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_of(2), soft=False)).remote()
    out["keeper"] = {"where": ray.get(keeper.hold.remote(kept), timeout=120), "expected": digest(kept_data)}
    del kept
    gc.collect()
    settle(b)
    out["keeper"]["held_after_driver_dropped"] = [name in s["buffers"] for s in b.stats()]
    out["keeper"]["read"] = ray.get(keeper.read.remote(), timeout=120)
    out["keeper"]["moved"] = ray.get(keeper.move.remote(a), timeout=120)
    ray.get(keeper.drop.remote(), timeout=120)
    settle(b)
    out["keeper"]["held_after_keeper_dropped"] = [name in s["buffers"] for s in b.stats()]

    # -- a handle pickled here, for a driver of another job (``elsewhere``)
    out["pickled_tensor"] = pickle.dumps(x).hex()

    # -- a killed device actor: WorkerDied; the other meshes keep working
    victim = out["b"]["where"][3]
    os.kill(victim["pid"], signal.SIGKILL)
    died = _error(lambda: reshard(x, a, Layout(b, (R, Shard(1))), timeout_s=60))
    survivors = reshard(x, a, Layout(a, (Shard(1), R)))
    also = reshard(x, a, Layout(c, (R, Shard(0))))
    out["killed"] = {
        "victim": victim,
        "error": died,
        "survivors_bit_exact": bool(np.array_equal(survivors.to_numpy(), data))
        and bool(np.array_equal(also.to_numpy(), data)),
        "mesh_after": _error(lambda: b.stats()),
    }
    for m in (a, b, c, span):
        m.shutdown()
    return out


def bad_input() -> dict:
    from reshard import DeviceMesh

    addrs = host_addresses()
    return {
        "wrong_length": _error(lambda: DeviceMesh.create((2, 2), nodes=[addrs[0]])),
        "unknown_id": _error(lambda: DeviceMesh.create((2, 1), nodes=["ab" * 28, addrs[1]])),
        "unknown_address": _error(lambda: DeviceMesh.create((2, 1), nodes=[addrs[0], "10.255.255.254"])),
        "not_a_node": _error(lambda: DeviceMesh.create((2, 1), nodes=[addrs[0], 7])),
        "pinned_too_big": _error(lambda: DeviceMesh.create((2, 2), nodes=[addrs[0], addrs[1]], num_cpus=1)),
        "packed_infeasible": _error(lambda: DeviceMesh.create((2, 2), resources={"host_0": 1}, startup_timeout_s=5)),
        "alive_nodes": len(addrs),
    }


def elsewhere(pickled_tensor: str | None = None, rows: int = 256, cols: int = 128, seed: int = 9) -> dict:
    from reshard import DeviceMesh, Layout, Replicate, Shard, distribute, reshard
    from reshard.runtime import runtime

    addrs = host_addresses()
    out: dict = {"driver": where()}
    m = DeviceMesh.create((2, 1), nodes=[addrs[2], addrs[3]])
    data = source(rows, cols, seed)
    x = distribute(data, Layout(m, (Shard(0), Replicate())))
    y = reshard(x, m, Layout(m, (Replicate(), Replicate())), shared_memory=False)
    out["bit_exact"] = bool(np.array_equal(y.to_numpy(), data))
    out["mesh"] = {"hosts": list(m.host_ids), "where": m.call(where)}
    out["store_address"] = list(runtime().backends["gloo"].store_address or ())
    out["listeners"] = listeners()
    if pickled_tensor is not None:
        out["old_handle"] = _error(lambda: pickle.loads(bytes.fromhex(pickled_tensor)).to_numpy())
    m.shutdown()
    return out


SCENARIOS = {f.__name__: f for f in (tour, bad_input, elsewhere)}

if __name__ == "__main__":
    sys.exit(scenario_main(SCENARIOS))
