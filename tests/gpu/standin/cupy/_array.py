"""``cupy.ndarray`` of the stand-in: a view (shape, strides, dtype) of stand-in device memory.

Every operation that computes is a kernel on the thread's current stream (``_gpu.launch``): the
result is allocated at once, its values are written when the stream gets there, so work on
another stream sees them only through events, as on a GPU. Reading values on the host (``get``,
``asnumpy``, ``float(x)``) copies on the current stream and waits for that copy, as cupy's
``ndarray.get`` does. Implicit conversion to numpy is refused, as in cupy. Only basic indexing
(integers, slices, ``...``, ``None``) is modelled.
"""

from __future__ import annotations

import math
import operator

import numpy as np

from cupy.cuda import _gpu, memory


class _Interface:
    """Exposes stand-in device bytes to numpy (``__array_interface__``); keeps the buffer alive."""

    def __init__(self, owner, address: int, shape, strides, dtype):
        self._owner = owner
        self.__array_interface__ = {
            "version": 3,
            "shape": tuple(shape),
            "strides": tuple(strides),
            "typestr": dtype.str,
            "descr": dtype.descr,
            "data": (address, False),
        }


class _Flags:
    def __init__(self, a: ndarray):
        self.c_contiguous = _contiguous(a.shape, a.strides, a.itemsize, reverse=False)
        self.f_contiguous = _contiguous(a.shape, a.strides, a.itemsize, reverse=True)
        self.owndata = False

    def __getitem__(self, key):
        return {"C_CONTIGUOUS": self.c_contiguous, "F_CONTIGUOUS": self.f_contiguous}[key]


def _contiguous(shape, strides, itemsize: int, reverse: bool) -> bool:
    """numpy's rule: axes of extent 1 do not count; an empty array is contiguous."""
    if 0 in shape:
        return True
    expect = itemsize
    axes = range(len(shape)) if reverse else range(len(shape) - 1, -1, -1)
    for ax in axes:
        if shape[ax] != 1:
            if strides[ax] != expect:
                return False
            expect *= shape[ax]
    return True


def _c_strides(shape, itemsize: int) -> tuple[int, ...]:
    out, step = [], itemsize
    for n in reversed(shape):
        out.append(step)
        step *= max(n, 1)
    return tuple(reversed(out))


def _shape_of(shape) -> tuple[int, ...]:
    if isinstance(shape, int | np.integer):
        return (int(shape),)
    return tuple(int(n) for n in shape)


