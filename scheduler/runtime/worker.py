"""Actor side of the pipeline runtime: one `StageWorker` per device of every stage mesh.

Runtime layer (imports torch). The driver (`scheduler.pipeline`) ships each device a `WorkerSpec`
once and a `StagePlan` per iteration; this module runs them.

Threads of one worker:

- a COMPUTE thread per iteration runs the stage's computes in the schedule's order. Before a
  compute it waits (with a deadline) for its input payloads; after it, it hands each output to
  the lane that sends it and goes on at once (overlap), or waits until those sends completed
  (``overlap=False``, a blocking send as in `scheduler.simulate`).
- one COMMUNICATION thread per lane (directed stage pair) the device takes part in, persistent,
  fed by a queue. At iteration start every lane gets all its transfers in the global transfer
  order (`scheduler.pipeline_plan`): a receiving lane posts its receive at once (the data is there
  when the compute needs it); a sending lane waits for the producing compute and sends right after
  it. A transfer runs this device's part of the lowered reshard program (`reshard.lower_plan`) on
  the lane's own communicators, so no communicator is ever used by two threads.

Errors. A user callable that raises marks the iteration failed (stage, microbatch, phase, device,
traceback) and switches the worker to ABORT mode: later computes are skipped and their outputs
replaced by zeros, so every transfer still happens and every communicator stays consistent; the
driver then aborts the other workers the same way. The worker is usable for the next iteration.
A failed or timed-out transfer breaks its lane (communicator state unknown): its remaining
receives are filled with zeros, and the driver rebuilds the lanes' communicators before the next
iteration. Every wait has a deadline.
"""

from __future__ import annotations

import math
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from reshard.lowering import DeviceProgram
from reshard.runtime.communicator import Rendezvous
from reshard.runtime.executor import StagingBuffer, compile_program, run_program, torch_dtype

from .ir import Payload, Phase
from .pipeline_plan import Lane, StagePlan, payload_name


@dataclass(frozen=True)
class WorkerSpec:
    """What one device of one stage needs to run its part of every iteration."""

    pipeline_id: str
    stage: int
    n_stages: int
    device: int
    coords: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    mesh_devices: tuple[int, ...]
    forward: Callable
    backward: Callable | None
    setup: Callable | None
    dtype: str
    in_local_shape: tuple[int, ...] | None  # this device's shard of the stage input
    out_local_shape: tuple[int, ...] | None  # this device's shard of the stage output
    send_programs: dict[Lane, DeviceProgram]  # per lane leaving this stage: this device's program
    recv_programs: dict[Lane, DeviceProgram]
    timeout_s: float
    name: str = ""
    rendezvous: tuple = ()  # (channel, group, info) with this device, in the global connect order


@dataclass
class IterationSpec:
    plan: StagePlan
    overlap: bool
    inputs: list | None  # stage 0: this device's input shard per microbatch (numpy), or None
    targets: list | None  # last stage: the target per microbatch (numpy), or None
    timeout_s: float


class StageFailure(Exception):
    """Raised inside the worker to carry a located failure."""


# ----------------------------------------------------------------------------------------------
# contexts handed to user callables


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, worker, axis, backward_reduce):
        ctx.worker, ctx.axis, ctx.backward_reduce = worker, axis, backward_reduce
        if backward_reduce:
            return tensor.clone()
        return worker.all_reduce(tensor.detach().clone(), axis)

    @staticmethod
    def backward(ctx, grad):
        if ctx.backward_reduce:
            return ctx.worker.all_reduce(grad.contiguous().clone(), ctx.axis), None, None, None
        return grad, None, None, None


