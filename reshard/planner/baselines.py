"""Baseline strategies: point-to-point, and the systems the paper compares against.

The paper is "On Optimizing the Communication of Model Parallelism".

- ``send_recv``: one point-to-point copy per receiver, each from its own least-loaded holder.
- ``allgather``: scatter + local all-gather (Alpa's older default). Per destination host, the
  slice is cut into k pieces along its first dim divisible by k, the sender sends piece j to the
  j-th of the host's k receivers, then receiver j broadcasts its piece to the other k - 1 (an
  all-gather over the intra-host links, expressed as k relaying broadcasts). Falls back to one
  send per receiver when no dim divides.
- ``broadcast``: one broadcast per unit task from its first holder (``no_loadbalance``).
- ``broadcast_size``: one broadcast per unit task from the holder host that has sent the fewest
  bytes so far (``loadbalance_size``).
- ``broadcast_order``: the paper's "Ours" (``loadbalance_order``): rounds of host-disjoint tasks,
  sender hosts drawn at random weighted toward lightly loaded hosts, the round with the most tasks
  kept out of up to 100 seeded samples; the plan is the concatenation of the rounds.

Receivers that hold a box already copy it locally in every strategy. ``SenderPicker`` spreads load
over the holders deterministically: a holder on the receiver's own host first (intra-host links
are fast), then the holder that has sent the fewest bytes so far, then the lowest device id. Loads
are bytes, as in the paper, whatever the hosts' NIC rates.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Mapping

from reshard.ir.plan import Transfer, TransferKind
from reshard.ir.tasks import UnitTask
from reshard.planner.problem import Problem
from reshard.planner.registry import register

ORDER_SAMPLES = 100
ORDER_SEED = 0
_ORDER_BUDGET = 400_000  # task visits per planning call; fewer samples per round beyond it


def split_local(task: UnitTask) -> tuple[list[int], list[int]]:
    """Receivers that hold the box already (local copy) and those that need it moved."""
    holders = set(task.senders)
    local = [r for r in task.receivers if r in holders]
    remote = [r for r in task.receivers if r not in holders]
    return local, remote


def local_copies(index: int, task: UnitTask, local: list[int]) -> list[Transfer]:
    return [Transfer(TransferKind.COPY, task.box, r, (r,), index) for r in local]


class SenderPicker:
    """Deterministic least-loaded choice among a task's holders."""

    def __init__(self, hosts: Mapping[int, int]):
        self.hosts = hosts
        self.sent_bytes: dict[int, int] = defaultdict(int)

    def pick(self, task: UnitTask, receivers: list[int]) -> int:
        dst_hosts = {self.hosts[r] for r in receivers}
        best = min(
            task.senders,
            key=lambda s: (self.hosts[s] not in dst_hosts, self.sent_bytes[s], s),
        )
        self.sent_bytes[best] += task.size_bytes
        return best


@register("send_recv")
def plan_send_recv(problem: Problem) -> tuple[Transfer, ...]:
    """One point-to-point copy per receiver, each from its own least-loaded holder."""
    picker = SenderPicker(problem.hosts)
    out: list[Transfer] = []
    for i, task in enumerate(problem.tasks):
        local, remote = split_local(task)
        out += local_copies(i, task, local)
        for r in remote:
            out.append(Transfer(TransferKind.SEND, task.box, picker.pick(task, [r]), (r,), i))
    return tuple(out)


def _broadcast(index: int, task: UnitTask, sender: int, remote: list[int]) -> Transfer:
    return Transfer(TransferKind.BROADCAST, task.box, sender, tuple(remote), index)


@register("broadcast")
def plan_broadcast_first(problem: Problem) -> tuple[Transfer, ...]:
    """One broadcast per unit task, always from its first holder (no load balance)."""
    out: list[Transfer] = []
    for i, task in enumerate(problem.tasks):
        local, remote = split_local(task)
        out += local_copies(i, task, local)
        if remote:
            out.append(_broadcast(i, task, task.senders[0], remote))
    return tuple(out)


class _HostLoad:
    """Bytes sent so far per host and per device; picks the least-loaded holder host, then device."""

    def __init__(self, hosts: Mapping[int, int]):
        self.hosts = hosts
        self.host_bytes: dict[int, int] = defaultdict(int)
        self.device_bytes: dict[int, int] = defaultdict(int)

    def device_on(self, task: UnitTask, host: int) -> int:
        return min((s for s in task.senders if self.hosts[s] == host), key=lambda s: (self.device_bytes[s], s))

    def charge(self, device: int, size: int) -> None:
        self.host_bytes[self.hosts[device]] += size
        self.device_bytes[device] += size


