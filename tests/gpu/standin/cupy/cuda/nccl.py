"""``cupy.cuda.nccl`` of the stand-in: NCCL between processes, over TCP on 127.0.0.1.

The Python surface is cupy 14's (cupy_backends/cuda/libs/nccl.pyx at v14.2.0): ``get_version``,
``get_unique_id`` (128 ``bytes``; cupy < 14 returned a tuple), ``groupStart``/``groupEnd``,
``NcclCommunicator(ndev, commId: bytes, rank, config=None)`` (a non-bytes id is a TypeError, a
wrong length a ValueError) with ``bcast``, ``broadcast``, ``send``, ``recv``, ``allReduce``,
``check_async_error`` (raises the asynchronous error first, then the call's result), ``abort``
and ``destroy`` (both ``void`` in cupy: their results are discarded; ``comm`` reads 0 afterwards).
``NcclError(status)`` looks its name up in a table of codes 0..6 only, so codes 7
(``ncclInProgress``) and 8 (``ncclTimeout``, NCCL >= 2.30) surface as ``KeyError(status)``.

Behaviour follows NCCL's source (src/group.cc, src/init.cc, src/enqueue.cc, src/bootstrap.cc,
src/misc/socket.cc) and user guide (api/group.html: ncclGroupEnd; api/comms.html:
ncclCommGetAsyncError, ncclCommAbort, ncclCommDestroy; usage/communicators.html: error handling
and communicator abort, non-blocking communicators):

- Unique id: ``ncclGetUniqueId`` starts a bootstrap root, a thread with a listening socket in the
  calling process (named "NCCL BootstrapR" when ``NCCL_SET_THREAD_NAME=1``); the id holds its
  address and a random magic. The root exits once every rank checked in and never otherwise (a
  group that never forms leaves it). Ranks connect to it with NCCL's retry rule
  (``NCCL_SOCKET_RETRY_CNT`` tries, the k-th after k * ``NCCL_SOCKET_RETRY_SLEEP_MSEC``), then
  fail with ``ncclRemoteError``. Simplification: the root hands every rank the whole address table
  and the ranks connect all to all (NCCL builds a ring and all-gathers over it).
- ``NCCL_COMM_BLOCKING`` is read once per process, at the first communicator creation
  (``NCCL_PARAM`` caches it); unset means blocking. ``ncclGroupStart``/``End`` nest per thread.
  A non-blocking group end returns ``ncclInProgress`` at once and a thread finishes the group:
  creations run concurrently (so overlapping groups created in different orders cannot
  deadlock), operations are then enqueued on their streams; until that is done every member
  communicator's asynchronous state is ``ncclInProgress``, and a call on it is refused with
  ``ncclInvalidArgument`` (``ncclCommEnsureReady``: "Attempt to use communicator before the
  previous operation returned ncclSuccess"). An operation outside a group is a group of one.
  Blocking and non-blocking communicators in one group: ``ncclInvalidArgument``. CUDA work issued
  on a stream whose NCCL launch is still in progress runs before NCCL's kernel (the guide: do not
  issue kernels on NCCL's streams before the state is ncclSuccess); a diagnostic says so.
- Point-to-point connections are made at a pair's first send/receive, not at creation (NCCL's
  runtime connection): the launch of a first send to a peer stays in progress until the peer
  launched its first receive from this rank, and the other way round.
- Operations are kernels: the operations of one group run as ONE task on their stream (several
  streams join), progressing together; tasks of one stream run in order, so a kernel waiting for
  a peer blocks that stream, which exposes ordering deadlocks between communicators. Collectives
  carry a per-communicator sequence number, send/recv one per peer and direction; a member that
  issued a different operation at the same number (kind, root, type, count, reduction) never
  completes: that is the hang it would be on a GPU, and a diagnostic names both sides. A send
  completes once its receiver consumed it, a broadcast's root once every member did.
- ``ncclCommAbort`` is local: in-flight kernels of the communicator exit, its sockets close, an
  unfinished group launch is aborted and joined (``ncclGroupJobAbort``); the other members are
  NOT told and keep waiting (as over NVLink or shared memory). ``ncclCommDestroy`` refuses a
  communicator whose state is in progress or failed (it leaks, as NCCL's early return does) and
  otherwise waits for its outstanding operations before freeing it.
- Faults for tests: ``cupy._control.inject``.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import json
import os
import socket
import struct
import sys
import threading
import time
from collections import defaultdict

import numpy as np

from cupy.cuda import _gpu, runtime

# ncclResult_t (nccl.h)
ncclSuccess = 0
ncclUnhandledCudaError = 1
ncclSystemError = 2
ncclInternalError = 3
ncclInvalidArgument = 4
ncclInvalidUsage = 5
ncclRemoteError = 6
ncclInProgress = 7
ncclTimeout = 8

# ncclRedOp_t / ncclDataType_t (cupy_backends/cuda/libs/nccl.pxd)
NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN, NCCL_AVG = 0, 1, 2, 3, 4
NCCL_INT8 = NCCL_CHAR = 0
NCCL_UINT8 = 1
NCCL_INT32 = NCCL_INT = 2
NCCL_UINT32 = 3
NCCL_INT64 = 4
NCCL_UINT64 = 5
NCCL_FLOAT16 = NCCL_HALF = 6
NCCL_FLOAT32 = NCCL_FLOAT = 7
NCCL_FLOAT64 = NCCL_DOUBLE = 8
NCCL_BFLOAT16 = 9
NCCL_UNIQUE_ID_BYTES = 128

_NUMPY = {
    NCCL_INT8: np.int8,
    NCCL_UINT8: np.uint8,
    NCCL_INT32: np.int32,
    NCCL_UINT32: np.uint32,
    NCCL_INT64: np.int64,
    NCCL_UINT64: np.uint64,
    NCCL_FLOAT16: np.float16,
    NCCL_FLOAT32: np.float32,
    NCCL_FLOAT64: np.float64,
    NCCL_BFLOAT16: np.uint16,  # carried as its bits; reduced through float32
}

#: ``ncclGetVersion``: 2.30.7 by default (ncclTimeout, which the stand-in can inject, exists from 2.30).
NCCL_VERSION_CODE = int(os.environ.get("CUPY_STANDIN_NCCL_VERSION", "23007"))
available = True

#: How long a non-blocking group's launch thread takes before it enqueues (keeps ncclInProgress visible).
LAUNCH_DELAY_S = float(os.environ.get("CUPY_STANDIN_LAUNCH_DELAY_S", "0.002"))
#: Cleared while a test holds non-blocking launches (``_control.launches_held``); they wait for it.
_launch_gate = threading.Event()
_launch_gate.set()
LAUNCH_HOLD_S = 60.0  # a held launch goes on after this even if the test never lets it go

_ERROR2 = {
    0: "NCCL_ERROR_SUCCESS",
    1: "NCCL_ERROR_UNHANDLED_CUDA_ERROR",
    2: "NCCL_ERROR_SYSTEM_ERROR",
    3: "NCCL_ERROR_INTERNAL_ERROR",
    4: "NCCL_ERROR_INVALID_ARGUMENT",
    5: "NCCL_ERROR_INVALID_USAGE",
    6: "NCCL_ERROR_REMOTE_ERROR",
}
_STRINGS = {  # ncclGetErrorString (src/init.cc)
    0: "no error",
    1: "unhandled cuda error (run with NCCL_DEBUG=INFO for details)",
    2: "unhandled system error (run with NCCL_DEBUG=INFO for details)",
    3: "internal error - please report this issue to the NCCL developers",
    4: "invalid argument (run with NCCL_DEBUG=WARN for details)",
    5: "invalid usage (run with NCCL_DEBUG=WARN for details)",
    6: "remote process exited or there was a network error",
    7: "NCCL operation in progress",
    8: "timeout",
}


class NcclError(RuntimeError):
    """cupy's NcclError: a status outside its message table raises ``KeyError(status)`` instead."""

    def __init__(self, status):
        self.status = status
        name = _ERROR2[status]
        super().__init__(f"{name}: {_STRINGS.get(status, 'unknown result code')}")

    def __reduce__(self):
        return (type(self), (self.status,))


