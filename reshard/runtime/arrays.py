"""The arrays the data plane moves: numpy on CPU devices, cupy arrays on GPU devices.

A CPU device keeps its shards as numpy arrays (in shared memory when it can): copying slices,
pulling from peers and combining contributions need nothing else, so a device that only moves bytes
through shared memory never imports torch. torch comes in lazily: for gloo (a message is the
array's bytes, handed to gloo as a uint8 tensor over the same memory), for bfloat16 arithmetic on
the host, and where the caller works in torch (the pipeline's activations, a user's own tensors).

A GPU device keeps its shards as cupy arrays over device memory: every copy and combination below
is a kernel queued on the calling thread's current cupy stream, so it runs in stream order with
the messages around it and returns before the GPU did the work (whoever reads the result on the
host or another stream waits for that stream first). A user's torch CUDA tensors come in and go
out through DLPack, without a copy.

Element types numpy and cupy lack (bfloat16, float8) are held as their bit patterns
(``reshard.dtypes.BIT_PATTERN``); the dtype name travels beside the array. Every helper takes any
of the three kinds.
"""

from __future__ import annotations

import functools
import sys
from collections import deque

import numpy as np

from reshard.dtypes import BIT_PATTERN, dtype_name, storage_name
from reshard.ir.placement import ReduceOp

_STORAGE: dict[str, np.dtype] = {}


def storage(dtype: str) -> np.dtype:
    """The numpy (and cupy) element type that holds dtype ``dtype`` (by name)."""
    got = _STORAGE.get(dtype)
    if got is None:
        got = _STORAGE[dtype] = np.dtype(storage_name(dtype))
    return got


def dtype_of(a) -> str:
    """The dtype name of a torch tensor, or of a numpy or cupy array by its element type (an array
    of bit patterns says only its storage type: callers that hold one know its name)."""
    return dtype_name(a.dtype)


def torch_dtype(dtype: str):
    import torch

    return getattr(torch, dtype)


def is_numpy(a) -> bool:
    return isinstance(a, np.ndarray)


def is_device(a) -> bool:
    """A cupy array (GPU device memory). No import: a cupy array exists only once cupy is loaded
    (a module another thread is still importing lacks the type yet)."""
    kind = getattr(sys.modules.get("cupy"), "ndarray", None)
    return kind is not None and isinstance(a, kind)


def is_torch(a) -> bool:
    kind = getattr(sys.modules.get("torch"), "Tensor", None)
    return kind is not None and isinstance(a, kind)


def empty(shape, dtype: str) -> np.ndarray:
    return np.empty(tuple(shape), dtype=storage(dtype))


def contiguous(a) -> bool:
    return a.is_contiguous() if is_torch(a) else a.flags.c_contiguous


def writable(a) -> bool:
    """False for a read-only numpy array (a memory map opened read-only, a frozen view)."""
    return not is_numpy(a) or bool(a.flags.writeable)


def cast(a, src: str, dst: str):
    """A new array of ``a`` (of dtype ``src``) cast to ``dst``, rounded as torch's ``Tensor.to``
    rounds; numpy (a CPU shard) or cupy (a GPU shard) as ``a`` is."""
    t = as_torch(a, src).to(torch_dtype(dst))
    return as_device(t) if is_device(a) else as_numpy(t)


def scaled_cast(a, cast, dst: str):
    """A new numpy array of CPU shard ``a`` divided by its scales and cast to float8 ``dst``
    (``reshard.scaling.ScaledCast``): in float32 (float64 for a float64 shard), rounded as torch's
    ``Tensor.to`` rounds."""
    import torch

    x = as_torch(a, cast.src)
    wide = torch.float64 if cast.src == "float64" else torch.float32
    scales = torch.from_numpy(cast.expanded(tuple(a.shape))).to(wide)
    return as_numpy((x.to(wide) / scales).to(torch_dtype(dst)))