def _is_basic(index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return all(
        p is Ellipsis
        or p is None
        or isinstance(p, slice)
        or (isinstance(p, int | np.integer) and not isinstance(p, bool))
        for p in parts
    )


class ndarray:
    """A stand-in device array."""

    __array_priority__ = 100  # numpy defers binary operators to us

    def __init__(self, shape, dtype=float, memptr=None, strides=None, order="C"):
        self._shape = _shape_of(shape)
        self._dtype = np.dtype(dtype)
        nbytes = math.prod(self._shape) * self._dtype.itemsize
        if memptr is None:
            memptr = memory.alloc(nbytes)
        self._data = memptr
        if strides is None:
            strides = _c_strides(self._shape, self._dtype.itemsize)
            if order == "F":
                strides = tuple(reversed(_c_strides(tuple(reversed(self._shape)), self._dtype.itemsize)))
        self._strides = tuple(int(s) for s in strides)

    # -- attributes
    shape = property(lambda self: self._shape)
    dtype = property(lambda self: self._dtype)
    strides = property(lambda self: self._strides)
    data = property(lambda self: self._data)
    ndim = property(lambda self: len(self._shape))
    size = property(lambda self: math.prod(self._shape))
    itemsize = property(lambda self: self._dtype.itemsize)
    nbytes = property(lambda self: self.size * self._dtype.itemsize)
    flags = property(lambda self: _Flags(self))

    @property
    def device(self):
        from cupy.cuda.device import Device

        return Device(self._data.device_id)

    @property
    def T(self):
        return self.transpose()

    @property
    def __cuda_array_interface__(self):
        c = self.flags.c_contiguous
        return {
            "shape": self._shape,
            "typestr": self._dtype.str,
            "descr": self._dtype.descr,
            "data": (self._data.ptr, False),
            "version": 3,
            "strides": None if c else self._strides,
        }

    # -- the stand-in's access to the bytes (only inside kernels or after a synchronisation)
    def _host(self) -> np.ndarray:
        """The elements as a numpy view of the stand-in device memory."""
        if self.size == 0:
            return np.empty(self._shape, self._dtype)
        raw = self._data.mem.host_bytes()
        address = raw.ctypes.data + (self._data.ptr - self._data.mem.ptr)
        return np.asarray(_Interface(raw, address, self._shape, self._strides, self._dtype))

    def _view(self, host_view: np.ndarray) -> ndarray:
        """An ndarray over the same memory as ``host_view`` (a numpy view of ``self._host()``)."""
        if host_view.size == 0 or self.size == 0:
            ptr_offset = self._data.ptr - self._data.mem.ptr
        else:
            raw = self._data.mem.host_bytes()
            ptr_offset = host_view.ctypes.data - raw.ctypes.data
        memptr = memory.MemoryPointer(self._data.mem, ptr_offset) if self._data.mem.ptr else self._data
        return ndarray(host_view.shape, host_view.dtype, memptr=memptr, strides=host_view.strides)

    # -- DLPack (the DLPack Python specification; cupy/_core/dlpack.pyx)
    def __dlpack_device__(self):
        """``(kDLCPU, 0)``: the stand-in's device memory is host memory (a GPU array says kDLCUDA)."""
        return (1, 0)

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        """The array's memory to a consumer (``torch.from_dlpack``). On a GPU the ``stream``
        argument makes the consumer's stream wait for this array's producer; the stand-in's
        consumer is the host, so it waits for every stream of the device first."""
        _gpu.synchronize_device(self._data.device_id)
        host = self._host()
        if max_version is None:
            return host.__dlpack__()
        return host.__dlpack__(max_version=max_version)

    def __array__(self, *args, **kwargs):
        raise TypeError(
            "Implicit conversion to a NumPy array is not allowed. Please use `.get()` to construct a NumPy array "
            "explicitly."
        )

    # -- host transfers
    def get(self, stream=None, order="C", out=None, blocking=True) -> np.ndarray:
        """Copy to the host on ``stream`` (default: current) and wait for the copy."""
        result = np.empty(self._shape, self._dtype) if out is None else out
        if self.size == 0:
            return result

        def copy():
            result[...] = self._host()

        queue = _gpu.queue_of(_current(stream).ptr)
        queue.wait(queue.submit(copy, "cudaMemcpyAsync(DeviceToHost)"))
        _gpu.check_sticky()
        return result

    def set(self, arr, stream=None) -> None:
        """``cudaMemcpyAsync`` from the host: the shape must be this array's (cupy: "Shape mismatch")."""
        if tuple(np.shape(arr)) != self._shape:
            raise ValueError(f"Shape mismatch. Old shape: {self._shape}, new shape: {tuple(np.shape(arr))}")
        host = np.array(arr, dtype=self._dtype, copy=True)
        _gpu.launch(lambda: self._host().__setitem__(Ellipsis, host), "cudaMemcpyAsync(HostToDevice)", stream)

    def tolist(self):
        return self.get().tolist()

    def item(self):
        return self.get().item()

    def __float__(self):
        return float(self.item())

    def __int__(self):
        return int(self.item())

    def __index__(self):
        return operator.index(self.item())

    def __bool__(self):
        if self.size != 1:
            raise ValueError("The truth value of an array with more than one element is ambiguous.")
        return bool(self.item())

    def __len__(self):
        if not self._shape:
            raise TypeError("len() of unsized object")
        return self._shape[0]

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]

    def __repr__(self):
        return f"array({np.array2string(self.get(), separator=', ')}, dtype={self._dtype.name})"

    __str__ = __repr__

    # -- views
    def __getitem__(self, index) -> ndarray:
        if isinstance(index, ndarray) or not _is_basic(index):
            raise NotImplementedError("the cupy stand-in models basic indexing only (ints, slices, ..., None)")
        index = index if isinstance(index, tuple) else (index,)
        if not any(p is Ellipsis for p in index):
            index = (*index, Ellipsis)  # integers alone would give numpy a scalar copy, not a 0-d view
        return self._view(self._host()[index])

    def __setitem__(self, index, value) -> None:
        dst = self[index]
        if dst.size == 0:
            return
        if isinstance(value, ndarray):

            def kernel():
                dst._host()[...] = value._host()

        else:
            host = np.array(value, copy=True)  # a host source is read when the copy is issued

            def kernel():
                dst._host()[...] = host

        _gpu.launch(kernel, "setitem")

    def fill(self, value) -> None:
        self[...] = value

    def view(self, dtype=None) -> ndarray:
        if dtype is None:
            return self._view(self._host())
        dtype = np.dtype(dtype)
        if self.size == 0:
            return ndarray(np.empty(self._shape, self._dtype).view(dtype).shape, dtype, memptr=self._data)
        return self._view(self._host().view(dtype))

    def reshape(self, *shape, order="C") -> ndarray:
        if len(shape) == 1 and not isinstance(shape[0], int | np.integer):
            shape = tuple(shape[0])
        shape = np.empty(self._shape, dtype=np.bool_).reshape(shape).shape if -1 in shape else _shape_of(shape)
        if math.prod(shape) != self.size:
            raise ValueError(f"cannot reshape array of size {self.size} into shape {shape}")
        if self.size == 0:
            return ndarray(shape, self._dtype, memptr=self._data)
        try:
            return self._view(np.reshape(self._host(), shape, copy=False))
        except ValueError:
            return self.copy().reshape(shape)

    def ravel(self) -> ndarray:
        return self.reshape(-1)

    def flatten(self) -> ndarray:
        return self.copy().reshape(-1)

    def transpose(self, *axes) -> ndarray:
        return self._view(self._host().transpose(*axes))

    def squeeze(self, axis=None) -> ndarray:
        return self._view(self._host().squeeze(axis))

    # -- kernels
    def copy(self, order="C") -> ndarray:
        return _map(lambda a: a.copy(), (self,), self._dtype)

    def astype(self, dtype, copy=True) -> ndarray:
        dtype = np.dtype(dtype)
        if not copy and dtype == self._dtype:
            return self
        return _map(lambda a: a.astype(dtype), (self,), dtype)

    def _reduce(self, fn, axis=None, keepdims=False, **kwargs) -> ndarray:
        probe = np.asarray(
            fn(np.broadcast_to(np.zeros((), self._dtype), self._shape), axis=axis, keepdims=keepdims, **kwargs)
        )
        out = ndarray(probe.shape, probe.dtype)

        def kernel():
            out._host()[...] = fn(self._host(), axis=axis, keepdims=keepdims, **kwargs)

        _gpu.launch(kernel, fn.__name__)
        return out

    def sum(self, axis=None, dtype=None, keepdims=False):
        return self._reduce(np.sum, axis, keepdims, dtype=dtype)

    def prod(self, axis=None, dtype=None, keepdims=False):
        return self._reduce(np.prod, axis, keepdims, dtype=dtype)

    def mean(self, axis=None, dtype=None, keepdims=False):
        return self._reduce(np.mean, axis, keepdims, dtype=dtype)

    def max(self, axis=None, keepdims=False):
        return self._reduce(np.max, axis, keepdims)

    def min(self, axis=None, keepdims=False):
        return self._reduce(np.min, axis, keepdims)

    def any(self, axis=None, keepdims=False):
        return self._reduce(np.any, axis, keepdims)

    def all(self, axis=None, keepdims=False):
        return self._reduce(np.all, axis, keepdims)

    __hash__ = None


