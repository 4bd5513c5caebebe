"""Device buffers for the NCCL backend: torch CUDA tensors and cupy arrays, zero-copy.

NCCL only sees ``(pointer, count, NCCL type)``. A torch tensor gives ``data_ptr()``, a cupy array
``data.ptr``; both already include the view's offset, so a contiguous slice of a larger buffer
is sent in place. A non-contiguous view is packed into (or unpacked from) a segment of ONE
reusable staging buffer per actor, on the communication stream, in stream order with the
transfer that uses it.

Broadcast, send and recv copy bytes and never reduce, so an element type without an NCCL type
(``bool``, ``int16``, complex types) travels as ``uint8`` with ``count = nbytes``; bit patterns
arrive unchanged. The tables at the top are pure (no cupy, no torch); everything that touches a
GPU imports cupy / torch on first use.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# ncclDataType_t values (nccl.h; stable since NCCL 2.0, bfloat16 since 2.10).
NCCL_INT8 = 0
NCCL_UINT8 = 1
NCCL_INT32 = 2
NCCL_UINT32 = 3
NCCL_INT64 = 4
NCCL_UINT64 = 5
NCCL_FLOAT16 = 6
NCCL_FLOAT32 = 7
NCCL_FLOAT64 = 8
NCCL_BFLOAT16 = 9

NCCL_TYPE_NAMES = {
    NCCL_INT8: "NCCL_INT8",
    NCCL_UINT8: "NCCL_UINT8",
    NCCL_INT32: "NCCL_INT32",
    NCCL_UINT32: "NCCL_UINT32",
    NCCL_INT64: "NCCL_INT64",
    NCCL_UINT64: "NCCL_UINT64",
    NCCL_FLOAT16: "NCCL_FLOAT16",
    NCCL_FLOAT32: "NCCL_FLOAT32",
    NCCL_FLOAT64: "NCCL_FLOAT64",
    NCCL_BFLOAT16: "NCCL_BFLOAT16",
}

NCCL_TYPE_SIZE = {
    NCCL_INT8: 1, NCCL_UINT8: 1, NCCL_INT32: 4, NCCL_UINT32: 4, NCCL_INT64: 8, NCCL_UINT64: 8,
    NCCL_FLOAT16: 2, NCCL_FLOAT32: 4, NCCL_FLOAT64: 8, NCCL_BFLOAT16: 2,
}  # fmt: skip

# Element type name (numpy / torch spelling without the "torch." prefix) -> NCCL type that carries
# it element for element. Anything else, bool included, is carried as bytes (NCCL_UINT8).
NATIVE_NCCL_TYPE = {
    "float64": NCCL_FLOAT64,
    "float32": NCCL_FLOAT32,
    "float16": NCCL_FLOAT16,
    "bfloat16": NCCL_BFLOAT16,
    "int64": NCCL_INT64,
    "int32": NCCL_INT32,
    "int8": NCCL_INT8,
    "uint8": NCCL_UINT8,
    "uint32": NCCL_UINT32,
    "uint64": NCCL_UINT64,
}

STAGING_ALIGN_BYTES = 256  # cudaMalloc alignment; keeps every dtype view of a segment aligned


def nccl_type_and_count(dtype_name: str, numel: int, itemsize: int) -> tuple[int, int]:
    """The NCCL type and element count that carry ``numel`` elements of ``dtype_name``."""
    code = NATIVE_NCCL_TYPE.get(dtype_name)
    if code is None or NCCL_TYPE_SIZE[code] != itemsize:
        return NCCL_UINT8, numel * itemsize
    return code, numel


def align_up(nbytes: int, align: int = STAGING_ALIGN_BYTES) -> int:
    return -(-nbytes // align) * align


@dataclass(frozen=True, slots=True)
class Segment:
    """A byte range ``[offset, offset + nbytes)`` of the staging buffer's generation ``generation``."""

    generation: int
    offset: int
    nbytes: int