def check_status(status: int) -> None:
    if status != ncclSuccess:
        raise NcclError(status)


def get_build_version() -> int:
    return NCCL_VERSION_CODE


def get_version() -> int:
    return NCCL_VERSION_CODE


# ------------------------------------------------------------------------------------------------
# Process-wide parameters (NCCL_PARAM: read once, cached)

_params: dict[str, object] = {}


def _param(name: str, default: str) -> str:
    if name not in _params:
        _params[name] = os.environ.get(name, default)
    return _params[name]


def _blocking() -> bool:
    return _param("NCCL_COMM_BLOCKING", "1") != "0"


def _set_thread_name(name: bytes) -> None:
    """``ncclSetThreadName``: only with NCCL_SET_THREAD_NAME=1; Linux ``prctl(PR_SET_NAME)``."""
    if _param("NCCL_SET_THREAD_NAME", "0") != "1" or not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(15, ctypes.c_char_p(name[:15]), 0, 0, 0)


# ------------------------------------------------------------------------------------------------
# Faults injected by tests (cupy._control.inject)

_faults: list[dict] = []
_faults_lock = threading.Lock()


def _take_fault(kind: str, call: str | None, comms) -> dict | None:
    """An armed fault of ``kind`` for ``call`` on one of ``comms`` (its rank filter), used up once."""
    with _faults_lock:
        for f in _faults:
            if f["kind"] != kind or f["count"] <= 0 or f.get("call") not in (None, call):
                continue
            if f.get("rank") is not None and all(c.rank != f["rank"] for c in comms):
                continue
            f["count"] -= 1
            return dict(f)
    return None


# ------------------------------------------------------------------------------------------------
# Wire format: header (kind, channel, sequence, meta length, payload length), meta, payload

_HEADER = struct.Struct("!BBxxQII")
_DATA, _ACK, _HELLO, _TABLE, _META, _CONNECT = 1, 2, 3, 4, 5, 6
_COLL, _P2P = 0, 1


def _send_frame(sock: socket.socket, kind: int, chan: int, seq: int, meta: bytes = b"", payload=b"") -> None:
    sock.sendall(_HEADER.pack(kind, chan, seq, len(meta), len(payload)) + meta)
    if len(payload):
        sock.sendall(payload)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            return None
        got += k
    return bytes(buf)


