"""Backend registry: names -> ``Backend`` classes, resolved lazily so that naming "nccl" imports
cupy only when it is used.

An entry is a class or a ``"module:Class"`` string, plus the torch device type of the buffers the
backend moves and how many GPUs each device actor reserves: 0 (CPU devices), a whole number, or a
fraction below 1 (several device actors share one GPU; Ray gives each the same GPU in
CUDA_VISIBLE_DEVICES).

A ``Backend`` instance that declares ``gpus_per_device`` (class attribute or per instance, e.g.
``NcclBackend(gpus_per_device=0.25)``): a mesh created from that instance reserves what the
instance asks for (``make_backend``); a mesh created by name reserves what the registry says.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass

from reshard.ir.target import CompileTarget, register_target, target_for
from reshard.runtime.backends.communicator import Backend


def check_gpus_per_device(gpus) -> float:
    """``gpus`` as float if Ray can reserve it per actor: >= 0, and whole when above 1."""
    try:
        x = float(gpus)
    except (TypeError, ValueError):
        raise TypeError(f"gpus_per_device must be a number, got {gpus!r}") from None
    if not x >= 0 or math.isinf(x):
        raise ValueError(f"gpus_per_device must be >= 0 and finite, got {gpus!r}")
    if x > 1 and not x.is_integer():
        raise ValueError(
            f"gpus_per_device={gpus!r}: Ray reserves fractions of a GPU only below 1; give a whole number of "
            "GPUs or a fraction < 1 (several device actors on one GPU)"
        )
    return x


@dataclass(frozen=True, slots=True)
class BackendSpec:
    target: type[Backend] | str  # a Backend subclass or "module:Class"
    device_type: str = "cpu"
    gpus_per_device: float = 0.0

    def __post_init__(self):
        object.__setattr__(self, "gpus_per_device", check_gpus_per_device(self.gpus_per_device))
        if not isinstance(self.device_type, str) or not self.device_type:
            raise ValueError(
                f"device_type must be a torch device type such as 'cpu' or 'cuda', got {self.device_type!r}"
            )

    def compile_target(self, name: str) -> CompileTarget:
        """What the backend's devices are compiled for (its declaration in ``reshard.ir.target``)."""
        return target_for(name, self.device_type)


BACKENDS: dict[str, BackendSpec] = {
    "gloo": BackendSpec("reshard.runtime.backends.gloo:GlooBackend", "cpu", 0.0),
    "nccl": BackendSpec("reshard.runtime.backends.nccl:NcclBackend", "cuda", 1.0),
}
"""The backends by name (``DeviceMesh.create(backend=...)``): ``gloo`` on CPUs, ``nccl`` on GPUs,
and those ``register_backend`` added."""


def register_backend(
    name: str,
    target: type[Backend] | str,
    *,
    device_type: str = "cpu",
    gpus_per_device: float = 0.0,
    compile_target: CompileTarget | None = None,
) -> None:
    """Register a ``Backend`` subclass (or ``"module:Class"``) under ``name``; ``compile_target``:
    how its devices' programs are sequenced (windows, bucket size; default: one message at a time)."""
    if compile_target is not None:
        if compile_target.backend != name or compile_target.device_type != device_type:
            raise ValueError(
                f"register_backend({name!r}): compile_target is declared for backend {compile_target.backend!r} on "
                f"{compile_target.device_type!r}, not {name!r} on {device_type!r}"
            )
        register_target(compile_target)
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


def make_backend(backend) -> tuple[str, Backend, float]:
    """``(name, instance, GPUs each device actor reserves)`` for a backend name or a ``Backend``
    instance. A name: its registry entry's GPUs. An instance: the GPUs it declares (its
    registry entry's when it declares none); an instance of a new name registers its class under
    that name. The registry entry of a known name never changes here: one mesh's instance says
    what that mesh reserves, not what the next mesh of that backend does."""
    if isinstance(backend, Backend):
        gpus = backend.gpus_per_device
        spec = BACKENDS.get(backend.name)
        if spec is None:
            register_backend(
                backend.name,
                type(backend),
                device_type=backend.device_type,
                gpus_per_device=0.0 if gpus is None else gpus,
            )
            spec = BACKENDS[backend.name]
        return backend.name, backend, spec.gpus_per_device if gpus is None else check_gpus_per_device(gpus)
    if not isinstance(backend, str):
        raise TypeError(
            f"backend must be a name ({', '.join(sorted(BACKENDS))}) or a Backend instance, got {backend!r}"
        )
    return backend, backend_class(backend)(), backend_spec(backend).gpus_per_device