class StageContext:
    """What a stage callable sees of its device: position, state, intra-stage collectives."""

    def __init__(self, worker: StageWorker):
        self._worker = worker
        self.state: Any = None

    @property
    def stage(self) -> int:
        return self._worker.spec.stage

    @property
    def device(self) -> int:
        return self._worker.spec.device

    @property
    def coords(self) -> tuple[int, ...]:
        """This device's position in the stage mesh."""
        return self._worker.spec.coords

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return self._worker.spec.mesh_shape

    def all_reduce(self, tensor: torch.Tensor, axis: int | None = None) -> torch.Tensor:
        """Sum `tensor` over the stage mesh (or over mesh axis `axis` only); returns the sum, the
        same bits on every device. Not differentiable; see `reduce_from_tp` / `copy_to_tp`."""
        return self._worker.all_reduce(tensor, axis)

    def reduce_from_tp(self, tensor: torch.Tensor, axis: int | None = None) -> torch.Tensor:
        """Tensor parallelism's "g": all-reduce forward, identity backward (after a row-parallel
        linear layer)."""
        return _AllReduce.apply(tensor, self._worker, axis, False)

    def copy_to_tp(self, tensor: torch.Tensor, axis: int | None = None) -> torch.Tensor:
        """Tensor parallelism's "f": identity forward, all-reduce backward (before a
        column-parallel linear layer whose input is replicated)."""
        return _AllReduce.apply(tensor, self._worker, axis, True)


class MicrobatchContext:
    """Per-microbatch context: `saved` lives from this microbatch's forward to its backward."""

    def __init__(self, stage_ctx: StageContext, microbatch: int, target: Any):
        self.stage_ctx = stage_ctx
        self.microbatch = microbatch
        self.target = target
        self.saved: dict[str, Any] = {}

    def __getattr__(self, name: str) -> Any:  # state, stage, device, coords, all_reduce, ...
        return getattr(self.stage_ctx, name)


# ----------------------------------------------------------------------------------------------
# what a lane hands the runtime's program interpreter


class _LaneExec:
    """The slice of a ``DeviceContext`` that ``reshard.runtime.executor.run_program`` uses, owned
    by one lane thread (its own staging buffer), and the lane's communicators as ``groups``."""

    def __init__(self, worker: StageWorker, channel: tuple):
        self.worker = worker
        self.channel = channel
        self.device = worker.spec.device
        self.staging = StagingBuffer(worker.torch_device, 1 << 20)

    @property
    def before_op(self):
        """The device's ``before_op(ctx, op)`` hook (tracing, fault injection), read at each run."""
        return getattr(self.worker.device_ctx, "before_op", None)

    def note_peak(self, nbytes: int) -> None:
        pass

    def get(self, group: tuple[int, ...]):
        return self.worker.communicator(self.channel, group)


# ----------------------------------------------------------------------------------------------
# one iteration's shared state


class _Slot:
    __slots__ = ("ready", "done", "tensor")

    def __init__(self) -> None:
        self.ready = threading.Event()  # the tensor exists (output computed / input received)
        self.done = threading.Event()  # the transfer finished (sends only)
        self.tensor: torch.Tensor | None = None


class _Iteration:
    def __init__(self, spec: IterationSpec, worker: StageWorker):
        self.spec = spec
        self.plan = spec.plan
        self.start = time.time()
        self.deadline = self.start + spec.timeout_s
        self.slots: dict[Payload, _Slot] = {}
        for lanes in (self.plan.send_lanes, self.plan.recv_lanes):
            for payloads in lanes.values():
                for p in payloads:
                    self.slots[p] = _Slot()
        self.abort = threading.Event()
        self.finished = threading.Event()
        self.lock = threading.Lock()
        self.pending = (
            1
            + sum(len(ps) for ps in self.plan.send_lanes.values())
            + sum(len(ps) for ps in self.plan.recv_lanes.values())
        )
        self.errors: list[dict] = []
        self.events: list[tuple[str, str, float, float]] = []  # (kind, label, start, end)
        self.transfers: list[dict] = []
        self.losses: dict[int, float] = {}
        self.held: list[int] = []
        self.current = "not started"
        self.broken_lanes: set[Lane] = set()

    def remaining_s(self) -> float:
        return max(0.0, self.deadline - time.time())

    def wait(self, event: threading.Event, what: str) -> None:
        if not event.wait(self.remaining_s()):
            raise TimeoutError(f"waited past the iteration deadline ({self.spec.timeout_s:g} s) for {what}")

    def fail(self, info: dict) -> None:
        with self.lock:
            self.errors.append(info)
        self.abort.set()

    def one_done(self) -> None:
        with self.lock:
            self.pending -= 1
            last = self.pending == 0
        if last:
            self.end = time.time()
            self.finished.set()