def _recv_frame(sock: socket.socket):
    """``(kind, chan, seq, meta, payload)``, or None when the connection closed."""
    try:
        head = _recv_exact(sock, _HEADER.size)
        if head is None:
            return None
        kind, chan, seq, nmeta, npayload = _HEADER.unpack(head)
        meta = _recv_exact(sock, nmeta) if nmeta else b""
        payload = _recv_exact(sock, npayload) if npayload else b""
    except OSError:
        return None
    if meta is None or payload is None:
        return None
    return kind, chan, seq, meta, payload


# ------------------------------------------------------------------------------------------------
# Bootstrap root (ncclGetUniqueId)

_ID_TAG = b"SIN1"


def get_unique_id() -> bytes:
    """A fresh id: starts a bootstrap root in this process that waits until every rank checked in."""
    magic = os.urandom(8)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    port = listener.getsockname()[1]
    named = threading.Event()
    thread = threading.Thread(
        target=_bootstrap_root, args=(listener, magic, named), name="standin-bootstrap-root", daemon=True
    )
    thread.start()
    named.wait()  # NCCL names the thread from the creating thread: named once the id is returned
    uid = magic + _ID_TAG + struct.pack("!H4s", port, socket.inet_aton("127.0.0.1"))
    return uid + bytes(NCCL_UNIQUE_ID_BYTES - len(uid))


def _parse_uid(uid: bytes) -> tuple[bytes, tuple[str, int]] | None:
    if uid[8:12] != _ID_TAG:
        return None
    port, ip = struct.unpack("!H4s", uid[12:18])
    return uid[:8], (socket.inet_ntoa(ip), port)


def _bootstrap_root(listener: socket.socket, magic: bytes, named: threading.Event) -> None:
    _set_thread_name(b"NCCL BootstrapR")
    named.set()
    ranks: dict[int, tuple[socket.socket, list]] = {}
    nranks = None
    try:
        while nranks is None or len(ranks) < nranks:
            conn, _ = listener.accept()
            frame = _recv_frame(conn)
            if frame is None or frame[0] != _HELLO:
                conn.close()
                continue
            hello = json.loads(frame[3])
            if bytes.fromhex(hello["magic"]) != magic:
                conn.close()  # NCCL's socket handshake drops a peer with another magic
                continue
            if nranks is None:
                nranks = hello["nranks"]
            if hello["nranks"] != nranks or hello["rank"] in ranks or not 0 <= hello["rank"] < nranks:
                _gpu.note(
                    f"bootstrap root: rank {hello['rank']} of {hello['nranks']} does not fit the {nranks} ranks "
                    "already checked in (mismatch or duplicate rank); the root gives up and the ranks wait forever"
                )
                return
            ranks[hello["rank"]] = (conn, hello["listen"])
        table = json.dumps([ranks[r][1] for r in range(nranks)]).encode()
        for conn, _ in ranks.values():
            with contextlib.suppress(OSError):
                _send_frame(conn, _TABLE, 0, 0, table)
    finally:
        listener.close()
        for conn, _ in ranks.values():
            with contextlib.suppress(OSError):
                conn.close()


# ------------------------------------------------------------------------------------------------
# Communicators


class _GroupJob:
    """One group launch: its communicators, done when the launch finished, abortable as a whole."""

    def __init__(self, comms: list):
        self.comms = comms
        self.aborted = threading.Event()
        self.done = threading.Event()
        self.thread: threading.Thread | None = None
        self.queues: list = []  # streams marked as awaiting this launch

    def abort(self) -> None:
        self.aborted.set()
        for c in self.comms:
            c.interrupt()


class _Conn:
    """A connection to one peer rank (or, for the rank itself, a loopback into its own mailbox)."""

    def __init__(self, comm: _Comm, peer: int, sock: socket.socket | None):
        self.comm = comm
        self.peer = peer
        self.sock = sock
        self.lock = threading.Lock()

    def send(self, kind: int, chan: int, seq: int, meta: bytes = b"", payload=b"") -> None:
        if self.sock is None:
            self.comm.deliver(self.comm.rank, kind, chan, seq, meta, bytes(payload))
            return
        with self.lock, contextlib.suppress(OSError):  # a closed peer: the data is lost, nobody is told
            _send_frame(self.sock, kind, chan, seq, meta, payload)

    def serve(self) -> None:
        """Reader thread: everything the peer sends goes into the communicator's mailbox."""
        while True:
            frame = _recv_frame(self.sock)
            if frame is None:
                return  # peer closed (abort, exit): NCCL does not tell this rank; its waits go on
            kind, chan, seq, meta, payload = frame
            self.comm.deliver(self.peer, kind, chan, seq, meta, payload)


