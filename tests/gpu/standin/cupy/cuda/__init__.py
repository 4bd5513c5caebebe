"""``cupy.cuda`` of the stand-in: devices, memory, streams and events (``nccl`` is imported on demand,
``from cupy.cuda import nccl``, as in cupy)."""

from cupy.cuda import runtime
from cupy.cuda.device import Device
from cupy.cuda.memory import BaseMemory, Memory, MemoryPointer, UnownedMemory, alloc
from cupy.cuda.stream import Event, ExternalStream, Stream, get_current_stream

__all__ = [
    "BaseMemory",
    "Device",
    "Event",
    "ExternalStream",
    "Memory",
    "MemoryPointer",
    "Stream",
    "UnownedMemory",
    "alloc",
    "get_current_stream",
    "runtime",
]
