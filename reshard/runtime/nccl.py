"""NCCL backend: broadcast groups over cupy's NCCL bindings (``cupy.cuda.nccl``).

Loaded lazily by the runtime's backend registry as ``reshard.runtime.nccl:NcclBackend``; this
module imports neither cupy nor torch at import time, so it can be imported (and its pure parts
tested) on a machine without GPUs.

Non-blocking communicators, one thread
    NCCL supports ``ncclCommAbort`` only on communicators no thread is inside of; aborting a
    blocking communicator from a watchdog while the caller sits in ``ncclGroupEnd`` or a lazy
    connection setup frees it under the caller. cupy exposes no ``ncclConfig_t.blocking``, so the
    backend sets ``NCCL_COMM_BLOCKING=0`` in the actor's environment when the backend arrives there
    (before the actor's first NCCL call; NCCL reads it once per process): every communicator is
    then non-blocking, every NCCL call returns at once (``ncclInProgress``: cupy raises it as
    ``KeyError(7)`` or ``NcclError`` with status 7, see ``nccl_status``), and the calling thread
    polls ``ncclCommGetAsyncError`` and CUDA events until done, an error, a peer's abort notice or
    the deadline; on failure that same thread aborts. No other thread ever calls into NCCL for a
    backend (its calls are serialised by one lock). Last resort: if NCCL nevertheless stays inside
    one call past its deadline plus ``WEDGE_GRACE_S`` (NCCL_COMM_BLOCKING was read as 1 before the
    backend set it, or NCCL itself is wedged), a guard thread ends the process
    (``WEDGED_EXIT_CODE``) so that Ray reports the actor dead instead of the actor hanging; the
    guard never touches a communicator.

Peers fail fast
    ``ncclCommAbort`` is local: peers connected over NVLink/PCIe/shared memory learn nothing and
    would wait for their whole deadline. Every actor process keeps one UDP socket
    (``PeerAborts``); the rendezvous carries each member's address, and a member that aborts a
    communicator sends a datagram naming it (a digest of its unique id) to the other members.
    Their polling loops check for that notice between NCCL calls, abort their own communicator and
    raise ``PeerFailed``. A lost datagram only means the deadline applies.

Driver side
    ``rendezvous(groups, actors)`` asks every member of the new groups, in one batched round trip
    (``ActorHandle.__ray_call__``, so any Ray actor works), for its NCCL settings, NCCL version and
    abort address (cached per actor after the first time), and the member chosen by
    ``assign_id_hosts`` for its groups' unique ids (the NCCL bootstrap root of a group then runs in
    one of its own processes). Members of one group whose settings (``SHARED_SETTINGS`` and every
    key a member's backend ``env`` sets) or NCCL versions differ are refused at once with an error
    naming both; the agreed settings travel in the rendezvous and every member checks its own
    against them before creating the communicator. Which groups are live, and the LRU bound on
    live communicators per device, are the runtime's (``reshard.runtime.groups``).

Actor side
    ``connect_many`` creates every new communicator of this actor inside ONE
    ``nccl.groupStart()/groupEnd()`` (so the order in which different actors create overlapping
    groups cannot deadlock). Every transfer runs on one dedicated communication stream: an event
    recorded on the producer's current stream makes the comm stream wait for the computation that
    wrote the buffer, and the producer stream then waits on the comm stream's completion event.
    ``with backend.grouped(): ...`` issues several operations as one NCCL group and waits once.

Unique ids and bootstrap threads
    ``ncclGetUniqueId`` starts a detached thread ("NCCL BootstrapR") with a listening socket in the
    generating process; it ends only after every rank of the group has checked in. A group that
    is never fully created (a member died, a creation timed out) leaves that thread and socket
    until the process exits: NCCL offers no call to stop it. The backend generates ids only for
    groups about to be created, counts the live roots (``bootstrap_root_threads``, in ``stats``)
    and warns when they pile up. ``ncclCommSplit`` (cupy >= 14 exposes ``commSplit`` with
    ``NcclConfig(split_share=...)``; cupy 13 does not) would avoid new ids, but it is collective
    over the whole parent communicator, which does not fit groups that only their members create
    lazily; it is not used.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import heapq
import itertools
import logging
import os
import socket
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from reshard.errors import ReshardError, ReshardTimeout, WorkerDied
from reshard.runtime import cuda_buffers as cb
from reshard.runtime.communicator import Backend, Communicator, Group, PeerFailed, Rendezvous
from reshard.runtime.cuda_buffers import nccl_version_tuple

log = logging.getLogger(__name__)

#: Broadcast settings the paper's authors forced (NCCL issue 674: broadcast of small messages and
#: two-rank groups is pathologically slow with the default algorithm/protocol choice).
PAPER_BROADCAST_ENV = {"NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple"}

#: What the backend itself sets in every actor: non-blocking communicators (see module docstring),
#: and named NCCL threads (``bootstrap_root_threads`` finds the roots by name).
NONBLOCKING_ENV = {"NCCL_COMM_BLOCKING": "0", "NCCL_SET_THREAD_NAME": "1"}

#: Settings every rank of one communicator must agree on: NCCL picks algorithm, protocol, buffer
#: sizes, channels and transports per rank, and ranks that pick differently hang or corrupt data.
SHARED_SETTINGS = (
    "NCCL_ALGO", "NCCL_PROTO", "NCCL_BUFFSIZE", "NCCL_LL_BUFFSIZE", "NCCL_LL128_BUFFSIZE", "NCCL_NTHREADS",
    "NCCL_LL128_NTHREADS", "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS", "NCCL_MIN_CTAS", "NCCL_MAX_CTAS",
    "NCCL_NCHANNELS_PER_NET_PEER", "NCCL_P2P_NET_CHUNKSIZE", "NCCL_P2P_PCI_CHUNKSIZE", "NCCL_P2P_NVL_CHUNKSIZE",
    "NCCL_P2P_DISABLE", "NCCL_P2P_LEVEL", "NCCL_SHM_DISABLE", "NCCL_CROSS_NIC", "NCCL_NVLS_ENABLE",
    "NCCL_COLLNET_ENABLE", "NCCL_RUNTIME_CONNECT", "NCCL_MULTI_RANK_GPU_ENABLE", "NCCL_PXN_DISABLE",
)  # fmt: skip

#: Settings that are per process or per host by nature: never compared between ranks.
PER_PROCESS_SETTINGS = frozenset({
    "NCCL_HOSTID", "NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_DEBUG_FILE", "NCCL_COMM_BLOCKING", "NCCL_SOCKET_IFNAME",
    "NCCL_IB_HCA", "NCCL_COMM_ID", "NCCL_TOPO_FILE", "NCCL_TOPO_DUMP_FILE", "NCCL_GRAPH_DUMP_FILE", "NCCL_CONF_FILE",
    "NCCL_SET_THREAD_NAME",
})  # fmt: skip

DEFAULT_TIMEOUT_S = 60.0
RENDEZVOUS_INFO_VERSION = 2
NCCL_IN_PROGRESS = 7  # ncclInProgress
NCCL_TIMEOUT = 8  # ncclTimeout (NCCL >= 2.30.3; cupy 14 raises it as KeyError(8))
CUDA_NOT_READY = 600  # cudaErrorNotReady
WEDGE_GRACE_S = 30.0
WEDGED_EXIT_CODE = 86
#: NCCL >= 2.30 lets several ranks share one GPU with NCCL_MULTI_RANK_GPU_ENABLE=1.
MULTI_RANK_GPU_MIN_VERSION = (2, 30, 0)
#: NCCL documents its multi-rank mode as experimental, for about two ranks per GPU, and as hanging
#: with more unless NCCL_MAX_CTAS is lowered: "auto" picks it only from half a GPU per actor up.
MULTI_RANK_MIN_SHARE = 0.5
#: How long a failed batch waits for the copies it queued on the stream before staging is reused.
STREAM_DRAIN_S = 5.0
BOOTSTRAP_ROOT_THREAD = "NCCL BootstrapR"
BOOTSTRAP_ROOTS_WARN = 64


class GpuSharing(enum.Enum):
    """How several device actors share one GPU (``NcclBackend(gpus_per_device < 1)``).

    NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU detected") unless each
    process names its own host (``NCCL_HOSTID``: NCCL then connects them like separate machines,
    sockets over loopback) or, from NCCL 2.30, ``NCCL_MULTI_RANK_GPU_ENABLE=1``."""

    AUTO = "auto"  # MULTI_RANK on NCCL >= 2.30 at >= 1/2 GPU per actor, else HOSTID; OFF with whole GPUs
    OFF = "off"
    HOSTID = "hostid"
    MULTI_RANK = "multi_rank"


# ----------------------------------------------------------------------------------------------
# Pure helpers (no cupy, no ray)


def normalize_group(group: Iterable[int]) -> Group:
    """A group is its sorted tuple of distinct global device ids; a device's rank is its index."""
    g = tuple(int(d) for d in group)
    if not g:
        raise ValueError("a communicator group needs at least one device")
    if tuple(sorted(set(g))) != g:
        raise ValueError(f"group {g} must be sorted and duplicate-free (a group is a sorted device tuple)")
    return g


