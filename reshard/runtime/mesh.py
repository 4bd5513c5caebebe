"""DeviceMesh: an n-D grid of device actors, bound to an abstract ``topology.Mesh``.

``DeviceMesh.create(shape)`` starts one Ray actor per device (fresh global device ids; logical
hosts: axis 0 enumerates hosts unless ``devices_per_host`` says otherwise). The mesh OWNS those
actors; ``shutdown()`` stops them.

``DeviceMesh.from_devices(devices, shape)`` builds a VIEW: another mesh (any shape of the same
size) over devices that existing meshes own, e.g. a 2x2 and a 1x3 mesh over one pool of 8
actors, disjoint or overlapping. Devices keep their host unless ``devices_per_host`` is given
(then the view gets fresh logical hosts). A view owns nothing: its ``shutdown()`` only closes the
view; shutting the owner down closes every view over its devices (``MeshClosed``).

``mesh.mesh`` is the abstract mesh, so ``Layout(device_mesh, placements)`` works.

Shared memory (CPU devices, default on): the actors allocate their shards in shared memory, and
a reshard moves every slice whose sender and receivers run on one machine as a PULL: the
receiver copies it straight out of the sender's source shard (``reshard.pulls``), whatever
logical hosts the meshes declare. Only the rest goes through the backend. ``shared_memory=False``
on ``create`` keeps shards private (everything through the backend, as between machines);
``reshard(..., shared_memory=False)`` does so for one call.
"""

from __future__ import annotations

import logging

import ray

from reshard.errors import MeshClosed, ReshardTimeout, WorkerDied
from reshard.runtime.backends import backend_spec, make_backend
from reshard.runtime.driver import DeviceRecord, gather, runtime
from topology.mesh import Mesh, default_devices_per_host

log = logging.getLogger(__name__)

_ACTOR_CLASS = None


def _actor_class():
    global _ACTOR_CLASS
    if _ACTOR_CLASS is None:
        from reshard.runtime.actor import DeviceActor

        _ACTOR_CLASS = ray.remote(DeviceActor)
    return _ACTOR_CLASS


def ensure_ray() -> None:
    """Start a local Ray if none is running (loopback, no dashboard)."""
    if not ray.is_initialized():
        ray.init(include_dashboard=False)


