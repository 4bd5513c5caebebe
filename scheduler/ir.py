"""Schedule IR: pipeline actions and the `Schedule` that holds them, as frozen, self-checking values.

A schedule is data: for every stage, the stream of actions that stage issues, in order, plus the
clock table that places each compute action in a global step. Nothing here executes anything.

Compact text form (``str(action)``; `parse_action` reads it back, given the stage that owns it):

===========  =============================================================
``F3``       forward of microbatch 3 on this stage
``B3``       backward of microbatch 3 on this stage
``S3F->1``   send microbatch 3's forward activation to stage 1
``S3B->0``   send microbatch 3's gradient to stage 0
``R3F<-0``   receive microbatch 3's forward activation from stage 0
``R3B<-2``   receive microbatch 3's gradient from stage 2
===========  =============================================================

Forward payloads travel to a higher stage, gradients to a lower one. A peer that is not adjacent is
a skip connection (U-Transformer style): stage i's activation feeds stage j > i + 1 directly and
stage j returns the matching gradient to stage i. ``repr`` of every value is eval-able in the
namespace of this module (``Compute(stage=0, phase=Phase.FORWARD, microbatch=3)``).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import cast

from .grid import render_grid

SCHEMA_VERSION = 1


class ScheduleError(ValueError):
    """A schedule breaks a rule; the message shows the step x stage grid with the failure marked.

    `clock` and `stage` locate the marked cell when there is one.
    """

    def __init__(self, message: str, clock: int | None = None, stage: int | None = None) -> None:
        super().__init__(message)
        self.clock = clock
        self.stage = stage


def check_count(name: str, value: object, minimum: int = 1) -> int:
    """Return `value` if it is an int >= `minimum`; raise TypeError/ValueError naming `name`."""
    if type(value) is int and value >= minimum:
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


class Phase(enum.Enum):
    """Which pass a compute or a payload belongs to."""

    FORWARD = "F"
    BACKWARD = "B"

    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return f"Phase.{self.name}"


@dataclass(frozen=True, slots=True, repr=False)
class Compute:
    """An action of a schedule: run `phase` (forward or backward) of `microbatch` on `stage`."""

    stage: int
    phase: Phase
    microbatch: int

    def __post_init__(self) -> None:
        check_count("stage", self.stage, 0)
        check_count("microbatch", self.microbatch, 0)
        if not isinstance(self.phase, Phase):
            raise TypeError(f"phase must be a Phase, got {self.phase!r}")

    def __str__(self) -> str:
        return f"{self.phase.value}{self.microbatch}"

    def __repr__(self) -> str:
        return f"Compute(stage={self.stage}, phase={self.phase!r}, microbatch={self.microbatch})"


def _check_transfer(phase: Phase, microbatch: int, src: int, dst: int) -> None:
    if type(microbatch) is int and type(src) is int and type(dst) is int and microbatch >= 0:
        if (phase is Phase.FORWARD and 0 <= src < dst) or (phase is Phase.BACKWARD and 0 <= dst < src):
            return
    if not isinstance(phase, Phase):
        raise TypeError(f"phase must be a Phase, got {phase!r}")
    check_count("microbatch", microbatch, 0)
    check_count("src stage", src, 0)
    check_count("dst stage", dst, 0)
    forward = phase is Phase.FORWARD
    if (dst <= src) if forward else (dst >= src):
        direction = "to a higher" if forward else "to a lower"
        raise ValueError(
            f"{phase.name} payload of microbatch {microbatch} must go {direction} stage, got {src} -> {dst}"
        )


@dataclass(frozen=True, slots=True, repr=False)
class Payload:
    """One tensor moving between two stages: `microbatch`'s activation (FORWARD) or gradient."""

    phase: Phase
    microbatch: int
    src: int
    dst: int

    def __post_init__(self) -> None:
        _check_transfer(self.phase, self.microbatch, self.src, self.dst)

    @property
    def is_skip(self) -> bool:
        return abs(self.dst - self.src) > 1

    @property
    def producer(self) -> Compute:
        """The compute on `src` whose result this payload is."""
        return Compute(self.src, self.phase, self.microbatch)

    @property
    def consumer(self) -> Compute:
        """The compute on `dst` that needs this payload."""
        return Compute(self.dst, self.phase, self.microbatch)

    def __str__(self) -> str:
        return f"{self.microbatch}{self.phase.value}:{self.src}->{self.dst}"

    def __repr__(self) -> str:
        return f"Payload(phase={self.phase!r}, microbatch={self.microbatch}, src={self.src}, dst={self.dst})"