def _current(stream):
    from cupy.cuda.stream import get_current_stream

    return get_current_stream() if stream is None else stream


def _dummy(x):
    """What decides a result's dtype: ndarrays by their dtype, Python scalars stay weak (NEP 50)."""
    if isinstance(x, ndarray):
        return np.zeros((), x.dtype)
    if isinstance(x, np.ndarray):
        return np.zeros((), x.dtype)
    return x


def _map(fn, operands, dtype=None) -> ndarray:
    """``fn(*operands)`` as one kernel on the current stream; host operands are read now."""
    operands = tuple(np.array(x, copy=True) if isinstance(x, np.ndarray | list | tuple) else x for x in operands)
    shape = np.broadcast_shapes(*(np.shape(x) if not isinstance(x, ndarray) else x.shape for x in operands))
    if dtype is None:
        dtype = np.asarray(fn(*(_dummy(x) for x in operands))).dtype
    out = ndarray(shape, dtype)
    if out.size == 0:
        return out

    def kernel():
        out._host()[...] = fn(*(x._host() if isinstance(x, ndarray) else x for x in operands))

    _gpu.launch(kernel, getattr(fn, "__name__", "elementwise"))
    return out


def _binary(ufunc, reflected=False):
    def method(self, other):
        if not isinstance(other, ndarray | np.ndarray | np.generic | int | float | complex | bool):
            return NotImplemented
        args = (other, self) if reflected else (self, other)
        return _map(ufunc, args)

    return method