def assign_id_hosts(groups: Iterable[Group]) -> dict[Group, int]:
    """For each group, the member device that generates its unique id: the member given the fewest
    ids so far (ties: lowest device id), so id generation and bootstrap roots are spread out."""
    load: dict[int, int] = {}
    out: dict[Group, int] = {}
    for g in groups:
        if g in out:
            continue
        host = min(g, key=lambda d: (load.get(d, 0), d))
        load[host] = load.get(host, 0) + 1
        out[g] = host
    return out


def effective_env(env: Mapping[str, str] | None, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """NCCL environment to apply before creating communicators.

    ``env=None`` means the paper's broadcast settings, unless the process environment already sets
    them (an explicit NCCL_ALGO / NCCL_PROTO of the user wins). An explicit dict is applied as is;
    ``{}`` applies nothing. ``NCCL_COMM_BLOCKING`` is the backend's own (always 0) and refused here.
    """
    if env is None:
        return {k: v for k, v in PAPER_BROADCAST_ENV.items() if k not in environ}
    bad = [k for k in env if not isinstance(k, str) or not k.startswith("NCCL_")]
    if bad:
        raise ValueError(f"NCCL environment keys must start with NCCL_: {bad}")
    if "NCCL_COMM_BLOCKING" in env:
        raise ValueError(
            "NcclBackend(env=...) must not set NCCL_COMM_BLOCKING: the backend needs non-blocking communicators "
            "(it sets NCCL_COMM_BLOCKING=0 itself) so that it can abort them safely"
        )
    return {k: str(v) for k, v in env.items()}


def nccl_status(error: BaseException) -> int | None:
    """The ``ncclResult_t`` behind an exception raised by cupy's NCCL bindings, else None.

    cupy raises ``NcclError(status)``; for codes missing from its message table (``ncclInProgress``
    = 7 on cupy 14, 6 and 7 on cupy 13) building that error raises ``KeyError(status)`` instead."""
    status = getattr(error, "status", None)
    if isinstance(status, int):
        return status
    if type(error) is KeyError and len(error.args) == 1 and type(error.args[0]) is int and 0 <= error.args[0] < 64:
        return error.args[0]
    return None


def local_settings(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """This process's NCCL settings that ranks may have to agree on (per-process ones left out)."""
    return {k: v for k, v in environ.items() if k.startswith("NCCL_") and k not in PER_PROCESS_SETTINGS}


def agreed_settings(group: Group, reports: Mapping[int, tuple[Mapping[str, str], Iterable[str]]]) -> dict:
    """The settings all members of ``group`` share: ``reports[device] = (its local_settings, keys
    its backend env sets)``. Compared keys: ``SHARED_SETTINGS`` and every key some member's backend
    sets (per-process keys excepted); unset is a value (None). ValueError naming both devices."""
    keys = set(SHARED_SETTINGS)
    for _, applied in reports.values():
        keys.update(k for k in applied if k not in PER_PROCESS_SETTINGS)
    keys = sorted(keys)
    first = group[0]
    want = {k: reports[first][0].get(k) for k in keys}
    for d in group[1:]:
        got = {k: reports[d][0].get(k) for k in keys}
        diff = {k: (want[k], got[k]) for k in keys if want[k] != got[k]}
        if diff:
            a = ", ".join(f"{k}={v[0]}" for k, v in diff.items())
            b = ", ".join(f"{k}={v[1]}" for k, v in diff.items())
            raise ValueError(
                f"NCCL settings differ inside group {group}: device {first} has {a}, device {d} has {b}. Every rank "
                "of a communicator must use the same NCCL settings (ranks that choose different algorithms, protocols "
                "or buffers hang or corrupt data): give both meshes the same NcclBackend(env=...), and set no "
                "different NCCL_* variables in their processes"
            )
    return {k: v for k, v in want.items() if v is not None}


def settings_mismatch(expected: Mapping[str, str], environ: Mapping[str, str] = os.environ) -> dict:
    """``{key: (expected, here)}`` for the agreed settings this process does not have (SHARED_SETTINGS
    absent from ``expected`` must be unset here too)."""
    keys = set(expected) | {k for k in SHARED_SETTINGS if k in environ}
    return {k: (expected.get(k), environ.get(k)) for k in sorted(keys) if expected.get(k) != environ.get(k)}


def sharing_env(mode: GpuSharing, gpus_per_device: float, nccl_version: tuple[int, int, int] | None,
                pid: int, hostname: str, environ: Mapping[str, str] = os.environ) -> dict[str, str]:  # fmt: skip
    """Per-process environment that lets several ranks share one GPU (empty when they do not)."""
    if mode is GpuSharing.AUTO:
        if gpus_per_device >= 1:
            return {}
        multi = nccl_version is not None and nccl_version >= MULTI_RANK_GPU_MIN_VERSION
        multi = multi and gpus_per_device >= MULTI_RANK_MIN_SHARE
        mode = GpuSharing.MULTI_RANK if multi else GpuSharing.HOSTID
    if mode is GpuSharing.OFF:
        return {}
    if mode is GpuSharing.MULTI_RANK:
        return {"NCCL_MULTI_RANK_GPU_ENABLE": "1"}
    out = {"NCCL_HOSTID": f"reshard-{hostname}-{pid}"}
    if "NCCL_SOCKET_IFNAME" not in environ:
        out["NCCL_SOCKET_IFNAME"] = "lo"  # the "hosts" share a machine: loopback
    return out


def uid_digest(uid: bytes) -> bytes:
    """16 bytes naming one communicator (its unique id) in abort notices."""
    return hashlib.blake2b(bytes(uid), digest_size=16).digest()


def bootstrap_root_threads() -> int:
    """Threads of this process that are NCCL bootstrap roots still waiting for ranks (Linux; NCCL
    names its threads only with NCCL_SET_THREAD_NAME=1, which the backend sets on arrival)."""
    n = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                n += f.read().strip() == BOOTSTRAP_ROOT_THREAD
        except OSError:
            continue
    return n


# ----------------------------------------------------------------------------------------------
# Environment of the actor process

_APPLIED_KEYS: set[str] = set()  # keys some backend's env set in this process (reported to peers)


def apply_env(env: Mapping[str, str], *, record: bool = True) -> None:
    """Set NCCL_* variables in this process (some are read per communicator, some once per process)."""
    for k, v in env.items():
        if os.environ.get(k) != v:
            if k == "NCCL_COMM_BLOCKING" and k in os.environ:
                log.warning("overriding NCCL_COMM_BLOCKING=%s with %s: the NCCL backend aborts safely only "
                            "non-blocking communicators", os.environ[k], v)  # fmt: skip
            os.environ[k] = v
        if record:
            _APPLIED_KEYS.add(k)


def nccl_available() -> bool:
    """True when cupy with NCCL imports and at least one CUDA device is visible."""
    try:
        cupy, _ = cb.import_nccl()
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def visible_gpu_count() -> int:
    """CUDA devices visible to this process (0 without cupy or without GPUs)."""
    try:
        cupy = cb.import_cupy()
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


def _uid_arg(uid: bytes):
    """cupy >= 14 takes the 128-byte id as bytes; older cupy as a tuple of signed chars."""
    probe = getattr(_uid_arg, "_bytes", None)
    if probe is None:
        import cupy

        probe = _uid_arg._bytes = int(cupy.__version__.split(".")[0]) >= 14
    if probe:
        return bytes(uid)
    return tuple(b - 256 if b > 127 else b for b in bytes(uid))


def _uid_bytes(uid) -> bytes:
    if isinstance(uid, bytes | bytearray):
        return bytes(uid)
    return bytes(b & 0xFF for b in uid)


def generate_unique_ids(n: int, env: Mapping[str, str] | None = None) -> list[bytes]:
    """``n`` fresh NCCL unique ids from this process (each starts an NCCL bootstrap root here)."""
    if env:
        apply_env(env)
    _, nccl = cb.import_nccl()
    ids = [_uid_bytes(nccl.get_unique_id()) for _ in range(n)]
    if n:
        roots = bootstrap_root_threads()
        if roots >= BOOTSTRAP_ROOTS_WARN and roots & (roots - 1) == 0:
            log.warning("%d NCCL bootstrap roots are waiting in this process for groups that were never fully "
                        "created (each a thread and a socket, kept until the process exits)", roots)  # fmt: skip
    return ids


def member_info(n_ids: int) -> dict:
    """What the rendezvous needs from one member: ``n_ids`` unique ids, its NCCL settings, the keys
    its backend set, its NCCL version and its abort address."""
    _, nccl = cb.import_nccl()
    ids = generate_unique_ids(n_ids)
    return {
        "uids": ids,
        "settings": local_settings(),
        "applied": sorted(_APPLIED_KEYS),
        "nccl": int(nccl.get_version()),
        "abort_to": list(peer_aborts().address),
    }


def _member_info_on_actor(actor_self, n_ids: int) -> dict:
    """Runs inside a member actor through ``ActorHandle.__ray_call__`` (its backend already applied
    its mesh's NCCL environment when it was unpickled there)."""
    return member_info(n_ids)


def _node_ip() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # not in a Ray process: loopback
        pass
    return "127.0.0.1"


# ----------------------------------------------------------------------------------------------
# Abort notices between members (the side channel of "peers fail fast")


class PeerAborts:
    """One UDP socket per process: receives "communicator X was aborted" notices from peers and
    sends them. A daemon thread only records digests; it never calls NCCL."""

    MAGIC = b"RSHA"
    KEEP = 4096  # digests remembered (oldest forgotten first)

    def __init__(self, host: str = "127.0.0.1"):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_DGRAM)
        self.sock.bind((host, 0))
        self.address = (host, self.sock.getsockname()[1])
        self._seen: OrderedDict[bytes, None] = OrderedDict()
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._serve, name="reshard-nccl-aborts", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                data, _ = self.sock.recvfrom(64)
            except OSError:
                return  # closed
            if len(data) == 20 and data[:4] == self.MAGIC:
                with self._cv:
                    self._seen[data[4:]] = None
                    while len(self._seen) > self.KEEP:
                        self._seen.popitem(last=False)
                    self._cv.notify_all()

    def notify(self, addresses: Iterable, digest: bytes) -> None:
        """Tell ``addresses`` that the communicator ``digest`` was aborted (never blocks, never raises)."""
        msg = self.MAGIC + bytes(digest)
        for addr in addresses:
            with contextlib.suppress(OSError, TypeError, ValueError):
                self.sock.sendto(msg, (str(addr[0]), int(addr[1])))

    def aborted(self, digest: bytes) -> bool:
        with self._cv:
            return digest in self._seen

    def wait(self, digest: bytes, timeout_s: float) -> bool:
        """True once a notice for ``digest`` arrived (False after ``timeout_s``)."""
        with self._cv:
            return self._cv.wait_for(lambda: digest in self._seen, timeout_s)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


_PEER_ABORTS: PeerAborts | None = None
_PEER_ABORTS_LOCK = threading.Lock()


def peer_aborts() -> PeerAborts:
    """This process's abort side channel (started on first use, on the Ray node's address)."""
    global _PEER_ABORTS
    with _PEER_ABORTS_LOCK:
        if _PEER_ABORTS is None:
            _PEER_ABORTS = PeerAborts(_node_ip())
        return _PEER_ABORTS


# ----------------------------------------------------------------------------------------------
# Wedge guard: ends the process when a call stays inside NCCL far past its deadline


def _exit_wedged(what: str) -> None:  # pragma: no cover - ends the process
    log.critical(
        "NCCL call %s is still blocked %.0fs after its deadline: NCCL is wedged in this process; exiting (code %d) "
        "so that the actor is reported dead", what, WEDGE_GRACE_S, WEDGED_EXIT_CODE,
    )  # fmt: skip
    for h in logging.getLogger().handlers:
        with contextlib.suppress(Exception):
            h.flush()
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    os._exit(WEDGED_EXIT_CODE)


class WedgeGuard:
    """Watches calls into NCCL: one still inside at ``deadline + grace_s`` calls ``on_wedged(what)``
    (default: exit the process). It only watches; it never touches a communicator."""

    def __init__(self, grace_s: float = WEDGE_GRACE_S, on_wedged=_exit_wedged):
        self.grace_s = float(grace_s)
        self.on_wedged = on_wedged
        self._cv = threading.Condition()
        self._heap: list[tuple[float, int]] = []
        self._inside: dict[int, str] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def inside(self, deadline: float, what: str) -> Iterator[None]:
        with self._cv:
            token = next(self._ids)
            self._inside[token] = what
            heapq.heappush(self._heap, (deadline + self.grace_s, token))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="reshard-nccl-wedge-guard", daemon=True)
                self._thread.start()
            self._cv.notify()
        try:
            yield
        finally:
            with self._cv:
                self._inside.pop(token, None)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._heap:
                    self._cv.wait()
                limit, token = self._heap[0]
                if token not in self._inside:
                    heapq.heappop(self._heap)
                    continue
                now = time.monotonic()
                if now < limit:
                    self._cv.wait(limit - now)
                    continue
                heapq.heappop(self._heap)
                what = self._inside.pop(token)
            self.on_wedged(what)


