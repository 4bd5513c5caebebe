"""Planning strategies: turn unit tasks into ordered transfers.

A strategy is a function ``(problem) -> tuple[Transfer, ...]`` registered under a name in
``STRATEGIES``: ``send_recv`` here, the paper's baselines in ``reshard.baselines`` (``allgather``,
``broadcast``, ``broadcast_size``, ``broadcast_order``) and the topology-aware default ``auto`` in
``reshard.auto``. Receivers that already hold a box get a local COPY; the rest get it over a link.
``SenderPicker`` spreads load over the holders deterministically: a holder on the receiver's own
host first (intra-host links are fast), then the holder that has sent the fewest bytes so far,
then the lowest device id.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from reshard.layout import Layout
from reshard.plan import Transfer, TransferKind
from reshard.tasks import UnitTask


@dataclass(frozen=True, slots=True)
class Problem:
    """Everything a strategy may look at."""

    shape: tuple[int, ...]
    itemsize: int
    src: Layout
    dst: Layout
    tasks: tuple[UnitTask, ...]
    cluster: object | None = None

    def host_of(self, device: int) -> int:
        return _host_map(self.src, self.dst)[device]


def _host_map(src: Layout, dst: Layout) -> dict[int, int]:
    hosts = dict(zip(src.mesh.device_ids, src.mesh.host_ids, strict=True))
    hosts.update(zip(dst.mesh.device_ids, dst.mesh.host_ids, strict=True))
    return hosts


Strategy = Callable[[Problem], tuple[Transfer, ...]]
STRATEGIES: dict[str, Strategy] = {}


def register(name: str):
    def deco(fn: Strategy) -> Strategy:
        STRATEGIES[name] = fn
        return fn

    return deco


def split_local(task: UnitTask) -> tuple[list[int], list[int]]:
    """Receivers that hold the box already (local copy) and those that need it moved."""
    holders = set(task.senders)
    local = [r for r in task.receivers if r in holders]
    remote = [r for r in task.receivers if r not in holders]
    return local, remote


class SenderPicker:
    """Deterministic least-loaded choice among a task's holders."""

    def __init__(self, problem: Problem):
        self.hosts = _host_map(problem.src, problem.dst)
        self.sent_bytes: dict[int, int] = defaultdict(int)

    def pick(self, task: UnitTask, receivers: list[int]) -> int:
        dst_hosts = {self.hosts[r] for r in receivers}
        best = min(
            task.senders,
            key=lambda s: (self.hosts[s] not in dst_hosts, self.sent_bytes[s], s),
        )
        self.sent_bytes[best] += task.size_bytes
        return best


def local_copies(index: int, task: UnitTask, local: list[int]) -> list[Transfer]:
    return [Transfer(TransferKind.COPY, task.box, r, (r,), index) for r in local]


@register("send_recv")
def plan_send_recv(problem: Problem) -> tuple[Transfer, ...]:
    """One point-to-point copy per receiver, each from its own least-loaded holder."""
    picker = SenderPicker(problem)
    out: list[Transfer] = []
    for i, task in enumerate(problem.tasks):
        local, remote = split_local(task)
        out += local_copies(i, task, local)
        for r in remote:
            out.append(Transfer(TransferKind.SEND, task.box, picker.pick(task, [r]), (r,), i))
    return tuple(out)


# The baselines and the topology-aware planner register themselves on import.
from reshard import baselines as _baselines  # noqa: E402,F401,I001
from reshard import auto as _auto  # noqa: E402,F401
