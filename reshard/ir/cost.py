"""Costs of reshards on a cluster: the cluster a plan is costed on, and the fluid lower bound.

``lower_bound_s`` extends the bound of "On Optimizing the Communication of Model Parallelism" to
the devices of a host and to hosts whose NICs differ. ``B(h)`` is host ``h``'s NIC rate per
direction (``cluster.nic_Bps_of``), ``I`` the intra-host rate of a device, and for a set X of
hosts ``B(X)`` the sum of its hosts' rates. Every term is a time no plan can beat:

- every host must take in, over its NIC, each byte some device of it needs that no device of it
  holds: ``in(h) / B(h)``; every byte that only host ``h`` holds and that a device of another host
  needs must leave over ``h``'s NIC: ``out(h) / B(h)``;
- both are cuts of the host set; more generally, the bytes needed inside a set X of hosts and held
  only outside it (among the hosts of the meshes, O) must each enter X over the receive port of
  some NIC of X and leave O over the send port of some NIC of O, so they cross at most at
  ``min(B(X), B(O))``; with equal rates that is ``min(|X|, |O|) * B``. Besides single hosts and
  their complements we take X = every task's receiver hosts and X = the complement of every task's
  holder hosts and of all holder hosts together (e.g. two source hosts feeding eight destination
  hosts send at ``B(h1) + B(h2)``, not at eight NICs); for very many distinct sets only the last
  (``_CUT_WORK``);
- every byte a device needs enters it through its intra-host port or its host's NIC:
  ``need(d) / (I + B(host(d)))``; and a device that alone holds a box on its host pushes it through
  its intra-host send port (once for its own copy, once more for the host's other receivers)
  unless the NIC brings it: ``push(d) / (I + B(host(d)))``; summed over a host, those passes share
  the send ports of the host's holding devices: ``push(h) / (holders(h) * I + B(h))``. When the
  meshes lie on one host, no NIC brings anything (there is no other host to send it): these terms
  then have ``B = 0`` (an NVLink node's reshard is bound by its devices' ports alone);

plus one network latency in front of the NIC terms when anything must cross the network (no byte
moves before its message's latency). The bound is at least the paper's (its two terms are among
the cuts), and no plan's simulated makespan is below it. It ignores that a device runs one
transfer at a time and a ring's pipeline fill, so some reshards cannot reach it (a cyclic shift
among the devices of a host takes rounds).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

from reshard.ir.tasks import UnitTask
from topology.cluster import Cluster

_CUT_WORK = 2_000_000  # (cut, task group) pairs the bound evaluates at most


def resolve_cluster(cluster: Cluster | None, hosts: Mapping[int, int]) -> Cluster:
    """``cluster`` checked against the device -> host map ``hosts``, or ``Cluster.for_hosts(hosts)``
    (default figures) when it is None."""
    if cluster is None:
        return Cluster.for_hosts(hosts)
    if not isinstance(cluster, Cluster):
        raise TypeError(f"cluster must be a topology.Cluster, got {type(cluster).__name__}")
    cluster.check_hosts(hosts)
    return cluster


def lower_bound_s(tasks: tuple[UnitTask, ...], hosts: Mapping[int, int], cluster: Cluster) -> float:
    """The fluid lower bound (module docstring) of serving ``tasks`` on ``cluster``; ``hosts`` maps
    every device of both meshes to its host."""
    intra = cluster.intra_host_Bps
    host_ids = sorted(set(hosts.values()))
    nic = {h: cluster.nic_Bps_of(h) for h in host_ids}
    bit = {h: 1 << k for k, h in enumerate(host_ids)}
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
    # cuts X of the hosts: bytes needed inside X and held only outside cross it at min(B(X), B(O)).
    # Single hosts and their complements first (the paper's terms)
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
    nic_term = 0.0
    if n_hosts > 1:
        nic_term = max((b / nic[host_of_bit[x]] for x, b in (*into.items(), *out_of.items())), default=0.0)
    # then every task's receiver hosts, the complement of every task's holder hosts and of all holder
    # hosts together, while that stays cheap (a looser bound is still a bound)
    holder_sets = {hs for hs, _ in groups}
    cuts = {rs for _, rs in groups} | {every ^ hs for hs in holder_sets} | {every ^ _union(holder_sets)}
    cuts -= set(host_of_bit)
    if len(cuts) * len(groups) > _CUT_WORK:
        cuts = {every ^ _union(holder_sets)}
    uniform = cluster.host_nic_GBps is None
    for x in cuts:
        inside = x.bit_count()
        if not inside or inside == n_hosts:
            continue
        if uniform:  # min(|X|, |O|) * B, the same number as min(B(X), B(O))
            width = min(inside, n_hosts - inside) * cluster.nic_Bps
        else:
            width = min(_rate(x, host_of_bit, nic), _rate(every ^ x, host_of_bit, nic))
        need = sum(size for (hs, rs), size in groups.items() if rs & x and not hs & x)
        nic_term = max(nic_term, need / width)
    network = nic_term + cluster.latency_us * 1e-6 if nic_term else 0.0
    via = nic if n_hosts > 1 else dict.fromkeys(nic, 0.0)  # on one host no NIC brings a byte
    device = max((b / (intra + via[hosts[k if k >= 0 else -1 - k]]) for k, b in dev_bytes.items()), default=0.0)
    push = max((b / (len(holder_devices[h]) * intra + via[h]) for h, b in host_push.items()), default=0.0)
    return max(network, device, push)


def _rate(mask: int, host_of_bit: dict[int, int], nic: dict[int, float]) -> float:
    """B(X): the summed NIC rates of the hosts in the bit set ``mask``."""
    total = 0.0
    while mask:
        low = mask & -mask
        total += nic[host_of_bit[low]]
        mask ^= low
    return total


def _union(masks) -> int:
    out = 0
    for m in masks:
        out |= m
    return out