# ----------------------------------------------------------------------------------------------
# Communicator


class NcclCommunicator(Communicator):
    """This device's NCCL communicator for one group. Operations block until the data has arrived
    (or raise); inside ``backend.grouped()`` they are queued and the block's end waits for all."""

    def __init__(self, backend: NcclBackend, group: Group, rank: int, timeout_s: float, raw, info: dict):
        super().__init__(group, rank, timeout_s)
        self._backend = backend
        self.raw = raw  # cupy.cuda.nccl.NcclCommunicator
        self.uid = _uid_bytes(info["uid"])  # the rendezvous this communicator was created from
        self.digest = uid_digest(self.uid)
        self.uid_host = int(info.get("host", -1))
        self.abort_to = [tuple(a) for a in info.get("abort_to", ())]
        self.aborted = False
        self.closed = False
        self.abort_requested = False  # another thread asked for an abort while a run held the backend

    def __repr__(self) -> str:
        state = "aborted" if self.aborted else "closed" if self.closed else "live"
        return f"NcclCommunicator(group={self.group}, rank={self.rank}, {state})"

    def broadcast(self, tensor, root: int) -> None:
        self._check_peer(root)
        self._backend._issue(self, "broadcast", tensor, root)

    def send(self, tensor, peer: int) -> None:
        self._check_peer(peer)
        self._backend._issue(self, "send", tensor, peer)

    def recv(self, tensor, peer: int) -> None:
        self._check_peer(peer)
        self._backend._issue(self, "recv", tensor, peer)

    def all_reduce(self, tensor, op: str = "sum") -> None:
        if op not in cb.REDUCE_OPS:
            raise ValueError(f"unknown reduce op {op!r}; choose one of {', '.join(cb.REDUCE_OPS)}")
        self._check_peer(0)
        self._backend._issue(self, "all_reduce", tensor, op)

    def peer_aborted(self) -> bool:
        """A member of this group reported that it aborted its communicator."""
        return peer_aborts().aborted(self.digest)

    def _check_peer(self, r: int) -> None:
        if not 0 <= r < self.size:
            raise ValueError(f"rank {r} out of range for group {self.group} (size {self.size})")
        if self.aborted or self.closed:
            raise ReshardError(
                f"communicator for group {self.group} was {'aborted' if self.aborted else 'closed'}; "
                "run a new rendezvous for it"
            )

    def abort(self) -> None:
        """Abort in-flight operations, free the communicator and tell the other members (local
        ``ncclCommAbort``, never blocks on peers). From the thread that issues this actor's NCCL
        calls it happens at once; from another thread while a run holds the backend it is recorded,
        and the run's polling thread aborts within one poll (NCCL allows no abort under a caller)."""
        self._backend._abort(self)

    def close(self) -> None:
        self._backend._destroy([self])