# ----------------------------------------------------------------------------------------------
# the worker


class _LaneThread:
    """A persistent communication thread for one lane, with its queue."""

    def __init__(self, worker: StageWorker, lane: Lane, role: str):
        self.worker, self.lane, self.role = worker, lane, role
        self.queue: queue.Queue = queue.Queue()
        self.thread = threading.Thread(
            target=self._loop, name=f"pipeline-lane-{lane[0]}->{lane[1]}-{role}", daemon=True
        )
        self.thread.start()

    def _loop(self) -> None:
        while True:
            job = self.queue.get()
            if job is None:
                return
            it, payload = job
            try:
                self.worker._transfer(it, self.lane, self.role, payload)
            except BaseException as exc:  # noqa: BLE001 - reported to the driver
                self.worker._lane_failed(it, self.lane, self.role, payload, exc)
            finally:
                it.one_done()

    def stop(self) -> None:
        self.queue.put(None)


class StageWorker:
    """One device's share of a pipeline: user state, lane threads, the running iteration."""

    def __init__(self, spec: WorkerSpec, device_ctx: Any):
        self.spec = spec
        self.device_ctx = device_ctx
        self.torch_device = getattr(device_ctx, "torch_device", torch.device("cpu"))
        self.dtype = torch_dtype(spec.dtype)
        self.ctx = StageContext(self)
        self.comms: dict[tuple, Any] = {}
        self.compiled = {
            (lane, role): compile_program(program, spec.dtype)
            for role, programs in (("send", spec.send_programs), ("recv", spec.recv_programs))
            for lane, program in programs.items()
        }
        self.execs: dict[tuple, _LaneExec] = {}
        self.lanes: dict[tuple[Lane, str], _LaneThread] = {}
        for lane in spec.send_programs:
            self.lanes[(lane, "send")] = _LaneThread(self, lane, "send")
        for lane in spec.recv_programs:
            self.lanes[(lane, "recv")] = _LaneThread(self, lane, "recv")
        self.iteration: _Iteration | None = None
        self.saved: dict[int, MicrobatchContext] = {}
        self.connect(spec.rendezvous)
        if spec.setup is not None:
            try:
                self.ctx.state = spec.setup(self.ctx)
            except Exception as exc:
                self.close()
                raise RuntimeError(
                    f"stage {spec.stage} (device {spec.device}): setup raised {type(exc).__name__}: {exc}"
                ) from exc

    def connect(self, rendezvous) -> None:
        """Create and connect every communicator this device uses, one at a time, in the
        driver's global order (the same on every device, so no two groups wait on each other):
        lane threads then never create or connect a group concurrently. Each (channel, group) is
        a communicator of its own, from its own rendezvous: two lanes over the same devices never
        share one."""
        backend = self.device_ctx.backend
        device = self.spec.device
        for channel, group, info in rendezvous:
            group = tuple(group)
            comm = backend.connect(Rendezvous(group, info), device, self.spec.timeout_s)
            self.comms[(channel, group)] = comm
            comm.timeout_s = min(self.spec.timeout_s, 60.0)
            comm.broadcast(torch.zeros(1, dtype=torch.float32, device=self.torch_device), 0)

    def communicator(self, channel: tuple, group: tuple[int, ...]):
        try:
            return self.comms[(channel, tuple(group))]
        except KeyError:
            raise RuntimeError(
                f"device {self.spec.device}: no communicator for {channel} group {group} (not set up by the driver)"
            ) from None

    # -- collectives inside the stage mesh (compute thread or driver calls only)

    def _axis_group(self, axis: int | None) -> tuple[int, ...]:
        spec = self.spec
        if axis is None:
            return tuple(sorted(spec.mesh_devices))
        if not 0 <= axis < len(spec.mesh_shape):
            raise ValueError(f"axis {axis} out of range for stage mesh {spec.mesh_shape}")
        members = []
        for flat, device in enumerate(spec.mesh_devices):
            coords = _coords(flat, spec.mesh_shape)
            if all(c == mine for a, (c, mine) in enumerate(zip(coords, spec.coords, strict=True)) if a != axis):
                members.append(device)
        return tuple(sorted(members))

    def all_reduce(self, tensor: torch.Tensor, axis: int | None = None) -> torch.Tensor:
        group = self._axis_group(axis)
        if len(group) == 1:
            return tensor
        comm = self.communicator(("stage", self.spec.stage), group)
        it = self.iteration
        running = it is not None and not it.finished.is_set()
        comm.timeout_s = max(it.remaining_s(), 1e-3) if running else self.spec.timeout_s
        tensor = tensor.contiguous()
        total = None
        for rank in range(len(group)):
            buf = tensor.clone() if group[rank] == self.spec.device else torch.empty_like(tensor)
            comm.broadcast(buf, rank)
            total = buf if total is None else total + buf
        return total

    # -- iteration control (called by the driver through the device actor)

    def start(self, spec: IterationSpec) -> None:
        if self.iteration is not None and not self.iteration.finished.is_set():
            raise RuntimeError(
                f"stage {self.spec.stage} device {self.spec.device} is still running an iteration "
                f"({self.iteration.current}); it cannot start another"
            )
        self.saved.clear()
        it = _Iteration(spec, self)
        self.iteration = it
        for lane, payloads in spec.plan.send_lanes.items():
            for p in payloads:
                self.lanes[(lane, "send")].queue.put((it, p))
        for lane, payloads in spec.plan.recv_lanes.items():
            for p in payloads:
                self.lanes[(lane, "recv")].queue.put((it, p))
        threading.Thread(target=self._compute_loop, args=(it,), name="pipeline-compute", daemon=True).start()

    def abort(self) -> None:
        if self.iteration is not None:
            self.iteration.abort.set()

    def poll(self, wait_s: float) -> dict:
        it = self.iteration
        if it is None:
            return {"state": "idle"}
        it.finished.wait(max(0.0, wait_s))
        status = {
            "state": "done" if it.finished.is_set() else "running",
            "stage": self.spec.stage,
            "device": self.spec.device,
            "errors": list(it.errors),
            "current": it.current,
            "broken_lanes": sorted(it.broken_lanes),
        }
        if it.finished.is_set():
            status.update(
                start=it.start,
                end=it.end,
                events=list(it.events),
                transfers=list(it.transfers),
                losses=dict(it.losses),
                peak_held=max(it.held, default=0),
                held=list(it.held),
            )
        return status

    def close(self) -> None:
        for lane in self.lanes.values():
            lane.stop()
        broken = self.iteration is not None and (self.iteration.broken_lanes or not self.iteration.finished.is_set())
        for comm in self.comms.values():
            try:
                comm.abort() if broken else comm.close()
            except Exception:  # noqa: BLE001 - best effort
                pass
        self.comms.clear()

    # -- the compute thread

    def _compute_loop(self, it: _Iteration) -> None:
        spec = self.spec
        for step in it.plan.steps:
            action = step.compute
            k = action.microbatch
            forward = action.phase is Phase.FORWARD
            label = f"{action.phase.value}{k}"
            it.current = f"{label} on stage {spec.stage}"
            try:
                inputs = []
                for p in step.inputs:
                    slot = it.slots[p]
                    it.wait(slot.ready, f"input {payload_name(p)} of {label} on stage {spec.stage}")
                    inputs.append(slot.tensor)
                    slot.tensor = None
                start = time.time()
                if it.abort.is_set():
                    out = self._placeholder(forward)
                    if not forward:
                        self.saved.pop(k, None)
                else:
                    try:
                        out = self._run_user(it, forward, k, inputs[0] if inputs else None)
                    except StageFailure as exc:
                        info = exc.args[0]
                        it.fail(info)
                        out = self._placeholder(forward)
                    else:
                        if time.time() > it.deadline:
                            late = TimeoutError(
                                f"{'forward' if forward else 'backward'} ran {time.time() - start:.3g} s and "
                                f"passed the iteration deadline ({it.spec.timeout_s:g} s)"
                            )
                            it.fail(_error_info("slow", spec, k, action.phase, late))
                end = time.time()
                it.events.append(("forward" if forward else "backward", label, start, end))
                it.held.append(len(self.saved))
                for p in step.outputs:
                    slot = it.slots[p]
                    slot.tensor = out
                    slot.ready.set()
                if not it.spec.overlap:
                    for p in step.outputs:
                        it.wait(it.slots[p].done, f"send {payload_name(p)} after {label} on stage {spec.stage}")
            except BaseException as exc:  # noqa: BLE001 - a deadline or an internal error: stop computing
                it.fail(
                    _error_info("timeout" if isinstance(exc, TimeoutError) else "internal", spec, k, action.phase, exc)
                )
                for p in step.outputs:  # let the lanes drain with zeros
                    if not it.slots[p].ready.is_set():
                        it.slots[p].tensor = self._placeholder(forward)
                        it.slots[p].ready.set()
                break
        it.current = "finished computing"
        if len(self.saved) and not it.errors:
            it.fail(_error_info("internal", spec, None, None, RuntimeError(f"{len(self.saved)} saved contexts left")))
        self.saved.clear()
        it.one_done()

    def _placeholder(self, forward: bool) -> torch.Tensor | None:
        shape = self.spec.out_local_shape if forward else self.spec.in_local_shape
        return None if shape is None else torch.zeros(shape, dtype=self.dtype, device=self.torch_device)

    def _run_user(self, it: _Iteration, forward: bool, k: int, x: torch.Tensor | None) -> torch.Tensor | None:
        spec = self.spec
        phase = Phase.FORWARD if forward else Phase.BACKWARD
        last = spec.stage == spec.n_stages - 1
        try:
            if forward:
                if x is None and spec.stage == 0 and it.spec.inputs is not None:
                    x = torch.from_numpy(it.spec.inputs[k])
                target = None
                if last and it.spec.targets is not None:
                    target = torch.from_numpy(it.spec.targets[k])
                mctx = MicrobatchContext(self.ctx, k, target)
                self.saved[k] = mctx
                if spec.backward is None:  # autograd mode
                    if x is not None and x.is_floating_point():
                        x = x.detach().requires_grad_(True)
                    with torch.enable_grad():
                        y = spec.forward(mctx, x)
                    mctx.saved["__x"], mctx.saved["__y"] = x, y
                else:
                    with torch.no_grad():
                        y = spec.forward(mctx, x)
                if last:
                    it.losses[k] = _as_float(y)
                    return None
                return self._check_out(y, spec.out_local_shape, "forward", k, "an output")
            mctx = self.saved.pop(k)
            grad = None if last else x
            if spec.backward is None:
                x_in, y = mctx.saved.pop("__x"), mctx.saved.pop("__y")
                if last:
                    y.backward() if y.requires_grad else None
                else:
                    torch.autograd.backward(y, grad)
                gx = None if x_in is None or not isinstance(x_in, torch.Tensor) else x_in.grad
            else:
                with torch.no_grad():
                    gx = spec.backward(mctx, grad)
            if spec.stage == 0:
                return None
            if gx is None:
                raise ValueError("backward returned no gradient for the stage input (None)")
            return self._check_out(gx, spec.in_local_shape, "backward", k, "an input-gradient")
        except StageFailure:
            raise
        except BaseException as exc:  # noqa: BLE001 - the user's callable failed
            raise StageFailure(_error_info("user", spec, k, phase, exc)) from exc

    def _check_out(self, t, shape, what: str, k: int, name: str) -> torch.Tensor:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what} returned {type(t).__name__}, expected {name} shard (a torch.Tensor)")
        if tuple(t.shape) != tuple(shape):
            raise ValueError(
                f"{what} returned {name} shard of shape {tuple(t.shape)}; this device's shard of the "
                f"declared layout has shape {tuple(shape)}"
            )
        if t.dtype != self.dtype:
            t = t.to(self.dtype)
        return t.detach().contiguous()

    # -- the lane threads

    def _transfer(self, it: _Iteration, lane: Lane, role: str, p: Payload) -> None:
        slot = it.slots[p]
        if lane in it.broken_lanes:
            self._fill_broken(it, role, p)
            return
        compiled = self.compiled[(lane, role)]
        program = compiled.program
        ex = self.execs.get((lane, role))
        if ex is None:
            ex = self.execs[(lane, role)] = _LaneExec(self, ("lane", lane))
        if role == "send":
            it.wait(slot.ready, f"the output {payload_name(p)} to send")
            src = slot.tensor
            start = time.time()
            run_program(ex, compiled, src, None, max(it.remaining_s(), 1e-3), ex)
            end = time.time()
            slot.tensor = None
            slot.done.set()
        else:
            shape = program.dst_shape
            dst = None if shape is None else torch.empty(shape, dtype=self.dtype, device=self.torch_device)
            start = time.time()
            run_program(ex, compiled, None, dst, max(it.remaining_s(), 1e-3), ex)
            end = time.time()
            slot.tensor = dst
            slot.ready.set()
        if program.ops:
            it.transfers.append(
                {"payload": str(p), "phase": p.phase.value, "microbatch": p.microbatch, "src": p.src,
                 "dst": p.dst, "role": role, "start": start, "end": end}
            )  # fmt: skip
            if role == "send":
                it.events.append(("send", f"{p.phase.value}{p.microbatch}->{p.dst}", start, end))

    def _fill_broken(self, it: _Iteration, role: str, p: Payload) -> None:
        slot = it.slots[p]
        if role == "send":
            slot.done.set()
        else:
            forward = p.phase is Phase.FORWARD
            shape = self.spec.in_local_shape if forward else self.spec.out_local_shape
            slot.tensor = None if shape is None else torch.zeros(shape, dtype=self.dtype, device=self.torch_device)
            slot.ready.set()

    def _lane_failed(self, it: _Iteration, lane: Lane, role: str, p: Payload, exc: BaseException) -> None:
        """A transfer failed: the lane's communicators are in an unknown state. Abort them (peers
        blocked on them fail at once instead of at their timeout), fill this lane's remaining
        receives with zeros, and let the driver re-create the communicators before the next run."""
        it.broken_lanes.add(lane)
        kind = "timeout" if isinstance(exc, TimeoutError) or "imeout" in str(exc) else "transfer"
        info = _error_info(kind, self.spec, p.microbatch, p.phase, exc)
        info["transfer"] = f"{role} {payload_name(p)}"
        it.fail(info)
        for (channel, _), comm in list(self.comms.items()):
            if channel == ("lane", lane):
                try:
                    comm.abort()
                except Exception:  # noqa: BLE001 - already broken
                    pass
        self._fill_broken(it, role, p)


