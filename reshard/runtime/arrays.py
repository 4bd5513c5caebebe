"""The arrays the data plane moves: numpy on CPU devices, torch tensors on GPU devices.

A CPU device keeps its shards as numpy arrays (in shared memory when it can): copying slices,
pulling from peers and combining contributions need nothing else, so a device that only moves bytes
through shared memory never imports torch. torch comes in lazily: for gloo (a message is the
array's bytes, handed to gloo as a uint8 tensor over the same memory), for bfloat16 arithmetic
(numpy has no bfloat16: its arrays hold the 16-bit patterns), and where the caller works in torch
(the pipeline's activations, a user's own tensors, GPU devices). Every helper takes either kind.
"""

from __future__ import annotations

import numpy as np

from reshard.dtypes import dtype_name
from reshard.ir.placement import ReduceOp

#: dtype name -> the numpy dtype that stores it (bfloat16: its bit pattern)
STORAGE = {
    "float64": np.float64, "float32": np.float32, "float16": np.float16, "bfloat16": np.int16,
    "int64": np.int64, "int32": np.int32, "int8": np.int8, "uint8": np.uint8, "bool": np.bool_,
}  # fmt: skip


def storage(dtype: str) -> np.dtype:
    return np.dtype(STORAGE[dtype])


def dtype_of(a) -> str:
    """The dtype name of a numpy array (int16 storage is bfloat16: the runtime moves no int16) or
    torch tensor."""
    if is_numpy(a):
        return "bfloat16" if a.dtype == np.int16 else dtype_name(a.dtype)
    return dtype_name(a.dtype)


def torch_dtype(dtype: str):
    import torch

    return getattr(torch, "bool" if dtype == "bool" else dtype)


def is_numpy(a) -> bool:
    return isinstance(a, np.ndarray)


def empty(shape, dtype: str) -> np.ndarray:
    return np.empty(tuple(shape), dtype=storage(dtype))


def contiguous(a) -> bool:
    return a.flags.c_contiguous if is_numpy(a) else a.is_contiguous()


def copy(dst, src) -> None:
    """``dst[...] = src`` between views of either kind (a torch source into a numpy target is
    read through its memory, bfloat16 as its bit pattern)."""
    if is_numpy(dst):
        np.copyto(dst, src if is_numpy(src) else as_numpy(src), casting="no")
    else:
        dst.copy_(src if not is_numpy(src) else _from_numpy(src, dst.dtype))


def combine(op: ReduceOp, dst, src, dtype: str) -> None:
    """``dst = op(dst, src)`` in place (``avg`` combines by summing)."""
    if is_numpy(dst) and dtype != "bfloat16":
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
    if is_numpy(dst) and dtype != "bfloat16":
        np.divide(dst, divisor, out=dst)
    else:
        (dst if not is_numpy(dst) else as_torch(dst, dtype)).div_(divisor)


def wire(a):
    """A contiguous array as what a communicator sends or receives into: its bytes as a flat uint8
    torch tensor over the same memory (both ends of a message agree on bytes, whatever the dtype
    of the slice each side holds)."""
    import torch

    if is_numpy(a):
        return torch.from_numpy(a.reshape(-1).view(np.uint8))
    return a.reshape(-1).view(torch.uint8)


def as_torch(a, dtype: str):
    """A numpy shard as a torch tensor over the same memory, of its real dtype (bfloat16 too)."""
    import torch

    t = torch.from_numpy(a)
    return t.view(torch.bfloat16) if dtype == "bfloat16" else t


def as_numpy(t) -> np.ndarray:
    """A CPU torch tensor as a numpy array over the same memory (bfloat16 as its bit pattern)."""
    import torch

    t = t.detach()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy()


def _from_numpy(a: np.ndarray, dtype):
    import torch

    if not a.flags.writeable:  # torch wants writable memory even to read it
        a = a.copy()
    t = torch.from_numpy(a if a.flags.c_contiguous else a.copy(order="C"))  # ascontiguousarray makes 0-d 1-d
    return t.view(dtype) if t.dtype != dtype and t.element_size() == dtype.itemsize else t