def same_memory(a, b) -> bool:
    """Whether numpy or cupy arrays ``a`` and ``b`` view the same bytes as the same shape and dtype."""
    if a is b:
        return True
    if type(a) is not type(b) or a.shape != b.shape or a.dtype != b.dtype:
        return False
    if is_numpy(a):
        return a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
    return is_device(a) and a.data.ptr == b.data.ptr


def copy(dst, src) -> None:
    """``dst[...] = src`` between views of any two kinds (a torch source into an array target is
    read through its memory, a bit-pattern dtype as its bit pattern). Into a cupy array it is a
    kernel on the current stream."""
    if type(dst) is np.ndarray and type(src) is np.ndarray:
        np.copyto(dst, src, casting="no")
    elif is_device(dst):
        if is_device(src):
            dst[...] = src
        elif is_torch(src) and src.is_cuda:
            dst[...] = as_device(src)
        else:
            host = src if is_numpy(src) else as_numpy(src)
            if dst.flags.c_contiguous:
                dst.set(np.asarray(host, order="C"))  # (ascontiguousarray makes a 0-d array 1-d)
            else:
                dst[...] = host
    elif is_numpy(dst):
        if is_device(src):
            src = src.get()
        np.copyto(dst, src if is_numpy(src) else as_numpy(src), casting="no")
    else:
        if is_device(src):
            src = as_torch(src, dtype_of(dst), dst.dtype)
        dst.copy_(src if not is_numpy(src) else _from_numpy(src, dst.dtype))


_COPYTO = functools.partial(np.copyto, casting="no")


def copy_many(dsts: list, srcs: list) -> None:
    """``copy`` of each pair; where all are numpy arrays, one C-level pass of ``np.copyto`` (a
    tree's thousands of small tensors: the Python per pair cost more than the copies)."""
    if len(dsts) != len(srcs):
        raise ValueError(f"copy_many got {len(dsts)} targets for {len(srcs)} sources")
    if set(map(type, dsts)) | set(map(type, srcs)) <= {np.ndarray}:
        deque(map(_COPYTO, dsts, srcs), maxlen=0)
        return
    for dst, src in zip(dsts, srcs, strict=True):
        copy(dst, src)


def combine(op: ReduceOp, dst, src, dtype: str) -> None:
    """``dst = op(dst, src)`` in place (``avg`` combines by summing), rounded as torch rounds."""
    if is_device(dst):
        _device_combine(op, dst, src, dtype)
        return
    if is_numpy(dst) and dtype not in BIT_PATTERN:
        src = src if is_numpy(src) else as_numpy(src)
        ufunc = {ReduceOp.SUM: np.add, ReduceOp.AVG: np.add, ReduceOp.MAX: np.maximum, ReduceOp.MIN: np.minimum}[op]
        ufunc(dst, src, out=dst)
        return
    import torch

    d = dst if not is_numpy(dst) else as_torch(dst, dtype)
    s = src if not is_numpy(src) else as_torch(src, dtype)
    if op in (ReduceOp.SUM, ReduceOp.AVG):
        d.add_(s)
    else:
        (torch.maximum if op is ReduceOp.MAX else torch.minimum)(d, s, out=d)


def scale(dst, divisor: int, dtype: str) -> None:
    if is_device(dst):
        _device_scale(dst, divisor, dtype)
    elif is_numpy(dst) and dtype not in BIT_PATTERN:
        np.divide(dst, divisor, out=dst)
    else:
        (dst if not is_numpy(dst) else as_torch(dst, dtype)).div_(divisor)


def wire(a):
    """A contiguous array as what a communicator sends or receives into: its bytes, flat uint8,
    over the same memory (a torch tensor for a host array or tensor, a cupy array for a cupy
    array); both ends of a message agree on bytes, whatever the dtype of the slice each side holds."""
    if is_device(a):
        return a.reshape(-1).view(np.uint8)
    import torch

    if is_numpy(a):
        return torch.from_numpy(a.reshape(-1).view(np.uint8))
    return a.reshape(-1).view(torch.uint8)


