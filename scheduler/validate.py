"""Schedule validator: dependencies, send/receive pairing, deadlock freedom, in-flight activations.

`validate_schedule` checks, in this order, and raises `ScheduleError` at the first failure with the
step x stage grid around the offending cell:

1. each stage's clock-table column lists exactly its stream's computes, in the same order;
2. each stage runs F k and B k exactly once for every microbatch k, F k before B k;
3. every compute's dependencies (`ir.dependencies`) ran at a strictly earlier clock;
4. in each stream, every compute comes after the receives of its inputs, every send after the
   compute that produces it; every payload is sent once and received once, between the right
   stages, and nothing else is sent;
5. no deadlock: the streams are replayed with blocking receives and the chosen send semantics
   (`SendSemantics`; computes take no time here, only order matters);
6. peak in-flight activations per stage stay within `max_in_flight`, when given.

It returns the per-stage peak in-flight activation counts.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Sequence

from .grid import render_grid
from .ir import Compute, Payload, Phase, Schedule, ScheduleError, Send


class SendSemantics(enum.Enum):
    """How a send behaves when its receiver is not there yet.

    BUFFERED: a send completes at once and its payload waits at the receiver (isend / NCCL on a
    comm stream); only receives block. RENDEZVOUS: a send blocks until the receiver reaches the
    matching receive, and both then proceed (a blocking send of a large message).
    """

    BUFFERED = "buffered"
    RENDEZVOUS = "rendezvous"


def validate_schedule(
    schedule: Schedule,
    *,
    sends: SendSemantics = SendSemantics.BUFFERED,
    max_in_flight: int | Sequence[int] | None = None,
) -> tuple[int, ...]:
    """Check `schedule` (see module doc); return peak in-flight activations per stage."""
    if not isinstance(schedule, Schedule):
        raise TypeError(f"schedule must be a Schedule, got {type(schedule).__name__}")
    if not isinstance(sends, SendSemantics):
        raise TypeError(f"sends must be a SendSemantics, got {sends!r}")
    clock_of = _check_clock_table(schedule)
    _check_complete(schedule, clock_of)
    _check_dependencies(schedule, clock_of)
    _check_streams(schedule, clock_of)
    _check_deadlock(schedule, clock_of, sends)
    return _check_in_flight(schedule, clock_of, max_in_flight)


def fail(schedule: Schedule, message: str, clock: int | None = None, stage: int | None = None) -> ScheduleError:
    """A `ScheduleError` for `schedule` whose message ends with the grid, (clock, stage) marked."""
    mark = None if clock is None or stage is None else (clock, stage)
    grid = render_grid(schedule.clock_table, schedule.n_stages, mark=mark, context=10, max_stages=16)
    return ScheduleError(f"{schedule.name}: {message}\n{grid}", clock=clock, stage=stage)


Key = tuple[int, Phase, int]
"""A compute as (stage, phase, microbatch); payloads are (phase, microbatch, src, dst)."""


def _check_clock_table(schedule: Schedule) -> dict[Key, int]:
    clock_of: dict[Key, int] = {}
    for s in range(schedule.n_stages):
        column = [(c, cell) for c, row in enumerate(schedule.clock_table) if (cell := row[s]) is not None]
        order = schedule.compute_order(s)
        for index, (c, action) in enumerate(column):
            expected = order[index] if index < len(order) else None
            if expected is None or (expected.phase, expected.microbatch) != (action.phase, action.microbatch):
                raise fail(
                    schedule,
                    f"stage {s}: clock table runs {action} where its stream runs {expected or 'nothing'}",
                    c,
                    s,
                )
            clock_of.setdefault((s, action.phase, action.microbatch), c)
        if len(column) < len(order):
            last = column[-1][0] if column else 0
            raise fail(schedule, f"stage {s}: stream runs {order[len(column)]} which the clock table lacks", last, s)
    return clock_of


def _check_complete(schedule: Schedule, clock_of: dict[Key, int]) -> None:
    for s in range(schedule.n_stages):
        seen: set[tuple[Phase, int]] = set()
        for action in schedule.compute_order(s):
            key = (action.phase, action.microbatch)
            at = (s, *key)
            if key in seen:
                raise fail(schedule, f"stage {s} runs {action} twice", clock_of[at], s)
            if action.phase is Phase.BACKWARD and (Phase.FORWARD, action.microbatch) not in seen:
                raise fail(schedule, f"stage {s} runs {action} before F{action.microbatch}", clock_of[at], s)
            seen.add(key)
        missing = len(seen) < 2 * schedule.n_microbatches
        if missing:
            k, phase = next((k, ph) for k in range(schedule.n_microbatches) for ph in Phase if (ph, k) not in seen)
            last = max((c for (st, _, _), c in clock_of.items() if st == s), default=0)
            raise fail(schedule, f"stage {s} never runs {phase.value}{k}", last, s)


def _check_dependencies(schedule: Schedule, clock_of: dict[Key, int]) -> None:
    sources = {(s, phase): schedule.peers(s, phase)[0] for s in range(schedule.n_stages) for phase in Phase}
    for (s, phase, k), c in clock_of.items():
        needs = [(p, phase, k) for p in sources[(s, phase)]]
        if phase is Phase.BACKWARD:
            needs.append((s, Phase.FORWARD, k))
        for dep in needs:
            if clock_of[dep] >= c:
                raise fail(
                    schedule,
                    f"stage {s} runs {phase.value}{k} at clock {c} but {dep[1].value}{k} on stage "
                    f"{dep[0]} finishes only at clock {clock_of[dep]}",
                    c,
                    s,
                )


def _check_streams(schedule: Schedule, clock_of: dict[Key, int]) -> None:
    n = schedule.n_stages
    peers = [{phase: schedule.peers(s, phase) for phase in Phase} for s in range(n)]
    required = {
        (a.phase, a.microbatch, s, p) for s in range(n) for a in schedule.compute_order(s) for p in peers[s][a.phase][1]
    }
    sent: set[tuple] = set()
    received: set[tuple] = set()
    for s, stream in enumerate(schedule.streams):
        done: set[tuple[Phase, int]] = set()
        for action in stream:
            phase, k = action.phase, action.microbatch
            if isinstance(action, Compute):
                for p in peers[s][phase][0]:
                    if (phase, k, p, s) not in received:
                        raise fail(
                            schedule,
                            f"stage {s} runs {action} before receiving {Payload(phase, k, p, s)}",
                            clock_of[(s, phase, k)],
                            s,
                        )
                done.add((phase, k))
                continue
            is_send = isinstance(action, Send)
            key = (phase, k, s, action.peer) if is_send else (phase, k, action.peer, s)
            producer = clock_of.get((key[2], phase, k))
            if key not in required:
                raise fail(
                    schedule,
                    f"stage {s} issues {action}: no compute produces {Payload(*key)} "
                    f"(not a neighbour or a declared skip)",
                    producer,
                    key[2],
                )
            target = sent if is_send else received
            if key in target:
                raise fail(schedule, f"stage {s} issues {action} twice", producer, key[2])
            if is_send and (phase, k) not in done:
                raise fail(schedule, f"stage {s} issues {action} before computing {phase.value}{k}", producer, s)
            target.add(key)
    for key in sorted(required - sent, key=_payload_order):
        raise fail(
            schedule,
            f"stage {key[2]} never sends {Payload(*key)} (unpaired receive)",
            clock_of.get((key[2], key[0], key[1])),
            key[2],
        )
    for key in sorted(required - received, key=_payload_order):
        raise fail(
            schedule,
            f"stage {key[3]} never receives {Payload(*key)} (send without a receive)",
            clock_of.get((key[3], key[0], key[1])),
            key[3],
        )


def _payload_order(key: tuple) -> tuple:
    return (key[1], key[0].value, key[2], key[3])


def _check_deadlock(schedule: Schedule, clock_of: dict[Key, int], sends: SendSemantics) -> None:
    streams = schedule.streams
    buffered = sends is SendSemantics.BUFFERED
    pos = [0] * schedule.n_stages
    ready = deque(range(schedule.n_stages))
    posted: set[tuple] = set()
    blocked: dict[tuple, int] = {}
    while ready:
        s = ready.popleft()
        stream = streams[s]
        while pos[s] < len(stream):
            action = stream[pos[s]]
            if isinstance(action, Compute):
                pos[s] += 1
                continue
            is_send = isinstance(action, Send)
            key = (action.phase, action.microbatch) + ((s, action.peer) if is_send else (action.peer, s))
            if buffered:
                if is_send:
                    posted.add(key)
                    if key in blocked:
                        ready.append(blocked.pop(key))
                elif key not in posted:
                    blocked[key] = s
                    break
                pos[s] += 1
                continue
            partner = blocked.pop(key, None)
            if partner is None:
                blocked[key] = s
                break
            pos[s] += 1
            pos[partner] += 1
            ready.append(partner)
    stuck = [s for s in range(schedule.n_stages) if pos[s] < len(streams[s])]
    if stuck:
        waits = "; ".join(f"stage {s} blocks on {streams[s][pos[s]]}" for s in stuck)
        s = stuck[0]
        action = streams[s][pos[s]]
        if isinstance(action, Send):
            clock = clock_of[(s, action.phase, action.microbatch)]
        else:
            upcoming = next((a for a in streams[s][pos[s] :] if isinstance(a, Compute)), None)
            clock = schedule.n_clocks if upcoming is None else clock_of[(s, upcoming.phase, upcoming.microbatch)]
        raise fail(schedule, f"deadlock with {sends.value} sends: {waits}", clock, s)


def _check_in_flight(
    schedule: Schedule, clock_of: dict[Key, int], max_in_flight: int | Sequence[int] | None
) -> tuple[int, ...]:
    n = schedule.n_stages
    if max_in_flight is None:
        limits: Sequence[int | None] = [None] * n
    elif isinstance(max_in_flight, int):
        limits = [max_in_flight] * n
    else:
        limits = list(max_in_flight)
        if len(limits) != n:
            raise ValueError(f"max_in_flight: expected {n} per-stage limits, got {len(limits)}")
    peaks = []
    for s in range(n):
        order = schedule.compute_order(s)
        counts = schedule.in_flight(s)
        limit = limits[s]
        for action, held in zip(order, counts, strict=True):
            if limit is not None and held > limit:
                raise fail(
                    schedule,
                    f"stage {s} holds {held} activations after {action}, over max_in_flight={limit}",
                    clock_of[(s, action.phase, action.microbatch)],
                    s,
                )
        peaks.append(max(counts, default=0))
    return tuple(peaks)
