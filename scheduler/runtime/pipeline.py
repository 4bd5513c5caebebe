"""Pipeline runtime: run a `Schedule` on stage meshes, moving activations and gradients between
stages with the reshard machinery, communication overlapped with compute.

Runtime layer (imports ray; the actors import torch). Usage::

    from scheduler.runtime import Pipeline, Stage
    from scheduler import eager_one_f_one_b

    stages = [
        Stage(mesh0, forward=f0, out_shape=(B, H), out_layout=Layout(mesh0, (Replicate(), Replicate()))),
        Stage(mesh1, forward=f1, in_shape=(B, H), in_layout=Layout(mesh1, (Replicate(), Replicate())),
              setup=init_params),
    ]
    with Pipeline(stages) as pipe:
        result = pipe.run(eager_one_f_one_b(2, 8), inputs=microbatches, targets=labels)
        grads = pipe.apply(lambda ctx: {n: p.grad.numpy() for n, p in ctx.state.items()})

Callables (run on every device of the stage, on its compute thread):

- ``setup(ctx) -> state``: once per device; ``ctx.state`` is the result (parameters, buffers).
- ``forward(ctx, x) -> y``: ``x`` is this device's shard of the stage input (stage 0: its shard of
  ``inputs[k]``, or None without inputs); ``y`` its shard of the stage output, of the local shape
  that ``out_layout`` gives it. The last stage returns the loss (``ctx.target`` holds
  ``targets[k]``). ``ctx.saved`` is a dict that lives until the microbatch's backward.
- ``backward(ctx, grad_y) -> grad_x``: shards likewise (``grad_y`` is None on the last stage;
  stage 0 may return None). Without ``backward`` the runtime differentiates ``forward`` with
  autograd (``ctx.copy_to_tp`` / ``ctx.reduce_from_tp`` make intra-stage all-reduces differentiable).
- ``ctx``: ``stage``, ``device``, ``coords`` (position in the stage mesh), ``microbatch``, ``state``,
  ``saved``, ``target``, ``all_reduce(t, axis=None)``.

How it runs (details in `scheduler.pipeline_plan` and `scheduler.runtime.worker`): a client of
the reshard runtime. Every boundary's move, both directions, is compiled by ``compile_reshard``
(one program per device); the communicators are the controller's (``reshard.runtime``: one
rendezvous, one group table under its bounds), on channels of their own per lane (directed stage
pair) and per stage mesh, set up in one global order and pinned while the pipeline lives; every
call to a device is an ordered call of this process's controller. The driver validates the
schedule, derives one global order of all transfers, and ships every device its stage plan; each
device runs a compute thread and one communication thread per lane, each lane issuing its
transfers in the global order; sends are issued right after the producing compute, receives are
posted ahead. Errors surface on the driver as `PipelineError` naming stage, device, phase and
microbatch; no wait is unbounded.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from reshard.errors import ReshardError, ReshardTimeout, WorkerDied
from reshard.ir.regions import layout_regions
from reshard.ir.serialize import encode_device_program
from reshard.passes.compile import compile_reshard, planning_hosts
from reshard.runtime import BACKENDS, Deadline, compile_options
from scheduler.ir import Schedule, ScheduleError
from scheduler.pipeline_plan import Lane, PipelinePlan, plan_pipeline
from scheduler.runtime.results import IterationResult, TimelineEvent
from scheduler.runtime.specs import ErrorKind, IterationSpec, WorkerSpec
from scheduler.runtime.stages import Stage, check_boundaries, check_stage, local_shape
from scheduler.simulate import simulate
from topology.mesh import device_hosts


class PipelineError(ReshardError):
    """A pipeline iteration failed. ``stage``, ``device``, ``microbatch``, ``phase`` ("F"/"B")
    locate the failure when known; ``kind`` is "user" (a stage callable raised), "slow" (a callable
    ran past the iteration deadline), "transfer", "timeout" or "internal"; ``remote_traceback`` is
    the actor-side traceback; ``errors`` lists every worker's report."""

    def __init__(
        self,
        message: str,
        *,
        kind: ErrorKind = ErrorKind.INTERNAL,
        stage=None,
        device=None,
        microbatch=None,
        phase=None,
        remote_traceback: str = "",
        errors: Sequence[dict] = (),
    ):
        super().__init__(message)
        self.kind, self.stage, self.device = kind, stage, device
        self.microbatch, self.phase = microbatch, phase
        self.remote_traceback = remote_traceback
        self.errors = list(errors)