class SegmentAllocator:
    """Bump allocation of aligned segments in one buffer that is reused after every ``reset``.

    Pure bookkeeping (the buffer itself lives in ``StagingBuffer``). If a batch needs more than
    the capacity, the allocator asks for a bigger buffer (a new *generation*); the old one must
    stay alive until ``reset`` because operations already queued may still use it. After
    ``reset`` only the newest buffer remains: steady state is one buffer per actor.
    """

    def __init__(self, capacity_bytes: int = 0):
        self.capacity_bytes = align_up(max(0, capacity_bytes))
        self.generation = 0
        self.used_bytes = 0
        self.high_water_bytes = 0

    def reserve(self, nbytes: int) -> bool:
        """Grow to at least ``nbytes`` (only between batches); True if a new buffer is needed."""
        if self.used_bytes:
            raise RuntimeError("reserve() while staging segments are in use; reset() first")
        nbytes = align_up(nbytes)
        if nbytes <= self.capacity_bytes:
            return False
        self.capacity_bytes = nbytes
        self.generation += 1
        return True

    def take(self, nbytes: int) -> tuple[Segment, bool]:
        """A segment of ``nbytes``; the flag says that a bigger buffer (new generation) is needed."""
        size = align_up(max(nbytes, 1))
        grew = False
        if self.used_bytes + size > self.capacity_bytes:
            # Grow geometrically; the new buffer holds this batch's later segments from offset 0.
            self.capacity_bytes = max(2 * self.capacity_bytes, size, align_up(self.used_bytes + size))
            self.generation += 1
            self.used_bytes = 0
            grew = True
        seg = Segment(self.generation, self.used_bytes, nbytes)
        self.used_bytes += size
        self.high_water_bytes = max(self.high_water_bytes, self.used_bytes)
        return seg, grew

    def reset(self) -> None:
        self.used_bytes = 0


# ----------------------------------------------------------------------------------------------
# Runtime part: cupy / torch imported on first use.

GPU_EXTRA_HINT = "install the GPU extra: pip install '.[gpu]' (cupy-cuda12x and nvidia-nccl-cu12)"


def import_cupy():
    """``cupy`` or an ImportError that says how to get it."""
    try:
        import cupy
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(f"the NCCL backend needs cupy: {GPU_EXTRA_HINT}") from e
    return cupy


def import_nccl():
    """``(cupy, cupy.cuda.nccl)``; ImportError naming the GPU extra when either is missing."""
    cupy = import_cupy()
    try:
        from cupy.cuda import nccl
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(f"cupy is installed but cupy.cuda.nccl is not usable: {GPU_EXTRA_HINT}") from e
    if not getattr(nccl, "available", True):  # pragma: no cover - cupy built without NCCL
        raise ImportError(f"cupy.cuda.nccl reports NCCL unavailable: {GPU_EXTRA_HINT}")
    return cupy, nccl


def framework_of(x) -> str:
    """``"torch"`` or ``"cupy"``; TypeError for anything else (host arrays included)."""
    mod = type(x).__module__ or ""
    if mod.startswith("torch"):
        if not getattr(x, "is_cuda", False):
            raise TypeError(f"the NCCL backend needs CUDA tensors; got a torch tensor on {x.device}")
        return "torch"
    if mod.startswith("cupy"):
        return "cupy"
    raise TypeError(f"the NCCL backend moves torch CUDA tensors or cupy arrays, not {type(x).__name__}")


@dataclass(frozen=True, slots=True)
class DeviceView:
    """What NCCL needs to know about one tensor / array."""

    framework: str  # "torch" | "cupy"
    ptr: int
    numel: int
    itemsize: int
    dtype_name: str
    shape: tuple[int, ...]
    contiguous: bool
    cuda_device: int

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    def nccl_args(self) -> tuple[int, int]:
        """``(count, nccl type)`` for a contiguous view."""
        code, count = nccl_type_and_count(self.dtype_name, self.numel, self.itemsize)
        return count, code