class _Comm:
    """NCCL's ``ncclComm`` of one rank in this process."""

    def __init__(self, handle: int, nranks: int, rank: int, uid: bytes, device: int, blocking: bool):
        self.handle = handle
        self.nranks = nranks
        self.rank = rank
        self.uid = uid
        self.device = device
        self.blocking = blocking
        self.async_result = ncclSuccess
        self.aborted = threading.Event()
        self.group: _GroupJob | None = None
        self.cv = threading.Condition()
        self.mailbox: dict = {}
        self.conns: dict[int, _Conn] = {}
        self.sockets: list[socket.socket] = []
        self.coll_seq = 0
        self.send_seq: dict[int, int] = defaultdict(int)
        self.recv_seq: dict[int, int] = defaultdict(int)
        self.pending = 0
        self.doomed = False  # an injected asynchronous error: its kernels never complete
        self.p2p_connected: set[tuple[int, str]] = set()  # (peer, "send"/"recv") set up (``_connect_peers``)

    def __repr__(self) -> str:
        return f"<stand-in ncclComm rank {self.rank}/{self.nranks} id {self.uid[:8].hex()}>"

    def deliver(self, peer: int, kind: int, chan: int, seq: int, meta: bytes, payload: bytes) -> None:
        with self.cv:
            self.mailbox[(peer, kind, chan, seq)] = (meta, payload)
            self.cv.notify_all()

    def take(self, peer: int, kind: int, chan: int, seq: int):
        """Wait for a message; None once the communicator is aborted."""
        key = (peer, kind, chan, seq)
        with self.cv:
            while key not in self.mailbox:
                if self.aborted.is_set():
                    return None
                self.cv.wait(0.5)
            return self.mailbox.pop(key)

    def hang(self) -> None:
        """Wait for nothing but the abort (a kernel that cannot complete)."""
        with self.cv:
            while not self.aborted.is_set():
                self.cv.wait(0.5)

    def interrupt(self) -> None:
        """Wake every thread waiting on this communicator's sockets or mailbox."""
        for s in list(self.sockets):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()
        with self.cv:
            self.cv.notify_all()

    def stop(self) -> bool:
        return self.aborted.is_set() or (self.group is not None and self.group.aborted.is_set())


_comms: dict[int, _Comm] = {}
_comms_lock = threading.Lock()
_handles = itertools.count(0x6600_0000_1000, 0x1000)


def live_communicators() -> list[_Comm]:
    with _comms_lock:
        return list(_comms.values())


# ------------------------------------------------------------------------------------------------
# Per-thread group state (src/group.cc: ncclGroupDepth, ncclAsyncJobs, ncclGroupError, ncclGroupBlocking)

_tls = threading.local()


class _Group:
    def __init__(self):
        self.depth = 0
        self.jobs: list = []
        self.error = ncclSuccess
        self.blocking: bool | None = None


def _group() -> _Group:
    g = getattr(_tls, "group", None)
    if g is None:
        g = _tls.group = _Group()
    return g


def _group_error(status: int) -> int:
    g = _group()
    if g.depth > 0 and g.error == ncclSuccess:
        g.error = status
    return status


def _join_group(g: _Group, blocking: bool) -> int:
    if g.blocking is None:
        g.blocking = blocking
    elif g.blocking != blocking:
        _gpu.note("Blocking and nonblocking communicators are not allowed in the same group.")
        return _group_error(ncclInvalidArgument)
    return ncclSuccess


def groupStart() -> None:
    _group().depth += 1


def groupEnd() -> None:
    g = _group()
    if g.depth == 0:
        _gpu.note("ncclGroupEnd: not in a group call.")
        check_status(ncclInvalidUsage)
    g.depth -= 1
    if g.depth > 0:
        return
    jobs, error, blocking = g.jobs, g.error, g.blocking
    g.jobs, g.error, g.blocking = [], ncclSuccess, None
    if error != ncclSuccess:
        for _, c, *_ in jobs:  # groupCleanup: the group's communicators carry its error
            c.async_result = error
        check_status(error)
    if jobs:
        check_status(_end_group(jobs, bool(blocking)))


def _hang_until_abort(comms: list[_Comm], call: str) -> int:
    """An injected wedge: the call returns only when one of ``comms`` is aborted (from another thread)."""
    _gpu.note(f"injected fault: {call} does not return until {comms} is aborted")
    while not any(c.stop() for c in comms):
        time.sleep(0.01)
    return ncclInternalError


def _end_group(jobs: list, blocking: bool) -> int:
    comms = list(dict.fromkeys(c for _, c, *_ in jobs))
    if _take_fault("hang", "groupEnd", comms):
        return _hang_until_abort(comms, "ncclGroupEnd")
    job = _GroupJob(comms)
    for c in comms:
        c.group = job
    if blocking:
        job.thread = threading.current_thread()
        _finish_group(job, jobs)
        return next((c.async_result for c in comms if c.async_result != ncclSuccess), ncclSuccess)
    for c in comms:
        c.async_result = ncclInProgress
    job.queues = _launch_queues(jobs)
    job.thread = threading.Thread(target=_finish_group, args=(job, jobs), name=_gpu.LAUNCHER, daemon=True)
    job.thread.start()
    return ncclInProgress


def _launch_queues(jobs: list) -> list:
    """The streams a non-blocking launch will enqueue on, marked until it did (see ``_gpu.Queue.submit``)."""
    queues = []
    for kind, c, *rest in jobs:
        if kind == "op":
            with contextlib.suppress(runtime.CUDARuntimeError):
                previous = runtime.getDevice()
                runtime.setDevice(c.device)
                try:
                    queues.append(_gpu.queue_of(rest[0].stream))
                finally:
                    runtime.setDevice(previous)
    for q in queues:
        q.nccl_launches += 1
    return queues