class PipelineTimeout(PipelineError, ReshardTimeout):
    """An iteration did not finish within its timeout."""


# ----------------------------------------------------------------------------------------------
# actor-side entry points (run as fn(ctx, ...) inside the device actor, through ordered calls)


def _install(ctx, spec) -> dict | None:
    return _workers().install(ctx, spec).pull_info()


def _connect_pulls(ctx, pipeline_id: str, infos: dict) -> None:
    _workers().worker(ctx, pipeline_id).connect_pulls(infos)


def _start(ctx, pipeline_id: str, spec) -> None:
    _workers().worker(ctx, pipeline_id).start(spec)


def _poll(ctx, pipeline_id: str, wait_s: float) -> dict:
    return _workers().worker(ctx, pipeline_id).poll(wait_s)


def _abort(ctx, pipeline_id: str) -> None:
    _workers().worker(ctx, pipeline_id).abort()


def _apply(ctx, pipeline_id: str, fn: Callable, args: tuple) -> Any:
    w = _workers().worker(ctx, pipeline_id)
    if w.iteration is not None and not w.iteration.finished.is_set():
        raise RuntimeError(f"stage {w.spec.stage} device {w.spec.device} is running an iteration")
    return fn(w.ctx, *args)


def _uninstall(ctx, pipeline_id: str) -> None:
    _workers().uninstall(ctx, pipeline_id)


def _workers():
    """The stage workers' module, imported where they run (the device actors): the driver never
    loads torch for a pipeline."""
    from scheduler.runtime import worker

    return worker


# ----------------------------------------------------------------------------------------------
# the driver


