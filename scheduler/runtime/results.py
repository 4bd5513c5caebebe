"""What one pipeline iteration did, measured on the actors: the timeline and the durations that
``scheduler.simulate`` can replay."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from scheduler.ir import Schedule
from scheduler.pipeline_plan import Lane
from scheduler.simulate import SimulationResult, simulate


@dataclass(frozen=True)
class TimelineEvent:
    """One bar of the measured timeline, seconds from the iteration start."""

    stage: int
    kind: str  # "forward", "backward", "send", "recv" (a receive: from posting it to the data's arrival)
    label: str
    start_s: float
    end_s: float


@dataclass
class IterationResult:
    """What one iteration did, measured on the actors.

    iteration_s: earliest compute/transfer start to latest end over all devices. driver_s: the
    driver's wall time for `run` (adds Ray round trips). peak_activations[i]: the most microbatch
    contexts stage i held at once (forward run, backward not yet), max over its devices.
    forward_s / backward_s: per stage, the measured compute durations. transfer_s: {(src, dst):
    measured send durations (the sender's side, max over its devices per transfer)}; a pull lane's
    send is its copy into the sender's ring. arrival_s: {(src, dst): per transfer, from the first
    sender's start to the last receiver's end: how long the payload was on its way}.
    """

    schedule: Schedule
    overlap: bool
    iteration_s: float
    driver_s: float
    losses: list[float]
    peak_activations: tuple[int, ...]
    forward_s: list[list[float]]
    backward_s: list[list[float]]
    transfer_s: dict[Lane, list[float]]
    events: list[TimelineEvent] = field(default_factory=list)
    arrival_s: dict[Lane, list[float]] = field(default_factory=dict)
    rendezvous: bool = False  # its lanes sent through NCCL on GPUs: only between computes

    def simulate_inputs(self, *, skip_lanes: bool = False) -> dict:
        """Mean measured durations as `scheduler.simulate` keyword arguments."""
        n = self.schedule.n_stages

        def med(xs: Sequence[float]) -> float:
            return statistics.fmean(xs) if xs else 0.0

        kwargs: dict[str, list[float] | dict[Lane, float]] = {
            "forward_s": [med(self.forward_s[s]) for s in range(n)],
            "backward_s": [med(self.backward_s[s]) for s in range(n)],
            "transfer_s": [med(self.transfer_s.get((b, b + 1), [])) for b in range(n - 1)],
            "backward_transfer_s": [med(self.transfer_s.get((b + 1, b), [])) for b in range(n - 1)],
        }
        if self.schedule.skips and not skip_lanes:
            kwargs["skip_transfer_s"] = {
                (i, j): max(med(self.transfer_s.get((i, j), [])), med(self.transfer_s.get((j, i), [])))
                for i, j in self.schedule.skips
            }
        return kwargs

    def predicted(self) -> SimulationResult:
        """`scheduler.simulate` of this schedule with this run's measured durations and overlap
        (``rendezvous`` where its lanes sent through NCCL on GPUs)."""
        return simulate(self.schedule, overlap=self.overlap, rendezvous=self.rendezvous, **self.simulate_inputs())

    def to_dict(self) -> dict:
        return {
            "schedule": self.schedule.name,
            "n_stages": self.schedule.n_stages,
            "n_microbatches": self.schedule.n_microbatches,
            "overlap": self.overlap,
            "rendezvous": self.rendezvous,
            "iteration_s": self.iteration_s,
            "driver_s": self.driver_s,
            "losses": self.losses,
            "peak_activations": list(self.peak_activations),
            "analytic_peak_activations": list(self.schedule.peak_activations),
            "forward_s": self.forward_s,
            "backward_s": self.backward_s,
            "transfer_s": {f"{a}->{b}": v for (a, b), v in sorted(self.transfer_s.items())},
            "arrival_s": {f"{a}->{b}": v for (a, b), v in sorted(self.arrival_s.items())},
            "events": [[e.stage, e.kind, e.label, e.start_s, e.end_s] for e in self.events],
        }
