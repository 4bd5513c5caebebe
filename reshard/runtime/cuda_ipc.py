"""CUDA IPC between the GPU device actors of one machine: the GPU twin of ``shared_memory``.

A holder names a source shard (a CUDA tensor) to other processes with ``CudaShards.descriptor(t)``:
the CUDA IPC handle of the allocation that contains it (``cudaIpcGetMemHandle`` of the block's
base, found with ``cuMemGetAddressRange``), the tensor's byte offset in that allocation, its
shape, the holder's pid and its GPU's UUID, and an IPC event handle. A peer opens the allocation
once (``PeerCudaShards.get``: ``cudaIpcOpenMemHandle``), keeps it while the owner process lives
(``purge``), and copies slices straight out of it: ``dst_slice.copy_(peer_view[region])`` on its
communication stream (``PeerCudaShards.copy``). The PULL ops and their validation are those of the
CPU path (``reshard.pulls``); NCCL stays for transfers between machines and for relays.

Device numbering: Ray gives every actor its own CUDA_VISIBLE_DEVICES, so device indices differ
between processes. The descriptor names the GPU by UUID and the importer maps it to its own index
(``device_for_uuid``); a GPU the importer cannot see cannot be pulled from (the driver should plan
pulls only between devices that see each other's GPUs: ``visible_gpu_uuids``).

Ready event: a shard may still be being written by kernels queued on the holder's stream when a
reshard starts. ``descriptor`` records an interprocess CUDA event (one per storage, re-recorded at
every export) on the holder's current stream and puts its ``cudaIpcEventHandle`` in the
descriptor; the puller makes its stream wait on that event before the copy, so the copy reads the
shard after the holder's last write that preceded the export.

Lifetime: the holder's caching allocator may hand a freed shard's block to a new tensor; a peer's
open mapping then still addresses the same block and a fresh descriptor names the new tensor's
offset in it, so mappings stay correct. Mappings of processes that exited are dropped by
``purge``; ``clear`` closes everything (call both only when no copy out of them is in flight).
"""

from __future__ import annotations

import ctypes
import os
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from reshard.errors import ReshardError

IPC_HANDLE_BYTES = 64  # cudaIpcMemHandle_t / cudaIpcEventHandle_t
PEER_MAPS = 256  # open peer allocations kept per device (least recently used closed first)


# ----------------------------------------------------------------------------------------------
# Pure helpers


def normalize_uuid(uuid) -> str:
    """A GPU UUID as 32 lowercase hex digits: accepts 16 raw bytes (cupy's device properties) or
    text such as ``GPU-1b2c...`` (nvidia-smi, CUDA_VISIBLE_DEVICES) with or without dashes. MIG
    instances keep their ``mig-`` prefix (they are not the same device as their parent GPU)."""
    if isinstance(uuid, bytes | bytearray):
        if len(uuid) != 16:
            raise ValueError(f"a GPU UUID has 16 bytes, got {len(uuid)}")
        return bytes(uuid).hex()
    if not isinstance(uuid, str):
        raise TypeError(f"a GPU UUID is 16 bytes or text, got {type(uuid).__name__}")
    text = uuid.strip().lower()
    prefix = ""
    if text.startswith("gpu-"):
        text = text[4:]
    elif text.startswith("mig-"):
        prefix, text = "mig-", text[4:]
    digits = text.replace("-", "")
    if len(digits) != 32 or any(c not in "0123456789abcdef" for c in digits):
        raise ValueError(f"{uuid!r} is not a GPU UUID (32 hex digits, optionally GPU-/MIG- prefixed, dashes allowed)")
    return prefix + digits


def device_for_uuid(uuid: str, visible: Sequence[str]) -> int | None:
    """This process's CUDA index of the GPU ``uuid`` among its ``visible`` UUIDs (None: not visible)."""
    want = normalize_uuid(uuid)
    for i, u in enumerate(visible):
        if normalize_uuid(u) == want:
            return i
    return None