class Pipeline:
    """Stages on device meshes, ready to run schedules (see the module doc).

    strategy: the reshard planner for every boundary (`reshard.STRATEGIES`). timeout_s: default
    bound on one iteration (and on setup calls). shared_memory: a boundary between two stage meshes
    of one machine whose devices keep shared memory is a pull lane (`scheduler.runtime.pull_lanes`:
    receivers copy activations straight out of the senders' memory); False sends them through the
    meshes' backend, as between machines.
    """

    def __init__(
        self, stages: Sequence[Stage], *, strategy: str = "auto", timeout_s: float = 120.0, shared_memory: bool = True
    ):
        stages = list(stages)
        if not stages:
            raise ValueError("a pipeline needs at least one stage, got 0")
        for i, s in enumerate(stages):
            if not isinstance(s, Stage):
                raise TypeError(f"stages[{i}] must be a scheduler.runtime.Stage, got {type(s).__name__}")
            if not callable(s.forward):
                raise TypeError(f"stage {i}: forward must be callable, got {s.forward!r}")
            for name in ("backward", "setup"):
                fn = getattr(s, name)
                if fn is not None and not callable(fn):
                    raise TypeError(f"stage {i}: {name} must be callable or None, got {fn!r}")
        if not (isinstance(timeout_s, int | float) and timeout_s > 0):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        self.stages = tuple(check_stage(i, s, len(stages)) for i, s in enumerate(stages))
        check_boundaries(self.stages)
        self.n_stages = len(stages)
        self.strategy = strategy
        self.timeout_s = float(timeout_s)
        self.shared_memory = bool(shared_memory)
        self.pipeline_id = uuid.uuid4().hex[:12]
        self.meshes = [getattr(s.mesh, "mesh", s.mesh) for s in self.stages]
        seen: dict[int, int] = {}
        for i, m in enumerate(self.meshes):
            for d in m.device_ids:
                if d in seen:
                    raise ValueError(
                        f"stages {seen[d]} and {i} share device {d}; pipeline stages must sit on disjoint meshes"
                    )
                seen[d] = i
        self.stage_of = seen
        self.devices = [d for m in self.meshes for d in m.device_ids]
        self.pull_lanes: set[Lane] = set()  # the lanes whose receivers pull (``_lower_lanes``)
        self._lane_programs = self._lower_lanes()
        # the lanes whose transfers are NCCL kernels on GPUs (``scheduler.runtime.worker``)
        self.kernel_lanes = frozenset(
            lane
            for lane in self._lane_programs
            if lane not in self.pull_lanes
            and getattr(BACKENDS.get(self.stages[lane[1]].mesh.backend), "device_type", "cpu") == "cuda"
        )
        self._iterations = 0
        self._keys: list = []  # the pipeline's communicator keys, pinned while it lives
        self._installed = False
        self._connected = False
        self._closed = False
        self._plans: dict[tuple[str, tuple, bool], PipelinePlan] = {}

    # -- planning (pure)

    def _lower_lanes(self):
        """Per lane (a, b): the compiled reshard program, for both directions of every boundary."""
        out = {}
        for a in range(self.n_stages - 1):
            b = a + 1
            src, dst = self.stages[a], self.stages[b]
            out_layout, in_layout = src.out_layout, dst.in_layout
            if out_layout is None or in_layout is None:
                raise ValueError(f"stages {a} and {b} need stage {a}'s out_layout and stage {b}'s in_layout")
            domains = self._pull_domains(src.mesh, dst.mesh)
            hosts = device_hosts(src.mesh.mesh, dst.mesh.mesh)
            cluster = dst.mesh.runtime.planning_cluster(dst.mesh.backend, hosts)
            # a pull lane plans its machine as one host (``reshard.passes.compile.planning_hosts``)
            pulled = domains and dst.mesh.runtime.planning_cluster(
                dst.mesh.backend, planning_hosts(out_layout, in_layout, domains) or hosts
            )
            options = compile_options(dst.mesh.backend)
            for lane, (shape, s_layout, d_layout) in (
                ((a, b), (src.out_shape, out_layout, in_layout)),
                ((b, a), (dst.in_shape, in_layout, out_layout)),
            ):
                compiled = compile_reshard(
                    shape,
                    src.dtype,
                    s_layout,
                    d_layout,
                    strategy=self.strategy,
                    cluster=pulled or cluster,
                    domains=domains,
                    publishers=(),
                    options=options,
                )
                if domains and not compiled.program.groups:  # every transfer became a pull
                    self.pull_lanes.add(lane)
                elif domains:
                    compiled = compile_reshard(
                        shape, src.dtype, s_layout, d_layout, strategy=self.strategy, cluster=cluster, options=options
                    )
                out[lane] = compiled.program
        return out

    def _pull_domains(self, a, b) -> dict[int, str] | None:
        """The devices' machine, when a boundary between meshes ``a`` and ``b`` can be a pull lane:
        every device on one Ray node, keeping shared memory with a relay board (what pull lanes
        need: ``scheduler.runtime.pull_lanes``); else None."""
        records = (*a.records, *b.records)
        nodes = {r.node_id for r in records}
        if not self.shared_memory or len(nodes) != 1 or not all(r.shared_memory and r.board for r in records):
            return None
        return {r.id: r.node_id for r in records}

    def channel(self, what: str, index) -> str:
        """The communicator channel of a lane ``(a, b)`` or of stage ``s``'s mesh."""
        if what == "lane":
            return f"pipeline:{self.pipeline_id}:lane:{index[0]}-{index[1]}"
        return f"pipeline:{self.pipeline_id}:stage:{index}"

    def _worker_spec(self, device: int) -> WorkerSpec:
        s = self.stage_of[device]
        stage = self.stages[s]
        mesh = self.meshes[s]
        flat = mesh.device_ids.index(device)
        in_local = local_shape(stage.in_layout, stage.in_shape, flat)
        out_local = local_shape(stage.out_layout, stage.out_shape, flat)
        mine = {
            lane: encode_device_program(prog.for_device(device), stage.dtype)
            for lane, prog in self._lane_programs.items()
            if s in lane
        }
        send = {lane: blob for lane, blob in mine.items() if lane[0] == s}
        recv = {lane: blob for lane, blob in mine.items() if lane[1] == s}
        channels = {lane: self.channel("lane", lane) for lane in (*send, *recv)}
        pull_peers = {}
        for lane in self.pull_lanes & {*send, *recv}:
            sources = self._lane_programs[lane].pull_sources  # receiver -> the devices it pulls from
            pull_peers[lane] = (
                tuple(r for r, holders in sorted(sources.items()) if device in holders)
                if lane[0] == s
                else tuple(sources.get(device, ()))
            )
        return WorkerSpec(
            pipeline_id=self.pipeline_id,
            stage=s,
            n_stages=self.n_stages,
            device=device,
            coords=mesh.coords(flat),
            mesh_shape=mesh.shape,
            mesh_devices=mesh.device_ids,
            forward=stage.forward,
            backward=stage.backward,
            setup=stage.setup,
            dtype=stage.dtype,
            in_local_shape=in_local,
            out_local_shape=out_local,
            send_programs=send,
            recv_programs=recv,
            timeout_s=self.timeout_s,
            name=stage.name,
            lane_channels=channels,
            stage_channel=self.channel("stage", s),
            pull_peers=pull_peers,
            kernel_lanes=self.kernel_lanes & {*send, *recv},
        )

    def _connect_order(self) -> list[tuple[str, tuple[int, ...]]]:
        """Every communicator of this pipeline as a group key ``(channel, devices)``, in one
        global order: each lane and each stage mesh is a channel with communicators of its own."""
        keys = []
        for lane, program in sorted(self._lane_programs.items()):
            keys += [(self.channel("lane", lane), tuple(g)) for g in program.groups]
        for s, groups in sorted(self._stage_groups().items()):
            keys += [(self.channel("stage", s), g) for g in groups]
        return keys

    def _stage_groups(self) -> dict:
        groups: dict = {}
        for s, mesh in enumerate(self.meshes):
            if mesh.size == 1:
                continue
            gs = {tuple(sorted(mesh.device_ids))}
            for axis in range(mesh.ndim):
                for flat in range(mesh.size):
                    coords = mesh.coords(flat)
                    members = [
                        d
                        for f, d in enumerate(mesh.device_ids)
                        if all(c == o for a, (c, o) in enumerate(zip(mesh.coords(f), coords, strict=True)) if a != axis)
                    ]
                    if len(members) > 1:
                        gs.add(tuple(sorted(members)))
            groups[s] = sorted(gs)
        return groups

    def plan(self, schedule: Schedule, *, overlap: bool = True) -> PipelinePlan:
        """Validate `schedule` for this pipeline and derive its per-stage plans (cached)."""
        if not isinstance(schedule, Schedule):
            raise TypeError(f"schedule must be a scheduler.Schedule, got {type(schedule).__name__}")
        if schedule.n_stages != self.n_stages:
            raise ValueError(f"schedule {schedule.name!r} has {schedule.n_stages} stages, the pipeline {self.n_stages}")
        if schedule.skips:
            raise ValueError(
                f"schedule {schedule.name!r} has skip connections {list(schedule.skips)}; the pipeline runtime "
                f"moves one tensor per boundary (simulate skips with scheduler.simulate)"
            )
        key = (schedule.name, tuple(map(tuple, schedule.to_dict()["streams"])), bool(overlap))
        if key not in self._plans:
            if self.kernel_lanes:
                try:  # NCCL lanes start a transfer only once its receiver reached its reader
                    simulate(schedule, forward_s=1.0, backward_s=1.0, rendezvous=True)
                except ScheduleError as e:
                    raise ValueError(
                        f"schedule {schedule.name!r} cannot run on these GPU meshes: their lanes send through NCCL "
                        f"only between computes, and a send must meet the compute that reads it ({e}); order each "
                        "stage's computes so that a payload is read in the order it is sent (the generated schedules "
                        "all are)"
                    ) from e
            self._plans[key] = plan_pipeline(schedule, overlap=overlap)
        return self._plans[key]

    # -- setup

    def _ensure_installed(self) -> None:
        if self._closed:
            raise ReshardError("this pipeline was closed; build a new one")
        for st in self.stages:
            st.mesh.check_open()
        rt = self.stages[0].mesh.runtime
        if not self._connected:
            self._keys = rt.ensure_keys(self._connect_order(), timeout_s=self.timeout_s, pin=True)
            self._connected = True
        if not self._installed:
            infos = self._call(
                self.devices,
                _install,
                lambda d: (self._worker_spec(d),),
                self.timeout_s,
                "setting up the stage workers (setup callables)",
            )
            if self.pull_lanes:
                by_device = {d: info for d, info in zip(self.devices, infos, strict=True) if info is not None}
                self._call(
                    self.devices,
                    _connect_pulls,
                    lambda d: (self.pipeline_id, by_device),
                    self.timeout_s,
                    "mapping the pull lanes' boards and rings",
                )
            self._installed = True

    def _call(self, devices, fn, args_of, timeout_s: float, what: str):
        """Ordered ``call(fn, *args_of(device))`` on ``devices``; their results in that order. A
        device that died or did not answer leaves the workers' state unknown: they are set up again
        before the next use."""
        try:
            out = self.stages[0].mesh.runtime.dispatch.call({d: (fn, args_of(d), {}) for d in devices}, timeout_s, what)
        except (WorkerDied, ReshardTimeout) as e:
            self._installed = self._connected = False
            self._forget_groups()
            if isinstance(e, WorkerDied):
                raise
            raise PipelineTimeout(f"{what}: {e}", kind=ErrorKind.TIMEOUT) from e
        except ReshardError:
            raise
        except Exception as e:  # a device's own error (``Dispatch.call`` raises it as is)
            raise PipelineError(f"{what} failed: {type(e).__name__}: {e}") from e
        return [out[d] for d in devices]

    def _forget_groups(self) -> None:
        """Drop this pipeline's communicators everywhere (new ones are set up before the next run)."""
        rt = self.stages[0].mesh.runtime
        with rt.lock:
            rt.communicators.unpin(self._keys)
            rt.communicators.forget(self._keys)
        self._connected = False

    # -- running

    def run(
        self,
        schedule: Schedule,
        *,
        inputs: Sequence[Any] | None = None,
        targets: Sequence[Any] | None = None,
        overlap: bool = True,
        timeout_s: float | None = None,
    ) -> IterationResult:
        """Run one training iteration of `schedule` (forwards and backwards of every microbatch).

        inputs: one array per microbatch, the global stage-0 input (``stage0.in_shape``), or None.
        targets: one array per microbatch handed to the last stage as ``ctx.target``, or None.
        overlap: False makes each compute wait until its sends finished (blocking sends). Lanes
        that send through NCCL on GPUs always do, and post their receives only when the compute
        that reads them is next (``scheduler.runtime.worker``: kernel lanes).
        Raises `PipelineError` (`PipelineTimeout`) naming stage, device, phase and microbatch.
        """
        timeout_s = self.timeout_s if timeout_s is None else float(timeout_s)
        plan = self.plan(schedule, overlap=overlap)
        m = schedule.n_microbatches
        stage0 = self.stages[0]
        per_device_inputs = self._shard_inputs(inputs, m, stage0)
        if targets is not None:
            targets = [np.ascontiguousarray(np.asarray(t)) for t in targets]
            if len(targets) != m:
                raise ValueError(f"targets: expected one per microbatch ({m}), got {len(targets)}")
        self._ensure_installed()

        def spec(d):
            s = self.stage_of[d]
            last = s == self.n_stages - 1
            iteration = IterationSpec(
                plan.stages[s],
                bool(overlap),
                per_device_inputs.get(d),
                targets if last else None,
                timeout_s,
                self._iterations,
            )
            return self.pipeline_id, iteration

        self._iterations += 1
        t0 = time.perf_counter()
        self._call(self.devices, _start, spec, min(timeout_s, 60.0), "starting the iteration")
        statuses = self._wait_all(timeout_s)
        driver_s = time.perf_counter() - t0
        errors = [e for st in statuses.values() for e in st["errors"]]
        if any(st["broken_lanes"] for st in statuses.values()):
            self._forget_groups()  # fresh communicators (new generations) before the next run
        if errors:
            raise _as_error(errors)
        return self._result(schedule, bool(overlap), statuses, driver_s)

    def _shard_inputs(self, inputs, m: int, stage0: Stage) -> dict[int, list]:
        if inputs is None:
            return {}
        inputs = list(inputs)
        if len(inputs) != m:
            raise ValueError(f"inputs: expected one array per microbatch ({m}), got {len(inputs)}")
        if stage0.in_layout is None or stage0.in_shape is None:
            raise ValueError("inputs given but stage 0 declares no in_shape/in_layout to shard them with")
        regions = layout_regions(stage0.in_layout, stage0.in_shape)
        out: dict[int, list] = {d: [] for d in self.meshes[0].device_ids}
        for k, x in enumerate(inputs):
            x = np.asarray(x.detach().cpu().numpy() if hasattr(x, "detach") else x)
            if tuple(x.shape) != tuple(stage0.in_shape):
                raise ValueError(f"inputs[{k}] has shape {tuple(x.shape)}, stage 0 in_shape is {stage0.in_shape}")
            x = x.astype(stage0.dtype, copy=False)
            for flat, d in enumerate(self.meshes[0].device_ids):
                box = regions[flat]
                out[d].append(np.ascontiguousarray(x[tuple(slice(lo, hi) for lo, hi in box)]))
        return out

    def _wait_all(self, timeout_s: float) -> dict[int, dict]:
        deadline = Deadline.after(timeout_s).later(15.0)  # the devices' own deadline, and time to drain
        pending = list(self.devices)
        statuses: dict[int, dict] = {}
        last: dict[int, dict] = {}
        aborted = False
        while pending:
            remaining = deadline.left()
            if remaining <= 0:
                raise self._timeout_error(timeout_s, pending, last)
            wait_s = min(1.0, max(0.05, remaining))
            args = (self.pipeline_id, wait_s)
            answers = self._call(pending, _poll, lambda d, args=args: args, wait_s + 30.0, "waiting for the iteration")
            still = []
            for d, st in zip(pending, answers, strict=True):
                last[d] = st
                if st["errors"] and not aborted:
                    aborted = True
                    self._call(self.devices, _abort, lambda d: (self.pipeline_id,), 30.0, "aborting the iteration")
                if st["state"] == "done":
                    statuses[d] = st
                else:
                    still.append(d)
            pending = still
        return statuses

    def _timeout_error(self, timeout_s: float, pending: list[int], last: dict[int, dict]) -> PipelineTimeout:
        self._installed = False  # fresh workers and communicators before the next run
        self._forget_groups()
        where = "; ".join(
            f"stage {self.stage_of[d]} device {d}: {last.get(d, {}).get('current', 'no answer')}" for d in pending
        )
        first = pending[0]
        errors = [e for st in last.values() for e in st.get("errors", [])]
        if errors:
            err = _as_error(errors)
            return PipelineTimeout(
                f"{err} (and the iteration did not drain within {timeout_s:g} s: {where})",
                kind=err.kind,
                stage=err.stage,
                device=err.device,
                microbatch=err.microbatch,
                phase=err.phase,
                remote_traceback=err.remote_traceback,
                errors=errors,
            )
        return PipelineTimeout(
            f"pipeline iteration did not finish within {timeout_s:g} s; still running: {where}",
            kind=ErrorKind.TIMEOUT,
            stage=self.stage_of[first],
            device=first,
        )

    def _result(self, schedule: Schedule, overlap: bool, statuses: dict[int, dict], driver_s: float):
        n = self.n_stages
        t0 = min(
            [st["start"] for st in statuses.values()]
            + [e[2] for st in statuses.values() for e in st["events"]]
            + [t["start"] for st in statuses.values() for t in st["transfers"]]
        )
        compute_starts = [e[2] for st in statuses.values() for e in st["events"] if e[0] in ("forward", "backward")]
        t0 = min(compute_starts + [t0]) if compute_starts else t0
        t_end = max(
            [e[3] for st in statuses.values() for e in st["events"]]
            + [t["end"] for st in statuses.values() for t in st["transfers"]]
        )
        peaks = [0] * n
        fwd: list[list[float]] = [[] for _ in range(n)]
        bwd: list[list[float]] = [[] for _ in range(n)]
        events: list[TimelineEvent] = []
        sends: dict[tuple[Lane, str, int], float] = {}
        departed: dict[tuple[Lane, str, int], float] = {}
        arrived: dict[tuple[Lane, str, int], float] = {}
        losses: dict[int, float] = {}
        first_device = {s: self.meshes[s].device_ids[0] for s in range(n)}
        for d, st in statuses.items():
            s = st["stage"]
            peaks[s] = max(peaks[s], st["peak_held"])
            if s == n - 1:
                for k, v in st["losses"].items():
                    losses.setdefault(int(k), v)
            for kind, label, a, b in st["events"]:
                if d == first_device[s]:
                    events.append(TimelineEvent(s, kind, label, a - t0, b - t0))
                if kind == "forward" and d == first_device[s]:
                    fwd[s].append(b - a)
                elif kind == "backward" and d == first_device[s]:
                    bwd[s].append(b - a)
            for t in st["transfers"]:
                key = ((t["src"], t["dst"]), t["phase"], t["microbatch"])
                if t["role"] != "send":
                    arrived[key] = max(arrived.get(key, t["end"]), t["end"])
                    continue
                sends[key] = max(sends.get(key, 0.0), t["end"] - t["start"])
                departed[key] = min(departed.get(key, t["start"]), t["start"])
        transfer_s: dict[Lane, list[float]] = {}
        for (lane, _, _), dur in sorted(sends.items()):
            transfer_s.setdefault(lane, []).append(dur)
        arrival_s: dict[Lane, list[float]] = {}
        for key, end in sorted(arrived.items()):
            if key in departed:
                arrival_s.setdefault(key[0], []).append(end - departed[key])
        events.sort(key=lambda e: (e.stage, e.start_s))
        return IterationResult(
            schedule=schedule,
            overlap=overlap,
            iteration_s=t_end - t0,
            driver_s=driver_s,
            losses=[losses.get(k, math.nan) for k in range(schedule.n_microbatches)],
            peak_activations=tuple(peaks),
            forward_s=fwd,
            backward_s=bwd,
            transfer_s=transfer_s,
            events=events,
            arrival_s=arrival_s,
            rendezvous=bool(self.kernel_lanes),
        )

    # -- utilities

    def apply(self, fn: Callable, *args, stages: Sequence[int] | None = None) -> list[list[Any]]:
        """Run ``fn(ctx, *args)`` on every device of the chosen stages (default all), between
        iterations (read gradients, step an optimizer); results per stage, per device in mesh order."""
        self._ensure_installed()
        chosen = range(self.n_stages) if stages is None else list(stages)
        devices = [d for s in chosen for d in self.meshes[s].device_ids]
        values = dict(
            zip(
                devices,
                self._call(devices, _apply, lambda d: (self.pipeline_id, fn, args), self.timeout_s, "apply"),
                strict=True,
            )
        )
        return [[values[d] for d in self.meshes[s].device_ids] for s in chosen]

    def close(self) -> None:
        """Stop the workers' threads and drop their state (the meshes stay up)."""
        if self._closed:
            return
        self._closed = True
        try:  # also after a failure that left workers to be re-installed
            self._call(self.devices, _uninstall, lambda d: (self.pipeline_id,), 30.0, "closing the pipeline")
        except Exception:  # noqa: BLE001 - best effort at shutdown: a dead or closed mesh has nothing left
            pass
        self._forget_groups()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