# ----------------------------------------------------------------------------------------------
# Batches of operations (one NCCL group call)


@dataclass
class _Batch:
    grouped: bool
    deadline: float | None
    comms: dict = field(default_factory=dict)  # id -> NcclCommunicator
    unpack: list = field(default_factory=list)  # (dst, staged, framework)
    consumers: dict = field(default_factory=dict)  # stream ptr -> cupy stream
    keep: list = field(default_factory=list)  # buffers referenced until completion
    ops: list = field(default_factory=list)  # descriptions for error messages
    staged: bool = False
    open: bool = False  # inside nccl.groupStart() and not yet ended


# ----------------------------------------------------------------------------------------------
# Backend


class NcclBackend(Backend):
    """NCCL broadcast groups through cupy.

    Options (all keyword, all optional, so the registry can construct it without arguments):
      env              NCCL_* variables applied in each actor before its communicators are created
                       (None: the paper's NCCL_ALGO=Ring, NCCL_PROTO=Simple unless already set; {}:
                       nothing). Pass an instance per mesh for per-mesh settings; both meshes of a
                       cross-mesh group must end up with equal settings (checked at rendezvous).
      timeout_s        deadline of the rendezvous and default deadline of creation and operations.
      cuda_device      CUDA ordinal of this actor's GPU (default: the current device, 0 under Ray's
                       CUDA_VISIBLE_DEVICES).
      gpus_per_device  GPUs each device actor reserves: 1 (default), or a fraction (several actors
                       share one GPU, e.g. 0.25 for four; see ``gpu_sharing``).
      gpu_sharing      ``GpuSharing`` (or its value): how ranks on one GPU are made acceptable to NCCL.
    """

    batches = True

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
        if not 0 < gpus <= 1:
            raise ValueError(
                f"NcclBackend(gpus_per_device={gpus_per_device}): one device actor drives one GPU, so give 1 "
                "(a GPU each) or a fraction in (0, 1) (several actors share a GPU)"
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
        self._abort_requests = False  # some communicator has abort_requested set
        self._abandoned_staging: list = []  # staging a failed batch's queued copies may still use
        self._device: int | None = None
        self._stream = None
        self._staging: cb.StagingBuffer | None = None
        self._guard = WedgeGuard()
        self._tls = threading.local()
        self._lock = threading.RLock()
        self.stats = {
            "created": 0, "destroyed": 0, "aborted": 0, "create_s": 0.0, "ops": 0, "batches": 0,
            "peer_aborts": 0, "bootstrap_roots": 0,
        }  # fmt: skip

    def __getstate__(self):
        # Ship only the configuration (the driver builds one and sends it to every actor of a mesh).
        return {
            "env": self.env, "timeout_s": self.timeout_s, "cuda_device": self.cuda_device,
            "gpus_per_device": self.gpus_per_device, "gpu_sharing": self.gpu_sharing.value,
        }  # fmt: skip

    def __setstate__(self, state):
        self.__init__(
            env=state["env"], timeout_s=state["timeout_s"], cuda_device=state["cuda_device"],
            gpus_per_device=state.get("gpus_per_device", 1.0), gpu_sharing=state.get("gpu_sharing", "auto"),
        )  # fmt: skip
        # Arriving in an actor: set this mesh's NCCL environment before anything there calls NCCL
        # (NCCL reads some variables once per process, at its first call).
        self.arrive()

    def arrive(self) -> None:
        """Apply this backend's environment in this process: its ``env``, non-blocking
        communicators and, for a fractional GPU, the GPU-sharing variables."""
        apply_env(self.env)
        apply_env(NONBLOCKING_ENV, record=False)
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
        """One unique id per group and every member's settings, in one batched round trip."""
        groups = [normalize_group(g) for g in groups]
        if not groups:
            return []
        missing = sorted({d for g in groups for d in g if d not in actors})
        if missing:
            raise ValueError(f"no actor for device(s) {missing} named in groups {groups}")
        hosts = assign_id_hosts(groups)
        per_host: dict[int, list[Group]] = {}
        for g in dict.fromkeys(groups):
            per_host.setdefault(hosts[g], []).append(g)
        members = sorted({d for g in groups for d in g})
        reports = {d: self._cached_member(d, actors[d]) for d in members}
        ask = [d for d in members if d in per_host or reports[d] is None]

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
        uid_of: dict[Group, tuple[bytes, int]] = {}
        for dev, res in zip(ask, results, strict=True):
            for g, uid in zip(per_host.get(dev, ()), res["uids"], strict=True):
                uid_of[g] = (uid, dev)
            static = {k: v for k, v in res.items() if k != "uids"}
            reports[dev] = static
            key = _actor_key(actors[dev])
            if key is not None:
                self._members[dev] = (key, static)
        return [Rendezvous(g, self._group_info(g, *uid_of[g], reports)) for g in groups]

    def abort_rendezvous(self, rendezvous: list[Rendezvous], reason: str = "aborted") -> None:
        """Members still creating these groups give up at once: each is sent the abort notice of its
        group's unique id, as a member that aborted would send (their creation polls read it)."""
        for r in rendezvous:
            info = r.info
            if isinstance(info, Mapping) and "uid" in info:
                addresses = [tuple(a) for a in info.get("abort_to", ())]
                peer_aborts().notify(addresses, uid_digest(_uid_bytes(info["uid"])))

    def _cached_member(self, device: int, handle) -> dict | None:
        hit = self._members.get(device)
        if hit is None or hit[0] != _actor_key(handle):
            return None
        return hit[1]

    @staticmethod
    def _group_info(group: Group, uid: bytes, host: int, reports: Mapping[int, dict]) -> dict:
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
        """Per-process setup on first use: env, CUDA device, communication stream, staging buffer."""
        if self._stream is not None:
            if device != self._device and self._device is not None:
                # one backend instance serves one device (one GPU per actor)
                raise ValueError(f"this NcclBackend serves device {self._device}, not {device}")
            return
        apply_env(self.env)
        apply_env(NONBLOCKING_ENV, record=False)
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
        with cupy.cuda.Device(self.cuda_device):
            self._stream = cupy.cuda.Stream(non_blocking=True)
        self._staging = cb.StagingBuffer(self.cuda_device)
        peer_aborts()

    def reserve_staging(self, nbytes: int) -> None:
        """Pre-allocate the actor's one staging buffer (e.g. ``program.staging_numel * itemsize``)."""
        if self._staging is None:
            raise RuntimeError("reserve_staging() before connect()")
        self._staging.reserve(nbytes)

    @property
    def stream(self):
        """The communication stream (cupy stream), for callers that want to order work after it."""
        return self._stream

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
        if comm.aborted or comm.closed:
            self._forget(comm)
            return
        if not self._lock.acquire(blocking=False):
            # A run's thread holds the backend (a group block, a poll): record the request; that
            # thread serves it at its next poll or when it lets go of the backend.
            comm.abort_requested = True
            self._abort_requests = True
            self._after_release()  # it may have let go meanwhile
            return
        try:
            comm.aborted = True
            if getattr(comm.raw, "comm", 0):
                with self._guard.inside(time.monotonic() + self.timeout_s, f"ncclCommAbort(group={comm.group})"):
                    comm.raw.abort()
            others = [a for r, a in enumerate(comm.abort_to) if r != comm.rank]
            if others:
                peer_aborts().notify(others, comm.digest)
            self._forget(comm)
        finally:
            self._lock.release()

    def _serve_abort_requests(self, batch: _Batch | None) -> None:
        """Abort the communicators other threads asked to abort; if ``batch`` uses one, fail it.
        Inside an open NCCL group nothing is aborted (the failure ends the group first)."""
        if not self._abort_requests:
            return
        with self._lock:
            asked_in_batch = batch is not None and any(c.abort_requested for c in batch.comms.values())
            if batch is not None and batch.open:
                if asked_in_batch:
                    self._fail(batch, None, timeout=False, aborted=True)
                return
            self._abort_requests = False
            for c in [c for c in self._comms.values() if c.abort_requested]:
                if batch is None or id(c) not in batch.comms:
                    c.abort()
            if asked_in_batch:
                self._fail(batch, None, timeout=False, aborted=True)

    def _after_release(self) -> None:
        """Serve the abort requests made while another holder had the backend, if it is free now."""
        if self._abort_requests and self._lock.acquire(blocking=False):
            try:
                self._serve_abort_requests(None)
            finally:
                self._lock.release()

    def _abort_raws(self, raws: list, infos: list[dict], rank_of: list[int]) -> None:
        """Abort half-made communicators (creation failed) and tell the other members."""
        for raw, info, rank in zip(raws, infos, rank_of, strict=False):
            if getattr(raw, "comm", 0):
                with self._guard.inside(time.monotonic() + self.timeout_s, "ncclCommAbort(creation)"):
                    raw.abort()
            others = [a for r, a in enumerate(info.get("abort_to", ())) if r != rank]
            peer_aborts().notify(others, uid_digest(_uid_bytes(info["uid"])))

    # ---------------------------------------------------------------- actor side: communicators

    def connect(self, rendezvous: Rendezvous, device: int, timeout_s: float) -> NcclCommunicator:
        return self.connect_many([rendezvous], device, timeout_s)[0]

    def connect_many(self, rendezvous: list[Rendezvous], device: int, timeout_s: float) -> list[NcclCommunicator]:
        """This device's communicators for ``rendezvous``; the new ones are created in ONE NCCL
        group call, so actors that create overlapping sets of groups cannot deadlock on the order.
        Raises ReshardTimeout if peers do not join within ``timeout_s``, PeerFailed if a member
        aborted its side meanwhile."""
        try:
            with self._lock:
                return self._connect_many(rendezvous, device, timeout_s)
        finally:
            self._after_release()

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
        try:
            with cupy.cuda.Device(self.cuda_device):
                self._call(nccl.groupStart, deadline, "ncclGroupStart")
                try:
                    for g, info, rank in zip(groups, infos, ranks, strict=True):
                        raws.append(nccl.NcclCommunicator(len(g), _uid_arg(_uid_bytes(info["uid"])), rank))
                finally:
                    self._call(nccl.groupEnd, deadline, f"ncclGroupEnd(create {groups})")
                self._await(raws, [uid_digest(_uid_bytes(i["uid"])) for i in infos], deadline)
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
        for g, info, raw, rank in zip(groups, infos, raws, ranks, strict=True):
            comm = NcclCommunicator(self, g, rank, timeout_s, raw, info)
            self._comms[comm.digest] = comm

    def _await(self, raws: list, digests: list[bytes], deadline: float) -> None:
        """Poll non-blocking calls of ``raws`` until none is in progress: raises the first
        asynchronous error, ``_PeerAbort`` when a member reported an abort (checked first: a peer's abort
        also shows here as a remote error), ``_Deadline`` at the deadline."""
        pending = list(zip(raws, digests, strict=True))
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
        """Destroy idle communicators, in the order of their groups.

        cupy's ``destroy()`` discards ``ncclCommDestroy``'s return code, so the communicator's
        asynchronous error is read first: a communicator with an error, or with a call still in
        progress, is aborted instead and the error raised."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        with self._lock:
            for c in sorted(comms, key=lambda c: (c.group, c.digest)):
                g = c.group
                if c.aborted or c.closed:
                    self._forget(c)
                    continue
                deadline = time.monotonic() + timeout
                try:
                    busy = self._async_state(c.raw, deadline)
                except Exception as e:
                    c.abort()
                    raise ReshardError(f"NCCL communicator of group {g} had failed ({e}); aborted it") from e
                if busy:
                    c.abort()
                    raise ReshardError(f"NCCL communicator of group {g} still had a call in progress; aborted it")
                c.closed = True
                if self._comms.get(c.digest) is c:
                    del self._comms[c.digest]
                with self._guard.inside(deadline, f"ncclCommDestroy(group={g})"):
                    c.raw.destroy()
                self.stats["destroyed"] += 1

    def abort_all(self) -> list[Group]:
        """Abort every communicator of this actor (failure cleanup; local, never blocks on peers)."""
        groups = [c.group for c in self._comms.values()]
        for c in list(self._comms.values()):
            c.abort()
        return groups

    def _forget(self, comm: NcclCommunicator) -> None:
        if self._comms.get(comm.digest) is comm:
            del self._comms[comm.digest]
            self.stats["aborted"] += 1

    def close(self) -> None:
        """Destroy every communicator and free the staging buffer."""
        try:
            if self._comms:
                self._destroy(list(self._comms.values()))
        finally:
            if self._staging is not None:
                self._staging.release()

    # ---------------------------------------------------------------- actor side: operations

    @contextlib.contextmanager
    def grouped(self, timeout_s: float | None = None) -> Iterator[None]:
        """Issue every operation inside the block as one NCCL group call; wait once at the end.

        This is the batching interface for executors: wrap a run of consecutive communication ops
        of one program (in the program's order) in one block. Ops in one block must not depend on
        each other (NCCL may run them in any order: no "receive, then forward what was received"),
        each staged op needs its own staging region, and every actor must issue its ops in the
        program's global order. Nested blocks join the outer one. On any error every communicator
        the block used is aborted (and its peers told) before the error propagates."""
        if getattr(self._tls, "batch", None) is not None:
            yield
            return
        _, nccl = cb.import_nccl()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        batch = _Batch(grouped=True, deadline=deadline)
        try:
            with self._lock:
                self._tls.batch = batch
                self._call(nccl.groupStart, time.monotonic() + self.timeout_s, "ncclGroupStart")
                batch.open = True
                try:
                    yield
                    self._finish(batch, nccl)
                except BaseException:
                    if batch.open or any(not c.aborted for c in batch.comms.values()):
                        # The block failed: end the group (groupStart/groupEnd must pair), then abort what it used.
                        self._end_group(batch, nccl, time.monotonic() + WEDGE_GRACE_S)
                        for c in list(batch.comms.values()):
                            c.abort()
                        self._reset_staging_after_failure()
                    raise
                finally:
                    self._tls.batch = None
        finally:
            self._after_release()

    def _end_group(self, batch: _Batch, nccl, deadline: float) -> BaseException | None:
        """``nccl.groupEnd()`` of an open batch: the error it raised, if any (in progress is fine)."""
        if not batch.open:
            return None
        batch.open = False
        try:
            self._call(nccl.groupEnd, deadline, "ncclGroupEnd")
        except Exception as e:
            return e
        return None

    def _issue(self, comm: NcclCommunicator, kind: str, x, arg) -> None:
        try:
            with self._lock:
                self._issue_locked(comm, kind, x, arg)
        finally:
            if getattr(self._tls, "batch", None) is None:
                self._after_release()

    def _issue_locked(self, comm: NcclCommunicator, kind: str, x, arg) -> None:
        cupy, nccl = cb.import_nccl()
        view = cb.describe(x)
        if view.cuda_device != self.cuda_device:
            raise ValueError(
                f"{kind} on group {comm.group}: buffer is on CUDA device {view.cuda_device}, "
                f"this actor's communicators use device {self.cuda_device}"
            )
        if kind == "all_reduce":
            cb.nccl_reduce_args(view.dtype_name, view.numel, view.itemsize, arg)  # refuse before queuing
        batch = getattr(self._tls, "batch", None)
        single = batch is None
        if single:
            batch = _Batch(grouped=False, deadline=None)
        if batch.deadline is None:
            batch.deadline = time.monotonic() + comm.timeout_s
        self.stats["ops"] += 1
        batch.ops.append(f"{kind}(group={comm.group}, rank={comm.rank}, arg={arg}, shape={view.shape})")
        batch.comms[id(comm)] = comm
        self._serve_abort_requests(batch)
        if comm.peer_aborted():
            self.stats["peer_aborts"] += 1
            self._fail(batch, None, timeout=False, peer=True)
        stream = self._stream
        if view.numel == 0:
            return  # every member sees the same shape, so every member skips
        # 1. the comm stream waits for the computation that produced / last used the buffer
        producer = cb.producer_stream(x, view)
        ready = cupy.cuda.Event(block=False, disable_timing=True)
        ready.record(producer)
        stream.wait_event(ready)
        batch.consumers[producer.ptr] = producer
        # 2. non-contiguous: pass through a segment of the staging buffer
        reads = kind in ("send", "all_reduce") or (kind == "broadcast" and arg == comm.rank)
        writes = kind in ("recv", "broadcast", "all_reduce")
        buf, bview = x, view
        if not view.contiguous:
            buf = self._staging.segment_like(view, x)
            bview = cb.describe(buf)
            batch.staged = True
            if reads:
                cb.copy_on_stream(buf, x, view.framework, stream)
            if writes:
                batch.unpack.append((x, buf, view.framework))
        batch.keep.append(x)
        batch.keep.append(buf)
        # 3. enqueue: returns at once (queued in a group, or ncclInProgress on a non-blocking comm)
        if kind == "all_reduce":
            count, dtype, op = cb.nccl_reduce_args(bview.dtype_name, bview.numel, bview.itemsize, arg)
            call = lambda: comm.raw.allReduce(bview.ptr, bview.ptr, count, dtype, op, stream.ptr)  # noqa: E731
        else:
            count, dtype = bview.nccl_args()
            method = {"broadcast": comm.raw.bcast, "send": comm.raw.send, "recv": comm.raw.recv}[kind]
            call = lambda: method(bview.ptr, count, dtype, arg, stream.ptr)  # noqa: E731
        try:
            self._call(call, batch.deadline, batch.ops[-1])
        except Exception as e:
            self._fail(batch, e, timeout=False)
        if single:
            self._finish(batch, nccl)

    def _finish(self, batch: _Batch, nccl) -> None:
        cupy = cb.import_cupy()
        stream = self._stream
        if batch.deadline is None:
            batch.deadline = time.monotonic() + self.timeout_s
        if batch.grouped:
            error = self._end_group(batch, nccl, batch.deadline)
            if error is not None:
                self._fail(batch, error, timeout=False)
        if not batch.keep:  # only empty transfers
            return
        self.stats["batches"] += 1
        # 4. wait until NCCL has launched the group (connection setup included) on the comm stream
        self._poll(batch, None)
        # 5. received data leaves the staging buffer after the NCCL kernels, on the same stream
        for dst, staged, fw in batch.unpack:
            cb.copy_on_stream(dst, staged, fw, stream)
        done = cupy.cuda.Event(block=False, disable_timing=True)
        done.record(stream)
        # 6. later work on the producers' streams sees the arrived data
        for s in batch.consumers.values():
            s.wait_event(done)
        self._poll(batch, done)
        if batch.staged:
            self._staging.reset()

    def _poll(self, batch: _Batch, done) -> None:
        """Until the batch's calls left ``ncclInProgress`` (``done`` None) or ``done`` fired. Each
        round checks, in order: abort requests of other threads, peers' abort notices (before
        NCCL's own error: a peer's abort surfaces there as a remote error), asynchronous errors,
        the event, the deadline."""
        comms = list(batch.comms.values())
        aborts = peer_aborts()
        pause = 0.0
        while True:
            self._serve_abort_requests(batch)
            self._check_notices(batch, comms, aborts)
            busy = False
            for c in comms:
                try:
                    busy |= self._async_state(c.raw, batch.deadline)
                except Exception as e:
                    self._check_notices(batch, comms, aborts)
                    self._fail(batch, e, timeout=False)
            finished = not busy
            if done is not None and finished:
                try:
                    finished = event_fired(done)
                except Exception as e:  # a CUDA error: the batch's kernels or copies failed
                    self._fail(batch, e, timeout=False)
            if finished:
                return
            if time.monotonic() >= batch.deadline:
                self._fail(batch, None, timeout=True)
            time.sleep(pause)
            pause = min(max(2 * pause, 2e-5), 1e-3)

    def _check_notices(self, batch: _Batch, comms: list[NcclCommunicator], aborts: PeerAborts) -> None:
        if any(aborts.aborted(c.digest) for c in comms):
            self.stats["peer_aborts"] += 1
            self._fail(batch, None, timeout=False, peer=True)

    def _reset_staging_after_failure(self) -> None:
        """Staging is free again once the copies a failed batch queued on the stream have run; if
        they do not finish within ``STREAM_DRAIN_S`` its buffers are set aside, never reused."""
        if self._staging is None:
            return
        drained = self._stream is None
        if not drained:
            with contextlib.suppress(Exception):
                cupy = cb.import_cupy()
                event = cupy.cuda.Event(block=False, disable_timing=True)
                event.record(self._stream)
                until = time.monotonic() + STREAM_DRAIN_S
                while not (drained := event_fired(event)) and time.monotonic() < until:
                    time.sleep(1e-3)
        if drained:
            self._staging.reset()
        else:
            log.error("device %s: copies queued on the NCCL stream did not finish within %.0fs after a failure; "
                      "its staging buffer is set aside", self._device, STREAM_DRAIN_S)  # fmt: skip
            self._abandoned_staging.append(self._staging)
            self._staging = cb.StagingBuffer(self.cuda_device)

    def _fail(self, batch: _Batch, error: BaseException | None, *, timeout: bool, peer: bool = False,
              aborted: bool = False):  # fmt: skip
        if batch.open:
            # never abort a communicator that an unfinished NCCL group still refers to: end it first
            _, nccl = cb.import_nccl()
            self._end_group(batch, nccl, time.monotonic() + WEDGE_GRACE_S)
        for c in list(batch.comms.values()):
            c.abort()
        self._reset_staging_after_failure()
        ops = "; ".join(batch.ops[:8]) + (" ..." if len(batch.ops) > 8 else "")
        if aborted:
            raise PeerFailed(
                f"NCCL operations on device {self._device}: the controller aborted them: {ops}; communicators "
                "aborted and the other members told"
            )
        if peer:
            raise PeerFailed(
                f"NCCL operations on device {self._device}: a member of the group aborted its communicator: {ops}; "
                "aborted here too (a failure elsewhere; the driver reports it)"
            )
        if timeout or (error is not None and nccl_status(error) == NCCL_TIMEOUT):
            raise ReshardTimeout(
                f"NCCL operations did not complete before their deadline on device {self._device}: {ops}; "
                "communicators aborted (a peer is missing, dead or issued a different operation order)"
            ) from error
        raise ReshardError(f"NCCL operations failed on device {self._device}: {ops}: {error}") from error


def event_fired(event) -> bool:
    """Whether a cupy event has fired; a CUDA error recorded by the work before it raises.

    cupy 14's ``Event.done`` compares ``runtime.eventQuery``'s status with 0, so an error there
    reads as "not yet" and a failed kernel would wait for the deadline; the status is read here."""
    cupy = cb.import_cupy()
    status = cupy.cuda.runtime.eventQuery(event.ptr)
    if status in (0, CUDA_NOT_READY):
        return status == 0
    raise cupy.cuda.runtime.CUDARuntimeError(status)


class _Deadline(Exception):
    """Internal: a poll reached its deadline."""


class _PeerAbort(Exception):
    """Internal: a member reported an abort while we polled."""


def _actor_key(handle) -> str | None:
    actor_id = getattr(handle, "_actor_id", None)
    return None if actor_id is None else str(actor_id)