@dataclass(frozen=True, slots=True)
class CudaShard:
    """A holder's CUDA tensor as other processes of its machine can open it."""

    pid: int
    gpu_uuid: str
    handle: bytes  # cudaIpcMemHandle_t of the allocation holding the tensor
    alloc_nbytes: int  # size of that allocation
    offset_bytes: int  # where the tensor starts in it
    shape: tuple[int, ...]
    event: bytes | None = None  # cudaIpcEventHandle_t recorded after the holder's last write, or None

    def __post_init__(self):
        if not isinstance(self.pid, int) or self.pid <= 0:
            raise ValueError(f"CudaShard.pid must be a positive process id, got {self.pid!r}")
        object.__setattr__(self, "gpu_uuid", normalize_uuid(self.gpu_uuid))
        for name in ("handle", "event"):
            v = getattr(self, name)
            if v is None and name == "event":
                continue
            if not isinstance(v, bytes | bytearray) or len(v) != IPC_HANDLE_BYTES:
                raise ValueError(f"CudaShard.{name} must be {IPC_HANDLE_BYTES} bytes (a CUDA IPC handle)")
            object.__setattr__(self, name, bytes(v))
        if self.alloc_nbytes <= 0 or not 0 <= self.offset_bytes < self.alloc_nbytes:
            raise ValueError(
                f"CudaShard: offset {self.offset_bytes} must lie inside the allocation of {self.alloc_nbytes} bytes"
            )
        shape = tuple(int(n) for n in self.shape)
        if any(n < 0 for n in shape):
            raise ValueError(f"CudaShard.shape {self.shape} has a negative extent")
        object.__setattr__(self, "shape", shape)

    def nbytes(self, itemsize: int) -> int:
        n = itemsize
        for s in self.shape:
            n *= s
        return n

    def check_fits(self, itemsize: int) -> None:
        """ValueError unless ``shape`` of ``itemsize``-byte elements at ``offset_bytes`` fits the allocation."""
        if self.offset_bytes % itemsize:
            raise ValueError(f"CudaShard: offset {self.offset_bytes} is not aligned to {itemsize}-byte elements")
        end = self.offset_bytes + self.nbytes(itemsize)
        if end > self.alloc_nbytes:
            raise ValueError(
                f"CudaShard: {self.shape} of {itemsize}-byte elements at offset {self.offset_bytes} ends at byte "
                f"{end}, past the {self.alloc_nbytes}-byte allocation (wrong dtype for this descriptor?)"
            )

    def encode(self) -> tuple:
        """Plain msgpack-able tuple (``decode`` inverts it)."""
        return (
            self.pid,
            self.gpu_uuid,
            self.handle,
            self.alloc_nbytes,
            self.offset_bytes,
            list(self.shape),
            self.event,
        )

    @classmethod
    def decode(cls, data) -> CudaShard:
        if isinstance(data, CudaShard):
            return data
        pid, uuid, handle, alloc, offset, shape, event = data
        return cls(int(pid), uuid, handle, int(alloc), int(offset), tuple(shape), event)


# ----------------------------------------------------------------------------------------------
# Runtime (torch, cupy and the CUDA driver, loaded on first use)


_LIBCUDA = None


