"""Driver side of the runtime: device registry, program and group bookkeeping, dispatch, failure.

One ``Runtime`` per driver process (``runtime()``). It never touches tensor bytes during a
reshard; it decides, ships small messages and waits with deadlines:

* Programs. A plan (cached by ``plan_reshard``) is validated, lowered, validated again and
  msgpack-encoded per device ONCE (``Lowered``, cached by problem). Each device's program is
  shipped with the first run that needs it and cached by id on the actor; the driver mirrors every
  actor's program cache (LRU, ``max_programs``) and piggybacks evictions on later calls. A repeated
  reshard is one small ``run(program_id, ...)`` call per participating actor.
* Groups. ``GroupTable`` says which communicator groups are live at which generation. New groups
  of a run get their rendezvous in ONE batched ``Backend.rendezvous`` call; the ``(group,
  generation, info)`` updates ride on the same ``run`` call. Groups evicted by the per-device bound
  are dropped on every member (pending drops ride on the member's next call).
* Failure. Completion is gathered with a deadline. If an actor died (``WorkerDied``), timed out
  (``ReshardTimeout``) or failed (``ReshardError``), the driver marks dead devices, forgets every
  group of the failed run (and every group of a dead device), and sends each surviving participant
  one ``cleanup`` call that frees its partial destination shard and aborts those generations.
  The source shards are never written, so the source tensor stays intact.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from reshard.errors import MeshClosed, ReshardError, ReshardTimeout, WorkerDied
from reshard.layout import Layout
from reshard.lowering import Program, lower_plan
from reshard.plan import ReshardPlan
from reshard.pulls import pull_sources, to_pulls
from reshard.runtime.communicator import PeerFailed
from reshard.runtime.groups import GroupTable, group_key
from reshard.serialize import encode_device_program
from reshard.validate import validate_plan, validate_program
from topology.cluster import Cluster
from topology.mesh import Mesh

log = logging.getLogger(__name__)
_RESHIP = object()  # program-cache mirror value: ship this program again with the next run


@dataclass
class DeviceRecord:
    """What the driver knows about one device actor."""

    id: int
    actor: object
    host: int
    backend: str
    node_id: str
    max_communicators: int
    max_programs: int
    owner: str  # description of the mesh that created it, for messages
    shared_memory: bool = False  # allocates its shards in shared memory (peers on its node may pull)
    state: str = "alive"  # alive | closed | dead
    reason: str = ""
    programs: OrderedDict = field(default_factory=OrderedDict)  # mirror of the actor's program cache
    group_drops: list = field(default_factory=list)  # pending (group, generation) drops
    program_drops: list = field(default_factory=list)  # pending program-id drops

    def take_updates(self) -> dict:
        out = {"group_drops": self.group_drops, "program_drops": self.program_drops, "group_sets": []}
        self.group_drops, self.program_drops = [], []
        return out

    def take_run_updates(self, group_sets) -> dict | None:
        """The updates for a run call, or None when there are none (the common repeated run)."""
        if not (self.group_drops or self.program_drops or group_sets):
            return None
        out = {"group_drops": self.group_drops, "program_drops": self.program_drops, "group_sets": group_sets or []}
        self.group_drops, self.program_drops = [], []
        return out


@dataclass(frozen=True)
class Lowered:
    """A plan lowered, validated and encoded for shipping."""

    pid: int
    plan: ReshardPlan
    program: Program
    blobs: dict  # device -> msgpack bytes of its DeviceProgram
    groups: tuple  # every communicator key the program uses
    participants: tuple  # devices that get a run call (ops or a destination shard)
    pulls_from: dict  # device -> the devices whose source shards it pulls (``reshard.pulls``)


class Runtime:
    def __init__(self):
        self.lock = threading.RLock()
        self.devices: dict[int, DeviceRecord] = {}
        self.backends: dict[str, object] = {}
        self.groups = GroupTable()
        self.lowered: OrderedDict = OrderedDict()
        self.max_lowered = 512
        self.meshes: dict = {}  # abstract Mesh -> live DeviceMeshes over it (latest last)
        self.closed_meshes: dict = {}  # abstract Mesh -> why it is closed
        self.stats: Counter = Counter()
        self._last_raw: dict = {}  # device -> (run_s, elapsed_s, comm_s, peak_bytes) of the last run
        self._device_ids = itertools.count()
        self._host_ids = itertools.count()
        self._program_ids = itertools.count(1)
        self._names = itertools.count(1)
        self._node_hosts: dict[str, int] = {}
        self._session = None
        self._live_cluster: Cluster | None = None
        self._clusters: dict = {}
        self._pull_layouts: dict = {}

    # ---------------------------------------------------------------- ids and session

    def new_device_ids(self, n: int) -> list[int]:
        with self.lock:
            return [next(self._device_ids) for _ in range(n)]

    def new_host_ids(self, n: int) -> list[int]:
        with self.lock:
            return [next(self._host_ids) for _ in range(n)]

    def host_of_node(self, node_id: str) -> int:
        with self.lock:
            if node_id not in self._node_hosts:
                self._node_hosts[node_id] = next(self._host_ids)
            return self._node_hosts[node_id]

    def new_buffer_name(self) -> str:
        with self.lock:
            return f"t{next(self._names)}"

    def check_session(self) -> None:
        """Ray may have been shut down and started again: old actors are gone then."""
        import ray

        if not ray.is_initialized():
            raise MeshClosed("Ray is not running (ray.shutdown() was called?); create new meshes after ray.init()")
        rc = ray.get_runtime_context()
        session = (rc.get_node_id(), rc.get_job_id())  # job ids restart at 1 in a new cluster
        with self.lock:
            if self._session is None:
                self._session = session
            elif session != self._session:
                for rec in self.devices.values():
                    if rec.state == "alive":
                        rec.state, rec.reason = "closed", "Ray was restarted"
                self.groups = GroupTable()
                self.backends.clear()
                self._session = session

    # ---------------------------------------------------------------- registry

    def add_devices(self, records: list[DeviceRecord], backend) -> None:
        with self.lock:
            for r in records:
                self.devices[r.id] = r
            self.backends.setdefault(records[0].backend, backend)

    def register_mesh(self, dmesh) -> None:
        with self.lock:
            self.meshes.setdefault(dmesh.mesh, []).append(dmesh)
            self.closed_meshes.pop(dmesh.mesh, None)

    def unregister_mesh(self, dmesh, reason: str) -> None:
        with self.lock:
            live = self.meshes.get(dmesh.mesh, [])
            if dmesh in live:
                live.remove(dmesh)
            if not live:
                self.meshes.pop(dmesh.mesh, None)
                self.closed_meshes[dmesh.mesh] = reason

    def resolve_mesh(self, mesh, what: str):
        """The live DeviceMesh whose abstract mesh is ``mesh`` (the latest one built over it)."""
        with self.lock:
            live = self.meshes.get(mesh)
            dmesh = live[-1] if live else None
            if dmesh is None:
                if mesh in self.closed_meshes:
                    raise MeshClosed(f"{what}: {self.closed_meshes[mesh]}; create a new mesh (DeviceMesh.create)")
                raise ValueError(
                    f"{what}: mesh {mesh} is not a live DeviceMesh of this runtime; build the layout from a "
                    "DeviceMesh (Layout(device_mesh, placements)), not from a plain topology.Mesh"
                )
        dmesh.check_open()
        return dmesh

    def check_devices(self, devices, what: str) -> None:
        with self.lock:
            for d in devices:
                rec = self.devices.get(d)
                if rec is None:
                    raise ValueError(f"{what}: device {d} belongs to no DeviceMesh of this runtime")
                if rec.state == "closed":
                    raise MeshClosed(f"{what}: device {d} is closed ({rec.reason}); use a live mesh")
                if rec.state == "dead":
                    raise WorkerDied(
                        f"{what}: device {d} died earlier ({rec.reason}); its mesh ({rec.owner}) is broken: "
                        "shut it down and create a new one"
                    )

    def records(self, devices) -> list[DeviceRecord]:
        with self.lock:
            return [self.devices[d] for d in devices]

    def close_devices(self, devices, reason: str) -> None:
        with self.lock:
            for d in devices:
                rec = self.devices.get(d)
                if rec is not None and rec.state == "alive":
                    rec.state, rec.reason = "closed", reason
                self._drop_device_groups(d)

    def mark_dead(self, device: int, reason: str) -> None:
        with self.lock:
            rec = self.devices.get(device)
            if rec is not None and rec.state == "alive":
                rec.state, rec.reason = "dead", reason
            self._drop_device_groups(device)

    def _drop_device_groups(self, device: int) -> None:
        for g, gen in self.groups.forget_device(device):
            for d in g:
                rec = self.devices.get(d)
                if rec is not None and d != device:
                    rec.group_drops.append((g, gen))

    # ---------------------------------------------------------------- programs

    def planning_cluster(self, backend: str, *meshes) -> Cluster:
        """The cost model "auto" plans for: the meshes' hosts with the live Ray cluster's link
        figures (``Cluster.from_ray``) and the collective library that will run the plan."""
        key = (backend, *meshes)  # the devices matter, not only the hosts: devices per host
        with self.lock:
            hit = self._clusters.get(key)
            if hit is None:
                if self._live_cluster is None:
                    self._live_cluster = Cluster.from_ray()
                live = self._live_cluster
                sized = Cluster.for_meshes(*meshes, nic_GBps=live.nic_GBps, intra_host_GBps=live.intra_host_GBps)
                hit = dataclasses.replace(
                    sized, latency_us=live.latency_us, intra_host_latency_us=live.intra_host_latency_us,
                    backend=backend, name="ray",
                )  # fmt: skip
                self._clusters[key] = hit
            return hit

    def memory_domains(self, src_mesh, dst_mesh, shared: dict) -> dict:
        """``{device: Ray node}`` of the devices that may take part in pulls between ``src_mesh``
        and ``dst_mesh``: devices that keep their shards in shared memory, and of the source
        devices only those whose shard is in it (``shared``: its descriptor)."""
        with self.lock:
            out = {}
            for d in (*src_mesh.device_ids, *dst_mesh.device_ids):
                rec = self.devices[d]
                if rec.shared_memory and (d in shared or d not in src_mesh.device_ids):
                    out[d] = rec.node_id
        return out

    def planning_layouts(self, src: Layout, dst: Layout, domain_of: dict) -> tuple[Layout, Layout]:
        """``src``/``dst`` with every device of a shared-memory domain on one host (its Ray node's):
        what "auto" should plan for when those transfers become pulls (no relays through a
        logical host that is not a real one). Unchanged without domains."""
        if not domain_of:
            return src, dst
        key = (src, dst, tuple(sorted(domain_of.items())))
        with self.lock:
            hit = self._pull_layouts.get(key)
            if hit is None:

                def remap(layout: Layout) -> Layout:
                    m = layout.mesh
                    hosts = [
                        self.host_of_node(domain_of[d]) if d in domain_of else h
                        for d, h in zip(m.device_ids, m.host_ids, strict=True)
                    ]
                    return Layout(Mesh(m.shape, m.device_ids, hosts, axis_names=m.axis_names), layout.placements)

                hit = self._pull_layouts[key] = (remap(src), remap(dst))
                if len(self._pull_layouts) > self.max_lowered:
                    self._pull_layouts.pop(next(iter(self._pull_layouts)))
            return hit

    def lower(self, plan: ReshardPlan, cluster: Cluster | None = None, domain_of: dict | None = None) -> Lowered:
        """Lower, validate and encode ``plan`` (cached). ``domain_of`` maps devices to their
        shared-memory domain: transfers inside one become pulls (``reshard.pulls``)."""
        domains = tuple(sorted(domain_of.items())) if domain_of else ()
        key = (plan.shape, plan.dtype, plan.src, plan.dst, plan.strategy, cluster, domains)
        with self.lock:
            hit = self.lowered.get(key)
            if hit is not None:
                self.lowered.move_to_end(key)
                return hit
        validate_plan(plan)
        program = lower_plan(plan)
        validate_program(program)
        if domains:
            program = to_pulls(program, domain_of)
            validate_program(program)
        blobs = {}
        participants = []
        for p in program.devices:
            if p.ops or p.dst_shape is not None:
                participants.append(p.device)
                blobs[p.device] = encode_device_program(p, program.dtype)
        groups = program.groups  # communicators only: COPY and PULL ops need none
        with self.lock:
            lowered = Lowered(
                next(self._program_ids), plan, program, blobs, tuple(groups), tuple(participants), pull_sources(program)
            )
            self.lowered[key] = lowered
            while len(self.lowered) > self.max_lowered:
                self.lowered.popitem(last=False)
            self.stats["plans_lowered"] += 1
        return lowered

    # ---------------------------------------------------------------- groups

    def _admit_groups(self, groups, extra_updates: dict[int, dict]) -> None:
        """Make ``groups`` live; fill ``extra_updates[device]['group_sets'/'group_drops']``."""
        if not groups:
            return
        members = sorted({d for g in groups for d in g})
        capacity = {d: self.devices[d].max_communicators for d in self.devices if self.devices[d].state == "alive"}
        create, drop = self.groups.admit(groups, capacity)
        for g, gen in drop:
            for d in g:
                self.devices[d].group_drops.append((g, gen))
        if create:
            backend_name = self.devices[members[0]].backend
            backend = self.backends[backend_name]
            actors = {d: self.devices[d].actor for d in sorted({d for g in create for d in g})}
            try:
                rdvs = backend.rendezvous(list(create), actors)
            except BaseException:
                self.groups.forget(create)
                raise
            gens = self.groups.commit(create)
            self.stats["rendezvous_calls"] += 1
            self.stats["groups_created"] += len(create)
            for r in rdvs:
                g = group_key(r.group)
                for d in g:
                    extra_updates.setdefault(d, {}).setdefault("group_sets", []).append((g, gens[g], r.info))

    def ensure_groups(self, groups, timeout_s: float = 60.0) -> None:
        """Set up communicator groups (sorted device tuples) on their members, one call per
        member, so functions run by ``call`` can use ``ctx.communicator(group)``."""
        groups = [group_key(g) for g in groups]
        members = sorted({d for g in groups for d in g})
        self.check_devices(members, "ensure_groups")
        with self.lock:
            sets: dict[int, dict] = {}
            self._admit_groups(groups, sets)
            refs = {}
            for d in members:
                rec = self.devices[d]
                updates = rec.take_updates()
                updates["group_sets"] = sets.get(d, {}).get("group_sets", [])
                refs[d] = rec.actor.update.remote(updates)
        results, errors, pending = gather(refs, timeout_s)
        if errors or pending:
            with self.lock:
                for d, (kind, err) in errors.items():
                    if kind == "died":
                        self.mark_dead(d, str(err))
                self.groups.forget(groups)
            raise _classify(errors, pending, f"ensure_groups({groups})", timeout_s)

    # ---------------------------------------------------------------- execution

    def execute(
        self, lowered: Lowered, src_name: str | None, dst_name: str, timeout_s: float, what: str, shared=None
    ) -> dict:
        """Run a lowered program: one ``run`` call per participant (one packed argument; updates
        only when there are any); ``shared`` maps source devices to their shards' shared-memory
        descriptors, for the devices that pull. Returns per-device raw results (see ``last_run``;
        the last item is the destination shard's descriptor)."""
        with self.lock:
            self.check_devices(lowered.participants, what)
            sets: dict[int, dict] = {}
            self._admit_groups(lowered.groups, sets)
            refs = {}
            for d in lowered.participants:
                rec = self.devices[d]
                blob = None
                if rec.programs.get(lowered.pid, _RESHIP) is _RESHIP:
                    blob = lowered.blobs[d]
                    self.stats["programs_shipped"] += 1
                rec.programs[lowered.pid] = None
                rec.programs.move_to_end(lowered.pid)
                while len(rec.programs) > rec.max_programs:
                    old, _ = rec.programs.popitem(last=False)
                    rec.program_drops.append(old)
                updates = rec.take_run_updates(sets[d].get("group_sets") if d in sets else None)
                # one packed argument per call: Ray serializes one small tuple
                holders = lowered.pulls_from.get(d)
                pulls = {h: shared[h] for h in holders} if holders else None
                refs[d] = rec.actor.run.remote((lowered.pid, blob, updates, src_name, dst_name, timeout_s, pulls))
            self.stats["runs"] += 1
            self.stats["run_calls"] += len(refs)
        results, errors, pending = gather(refs, timeout_s, settle_s=SETTLE_S)
        if not errors and not pending:
            self._last_raw = results
            return results
        self._fail(lowered, refs, errors, pending, dst_name)
        raise _classify(errors, pending, what, timeout_s)

    @property
    def last_run(self) -> dict:
        """Per-device statistics of the last successful run (for diagnostics and benchmarks):
        ``run_s`` (the actor's whole call), ``elapsed_s`` (its program), ``comm_s`` (inside
        communication calls), ``peak_bytes`` (destination + staging bytes it held)."""
        return {
            d: {"run_s": r[0], "elapsed_s": r[1], "comm_s": r[2], "peak_bytes": r[3]}
            for d, r in self._last_raw.items()
        }

    def _fail(self, lowered: Lowered, refs, errors, pending, dst_name) -> None:
        with self.lock:
            self.stats["failed_runs"] += 1
            for d, (kind, err) in errors.items():
                if kind == "died":
                    self.mark_dead(d, f"actor died: {_first_line(err)}")
                    # the dead actor's program cache is gone with it
                    self.devices[d].programs.clear()
                elif lowered.pid in self.devices[d].programs:
                    # it may have failed before caching the program: ship it again next time (the
                    # entry stays, so the mirror still evicts it if the actor did cache it)
                    self.devices[d].programs[lowered.pid] = _RESHIP
            for d in pending:
                if lowered.pid in self.devices[d].programs:
                    self.devices[d].programs[lowered.pid] = _RESHIP
            drops = self.groups.forget(lowered.groups)
            for d in refs:
                rec = self.devices[d]
                mine = [(g, gen) for g, gen in drops if d in g]
                if rec.state != "alive":
                    continue
                try:
                    rec.actor.cleanup.remote(dst_name, mine)
                except Exception as e:  # the actor may be going away as well
                    log.warning("cleanup of device %d failed: %s", d, e)
            # members outside this run (none today: every group member runs) get the drops later
            for g, gen in drops:
                for d in g:
                    if d not in refs and d in self.devices:
                        self.devices[d].group_drops.append((g, gen))

    def free(self, devices, name: str) -> None:
        with self.lock:
            for d in devices:
                rec = self.devices.get(d)
                if rec is not None and rec.state == "alive":
                    rec.actor.free.remote(name)


#: After the first failure, how long the driver still collects the other participants' outcomes
#: (a peer's death reaches the others within milliseconds; what is still blocked then is left to
#: its own deadline, and the cleanup calls queue behind it).
SETTLE_S = 2.0

#: While waiting for all of a run's calls at once, how often the driver checks whether one of
#: the finished ones failed (then it switches to collecting outcomes one by one).
FAILURE_POLL_S = 0.25


def gather(refs: dict, timeout_s: float, *, settle_s: float | None = None):
    """Wait for ``refs`` (key -> ObjectRef) until all are done or ``timeout_s`` passed; with
    ``settle_s``, at most that much longer once the first one failed.

    Returns ``(results, errors, pending)``: ``errors[key] = (kind, exception)`` with kind "died"
    (the actor died), "timeout", "peer" (a consequence of a peer's failure) or "error"."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

    deadline = time.monotonic() + timeout_s
    by_ref = {r: d for d, r in refs.items()}
    results, errors = {}, {}
    # Fast path: wait for all at once (in slices, so that a failure is noticed within
    # FAILURE_POLL_S), then fetch every result with one ray.get.
    done: list = []
    waiting = list(by_ref)
    while waiting:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        ready, waiting = ray.wait(waiting, num_returns=len(waiting), timeout=min(left, FAILURE_POLL_S))
        done.extend(ready)
        if waiting and done:
            try:
                ray.get(done, timeout=max(1.0, left))
            except Exception:  # something failed: classify one by one below
                break
    if not waiting:
        try:
            values = ray.get(done, timeout=max(1.0, deadline - time.monotonic()))
        except Exception:
            values = None
        if values is not None:
            return {by_ref[r]: v for r, v in zip(done, values, strict=True)}, {}, []
    while by_ref:
        left = deadline - time.monotonic()
        # past the deadline: still collect what has finished, without waiting
        ready, _ = ray.wait(list(by_ref), num_returns=1 if left > 0 else len(by_ref), timeout=max(left, 0.0))
        if not ready:
            break
        left = max(left, 0.0)
        for r in ready:
            d = by_ref.pop(r)
            try:
                results[d] = ray.get(r, timeout=max(1.0, left))
            except RayActorError as e:
                errors[d] = ("died", e)
            except RayTaskError as e:
                cause = getattr(e, "cause", None) or e
                if isinstance(cause, RayActorError):
                    errors[d] = ("died", cause)
                elif isinstance(cause, ReshardTimeout):
                    errors[d] = ("timeout", cause)
                elif isinstance(cause, PeerFailed):
                    errors[d] = ("peer", cause)
                else:
                    errors[d] = ("error", cause)
            except GetTimeoutError as e:
                errors[d] = ("timeout", e)
            if errors and settle_s is not None:
                deadline = min(deadline, time.monotonic() + settle_s)
    return results, errors, sorted(by_ref.values())


def _first_line(err) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def _classify(errors: dict, pending: list, what: str, timeout_s: float) -> ReshardError:
    """One exception for a failed run, naming the root cause first: a dead actor, else an actor's
    own error, else a timeout, else errors that only echo a peer's failure."""
    by_kind: dict[str, list[int]] = {"died": [], "error": [], "timeout": [], "peer": []}
    for d, (kind, _) in sorted(errors.items()):
        by_kind[kind].append(d)
    shown = (by_kind["error"] + by_kind["timeout"] + by_kind["peer"])[:4]
    details = "; ".join(f"device {d}: {_first_line(errors[d][1])}" for d in shown)
    tail = " The source tensor is intact; partial destination shards were freed."
    if by_kind["died"]:
        others = f" Others: {details}." if details else ""
        return WorkerDied(f"{what}: device actor(s) {by_kind['died']} died.{others}{tail}")
    if by_kind["error"]:
        return ReshardError(f"{what}: {details}.{tail}")
    if pending or by_kind["timeout"]:
        stuck = f" devices {pending} had not finished;" if pending else ""
        return ReshardTimeout(f"{what}: did not complete within timeout_s={timeout_s:g}s;{stuck} {details}.{tail}")
    return ReshardError(f"{what}: {details}.{tail}")


_RUNTIME: Runtime | None = None
_RUNTIME_LOCK = threading.Lock()


def runtime() -> Runtime:
    global _RUNTIME
    with _RUNTIME_LOCK:
        if _RUNTIME is None:
            _RUNTIME = Runtime()
        return _RUNTIME
