"""Costs of plans on a cluster: simulation (``topology.simulator``) and the fluid lower bound.

``simulate_plan`` hands the simulator a neutral copy of the plan: its transfers in issue order and
the device -> host map of both meshes. ``lower_bound_s`` is the bound of PAPER.md, extended to
the devices of a host:

- every host must take in, over its NIC, each byte some device of it needs that no device of it
  holds: ``in(h) / B``;
- every byte that only host ``h`` holds and that a device of another host needs must leave over
  ``h``'s NIC: ``out(h) / B``;
- both are cuts of the host set; more generally, the bytes needed inside a set X of hosts and held
  only outside it cross into X at most at ``min(|X|, |outside|) * B``. Besides single hosts and
  their complements we take X = every task's receiver hosts and X = the complement of every task's
  holder hosts and of all holder hosts together (e.g. two source hosts feeding eight destination
  hosts send at 2B, not 8B); for very many distinct sets only the last (``_CUT_WORK``);
- every byte a device needs enters it through its intra-host port or its host's NIC:
  ``need(d) / (I + B)``; and a device that alone holds a box on its host pushes it through its
  intra-host send port (once for its own copy, once more for the host's other receivers) unless
  the NIC brings it: ``push(d) / (I + B)``; summed over a host, those passes share the send ports
  of the host's holding devices: ``push(h) / (holders(h) * I + B)``;

plus one network latency in front of the NIC terms when anything must cross the network (no byte
moves before its message's latency). ``B`` = ``cluster.nic_GBps``, ``I`` = ``cluster.intra_host_GBps``.
The bound is at least PAPER.md's (its two terms are among the cuts), and no plan's simulated
makespan is below it. It ignores that a device runs one transfer at a time and a ring's pipeline
fill, so some reshards cannot reach it (a cyclic shift among the devices of a host takes rounds).
"""

from __future__ import annotations

from collections import defaultdict

from reshard.layout import Layout
from reshard.plan import ReshardPlan, TransferKind
from reshard.regions import box_volume
from reshard.tasks import UnitTask
from topology.cluster import Cluster
from topology.simulator import SimKind, SimResult, SimTransfer, simulate_transfers

_CUT_WORK = 2_000_000  # (cut, task group) pairs the bound evaluates at most
_SIM_KIND = {TransferKind.COPY: SimKind.COPY, TransferKind.SEND: SimKind.P2P, TransferKind.BROADCAST: SimKind.BROADCAST}


def device_hosts(src: Layout, dst: Layout) -> dict[int, int]:
    """Global device id -> host id over both meshes."""
    hosts = dict(zip(src.mesh.device_ids, src.mesh.host_ids, strict=True))
    for d, h in zip(dst.mesh.device_ids, dst.mesh.host_ids, strict=True):
        if hosts.setdefault(d, h) != h:
            raise ValueError(
                f"device {d} sits on host {hosts[d]} in the source mesh but on host {h} in the destination mesh"
            )
    return hosts


def resolve_cluster(cluster: Cluster | None, src: Layout, dst: Layout) -> Cluster:
    """``cluster`` checked against both meshes, or ``Cluster.for_meshes`` when it is None."""
    if cluster is None:
        return Cluster.for_meshes(src.mesh, dst.mesh)
    if not isinstance(cluster, Cluster):
        raise TypeError(f"cluster must be a topology.Cluster, got {type(cluster).__name__}")
    cluster.check_meshes(src.mesh, dst.mesh)
    return cluster


def sim_transfers(plan: ReshardPlan) -> list[SimTransfer]:
    """The plan's transfers in issue order, in the simulator's neutral form."""
    item = plan.itemsize
    return [SimTransfer(_SIM_KIND[t.kind], t.src, t.dsts, box_volume(t.box) * item) for t in plan.transfers]


def simulate_plan(plan: ReshardPlan, cluster: Cluster | None = None, *, backend: str | None = None) -> SimResult:
    """Simulate ``plan`` on ``cluster`` (default: ``Cluster.for_meshes`` of the plan's meshes)."""
    cluster = resolve_cluster(cluster, plan.src, plan.dst)
    return simulate_transfers(sim_transfers(plan), device_hosts(plan.src, plan.dst), cluster, backend=backend)


