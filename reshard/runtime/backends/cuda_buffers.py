"""Device buffers for the NCCL backend: torch CUDA tensors and cupy arrays, zero-copy.

NCCL only sees ``(pointer, count, NCCL type)``. A torch tensor gives ``data_ptr()``, a cupy array
``data.ptr``; both already include the view's offset, so a contiguous slice of a larger buffer
is sent in place. A non-contiguous view is packed into (or unpacked from) a segment of ONE
reusable staging buffer per actor, on the communication stream, in stream order with the
transfer that uses it.

Broadcast, send and recv copy bytes and never reduce, so an element type without an NCCL type
(``bool``, ``int16``, complex types) travels as ``uint8`` with ``count = nbytes``; bit patterns
arrive unchanged. All-reduce needs the real element type (bool max/min as ``uint8``, bool sum as
max, i.e. logical or, as torch does). The tables at the top are pure (no cupy, no torch);
everything that touches a GPU imports cupy / torch on first use.

``check_gpu_stack`` refuses a broken GPU install with an error naming the problem and the fix:
two cupy distributions in one environment (``cupy-cuda12x`` and ``cupy-cuda13x`` write into the
same package), more than one libnccl mapped into the process, or cupy and torch reporting
different NCCL versions (ranks then fail with mismatched versions).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Any

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
    NCCL_INT8: 1,
    NCCL_UINT8: 1,
    NCCL_INT32: 4,
    NCCL_UINT32: 4,
    NCCL_INT64: 8,
    NCCL_UINT64: 8,
    NCCL_FLOAT16: 2,
    NCCL_FLOAT32: 4,
    NCCL_FLOAT64: 8,
    NCCL_BFLOAT16: 2,
}

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

# ncclRedOp_t values (nccl.h).
NCCL_SUM = 0
NCCL_PROD = 1
NCCL_MAX = 2
NCCL_MIN = 3
REDUCE_OPS = {"sum": NCCL_SUM, "max": NCCL_MAX, "min": NCCL_MIN}

STAGING_ALIGN_BYTES = 256  # cudaMalloc alignment; keeps every dtype view of a segment aligned


def nccl_type_and_count(dtype_name: str, numel: int, itemsize: int) -> tuple[int, int]:
    """The NCCL type and element count that carry ``numel`` elements of ``dtype_name``."""
    code = NATIVE_NCCL_TYPE.get(dtype_name)
    if code is None or NCCL_TYPE_SIZE[code] != itemsize:
        return NCCL_UINT8, numel * itemsize
    return code, numel


def nccl_reduce_args(dtype_name: str, numel: int, itemsize: int, op: str) -> tuple[int, int, int]:
    """``(count, NCCL type, NCCL op)`` of an all-reduce of ``numel`` elements of ``dtype_name``.

    Reductions need the element type itself, so only types NCCL has are accepted; bool reduces as
    uint8 with sum meaning logical or (max), as in torch."""
    if op not in REDUCE_OPS:
        raise ValueError(f"unknown reduce op {op!r}; choose one of {', '.join(REDUCE_OPS)}")
    code = REDUCE_OPS[op]
    if dtype_name == "bool":
        return numel, NCCL_UINT8, NCCL_MAX if code == NCCL_SUM else code
    nccl_type = NATIVE_NCCL_TYPE.get(dtype_name)
    if nccl_type is None or NCCL_TYPE_SIZE[nccl_type] != itemsize:
        raise TypeError(
            f"NCCL cannot reduce {dtype_name}: all_reduce takes {', '.join(sorted(NATIVE_NCCL_TYPE))} or bool; "
            "convert the tensor first"
        )
    return numel, nccl_type, code


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

GPU_EXTRA_HINT = (
    "install the GPU extra of your CUDA version: pip install '.[gpu-cu12]' (CUDA 12: cupy-cuda12x, "
    "nvidia-nccl-cu12) or '.[gpu-cu13]' (CUDA 13: cupy-cuda13x, nvidia-nccl-cu13); '.[gpu]' is '.[gpu-cu12]'"
)

_CUPY_DIST = re.compile(r"^cupy(-cuda\d+x?|-rocm-[\w.-]+)?$")


def nccl_version_tuple(code: int) -> tuple[int, int, int]:
    """``ncclGetVersion``'s integer as ``(major, minor, patch)`` (2.9+: M*10000+m*100+p, before: M*1000+m*100+p)."""
    code = int(code)
    if code >= 20900:
        return code // 10000, code // 100 % 100, code % 100
    return code // 1000, code // 100 % 10, code % 100


#: cupy 13 loads its own libnccl unless torch loaded the wheel's first; 14 finds the wheel's.
MIN_CUPY_MAJOR = 14


