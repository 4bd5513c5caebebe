"""Seeded chaos over real device actors: random reshards with faults injected before and during
steps, and the runtime's failure contract checked after every step.

A ``Chaos`` run keeps a pool of device actors (``DeviceMesh.create``; killed ones are replaced by
fresh meshes), a few live tensors and a model (``chaos_model``: a few tensors of random shapes,
dtypes and layouts on a random mesh). Each step is of a random kind (``Kind``): it reshards a
tensor (a live one, or a new one) from its mesh to a random layout on a random mesh over the pool,
blocking or as a ``Work`` waited for; or it syncs the whole model from a new version on a random
mesh (``reshard(tree, ..., out=model)``, blocking or as a ``Work``). Either goes through
shared-memory pulls or through gloo only (``shared_memory=False``). Every other step carries a
fault; the faulty steps cycle through every (fault, phase, transport) combination in a seeded order:

- ``RAY_KILL`` / ``SIGKILL``: ``ray.kill`` of a device actor / SIGKILL of its process;
- ``SIGSTOP``: the process is stopped until the reshard has raised (beyond its timeout), then
  continued;
- ``ALLOC``: the actor's address space is capped (``RLIMIT_AS``, set from outside with
  ``prlimit``) just above what it maps, so the step's allocations fail; lifted afterwards the same
  way (killed, if it then does not answer: a failed allocation inside Ray can wedge it);
- ``INTERRUPT``: a real SIGINT to the driver's main thread while ``reshard`` waits.

Phases: ``BEFORE`` (the fault is in place before the step is submitted), ``DURING`` (the
victim's ``before_op`` hook tells a ``Beacon`` actor that it is mid-run and holds there; the fault
lands then) and ``COMMIT`` (model syncs only: a destination's commit hook holds at the start of its
commit, before it decides; a kill, a stop or the driver's interrupt lands then; half the faults).
Synchronisation is on events only: times are measured, never waited for.

Invariants checked after every step (each breach is a ``Violation``):
1. the call returned a complete, bit-exact tensor, or raised a ``ReshardError`` subclass naming a
   device by its number within ``timeout_s`` + 2 s (for ``INTERRUPT``: ``KeyboardInterrupt``, always); no
   call runs past a hang-catching bound; a step without a fault succeeds;
2. every live tensor (the step's source included) reads back bit-exact, or raises ``WorkerDied``
   when a device holding it died;
3. after ``reshard.runtime.settle``, no device holds a shard that no live handle owns, every live
   handle's devices hold its shard, and each shard is held by exactly its handle (``stats()``);
4. after a fault, the next reshard over the step's surviving devices succeeds on the first try
   (the same reshard again when all its devices survived; for a model sync, a sync from them):
   otherwise it counts as a livelock;
5. after a model sync, once its devices run no call: every tensor of the model on every live
   device holds one version, the same everywhere, never half of each (``TORN``): the new one when
   the call returned, the old one when its error said the outputs were left as they were, the new
   one when it said they change.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import gc
import itertools
import math
import os
import random
import re
import resource
import signal
import threading
import time
import traceback
from collections import Counter
from dataclasses import asdict, dataclass, field

import chaos_model
import numpy as np
import ray

from reshard import (
    DeviceMesh,
    Layout,
    Replicate,
    ReshardError,
    Shard,
    WorkerDied,
    distribute,
    free,
    reshard,
)
from reshard.ir.regions import layout_regions
from reshard.runtime import lowered_batch, lowered_reshard, runtime, settle
from reshard.runtime.messages import COMMIT_WAIT_S, DeviceState


class Fault(enum.Enum):
    NONE = "none"
    RAY_KILL = "ray.kill"
    SIGKILL = "SIGKILL"
    SIGSTOP = "SIGSTOP+SIGCONT"
    ALLOC = "allocation failure (RLIMIT_AS)"
    INTERRUPT = "driver KeyboardInterrupt"


class Phase(enum.Enum):
    BEFORE = "before"  # in place before the step is submitted
    DURING = "during"  # lands while the victim is mid-run (its before_op hook signalled)
    COMMIT = "commit"  # lands while a destination of a model sync holds at the start of its commit


class Kind(enum.Enum):
    TENSOR = "reshard"  # one tensor into a new one
    ASYNC = "reshard, async_op"  # the same, as a Work waited for
    SYNC = "model sync (out=)"  # the whole model written into its outputs (blocking, or as a Work; ", attached":
    # on actors of the user's attached with ``DeviceMesh.attach``)


KILLS = (Fault.RAY_KILL, Fault.SIGKILL)
COMBOS = (
    (Fault.RAY_KILL, Phase.BEFORE),
    (Fault.RAY_KILL, Phase.DURING),
    (Fault.SIGKILL, Phase.BEFORE),
    (Fault.SIGKILL, Phase.DURING),
    (Fault.SIGSTOP, Phase.BEFORE),
    (Fault.SIGSTOP, Phase.DURING),
    (Fault.ALLOC, Phase.BEFORE),
    (Fault.INTERRUPT, Phase.DURING),
    (Fault.RAY_KILL, Phase.COMMIT),
    (Fault.SIGKILL, Phase.COMMIT),
    (Fault.SIGSTOP, Phase.COMMIT),
    (Fault.INTERRUPT, Phase.COMMIT),
)
TRANSPORTS = (True, False)  # shared_memory: pulls where possible / everything through gloo

#: The timeout_s each kind of step runs with (a stopped device makes its step wait for the whole of it).
TIMEOUT_S = {
    Fault.NONE: 30.0,
    Fault.RAY_KILL: 20.0,
    Fault.SIGKILL: 20.0,
    Fault.SIGSTOP: 2.0,
    Fault.ALLOC: 10.0,
    Fault.INTERRUPT: 20.0,
}
DEVICE_NAMED = r"devices?(\(s\))? \[?\d"  # an error names a device by its number ("device 3", "device(s) [2]")
HANG_S = 30.0  # a call still running this long after its timeout is a hang (whatever it ended with)
TARGET_S = 2.0  # a failed call raises within its timeout plus this (the documented promise: asserted)
PROBE_TIMEOUT_S = 60.0
SLOW_PROBE_S = 1.0  # a retry slower than this is noted with what the devices did (``Chaos.slow``)
OLD, NEW = chaos_model.OLD, chaos_model.NEW
MODEL_SYNCS = 6  # a model serves this many syncs, then the next is built (shapes, layouts, mesh: new)
HOLD_S = 120.0  # how long a victim's hook holds when nobody releases it
ALLOC_MARGIN_BYTES = 1 << 20  # address space left to a capped actor above what it maps: Ray's own buffers fit
ALLOC_MIN_BYTES = 16 << 20  # an ALLOC step moves a tensor this big at least (>= 4 MiB per device: it cannot fit)
DTYPES = ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int8", "uint8", "bool")
ITEMSIZE = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}


def gone(actor) -> None:
    """Return once Ray says ``actor`` (any Ray actor) is dead: ``ray.kill`` is asynchronous, and a
    fault "before" a step must be in place when the step starts (else a fast step can finish first)."""
    until = time.monotonic() + PROBE_TIMEOUT_S
    while time.monotonic() < until:
        try:
            ray.get(actor.__ray_call__.remote(_answer), timeout=PROBE_TIMEOUT_S)
        except ray.exceptions.RayActorError:
            return
    raise AssertionError(f"ray.kill: the actor still answered after {PROBE_TIMEOUT_S:g} s")


def _answer(actor_self) -> None:
    return None


# ------------------------------------------------------------------------------------------ events


class Beacon:
    """Named one-shot events shared by the driver and the actors (an async Ray actor)."""

    def __init__(self):
        self.events: dict[str, asyncio.Event] = {}

    def _event(self, name: str) -> asyncio.Event:
        return self.events.setdefault(name, asyncio.Event())

    async def set(self, name: str) -> None:
        self._event(name).set()

    async def wait(self, names: list[str], timeout_s: float) -> str | None:
        """The first of ``names`` to be set (None: none within ``timeout_s``)."""
        waits = {asyncio.ensure_future(self._event(n).wait()): n for n in names}
        done, pending = await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        for p in pending:
            p.cancel()
        return next((waits[d] for d in done), None)

    async def forget(self, prefix: str) -> None:
        for name in [n for n in self.events if n.startswith(prefix)]:
            del self.events[name]


# --------------------------------------------------------------------- functions run in the actors


def _arm(ctx, beacon, tag: str, skip: int) -> None:
    """Hold the run at op number ``skip`` (counting from 0): say "arrived", wait for "go"."""
    count = itertools.count()

    def hook(run, op):
        if next(count) != skip:
            return
        ctx.before_op = None
        ray.get(beacon.set.remote(f"{tag}/arrived"))
        ray.get(beacon.wait.remote([f"{tag}/go"], HOLD_S))

    ctx.before_op = hook


def _arm_commit(ctx, beacon, tag: str) -> None:
    """Hold the next commit at its start, before it decides: say "arrived", wait for "go"."""

    def hook(stage, run):
        if stage != "before":
            return
        ctx.commit_hook = None
        ray.get(beacon.set.remote(f"{tag}/arrived"))
        ray.get(beacon.wait.remote([f"{tag}/go"], HOLD_S))

    ctx.commit_hook = hook


def _disarm(ctx) -> None:
    ctx.before_op = None
    ctx.commit_hook = None


def _trimmed_mapping(ctx) -> int:
    """The bytes this process maps, after handing the allocator's free memory back (else a new shard
    could still come out of the heap once the cap is set)."""
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def _on_device(actor_self, fn):
    """``fn(ctx)`` on a device actor outside its callers' order (through ``__ray_call__``)."""
    from reshard.runtime import device_of

    return fn(device_of(actor_self))