def lower_bound_s(tasks: tuple[UnitTask, ...], hosts: dict[int, int], cluster: Cluster) -> float:
    """The fluid lower bound (module docstring) of serving ``tasks`` on ``cluster``; ``hosts`` maps
    every device of both meshes to its host."""
    nic = cluster.nic_Bps
    dev_rate = cluster.intra_host_Bps + nic
    bit = {h: 1 << k for k, h in enumerate(sorted(set(hosts.values())))}
    every = sum(bit.values())
    groups: dict[tuple[int, int], int] = defaultdict(int)  # (holder hosts, receiver hosts) -> bytes
    dev_bytes: dict[int, int] = defaultdict(int)
    host_push: dict[int, int] = defaultdict(int)
    holder_devices: dict[int, set[int]] = defaultdict(set)
    for t in tasks:
        size = t.size_bytes
        if not size:
            continue
        holder_hosts = receiver_hosts = 0
        on_host: dict[int, list[int]] = defaultdict(list)
        for s in t.senders:
            holder_hosts |= bit[hosts[s]]
            on_host[hosts[s]].append(s)
        holders = set(t.senders)
        for r in t.receivers:
            receiver_hosts |= bit[hosts[r]]
            dev_bytes[r] += size  # enters r through its intra-host port or its host's NIC
        groups[holder_hosts, receiver_hosts] += size
        for h, devices in on_host.items():
            # every copy on h and a first send to h's other receivers pass the intra-host send port
            # of some holder on h, unless the NIC brings the box
            local = [r for r in t.receivers if hosts[r] == h]
            passes = sum(r in holders for r in local) + any(r not in holders for r in local)
            host_push[h] += size * passes
            holder_devices[h].update(devices)
            if len(devices) > 1:
                continue
            d = devices[0]
            # d alone holds the box on its host: whatever the host's devices need of it (d's own copy,
            # and a first send to the others) passes d's intra-host port, unless the NIC brings it
            passes = (d in local) + any(r not in holders for r in local)
            if len(t.senders) == 1 and any(hosts[r] != h for r in t.receivers) and not any(r != d for r in local):
                passes = max(passes, 1)  # the only copy anywhere must leave d
            dev_bytes[-1 - d] += size * passes
    # cuts X of the hosts: bytes needed inside X and held only outside cross it at
    # min(|X|, |outside|) NIC bandwidths. Single hosts and their complements first (PAPER.md's terms)
    n_hosts = len(bit)
    host_of_bit = {b: h for h, b in bit.items()}
    into: dict[int, int] = defaultdict(int)
    out_of: dict[int, int] = defaultdict(int)
    for (hs, rs), size in groups.items():
        need = rs & ~hs
        if not need:
            continue
        if hs & (hs - 1) == 0:  # one holder host
            out_of[hs] += size
        while need:
            low = need & -need
            into[low] += size
            need ^= low
    nic_term = max((*into.values(), *out_of.values()), default=0) / nic if n_hosts > 1 else 0.0
    # then every task's receiver hosts, the complement of every task's holder hosts and of all holder
    # hosts together, while that stays cheap (a looser bound is still a bound)
    holder_sets = {hs for hs, _ in groups}
    cuts = {rs for _, rs in groups} | {every ^ hs for hs in holder_sets} | {every ^ _union(holder_sets)}
    cuts -= set(host_of_bit)
    if len(cuts) * len(groups) > _CUT_WORK:
        cuts = {every ^ _union(holder_sets)}
    for x in cuts:
        inside = x.bit_count()
        width = min(inside, n_hosts - inside)
        if not width:
            continue
        need = sum(size for (hs, rs), size in groups.items() if rs & x and not hs & x)
        nic_term = max(nic_term, need / (width * nic))
    network = nic_term + cluster.latency_us * 1e-6 if nic_term else 0.0
    push = max((b / (len(holder_devices[h]) * cluster.intra_host_Bps + nic) for h, b in host_push.items()), default=0.0)
    return max(network, max(dev_bytes.values(), default=0) / dev_rate, push)


def _union(masks) -> int:
    out = 0
    for m in masks:
        out |= m
    return out


def plan_lower_bound_s(plan: ReshardPlan, cluster: Cluster | None = None) -> float:
    cluster = resolve_cluster(cluster, plan.src, plan.dst)
    return lower_bound_s(plan.tasks, device_hosts(plan.src, plan.dst), cluster)