@dataclass(frozen=True, slots=True, repr=False)
class Send:
    """`stage` sends `microbatch`'s `phase` payload to `peer`."""

    stage: int
    phase: Phase
    microbatch: int
    peer: int

    def __post_init__(self) -> None:
        _check_transfer(self.phase, self.microbatch, self.stage, self.peer)

    @property
    def payload(self) -> Payload:
        return Payload(self.phase, self.microbatch, self.stage, self.peer)

    def __str__(self) -> str:
        return f"S{self.microbatch}{self.phase.value}->{self.peer}"

    def __repr__(self) -> str:
        return f"Send(stage={self.stage}, phase={self.phase!r}, microbatch={self.microbatch}, peer={self.peer})"


@dataclass(frozen=True, slots=True, repr=False)
class Recv:
    """`stage` receives `microbatch`'s `phase` payload from `peer`."""

    stage: int
    phase: Phase
    microbatch: int
    peer: int

    def __post_init__(self) -> None:
        _check_transfer(self.phase, self.microbatch, self.peer, self.stage)

    @property
    def payload(self) -> Payload:
        return Payload(self.phase, self.microbatch, self.peer, self.stage)

    def __str__(self) -> str:
        return f"R{self.microbatch}{self.phase.value}<-{self.peer}"

    def __repr__(self) -> str:
        return f"Recv(stage={self.stage}, phase={self.phase!r}, microbatch={self.microbatch}, peer={self.peer})"


Action = Compute | Send | Recv

_ACTION_RE = re.compile(r"^(?:([FB])(\d+)|S(\d+)([FB])->(\d+)|R(\d+)([FB])<-(\d+))$")


def parse_action(text: str, stage: int) -> Action:
    """Read the compact form (``"F3"``, ``"S3F->1"``, ``"R3B<-2"``) of an action owned by `stage`."""
    match = _ACTION_RE.match(text.strip())
    if match is None:
        raise ValueError(f"not an action: {text!r} (expected e.g. 'F3', 'B0', 'S3F->1', 'R3B<-2')")
    g = match.groups()
    if g[0] is not None:
        return Compute(stage, Phase(g[0]), int(g[1]))
    if g[2] is not None:
        return Send(stage, Phase(g[3]), int(g[2]), int(g[4]))
    return Recv(stage, Phase(g[6]), int(g[5]), int(g[7]))


def normalize_skips(skips: Iterable[Sequence[int]], n_stages: int) -> tuple[tuple[int, int], ...]:
    """Check skip connections (i, j) with 0 <= i, i + 1 < j < n_stages; return them sorted, unique."""
    out = set()
    for pair in skips:
        if len(pair) != 2:
            raise ValueError(f"skips: each skip is a pair (i, j), got {pair!r}")
        i = check_count("skip source stage", pair[0], 0)
        j = check_count("skip destination stage", pair[1], 0)
        if not (j > i + 1 and j < n_stages):
            raise ValueError(f"skips: ({i}, {j}) is not a skip connection; need i + 1 < j < n_stages={n_stages}")
        out.add((i, j))
    return tuple(sorted(out))


