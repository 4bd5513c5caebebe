"""Backend registry: names -> ``Backend`` classes, resolved lazily so that naming "nccl" imports
cupy only when it is used.

An entry is a class or a ``"module:Class"`` string, plus the torch device type of the buffers the
backend moves and how many GPUs each device actor reserves.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from reshard.runtime.communicator import Backend


@dataclass(frozen=True, slots=True)
class BackendSpec:
    target: object  # a Backend subclass or "module:Class"
    device_type: str = "cpu"
    gpus_per_device: float = 0.0


BACKENDS: dict[str, BackendSpec] = {
    "gloo": BackendSpec("reshard.runtime.gloo:GlooBackend", "cpu", 0.0),
    "nccl": BackendSpec("reshard.runtime.nccl:NcclBackend", "cuda", 1.0),
}


def register_backend(name: str, target, *, device_type: str = "cpu", gpus_per_device: float = 0.0) -> None:
    """Register a ``Backend`` subclass (or ``"module:Class"``) under ``name``."""
    BACKENDS[name] = BackendSpec(target, device_type, gpus_per_device)


def backend_spec(name: str) -> BackendSpec:
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(sorted(BACKENDS))}") from None


def backend_class(name: str) -> type[Backend]:
    target = backend_spec(name).target
    if isinstance(target, str):
        module, _, attr = target.partition(":")
        try:
            target = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"backend {name!r} ({backend_spec(name).target}) cannot be loaded: {e}") from e
    return target


def make_backend(backend) -> tuple[str, Backend]:
    """``(name, instance)`` for a backend name or a ``Backend`` instance."""
    if isinstance(backend, Backend):
        if backend.name not in BACKENDS:
            register_backend(backend.name, type(backend), device_type=getattr(backend, "device_type", "cpu"))
        return backend.name, backend
    if not isinstance(backend, str):
        raise TypeError(
            f"backend must be a name ({', '.join(sorted(BACKENDS))}) or a Backend instance, got {backend!r}"
        )
    return backend, backend_class(backend)()