def _positive_int(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


class DeviceMesh:
    """A grid of device actors. Build with ``create`` (new actors) or ``from_devices`` (a view)."""

    def __init__(self, mesh: Mesh, backend: str, *, owned: bool, _token=None):
        if _token is not _PRIVATE:
            raise TypeError("use DeviceMesh.create(shape) or DeviceMesh.from_devices(devices, shape)")
        self.mesh = mesh
        self.backend = backend
        self.owned = owned
        self._closed: str | None = None
        self._records = runtime().records(mesh.device_ids)

    # ---------------------------------------------------------------- construction

    @classmethod
    def create(
        cls,
        shape,
        *,
        devices_per_host: int | None = None,
        backend=None,
        axis_names=None,
        max_communicators: int = 64,
        max_programs: int = 256,
        op_timeout_s: float = 300.0,
        startup_timeout_s: float = 120.0,
        staging_keep_bytes: int = 64 << 20,
        buffer_pool_bytes: int = 256 << 20,
        torch_threads: int = 1,
        shared_memory: bool = True,
    ) -> DeviceMesh:
        """Start one actor per device of a mesh of ``shape``.

        ``devices_per_host`` (default: product of the axes after the first) must divide the size.
        ``backend``: "gloo" (CPU), "nccl" (one GPU per device), a registered name or a ``Backend``
        instance; default "nccl" when Ray reports at least one GPU per device, else "gloo".
        ``max_communicators`` bounds each device's communicator cache (LRU, driver-enforced);
        ``max_programs`` its program cache; ``op_timeout_s`` is the gloo context timeout (each op
        also waits at most the time left to its reshard's deadline); ``staging_keep_bytes`` bounds
        the staging buffer an idle actor keeps for its next run (a run itself holds exactly its
        largest staged slice). ``buffer_pool_bytes`` bounds, per device, the idle memory of freed
        shards (``ShardedTensor.free()``) kept for reuse: a new shard of a byte size freed before
        reuses that memory instead of page-faulting fresh memory in (least recently freed evicted
        first; 0 disables the pool). Idle pool bytes are reported apart from live buffers
        (``pool_bytes`` in the actors' ``stats()``). ``shared_memory`` (CPU devices only; see the
        module docstring): shards live in shared memory and actors of one machine pull slices from
        each other instead of messaging; False sends everything through the backend.
        """
        probe = Mesh(shape, devices_per_host=devices_per_host, axis_names=axis_names)  # validates
        _positive_int("max_communicators", max_communicators)
        _positive_int("max_programs", max_programs)
        if int(buffer_pool_bytes) < 0:
            raise ValueError(f"buffer_pool_bytes must be >= 0 (0 disables the pool), got {buffer_pool_bytes}")
        if not op_timeout_s > 0 or not startup_timeout_s > 0:
            raise ValueError("op_timeout_s and startup_timeout_s must be positive seconds")
        ensure_ray()
        rt = runtime()
        rt.check_session()
        size = probe.size
        if backend is None:
            gpus = ray.cluster_resources().get("GPU", 0)
            backend = "nccl" if gpus >= size else "gloo"
            if 0 < gpus < size:
                log.warning("Ray reports %s GPU(s) for a mesh of %d devices: using gloo on CPUs", gpus, size)
        if isinstance(backend, str) and backend in rt.backends:
            name, instance = backend, rt.backends[backend]  # one driver-side instance per backend name
        else:
            name, instance = make_backend(backend)
        setup = getattr(instance, "setup_driver", None)  # optional backend hook
        if setup is not None:
            setup()
        spec = backend_spec(name)
        need = size * spec.gpus_per_device
        have = ray.cluster_resources().get("GPU", 0)
        if need > have:
            raise ValueError(
                f"DeviceMesh.create({probe.shape}) with backend {name!r} needs {need:g} GPU(s), one per device, "
                f"but the Ray cluster has {have:g}; use backend='gloo' for CPU devices or a smaller mesh"
            )
        dph = default_devices_per_host(probe.shape) if devices_per_host is None else devices_per_host
        ids = rt.new_device_ids(size)
        host_base = rt.new_host_ids(size // dph)
        hosts = [host_base[i // dph] for i in range(size)]
        options = {
            "max_communicators": max_communicators,
            "op_timeout_s": float(op_timeout_s),
            "staging_keep_bytes": int(staging_keep_bytes),
            "buffer_pool_bytes": int(buffer_pool_bytes),
            "torch_threads": int(torch_threads),
            "device_type": spec.device_type,
            "shared_memory": bool(shared_memory) and spec.device_type == "cpu",
        }
        actor_cls = _actor_class()
        actors = [
            actor_cls.options(
                num_cpus=0, num_gpus=spec.gpus_per_device, max_restarts=0, max_task_retries=0, max_concurrency=1
            ).remote(d, instance, options)
            for d in ids
        ]
        infos, errors, pending = gather(
            {d: a.ready.remote() for d, a in zip(ids, actors, strict=True)}, startup_timeout_s
        )
        if errors or pending:
            for a in actors:
                ray.kill(a, no_restart=True)
            if pending:
                raise ReshardTimeout(
                    f"DeviceMesh.create({probe.shape}): devices {pending} did not start within "
                    f"startup_timeout_s={startup_timeout_s:g}s (not enough CPUs/GPUs for backend {name!r}?)"
                )
            d, (_, err) = next(iter(errors.items()))
            raise WorkerDied(f"DeviceMesh.create({probe.shape}): device {d} failed to start: {err}")
        nodes = [infos[d]["node_id"] for d in ids]
        if len(set(nodes)) > 1:  # a real multi-node cluster: hosts are the Ray nodes
            hosts = [rt.host_of_node(n) for n in nodes]
        mesh = Mesh(probe.shape, ids, hosts, axis_names=axis_names)
        owner = f"DeviceMesh{probe.shape} devices {ids[0]}..{ids[-1]}"
        records = [
            DeviceRecord(d, a, h, name, n, max_communicators, max_programs, owner, infos[d]["shared_memory"])
            for d, a, h, n in zip(ids, actors, hosts, nodes, strict=True)
        ]
        rt.add_devices(records, instance)
        dmesh = cls(mesh, name, owned=True, _token=_PRIVATE)
        rt.register_mesh(dmesh)
        return dmesh

    @classmethod
    def from_devices(cls, devices, shape, *, devices_per_host: int | None = None, axis_names=None) -> DeviceMesh:
        """A view of ``shape`` over existing devices (global ids, row-major; or a DeviceMesh).

        Hosts: each device's own host, unless ``devices_per_host`` is given (fresh logical hosts,
        ``devices_per_host`` consecutive devices each)."""
        if isinstance(devices, DeviceMesh):
            devices = devices.device_ids
        try:
            devices = tuple(int(d) for d in devices)
        except TypeError:
            raise TypeError(f"devices must be global device ids or a DeviceMesh, got {devices!r}") from None
        probe = Mesh(shape, devices_per_host=devices_per_host, axis_names=axis_names)
        if probe.size != len(devices):
            raise ValueError(
                f"DeviceMesh.from_devices: shape {probe.shape} has {probe.size} positions but {len(devices)} "
                f"devices were given ({list(devices)}); pass exactly {probe.size} devices"
            )
        if len(set(devices)) != len(devices):
            raise ValueError(
                f"DeviceMesh.from_devices: devices {list(devices)} repeat a device; a mesh holds each once"
            )
        rt = runtime()
        rt.check_devices(devices, "DeviceMesh.from_devices")
        records = rt.records(devices)
        backends = {r.backend for r in records}
        if len(backends) > 1:
            raise ValueError(f"DeviceMesh.from_devices: devices use different backends {sorted(backends)}; use one")
        if devices_per_host is None:
            hosts = [r.host for r in records]
        else:
            base = rt.new_host_ids(len(devices) // devices_per_host)
            hosts = [base[i // devices_per_host] for i in range(len(devices))]
        mesh = Mesh(probe.shape, devices, hosts, axis_names=axis_names)
        dmesh = cls(mesh, backends.pop(), owned=False, _token=_PRIVATE)
        rt.register_mesh(dmesh)
        return dmesh

    # ---------------------------------------------------------------- properties

    @property
    def shape(self) -> tuple[int, ...]:
        return self.mesh.shape

    @property
    def ndim(self) -> int:
        return self.mesh.ndim

    @property
    def size(self) -> int:
        return self.mesh.size

    @property
    def device_ids(self) -> tuple[int, ...]:
        return self.mesh.device_ids

    @property
    def host_ids(self) -> tuple[int, ...]:
        return self.mesh.host_ids

    @property
    def shared_memory(self) -> bool:
        """Whether every device keeps its shards in shared memory (peers on its machine pull)."""
        return all(r.shared_memory for r in self._records)

    @property
    def actors(self) -> tuple:
        """Actor handles, by flat mesh index."""
        return tuple(r.actor for r in self._records)

    def actor(self, index: int):
        """The actor at flat mesh index ``index``."""
        return self._records[index].actor

    def index_of(self, device: int) -> int:
        return self.mesh.device_ids.index(device)

    @property
    def closed(self) -> bool:
        return self._closed is not None

    def __repr__(self) -> str:
        state = " closed" if self._closed else ""
        kind = "" if self.owned else " view"
        devices, hosts = list(self.device_ids), list(self.host_ids)
        memory = ", shared memory" if self.shared_memory else ""
        return f"DeviceMesh{self.shape}{kind}(devices={devices}, hosts={hosts}, {self.backend}{memory}{state})"

    def check_open(self) -> None:
        """Raise MeshClosed (shut down) or WorkerDied (a device died) unless usable."""
        if self._closed:
            raise MeshClosed(f"{self!r} was shut down ({self._closed}); create a new mesh with DeviceMesh.create(...)")
        runtime().check_devices(self.device_ids, repr(self))

    # ---------------------------------------------------------------- remote calls

    def call(self, fn, *args, devices=None, timeout_s: float = 60.0, **kwargs) -> list:
        """Run ``fn(ctx, *args, **kwargs)`` on the devices at flat indices ``devices`` (default
        all) and return the results in that order. ``ctx`` is the actor's ``DeviceContext``."""
        self.check_open()
        idx = range(self.size) if devices is None else list(devices)
        refs = {i: self._records[i].actor.call.remote(fn, *args, **kwargs) for i in idx}
        results, errors, pending = gather(refs, timeout_s)
        rt = runtime()
        for i, (kind, err) in errors.items():
            if kind == "died":
                rt.mark_dead(self.device_ids[i], f"actor died in call(): {err}")
        if errors:
            i, (kind, err) = min(errors.items())
            if kind == "died":
                raise WorkerDied(
                    f"{self!r}: device {self.device_ids[i]} died while running {getattr(fn, '__name__', fn)}"
                )
            raise err
        if pending:
            raise ReshardTimeout(
                f"{self!r}: call to {getattr(fn, '__name__', fn)} on flat indices {pending} "
                f"timed out after {timeout_s:g}s"
            )
        return [results[i] for i in idx]

    def configure(self, *, max_communicators: int | None = None, max_programs: int | None = None) -> None:
        """Change the per-device bounds of this mesh's devices (the driver enforces both; they
        take effect at the next reshard that touches the devices)."""
        self.check_open()
        for rec in self._records:
            if max_communicators is not None:
                rec.max_communicators = _positive_int("max_communicators", max_communicators)
            if max_programs is not None:
                rec.max_programs = _positive_int("max_programs", max_programs)

    def stats(self, timeout_s: float = 30.0) -> list[dict]:
        """Each device's state: buffers and bytes, cached programs, live groups, counters."""
        self.check_open()
        refs = {i: r.actor.stats.remote() for i, r in enumerate(self._records)}
        results, errors, pending = gather(refs, timeout_s)
        if errors or pending:
            raise ReshardTimeout(f"{self!r}: stats failed: {errors or pending}")
        return [results[i] for i in range(self.size)]

    # ---------------------------------------------------------------- lifetime

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Close the mesh. An owning mesh also stops its actors (after closing their
        communicators); views over them become unusable. Idempotent."""
        if self._closed:
            return
        reason = f"{self!r} was shut down"
        self._closed = reason
        rt = runtime()
        rt.unregister_mesh(self, reason)
        if not self.owned:
            return
        live = [r for r in self._records if r.state == "alive"]
        rt.close_devices(self.device_ids, reason)
        if ray.is_initialized():
            refs = [r.actor.close.remote() for r in live]
            if refs:
                ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
            for r in self._records:
                try:
                    ray.kill(r.actor, no_restart=True)
                except Exception:  # already gone
                    pass

    def __enter__(self) -> DeviceMesh:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


_PRIVATE = object()
