"""Discrete-event timing simulator for a `Schedule`: iteration time, bubbles, waits, a Gantt chart.

Model (every duration a plain float in seconds; a reshard-plan cost model can supply them):

- Compute: each stage has one compute unit that runs the stage's computes one at a time, in stream
  order. A compute starts when the unit is free and every input payload has arrived (F k on stage i:
  the activation from i - 1 and from skip sources; B k: the gradient from i + 1 and from skip
  destinations). It lasts ``forward_s[i]`` or ``backward_s[i]``.
- Sends: a send is issued as soon as the compute producing its payload ends ("send as soon as the
  result exists"). Each directed stage pair (src -> dst) is one link carrying one transfer at a
  time, first come first served in the sender's issue order; the payload arrives when its transfer
  ends. Durations: activations on boundary b (stage b -> b + 1) take ``transfer_s[b]``, gradients
  (b + 1 -> b) take ``backward_transfer_s[b]`` (default: the same as forward), both directions of a
  skip (i, j) take ``skip_transfer_s[(i, j)]``. Links are full duplex (the two directions of a
  boundary do not contend) and receiving costs the receiver nothing; there is no latency term.
- ``overlap=True``: a stage's sends run on its links concurrently with its computes.
  ``overlap=False``: a send also occupies its sender's compute unit from the moment the unit is free
  to issue it until the transfer ends (a blocking send); the receiver is not occupied.
  ``rendezvous=True`` (implies blocking sends): a transfer also starts only once its receiver
  reached the compute that reads it, i.e. ended the compute before that one, as NCCL lanes on
  GPUs run (``scheduler.runtime.worker``: no NCCL kernel waits beside a compute). A schedule
  that cannot run so ends in ``ScheduleError`` ("stuck").

Reported: ``iteration_s`` = the last event's end; ``busy_s[i]`` = stage i's compute time;
``idle_waiting_s[i]`` = time stage i's unit was free but its next compute's inputs had not arrived
(pipeline fill included, the tail after its last compute not); ``bubble_fraction`` =
1 - sum(busy_s) / (n_stages * iteration_s); ``events[i]`` = stage i's computes and sends in issue
order as ``Event(kind, label, start_s, end_s)``. With all transfers 0 the times equal those of the
same schedule without communication.
"""

from __future__ import annotations

import enum
import math
import numbers
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from .generators import with_skips
from .ir import Compute, Phase, Schedule, ScheduleError, Send
from .validate import validate_schedule

Seconds = float | Sequence[float]


