"""The NCCL backend: configuration, rendezvous, communicator creation and the communicator cache."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from reshard.errors import ReshardError, ReshardTimeout, WorkerDied
from reshard.runtime.backends import cuda_buffers as cb
from reshard.runtime.backends.communicator import Backend, Group, PeerFailed, Rendezvous
from reshard.runtime.backends.cuda_buffers import nccl_version_tuple
from reshard.runtime.backends.nccl.aborts import peer_aborts, uid_digest
from reshard.runtime.backends.nccl.communicator import NcclCommunicator
from reshard.runtime.backends.nccl.ids import (
    RENDEZVOUS_INFO_VERSION,
    RendezvousInfo,
    _member_info_on_actor,
    _uid_arg,
    _uid_bytes,
    assign_id_hosts,
    bootstrap_root_threads,
    member_info,
    normalize_group,
    visible_gpu_count,
)
from reshard.runtime.backends.nccl.library import c_library
from reshard.runtime.backends.nccl.operations import Operations
from reshard.runtime.backends.nccl.settings import (
    NONBLOCKING_ENV,
    PER_PROCESS_SETTINGS,
    THREAD_NAMES_ENV,
    GpuSharing,
    agreed_settings,
    apply_env,
    effective_env,
    settings_mismatch,
    sharing_env,
)
from reshard.runtime.backends.nccl.status import NCCL_IN_PROGRESS, _Deadline, _PeerAbort, nccl_status
from reshard.runtime.backends.nccl.wedge import WedgeGuard

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 60.0


class NcclBackend(Operations, Backend):
    """NCCL broadcast groups through cupy.

    Options (all keyword, all optional, so the registry can construct it without arguments):
      env              NCCL_* variables applied in each actor before its communicators are created
                       (None: the paper's NCCL_ALGO=Ring, NCCL_PROTO=Simple unless already set; {}:
                       nothing). Pass an instance per mesh for per-mesh settings; both meshes of a
                       cross-mesh group must end up with equal settings (checked at rendezvous).
      timeout_s        deadline of the rendezvous and default deadline of creation and operations.
      cuda_device      CUDA ordinal of this actor's GPU (default: the current device, 0 under Ray's
                       CUDA_VISIBLE_DEVICES).
      gpus_per_device  GPUs each device actor reserves: 1 (default), a fraction (several actors
                       share one GPU, e.g. 0.25 for four; see ``gpu_sharing``), or 0 (none through
                       Ray: each actor uses the GPU its process sees).
      gpu_sharing      ``GpuSharing`` (or its value): how ranks on one GPU are made acceptable to NCCL.
    """

    batches = True
    stream_ordered = True

    name = "nccl"
    device_type = "cuda"  # the torch device type of the buffers this backend moves
    gpus_per_device = 1.0

    def __init__(
        self,
        *,
        env: Mapping[str, str] | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        cuda_device: int | None = None,
        gpus_per_device: float = 1.0,
        gpu_sharing: GpuSharing | str = GpuSharing.AUTO,
    ):
        self.env = effective_env(env)
        self.timeout_s = float(timeout_s)
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be positive seconds, got {timeout_s}")
        self.cuda_device = cuda_device
        gpus = float(gpus_per_device)
        if not 0 <= gpus <= 1:
            raise ValueError(
                f"NcclBackend(gpus_per_device={gpus_per_device}): one device actor drives one GPU, so give 1 "
                "(a GPU each), a fraction in (0, 1) (several actors share a GPU) or 0 (the actors reserve no GPU "
                "through Ray: each finds its own)"
            )
        self.gpus_per_device = gpus
        try:
            self.gpu_sharing = GpuSharing(gpu_sharing)
        except ValueError:
            raise ValueError(
                f"gpu_sharing={gpu_sharing!r}; choose one of {', '.join(m.value for m in GpuSharing)}"
            ) from None
        # driver-side cache: device -> (actor id, static member report)
        self._members: dict[int, tuple[str, dict]] = {}
        # actor-side state, created on first use
        # uid digest -> communicator: two channels on the same devices are two communicators
        self._comms: OrderedDict[bytes, NcclCommunicator] = OrderedDict()
        self._stagings: list[cb.StagingBuffer] = []  # every thread's (``_staging_buffer``)
        self._device: int | None = None
        self._ready = False
        self._guard = WedgeGuard()
        self._tls = threading.local()
        self._lock = threading.RLock()  # communicator creation, one at a time
        self._cache_lock = threading.Lock()  # the communicator cache (held for dict updates only)
        self._reaper: ThreadPoolExecutor | None = None  # retires dropped communicators off the runs' path
        self.stats = {
            "created": 0,
            "destroyed": 0,
            "aborted": 0,
            "create_s": 0.0,
            "ops": 0,
            "batches": 0,
            "peer_aborts": 0,
            "bootstrap_roots": 0,
            "retired": 0,
        }

    def __getstate__(self):
        # Ship only the configuration (the driver builds one and sends it to every actor of a mesh).
        return {
            "env": self.env,
            "timeout_s": self.timeout_s,
            "cuda_device": self.cuda_device,
            "gpus_per_device": self.gpus_per_device,
            "gpu_sharing": self.gpu_sharing.value,
        }

    def __setstate__(self, state):
        type(self).__init__(
            self,
            env=state["env"],
            timeout_s=state["timeout_s"],
            cuda_device=state["cuda_device"],
            gpus_per_device=state.get("gpus_per_device", 1.0),
            gpu_sharing=state.get("gpu_sharing", "auto"),
        )
        # Arriving in an actor: set this mesh's NCCL environment before anything there calls NCCL
        # (NCCL reads some variables once per process, at its first call).
        self.arrive()

    def arrive(self) -> None:
        """Apply what this backend needs of the process environment: the ``env`` its user gave,
        named NCCL threads, and for a fractional GPU the GPU-sharing variables. Non-blocking
        communicators are a setting of each communicator (``library.c_library``), not of the
        process: only where NCCL's C API cannot be reached does ``NCCL_COMM_BLOCKING=0`` go into
        the environment (logged; it would reach the process's other communicators)."""
        apply_env(self.env)
        apply_env(THREAD_NAMES_ENV, record=False)
        _nonblocking_fallback()
        version = None
        if self.gpu_sharing is GpuSharing.AUTO and self.gpus_per_device < 1:
            with contextlib.suppress(ImportError):
                _, nccl = cb.import_nccl()
                version = nccl_version_tuple(nccl.get_version())
        share = sharing_env(self.gpu_sharing, self.gpus_per_device, version, os.getpid(), socket.gethostname())
        apply_env({k: v for k, v in share.items() if k in PER_PROCESS_SETTINGS}, record=False)
        apply_env({k: v for k, v in share.items() if k not in PER_PROCESS_SETTINGS})

    # ---------------------------------------------------------------- driver side

    def rendezvous(
        self, groups: list[Group], actors: dict[int, object], timeout_s: float | None = None
    ) -> list[Rendezvous]:
        """One unique id per entry of ``groups`` (the same devices twice, as two channels name them,
        are two communicators) and every member's settings, in one batched round trip."""
        groups = [normalize_group(g) for g in groups]
        if not groups:
            return []
        missing = sorted({d for g in groups for d in g if d not in actors})
        if missing:
            raise ValueError(f"no actor for device(s) {missing} named in groups {groups}")
        hosts = assign_id_hosts(groups)
        per_host: dict[int, list[int]] = {}  # device -> the positions in ``groups`` it makes ids for
        for i, host in enumerate(hosts):
            per_host.setdefault(host, []).append(i)
        members = sorted({d for g in groups for d in g})
        cached = {d: self._cached_member(d, actors[d]) for d in members}
        ask = [d for d in members if d in per_host or cached[d] is None]
        reports = {d: report for d, report in cached.items() if report is not None}

        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        timeout = self.timeout_s if timeout_s is None else timeout_s
        refs = []
        for dev in ask:
            handle = actors[dev]
            if not hasattr(handle, "__ray_call__"):
                raise TypeError(f"actor of device {dev} is not a Ray actor handle with __ray_call__ (Ray >= 2.40)")
            refs.append(handle.__ray_call__.remote(_member_info_on_actor, len(per_host.get(dev, ()))))
        try:
            results = ray.get(refs, timeout=timeout)
        except GetTimeoutError as e:
            raise ReshardTimeout(
                f"NCCL rendezvous: devices {ask} did not return unique ids and settings within {timeout:.1f}s"
            ) from e
        except RayActorError as e:
            raise WorkerDied(f"NCCL rendezvous: an actor of devices {ask} died: {e}") from e
        except RayTaskError as e:
            cause = e.cause if hasattr(e, "cause") else e
            if isinstance(cause, ImportError):
                raise RuntimeError(f"NCCL rendezvous failed on an actor: {cause}") from e
            raise ReshardError(f"NCCL rendezvous failed on an actor: {cause}") from e
        uid_of: dict[int, tuple[bytes, int]] = {}  # position in ``groups`` -> (unique id, its maker)
        for dev, res in zip(ask, results, strict=True):
            for i, uid in zip(per_host.get(dev, ()), res["uids"], strict=True):
                uid_of[i] = (uid, dev)
            static = {k: v for k, v in res.items() if k != "uids"}
            reports[dev] = static
            key = _actor_key(actors[dev])
            if key is not None:
                self._members[dev] = (key, static)
        return [Rendezvous(g, self._group_info(g, *uid_of[i], reports)) for i, g in enumerate(groups)]

    def abort_rendezvous(self, rendezvous: list[Rendezvous], reason: str = "aborted") -> None:
        """Members still creating these groups give up at once: each is sent the abort notice of its
        group's unique id, as a member that aborted would send (their creation polls read it)."""
        for r in rendezvous:
            info = r.info
            if isinstance(info, Mapping) and "uid" in info:
                addresses = [tuple(a) for a in info.get("abort_to", ())]
                peer_aborts().notify(addresses, _uid_bytes(info["uid"]))

    def _cached_member(self, device: int, handle) -> dict | None:
        hit = self._members.get(device)
        if hit is None or hit[0] != _actor_key(handle):
            return None
        return hit[1]

    @staticmethod
    def _group_info(group: Group, uid: bytes, host: int, reports: Mapping[int, dict]) -> RendezvousInfo:
        settings = agreed_settings(group, {d: (reports[d]["settings"], reports[d]["applied"]) for d in group})
        versions = {d: reports[d]["nccl"] for d in group}
        if len(set(versions.values())) > 1:
            shown = ", ".join(
                f"device {d}: NCCL {'.'.join(map(str, nccl_version_tuple(v)))}" for d, v in versions.items()
            )
            raise RuntimeError(
                f"members of NCCL group {group} load different NCCL versions ({shown}); NCCL refuses mismatched "
                "versions. Install one nvidia-nccl wheel on every node (the GPU extra matching your CUDA: "
                "pip install 'meshreshard[gpu-cu12]' or 'meshreshard[gpu-cu13]')"
            )
        return {
            "v": RENDEZVOUS_INFO_VERSION,
            "uid": bytes(uid),
            "host": int(host),
            "settings": settings,
            "abort_to": [list(reports[d]["abort_to"]) for d in group],
            "nccl": int(versions[group[0]]),
        }

    def local_rendezvous(self, groups: list[Group]) -> list[Rendezvous]:
        """Ids generated in this process, every rank in this process (single-process use, tests)."""
        groups = [normalize_group(g) for g in groups]
        self.arrive()
        report = member_info(len(groups))
        uids = report.pop("uids")
        out = []
        for g, uid in zip(groups, uids, strict=True):
            out.append(Rendezvous(g, self._group_info(g, uid, -1, dict.fromkeys(g, report))))
        return out

    # ---------------------------------------------------------------- actor side: setup

    def _ensure_actor(self, device: int):
        """Per-process setup on first use: env, CUDA device, the abort-notice socket."""
        if self._ready:
            if device != self._device and self._device is not None:
                # one backend instance serves one device (one GPU per actor)
                raise ValueError(f"this NcclBackend serves device {self._device}, not {device}")
            return
        apply_env(self.env)
        apply_env(THREAD_NAMES_ENV, record=False)
        _nonblocking_fallback()
        cupy, _ = cb.import_nccl()
        if visible_gpu_count() < 1:
            raise RuntimeError(
                "the NCCL backend needs a CUDA device and none is visible to this process "
                "(no GPU, no driver, or the actor was started without num_gpus); use the gloo backend on CPUs"
            )
        cb.check_gpu_stack()
        if self.cuda_device is None:
            self.cuda_device = cupy.cuda.Device().id
        self._device = device
        peer_aborts()
        self._ready = True

    def setup_actor(self, device: int, cuda_device: int | None) -> None:
        """The device's GPU is the one its context chose (not whichever the first caller's thread had current)."""
        if self.cuda_device is None and cuda_device is not None:
            self.cuda_device = cuda_device

    def reserve_staging(self, nbytes: int) -> None:
        """Pre-allocate the calling thread's staging buffer (for non-contiguous buffers)."""
        if not self._ready:
            raise RuntimeError("reserve_staging() before connect()")
        self._staging_buffer().reserve(nbytes)

    @property
    def stream(self):
        """The stream the calling thread's operations go to (cupy stream): its current one, or the
        backend's stream of this thread; for callers that want to order work after it."""
        return self._thread_stream()

    def live_groups(self) -> list[Group]:
        return [c.group for c in self._comms.values()]

    # ---------------------------------------------------------------- calls into NCCL

    def _call(self, fn, deadline: float, what: str) -> bool:
        """One NCCL call under the wedge guard; True if NCCL answered ``ncclInProgress``."""
        with self._guard.inside(deadline, what):
            try:
                fn()
            except Exception as e:
                if nccl_status(e) == NCCL_IN_PROGRESS:
                    return True
                raise
        return False

    def _async_state(self, raw, deadline: float) -> bool:
        """True while ``raw`` has a non-blocking call in progress; raises its asynchronous error."""
        return self._call(raw.check_async_error, deadline, "ncclCommGetAsyncError")

    def _abort(self, comm: NcclCommunicator) -> None:
        """Abort ``comm`` now, or, while another thread queues operations on it, as soon as that
        thread checks it or lets go of it (NCCL allows no abort under a caller)."""
        if comm.aborted or comm.closed:
            self._forget(comm)
            return
        if not comm.lock.acquire(blocking=False):
            comm.abort_requested = True
            if not comm.lock.acquire(blocking=False):
                return  # the holder serves it: it checks the request after it let go
        try:
            self._abort_now(comm)
        finally:
            comm.lock.release()

    def _abort_now(self, comm: NcclCommunicator, *, notify: bool = True) -> None:
        """Abort ``comm`` (the caller holds its lock) and tell the other members (local
        ``ncclCommAbort``: never waits for peers)."""
        if comm.aborted or comm.closed:
            self._forget(comm)
            return
        comm.aborted = True
        if getattr(comm.raw, "comm", 0):
            with self._guard.inside(time.monotonic() + self.timeout_s, f"ncclCommAbort(group={comm.group})"):
                comm.raw.abort()
        others = [a for r, a in enumerate(comm.abort_to) if r != comm.rank]
        if notify and others:
            peer_aborts().notify(others, comm.uid)
        self._forget(comm)

    def _retire(self, comm: NcclCommunicator) -> None:
        """Release a communicator nobody uses any more (its group was dropped) on the backend's
        reaper thread: a local abort, which never waits for peers, unlike ``ncclCommDestroy``
        (collective inside a node), and never tells them (they drop it too)."""
        if comm.aborted or comm.closed:
            self._forget(comm)
            return
        if self._reaper is None:
            with self._cache_lock:
                if self._reaper is None:
                    self._reaper = ThreadPoolExecutor(1, thread_name_prefix="reshard-nccl-reaper")
        self._reaper.submit(self._retire_now, comm)

    def _retire_now(self, comm: NcclCommunicator) -> None:
        try:
            with comm.lock:
                self._abort_now(comm, notify=False)
            self.stats["retired"] += 1
        except Exception as e:  # logged: a retirement has nobody to report to
            log.warning("device %s: retiring the communicator of group %s failed: %s", self._device, comm.group, e)

    def _abort_raws(self, raws: list, infos: list[Mapping[str, Any]], rank_of: list[int]) -> None:
        """Abort half-made communicators (creation failed) and tell the other members."""
        for raw, info, rank in zip(raws, infos, rank_of, strict=False):
            if getattr(raw, "comm", 0):
                with self._guard.inside(time.monotonic() + self.timeout_s, "ncclCommAbort(creation)"):
                    raw.abort()
            others = [a for r, a in enumerate(info.get("abort_to", ())) if r != rank]
            peer_aborts().notify(others, _uid_bytes(info["uid"]))
        for info in infos:
            peer_aborts().unwatch(_uid_bytes(info["uid"]))

    # ---------------------------------------------------------------- actor side: communicators

    def connect(self, rendezvous: Rendezvous, device: int, timeout_s: float) -> NcclCommunicator:
        return self.connect_many([rendezvous], device, timeout_s)[0]

    def connect_many(self, rendezvous: list[Rendezvous], device: int, timeout_s: float) -> list[NcclCommunicator]:
        """This device's communicators for ``rendezvous``; the new ones are created in ONE NCCL
        group call, so actors that create overlapping sets of groups cannot deadlock on the order.
        Raises ReshardTimeout if peers do not join within ``timeout_s``, PeerFailed if a member
        aborted its side meanwhile."""
        with self._lock:
            return self._connect_many(rendezvous, device, timeout_s)

    def _connect_many(self, rendezvous: list[Rendezvous], device: int, timeout_s: float) -> list[NcclCommunicator]:
        self._ensure_actor(device)
        todo: dict[bytes, tuple[Group, Rendezvous]] = {}
        for r in rendezvous:
            g = normalize_group(r.group)
            if device not in g:
                raise ValueError(f"device {device} is not a member of group {g}")
            info = r.info
            if not isinstance(info, Mapping) or info.get("v") != RENDEZVOUS_INFO_VERSION:
                version = info.get("v") if isinstance(info, Mapping) else None
                raise ValueError(
                    f"rendezvous of group {g} has info version {version}, this backend reads "
                    f"{RENDEZVOUS_INFO_VERSION}: driver and actors run different versions of reshard"
                )
            # A rendezvous names one communicator (its unique id): another channel on the same
            # devices, or a group re-created after a failure, is another communicator.
            digest = uid_digest(_uid_bytes(info["uid"]))
            if digest not in self._comms and digest not in todo:
                todo[digest] = (g, r)
        if todo:
            # every member creates in the same order: by group, then by unique id
            self._create([todo[k] for k in sorted(todo, key=lambda k: (todo[k][0], k))], device, timeout_s)
        out = []
        with self._cache_lock:
            for r in rendezvous:
                digest = uid_digest(_uid_bytes(r.info["uid"]))
                self._comms.move_to_end(digest)
                out.append(self._comms[digest])
        return out

    def _create(self, items: list[tuple[Group, Rendezvous]], device: int, timeout_s: float) -> None:
        cupy, nccl = cb.import_nccl()
        apply_env(self.env)
        groups = [g for g, _ in items]
        infos = [r.info for _, r in items]
        for g, info in zip(groups, infos, strict=True):
            diff = settings_mismatch(info.get("settings", {}))
            if diff:
                shown = "; ".join(f"{k}: group {v[0]}, here {v[1]}" for k, v in diff.items())
                raise ReshardError(
                    f"device {device}: NCCL settings of this process differ from those agreed for group {g} ({shown}); "
                    "every rank must use the same settings: give all meshes the same NcclBackend(env=...)"
                )
        ranks = [g.index(device) for g in groups]
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        raws: list = []
        lib = c_library()
        uids = [_uid_bytes(info["uid"]) for info in infos]
        for uid in uids:  # a member's abort notice counts from now on
            peer_aborts().watch(uid)
        try:
            with cupy.cuda.Device(self.cuda_device):
                self._call(nccl.groupStart, deadline, "ncclGroupStart")
                try:
                    for g, info, rank in zip(groups, infos, ranks, strict=True):
                        uid = _uid_bytes(info["uid"])
                        if lib is not None:  # non-blocking by its own configuration
                            raws.append(lib.init_rank(len(g), uid, rank, blocking=False))
                        else:
                            raws.append(nccl.NcclCommunicator(len(g), _uid_arg(uid), rank))
                finally:
                    self._call(nccl.groupEnd, deadline, f"ncclGroupEnd(create {groups})")
                self._await(raws, uids, deadline)
        except _PeerAbort as e:
            self._abort_raws(raws, infos, ranks)
            raise PeerFailed(
                f"NCCL communicators for groups {groups} on device {device}: a member aborted its side while they "
                "were being created (a failure elsewhere; the driver reports it)"
            ) from e
        except _Deadline as e:
            self._abort_raws(raws, infos, ranks)
            raise ReshardTimeout(
                f"NCCL communicators for groups {groups} on device {device}: peers did not join within "
                f"{timeout_s:.1f}s (every member must connect with the same rendezvous); aborted"
            ) from e
        except Exception as e:
            self._abort_raws(raws, infos, ranks)
            raise ReshardError(f"creating NCCL communicators for groups {groups} on device {device}: {e}") from e
        self.stats["created"] += len(raws)
        self.stats["create_s"] += time.monotonic() - t0
        self.stats["bootstrap_roots"] = bootstrap_root_threads()
        with self._cache_lock:
            for g, info, raw, rank in zip(groups, infos, raws, ranks, strict=True):
                comm = NcclCommunicator(self, g, rank, timeout_s, raw, info)
                self._comms[comm.digest] = comm

    def _await(self, raws: list, uids: list[bytes], deadline: float) -> None:
        """Poll non-blocking calls of ``raws`` until none is in progress: raises the first
        asynchronous error, ``_PeerAbort`` when a member reported an abort (checked first: a peer's abort
        also shows here as a remote error), ``_Deadline`` at the deadline."""
        pending = list(zip(raws, uids, strict=True))
        aborts = peer_aborts()
        pause = 0.0
        while pending:
            # a peer's notice first: its abort also surfaces here as a remote error, which it explains
            if any(aborts.aborted(d) for _, d in pending):
                self.stats["peer_aborts"] += 1
                raise _PeerAbort
            try:
                pending = [(raw, d) for raw, d in pending if self._async_state(raw, deadline)]
            except Exception:
                if any(aborts.aborted(d) for _, d in pending):
                    self.stats["peer_aborts"] += 1
                    raise _PeerAbort from None
                raise
            if not pending:
                return
            if time.monotonic() >= deadline:
                raise _Deadline
            time.sleep(pause)
            pause = min(max(2 * pause, 2e-5), 1e-3)

    def communicator(self, group: Group) -> NcclCommunicator:
        """The communicator of ``group`` connected last (KeyError if this device has none)."""
        group = normalize_group(group)
        for c in reversed(self._comms.values()):
            if c.group == group:
                return c
        raise KeyError(group)

    def destroy(self, groups: Iterable[Group], timeout_s: float | None = None) -> None:
        """Destroy every communicator of ``groups`` (every member destroys the same groups)."""
        wanted = {normalize_group(g) for g in groups}
        self._destroy([c for c in self._comms.values() if c.group in wanted], timeout_s)

    def _destroy(self, comms: list[NcclCommunicator], timeout_s: float | None = None) -> None:
        """Destroy idle communicators, in the order of their groups (``ncclCommDestroy``: every
        member destroys the same ones).

        cupy's ``destroy()`` discards ``ncclCommDestroy``'s return code, so the communicator's
        asynchronous error is read first: a communicator with an error, or with a call still in
        progress, is aborted instead and the error raised."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        for c in sorted(comms, key=lambda c: (c.group, c.digest)):
            g = c.group
            deadline = time.monotonic() + timeout
            if not c.lock.acquire(timeout=timeout):
                raise ReshardTimeout(f"device {self._device}: communicator of group {g} stayed busy; not destroyed")
            try:
                if c.aborted or c.closed:
                    self._forget(c)
                    continue
                try:
                    busy = self._async_state(c.raw, deadline)
                except Exception as e:
                    self._abort_now(c)
                    raise ReshardError(f"NCCL communicator of group {g} had failed ({e}); aborted it") from e
                if busy:
                    self._abort_now(c)
                    raise ReshardError(f"NCCL communicator of group {g} still had a call in progress; aborted it")
                c.closed = True
                peer_aborts().unwatch(c.uid)
                with self._cache_lock:
                    if self._comms.get(c.digest) is c:
                        del self._comms[c.digest]
                with self._guard.inside(deadline, f"ncclCommDestroy(group={g})"):
                    c.raw.destroy()
                self.stats["destroyed"] += 1
            finally:
                c.lock.release()

    def abort_all(self) -> list[Group]:
        """Abort every communicator of this actor (failure cleanup; local, never blocks on peers)."""
        groups = [c.group for c in self._comms.values()]
        for c in list(self._comms.values()):
            c.abort()
        return groups

    def _forget(self, comm: NcclCommunicator) -> None:
        peer_aborts().unwatch(comm.uid)
        with self._cache_lock:
            if self._comms.get(comm.digest) is comm:
                del self._comms[comm.digest]
                self.stats["aborted"] += 1

    def close(self) -> None:
        """Destroy every communicator and free the staging buffer."""
        try:
            if self._comms:
                self._destroy(list(self._comms.values()))
        finally:
            with self._lock:
                for staging in self._stagings:
                    staging.release()


def _nonblocking_fallback() -> None:
    """``NCCL_COMM_BLOCKING=0`` for the process, only where NCCL's C API is out of reach (no
    libnccl mapped that ctypes can bind: the communicators are cupy's, which take no configuration)."""
    try:
        if c_library() is not None:
            return
    except ImportError:
        return
    if os.environ.get("NCCL_COMM_BLOCKING") != "0":
        log.warning(
            "NCCL's C API is out of reach: setting NCCL_COMM_BLOCKING=0 for this process (it reaches its "
            "other NCCL communicators too)"
        )
        apply_env(NONBLOCKING_ENV, record=False)


def _actor_key(handle) -> str | None:
    actor_id = getattr(handle, "_actor_id", None)
    return None if actor_id is None else str(actor_id)