@ray.remote(num_cpus=0)
class _Inference:
    """A user's inference worker: a plain Ray actor, attached as a device as it is."""


def _pid(ctx) -> int:
    return os.getpid()


# ------------------------------------------------------------------------------------------ records


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One step: what was injected, what the call did and how long it took."""

    index: int
    fault: str
    phase: str | None
    shared_memory: bool
    victim_took_part: bool | None
    outcome: str  # "ok", or the exception's class name
    seconds: float  # from the call to its return or exception
    timeout_s: float
    message: str
    probe_s: float | None  # the first reshard after the fault (invariant 4)
    interrupt_to_raise_s: float | None  # INTERRUPT: from the SIGINT to the exception
    nbytes: int
    dtype: str
    died: tuple[int, ...]
    step_s: float  # the whole step: replacing dead devices, the call, the fault, every check
    kind: str = Kind.TENSOR.value

    @property
    def failed(self) -> bool:
        return self.outcome != "ok"


@dataclass(frozen=True, slots=True)
class Violation:
    step: int
    invariant: str
    detail: str


@dataclass
class FaultAt:
    """A step's fault: where it lands, on whom, and what came of it (``landed``: when, whether it killed)."""

    fault: Fault
    phase: Phase | None
    victim: int | None
    tag: str
    killed: bool = False
    injector: threading.Thread | None = None
    landed: dict = field(default_factory=dict)


@dataclass
class Held:
    """A live tensor handle and the bits it must read back as (bfloat16 as int16)."""

    tensor: object
    expected: np.ndarray


# ------------------------------------------------------------------------------------------ helpers


def random_array(rng: np.random.Generator, shape: tuple[int, ...], dtype: str):
    """(what to distribute, its expected bits as numpy): random bit patterns, NaNs included."""
    n = math.prod(shape)
    if dtype == "bool":
        arr = rng.integers(0, 2, size=shape).astype(bool)
        return arr, arr
    wire = "int16" if dtype == "bfloat16" else dtype
    arr = np.frombuffer(rng.bytes(n * ITEMSIZE[dtype]), dtype=np.uint8).view(wire).reshape(shape).copy()
    if dtype == "bfloat16":
        import torch

        return torch.from_numpy(arr).view(torch.bfloat16), arr
    return arr, arr


def read_bits(tensor, timeout_s: float) -> np.ndarray:
    """The tensor read back, as numpy (bfloat16 as its int16 bit pattern)."""
    if tensor.dtype_name == "bfloat16":
        import torch

        return tensor.to_torch(timeout_s=timeout_s).view(torch.int16).numpy()
    return tensor.to_numpy(timeout_s=timeout_s)


