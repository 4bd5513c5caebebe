"""NCCL's C API for what cupy does not expose: communicators created with their own configuration
(``ncclCommInitRankConfig`` with ``ncclConfig_t.blocking = 0``), so that the backend never sets
``NCCL_COMM_BLOCKING`` in the process environment, which NCCL reads once per process and would
apply to a framework's own communicators too (torch.distributed's, in an attached worker).

``CLibrary`` binds the libnccl this process already loaded (the one cupy and torch use: one per
process, ``cuda_buffers.check_gpu_stack``) through ctypes and makes communicators that answer the
calls the backend makes of cupy's (``bcast``, ``send``, ``recv``, ``allReduce``,
``check_async_error``, ``abort``, ``destroy``, ``comm``), raising ``NcclStatus`` (its ``status``:
the ``ncclResult_t``) where cupy raises ``NcclError``. Where no libnccl is mapped (the CPU
stand-in models the same C API: ``cupy.cuda.nccl.c_library()``), ``c_library()`` returns that.

ncclConfig_t: NCCL copies ``min(config.size, sizeof(ncclConfig_t))`` bytes of what it is given
and starts every field past them at its default (src/init.cc, ``parseCommConfig``, NCCL 2.18 to
2.30); a config that declares version 2.14 and stops after ``blocking`` says nothing else.
"""

from __future__ import annotations

import ctypes
import threading

NCCL_API_MAGIC = 0xCAFEBEEF
CONFIG_VERSION = 2 * 10000 + 14 * 100  # NCCL_VERSION(2, 14, 0): the first with ``blocking``
UNIQUE_ID_BYTES = 128


class NcclStatus(RuntimeError):
    """An ``ncclResult_t`` other than ``ncclSuccess`` (7: ``ncclInProgress``)."""

    def __init__(self, status: int, what: str):
        self.status = int(status)
        super().__init__(f"{what}: ncclResult {self.status}")


class _Config(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("magic", ctypes.c_uint),
        ("version", ctypes.c_uint),
        ("blocking", ctypes.c_int),
    ]


#: The bytes of ``_Config`` NCCL reads: up to ``blocking`` (not the struct's trailing padding).
CONFIG_BYTES = _Config.blocking.offset + ctypes.sizeof(ctypes.c_int)


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_ubyte * UNIQUE_ID_BYTES)]  # bytes, NULs too (c_char stops at one)


class CComm:
    """One communicator made through the C API: the calls the backend makes of cupy's."""

    def __init__(self, lib: CLibrary, handle: int):
        self._lib = lib
        self.comm = handle

    def bcast(self, buff: int, count: int, datatype: int, root: int, stream: int) -> None:
        self._lib.check(self._lib.broadcast(buff, buff, count, datatype, root, self.comm, stream), "ncclBroadcast")

    def send(self, buff: int, count: int, datatype: int, peer: int, stream: int) -> None:
        self._lib.check(self._lib.send(buff, count, datatype, peer, self.comm, stream), "ncclSend")

    def recv(self, buff: int, count: int, datatype: int, peer: int, stream: int) -> None:
        self._lib.check(self._lib.recv(buff, count, datatype, peer, self.comm, stream), "ncclRecv")

    def allReduce(self, send: int, recv: int, count: int, datatype: int, op: int, stream: int) -> None:  # noqa: N802
        self._lib.check(self._lib.all_reduce(send, recv, count, datatype, op, self.comm, stream), "ncclAllReduce")

    def check_async_error(self) -> None:
        error = ctypes.c_int(0)
        self._lib.check(self._lib.get_async_error(self.comm, ctypes.byref(error)), "ncclCommGetAsyncError")
        self._lib.check(error.value, "the communicator's asynchronous error")

    def abort(self) -> None:
        if self.comm:
            self._lib.abort(self.comm)  # its result is of no use: the communicator is gone either way
            self.comm = 0

    def destroy(self) -> None:
        if self.comm:
            self._lib.destroy(self.comm)
            self.comm = 0


class CLibrary:
    """NCCL's C API in the libnccl at ``path`` (already loaded in this process)."""

    def __init__(self, path: str):
        lib = ctypes.CDLL(path)
        ptr, size, i = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
        self._init = _fn(lib.ncclCommInitRankConfig, ctypes.POINTER(ptr), i, _UniqueId, i, ctypes.POINTER(_Config))
        self.broadcast = _fn(lib.ncclBroadcast, ptr, ptr, size, i, i, ptr, ptr)
        self.send = _fn(lib.ncclSend, ptr, size, i, i, ptr, ptr)
        self.recv = _fn(lib.ncclRecv, ptr, size, i, i, ptr, ptr)
        self.all_reduce = _fn(lib.ncclAllReduce, ptr, ptr, size, i, i, ptr, ptr)
        self.get_async_error = _fn(lib.ncclCommGetAsyncError, ptr, ctypes.POINTER(i))
        self.abort = _fn(lib.ncclCommAbort, ptr)
        self.destroy = _fn(lib.ncclCommDestroy, ptr)
        self.path = path

    @staticmethod
    def check(status: int, what: str) -> None:
        if status:
            raise NcclStatus(status, what)

    def init_rank(self, nranks: int, uid: bytes, rank: int, *, blocking: bool) -> CComm:
        """``ncclCommInitRankConfig`` of rank ``rank`` of ``nranks`` with ``uid``: blocking or not, this
        communicator only. Non-blocking, it may still be connecting when this returns: poll its
        ``check_async_error`` until it no longer answers ``ncclInProgress``."""
        if len(uid) != UNIQUE_ID_BYTES:
            raise ValueError(f"an NCCL unique id has {UNIQUE_ID_BYTES} bytes, got {len(uid)}")
        config = _Config(CONFIG_BYTES, NCCL_API_MAGIC, CONFIG_VERSION, 1 if blocking else 0)
        handle = ctypes.c_void_p(0)
        status = self._init(
            ctypes.byref(handle),
            nranks,
            _UniqueId((ctypes.c_ubyte * UNIQUE_ID_BYTES)(*uid)),
            rank,
            ctypes.byref(config),
        )
        comm = CComm(self, handle.value or 0)
        if status not in (0, IN_PROGRESS):  # in progress: it exists and connects; its owner polls it
            comm.abort()
            raise NcclStatus(status, "ncclCommInitRankConfig")
        return comm


IN_PROGRESS = 7  # ncclInProgress


def _fn(f, *argtypes):
    f.argtypes = list(argtypes)
    f.restype = ctypes.c_int
    return f


_LOCK = threading.Lock()
_LIBRARY: list = []


def c_library():
    """This process's NCCL C API: ``CLibrary`` over the libnccl it loaded (cupy's NCCL imported
    first), or the CPU stand-in's model of it; None where neither is there."""
    with _LOCK:
        if not _LIBRARY:
            from reshard.runtime.backends import cuda_buffers as cb

            _, nccl = cb.import_nccl()
            paths = cb.loaded_nccl_libraries()
            model = getattr(nccl, "c_library", None)  # the CPU stand-in's (tests/gpu/standin)
            _LIBRARY.append(CLibrary(paths[0]) if len(paths) == 1 else model() if model is not None else None)
        return _LIBRARY[0]