@register("broadcast_size")
def plan_broadcast_size(problem: Problem) -> tuple[Transfer, ...]:
    """One broadcast per unit task from the candidate host with the fewest bytes sent so far."""
    load = _HostLoad(problem.hosts)
    out: list[Transfer] = []
    for i, task in enumerate(problem.tasks):
        local, remote = split_local(task)
        out += local_copies(i, task, local)
        if remote:
            first_seen = list(dict.fromkeys(load.hosts[s] for s in task.senders))
            host = min(first_seen, key=lambda h: load.host_bytes[h])
            sender = load.device_on(task, host)
            load.charge(sender, task.size_bytes)
            out.append(_broadcast(i, task, sender, remote))
    return tuple(out)


@register("broadcast_order")
def plan_broadcast_order(problem: Problem) -> tuple[Transfer, ...]:
    """Rounds of host-disjoint broadcasts (the paper's load-balanced order), seeded."""
    hosts = problem.hosts
    load = _HostLoad(hosts)
    rng = random.Random(ORDER_SEED)
    out: list[Transfer] = []
    pending: list[tuple[int, frozenset[int], tuple[int, ...]]] = []
    remote_of: dict[int, list[int]] = {}
    for i, task in enumerate(problem.tasks):
        local, remote = split_local(task)
        out += local_copies(i, task, local)
        if remote:
            remote_of[i] = remote
            holder_hosts = tuple(dict.fromkeys(hosts[s] for s in task.senders))
            pending.append((i, frozenset(hosts[r] for r in remote), holder_hosts))
    if not pending:
        return tuple(out)
    all_hosts = len(set(hosts.values()))
    mean_size = sum(problem.tasks[i].size_bytes for i, _, _ in pending) / len(pending) or 1.0
    while pending:
        samples = max(1, min(ORDER_SAMPLES, _ORDER_BUDGET // (len(pending) * max(1, len(pending) // 4))))
        weights = {h: 1.0 / (1.0 + b / mean_size) for h, b in load.host_bytes.items()}
        # no round can hold more tasks than this: its hosts are disjoint
        most = min(len(pending), all_hosts // min(len(rh) + rh.isdisjoint(hh) for _, rh, hh in pending))
        best: list[tuple[int, int]] = []
        for _ in range(samples):
            order = pending[:]
            used: set[int] = set()
            chosen: list[tuple[int, int]] = []
            for k in range(len(order)):  # a lazy Fisher-Yates shuffle: stop as soon as the round is full
                j = k + int(rng.random() * (len(order) - k))
                order[k], order[j] = order[j], order[k]
                i, receiver_hosts, holder_hosts = order[k]
                if not receiver_hosts.isdisjoint(used):
                    continue
                free = [h for h in holder_hosts if h not in used]
                if not free:
                    continue
                host = rng.choices(free, [weights.get(h, 1.0) for h in free])[0] if len(free) > 1 else free[0]
                chosen.append((i, host))
                used.add(host)
                used.update(receiver_hosts)
                if len(used) >= all_hosts:
                    break
            if len(chosen) > len(best):
                best = chosen
                if len(best) >= most:
                    break
        picked = set()
        for i, host in best:
            task = problem.tasks[i]
            sender = load.device_on(task, host)
            load.charge(sender, task.size_bytes)
            out.append(_broadcast(i, task, sender, remote_of[i]))
            picked.add(i)
        pending = [p for p in pending if p[0] not in picked]
    return tuple(out)


@register("allgather")
def plan_allgather(problem: Problem) -> tuple[Transfer, ...]:
    """Scatter the slice over each destination host's receivers, then all-gather inside the host."""
    hosts = problem.hosts
    picker = SenderPicker(hosts)
    out: list[Transfer] = []
    for i, task in enumerate(problem.tasks):
        local, remote = split_local(task)
        out += local_copies(i, task, local)
        by_host: dict[int, list[int]] = defaultdict(list)
        for r in remote:
            by_host[hosts[r]].append(r)
        for receivers in by_host.values():
            sender = picker.pick(task, receivers)
            k = len(receivers)
            dim = next((d for d, (lo, hi) in enumerate(task.box) if (hi - lo) % k == 0), None)
            if k == 1 or dim is None:
                out += [Transfer(TransferKind.SEND, task.box, sender, (r,), i) for r in receivers]
                continue
            lo, hi = task.box[dim]
            step = (hi - lo) // k
            pieces = [task.box[:dim] + ((lo + j * step, lo + (j + 1) * step),) + task.box[dim + 1 :] for j in range(k)]
            scatter = list(zip(pieces, receivers, strict=True))
            out += [Transfer(TransferKind.SEND, piece, sender, (r,), i) for piece, r in scatter]
            for j, (piece, r) in enumerate(scatter):
                others = receivers[:j] + receivers[j + 1 :]
                out.append(Transfer(TransferKind.BROADCAST, piece, r, tuple(others), i))
    return tuple(out)
