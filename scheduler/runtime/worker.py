"""Actor side of the pipeline runtime: one `StageWorker` per device of every stage mesh.

Runtime layer (imports torch). The driver (`scheduler.runtime.pipeline`) ships each device a `WorkerSpec`
once and a `StagePlan` per iteration; this module runs them.

Threads of one worker:

- a COMPUTE thread per iteration runs the stage's computes in the schedule's order. Before a
  compute it waits (with a deadline) for its input payloads; after it, it hands each output to
  the lane that sends it and goes on at once (overlap), or lets the next compute wait until
  those sends completed (``overlap=False``, a blocking send as in `scheduler.simulate`).
- one COMMUNICATION thread per lane (directed stage pair) the device takes part in, persistent,
  fed by a queue. At iteration start every lane gets all its transfers in the global transfer
  order (`scheduler.pipeline_plan`): a receiving lane posts its receive at once (the data is there
  when the compute needs it); a sending lane waits for the producing compute and sends right after
  it. A transfer runs this device's part of the lowered reshard program (`reshard.lower_plan`) on
  the lane's own communicators, so no communicator is ever used by two threads.

Kernel lanes. On a GPU, a lane that sends through NCCL (not a pull lane) runs NCCL kernels that
wait on the GPU for their peer, and a CUDA call of the user's compute may wait for every kernel
of the device: the first launch of a kernel under lazy module loading (the default since CUDA
12.2 and torch's; CUDA programming guide, "Lazy Loading: concurrent execution") or a
``cudaFree``; NCCL's guide warns of it ("Using multiple NCCL communicators concurrently"). A
receive posted early, whose sender waits for this device's next output, then never completes.
So no kernel lane has a transfer in flight while a compute runs: its receives start when the
compute thread reaches the step that reads them, its sends finish before the next compute, and
a step's receives are posted before the previous step's sends are waited for (each pair of
neighbours then has its sends and receives out together, as a torch pipeline batches them).
Compute overlaps the other stages' transfers, not its own device's.

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
from typing import Any

import torch

from reshard.errors import ReshardTimeout
from reshard.ir.serialize import decode_device_program
from scheduler.ir import Payload, Phase
from scheduler.pipeline_plan import Lane, payload_name
from scheduler.runtime.pull_lanes import FAILED, SLOTS, LaneBoard, PeerCell, SendRing, peer_slots
from scheduler.runtime.specs import ErrorKind, IterationSpec, Role, StageFailure, WorkerSpec, error_info
from scheduler.runtime.stage_context import MicrobatchContext, StageContext

LANE_STAGING_KEEP_BYTES = 1 << 20


# ----------------------------------------------------------------------------------------------
# what a lane hands the runtime's executor


# ----------------------------------------------------------------------------------------------
# one iteration's shared state


class _Slot:
    __slots__ = ("ready", "done", "wanted", "tensor")

    def __init__(self) -> None:
        self.ready = threading.Event()  # the tensor exists (output computed / input received)
        self.done = threading.Event()  # the transfer finished (sends only)
        self.wanted = threading.Event()  # the compute thread reached the step that reads it (receives only)
        self.tensor: torch.Tensor | None = None


class _Iteration:
    def __init__(self, spec: IterationSpec, worker: StageWorker):
        self.spec = spec
        self.plan = spec.plan
        self.start = time.time()
        self.deadline = self.start + spec.timeout_s
        self.slots: dict[Payload, _Slot] = {}
        self.order: dict[tuple[Lane, Role, Payload], int] = {}  # a transfer's place in its lane
        self.lane_of: dict[Payload, Lane] = {}
        for role, lanes in ((Role.SEND, self.plan.send_lanes), (Role.RECV, self.plan.recv_lanes)):
            for lane, payloads in lanes.items():
                for n, p in enumerate(payloads):
                    self.slots[p] = _Slot()
                    self.order[(lane, role, p)] = n
                    self.lane_of[p] = lane
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

    def __init__(self, worker: StageWorker, lane: Lane, role: Role):
        self.worker, self.lane, self.role = worker, lane, role
        self.queue: queue.Queue = queue.Queue()
        self.thread = threading.Thread(
            target=self._loop, name=f"pipeline-lane-{lane[0]}->{lane[1]}-{role.value}", daemon=True
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

    def __init__(self, spec: WorkerSpec, device_ctx: Any, groups):
        self.spec = spec
        self.device_ctx = device_ctx
        self.groups = groups  # the controller's GroupCache on this device
        self.torch_device = device_ctx.torch_device
        self.dtype = getattr(torch, spec.dtype)
        self.ctx = StageContext(self)
        self.programs = {
            (lane, role): decode_device_program(blob)[1]
            for role, blobs in ((Role.SEND, spec.send_programs), (Role.RECV, spec.recv_programs))
            for lane, blob in blobs.items()
        }
        self.runners = {
            (lane, role): device_ctx.runner(
                program, spec.dtype, channel=spec.lane_channels[lane], staging_keep_bytes=LANE_STAGING_KEEP_BYTES
            )
            for (lane, role), program in self.programs.items()
        }
        pulls = [(lane, role) for lane, role in self.programs if lane in spec.pull_peers]
        self.board = LaneBoard(device_ctx, [(lane, role.value) for lane, role in pulls]) if pulls else None
        self.rings: dict[Lane, SendRing] = {}
        for lane, role in pulls:
            shape = self.programs[(lane, role)].src_shape
            if role is Role.SEND and spec.pull_peers[lane] and shape is not None:
                self.rings[lane] = SendRing(device_ctx, shape, spec.dtype)
        self.ring_tensors = {
            lane: [torch.from_numpy(s).view(self.dtype) for s in ring.slots] for lane, ring in self.rings.items()
        }
        self.peer_cells: dict[tuple[Lane, Role], list[PeerCell]] = {}
        self.peer_rings: dict[Lane, dict[int, list]] = {}
        self.lanes: dict[tuple[Lane, str], _LaneThread] = {}
        for lane in spec.send_programs:
            self.lanes[(lane, Role.SEND)] = _LaneThread(self, lane, Role.SEND)
        for lane in spec.recv_programs:
            self.lanes[(lane, Role.RECV)] = _LaneThread(self, lane, Role.RECV)
        self.iteration: _Iteration | None = None
        self.saved: dict[int, MicrobatchContext] = {}
        if spec.setup is not None:
            try:
                self.ctx.state = spec.setup(self.ctx)
            except Exception as exc:
                self.close()
                raise RuntimeError(
                    f"stage {spec.stage} (device {spec.device}): setup raised {type(exc).__name__}: {exc}"
                ) from exc

    def pull_info(self) -> dict | None:
        """What peers need to map this worker's pull lanes: its board, its cells, its rings."""
        if self.board is None:
            return None
        return {
            "board": self.board.handle,
            "cells": self.board.index,
            "rings": {lane: ring.handles for lane, ring in self.rings.items()},
        }

    def connect_pulls(self, infos: dict[int, dict]) -> None:
        """Map the boards and rings of this worker's pull lane peers (``pull_info`` of each)."""
        for lane, role in self.programs:
            peers = self.spec.pull_peers.get(lane)
            if peers is None:
                continue
            theirs = Role.RECV.value if role is Role.SEND else Role.SEND.value
            self.peer_cells[(lane, role)] = [PeerCell(self.device_ctx, d, infos[d], lane, theirs) for d in peers]
            if role is Role.RECV:
                self.peer_rings[lane] = {
                    d: peer_slots(self.device_ctx, d, infos[d]["rings"][lane], self.spec.dtype) for d in peers
                }

    def communicator(self, channel: str, group: tuple[int, ...]):
        return self.groups.get((channel, tuple(sorted(group))))

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
        comm = self.communicator(self.spec.stage_channel, group)
        it = self.iteration
        if it is not None and not it.finished.is_set():
            comm.timeout_s = max(it.remaining_s(), 1e-3)
        else:
            comm.timeout_s = self.spec.timeout_s
        total = tensor.contiguous().clone()
        comm.all_reduce(self.device_ctx.device_array(total), "sum")  # in place, over the tensor's memory
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
                self.lanes[(lane, Role.SEND)].queue.put((it, p))
        for lane, payloads in spec.plan.recv_lanes.items():
            for p in payloads:
                self.lanes[(lane, Role.RECV)].queue.put((it, p))
        threading.Thread(target=self._compute_loop, args=(it,), name="pipeline-compute", daemon=True).start()

    def abort(self) -> None:
        if self.iteration is not None:
            self.iteration.abort.set()

    def poll(self, wait_s: float) -> dict:
        it = self.iteration
        if it is None:
            return {"state": "idle"}
        it.finished.wait(max(0.0, wait_s))
        status: dict[str, object] = {
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
        """Stop the lane threads (the communicators are the controller's: it drops them)."""
        for lane in self.lanes.values():
            lane.stop()

    # -- the compute thread

    def _compute_loop(self, it: _Iteration) -> None:
        spec = self.spec
        unsent: list[Payload] = []  # outputs whose sends must finish before the next compute
        for step in it.plan.steps:
            action = step.compute
            k = action.microbatch
            forward = action.phase is Phase.FORWARD
            label = f"{action.phase.value}{k}"
            it.current = f"{label} on stage {spec.stage}"
            try:
                for p in step.inputs:  # its receives may start now (on kernel lanes: only now)
                    it.slots[p].wanted.set()
                for p in unsent:
                    it.wait(it.slots[p].done, f"send {payload_name(p)} before {label} on stage {spec.stage}")
                unsent = []
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
                            it.fail(error_info(ErrorKind.SLOW, spec, k, action.phase, late))
                end = time.time()
                it.events.append(("forward" if forward else "backward", label, start, end))
                it.held.append(len(self.saved))
                for p in step.outputs:
                    slot = it.slots[p]
                    slot.tensor = out
                    slot.ready.set()
                unsent = [p for p in step.outputs if not it.spec.overlap or it.lane_of[p] in self.spec.kernel_lanes]
            except BaseException as exc:  # noqa: BLE001 - a deadline or an internal error: stop computing
                it.fail(
                    error_info(
                        ErrorKind.TIMEOUT if isinstance(exc, TimeoutError) else ErrorKind.INTERNAL,
                        spec,
                        k,
                        action.phase,
                        exc,
                    )
                )
                for p in step.outputs:  # let the lanes drain with zeros
                    if not it.slots[p].ready.is_set():
                        it.slots[p].tensor = self._placeholder(forward)
                        it.slots[p].ready.set()
                for slot in it.slots.values():
                    slot.wanted.set()
                break
        it.current = "finished computing"
        if len(self.saved) and not it.errors:
            left = RuntimeError(f"{len(self.saved)} saved contexts left")
            it.fail(error_info(ErrorKind.INTERNAL, spec, None, None, left))
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
                    x = torch.from_numpy(it.spec.inputs[k]).to(self.torch_device)
                target = None
                if last and it.spec.targets is not None:
                    target = torch.from_numpy(it.spec.targets[k]).to(self.torch_device)
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
            raise StageFailure(error_info(ErrorKind.USER, spec, k, phase, exc)) from exc

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

    def _transfer(self, it: _Iteration, lane: Lane, role: Role, p: Payload) -> None:
        slot = it.slots[p]
        if lane in it.broken_lanes:
            self._fill_broken(it, role, p)
            return
        runner = self.runners[(lane, role)]
        program = runner.program
        pull = lane in self.spec.pull_peers

        def run(src, dst) -> None:
            if not pull:
                runner(src, dst, time.monotonic() + max(it.remaining_s(), 1e-3))
                return
            n, what = it.order[(lane, role, p)], f"{role.value} {payload_name(p)}"
            if role is Role.SEND:
                ring = self.ring_tensors.get(lane)
                if ring is not None:
                    if n >= SLOTS:  # the slot is free once every receiver consumed what it held
                        for cell in self.peer_cells[(lane, role)]:
                            cell.wait(it.spec.number, n - SLOTS + 1, it.remaining_s, what)
                    ring[n % SLOTS].copy_(src)
            else:
                for cell in self.peer_cells[(lane, role)]:
                    cell.wait(it.spec.number, n + 1, it.remaining_s, what)
                peers = {d: slots[n % SLOTS] for d, slots in self.peer_rings[lane].items()}
                runner(None, dst, time.monotonic() + max(it.remaining_s(), 1e-3), peers)
            assert self.board is not None
            self.board.post(lane, role.value, it.spec.number, n + 1)

        if role is Role.SEND:
            it.wait(slot.ready, f"the output {payload_name(p)} to send")
            src = slot.tensor
            start = time.time()
            run(src, None)
            end = time.time()
            slot.tensor = None
            slot.done.set()
        else:
            if lane in self.spec.kernel_lanes:
                it.wait(slot.wanted, f"the compute that reads {payload_name(p)}")
            shape = program.dst_shape
            dst = None if shape is None else torch.empty(shape, dtype=self.dtype, device=self.torch_device)
            start = time.time()
            run(None, dst)
            end = time.time()
            slot.tensor = dst
            slot.ready.set()
        if program.ops or pull:
            it.transfers.append(
                {
                    "payload": str(p),
                    "phase": p.phase.value,
                    "microbatch": p.microbatch,
                    "src": p.src,
                    "dst": p.dst,
                    "role": role.value,
                    "start": start,
                    "end": end,
                }
            )
            if role is Role.SEND:
                it.events.append(("send", f"{p.phase.value}{p.microbatch}->{p.dst}", start, end))
            else:
                it.events.append(("recv", f"{p.phase.value}{p.microbatch}<-{p.src}", start, end))

    def _fill_broken(self, it: _Iteration, role: Role, p: Payload) -> None:
        slot = it.slots[p]
        if role is Role.SEND:
            slot.done.set()
        else:
            forward = p.phase is Phase.FORWARD
            shape = self.spec.in_local_shape if forward else self.spec.out_local_shape
            slot.tensor = None if shape is None else torch.zeros(shape, dtype=self.dtype, device=self.torch_device)
            slot.ready.set()

    def _lane_failed(self, it: _Iteration, lane: Lane, role: Role, p: Payload, exc: BaseException) -> None:
        """A transfer failed: the lane's communicators are in an unknown state. Abort them (peers
        blocked on them fail at once instead of at their timeout), fill this lane's remaining
        receives with zeros, and let the driver re-create the communicators before the next run."""
        it.broken_lanes.add(lane)
        kind = ErrorKind.TIMEOUT if isinstance(exc, TimeoutError | ReshardTimeout) else ErrorKind.TRANSFER
        info = error_info(kind, self.spec, p.microbatch, p.phase, exc)  # stamped before the peers hear of it
        info["transfer"] = f"{role.value} {payload_name(p)}"
        it.fail(info)
        if self.board is not None and lane in self.spec.pull_peers:  # its peers fail at once
            self.board.post(lane, role.value, it.spec.number, FAILED)
        channel = self.spec.lane_channels[lane]
        programs = (self.programs.get((lane, Role.SEND)), self.programs.get((lane, Role.RECV)))
        keys = [(channel, g) for prog in programs if prog is not None for g in prog.connect]
        self.groups.abort(keys, f"the lane {lane} failed")
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


# ----------------------------------------------------------------------------------------------
# this device's workers, kept on its DeviceContext (one per pipeline)

_KEY = "scheduler.pipelines"


def install(device_ctx: Any, spec: WorkerSpec) -> StageWorker:
    """(Re)create this device's worker for ``spec.pipeline_id`` (closing an older one), with the
    communicators of the calling controller (this runs inside an ordered ``call``)."""
    workers = device_ctx.extensions.setdefault(_KEY, {})
    old = workers.pop(spec.pipeline_id, None)
    if old is not None:
        old.close()
    groups = device_ctx.controller(device_ctx.caller).groups
    made = workers[spec.pipeline_id] = StageWorker(spec, device_ctx, groups)
    return made


def worker(device_ctx: Any, pipeline_id: str) -> StageWorker:
    try:
        return device_ctx.extensions.get(_KEY, {})[pipeline_id]
    except KeyError:
        raise RuntimeError(f"pipeline {pipeline_id} has no worker on device {device_ctx.device} (closed?)") from None


def uninstall(device_ctx: Any, pipeline_id: str) -> None:
    w = device_ctx.extensions.get(_KEY, {}).pop(pipeline_id, None)
    if w is not None:
        w.close()