def address_range(ptr: int) -> tuple[int, int]:
    """``(base, size)`` of the CUDA allocation containing device pointer ``ptr`` (``cuMemGetAddressRange``)."""
    global _LIBCUDA
    if _LIBCUDA is None:
        lib = ctypes.CDLL("libcuda.so.1")
        fn = lib.cuMemGetAddressRange_v2
        fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
        fn.restype = ctypes.c_int
        _LIBCUDA = fn
    base, size = ctypes.c_uint64(0), ctypes.c_size_t(0)
    rc = _LIBCUDA(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
    if rc != 0:
        raise OSError(f"cuMemGetAddressRange({ptr:#x}) failed with CUresult {rc}")
    return int(base.value), int(size.value)


_VISIBLE: list[str] | None = None


def visible_gpu_uuids() -> list[str]:
    """UUIDs of the GPUs this process sees, in its CUDA index order (empty without torch's CUDA or GPUs).

    Read through torch, which returns the 16 raw bytes: cupy's ``getDeviceProperties(i)["uuid"]``
    converts them like a C string, so a UUID holding a 0x00 byte comes back truncated."""
    global _VISIBLE
    if _VISIBLE is None:
        try:
            import torch

            if not torch.cuda.is_available():
                return []
            n = torch.cuda.device_count()
            _VISIBLE = [normalize_uuid(bytes(torch.cuda.get_device_properties(i).uuid.bytes)) for i in range(n)]
        except (ImportError, RuntimeError, AttributeError, ValueError):
            return []
    return list(_VISIBLE)


class CudaShards:
    """Exporter: descriptors of this process's CUDA shards, each with its storage's ready event."""

    def __init__(self):
        self.events: dict[int, tuple[weakref.ref, object]] = {}  # storage data_ptr -> (storage, torch event)

    def descriptor(self, t) -> CudaShard | None:
        """How peers of this machine open CUDA tensor ``t``; None when it cannot be exported (not a
        contiguous non-empty CUDA tensor, or memory without IPC support such as expandable segments)."""
        import torch

        if t is None or not isinstance(t, torch.Tensor) or not t.is_cuda or not t.is_contiguous() or t.numel() == 0:
            return None
        import cupy

        ptr = t.data_ptr()
        index = t.device.index
        uuids = visible_gpu_uuids()
        if index >= len(uuids):  # no UUID to name the GPU by: peers could not find it
            return None
        try:
            with cupy.cuda.Device(index):
                base, size = address_range(ptr)
                handle = cupy.cuda.runtime.ipcGetMemHandle(base)
        except (OSError, cupy.cuda.runtime.CUDARuntimeError):
            return None
        event = self._ready_event(t)
        return CudaShard(os.getpid(), uuids[index], handle, size, ptr - base, tuple(t.shape), event)

    def _ready_event(self, t) -> bytes:
        import torch

        storage = t.untyped_storage()
        key = storage.data_ptr()
        hit = self.events.get(key)
        if hit is None or hit[0]() is None:
            ev = torch.cuda.Event(enable_timing=False, interprocess=True)
            self.events[key] = hit = (weakref.ref(storage), ev)
            weakref.finalize(storage, self.events.pop, key, None)
        ev = hit[1]
        ev.record(torch.cuda.current_stream(t.device))
        return bytes(ev.ipc_handle())


@dataclass
class _Mapping:
    index: int  # this process's CUDA index of the holder's GPU
    ptr: int  # base of the opened allocation here
    flat: object  # torch uint8 tensor over the whole allocation


class PeerCudaShards:
    """Importer: peers' CUDA allocations opened in this process, kept while their owner process
    lives (``purge``), at most ``limit`` (least recently used closed first)."""

    def __init__(self, device: int, limit: int = PEER_MAPS):
        self.device = device
        self.limit = limit
        self.maps: OrderedDict[tuple[int, bytes], _Mapping] = OrderedDict()
        self.events: dict[tuple[int, bytes], object] = {}

    def get(self, holder: int, desc, dtype):
        """Device ``holder``'s shard named by ``desc`` (a ``CudaShard`` or its ``encode()``), as a
        torch tensor of ``dtype`` and the shard's shape on this process's index of the holder's GPU."""
        d = CudaShard.decode(desc)
        if d.pid == os.getpid():
            raise ValueError(
                f"device {self.device}: device {holder}'s shard lives in this process; use the tensor itself "
                "(CUDA cannot open an IPC handle in the process that exported it)"
            )
        d.check_fits(dtype.itemsize)
        key = (d.pid, d.handle)
        m = self.maps.get(key)
        if m is None:
            m = self.maps[key] = self._open(holder, d)
            while len(self.maps) > self.limit:
                self._close(self.maps.popitem(last=False)[1])
        else:
            self.maps.move_to_end(key)
        nbytes = d.nbytes(dtype.itemsize)
        return m.flat[d.offset_bytes : d.offset_bytes + nbytes].view(dtype).view(d.shape)

    def wait_ready(self, desc, stream) -> None:
        """Make torch ``stream`` wait for the holder's writes that preceded the export of ``desc``."""
        d = CudaShard.decode(desc)
        if d.event is None:
            return
        import torch

        key = (d.pid, d.event)
        ev = self.events.get(key)
        if ev is None:
            index = self._index(None, d)
            ev = self.events[key] = torch.cuda.Event.from_ipc_handle(index, d.event)
        stream.wait_event(ev)

    def copy(self, dst, holder: int, desc, region: tuple, stream=None) -> None:
        """``dst.copy_(holder's shard[region])`` on ``stream`` (default: ``dst``'s current stream),
        after the holder's ready event. The caller orders later reads of ``dst`` after ``stream``."""
        import torch

        src = self.get(holder, desc, dst.dtype)[region]
        stream = torch.cuda.current_stream(dst.device) if stream is None else stream
        self.wait_ready(desc, stream)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def purge(self, keep: Iterable | None = None) -> None:
        """Close the allocations of processes that exited, and, when ``keep`` (descriptors) is given,
        those no descriptor in it names. Only while no copy out of them is in flight."""
        descs = None if keep is None else [CudaShard.decode(d) for d in keep]
        maps = None if descs is None else {(d.pid, d.handle) for d in descs}
        events = None if descs is None else {(d.pid, d.event) for d in descs}
        for key, m in list(self.maps.items()):
            if not _alive(key[0]) or (maps is not None and key not in maps):
                del self.maps[key]
                self._close(m)
        for key in list(self.events):
            if not _alive(key[0]) or (events is not None and key not in events):
                del self.events[key]

    def clear(self) -> None:
        """Close everything (only while no copy out of it is in flight)."""
        while self.maps:
            self._close(self.maps.popitem(last=False)[1])
        self.events.clear()

    def _index(self, holder: int | None, d: CudaShard) -> int:
        index = device_for_uuid(d.gpu_uuid, visible_gpu_uuids())
        if index is None:
            who = "the holder" if holder is None else f"device {holder}"
            raise ReshardError(
                f"device {self.device}: {who}'s GPU {d.gpu_uuid} is not visible in this process "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); CUDA IPC pulls need the "
                "holder's GPU visible here: plan a transfer through NCCL instead"
            )
        return index

    def _open(self, holder: int, d: CudaShard) -> _Mapping:
        import cupy
        import torch

        index = self._index(holder, d)
        try:
            with cupy.cuda.Device(index):
                ptr = cupy.cuda.runtime.ipcOpenMemHandle(d.handle)
        except cupy.cuda.runtime.CUDARuntimeError as e:
            raise ReshardError(
                f"device {self.device}: cannot open device {holder}'s shard (process {d.pid}, GPU {d.gpu_uuid}): {e}; "
                "the holder exited or freed it, or the GPUs cannot access each other"
            ) from e
        mem = cupy.cuda.UnownedMemory(ptr, d.alloc_nbytes, self, index)
        arr = cupy.ndarray((d.alloc_nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))
        return _Mapping(index, ptr, torch.from_dlpack(arr))

    @staticmethod
    def _close(m: _Mapping) -> None:
        import cupy

        m.flat = None
        with cupy.cuda.Device(m.index):
            cupy.cuda.runtime.ipcCloseMemHandle(m.ptr)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