def describe(x) -> DeviceView:
    fw = framework_of(x)
    if fw == "torch":
        name = str(x.dtype).removeprefix("torch.")
        return DeviceView(
            "torch", int(x.data_ptr()), int(x.numel()), int(x.element_size()), name, tuple(x.shape),
            bool(x.is_contiguous()), int(x.device.index),
        )  # fmt: skip
    return DeviceView(
        "cupy", int(x.data.ptr), int(x.size), int(x.itemsize), str(x.dtype.name), tuple(x.shape),
        bool(x.flags.c_contiguous), int(x.device.id),
    )  # fmt: skip


def producer_stream(x, view: DeviceView):
    """The stream that computations on ``x`` are issued to now (torch / cupy current stream), as cupy."""
    cupy = import_cupy()
    if view.framework == "torch":
        import torch

        ptr = torch.cuda.current_stream(x.device).cuda_stream
    else:
        ptr = cupy.cuda.get_current_stream().ptr
    return _external_stream(cupy, ptr)


class _StreamHandle:
    """A raw ``cudaStream_t`` exposed through the CUDA stream protocol."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __cuda_stream__(self):
        return (0, self.ptr)


_EXTERNAL_STREAMS: dict[int, object] = {}


def _external_stream(cupy, ptr: int):
    """A cupy stream object for a stream owned by someone else (torch, the caller)."""
    if ptr == 0:
        return cupy.cuda.Stream.null
    s = _EXTERNAL_STREAMS.get(ptr)
    if s is None:
        if hasattr(cupy.cuda.Stream, "from_external"):  # cupy >= 14
            s = cupy.cuda.Stream.from_external(_StreamHandle(ptr))
        else:
            s = cupy.cuda.ExternalStream(ptr)
        if len(_EXTERNAL_STREAMS) > 64:
            _EXTERNAL_STREAMS.clear()
        _EXTERNAL_STREAMS[ptr] = s
    return s


class StagingBuffer:
    """ONE reusable device buffer per actor for non-contiguous views; segments handed out per batch."""

    def __init__(self, cuda_device: int):
        self.cuda_device = cuda_device
        self.alloc = SegmentAllocator()
        self._buffers: dict[int, object] = {}  # generation -> cupy uint8 array; old ones kept until reset

    @property
    def capacity_bytes(self) -> int:
        return self.alloc.capacity_bytes

    def reserve(self, nbytes: int) -> None:
        """Allocate up front (the program's ``staging_numel * itemsize``) so no batch allocates."""
        if self.alloc.reserve(nbytes):
            self._buffers.clear()
            self._allocate(self.alloc.generation, self.alloc.capacity_bytes)

    def _allocate(self, generation: int, nbytes: int):
        cupy = import_cupy()
        with cupy.cuda.Device(self.cuda_device):
            buf = cupy.empty((nbytes,), dtype=cupy.uint8)
        self._buffers[generation] = buf
        return buf

    def segment_like(self, view: DeviceView, x):
        """A contiguous array / tensor of ``x``'s framework, dtype and shape inside the staging buffer."""
        seg, grew = self.alloc.take(view.nbytes)
        buf = self._buffers.get(seg.generation)
        if buf is None or grew:
            buf = self._allocate(seg.generation, self.alloc.capacity_bytes)
        raw = buf[seg.offset : seg.offset + seg.nbytes]
        if view.framework == "torch":
            import torch

            return torch.from_dlpack(raw).view(x.dtype).view(view.shape)
        return raw.view(x.dtype).reshape(view.shape)

    def reset(self) -> None:
        """Every segment is free again (call after the batch that used them completed)."""
        self.alloc.reset()
        newest = self.alloc.generation
        for gen in [g for g in self._buffers if g != newest]:
            del self._buffers[gen]

    def release(self) -> None:
        self._buffers.clear()
        self.alloc = SegmentAllocator()


def copy_on_stream(dst, src, framework: str, stream) -> None:
    """``dst[...] = src`` issued on cupy ``stream`` (``stream`` is a cupy stream object)."""
    if framework == "torch":
        import torch

        with torch.cuda.stream(torch.cuda.ExternalStream(stream.ptr, device=dst.device)):
            dst.copy_(src)
    else:
        with stream:
            dst[...] = src


def nbytes_numel(shape: tuple[int, ...], itemsize: int) -> int:
    return math.prod(shape) * itemsize