def _finish_group(job: _GroupJob, jobs: list) -> None:
    """The group's launch: creations (concurrently), then the operations' kernels; sets each
    member's asynchronous state (an error of the group is every member's)."""
    status = ncclSuccess
    results: dict[int, int] = {}
    try:
        inits = [c for kind, c, *_ in jobs if kind == "init"]
        ops = [rest[0] for kind, _, *rest in jobs if kind == "op"]
        if inits:
            threads = [threading.Thread(target=_init_rank, args=(c, results), daemon=True) for c in inits]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            outcome = [results.get(c.handle, ncclInternalError) for c in inits]
            status = next((s for s in outcome if s != ncclSuccess), ncclSuccess)
        if ops and status == ncclSuccess:
            if not all(c.blocking for c in job.comms):
                time.sleep(LAUNCH_DELAY_S)
                _launch_gate.wait(LAUNCH_HOLD_S)
            status = _connect_peers(ops)
        if ops and status == ncclSuccess:
            status = _enqueue(job, ops)
        if job.aborted.is_set() and status == ncclSuccess:
            status = ncclInternalError
    except Exception as e:  # an internal failure of the model is an NCCL internal error
        _gpu.note(f"group launch failed: {type(e).__name__}: {e}")
        status = ncclInternalError
    finally:
        for q in job.queues:
            q.nccl_launches -= 1
        for c in job.comms:
            if c.doomed and status == ncclSuccess:
                continue
            c.async_result = status
        for c in job.comms:
            if c.group is job:
                c.group = None
        job.done.set()


def _connect_peers(ops: list) -> int:
    """Point-to-point connections are made at the first exchange between two ranks, not at
    creation (NCCL_RUNTIME_CONNECT=1, the default since NCCL 2.22; src/transport.cc
    ncclTransportP2pSetup): a rank's first send to a peer is set up together with the peer's first
    receive from it, and the launch stays in progress (a blocking group end waits) until the peer
    launched that receive. Each side announces its new connections, then waits for the peer's."""
    new = {}
    for op in ops:
        c = op.comm
        if op.kind in ("send", "recv") and (op.peer, op.kind) not in c.p2p_connected:
            new[(c, op.peer, op.kind)] = None
    for c, peer, kind in new:
        c.conns[peer].send(_CONNECT, 0 if kind == "send" else 1, 0)  # the sender's half, the receiver's half
    for c, peer, kind in new:
        key = (peer, _CONNECT, 1 if kind == "send" else 0, 0)
        with c.cv:
            while key not in c.mailbox:
                if c.stop():
                    return ncclInternalError
                c.cv.wait(0.05)
            del c.mailbox[key]
        c.p2p_connected.add((peer, kind))
    return ncclSuccess


# ------------------------------------------------------------------------------------------------
# Creation (bootstrap)


def _init_rank(c: _Comm, results: dict) -> None:
    try:
        results[c.handle] = _bootstrap(c)
    except OSError:
        results[c.handle] = ncclInternalError if c.stop() else ncclSystemError
    except Exception as e:  # a failure of the model itself
        _gpu.note(f"{c}: creation failed: {type(e).__name__}: {e}")
        results[c.handle] = ncclInternalError


def _bootstrap(c: _Comm) -> int:
    fault = _take_fault("async_error", "init", [c])
    if fault:
        return fault.get("code") or ncclRemoteError
    if _take_fault("never_join", None, [c]):
        _gpu.note(f"injected fault: {c} never checks in with its bootstrap root")
        while not c.stop():
            time.sleep(0.01)
        return ncclInternalError
    parsed = _parse_uid(c.uid)
    if parsed is None:
        return ncclInvalidArgument
    magic, root_addr = parsed
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    c.sockets.append(listener)
    listener.bind(("127.0.0.1", 0))
    listener.listen(c.nranks)
    root = _connect(c, root_addr)
    if isinstance(root, int):
        return root
    hello = {"magic": magic.hex(), "nranks": c.nranks, "rank": c.rank, "listen": list(listener.getsockname())}
    _send_frame(root, _HELLO, 0, 0, json.dumps(hello).encode())
    frame = _recv_frame(root)
    root.close()
    if frame is None:
        if not c.stop():
            c.hang()  # NCCL's rank waits for the root's answer without a deadline
        return ncclInternalError
    table = json.loads(frame[3])
    for peer in range(c.rank):
        s = _connect(c, tuple(table[peer]))
        if isinstance(s, int):
            return s
        _send_frame(s, _HELLO, 0, c.rank, magic)
        c.conns[peer] = _Conn(c, peer, s)
    for _ in range(c.rank + 1, c.nranks):
        s, _ = listener.accept()
        c.sockets.append(s)
        frame = _recv_frame(s)
        if frame is None or frame[3] != magic:
            return ncclInternalError if c.stop() else ncclRemoteError
        c.conns[frame[2]] = _Conn(c, frame[2], s)
    c.conns[c.rank] = _Conn(c, c.rank, None)
    for conn in c.conns.values():
        if conn.sock is not None:
            threading.Thread(target=conn.serve, name="standin-nccl-proxy", daemon=True).start()
    return ncclInternalError if c.stop() else ncclSuccess


def _connect(c: _Comm, addr) -> socket.socket | int:
    """``ncclSocketConnect``: a refused connection is retried NCCL_SOCKET_RETRY_CNT times, the k-th
    after k * NCCL_SOCKET_RETRY_SLEEP_MSEC, then ``ncclRemoteError``."""
    tries = int(_param("NCCL_SOCKET_RETRY_CNT", "34"))
    sleep_s = int(_param("NCCL_SOCKET_RETRY_SLEEP_MSEC", "100")) / 1000
    for attempt in range(tries + 1):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        c.sockets.append(s)
        try:
            s.connect((addr[0], int(addr[1])))
            return s
        except ConnectionRefusedError:
            s.close()
        deadline = time.monotonic() + (attempt + 1) * sleep_s
        while time.monotonic() < deadline:
            if c.stop():
                return ncclInternalError
            time.sleep(0.01)
    _gpu.note(f"{c}: connect to {addr} refused {tries} times")
    return ncclRemoteError