#: How many follow-on errors a pipeline error's message lists (all are in ``PipelineError.errors``).
FOLLOW_ON_SHOWN = 8


def _one_line(e: dict) -> str:
    """One worker's error as a line: where, which transfer, what."""
    where = f"stage {e['stage']} (device {e['device']})"
    if e["microbatch"] is not None:
        where += f" {e['phase']}{e['microbatch']}"
    transfer = f" [{e['transfer']}]" if "transfer" in e else ""
    first = (e["message"].splitlines() or [""])[0]
    return f"  {where}{transfer} {e['kind']}: {e['type']}: {first[:240]}"


def _as_error(errors: Sequence[dict]) -> PipelineError:
    """The root cause among the workers' errors: a user error first, then the earliest."""
    root = min(errors, key=lambda e: (list(ErrorKind).index(ErrorKind(e["kind"])), e["time"]))
    phase = {"F": "forward", "B": "backward"}.get(root["phase"], "step")
    where = f"stage {root['stage']} (device {root['device']})"
    if root["microbatch"] is not None:
        where += f" {phase} of microbatch {root['microbatch']}"
    what = {
        ErrorKind.USER: "raised",
        ErrorKind.SLOW: "timed out:",
        ErrorKind.TRANSFER: "transfer failed:",
        ErrorKind.TIMEOUT: "timed out:",
    }.get(ErrorKind(root["kind"]), "failed:")
    extra = f" [{root['transfer']}]" if "transfer" in root else ""
    message = f"{where}{extra} {what} {root['type']}: {root['message']}"
    if len(errors) > 1:
        message += f" (+{len(errors) - 1} follow-on error(s) on other workers)"
    message += "\n--- remote traceback ---\n" + root["traceback"]
    later = sorted((e for e in errors if e is not root), key=lambda e: e["time"])
    if later:
        message += "\n--- follow-on errors, earliest first ---\n" + "\n".join(map(_one_line, later[:FOLLOW_ON_SHOWN]))
        if len(later) > FOLLOW_ON_SHOWN:
            message += f"\n... and {len(later) - FOLLOW_ON_SHOWN} more (PipelineError.errors)"
    cls = PipelineTimeout if ErrorKind(root["kind"]) in (ErrorKind.TIMEOUT, ErrorKind.SLOW) else PipelineError
    return cls(
        message,
        kind=ErrorKind(root["kind"]),
        stage=root["stage"],
        device=root["device"],
        microbatch=root["microbatch"],
        phase=root["phase"],
        remote_traceback=root["traceback"],
        errors=errors,
    )
