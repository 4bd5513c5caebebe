"""Schedule generators: GPipe, 1F1B and eager 1F1B.

A schedule is fixed by each stage's compute order; everything else is derived from it:

- the clock table, by a dependency-driven list scheduler: at every clock each stage runs the next
  compute of its order if every dependency (`ir.dependencies`) finished at an earlier clock, else
  it idles;
- the streams: before each compute, the receives of its inputs; right after it, the sends of its
  outputs ("send as soon as the result exists"), neighbour first, then skip peers.

The three schedules differ only in how many forwards stage i runs before its first backward
(its warm-up), after which it alternates one backward, one forward:
GPipe m, 1F1B min(m, n - i), eager 1F1B min(m, 2(n - i) - 1). That warm-up is also the peak
number of activations the stage holds.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import cast

from .grid import render_grid
from .ir import (
    Action,
    ClockTable,
    Compute,
    Phase,
    Recv,
    Schedule,
    ScheduleError,
    Send,
    check_count,
    normalize_skips,
    parse_action,
    peers,
)

Skips = Iterable[Sequence[int]]


def list_schedule(orders: Sequence[Sequence[Compute]], skips: Sequence[tuple[int, int]] = ()) -> ClockTable:
    """Place each stage's computes, in its order, at the earliest clock its dependencies allow."""
    n = len(orders)
    inputs = [{phase: peers(s, phase, n, skips)[0] for phase in Phase} for s in range(n)]

    def deps(a: Compute) -> list[tuple[int, Phase, int]]:
        keys = [(p, a.phase, a.microbatch) for p in inputs[a.stage][a.phase]]
        if a.phase is Phase.BACKWARD:
            keys.append((a.stage, Phase.FORWARD, a.microbatch))
        return keys

    needs = [[deps(a) for a in order] for order in orders]
    done: dict[tuple[int, Phase, int], int] = {}
    pos = [0] * n
    remaining = sum(len(order) for order in orders)
    table: list[tuple[Compute | None, ...]] = []
    while remaining:
        clock = len(table)
        row: list[Compute | None] = [None] * n
        for s in range(n):
            if pos[s] < len(orders[s]) and all(done.get(d, clock) < clock for d in needs[s][pos[s]]):
                row[s] = orders[s][pos[s]]
        if not any(row):
            stuck = next(s for s in range(n) if pos[s] < len(orders[s]))
            missing = [f"{ph.value}{k} on stage {p}" for p, ph, k in needs[stuck][pos[stuck]] if (p, ph, k) not in done]
            grid = render_grid([*table, tuple(row)], n, mark=(clock, stuck), context=8, max_stages=16)
            raise ScheduleError(
                f"compute orders deadlock at clock {clock}: stage {stuck} waits to run "
                f"{orders[stuck][pos[stuck]]}, which needs {', '.join(missing)}\n{grid}",
                clock=clock,
                stage=stuck,
            )
        for s, action in enumerate(row):
            if action is not None:
                done[(s, action.phase, action.microbatch)] = clock
                pos[s] += 1
                remaining -= 1
        table.append(tuple(row))
    return tuple(table)


def build_streams(
    orders: Sequence[Sequence[Compute]], skips: Sequence[tuple[int, int]] = ()
) -> tuple[tuple[Action, ...], ...]:
    """Interleave each stage's computes with the receives of their inputs and sends of their outputs."""
    n = len(orders)
    streams = []
    for s, order in enumerate(orders):
        links = {phase: peers(s, phase, n, skips) for phase in Phase}
        stream: list[Action] = []
        for action in order:
            phase, k = action.phase, action.microbatch
            sources, targets = links[phase]
            stream.extend(Recv(s, phase, k, p) for p in sources)
            stream.append(action)
            stream.extend(Send(s, phase, k, p) for p in targets)
        streams.append(tuple(stream))
    return tuple(streams)


def schedule_from_orders(
    name: str,
    orders: Sequence[Sequence[Compute | str]],
    n_microbatches: int,
    skips: Skips = (),
) -> Schedule:
    """Build a `Schedule` from per-stage compute orders (Compute values or ``"F3"``-style text)."""
    n = check_count("n_stages", len(orders))
    check_count("n_microbatches", n_microbatches)
    skips = normalize_skips(skips, n)
    parsed = [tuple(parse_action(a, s) if isinstance(a, str) else a for a in order) for s, order in enumerate(orders)]
    for s, order in enumerate(parsed):
        for action in order:
            if not isinstance(action, Compute) or action.stage != s:
                raise ValueError(f"orders[{s}]: {action!r} is not a compute of stage {s}")
    computes = cast(list[tuple[Compute, ...]], parsed)  # checked just above
    return Schedule(
        name=name,
        n_stages=n,
        n_microbatches=n_microbatches,
        streams=build_streams(computes, skips),
        clock_table=list_schedule(computes, skips),
        skips=skips,
    )


def with_skips(schedule: Schedule, skips: Skips) -> Schedule:
    """The same compute orders with extra skip connections (and their sends and receives) added."""
    merged = (*schedule.skips, *normalize_skips(skips, schedule.n_stages))
    orders = [schedule.compute_order(s) for s in range(schedule.n_stages)]
    return schedule_from_orders(schedule.name, orders, schedule.n_microbatches, merged)


def warmup_order(stage: int, n_microbatches: int, warmup: int) -> tuple[Compute, ...]:
    """`warmup` forwards, then alternate one backward and one forward, then the remaining backwards."""
    m = n_microbatches
    warmup = min(m, warmup)
    order = [Compute(stage, Phase.FORWARD, k) for k in range(warmup)]
    for k in range(m - warmup):
        order += [Compute(stage, Phase.BACKWARD, k), Compute(stage, Phase.FORWARD, warmup + k)]
    order += [Compute(stage, Phase.BACKWARD, k) for k in range(m - warmup, m)]
    return tuple(order)


def _from_warmups(name: str, n_stages: int, n_microbatches: int, warmups: Sequence[int], skips: Skips) -> Schedule:
    orders = [warmup_order(s, n_microbatches, w) for s, w in enumerate(warmups)]
    return schedule_from_orders(name, orders, n_microbatches, skips)


def gpipe(n_stages: int, n_microbatches: int, *, skips: Skips = ()) -> Schedule:
    """GPipe: every stage runs all forwards, then all backwards (holds all m activations)."""
    n, m = check_count("n_stages", n_stages), check_count("n_microbatches", n_microbatches)
    return _from_warmups("GPipe", n, m, [m] * n, skips)


def one_f_one_b(n_stages: int, n_microbatches: int, *, skips: Skips = ()) -> Schedule:
    """1F1B (PipeDream-flush): stage i warms up with min(m, n - i) forwards, then alternates."""
    n, m = check_count("n_stages", n_stages), check_count("n_microbatches", n_microbatches)
    return _from_warmups("1F1B", n, m, [n - i for i in range(n)], skips)


def eager_one_f_one_b(n_stages: int, n_microbatches: int, *, skips: Skips = ()) -> Schedule:
    """Eager 1F1B: stage i warms up with min(m, 2(n - i) - 1) forwards, so each activation exists a
    clock before the next stage needs it and its send overlaps compute; same clock count as 1F1B."""
    n, m = check_count("n_stages", n_stages), check_count("n_microbatches", n_microbatches)
    return _from_warmups("eager-1F1B", n, m, [2 * (n - i) - 1 for i in range(n)], skips)