class NcclConfig:
    """``ncclConfig_t`` as cupy 14 exposes it (only ``split_share``)."""

    def __init__(self, split_share: int = 0):
        self.split_share = split_share


def _free(c: _Comm) -> None:
    """Forget ``c`` and wake everything waiting on it (its pending operations end)."""
    with _comms_lock:
        _comms.pop(c.handle, None)
    c.aborted.set()
    c.interrupt()


class NcclCommunicator:
    """``ncclCommInitRank``: inside a group the creation is queued until ``groupEnd``."""

    def __init__(self, ndev: int, commId: bytes, rank: int, config=None):
        self._comm = 0
        if not isinstance(commId, bytes):
            raise TypeError(f"Argument 'commId' has incorrect type (expected bytes, got {type(commId).__name__})")
        if len(commId) != NCCL_UNIQUE_ID_BYTES:
            raise ValueError(f"commId length {len(commId)} != {NCCL_UNIQUE_ID_BYTES}.")
        check_status(self._init(int(ndev), commId, int(rank)))

    def _init(self, ndev: int, uid: bytes, rank: int, blocking: bool | None = None) -> int:
        if ndev < 1 or not 0 <= rank < ndev:
            return _group_error(ncclInvalidArgument)
        if runtime.getDeviceCount() < 1 or _gpu.sticky() is not None:
            return _group_error(ncclUnhandledCudaError)
        blocking = _blocking() if blocking is None else blocking
        c = _Comm(next(_handles), ndev, rank, uid, runtime.getDevice(), blocking)
        with _comms_lock:
            _comms[c.handle] = c
        self._comm = c.handle
        if _take_fault("hang", "init", [c]):
            return _hang_until_abort([c], "ncclCommInitRank")
        g = _group()
        if g.depth > 0:
            status = _join_group(g, c.blocking)
            if status == ncclSuccess:
                g.jobs.append(("init", c))
            return status
        return _end_group([("init", c)], c.blocking)

    def __del__(self):
        if sys.is_finalizing():
            return
        with contextlib.suppress(Exception):
            self.destroy()  # cupy's __dealloc__ calls destroy()

    @property
    def comm(self) -> int:
        return self._comm

    def _live(self) -> _Comm | None:
        with _comms_lock:
            return _comms.get(self._comm)

    def _take(self) -> _Comm | None:
        """The live communicator behind this handle, which no longer names it (destroy, abort)."""
        if not self._comm:
            return None
        c = self._live()
        self._comm = 0
        return c

    def destroy(self) -> None:
        """``ncclCommDestroy`` (void in cupy): refused while in progress or failed, else waits for
        the communicator's outstanding operations, then frees it."""
        c = self._take()
        if c is None:
            return
        state = c.async_result
        if state != ncclSuccess:
            why = "a call is in progress" if state == ncclInProgress else f"it has asynchronous error {state}"
            _gpu.note(
                f"ncclCommDestroy({c}) refused: {why} (ncclCommEnsureReady); cupy discards the result and "
                "the communicator leaks"
            )
            return
        with c.cv:
            while c.pending and not c.aborted.is_set():
                c.cv.wait(0.5)
        _free(c)

    def abort(self) -> None:
        """``ncclCommAbort`` (void in cupy): local; an unfinished group launch is aborted and joined."""
        c = self._take()
        if c is None:
            return
        _free(c)
        job = c.group
        if job is not None:
            job.abort()
            if job.thread is not threading.current_thread():
                job.done.wait()

    def check_async_error(self) -> None:
        c = self._live()
        if c is None:
            check_status(ncclInvalidArgument)
        if _take_fault("hang", "check_async_error", [c]):
            check_status(_hang_until_abort([c], "ncclCommGetAsyncError"))
        check_status(c.async_result)

    def device_id(self) -> int:
        return self._checked().device

    def rank_id(self) -> int:
        return self._checked().rank

    def size(self) -> int:
        return self._checked().nranks

    def _checked(self) -> _Comm:
        c = self._live()
        if c is None:
            check_status(ncclInvalidArgument)
        return c

    # -- operations (src/enqueue.cc: ncclEnqueueCheck)
    def bcast(self, buff: int, count: int, datatype: int, root: int, stream: int) -> None:
        check_status(self._op("bcast", buff, buff, count, datatype, root, None, stream))

    def broadcast(self, sendbuff: int, recvbuff: int, count: int, datatype: int, root: int, stream: int) -> None:
        check_status(self._op("bcast", sendbuff, recvbuff, count, datatype, root, None, stream))

    def send(self, sendbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        check_status(self._op("send", sendbuf, sendbuf, count, datatype, peer, None, stream))

    def recv(self, recvbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        check_status(self._op("recv", recvbuf, recvbuf, count, datatype, peer, None, stream))

    def allReduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int, stream: int) -> None:
        check_status(self._op("allreduce", sendbuf, recvbuf, count, datatype, None, op, stream))

    def _op(self, kind, sendptr, recvptr, count, dtype, peer, redop, stream) -> int:
        c = self._live()
        if c is None:
            return _group_error(ncclInvalidArgument)
        if _take_fault("hang", {"allreduce": "allReduce"}.get(kind, kind), [c]):
            return _hang_until_abort([c], kind)
        if c.async_result == ncclInProgress:
            _gpu.note(f"{kind} on {c}: Attempt to use communicator before the previous operation returned ncclSuccess")
            return _group_error(ncclInvalidArgument)
        if c.async_result != ncclSuccess:
            return _group_error(c.async_result)
        if dtype not in _NUMPY or count < 0 or (redop is not None and redop not in (0, 1, 2, 3, 4)):
            return _group_error(ncclInvalidArgument)
        if peer is not None and not 0 <= peer < c.nranks:
            return _group_error(ncclInvalidArgument)
        nbytes = count * np.dtype(_NUMPY[dtype]).itemsize
        if nbytes:
            for ptr in {sendptr, recvptr}:
                if _gpu.allocation_of(ptr) is None:
                    _gpu.note(f"{kind} on {c}: pointer {ptr:#x} is not device memory")
                    return _group_error(ncclInvalidArgument)
        op = _Op(c, kind, sendptr, recvptr, count, dtype, peer, redop, stream, nbytes)
        if kind in ("bcast", "allreduce"):
            op.seq = c.coll_seq
            c.coll_seq += 1
        elif kind == "send":
            op.seq = c.send_seq[peer]
            c.send_seq[peer] += 1
        else:
            op.seq = c.recv_seq[peer]
            c.recv_seq[peer] += 1
        g = _group()
        if g.depth > 0:
            status = _join_group(g, c.blocking)
            if status == ncclSuccess:
                g.jobs.append(("op", c, op))
            return status
        return _end_group([("op", c, op)], c.blocking)


# ------------------------------------------------------------------------------------------------
# Kernels


class _Op:
    __slots__ = ("comm", "kind", "sendptr", "recvptr", "count", "dtype", "peer", "redop", "stream", "nbytes", "seq")

    def __init__(self, comm, kind, sendptr, recvptr, count, dtype, peer, redop, stream, nbytes):
        self.comm, self.kind, self.sendptr, self.recvptr = comm, kind, sendptr, recvptr
        self.count, self.dtype, self.peer, self.redop = count, dtype, peer, redop
        self.stream, self.nbytes, self.seq = stream, nbytes, 0

    def meta(self) -> bytes:
        if self.kind in ("send", "recv"):
            return f"p2p nbytes={self.nbytes}".encode()
        root = self.peer if self.kind == "bcast" else "-"
        return f"{self.kind} root={root} type={self.dtype} count={self.count} op={self.redop}".encode()

    def __repr__(self) -> str:
        return f"{self.kind}#{self.seq}({self.meta().decode()}, peer={self.peer}) on {self.comm}"


def _enqueue(job: _GroupJob, ops: list[_Op]) -> int:
    """Put the group's operations on their streams as one task per stream (several streams join)."""
    by_stream: dict[int, list[_Op]] = {}
    for op in ops:
        by_stream.setdefault(op.stream, []).append(op)
    previous = runtime.getDevice()
    try:
        runtime.setDevice(ops[0].comm.device)
        queues = [_gpu.queue_of(ptr) for ptr in by_stream]
    except runtime.CUDARuntimeError:
        return ncclUnhandledCudaError
    finally:
        runtime.setDevice(previous)
    if _gpu.sticky() is not None:
        return ncclUnhandledCudaError
    fault = _take_fault("async_error", "op", job.comms)
    for op in ops:
        with op.comm.cv:
            op.comm.pending += 1
    if fault:
        for c in job.comms:
            c.doomed = True
    first, others = queues[0], queues[1:]
    arrived = [threading.Event() for _ in others]
    finished = threading.Event()

    def joined(i: int):
        def task():
            arrived[i].set()
            finished.wait()

        return task

    for i, q in enumerate(others):
        q.submit(joined(i), "ncclGroup (joined stream)")

    def kernel():
        try:
            for a in arrived:
                a.wait()
            _run(ops)
        finally:
            finished.set()
            for op in ops:
                with op.comm.cv:
                    op.comm.pending -= 1
                    op.comm.cv.notify_all()

    first.submit(kernel, f"nccl kernel {ops}")
    if fault:
        code = fault.get("code") or ncclRemoteError
        _gpu.note(f"injected fault: asynchronous error {code} on {job.comms}; their kernels never complete")
        for c in job.comms:
            c.async_result = code
    return ncclSuccess


def _run(ops: list[_Op]) -> None:
    """One group's kernel: post everything outgoing, then take everything incoming (so no member
    waits for another's acknowledgement before answering its data), then wait for acknowledgements."""
    live = []
    for op in ops:
        c = op.comm
        if c.doomed:
            c.hang()
            continue
        if c.stop():
            continue
        live.append(op)
        if op.kind in ("bcast", "allreduce"):  # every member says which collective it runs here
            for r in range(c.nranks):
                if r != c.rank:
                    c.conns[r].send(_META, _COLL, op.seq, op.meta())
        if op.kind == "send":
            c.conns[op.peer].send(_DATA, _P2P, op.seq, op.meta(), _read(op.sendptr, op.nbytes))
        elif (op.kind == "bcast" and c.rank == op.peer) or op.kind == "allreduce":
            data = _read(op.sendptr, op.nbytes)
            for r in range(c.nranks):
                if r != c.rank:
                    c.conns[r].send(_DATA, _COLL, op.seq, op.meta(), data)
            if op.kind == "bcast" and op.recvptr != op.sendptr:
                _write(op.recvptr, data)
    waits = []
    for op in live:
        c = op.comm
        if op.kind in ("bcast", "allreduce") and not _members_agree(op):
            continue
        if op.kind == "recv":
            msg = _take_matching(op, op.peer, _P2P)
            if msg is None:
                continue
            _write(op.recvptr, msg)
            c.conns[op.peer].send(_ACK, _P2P, op.seq)
        elif op.kind == "bcast" and c.rank != op.peer:
            msg = _take_matching(op, op.peer, _COLL)
            if msg is None:
                continue
            _write(op.recvptr, msg)
            c.conns[op.peer].send(_ACK, _COLL, op.seq)
        elif op.kind == "allreduce":
            parts = {c.rank: _read(op.sendptr, op.nbytes)}
            for r in range(c.nranks):
                if r != c.rank:
                    parts[r] = _take_matching(op, r, _COLL)
                    if parts[r] is None:
                        break
            else:
                _write(op.recvptr, _reduce([parts[r] for r in range(c.nranks)], op.dtype, op.redop, c.nranks))
        else:
            waits.append(op)
    for op in waits:
        c = op.comm
        peers = [op.peer] if op.kind == "send" else [r for r in range(c.nranks) if r != c.rank]
        chan = _P2P if op.kind == "send" else _COLL
        for r in peers:
            if c.take(r, _ACK, chan, op.seq) is None:
                break


def _mismatch(op: _Op, peer: int, theirs: bytes) -> None:
    """A member issued something else at this place: never completes (until abort), with a diagnostic."""
    c = op.comm
    _gpu.note(
        f"rank {c.rank} of {c}: operation #{op.seq} is {op.meta().decode()}, rank {peer} issued {theirs.decode()} "
        "at the same place: on a GPU this hangs or corrupts data; the stand-in hangs"
    )
    c.hang()


def _members_agree(op: _Op) -> bool:
    """Every other member announced the same collective at this sequence number (False: aborted)."""
    c = op.comm
    for r in range(c.nranks):
        if r != c.rank:
            msg = c.take(r, _META, _COLL, op.seq)
            if msg is None:
                return False
            if msg[0] != op.meta():
                _mismatch(op, r, msg[0])
                return False
    return True


def _take_matching(op: _Op, peer: int, chan: int) -> bytes | None:
    """The peer's data for this operation; a mismatch never completes (with a diagnostic)."""
    msg = op.comm.take(peer, _DATA, chan, op.seq)
    if msg is None:
        return None
    meta, payload = msg
    if meta != op.meta():
        _mismatch(op, peer, meta)
        return None
    return payload


def _read(ptr: int, nbytes: int) -> bytes:
    return _gpu.resolve(ptr, nbytes).tobytes() if nbytes else b""


def _write(ptr: int, data: bytes) -> None:
    if data:
        _gpu.resolve(ptr, len(data))[:] = np.frombuffer(data, dtype=np.uint8)


def _bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _f32_to_bf16(x: np.ndarray) -> np.ndarray:
    u = x.astype(np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)  # round to nearest even


def _reduce(parts: list[bytes], dtype: int, redop: int, nranks: int) -> bytes:
    """Reduce in rank order, every step in the element type (bfloat16 through float32, rounded back)."""
    fn = {NCCL_SUM: np.add, NCCL_PROD: np.multiply, NCCL_MAX: np.maximum, NCCL_MIN: np.minimum, NCCL_AVG: np.add}
    arrays = [np.frombuffer(p, dtype=_NUMPY[dtype]) for p in parts]
    if dtype == NCCL_BFLOAT16:
        acc = _bf16_to_f32(arrays[0])
        for a in arrays[1:]:
            acc = _bf16_to_f32(_f32_to_bf16(fn[redop](acc, _bf16_to_f32(a))))
        if redop == NCCL_AVG:
            acc = acc / nranks
        return _f32_to_bf16(acc).tobytes()
    acc = arrays[0].copy()
    with np.errstate(all="ignore"):
        for a in arrays[1:]:
            acc = fn[redop](acc, a).astype(acc.dtype)
        if redop == NCCL_AVG:
            acc = (acc / nranks).astype(acc.dtype)
    return acc.tobytes()


# ------------------------------------------------------------------------------------------------
# NCCL's C API where cupy has no binding (the runtime's ``backends/nccl/library.py`` binds the real
# libnccl through ctypes): ``ncclCommInitRankConfig`` with ``ncclConfig_t.blocking`` set per
# communicator (NCCL's user guide, "Communicator creation with options"; unset, NCCL_COMM_BLOCKING
# decides). The communicators it makes answer the calls cupy's do.


class _CLibrary:
    path = "cupy-standin"

    def init_rank(self, nranks: int, uid: bytes, rank: int, *, blocking: bool) -> NcclCommunicator:
        if len(uid) != NCCL_UNIQUE_ID_BYTES:
            raise ValueError(f"an NCCL unique id has {NCCL_UNIQUE_ID_BYTES} bytes, got {len(uid)}")
        comm = NcclCommunicator.__new__(NcclCommunicator)
        comm._comm = 0
        status = comm._init(int(nranks), bytes(uid), int(rank), bool(blocking))
        if status not in (ncclSuccess, ncclInProgress):
            check_status(status)
        return comm


_C = _CLibrary()


def c_library() -> _CLibrary:
    return _C
