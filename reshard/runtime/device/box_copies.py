"""Many box copies between GPU arrays in one kernel: a bucket packed or unpacked, a run's pulls and
local copies, whatever the number of pieces (one launch instead of one copy each).

A copy is described once, when its program is prepared, relative to the buffers it reads and
writes (``BoxCopy``: byte offsets, the innermost contiguous run of bytes, up to four outer extents
and their strides on both sides); a run then only adds the buffers' base addresses (numpy, for
every copy at once) and launches the kernel on the current stream. Each row of a copy is cut in
chunks of ``CHUNK_BYTES``; a thread block copies one chunk at a time, 16 bytes per thread where
both sides and the length allow it.

Where cupy cannot compile kernels (the CPU stand-in), the same copies run one by one as cupy
assignments: the order and the bytes are the same, the launch count is not.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

#: Bytes of a row a thread block copies at a time.
CHUNK_BYTES = 64 << 10
#: Outer dimensions a copy may have past its contiguous run (more are unrolled into several copies).
OUTER = 4
FIELDS = 4 + 3 * OUTER  # src, dst, inner bytes, chunks per row; extents; src strides; dst strides
THREADS = 256
MAX_BLOCKS = 4096

_SOURCE = r"""
extern "C" __global__ void copy_boxes(const long long* table, const long long* starts, const int entries,
                                      const long long tasks) {
    for (long long task = blockIdx.x; task < tasks; task += gridDim.x) {
        int lo = 0, hi = entries - 1;
        while (lo < hi) {
            const int mid = (lo + hi + 1) >> 1;
            if (starts[mid] <= task) lo = mid; else hi = mid - 1;
        }
        const long long* e = table + (long long)lo * @FIELDS@;
        const long long inner = e[2], chunks = e[3];
        long long local = task - starts[lo];
        long long row = local / chunks;
        const long long chunk = local - row * chunks;
        long long so = 0, d = 0;
        #pragma unroll
        for (int k = 0; k < @OUTER@; ++k) {
            const long long n = e[4 + k];
            const long long i = row % n;
            row /= n;
            so += i * e[4 + @OUTER@ + k];
            d += i * e[4 + 2 * @OUTER@ + k];
        }
        const long long begin = chunk * @CHUNK@LL;
        const long long left = inner - begin;
        const long long len = left < @CHUNK@LL ? left : @CHUNK@LL;
        const char* s = (const char*)e[0] + so + begin;
        char* t = (char*)e[1] + d + begin;
        if ((((unsigned long long)s | (unsigned long long)t | (unsigned long long)len) & 15ULL) == 0) {
            const uint4* s16 = (const uint4*)s;
            uint4* t16 = (uint4*)t;
            for (long long j = threadIdx.x; j < len / 16; j += blockDim.x) t16[j] = s16[j];
        } else if ((((unsigned long long)s | (unsigned long long)t | (unsigned long long)len) & 7ULL) == 0) {
            const unsigned long long* s8 = (const unsigned long long*)s;
            unsigned long long* t8 = (unsigned long long*)t;
            for (long long j = threadIdx.x; j < len / 8; j += blockDim.x) t8[j] = s8[j];
        } else {
            for (long long j = threadIdx.x; j < len; j += blockDim.x) t[j] = s[j];
        }
    }
}
"""
_SOURCE = _SOURCE.replace("@FIELDS@", str(FIELDS)).replace("@OUTER@", str(OUTER)).replace("@CHUNK@", str(CHUNK_BYTES))


@dataclass(frozen=True, slots=True)
class BoxCopy:
    """One copy of bytes between two buffers, relative to their starts: ``src``/``dst`` byte
    offsets, ``inner`` contiguous bytes per row, ``extents`` of the outer dimensions (innermost
    first, padded with 1) and their byte strides on each side."""

    src: int
    dst: int
    inner: int
    extents: tuple[int, ...]
    src_strides: tuple[int, ...]
    dst_strides: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.inner * math.prod(self.extents)


def describe(
    shape: Sequence[int],
    itemsize: int,
    src_offset: int,
    src_strides: Sequence[int],
    dst_offset: int,
    dst_strides: Sequence[int],
) -> list[BoxCopy]:
    """The ``BoxCopy``s that copy a box of ``shape`` (elements of ``itemsize`` bytes) from a view at
    byte ``src_offset`` with byte ``src_strides`` to one at ``dst_offset`` with ``dst_strides``:
    one, unless the box has more than ``OUTER`` outer dimensions that do not merge (each index of
    the extra ones is a copy of its own)."""
    if math.prod(shape) == 0:
        return []
    dims = [(int(n), int(s), int(d)) for n, s, d in zip(shape, src_strides, dst_strides, strict=True) if n != 1]
    merged = [(int(itemsize), 1, 1)]  # innermost first: an element's bytes, then the box's dims
    for n, s, d in reversed(dims):
        m = merged[-1]
        if m[1] * m[0] == s and m[2] * m[0] == d:  # contiguous across on both sides: one dimension
            merged[-1] = (m[0] * n, m[1], m[2])
        else:
            merged.append((n, s, d))
    inner = merged[0][0]
    kept, extra = merged[1 : 1 + OUTER], merged[1 + OUTER :]
    pad = OUTER - len(kept)
    extents = tuple(n for n, _, _ in kept) + (1,) * pad
    src_st = tuple(s for _, s, _ in kept) + (0,) * pad
    dst_st = tuple(d for _, _, d in kept) + (0,) * pad
    out = []
    for index in itertools.product(*(range(n) for n, _, _ in extra)):
        so = src_offset + sum(i * s for i, (_, s, _) in zip(index, extra, strict=True))
        do = dst_offset + sum(i * d for i, (_, _, d) in zip(index, extra, strict=True))
        out.append(BoxCopy(so, do, inner, extents, src_st, dst_st))
    return out


def of_views(dst, src) -> tuple[int, int, list[BoxCopy]]:
    """``(dst base, src base, copies)`` of ``dst[...] = src`` for two cupy views of one shape,
    relative to their own data pointers."""
    if tuple(dst.shape) != tuple(src.shape) or dst.itemsize != src.itemsize:
        raise ValueError(f"box copy between {src.shape} x{src.itemsize} and {dst.shape} x{dst.itemsize}")
    copies = describe(dst.shape, dst.itemsize, 0, src.strides, 0, dst.strides)
    return dst.data.ptr, src.data.ptr, copies


def copy_views(dsts: Sequence, srcs: Sequence) -> None:
    """``dst[...] = src`` for each pair of cupy views (of one shape and item size each, strided or
    not), all by one launch on the current stream."""
    table, bases = Table(), list[int]()
    for k, (dst, src) in enumerate(zip(dsts, srcs, strict=True)):
        to, of, copies = of_views(dst, src)
        bases += (of, to)
        for c in copies:
            table.add(2 * k, 2 * k + 1, c)
    table.launch(bases)


class Table:
    """Copies from buffers to buffers, resolved against base addresses at run time: ``add``
    registers one with the indices of its source and destination buffers; ``launch(bases)`` copies
    them all in one kernel on the current stream (``bases[i]``: buffer ``i``'s address)."""

    def __init__(self):
        self.rows: list[tuple[int, int, BoxCopy]] = []  # (src buffer, dst buffer, copy)
        self._frozen: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None

    def add(self, src_buffer: int, dst_buffer: int, copy: BoxCopy) -> None:
        self.rows.append((src_buffer, dst_buffer, copy))
        self._frozen = None

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for _, _, c in self.rows)

    def _freeze(self):
        if self._frozen is None:
            table = np.zeros((len(self.rows), FIELDS), np.int64)
            src_of = np.array([r[0] for r in self.rows], np.int64)
            dst_of = np.array([r[1] for r in self.rows], np.int64)
            tasks = np.zeros(len(self.rows), np.int64)
            for i, (_, _, c) in enumerate(self.rows):
                chunks = -(-c.inner // CHUNK_BYTES)
                table[i] = (c.src, c.dst, c.inner, chunks, *c.extents, *c.src_strides, *c.dst_strides)
                tasks[i] = chunks * math.prod(c.extents)
            starts = np.concatenate([[0], np.cumsum(tasks)])
            self._frozen = table, src_of, dst_of, starts
        return self._frozen

    def launch(self, bases: Sequence[int]) -> None:
        if not self.rows:
            return
        table, src_of, dst_of, starts = self._freeze()
        addresses = np.asarray(bases, np.int64)
        resolved = table.copy()
        resolved[:, 0] += addresses[src_of]
        resolved[:, 1] += addresses[dst_of]
        run(resolved, starts)


_KERNEL: list = []


def _kernel():
    """The compiled kernel, or None where cupy compiles none (the CPU stand-in)."""
    if not _KERNEL:
        import cupy

        raw = getattr(cupy, "RawKernel", None)
        _KERNEL.append(None if raw is None else raw(_SOURCE, "copy_boxes"))
    return _KERNEL[0]


def load(cuda_device: int) -> None:
    """Compile and load the kernel on GPU ``cuda_device`` now, when a device starts: loading a
    module may wait for every kernel of the GPU (CUDA programming guide, "Lazy Loading: concurrent
    execution"), and a first run that loaded it while an NCCL kernel waits for its peer could hang."""
    kernel = _kernel()
    if kernel is None:
        return
    import cupy

    with cupy.cuda.Device(cuda_device):
        kernel.compile()


def run(table: np.ndarray, starts: np.ndarray) -> None:
    """Copy every row of ``table`` (absolute addresses; ``starts``: cumulative tasks, one more than
    the rows) on the current stream."""
    import cupy

    kernel = _kernel()
    total = int(starts[-1])
    if total == 0:
        return
    if kernel is None:
        _run_by_assignment(table)
        return
    device_table = cupy.asarray(table.reshape(-1))
    device_starts = cupy.asarray(starts[:-1])
    blocks = min(total, MAX_BLOCKS)
    kernel((blocks,), (THREADS,), (device_table, device_starts, np.int32(len(table)), np.int64(total)))


def _run_by_assignment(table: np.ndarray) -> None:
    """The same copies as cupy assignments, one per row (where no kernel compiles)."""
    import cupy

    for row in table:
        src, dst, inner = int(row[0]), int(row[1]), int(row[2])
        extents = tuple(int(n) for n in row[4 : 4 + OUTER])
        src_strides = tuple(int(s) for s in row[4 + OUTER : 4 + 2 * OUTER])
        dst_strides = tuple(int(s) for s in row[4 + 2 * OUTER : 4 + 3 * OUTER])
        shape = tuple(reversed(extents)) + (inner,)
        nbytes_src = sum((n - 1) * s for n, s in zip(extents, src_strides, strict=True)) + inner
        nbytes_dst = sum((n - 1) * s for n, s in zip(extents, dst_strides, strict=True)) + inner
        s_view = cupy.ndarray(
            shape, np.uint8, memptr=_pointer(src, nbytes_src), strides=tuple(reversed(src_strides)) + (1,)
        )
        d_view = cupy.ndarray(
            shape, np.uint8, memptr=_pointer(dst, nbytes_dst), strides=tuple(reversed(dst_strides)) + (1,)
        )
        d_view[...] = s_view


def _pointer(address: int, nbytes: int):
    import cupy

    return cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(address, nbytes, None), 0)
