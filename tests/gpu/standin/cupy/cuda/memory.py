"""``cupy.cuda.memory`` of the stand-in: ``Memory``, ``UnownedMemory``, ``MemoryPointer``, ``alloc``.

Follows cupy/cuda/memory.pyx: a ``MemoryPointer`` is ``(mem, offset)`` with ``ptr = mem.ptr +
offset``; an allocation is freed when its last ``Memory`` reference goes away (the pool's block
then holds garbage for its next user; here the range becomes invalid, so a later use faults).
"""

from __future__ import annotations

import weakref

from cupy.cuda import _gpu, runtime


class BaseMemory:
    ptr = 0
    size = 0
    device_id = 0

    def host_bytes(self):
        """The allocation's bytes as a host ``numpy.uint8`` array (the stand-in's device memory)."""
        raise NotImplementedError

    @property
    def device(self):
        from cupy.cuda.device import Device

        return Device(self.device_id)


class Memory(BaseMemory):
    """A device allocation of this process (``cudaMalloc`` through cupy's pool)."""

    def __init__(self, size: int):
        self.size = int(size)
        self.device_id = runtime.getDevice()
        self._alloc = _gpu.malloc(self.size, self.device_id)
        self.ptr = 0 if self._alloc is None else self._alloc.ptr
        if self._alloc is not None:
            weakref.finalize(self, _gpu.free, self.ptr)

    def host_bytes(self):
        return self._alloc.buf[: self.size] if self._alloc is not None else None


class UnownedMemory(BaseMemory):
    """Memory allocated by someone else (``owner`` keeps it alive); must lie in a live allocation."""

    def __init__(self, ptr: int, size: int, owner, device_id: int | None = None):
        self.ptr = int(ptr)
        self.size = int(size)
        self._owner = owner
        self.device_id = runtime.getDevice() if device_id is None else int(device_id)
        self._alloc = _gpu.allocation_of(self.ptr) if self.size else None
        if self.size and (self._alloc is None or self.ptr + self.size > self._alloc.ptr + self._alloc.size):
            raise runtime.CUDARuntimeError(runtime.cudaErrorInvalidValue)

    def host_bytes(self):
        if self._alloc is None:
            return None
        start = self.ptr - self._alloc.ptr
        return self._alloc.buf[start : start + self.size]


class MemoryPointer:
    """A pointer into a ``Memory``: ``ptr = mem.ptr + offset``."""

    __slots__ = ("mem", "ptr", "device_id")

    def __init__(self, mem: BaseMemory, offset: int):
        self.mem = mem
        self.ptr = mem.ptr + int(offset) if mem.ptr else 0
        self.device_id = mem.device_id

    def __int__(self) -> int:
        return self.ptr

    def __add__(self, offset: int) -> MemoryPointer:
        return MemoryPointer(self.mem, self.ptr - self.mem.ptr + offset)

    @property
    def device(self):
        return self.mem.device


def alloc(size: int) -> MemoryPointer:
    return MemoryPointer(Memory(size), 0)


class HostMemory(BaseMemory):
    """Host memory that a DLPack producer (a CPU torch tensor) lends as stand-in device memory,
    registered as an allocation for as long as this object lives (``cupy.from_dlpack``)."""

    def __init__(self, host, owner):
        import numpy as np

        flat = host.reshape(-1).view(np.uint8) if host.flags.c_contiguous else None
        if flat is None:  # a strided view: register the span it covers
            lo = sum(s * (n - 1) for s, n in zip(host.strides, host.shape, strict=True) if s < 0)
            hi = host.itemsize + sum(s * (n - 1) for s, n in zip(host.strides, host.shape, strict=True) if s > 0)
            address = host.ctypes.data + lo
            flat = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * (hi - lo)).from_address(address))
        self.start = 0
        self._owner = (host, owner)
        self.device_id = runtime.getDevice()
        self._alloc = _gpu.register_host(flat, self.device_id)
        self.ptr = self._alloc.ptr
        self.size = self._alloc.size
        self.start = host.ctypes.data - flat.ctypes.data
        weakref.finalize(self, _gpu.free, self.ptr)

    def host_bytes(self):
        return self._alloc.buf