def _coords(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for n in reversed(shape):
        flat, c = divmod(flat, n)
        out.append(c)
    return tuple(reversed(out))


def _as_float(y) -> float:
    if isinstance(y, torch.Tensor):
        return float(y.detach().sum()) if y.numel() else math.nan
    return float(y)


def _error_info(kind: str, spec: WorkerSpec, microbatch, phase, exc: BaseException) -> dict:
    return {
        "kind": kind,
        "stage": spec.stage,
        "device": spec.device,
        "microbatch": microbatch,
        "phase": None if phase is None else phase.value,
        "type": type(exc).__name__,
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
        "time": time.time(),
    }


# ----------------------------------------------------------------------------------------------
# per-process registry: entry points the driver calls through the device actor


@dataclass
class _Registry:
    workers: dict[tuple[str, int], StageWorker] = field(default_factory=dict)


REGISTRY = _Registry()


def install(device_ctx: Any, spec: WorkerSpec) -> None:
    """(Re)create this device's worker for `spec.pipeline_id` (closing an older one)."""
    key = (spec.pipeline_id, spec.device)
    old = REGISTRY.workers.pop(key, None)
    if old is not None:
        old.close()
    REGISTRY.workers[key] = StageWorker(spec, device_ctx)


def worker(pipeline_id: str, device: int) -> StageWorker:
    try:
        return REGISTRY.workers[(pipeline_id, device)]
    except KeyError:
        raise RuntimeError(f"pipeline {pipeline_id} has no worker on device {device} (closed?)") from None


def uninstall(pipeline_id: str, device: int) -> None:
    w = REGISTRY.workers.pop((pipeline_id, device), None)
    if w is not None:
        w.close()