def gpu_stack_problems(
    cupy_dists: list[tuple[str, str]],
    nccl_libraries: list[str],
    cupy_nccl: tuple[int, int, int] | None,
    torch_nccl: tuple[int, ...] | None,
) -> list[str]:
    """What is wrong with this process's GPU libraries (empty: nothing found). Arguments: installed
    cupy distributions ``(name, version)``, paths of the libnccl files mapped into the process, and
    the NCCL versions cupy and torch report (None: unknown)."""
    problems = []
    cupys = sorted({(n.lower(), v) for n, v in cupy_dists if _CUPY_DIST.match(n.lower().replace("_", "-"))})
    if len(cupys) > 1:
        shown = ", ".join(f"{n} {v}" for n, v in cupys)
        problems.append(
            f"{len(cupys)} cupy distributions are installed ({shown}); they overwrite each other's files. Keep the one "
            f"matching your CUDA and torch (pip uninstall the others, then reinstall it); {GPU_EXTRA_HINT}"
        )
    old = [f"{n} {v}" for n, v in cupys if _major(v) < MIN_CUPY_MAJOR]
    if old:
        problems.append(
            f"{', '.join(old)} is older than cupy {MIN_CUPY_MAJOR}: it finds the nvidia-nccl wheel's libnccl only if "
            f"torch loaded it first, else a second NCCL; install cupy >= {MIN_CUPY_MAJOR} ({GPU_EXTRA_HINT})"
        )
    libs = sorted(set(nccl_libraries))
    if len(libs) > 1:
        problems.append(
            f"{len(libs)} different libnccl files are loaded in this process ({', '.join(libs)}); torch and cupy must "
            "use one NCCL: install the nvidia-nccl wheel torch depends on and the cupy build of the same CUDA"
        )
    if cupy_nccl is not None and torch_nccl is not None and tuple(cupy_nccl) != tuple(torch_nccl):
        problems.append(
            f"cupy uses NCCL {'.'.join(map(str, cupy_nccl))} but torch uses NCCL {'.'.join(map(str, torch_nccl))}; "
            "ranks that load different NCCL versions cannot form a communicator. Install the cupy build and "
            f"nvidia-nccl wheel of torch's CUDA version; {GPU_EXTRA_HINT}"
        )
    return problems


def _major(version: str) -> int:
    head = version.split(".", 1)[0]
    return int(head) if head.isdigit() else 0


def installed_cupy_distributions() -> list[tuple[str, str]]:
    """``(name, version)`` of every installed distribution that provides the ``cupy`` package."""
    from importlib import metadata

    out = []
    for dist in metadata.distributions():
        # typeshed gives PackageMetadata get() from 3.12 on; on 3.10 the object is an email Message, which has it
        name = (dist.metadata.get("Name") or "").lower().replace("_", "-")  # type: ignore[attr-defined]
        if _CUPY_DIST.match(name):
            out.append((name, dist.version))
    return out


def loaded_nccl_libraries(maps_path: str = "/proc/self/maps") -> list[str]:
    """Paths of the libnccl files mapped into this process (Linux; empty elsewhere)."""
    try:
        with open(maps_path) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    paths = set()
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and os.path.basename(parts[5]).startswith("libnccl.so"):
            paths.add(os.path.realpath(parts[5].removesuffix(" (deleted)")))
    return sorted(paths)


def check_gpu_stack() -> None:
    """RuntimeError naming every problem ``gpu_stack_problems`` finds in this process."""
    _, nccl = import_nccl()
    cupy_nccl = nccl_version_tuple(nccl.get_version())
    torch_nccl = None
    try:
        import torch

        torch_nccl = tuple(int(x) for x in torch.cuda.nccl.version()[:3])  # may end with a suffix string
    except Exception:  # torch without CUDA/NCCL: nothing to compare
        pass
    problems = gpu_stack_problems(installed_cupy_distributions(), loaded_nccl_libraries(), cupy_nccl, torch_nccl)
    if problems:
        raise RuntimeError("the GPU libraries of this process do not fit together:\n- " + "\n- ".join(problems))


_CUPY_CHECKED: list[str] = []


def import_cupy():
    """``cupy`` or an ImportError that says how to get it (or that two cupy builds collide)."""
    if not _CUPY_CHECKED:
        dists = installed_cupy_distributions()
        _CUPY_CHECKED.append("")
        problems = gpu_stack_problems(dists, [], None, None)
        if problems:
            _CUPY_CHECKED[0] = problems[0]
    if _CUPY_CHECKED[0]:
        raise ImportError(_CUPY_CHECKED[0])
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
            "torch",
            int(x.data_ptr()),
            int(x.numel()),
            int(x.element_size()),
            name,
            tuple(x.shape),
            bool(x.is_contiguous()),
            int(x.device.index),
        )
    return DeviceView(
        "cupy",
        int(x.data.ptr),
        int(x.size),
        int(x.itemsize),
        str(x.dtype.name),
        tuple(x.shape),
        bool(x.flags.c_contiguous),
        int(x.device.id),
    )


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
        self._buffers: dict[int, Any] = {}  # generation -> cupy uint8 array (untyped); old ones kept until reset

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