class EventKind(enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    SEND = "send"

    def __repr__(self) -> str:
        return f"EventKind.{self.name}"


class Event(NamedTuple):
    """One bar of the Gantt chart: a compute or a send (on the sender's row)."""

    kind: EventKind
    label: str
    start_s: float
    end_s: float


@dataclass(frozen=True, slots=True)
class SimulationResult:
    """Timings of one simulated iteration; per-stage tuples are indexed by stage."""

    schedule_name: str
    overlap: bool
    iteration_s: float
    bubble_fraction: float
    busy_s: tuple[float, ...]
    idle_waiting_s: tuple[float, ...]
    send_s: tuple[float, ...]
    peak_activations: tuple[int, ...]
    events: tuple[tuple[Event, ...], ...]


def simulate(
    schedule: Schedule,
    *,
    forward_s: Seconds,
    backward_s: Seconds,
    transfer_s: Seconds = 0.0,
    backward_transfer_s: Seconds | None = None,
    skip_transfer_s: Mapping[tuple[int, int], float] | None = None,
    overlap: bool = True,
    rendezvous: bool = False,
) -> SimulationResult:
    """Simulate one iteration of `schedule` (model in the module doc).

    forward_s, backward_s: seconds per compute, one value or one per stage. transfer_s: seconds per
    activation transfer, one value or one per boundary (n_stages - 1). backward_transfer_s: the same
    for gradients (None = transfer_s). skip_transfer_s: {(i, j): seconds} for skip connections;
    skips the schedule lacks are added to it.
    """
    if not isinstance(schedule, Schedule):
        raise TypeError(f"schedule must be a Schedule, got {type(schedule).__name__}")
    n = schedule.n_stages
    fwd = _durations("forward_s", forward_s, n)
    bwd = _durations("backward_s", backward_s, n)
    xfer = _durations("transfer_s", transfer_s, n - 1)
    back_xfer = xfer if backward_transfer_s is None else _durations("backward_transfer_s", backward_transfer_s, n - 1)
    skip_xfer = {}
    for pair, seconds in (skip_transfer_s or {}).items():
        skip_xfer[tuple(pair)] = _durations(f"skip_transfer_s[{pair!r}]", seconds, 1)[0]
    extra = [pair for pair in skip_xfer if pair not in schedule.skips]
    if extra:
        schedule = with_skips(schedule, extra)
    for pair in schedule.skips:
        if pair not in skip_xfer:
            raise ValueError(f"skip_transfer_s: no duration for the schedule's skip connection {pair}")
    validate_schedule(schedule)

    link_s = {(b, b + 1): xfer[b] for b in range(n - 1)}
    link_s.update({(b + 1, b): back_xfer[b] for b in range(n - 1)})
    for (i, j), seconds in skip_xfer.items():
        link_s[(i, j)] = link_s[(j, i)] = seconds
    inputs = [{phase: schedule.peers(s, phase)[0] for phase in Phase} for s in range(n)]

    streams = schedule.streams
    overlap = overlap and not rendezvous
    before: list[dict[tuple[Phase, int], tuple[Phase, int] | None]] = []  # a compute -> the stage's one before it
    for stream in streams:
        computes = [(a.phase, a.microbatch) for a in stream if isinstance(a, Compute)]
        before.append(dict(zip(computes, [None, *computes[:-1]], strict=True)))
    reaching: dict[tuple[int, tuple[Phase, int]], list[int]] = {}  # (stage, compute) -> senders waiting for its end
    pos = [0] * n
    free = [0.0] * n
    waiting = [0.0] * n
    busy = [0.0] * n
    sending = [0.0] * n
    events: list[list[Event]] = [[] for _ in range(n)]
    ended: list[dict[tuple[Phase, int], float]] = [{} for _ in range(n)]
    arrival: dict[tuple, float] = {}
    link_free: dict[tuple[int, int], float] = {}
    blocked: dict[tuple, int] = {}
    ready = deque(range(n))
    while ready:
        s = ready.popleft()
        stream = streams[s]
        while pos[s] < len(stream):
            action = stream[pos[s]]
            phase, k = action.phase, action.microbatch
            if isinstance(action, Compute):
                keys = [(phase, k, p, s) for p in inputs[s][phase]]
                missing = next((key for key in keys if key not in arrival), None)
                if missing is not None:
                    blocked[missing] = s
                    break
                start = max([free[s], *(arrival[key] for key in keys)])
                forward = phase is Phase.FORWARD
                end = start + (fwd[s] if forward else bwd[s])
                waiting[s] += start - free[s]
                busy[s] += end - start
                free[s] = ended[s][(phase, k)] = end
                kind = EventKind.FORWARD if forward else EventKind.BACKWARD
                events[s].append(Event(kind, str(action), start, end))
                ready.extend(reaching.pop((s, (phase, k)), ()))
            elif isinstance(action, Send):
                link = (s, action.peer)
                key = (phase, k, *link)
                issue = ended[s][(phase, k)] if overlap else free[s]
                if rendezvous:  # the receiver posts its receive once it ended the compute before the reader
                    prior = before[action.peer][(phase, k)]
                    if prior is not None and prior not in ended[action.peer]:
                        reaching.setdefault((action.peer, prior), []).append(s)
                        break
                    issue = max(issue, 0.0 if prior is None else ended[action.peer][prior])
                start = max(issue, link_free.get(link, 0.0))
                end = start + link_s[link]
                link_free[link] = arrival[key] = end
                sending[s] += end - start
                if not overlap:
                    free[s] = end
                events[s].append(Event(EventKind.SEND, str(action), start, end))
                if key in blocked:
                    ready.append(blocked.pop(key))
            pos[s] += 1
    stuck = [s for s in range(n) if pos[s] < len(streams[s])]
    if stuck:
        s = stuck[0]
        raise ScheduleError(f"{schedule.name}: simulation stuck at stage {s} on {streams[s][pos[s]]}", stage=s)
    iteration = max((e.end_s for row in events for e in row), default=0.0)
    bubble = 1.0 - sum(busy) / (n * iteration) if iteration > 0 else 0.0
    return SimulationResult(
        schedule_name=schedule.name,
        overlap=bool(overlap),
        iteration_s=iteration,
        bubble_fraction=bubble,
        busy_s=tuple(busy),
        idle_waiting_s=tuple(waiting),
        send_s=tuple(sending),
        peak_activations=schedule.peak_activations,
        events=tuple(tuple(row) for row in events),
    )


def _durations(name: str, value: Seconds, count: int) -> tuple[float, ...]:
    """One value for each of `count` slots: a scalar is repeated, a sequence must have `count`."""
    if isinstance(value, bool | str | bytes):
        raise TypeError(f"{name} must be seconds (a number or a sequence of numbers), got {value!r}")
    if isinstance(value, float | int | numbers.Real):
        values = [value] * count
    else:
        try:
            values = list(value)
        except TypeError:
            raise TypeError(f"{name} must be seconds (a number or a sequence of numbers), got {value!r}") from None
        if len(values) != count:
            raise ValueError(f"{name}: expected {count} values, got {len(values)}")
    out = []
    for v in values:
        if isinstance(v, bool):
            raise TypeError(f"{name} must be seconds, got {v!r}")
        f = float(v)
        if not math.isfinite(f) or f < 0:
            raise ValueError(f"{name} must be finite and >= 0, got {v!r}")
        out.append(f)
    return tuple(out)