def same_bits(got: np.ndarray, expected: np.ndarray) -> bool:
    if tuple(got.shape) != tuple(expected.shape) or got.dtype != expected.dtype:
        return False
    return np.array_equal(np.ascontiguousarray(got).view(np.uint8), np.ascontiguousarray(expected).view(np.uint8))


def percentile(values, q: float) -> float | None:
    return None if not values else float(np.percentile(np.asarray(values, dtype=float), q))


def first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:400]


# ------------------------------------------------------------------------------------------ the run


class Chaos:
    """A seeded chaos run over a pool of ``pool_size`` device actors (module docstring)."""

    def __init__(
        self, seed: int, *, pool_size: int = 6, min_live: int = 4, max_tensors: int = 3, max_bytes: int = 4 << 20
    ):
        self.seed = seed
        self.rng = random.Random(seed)
        self.data_rng = np.random.default_rng(seed)
        self.pool_size, self.min_live, self.max_tensors, self.max_bytes = pool_size, min_live, max_tensors, max_bytes
        self.pids: dict[int, int] = {}  # live devices -> actor process id
        self.caps: dict[int, tuple[int, int]] = {}  # ALLOC victims -> their address-space limits before the cap
        self.actors: dict[int, object] = {}  # live devices -> their Ray actor
        self.callers: dict[int, object] = {}  # live devices -> what takes the runtime's calls (attached: a proxy)
        self.attached: set[int] = set()  # devices that are the user's own actors, attached (``_inference_mesh``)
        self.inference: list = []  # those actors, for the end
        self.owners: list[DeviceMesh] = []
        self.views: dict[tuple, DeviceMesh] = {}
        self.retired: list[DeviceMesh] = []  # views over dead devices
        self.held: list[Held] = []
        self.model: chaos_model.Model | None = None  # what model syncs write into (built by the first)
        self.models_built = 0
        self.records: list[StepRecord] = []
        self.violations: list[Violation] = []
        self.deaths: list[tuple[int, int, str]] = []  # (step, device, why)
        self.slow: list[dict] = []  # retries slower than SLOW_PROBE_S, with the devices' recent calls
        self.devices_started = 0
        self.replacements = 0
        self.beacon = ray.remote(num_cpus=0)(Beacon).remote()
        self._main = threading.main_thread().ident
        # A process started in the background of a shell inherits SIGINT ignored, and Python then
        # raises no KeyboardInterrupt for it: the INTERRUPT fault must reach the driver all the same.
        self._sigint = signal.signal(signal.SIGINT, signal.default_int_handler)
        self._replenish()

    # ------------------------------------------------------------------ pool

    def _pool(self) -> list[int]:
        """The live devices of the pool (``DeviceMesh.create``'s; attached actors hold models only)."""
        return sorted(d for d in self.pids if d not in self.attached)

    def _replenish(self) -> None:
        live = len(self._pool())
        missing = self.pool_size - live
        if live >= self.min_live and self.owners:
            return
        mesh = DeviceMesh.create((missing,), backend="gloo", startup_timeout_s=300)
        self.replacements += bool(self.owners)
        self.owners.append(mesh)
        self.devices_started += missing
        for d, pid in zip(mesh.device_ids, mesh.call(_pid), strict=True):
            self.pids[d] = pid
            self.actors[d] = self.callers[d] = mesh.actor(mesh.index_of(d))

    def _inference_mesh(self) -> DeviceMesh:
        """Two plain Ray actors of the user's (single-threaded, a class that knows nothing of the
        library) attached as a mesh (``DeviceMesh.attach``), as inference workers are."""
        actors = [_Inference.remote() for _ in range(2)]
        self.inference += actors
        mesh = DeviceMesh.attach(actors, (2,), startup_timeout_s=300)
        self.owners.append(mesh)
        for d, actor, pid in zip(mesh.device_ids, actors, mesh.call(_pid), strict=True):
            self.pids[d], self.actors[d], self.callers[d] = pid, actor, mesh.actor(mesh.index_of(d))
            self.attached.add(d)
        return mesh

    def _view(self, devices, shape=None) -> DeviceMesh:
        devices = tuple(devices)
        shape = (len(devices),) if shape is None else tuple(shape)
        key = (devices, shape)
        v = self.views.get(key)
        if v is None:
            v = self.views[key] = DeviceMesh.from_devices(devices, shape)
        return v

    def _bury(self, device: int, step: int, why: str) -> None:
        """``device`` is dead: forget it and the views over it."""
        if self.pids.pop(device, None) is None:
            return
        self.actors.pop(device, None)
        self.callers.pop(device, None)
        self.caps.pop(device, None)
        self.attached.discard(device)
        self.deaths.append((step, device, why))
        for key in [k for k in self.views if device in k[0]]:
            self.retired.append(self.views.pop(key))  # tensors on it must still say WorkerDied

    def _known_dead(self) -> list[int]:
        reg = runtime().registry.devices
        return [d for d in self.pids if reg[d].state is DeviceState.DEAD]

    # ------------------------------------------------------------------ random choices

    def _random_shape(self, nbytes_min: int = 1) -> tuple[tuple[int, ...], str]:
        rng = self.rng
        dtype = rng.choice(DTYPES)
        max_el = max(self.max_bytes, 2 * nbytes_min) // ITEMSIZE[dtype]
        lo = max(1, nbytes_min // ITEMSIZE[dtype])
        total = int(2 ** rng.uniform(math.log2(lo), math.log2(max(lo, max_el))))
        ndim = rng.randint(1, 3)
        dims = []
        for k in range(ndim - 1):
            d = rng.randint(1, max(1, int(total ** (1 / (ndim - k))) * 2))
            dims.append(d)
            total = max(1, total // d)
        dims.append(total)
        rng.shuffle(dims)
        return tuple(dims), dtype

    def _random_mesh(self, pool) -> DeviceMesh:
        rng = self.rng
        n = rng.randint(1, min(4, len(pool)))
        devices = rng.sample(sorted(pool), n)
        shape = (n,)
        if n == 4 and rng.random() < 0.5:
            shape = (2, 2)
        elif n in (2, 3) and rng.random() < 0.25:
            shape = (1, n)
        return self._view(devices, shape)

    def _random_layout(self, mesh: DeviceMesh, ndim: int) -> Layout:
        rng = self.rng
        return Layout(
            mesh, tuple(Replicate() if rng.random() < 0.35 else Shard(rng.randrange(ndim)) for _ in mesh.shape)
        )

    def _new_tensor(self, pool, nbytes_min: int = 1) -> Held:
        shape, dtype = self._random_shape(nbytes_min)
        data, expected = random_array(self.data_rng, shape, dtype)
        mesh = self._random_mesh(pool)
        t = distribute(data, self._random_layout(mesh, len(shape)), timeout_s=PROBE_TIMEOUT_S)
        held = Held(t, expected)
        self.held.append(held)
        return held

    # ------------------------------------------------------------------ schedule

    def schedule(self, steps: int):
        """``(kind, fault, phase, shared_memory)`` per step: a fault every other step, cycling
        through every combination in a seeded order, those at commit time twice per cycle (half
        the faults); a commit-time fault is a model sync's, other steps are of any kind."""
        combos = [(f, p, s) for f, p in COMBOS for s in TRANSPORTS for _ in range(1 + (p is Phase.COMMIT))]
        faulty: list = []
        out = []
        for i in range(steps):
            if i % 2 == 0:
                out.append((self.rng.choice(list(Kind)), Fault.NONE, None, self.rng.choice(TRANSPORTS)))
                continue
            if not faulty:
                faulty = list(combos)
                self.rng.shuffle(faulty)
            fault, phase, shared = faulty.pop()
            out.append((Kind.SYNC if phase is Phase.COMMIT else self.rng.choice(list(Kind)), fault, phase, shared))
        return out

    def run(self, steps: int, progress=None) -> None:
        """``steps`` steps; one that raises (a harness error, not a violation) says which step it
        was and what the steps before it did (a CI log shows no progress)."""
        for i, (kind, fault, phase, shared) in enumerate(self.schedule(steps)):
            try:
                if kind is Kind.SYNC:
                    self.sync_step(i, fault, phase, shared)
                else:
                    self.step(i, kind, fault, phase, shared)
            except Exception as e:
                what = f"{fault.value} {phase.value if phase else ''} {'pull' if shared else 'gloo'}"
                e.add_note(f"chaos step {i} of seed {self.seed}: {kind.value}: {what}")
                for r in self.records[-3:]:
                    e.add_note(
                        f"  step {r.index}: {r.kind}: {r.fault} {r.phase or ''} -> {r.outcome}: {r.message[:200]}"
                    )
                raise
            if progress is not None:
                progress(i, self.records[-1])

    # ------------------------------------------------------------------ one step

    def step(self, i: int, kind: Kind, fault: Fault, phase: Phase | None, shared: bool) -> None:
        """One tensor resharded into a new one (``async_op`` for ``Kind.ASYNC``)."""
        began = time.monotonic()
        rng = self.rng
        self._replenish()
        pool = self._pool()
        fresh = fault is Fault.ALLOC or not self.held or rng.random() < 0.5
        src = self._new_tensor(pool, ALLOC_MIN_BYTES if fault is Fault.ALLOC else 1) if fresh else rng.choice(self.held)
        t = src.tensor
        dst_layout = self._random_layout(self._random_mesh(pool), t.ndim)
        compiled = lowered_reshard(t, dst_layout, shared_memory=shared)
        step_devices = sorted(set(t.mesh.device_ids) | set(dst_layout.mesh.device_ids))
        victim = self._victim(fault, phase, compiled, pool)
        if victim is None:
            fault, phase = Fault.NONE, None
        timeout_s = TIMEOUT_S[fault]
        fault_at = self._fault_at(
            i, fault, phase, victim, self._hold_at(compiled, victim) if phase is Phase.DURING else 0
        )

        result, error, seconds, raised_at = self._call(
            i,
            fault_at,
            kind is Kind.ASYNC,
            timeout_s,
            functools.partial(reshard, t, t.mesh, dst_layout, timeout_s=timeout_s, shared_memory=shared),
        )

        outcome = "ok" if error is None else type(error).__name__
        message = "" if error is None else first_line(error)
        nbytes, dtype = t.size_bytes, t.dtype_name
        self._check_call(i, fault, result, error, src, seconds, timeout_s)
        if result is not None:
            self._keep_or_drop(result, src.expected)
        del result, error, t  # only ``self.held`` may keep handles alive (invariant 3)
        self._check_tensors(i)
        probe_s = None
        if fault is not Fault.NONE:
            probe_s = self._probe(i, src, dst_layout, step_devices, shared)
        self._check_leaks(i)
        self._record(
            i,
            kind.value,
            fault_at,
            shared,
            victim is not None and victim in compiled.participants,
            outcome,
            seconds,
            timeout_s,
            message,
            probe_s,
            raised_at,
            nbytes,
            dtype,
            began,
        )

    def sync_step(self, i: int, fault: Fault, phase: Phase | None, shared: bool) -> None:
        """The model synced whole from a new version on a random mesh (``reshard(..., out=)``,
        blocking or ``async_op``); invariant 5 after it."""
        began = time.monotonic()
        rng = self.rng
        self._replenish()
        pool = self._pool()
        model = self._model()
        attached = set(model.devices) <= self.attached  # a model in the user's own actors
        shapes = model.shapes()
        src_mesh = self._random_mesh(pool)
        src_layouts = chaos_model.random_layouts(rng, src_mesh, shapes)
        new = chaos_model.new_data(self.data_rng, shapes)
        src = distribute(new, lambda path, t: src_layouts[path], timeout_s=PROBE_TIMEOUT_S)
        layouts = {k: v.layout for k, v in model.outs.items()}
        compiled = lowered_batch(src, src_mesh, lambda path, t: layouts[path], shared_memory=shared)
        step_devices = sorted(set(src_mesh.device_ids) | set(model.devices))
        victim = self._sync_victim(fault, phase, compiled, model, pool)
        if victim is None:
            fault, phase = Fault.NONE, None
        timeout_s = TIMEOUT_S[fault]
        fault_at = self._fault_at(i, fault, phase, victim, 0)
        as_work = rng.random() < 0.5

        _, error, seconds, raised_at = self._call(
            i,
            fault_at,
            as_work,
            timeout_s,
            functools.partial(
                reshard,
                src,
                src_mesh,
                lambda path, t: layouts[path],
                out=model.outs,
                timeout_s=timeout_s,
                shared_memory=shared,
            ),
        )
        self._check_raised(i, fault, error, seconds, timeout_s)
        self._quiet(i, step_devices, timeout_s)
        self._check_versions(i, fault, error, new)
        outcome = "ok" if error is None else type(error).__name__
        message = "" if error is None else first_line(error)
        del error
        try:
            free(src)
        except ReshardError:  # its Ray session's view of dead devices: nothing left to free
            pass
        del src
        self._drop_broken_model()
        self._check_tensors(i)
        probe_s = None
        if fault is not Fault.NONE:
            probe_s = self._probe_sync(i, step_devices, shared)
        self._check_leaks(i)
        nbytes = sum(a.nbytes for a in new.values())
        kind = Kind.SYNC.value + (", async_op" if as_work else "") + (", attached" if attached else "")
        self._record(
            i,
            kind,
            fault_at,
            shared,
            victim is not None and victim in compiled.participants,
            outcome,
            seconds,
            timeout_s,
            message,
            probe_s,
            raised_at,
            nbytes,
            "tree",
            began,
        )

    def _call(self, i: int, at: FaultAt, as_work: bool, timeout_s: float, call) -> tuple:
        """``call(async_op=...)`` (the step's reshard; as a ``Work`` waited for when ``as_work``),
        timed, then its fault dealt with (``_after_fault``). A work interrupted while waited for
        goes on: it is let end, and dropped with what it made (only ``self.held`` keeps handles,
        invariant 3). Returns ``(result, error, seconds, when it returned or raised)``."""
        result = error = work = None
        t0 = time.monotonic()
        try:
            if as_work:
                work = call(async_op=True)
                result = work.wait()
            else:
                result = call(async_op=False)
        except BaseException as e:  # KeyboardInterrupt included: that is the INTERRUPT fault
            error = e
        raised_at = time.monotonic()
        self._after_fault(i, at)
        if work is not None and error is not None:
            work.exception(timeout_s + HANG_S)
        return result, error, raised_at - t0, raised_at

    # ------------------------------------------------------------------ faults

    def _fault_at(self, i: int, fault: Fault, phase: Phase | None, victim: int | None, hold_at: int) -> FaultAt:
        """Put ``fault`` in place (``BEFORE``), or arm the victim to hold where it lands (its op
        ``hold_at`` for ``DURING``, the start of its commit for ``COMMIT``) with a thread that
        injects it once the victim says it holds."""
        at = FaultAt(fault, phase, victim, f"step{i}")
        if fault is Fault.NONE:
            return at
        if phase is Phase.BEFORE:
            at.killed = self._inject(fault, victim, at.landed)
            if fault is Fault.RAY_KILL:
                gone(self.actors[victim])
            return at
        if phase is Phase.DURING:
            self._view([victim]).call(_arm, self.beacon, at.tag, hold_at)
        else:
            self._view([victim]).call(_arm_commit, self.beacon, at.tag)
        at.injector = threading.Thread(
            target=self._inject_on_arrival, args=(fault, victim, at.tag, at.landed), name="chaos-injector", daemon=True
        )
        at.injector.start()
        return at

    def _after_fault(self, i: int, at: FaultAt) -> None:
        """Once the call returned or raised: the injector joined, a stopped victim continued, a
        held one let go, a killed one buried, a capped or armed one restored."""
        fault, victim = at.fault, at.victim
        if at.injector is not None:
            self.beacon.set.remote(f"{at.tag}/done")
            at.injector.join(HOLD_S + 60)
            if at.injector.is_alive():
                self._violate(i, "harness", "the fault injector did not finish")
            at.killed = at.landed.get("killed", False)
        if fault is Fault.SIGSTOP:
            os.kill(self.pids[victim], signal.SIGCONT)
        if at.phase in (Phase.DURING, Phase.COMMIT):
            ray.get(self.beacon.set.remote(f"{at.tag}/go"))
        if at.killed:
            self._bury(victim, i, fault.value)
        elif fault is Fault.ALLOC or at.phase in (Phase.DURING, Phase.COMMIT):
            self._restore(i, victim, fault)
        for d in self._known_dead():
            self._bury(d, i, "died (noticed by the runtime)")

    def _record(
        self,
        i,
        kind,
        at: FaultAt,
        shared,
        took_part,
        outcome,
        seconds,
        timeout_s,
        message,
        probe_s,
        raised_at,
        nbytes,
        dtype,
        began,
    ) -> None:
        ray.get(self.beacon.forget.remote(at.tag))
        landed = at.landed.get("at")
        interrupt_s = raised_at - landed if at.fault is Fault.INTERRUPT and landed is not None else None
        self.records.append(
            StepRecord(
                i,
                at.fault.value,
                None if at.phase is None else at.phase.value,
                shared,
                took_part if at.victim is not None else None,
                outcome,
                round(seconds, 4),
                timeout_s,
                message,
                probe_s,
                None if interrupt_s is None else round(interrupt_s, 4),
                nbytes,
                dtype,
                tuple(d for s, d, _ in self.deaths if s == i),
                round(time.monotonic() - began, 3),
                kind,
            )
        )

    def _victim(self, fault: Fault, phase: Phase | None, compiled, pool) -> int | None:
        rng = self.rng
        if fault is Fault.NONE:
            return None
        busy = [d for d in compiled.participants if _parts(compiled, d)[0]]
        if phase is Phase.DURING:
            return rng.choice(busy) if busy else None
        if fault is Fault.ALLOC:  # the participant that allocates the most
            if not compiled.participants:
                return None
            return max(compiled.participants, key=lambda d: _parts(compiled, d)[1])
        bystanders = [d for d in pool if d not in compiled.participants]
        if bystanders and rng.random() < 0.2:
            return rng.choice(bystanders)
        return rng.choice(list(compiled.participants)) if compiled.participants else None

    @staticmethod
    def _hold_at(compiled, victim: int) -> int:
        """Which op the victim holds at: its first communication if it has one, else its first op."""
        ops = compiled.program.for_device(victim).all_ops
        kinds = [type(op).__name__ for op in ops]
        comm = [k for k, name in enumerate(kinds) if name in ("Send", "Recv", "Broadcast")]
        return comm[0] if comm else 0

    def _inject(self, fault: Fault, victim: int, landed: dict) -> bool:
        """Apply ``fault`` to ``victim`` now; True when it kills the victim."""
        landed["at"] = time.monotonic()
        if fault is Fault.RAY_KILL:
            ray.kill(self.actors[victim], no_restart=True)
            return True
        if fault is Fault.SIGKILL:
            os.kill(self.pids[victim], signal.SIGKILL)
            return True
        if fault is Fault.SIGSTOP:
            os.kill(self.pids[victim], signal.SIGSTOP)
            return False
        if fault is Fault.ALLOC:  # set from outside: lifting it then needs nothing of the capped actor
            mapped = self._view([victim]).call(_trimmed_mapping)[0]
            pid = self.pids[victim]
            limits = self.caps[victim] = resource.prlimit(pid, resource.RLIMIT_AS)
            resource.prlimit(pid, resource.RLIMIT_AS, (mapped + ALLOC_MARGIN_BYTES, limits[1]))
            return False
        if fault is Fault.INTERRUPT:
            signal.pthread_kill(self._main, signal.SIGINT)
            return False
        raise AssertionError(fault)

    def _inject_on_arrival(self, fault: Fault, victim: int, tag: str, landed: dict) -> None:
        got = ray.get(self.beacon.wait.remote([f"{tag}/arrived", f"{tag}/done"], HOLD_S), timeout=HOLD_S + 30)
        if got == f"{tag}/arrived":
            landed["killed"] = self._inject(fault, victim, landed)

    def _restore(self, i: int, victim: int, fault: Fault) -> None:
        """Lift the cap / disarm the hook on a victim that lives on. An ALLOC victim may not: it may
        have died, or a failed allocation inside Ray may have left it unable to answer; once its cap
        is lifted, one that does not answer is killed and buried."""
        if fault is Fault.ALLOC:
            try:
                resource.prlimit(self.pids[victim], resource.RLIMIT_AS, self.caps.pop(victim))
            except ProcessLookupError:
                self._bury(victim, i, f"{fault.value}: its process is gone")
                return
        call = (_answer,) if fault is Fault.ALLOC else (_on_device, _disarm)
        try:  # out of the call order: a failed sync's commit may wait ahead for the runs' outcomes
            ray.get(self.actors[victim].__ray_call__.remote(*call), timeout=PROBE_TIMEOUT_S)
        except (ray.exceptions.RayActorError, WorkerDied) as e:
            if fault is not Fault.ALLOC:
                self._violate(i, "no unexpected deaths", f"device {victim} died: {first_line(e)}")
            self._bury(victim, i, f"{fault.value}: {first_line(e)}")
        except ray.exceptions.GetTimeoutError:
            if fault is not Fault.ALLOC:
                raise
            os.kill(self.pids[victim], signal.SIGKILL)
            self._bury(victim, i, f"{fault.value}: no answer {PROBE_TIMEOUT_S:g} s after its cap was lifted")

    def _sync_victim(self, fault: Fault, phase: Phase | None, compiled, model, pool) -> int | None:
        """``_victim``'s choice for a model sync; at ``COMMIT``, a destination that writes an output."""
        if phase is not Phase.COMMIT:
            return self._victim(fault, phase, compiled, pool)
        writers = [
            d
            for d in model.devices
            if any(
                math.prod(hi - lo for lo, hi in box)
                for t in model.outs.values()
                for box in [layout_regions(t.layout, t.shape)[model.devices.index(d)]]
            )
        ]
        return self.rng.choice(writers) if writers else None

    def _quiet(self, i: int, devices, timeout_s: float) -> None:
        """Until the live ``devices`` run and wait for no call: a failed sync's commits may still be
        deciding (a destination learns every run's outcome, up to ``COMMIT_WAIT_S`` past the deadline)."""
        until = time.monotonic() + timeout_s + COMMIT_WAIT_S + HANG_S
        while time.monotonic() < until:
            live = [d for d in devices if d in self.pids]
            if not live:
                return
            try:
                stats = self._view(live).stats(timeout_s=PROBE_TIMEOUT_S)
            except WorkerDied:
                for d in self._known_dead():
                    self._bury(d, i, "died (noticed by the runtime)")
                continue
            if not any(s["calls"]["running"] or s["calls"]["waiting"] for s in stats):
                return
            ray.get(self.beacon.wait.remote([f"step{i}/never"], 0.05))  # a pause between looks
        self._violate(i, "1: bounded", f"devices {devices} still busy {timeout_s + COMMIT_WAIT_S + HANG_S:g}s on")

    def _check_versions(self, i: int, fault: Fault, error, new: dict) -> None:
        """Invariant 5: every output on every live device holds one version, the same for every
        tensor, the new one when the call returned, the old one when its error said so."""
        model = self.model
        alive = {d: self.callers[d] for d in model.devices if d in self.pids}
        try:
            seen = model.versions(alive, new, PROBE_TIMEOUT_S)
        except Exception as e:
            self._violate(i, "5: outputs readable", first_line(e))
            self._drop_broken_model(always=True)
            return
        found = set(seen.values()) - {chaos_model.SAME}
        told = "" if error is None else str(error)
        if chaos_model.TORN in found:
            torn = sorted(k for k, v in seen.items() if v == chaos_model.TORN)
            self._violate(i, "5: all old or all new", f"{fault.value}: torn outputs {torn}")
        elif len(found) > 1:
            self._violate(i, "5: one version everywhere", f"{fault.value}: {sorted(seen.items())}")
        elif error is None and found - {NEW}:
            self._violate(i, "5: as the caller was told", "the sync returned, the outputs are old")
        elif found == {NEW} and "left as they were" in told:
            self._violate(i, "5: as the caller was told", f"the outputs changed: {first_line(error)}")
        elif found == {OLD} and "so the outputs change" in told:
            self._violate(i, "5: as the caller was told", f"the outputs kept their old values: {first_line(error)}")
        if len(found) > 1:
            self._drop_broken_model(always=True)  # a violation: the next sync starts afresh
        elif found == {NEW}:
            model.expected = new

    def _model(self) -> chaos_model.Model:
        """The model; a new one when there is none or the last served ``MODEL_SYNCS`` syncs, in
        turn on a random mesh of the pool and on attached actors of the user's."""
        if self.model is not None and self.model.syncs >= MODEL_SYNCS:
            self._drop_broken_model(always=True)
        if self.model is None:
            self._replenish()
            self.models_built += 1
            on = self._inference_mesh() if self.models_built % 2 == 0 else self._random_mesh(self._pool())
            self.model = chaos_model.build(self.rng, self.data_rng, on, PROBE_TIMEOUT_S)
        self.model.syncs += 1
        return self.model

    def _drop_broken_model(self, always: bool = False) -> None:
        """Free the model when one of its devices died (or ``always``: its outputs broke); the next
        model sync builds another."""
        if self.model is not None and (always or any(d not in self.pids for d in self.model.devices)):
            self.model.free()
            self.model = None

    def _probe_sync(self, i: int, step_devices, shared: bool) -> float | None:
        """Invariant 4 for a model sync: the next sync, from the step's survivors, lands first time."""
        survivors = [d for d in step_devices if d in self.pids]
        if not survivors:
            return None
        model = self._model()
        new = chaos_model.new_data(self.data_rng, model.shapes())
        src_mesh = self._view(survivors)
        layouts = {k: v.layout for k, v in model.outs.items()}
        t0 = time.monotonic()
        src = None
        try:
            src = distribute(new, Layout(src_mesh, (Replicate(),)), timeout_s=PROBE_TIMEOUT_S)
            reshard(
                src,
                src_mesh,
                lambda path, t: layouts[path],
                out=model.outs,
                timeout_s=PROBE_TIMEOUT_S,
                shared_memory=shared,
            )
            seconds = time.monotonic() - t0
        except Exception as e:
            self._violate(i, "4: first retry succeeds (livelock)", first_line(e))
            return None
        finally:
            if src is not None:
                free(src)
        self._check_versions(i, Fault.NONE, None, new)
        return round(seconds, 4)

    # ------------------------------------------------------------------ invariants

    def _violate(self, i: int, invariant: str, detail: str) -> None:
        self.violations.append(Violation(i, invariant, detail))

    def _check_call(self, i, fault, result, error, src: Held, seconds: float, timeout_s: float) -> None:
        """Invariant 1."""
        self._check_raised(i, fault, error, seconds, timeout_s)
        if error is not None:
            return
        try:
            got = read_bits(result, PROBE_TIMEOUT_S)
        except Exception as e:
            self._violate(i, "1: complete result", f"reading the result failed: {first_line(e)}")
            return
        if not same_bits(got, src.expected):
            self._violate(i, "1: bit-exact", f"{fault.value}: the result differs from the source")

    def _check_raised(self, i, fault, error, seconds: float, timeout_s: float) -> None:
        """Invariant 1, but for the result: bounded, and a failure raised as promised."""
        if seconds > timeout_s + HANG_S:
            self._violate(i, "1: bounded", f"the call took {seconds:.1f}s with timeout_s={timeout_s:g}")
        if error is not None:
            allowed = (ReshardError, KeyboardInterrupt) if fault is Fault.INTERRUPT else ReshardError
            if not isinstance(error, allowed):
                where = "".join(traceback.format_exception(error)[-6:])  # where it came from, for the report
                self._violate(i, "1: ReshardError", f"{fault.value}: raised {first_line(error)}\n{where}")
            elif isinstance(error, ReshardError) and not re.search(DEVICE_NAMED, str(error)):
                self._violate(i, "1: names a device", f"{fault.value}: {first_line(error)}")
            if isinstance(error, ReshardError) and seconds > timeout_s + TARGET_S:
                self._violate(
                    i,
                    "1: within timeout_s + 2 s",
                    f"{fault.value}: raised after {seconds:.2f}s, timeout_s={timeout_s:g}: {first_line(error)}",
                )
            if fault is Fault.NONE:
                self._violate(i, "1: clean steps succeed", first_line(error))
            if fault is Fault.INTERRUPT and not isinstance(error, KeyboardInterrupt):
                self._violate(i, "1: an interrupt raises KeyboardInterrupt", f"it raised {first_line(error)}")

    def _keep_or_drop(self, result, expected: np.ndarray) -> None:
        held = Held(result, expected)
        if self.rng.random() < 0.5:
            self.held.append(held)
        else:
            self._drop(held)
        while len(self.held) > self.max_tensors:
            self._drop(self.held.pop(0))

    def _drop(self, held: Held) -> None:
        """``free()`` it, or let it go to the garbage collector (its release goes out asynchronously)."""
        if self.rng.random() < 0.5 and not held.tensor.freed:
            try:
                held.tensor.free()
            except ReshardError:  # its Ray session is gone: nothing to free
                pass
        held.tensor = None

    def _check_tensors(self, i: int) -> None:
        """Invariant 2."""
        keep = []
        for held in self.held:
            t = held.tensor
            intact = all(d in self.pids for d in t.mesh.device_ids)
            try:
                got = read_bits(t, PROBE_TIMEOUT_S)
            except WorkerDied as e:
                if intact:
                    self._violate(i, "2: source intact", f"WorkerDied with every device alive: {first_line(e)}")
                held.tensor = None
                continue
            except Exception as e:
                self._violate(i, "2: source intact", f"reading {t!r} raised {first_line(e)}")
                held.tensor = None
                continue
            if not same_bits(got, held.expected):
                self._violate(i, "2: source intact", f"{t!r} reads back different bits")
            if intact:
                keep.append(held)
            else:  # a holder died but the regions read came from survivors: the tensor is broken all the same
                held.tensor = None
        self.held = keep

    def _probe(self, i: int, src: Held, dst_layout: Layout, step_devices, shared: bool) -> float | None:
        """Invariant 4: the step again when all its devices live, else a reshard over its survivors."""
        survivors = [d for d in step_devices if d in self.pids]
        if not survivors:
            return None
        t0 = time.monotonic()
        made = []
        try:
            if src.tensor is not None and all(d in self.pids for d in step_devices):
                y = reshard(src.tensor, src.tensor.mesh, dst_layout, timeout_s=PROBE_TIMEOUT_S, shared_memory=shared)
                expected = src.expected
            else:
                self.rng.shuffle(survivors)
                data, expected = random_array(self.data_rng, (len(survivors) * 3, 5), "float32")
                a = self._view(survivors)
                b = self._view(survivors[::-1])
                x = distribute(data, Layout(a, (Shard(0),)), timeout_s=PROBE_TIMEOUT_S)
                made.append(x)
                y = reshard(x, a, Layout(b, (Shard(1),)), timeout_s=PROBE_TIMEOUT_S, shared_memory=shared)
            made.append(y)
            seconds = time.monotonic() - t0
            if seconds > SLOW_PROBE_S:
                self._note_slow(i, survivors, seconds)
            if not same_bits(read_bits(y, PROBE_TIMEOUT_S), expected):
                self._violate(i, "4: first retry succeeds", "the retry's result differs from its source")
            return round(seconds, 4)
        except Exception as e:
            self._violate(i, "4: first retry succeeds (livelock)", first_line(e))
            return None
        finally:
            for x in made:
                x.free()

    def _note_slow(self, i: int, devices, seconds: float) -> None:
        """What the devices did last, for a retry that took long (diagnostics, not an invariant)."""
        stats = self._view(sorted(devices)).stats(timeout_s=PROBE_TIMEOUT_S)
        self.slow.append(
            {"step": i, "probe_s": round(seconds, 3), "recent": {s["device"]: s["calls"]["recent"][-4:] for s in stats}}
        )

    def _check_leaks(self, i: int) -> None:
        """Invariant 3."""
        self._drop_broken_model()
        gc.collect()
        everyone = self._view(sorted(self.pids))
        try:
            settle(everyone, timeout_s=PROBE_TIMEOUT_S)
            stats = everyone.stats(timeout_s=PROBE_TIMEOUT_S)
        except ReshardError as e:
            self._violate(i, "3: no leaked shards", f"settle/stats failed: {first_line(e)}")
            return
        expected = {d: set() for d in everyone.device_ids}
        for held in self.held:
            for d in held.tensor.mesh.device_ids:
                expected[d].add(held.tensor.name)
        for t in self.model.outs.values() if self.model is not None else ():
            for d in t.mesh.device_ids:
                expected[d].add(t.name)
        for d, s in zip(everyone.device_ids, stats, strict=True):
            have = set(s["buffers"])
            if have - expected[d]:
                self._violate(i, "3: no leaked shards", f"device {d} holds {sorted(have - expected[d])} unowned")
            if expected[d] - have:
                self._violate(i, "2: source intact", f"device {d} lost the shards of {sorted(expected[d] - have)}")
            for name, holders in s["holders"].items():
                if name in expected[d] and holders != [name]:
                    self._violate(i, "3: no leaked shards", f"device {d}: {name} is held by {holders}")

    # ------------------------------------------------------------------ end

    def close(self) -> None:
        for held in self.held:
            if held.tensor is not None and not held.tensor.freed:
                try:
                    held.tensor.free()
                except ReshardError:
                    pass
        self.held = []
        if self.model is not None:
            self.model.free()
        for v in [*self.views.values(), *self.retired]:
            v.shutdown()
        for m in self.owners:
            m.shutdown()
        for a in self.inference:
            ray.kill(a)
        ray.kill(self.beacon)
        signal.signal(signal.SIGINT, self._sigint)

    def summary(self) -> dict:
        """Counts, outcomes and times by fault kind (times to error against timeout + TARGET_S)."""
        by_kind: dict = {}
        for f in Fault:
            recs = [r for r in self.records if r.fault == f.value]
            if not recs:
                continue
            errors = [r for r in recs if r.failed]
            late = [r for r in errors if r.seconds > r.timeout_s + TARGET_S]
            times = [r.seconds for r in errors]
            by_kind[f.value] = {
                "steps": len(recs),
                "by_phase_transport": dict(Counter(f"{r.phase}/{'pull' if r.shared_memory else 'gloo'}" for r in recs)),
                "victim_took_part": sum(bool(r.victim_took_part) for r in recs),
                "failed": len(errors),
                "outcomes": dict(Counter(r.outcome for r in recs)),
                "time_to_error_p50_s": percentile(times, 50),
                "time_to_error_p99_s": percentile(times, 99),
                "time_to_error_max_s": max(times, default=None),
                "timeout_s": recs[0].timeout_s,
                "over_timeout_plus_2s": len(late),
                "interrupt_to_raise_p99_s": percentile(
                    [r.interrupt_to_raise_s for r in recs if r.interrupt_to_raise_s is not None], 99
                ),
                "probe_p50_s": percentile([r.probe_s for r in recs if r.probe_s is not None], 50),
                "probe_p99_s": percentile([r.probe_s for r in recs if r.probe_s is not None], 99),
                "messages": dict(Counter(r.message.split(":")[0] + ": " + _gist(r.message) for r in errors)),
            }
        return {
            "seed": self.seed,
            "steps": len(self.records),
            "faults_injected": sum(r.fault != Fault.NONE.value for r in self.records),
            "steps_by_kind": dict(Counter(r.kind for r in self.records)),
            "commit_time_faults": sum(r.phase == Phase.COMMIT.value for r in self.records),
            "violations": [asdict(v) for v in self.violations],
            "livelocks": sum(v.invariant.startswith("4") for v in self.violations),
            "deaths": len(self.deaths),
            "devices_started": self.devices_started,
            "pool_replacements": self.replacements,
            "wall_s_by_kind": {
                f.value: round(sum(r.step_s for r in self.records if r.fault == f.value), 1) for f in Fault
            },
            "by_kind": by_kind,
            "slow_retries": self.slow,
        }


def _parts(compiled, device: int) -> tuple[int, int]:
    """(ops, destination elements) of ``device`` in a compiled reshard, or a tree's (every tensor's)."""
    ops = elements = 0
    for c in getattr(compiled, "tensors", (compiled,)):
        if device in c.participants:
            p = c.program.for_device(device)
            ops += len(p.all_ops)
            elements += math.prod(p.dst_shape) if p.dst_shape is not None else 0
    return ops, elements


def _gist(message: str) -> str:
    """What kind of failure a message names, without its ids and numbers."""
    low = message.lower()
    for key in (
        "did not complete",
        "allocate",
        "cannot allocate",
        "resource temporarily",
        "source shard",
        "died",
        "aborted",
        "deadline",
        "closed",
    ):
        if key in low:
            return key
    return "other"