def peers(
    stage: int, phase: Phase, n_stages: int, skips: Sequence[tuple[int, int]] = ()
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(stages that `phase` computes on `stage` receive from, stages they send to), nearest first.

    Forward: from stage - 1 and skip sources, to stage + 1 and skip destinations; backward the
    reverse. Depends only on the stage and phase, never on the microbatch.
    """
    lower = ([stage - 1] if stage > 0 else []) + [i for i, j in skips if j == stage]
    upper = ([stage + 1] if stage < n_stages - 1 else []) + [j for i, j in skips if i == stage]
    below, above = tuple(sorted(lower, reverse=True)), tuple(sorted(upper))
    return (below, above) if phase is Phase.FORWARD else (above, below)


def inputs_of(action: Compute, n_stages: int, skips: Sequence[tuple[int, int]] = ()) -> tuple[Payload, ...]:
    """Payloads from other stages that `action` needs, nearest peer first."""
    s, k, phase = action.stage, action.microbatch, action.phase
    return tuple(Payload(phase, k, p, s) for p in peers(s, phase, n_stages, skips)[0])


def outputs_of(action: Compute, n_stages: int, skips: Sequence[tuple[int, int]] = ()) -> tuple[Payload, ...]:
    """Payloads that `action` produces for other stages, nearest peer first."""
    s, k, phase = action.stage, action.microbatch, action.phase
    return tuple(Payload(phase, k, s, p) for p in peers(s, phase, n_stages, skips)[1])


def dependencies(action: Compute, n_stages: int, skips: Sequence[tuple[int, int]] = ()) -> tuple[Compute, ...]:
    """Computes that must finish before `action` starts: the producers of its inputs, and for a
    backward, the same microbatch's forward on the same stage."""
    deps = tuple(p.producer for p in inputs_of(action, n_stages, skips))
    if action.phase is Phase.BACKWARD:
        deps = (Compute(action.stage, Phase.FORWARD, action.microbatch), *deps)
    return deps


ClockTable = tuple[tuple[Compute | None, ...], ...]


@dataclass(frozen=True, slots=True)
class Schedule:
    """Per-stage action streams of one training iteration, and their clock table.

    `streams[i]` is everything stage i issues, compute and communication, in issue order.
    `clock_table[c][i]` is the compute that stage i runs at clock c, or None when it idles.
    `skips` lists the skip connections (i, j) whose payloads the streams carry.
    Construction checks shapes, ranges and ownership; `validate_schedule` checks semantics.
    `str(schedule)` is the step x stage grid.
    """

    name: str
    n_stages: int
    n_microbatches: int
    streams: tuple[tuple[Action, ...], ...]
    clock_table: ClockTable
    skips: tuple[tuple[int, int], ...] = field(default=())
    _orders: tuple[tuple[Compute, ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise TypeError(f"name must be a str, got {self.name!r}")
        n = check_count("n_stages", self.n_stages)
        m = check_count("n_microbatches", self.n_microbatches)
        streams = tuple(tuple(stream) for stream in self.streams)
        if len(streams) != n:
            raise ValueError(f"streams: expected one stream per stage ({n}), got {len(streams)}")
        for i, stream in enumerate(streams):
            for action in stream:
                _check_owned(action, i, n, m)
        table = tuple(tuple(row) for row in self.clock_table)
        for c, row in enumerate(table):
            if len(row) != n:
                raise ValueError(f"clock_table: clock {c} has {len(row)} cells, expected {n}")
            for i, cell in enumerate(row):
                if cell is not None and not isinstance(cell, Compute):
                    raise TypeError(f"clock_table[{c}][{i}] must be a Compute or None, got {cell!r}")
                if cell is not None:
                    _check_owned(cell, i, n, m)
        object.__setattr__(self, "streams", streams)
        object.__setattr__(self, "clock_table", table)
        object.__setattr__(self, "skips", normalize_skips(self.skips, n))
        orders = tuple(tuple(a for a in stream if isinstance(a, Compute)) for stream in streams)
        object.__setattr__(self, "_orders", orders)

    @property
    def n_clocks(self) -> int:
        return len(self.clock_table)

    def compute_order(self, stage: int) -> tuple[Compute, ...]:
        """Stage `stage`'s compute actions in execution (stream) order."""
        return self._orders[stage]

    def stage_actions(self, stage: int) -> list[str]:
        """Stage `stage`'s compute actions in execution order, compact: ``["F0", "F1", "B0", ...]``."""
        return [str(a) for a in self.compute_order(stage)]

    def in_flight(self, stage: int) -> tuple[int, ...]:
        """Activations held by `stage` after each of its computes (forwards not yet backpropagated)."""
        held, out = 0, []
        for action in self.compute_order(stage):
            held += 1 if action.phase is Phase.FORWARD else -1
            out.append(held)
        return tuple(out)

    @property
    def peak_activations(self) -> tuple[int, ...]:
        """Per stage, the most microbatches whose forward has run and whose backward has not."""
        return tuple(max(self.in_flight(i), default=0) for i in range(self.n_stages))

    def peers(self, stage: int, phase: Phase) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return peers(stage, phase, self.n_stages, self.skips)

    def inputs_of(self, action: Compute) -> tuple[Payload, ...]:
        return inputs_of(action, self.n_stages, self.skips)

    def outputs_of(self, action: Compute) -> tuple[Payload, ...]:
        return outputs_of(action, self.n_stages, self.skips)

    def dependencies(self, action: Compute) -> tuple[Compute, ...]:
        return dependencies(action, self.n_stages, self.skips)

    def grid(self, mark: tuple[int, int] | None = None) -> str:
        """The step x stage grid; `mark` = (clock, stage) brackets one cell and flags its row."""
        return render_grid(self.clock_table, self.n_stages, mark=mark)

    def __str__(self) -> str:
        return f"{self.name} ({self.n_stages} stages, {self.n_microbatches} microbatches)\n{self.grid()}"

    def to_dict(self) -> dict:
        """Plain data (str/int/list/None) for msgpack or JSON, actions in compact form."""
        return {
            "schema": SCHEMA_VERSION,
            "name": self.name,
            "n_stages": self.n_stages,
            "n_microbatches": self.n_microbatches,
            "skips": [list(p) for p in self.skips],
            "streams": [[str(a) for a in stream] for stream in self.streams],
            "clock_table": [[None if a is None else str(a) for a in row] for row in self.clock_table],
        }

    @classmethod
    def from_dict(cls, data: dict) -> Schedule:
        if data.get("schema") != SCHEMA_VERSION:
            raise ValueError(f"schedule schema {data.get('schema')!r} != supported {SCHEMA_VERSION}")
        return cls(
            name=data["name"],
            n_stages=data["n_stages"],
            n_microbatches=data["n_microbatches"],
            streams=tuple(tuple(parse_action(t, i) for t in stream) for i, stream in enumerate(data["streams"])),
            clock_table=cast(  # __post_init__ checks that every cell is a Compute or None
                ClockTable,
                tuple(
                    tuple(None if t is None else parse_action(t, i) for i, t in enumerate(row))
                    for row in data["clock_table"]
                ),
            ),
            skips=tuple(tuple(p) for p in data["skips"]),
        )

    def to_msgpack(self) -> bytes:
        import msgpack

        return msgpack.packb(self.to_dict(), use_bin_type=True)

    @classmethod
    def from_msgpack(cls, blob: bytes) -> Schedule:
        import msgpack

        return cls.from_dict(msgpack.unpackb(blob, raw=False))


def _check_owned(action: object, stage: int, n_stages: int, n_microbatches: int) -> None:
    if not isinstance(action, Compute | Send | Recv):
        raise TypeError(f"stage {stage}: not an action: {action!r}")
    if action.stage != stage:
        raise ValueError(f"stage {stage}: action {action!r} belongs to stage {action.stage}")
    if action.microbatch >= n_microbatches:
        raise ValueError(
            f"stage {stage}: {action} names microbatch {action.microbatch} >= n_microbatches={n_microbatches}"
        )
    if not isinstance(action, Compute) and action.peer >= n_stages:
        raise ValueError(f"stage {stage}: {action} names stage {action.peer} >= n_stages={n_stages}")
