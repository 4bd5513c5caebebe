"""The device this process is, for code that has no handle on its actor instance (a Ray Train
worker's train function, a thread of an inference engine): an actor process is at most one device
at a time."""

from __future__ import annotations

import threading
from typing import Any

_LOCK = threading.Lock()
_CURRENT: Any = None


def set_current(ctx) -> None:
    global _CURRENT
    with _LOCK:
        _CURRENT = ctx


def clear_current(ctx) -> None:
    global _CURRENT
    with _LOCK:
        if _CURRENT is ctx:
            _CURRENT = None


def current_device():
    """The ``DeviceContext`` of the device this process is (attached with ``DeviceMesh.attach``,
    ``from_actors`` or made by ``DeviceMesh.create``), from any thread of it:
    ``current_device().share_state_dict(model.state_dict())`` inside a train function. Raises
    RuntimeError in a process that is no device (yet)."""
    with _LOCK:
        ctx = _CURRENT
    if ctx is None:
        raise RuntimeError(
            "this process is not a device of any mesh: attach its actor first (DeviceMesh.attach(actors, shape) "
            "on the driver, or reshard.integrations for Ray Train workers)"
        )
    return ctx
