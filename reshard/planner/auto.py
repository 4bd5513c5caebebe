"""``auto``: the topology-aware planner. It minimizes the simulated makespan on the cluster.

``auto`` builds several candidate plans and keeps the one ``topology.simulator`` finds fastest on
the problem's cluster, simulated as the runtime issues them (in windows of
``reshard.ir.target.window_ops_for(backend)`` small messages per device, so many small messages
cost a latency per window), so it is never slower there than any candidate, and the baselines of
``reshard.planner.baselines`` are candidates. Its own candidates go past the baselines'
weaknesses: ``reshard.planner.hier`` balances the hosts' NICs (by time, so a slow NIC gets less
work) and picks sending devices ("hier", or "serial": one sending device per host), and
``reshard.planner.order`` orders the transfers ("color", "nic", "lpt", "task"; on gloo each also in
duplex rounds, where a relay forwards a slice while the next comes in).

Candidates are simulated within a planning-time budget (``SIMULATION_BUDGET`` transfers in all,
baselines while ``MAX_BASELINE_WORK`` allows); past ``MAX_SIMULATED_TRANSFERS`` ``auto`` returns
the "serial/color" candidate unsimulated: one sending device per host where the box allows, so
that device-order serialization keeps every NIC on the color schedule.
Of equally fast candidates it keeps the one whose busiest device moves the fewest bytes, then one
in duplex rounds (its relays forward earlier), then the one with fewer groups and transfers.
Everything is deterministic (no unseeded randomness; ties break on device ids).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from reshard.ir.plan import Transfer, TransferKind, sim_transfers
from reshard.ir.regions import box_volume, device_regions
from reshard.ir.target import WINDOW_BYTES, target_for, window_ops_for
from reshard.planner.baselines import (
    plan_allgather,
    plan_broadcast_first,
    plan_broadcast_order,
    plan_broadcast_size,
    plan_send_recv,
)
from reshard.planner.hier import Context, plan_items
from reshard.planner.order import order_items
from reshard.planner.problem import Problem
from reshard.planner.registry import register
from topology.simulator import simulate_transfers

MAX_SIMULATED_TRANSFERS = 4000  # beyond it the serial/color plan is returned unsimulated
SIMULATION_BUDGET = 24000  # transfers simulated per planning call, over all candidates
MAX_BASELINE_WORK = 50_000  # baselines join the candidates while sum(senders * receivers) stays below
DUPLEX = "+duplex"  # the name of an order in duplex rounds
BASELINES = {
    "broadcast_order": plan_broadcast_order,
    "broadcast_size": plan_broadcast_size,
    "broadcast": plan_broadcast_first,
    "allgather": plan_allgather,
    "send_recv": plan_send_recv,
}


@dataclass(frozen=True, slots=True)
class Candidate:
    name: str
    transfers: tuple[Transfer, ...]
    makespan_s: float | None  # None when not simulated


@register("auto")
def plan_auto(problem: Problem) -> tuple[Transfer, ...]:
    """The fastest (simulated) of the candidate plans; see the module docstring."""
    return choose(problem)[0].transfers


def choose(problem: Problem) -> tuple[Candidate, list[Candidate]]:
    """(the chosen candidate, every candidate simulated), in evaluation order."""
    ctx = Context(problem)
    window = window_ops_for(problem.cluster.backend)
    beside = target_for(problem.cluster.backend).copies_beside_messages  # local copies run beside messages
    serial, shapes = plan_items(ctx, split=True, serial=True)
    first = order_items(serial, "color")
    if len(first) > MAX_SIMULATED_TRANSFERS:
        c = Candidate("serial/color", first, None)
        return c, [c]
    items, _ = plan_items(ctx, split=True)
    orders: list[tuple[str, Callable[[], list], str]] = [  # (name, its items, how to order them)
        ("serial/color", lambda: serial, "color"),
        ("hier/color", lambda: items, "color"),
        ("hier/lpt", lambda: items, "lpt"),
        ("serial/lpt", lambda: serial, "lpt"),
        ("hier/nic", lambda: items, "nic"),
        ("hier/task", lambda: items, "task"),
    ]
    if "split" in shapes:  # else identical to hier
        orders.append(("whole/color", lambda: plan_items(ctx, split=False)[0], "color"))
    if "ring" in shapes:
        orders.append(("star/color", lambda: plan_items(ctx, split=True, modes=("star",))[0], "color"))
    makers: list[tuple[str, Callable[[], tuple[Transfer, ...]]]] = [("serial/color", lambda: first)]
    makers += [(name, partial(_ordered, of, how, False)) for name, of, how in orders[1:]]
    if window > 1:  # devices that issue windows forward a slice while the next comes in
        makers += [(name + DUPLEX, partial(_ordered, of, how, True)) for name, of, how in orders]
    work = sum(len(t.senders) * len(t.receivers) for t in problem.tasks)
    if work <= MAX_BASELINE_WORK:
        makers[2:2] = [(name, partial(fn, problem)) for name, fn in BASELINES.items()]
    regions = device_regions(problem.src, problem.shape) if window > 1 else None
    seen: set[tuple[Transfer, ...]] = set()
    evaluated: list[Candidate] = []
    budget = SIMULATION_BUDGET
    for name, make in makers:
        transfers = make()
        if transfers in seen or len(transfers) > budget:
            continue
        seen.add(transfers)
        budget -= len(transfers)
        sim = simulate_transfers(
            sim_transfers(transfers, problem.itemsize, src_regions=regions),
            problem.hosts,
            problem.cluster,
            window=window,
            window_bytes=WINDOW_BYTES,
            local_beside=beside,
        )
        evaluated.append(Candidate(name, transfers, sim.makespan_s))
    best = min(
        evaluated,
        key=lambda c: (
            _makespan(c),
            _busiest(c.transfers),
            not c.name.endswith(DUPLEX),
            _groups(c.transfers),
            len(c.transfers),
        ),
    )
    return best, evaluated


def _ordered(of: Callable[[], list], how: str, duplex: bool) -> tuple[Transfer, ...]:
    """The items ``of()`` ordered by ``how`` (``order_items``)."""
    return order_items(of(), how, duplex=duplex)


def _makespan(c: Candidate) -> float:
    assert c.makespan_s is not None
    return c.makespan_s


def _busiest(transfers: tuple[Transfer, ...]) -> int:
    """The most elements one device moves (sends, receives or copies): between plans the simulator
    finds equally fast, the one that spreads the work (every byte costs its device time: a CPU
    device copies it)."""
    load: dict[int, int] = {}
    for t in transfers:
        n = box_volume(t.box)
        for d in {t.src, *t.dsts}:
            load[d] = load.get(d, 0) + n
    return max(load.values(), default=0)


def _groups(transfers: tuple[Transfer, ...]) -> int:
    return len({tuple(sorted(t.group)) for t in transfers if t.kind is not TransferKind.COPY})
