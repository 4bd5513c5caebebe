"""Reductions: a Partial source becomes an ordinary multicast after the contributions are combined.

For every unit task of a source with Partial axes (``UnitTask.contributions``: the holders of each
contribution of the box), one receiver becomes the box's ROOT and combines all contributions in its
destination shard; the other receivers then get the box from it like from any single holder (the
strategy plans that part, ``derived_problem``). What crosses the network is what a host must send:

- the root sits on the receiving host that already holds the most contributions (those never cross
  the network); among its receivers, one that holds a contribution itself, then the one that was
  root least so far (spreading the fan-out), then the lowest id;
- each contribution is taken from a holder on the root's host if there is one, else from the host
  that holds the most contributions;
- on the root's host, contributions go straight into the root's destination shard (the first one
  written, the others combined into it);
- on any other host holding several contributions, one holder (the leader) combines them in its
  scratch buffer (``Buffer.TMP``, the shape of its source shard) and sends ONE partial result;
  a host holding one sends it as is. So each host's NIC carries the box at most once.

``avg`` combines by summing and ends with a ``SCALE`` transfer (divide by the number of
contributions) on the root. Order: every host's local combining first, then what crosses hosts,
then the scaling; the distribution comes after all of them in the plan's global order.
Floating-point results equal a sum in this order (not numpy's pairwise order): equal to numpy
within rounding; integer results are exact.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

from reshard.ir.placement import ReduceOp
from reshard.ir.plan import Transfer, TransferKind
from reshard.ir.program import Buffer
from reshard.ir.tasks import UnitTask
from reshard.planner.problem import Problem

NON_REDUCIBLE = ("bool", "float8_e4m3fn", "float8_e5m2")


def check_reducible(dtype: str, op: ReduceOp) -> None:
    if dtype in NON_REDUCIBLE:
        raise ValueError(
            f"a Partial({op.value}) source of dtype {dtype} cannot be reduced; use a numeric dtype of at least 16 "
            "bits (reduce float8 contributions in bfloat16 or float32, then cast)"
        )
    if op is ReduceOp.AVG and not (
        (dtype.startswith("float") and not dtype.startswith("float8")) or dtype == "bfloat16"
    ):
        raise ValueError(f"Partial(avg) needs a floating-point dtype, got {dtype}; use sum, max or min")


def plan_reductions(problem: Problem, op: ReduceOp) -> tuple[tuple[Transfer, ...], dict[int, int]]:
    """The transfers that combine every Partial box on its root, and ``{task index: root}``."""
    hosts = problem.hosts
    local: list[Transfer] = []
    crossing: list[Transfer] = []
    scaling: list[Transfer] = []
    roots: dict[int, int] = {}
    rooted: dict[int, int] = defaultdict(int)  # device -> times chosen as root
    for i, task in enumerate(problem.tasks):
        root = _root(task, hosts, rooted)
        rooted[root] += 1
        roots[i] = root
        home = hosts[root]
        reps = [_representative(group, root, task, hosts) for group in task.contributions]
        by_host: dict[int, list[int]] = defaultdict(list)
        for r in reps:
            by_host[hosts[r]].append(r)
        written = False  # whether the root's box holds a first contribution yet

        def into_root(src: int, read: Buffer, out: list[Transfer], task=task, i=i, root=root) -> None:
            nonlocal written
            kind = TransferKind.COPY if src == root else TransferKind.SEND
            out.append(Transfer(kind, task.box, src, (root,), i, reduce=written, read=read))
            written = True

        for src in sorted(by_host.get(home, ()), key=lambda d: (d != root, d)):
            into_root(src, Buffer.SRC, local)
        for h in sorted(by_host):
            if h == home:
                continue
            group = sorted(by_host[h])
            if len(group) == 1:
                into_root(group[0], Buffer.SRC, crossing)
                continue
            leader = group[0]
            local.append(Transfer(TransferKind.COPY, task.box, leader, (leader,), i, read=Buffer.SRC, write=Buffer.TMP))
            for src in group[1:]:
                local.append(
                    Transfer(
                        TransferKind.SEND, task.box, src, (leader,), i, reduce=True, read=Buffer.SRC, write=Buffer.TMP
                    )
                )
            into_root(leader, Buffer.TMP, crossing)
        if op is ReduceOp.AVG:
            scaling.append(Transfer(TransferKind.SCALE, task.box, root, (root,), i))
    return (*local, *crossing, *scaling), roots


def derived_problem(problem: Problem, roots: dict[int, int]) -> tuple[Problem, tuple[int, ...]]:
    """The multicast left once every box sits reduced on its root: each task's only holder is its
    root (in its destination shard); tasks whose only receiver is the root drop out. Returns the
    problem and, per task of it, the index of the task it came from."""
    tasks, origin = [], []
    for i, task in enumerate(problem.tasks):
        receivers = tuple(r for r in task.receivers if r != roots[i])
        if receivers:
            tasks.append(UnitTask(task.box, (roots[i],), receivers, task.size_bytes))
            origin.append(i)
    return replace(problem, tasks=tuple(tasks)), tuple(origin)


def from_roots(transfers: tuple[Transfer, ...], origin: tuple[int, ...]) -> tuple[Transfer, ...]:
    """A strategy's transfers of the derived problem, reading the reduced boxes (the roots'
    destination shards) and naming the original tasks."""
    return tuple(replace(t, read=Buffer.DST, task=origin[t.task]) for t in transfers)


def _root(task: UnitTask, hosts, rooted) -> int:
    held: defaultdict[int, int] = defaultdict(int)  # host -> contributions held there
    for group in task.contributions:
        for h in {hosts[d] for d in group}:
            held[h] += 1
    holders = set(task.senders)
    return min(task.receivers, key=lambda r: (-held[hosts[r]], r not in holders, rooted[r], r))


def _representative(group: tuple[int, ...], root: int, task: UnitTask, hosts) -> int:
    """The holder of one contribution to read it from: the root itself, else one on the root's
    host, else one on the host holding the most contributions (combined there before crossing)."""
    held: defaultdict[int, int] = defaultdict(int)
    for g in task.contributions:
        for h in {hosts[d] for d in g}:
            held[h] += 1
    home = hosts[root]
    return min(group, key=lambda d: (d != root, hosts[d] != home, -held[hosts[d]], d))
