"""``cupy.cuda.Device`` of the stand-in (cupy/cuda/device.pyx): the current device per thread."""

from __future__ import annotations

import threading

from cupy.cuda import _gpu, runtime

_tls = threading.local()


class Device:
    def __init__(self, device=None):
        self.id = runtime.getDevice() if device is None else int(device)

    def __enter__(self):
        stack = getattr(_tls, "stack", None)
        if stack is None:
            stack = _tls.stack = []
        current = runtime.getDevice()
        stack.append(current)
        if self.id != current:
            try:
                runtime.setDevice(self.id)
            except Exception:
                stack.pop()
                raise
        return self

    def __exit__(self, *args):
        runtime.setDevice(_tls.stack.pop())

    def __repr__(self):
        return f"<CUDA Device {self.id}>"

    def __int__(self):
        return self.id

    def __index__(self):
        return self.id

    def __eq__(self, other):
        return isinstance(other, Device) and other.id == self.id

    def __hash__(self):
        return hash(("Device", self.id))

    def use(self):
        runtime.setDevice(self.id)
        return self

    def synchronize(self):
        _gpu.synchronize_device(self.id)

    @property
    def compute_capability(self) -> str:
        p = runtime.getDeviceProperties(self.id)
        return f"{p['major']}{p['minor']}"