_BINARY = {
    "add": np.add,
    "sub": np.subtract,
    "mul": np.multiply,
    "truediv": np.true_divide,
    "floordiv": np.floor_divide,
    "mod": np.remainder,
    "pow": np.power,
    "and": np.bitwise_and,
    "or": np.bitwise_or,
    "xor": np.bitwise_xor,
    "lshift": np.left_shift,
    "rshift": np.right_shift,
}
for _name, _ufunc in _BINARY.items():
    setattr(ndarray, f"__{_name}__", _binary(_ufunc))
    setattr(ndarray, f"__r{_name}__", _binary(_ufunc, reflected=True))
for _name, _ufunc in {
    "eq": np.equal,
    "ne": np.not_equal,
    "lt": np.less,
    "le": np.less_equal,
    "gt": np.greater,
    "ge": np.greater_equal,
}.items():
    setattr(ndarray, f"__{_name}__", _binary(_ufunc))
ndarray.__neg__ = lambda self: _map(np.negative, (self,))
ndarray.__pos__ = lambda self: _map(np.positive, (self,))
ndarray.__abs__ = lambda self: _map(np.absolute, (self,))
ndarray.__invert__ = lambda self: _map(np.invert, (self,))


def empty(shape, dtype=float, order="C") -> ndarray:
    return ndarray(shape, dtype, order=order)


def full(shape, fill_value, dtype=None, order="C") -> ndarray:
    """``cudaMemsetAsync`` / a fill kernel on the current stream."""
    dtype = np.array(fill_value).dtype if dtype is None else np.dtype(dtype)
    out = ndarray(shape, dtype, order=order)
    if out.size:
        out.fill(fill_value)
    return out


def asarray(a, dtype=None, order=None) -> ndarray:
    if isinstance(a, ndarray):
        return a if dtype is None or np.dtype(dtype) == a.dtype else a.astype(dtype)
    host = np.array(a, dtype=dtype, copy=True)  # pageable host memory: read when the copy is issued
    out = ndarray(host.shape, host.dtype)
    if out.size:
        _gpu.launch(lambda: out._host().__setitem__(Ellipsis, host), "cudaMemcpyAsync(HostToDevice)")
    return out


def asnumpy(a, stream=None, order="C", out=None, blocking=True):
    if isinstance(a, ndarray):
        return a.get(stream=stream, out=out)
    return np.asarray(a, order=order)


def _ufunc(fn):
    """A cupy ufunc: ``fn(*operands, out=None)`` as one kernel on the current stream."""

    def ufunc(*operands, out=None, **kwargs):
        if out is None:
            return _map(lambda *a: fn(*a, **kwargs), operands)
        inputs = tuple(np.array(x, copy=True) if isinstance(x, np.ndarray | list | tuple) else x for x in operands)

        def kernel():
            fn(*(x._host() if isinstance(x, ndarray) else x for x in inputs), out=out._host(), **kwargs)

        if out.size:
            _gpu.launch(kernel, fn.__name__)
        return out

    ufunc.__name__ = fn.__name__
    return ufunc


def where(condition, x, y) -> ndarray:
    return _map(np.where, (condition, x, y))


def from_dlpack(obj) -> ndarray:
    """An array over the memory of a DLPack producer, no copy. The stand-in takes host tensors
    (a CPU torch tensor stands for a CUDA one: its memory becomes stand-in device memory, registered
    for the producer's lifetime); cupy takes device memory only."""
    kind, _ = obj.__dlpack_device__()
    if kind != 1:
        raise RuntimeError(f"the cupy stand-in takes host memory through DLPack (device type {kind} given)")
    host = np.from_dlpack(obj)
    if host.size == 0:
        return ndarray(host.shape, host.dtype, memptr=memory.MemoryPointer(memory.UnownedMemory(0, 0, obj), 0))
    lo = host.ctypes.data + sum(s * (n - 1) for s, n in zip(host.strides, host.shape, strict=True) if s < 0)
    span = host.itemsize + sum(abs(s) * (n - 1) for s, n in zip(host.strides, host.shape, strict=True))
    ptr = _gpu.device_address(lo, span)
    if ptr is not None:  # stand-in device memory coming back (e.g. a torch view of a cupy array)
        mem = memory.UnownedMemory(ptr, span, obj)
        return ndarray(
            host.shape, host.dtype, memptr=memory.MemoryPointer(mem, host.ctypes.data - lo), strides=host.strides
        )
    mem = memory.HostMemory(host, obj)
    return ndarray(host.shape, host.dtype, memptr=memory.MemoryPointer(mem, mem.start), strides=host.strides)