def as_torch(a, dtype: str, want=None):
    """A numpy or cupy array as a torch tensor over the same memory, of its real dtype (bfloat16 and
    float8 too); a cupy array through DLPack."""
    import torch

    t = torch.from_numpy(a) if is_numpy(a) else torch.from_dlpack(a)
    want = torch_dtype(dtype) if want is None else want
    return t.view(want) if t.dtype != want else t


def as_device(t):
    """A torch CUDA tensor as a cupy array over the same memory (a bit-pattern dtype as its storage
    type: DLPack has no bfloat16 or float8 that cupy takes)."""
    import cupy
    import torch

    name = dtype_name(t.dtype)
    if name in BIT_PATTERN:
        t = t.view(getattr(torch, BIT_PATTERN[name]))
    return cupy.from_dlpack(t.detach())


def as_numpy(t) -> np.ndarray:
    """A CPU torch tensor as a numpy array over the same memory (a bit-pattern dtype as its bit
    pattern); a cupy array copied to the host once its stream got there."""
    if is_device(t):
        return t.get()
    import torch

    t = t.detach()
    name = dtype_name(t.dtype)
    if name in BIT_PATTERN:
        t = t.view(getattr(torch, BIT_PATTERN[name]))
    return t.numpy()


def _from_numpy(a: np.ndarray, dtype):
    import torch

    if not a.flags.writeable:  # torch wants writable memory even to read it
        a = a.copy()
    t = torch.from_numpy(a if a.flags.c_contiguous else a.copy(order="C"))  # ascontiguousarray makes 0-d 1-d
    return t.view(dtype) if t.dtype != dtype and t.element_size() == dtype.itemsize else t


# ------------------------------------------------------------------------------------------------
# Arithmetic on cupy arrays that gives the bits torch gives (Partial contributions combined, averages
# scaled), queued on the current stream. bfloat16 has no cupy type: its bit patterns are widened to
# float32 (exact), combined there and rounded back to nearest-even, as torch rounds a bfloat16 result
# computed in float32 (a NaN stays a quiet NaN). float8 contributions are never combined (the
# planner refuses Partial float8 layouts).


def _bf16_to_f32(bits):
    import cupy

    return (bits.view(cupy.uint16).astype(cupy.uint32) << 16).view(cupy.float32)


def _f32_to_bf16(values, out) -> None:
    import cupy

    u = values.view(cupy.uint32)
    rounded = (u + (0x7FFF + ((u >> 16) & 1))) >> 16
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    out.view(cupy.uint16)[...] = cupy.where(nan, (u >> 16) | 0x0040, rounded).astype(cupy.uint16)


def _device_combine(op: ReduceOp, dst, src, dtype: str) -> None:
    import cupy

    if dtype == "bool":  # sum and max: or; min: and (as torch on bool)
        logical = cupy.bitwise_and if op is ReduceOp.MIN else cupy.bitwise_or
        logical(dst.view(cupy.uint8), src.view(cupy.uint8), out=dst.view(cupy.uint8))
        return
    if dtype in BIT_PATTERN and dtype != "bfloat16":
        raise TypeError(f"{dtype} contributions cannot be combined on a device; reduce them in a wider dtype")
    ufunc = {ReduceOp.SUM: cupy.add, ReduceOp.AVG: cupy.add, ReduceOp.MAX: cupy.maximum, ReduceOp.MIN: cupy.minimum}[op]
    if dtype == "bfloat16":
        _f32_to_bf16(ufunc(_bf16_to_f32(dst), _bf16_to_f32(src)), dst)
    else:
        ufunc(dst, src, out=dst)


def _device_scale(dst, divisor: int, dtype: str) -> None:
    import cupy

    if dtype == "bfloat16":
        _f32_to_bf16(_bf16_to_f32(dst) / np.float32(divisor), dst)
    else:
        cupy.divide(dst, dst.dtype.type(divisor), out=dst)
