"""What each pipeline stage's threads do in one iteration, derived from a `Schedule` (pure).

The pipeline runtime (`scheduler.pipeline`) runs, on every device of stage s, one compute thread
and one communication thread per LANE (a directed stage pair (src, dst) that carries payloads
from src to dst: activations forward, gradients backward, skip connections both ways). This module
decides, without Ray or torch, the order of everything:

- the GLOBAL TRANSFER ORDER: every payload of the iteration, sorted by the clock at which its
  producing compute runs in the schedule's clock table (ties: producer stage, then the producer's
  stream order). Each lane issues its transfers in this order (the lane's subsequence), so every
  communicator, on every device, sees its operations in one global order;
- per stage, the compute order (the stream's computes) with the payloads each compute waits for
  and produces, and the send and receive lanes with their payload sequences.

Deadlock freedom, by construction. Give every compute the key (its clock, 0) and every transfer
(its producer's clock, 1, rank in the global order). Every wait in the runtime goes from a smaller
key to a larger one: a send waits for its producer (clock c, 0) < (c, 1, .); a lane's transfer
waits for the lane's previous transfer (smaller rank in the global order); a compute waits for its
inputs (produced at a strictly earlier clock, which `validate_schedule` guarantees) and for the
previous compute of its stage (earlier clock); without overlap, a compute also waits for the sends
of the previous compute (producer clock < its clock). A cycle of waits would need a key smaller
than itself. `check_deadlock_free` replays the same rules as a cheap second check.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .ir import Compute, Payload, Phase, Schedule, ScheduleError, Send
from .validate import fail

Lane = tuple[int, int]


def lane_of(payload: Payload) -> Lane:
    """The directed stage pair that carries `payload`."""
    return (payload.src, payload.dst)


def clock_of(schedule: Schedule) -> dict[Compute, int]:
    """The clock at which each compute runs in the clock table."""
    out: dict[Compute, int] = {}
    for c, row in enumerate(schedule.clock_table):
        for action in row:
            if action is not None:
                out.setdefault(action, c)
    return out


def global_transfer_order(schedule: Schedule) -> tuple[Payload, ...]:
    """Every payload of the iteration in the one order all communication follows (module doc)."""
    clocks = clock_of(schedule)
    keyed = []
    for s, stream in enumerate(schedule.streams):
        for position, action in enumerate(stream):
            if isinstance(action, Send):
                p = action.payload
                keyed.append(((clocks[p.producer], s, position), p))
    keyed.sort(key=lambda kp: kp[0])
    return tuple(p for _, p in keyed)


def lane_sequences(order: Sequence[Payload]) -> dict[Lane, tuple[Payload, ...]]:
    """Each lane's transfers: its subsequence of the global order."""
    lanes: dict[Lane, list[Payload]] = {}
    for p in order:
        lanes.setdefault(lane_of(p), []).append(p)
    return {lane: tuple(ps) for lane, ps in lanes.items()}


@dataclass(frozen=True, slots=True)
class ComputeStep:
    """One compute of a stage: what it waits for and what it produces for other stages."""

    compute: Compute
    inputs: tuple[Payload, ...]
    outputs: tuple[Payload, ...]


@dataclass(frozen=True, slots=True)
class StagePlan:
    """Everything stage `stage`'s threads do in one iteration.

    steps: computes in execution order. send_lanes / recv_lanes: the lanes leaving / entering
    this stage, each with its transfers in global order. peak_activations: the schedule's analytic
    count of microbatches whose forward ran and whose backward has not.
    """

    stage: int
    n_stages: int
    n_microbatches: int
    steps: tuple[ComputeStep, ...]
    send_lanes: dict[Lane, tuple[Payload, ...]]
    recv_lanes: dict[Lane, tuple[Payload, ...]]
    peak_activations: int


@dataclass(frozen=True, slots=True)
class PipelinePlan:
    """A validated schedule turned into per-stage plans plus the global transfer order."""

    schedule: Schedule
    order: tuple[Payload, ...]
    lanes: dict[Lane, tuple[Payload, ...]]
    stages: tuple[StagePlan, ...]

    @property
    def n_transfers(self) -> int:
        return len(self.order)


def plan_pipeline(schedule: Schedule, *, overlap: bool = True) -> PipelinePlan:
    """Validate `schedule`, derive the global transfer order and each stage's plan; check that the
    runtime's waits cannot deadlock (raises `ScheduleError` with the grid, failing step marked)."""
    from .validate import validate_schedule

    if not isinstance(schedule, Schedule):
        raise TypeError(f"schedule must be a scheduler.Schedule, got {type(schedule).__name__}")
    validate_schedule(schedule)
    order = global_transfer_order(schedule)
    lanes = lane_sequences(order)
    check_deadlock_free(schedule, order, overlap=overlap)
    peaks = schedule.peak_activations
    stages = []
    for s in range(schedule.n_stages):
        steps = tuple(ComputeStep(a, schedule.inputs_of(a), schedule.outputs_of(a)) for a in schedule.compute_order(s))
        stages.append(
            StagePlan(
                stage=s,
                n_stages=schedule.n_stages,
                n_microbatches=schedule.n_microbatches,
                steps=steps,
                send_lanes={lane: ps for lane, ps in lanes.items() if lane[0] == s},
                recv_lanes={lane: ps for lane, ps in lanes.items() if lane[1] == s},
                peak_activations=peaks[s],
            )
        )
    return PipelinePlan(schedule, order, lanes, tuple(stages))


def check_deadlock_free(schedule: Schedule, order: Sequence[Payload], *, overlap: bool = True) -> None:
    """Replay the runtime's waits with zero durations: compute threads run their stage's computes
    in order once inputs arrived (and, without overlap, once the previous compute's sends are
    done); each lane runs its transfers in `order` once the producer ran. Raise `ScheduleError`
    (grid with the stuck compute marked) if some thread can never proceed."""
    n = schedule.n_stages
    lanes = lane_sequences(order)
    produced = {p for s in range(n) for a in schedule.compute_order(s) for p in schedule.outputs_of(a)}
    if set(order) != produced or len(order) != len(produced):
        raise ScheduleError(f"{schedule.name}: the transfer order does not list every payload exactly once")
    orders = [schedule.compute_order(s) for s in range(n)]
    pos = [0] * n
    lane_pos = dict.fromkeys(lanes, 0)
    done: set[Compute] = set()
    arrived: set[Payload] = set()
    progress = True
    while progress:
        progress = False
        for s in range(n):
            while pos[s] < len(orders[s]):
                action = orders[s][pos[s]]
                if any(p not in arrived for p in schedule.inputs_of(action)):
                    break
                if not overlap and pos[s] > 0:
                    previous = orders[s][pos[s] - 1]
                    if any(p not in arrived for p in schedule.outputs_of(previous)):
                        break
                done.add(action)
                pos[s] += 1
                progress = True
        for lane, seq in lanes.items():
            while lane_pos[lane] < len(seq) and seq[lane_pos[lane]].producer in done:
                arrived.add(seq[lane_pos[lane]])
                lane_pos[lane] += 1
                progress = True
    stuck = [s for s in range(n) if pos[s] < len(orders[s])]
    if stuck:
        clocks = clock_of(schedule)
        s = stuck[0]
        action = orders[s][pos[s]]
        waits = [str(p) for p in schedule.inputs_of(action) if p not in arrived]
        raise fail(
            schedule,
            f"transfer order deadlocks: stage {s} waits forever to run {action} "
            f"(missing {', '.join(waits) or 'its previous sends'})",
            clocks.get(action),
            s,
        )


def payload_name(p: Payload) -> str:
    """``"F3 0->1"``: activation of microbatch 3 from stage 0 to 1; ``"B3 1->0"``: its gradient."""
    return f"{p.phase.value}{p.microbatch} {p.src}->{p.dst}"


def is_forward(p: Payload) -> bool:
    return p.phase is Phase.FORWARD
