"""DeviceMesh: an n-D grid of device actors, bound to an abstract ``topology.Mesh``.

``DeviceMesh.create(shape)`` starts one Ray actor per device, placed on nodes
(``reshard.runtime.driver.node_placement``): axis 0 enumerates hosts (unless ``devices_per_host`` says
otherwise), each host's devices on one Ray node (``nodes=[...]`` names them). When the devices
sit on several nodes, their hosts ARE those nodes (job-wide host ids, as ``Cluster.from_ray``
numbers them); when they all share one node, the mesh keeps its logical hosts (the planner then
treats them as hosts, e.g. to rehearse a multi-host plan on one machine). The creating mesh OWNS
its actors; ``shutdown()`` stops them.

``DeviceMesh.from_devices(devices, shape)`` builds a VIEW over devices existing meshes own (any
shape of the same size, disjoint or overlapping). A view owns nothing: its ``shutdown()`` only
closes the view; shutting the owner down closes every view over its devices (``MeshClosed``).

Handles pickle into Ray tasks and actors of the same job and work there (reshard, distribute,
read back); a copy never owns the actors: its ``shutdown()`` closes only the copy.

Shared memory (CPU devices, default on): the actors allocate their shards in shared memory, and a
reshard moves every slice whose sender and receivers run on one machine as a pull: the receiver
copies it straight out of the sender's source shard, mapped read-only, or, for a slice the sender
relays (it received it from another machine), out of its destination shard once the sender
published it (``reshard.passes.pulls``). Only the rest goes through the backend. ``shared_memory=False``
keeps shards private (everything through the backend, as between machines). Trust model: any
process of the same user on the machine may read or write those shards through ``/proc``, as it
may attach a debugger; the actors themselves map their peers' shards read-only.
"""

from __future__ import annotations

import logging

import ray

from reshard.errors import MeshClosed, ReshardTimeout
from reshard.runtime.backends.registry import backend_class, backend_spec, make_backend
from reshard.runtime.deadlines import Deadline
from reshard.runtime.device_options import DeviceOptions, positive_int, positive_seconds
from reshard.runtime.driver import directory, node_placement
from reshard.runtime.driver.controller import Runtime, runtime
from reshard.runtime.driver.device_registry import DeviceRecord, Session
from reshard.runtime.driver.dispatch import failure_error, gather
from reshard.runtime.messages import DeviceState
from topology.mesh import Mesh, default_devices_per_host

log = logging.getLogger(__name__)

_ACTOR_CLASS = None
DEFAULT_NUM_CPUS = 0.01  # what a device actor reserves by default: visible to Ray, not a whole core
MAX_CONCURRENCY = 32  # calls a device actor serves at once (most wait their turn; see inbox)


def _actor_class():
    global _ACTOR_CLASS
    if _ACTOR_CLASS is None:
        from reshard.runtime.device.actor import CONTROL, DeviceActor

        # Ray's typed overloads of ray.remote omit the actor option concurrency_groups
        _ACTOR_CLASS = ray.remote(concurrency_groups={CONTROL: 4})(DeviceActor)  # type: ignore[call-overload]
    return _ACTOR_CLASS


def ensure_ray() -> None:
    """Start an embedded local Ray if none is running, on loopback, without a dashboard. Only
    ``DeviceMesh.create`` does this; everything else refuses to run without Ray. Loopback: Ray
    reads ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` when it is imported, so unless the user set it, it
    is set for the processes Ray starts and Ray's constant for this one (a cluster the user
    connects to is left as it is)."""
    if ray.is_initialized():
        return
    import os

    if "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in os.environ:
        from ray._private import ray_constants

        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        ray_constants.ENABLE_RAY_CLUSTER = False
    ray.init(include_dashboard=False)


class DeviceMesh:
    """A grid of device actors: the meshes layouts place tensors on. ``create`` starts new
    actors (and an embedded local Ray if none runs); ``attach`` makes existing actors of any class
    devices, ``from_actors`` actors that mix in ``DeviceRole``; ``from_devices`` is a view (another
    shape, a subset) over devices of live meshes. ``shutdown()`` stops the actors it owns.

        mesh = DeviceMesh.create((2, 4))                       # 2 hosts x 4 devices, gloo on CPUs
        gpus = DeviceMesh.create((8,), backend="nccl")         # one GPU per device
        x = distribute(array, Layout(mesh, (Shard(0), Replicate())))
    """

    def __init__(
        self,
        mesh: Mesh,
        backend: str,
        records,
        *,
        rt: Runtime,
        owned: bool,
        placement_group=None,
        attached=False,
        _token=None,
    ):
        if _token is not _PRIVATE:
            raise TypeError("use DeviceMesh.create(shape) or DeviceMesh.from_devices(devices, shape)")
        self.runtime = rt  # this process's controller: every call on the mesh and its tensors goes through it
        self.mesh = mesh
        self.backend = backend
        self.owned = owned
        self.attached = attached  # over the user's own actors (from_actors): shutdown detaches, kills nothing
        self._records = list(records)
        self._placement_group = placement_group
        self._closed: str | None = None

    # ---------------------------------------------------------------- construction

    @classmethod
    def create(
        cls,
        shape,
        *,
        devices_per_host: int | None = None,
        nodes=None,
        backend=None,
        axis_names=None,
        num_cpus: float = DEFAULT_NUM_CPUS,
        resources: dict | None = None,
        max_communicators: int = 64,
        max_programs: int = 256,
        op_timeout_s: float = DeviceOptions.op_timeout_s,
        startup_timeout_s: float = 120.0,
        staging_keep_bytes: int = DeviceOptions.staging_keep_bytes,
        buffer_pool_bytes: int = DeviceOptions.buffer_pool_bytes,
        assembly_bytes: int = DeviceOptions.assembly_bytes,
        torch_threads: int = DeviceOptions.torch_threads,
        shared_memory: bool = DeviceOptions.shared_memory,
        caller_check_s: float = DeviceOptions.caller_check_s,
    ) -> DeviceMesh:
        """Start one actor per device of a mesh of ``shape`` (module docstring).

        ``devices_per_host`` (default: product of the axes after the first) must divide the size.
        ``nodes``: one Ray node per host (node id or IP). ``num_cpus``/``resources``: what each
        device actor reserves. ``backend``: "gloo" (CPU), "nccl" (one GPU per device), a registered
        name or a ``Backend`` instance; default "nccl" when Ray reports a GPU per device, else "gloo".
        ``max_communicators`` bounds each device's communicators per controlling process (LRU,
        controller-enforced); ``max_programs`` its program cache; ``op_timeout_s`` bounds connection
        setup outside a reshard; ``staging_keep_bytes`` bounds the staging an idle device keeps;
        ``buffer_pool_bytes`` bounds, per device, the idle memory of dropped shards kept for reuse
        (0 disables the pool); ``assembly_bytes`` bounds, per device, the private buffer in which a
        new destination shard is assembled before it is written into fresh shared memory in one pass
        (larger ones, and all with 0, are written in place: slower, as fresh shared pages fault in);
        ``shared_memory`` (CPU devices only): see the module docstring. Every ``caller_check_s``
        each device frees what it kept for processes that called it and ended (``DeviceOptions``).
        """
        probe = Mesh(shape, devices_per_host=devices_per_host, axis_names=axis_names)  # validates
        positive_int("max_communicators", max_communicators)
        positive_int("max_programs", max_programs)
        positive_seconds("startup_timeout_s", startup_timeout_s)
        device_options = DeviceOptions(
            op_timeout_s,
            staging_keep_bytes,
            buffer_pool_bytes,
            assembly_bytes,
            torch_threads,
            shared_memory,
            caller_check_s,
        )
        if not isinstance(num_cpus, int | float) or num_cpus < 0:
            raise ValueError(f"num_cpus must be a number >= 0 (CPUs each device actor reserves), got {num_cpus!r}")
        ensure_ray()
        rt = runtime()
        session = Session.current()
        size = probe.size
        if backend is None:
            gpus = ray.cluster_resources().get("GPU", 0)
            backend = "nccl" if gpus >= size else "gloo"
            if 0 < gpus < size:
                log.warning("Ray reports %s GPU(s) for a mesh of %d devices: using gloo on CPUs", gpus, size)
        if isinstance(backend, str) and backend in rt.backends:
            name, instance = backend, rt.backends[backend]  # one instance per backend name and process
            gpus = backend_spec(name).gpus_per_device
        else:
            name, instance, gpus = make_backend(backend)
        spec = backend_spec(name)
        need = size * gpus
        have = ray.cluster_resources().get("GPU", 0)
        if need > have:
            raise ValueError(
                f"DeviceMesh.create({probe.shape}) with backend {name!r} needs {need:g} GPU(s), one per device, "
                f"but the Ray cluster has {have:g}; use backend='gloo' for CPU devices or a smaller mesh"
            )
        dph = default_devices_per_host(probe.shape) if devices_per_host is None else devices_per_host
        n_hosts = size // dph
        deadline = Deadline.after(startup_timeout_s)
        where = node_placement.place(
            n_hosts, dph, nodes, node_placement.demand(num_cpus, gpus, resources), startup_timeout_s
        )
        ids = rt.registry.new_device_ids(size)
        options = device_options.for_device(spec.device_type)
        actor_cls = _actor_class()
        actors = [
            actor_cls.options(**opts, max_restarts=0, max_task_retries=0, max_concurrency=MAX_CONCURRENCY).remote(
                d, instance, options
            )
            for d, opts in zip(ids, where.options, strict=True)
        ]
        outcome = gather(
            {d: a.reshard_ready.remote() for d, a in zip(ids, actors, strict=True)}, deadline, settle_s=None
        )
        if not outcome.ok:
            for a in actors:
                ray.kill(a, no_restart=True)
            node_placement.remove(where.placement_group)
            if outcome.pending and not outcome.failures:
                raise ReshardTimeout(
                    f"DeviceMesh.create({probe.shape}): devices {outcome.pending} did not start within "
                    f"startup_timeout_s={startup_timeout_s:g}s; Ray has {ray.available_resources()} available "
                    f"and each device asks for {node_placement.demand(num_cpus, gpus, resources)}"
                )
            raise failure_error(outcome, f"DeviceMesh.create({probe.shape})", deadline)
        return cls._register(
            probe.shape,
            axis_names,
            dph,
            ids,
            actors,
            outcome.results,
            name,
            instance,
            session,
            (max_communicators, max_programs),
            f"DeviceMesh{probe.shape}",
            owned=True,
            placement_group=where.placement_group,
        )

    @classmethod
    def from_actors(
        cls,
        actors,
        shape,
        *,
        devices_per_host: int | None = None,
        axis_names=None,
        backend="gloo",
        shared_memory: bool = DeviceOptions.shared_memory,
        max_communicators: int = 64,
        max_programs: int = 256,
        op_timeout_s: float = DeviceOptions.op_timeout_s,
        startup_timeout_s: float = 120.0,
        buffer_pool_bytes: int = DeviceOptions.buffer_pool_bytes,
        assembly_bytes: int = DeviceOptions.assembly_bytes,
        staging_keep_bytes: int = DeviceOptions.staging_keep_bytes,
        torch_threads: int = 0,
        caller_check_s: float = DeviceOptions.caller_check_s,
    ) -> DeviceMesh:
        """A mesh over the user's own Ray actors (flat order), whose classes mix in
        ``reshard.runtime.DeviceRole``: each actor becomes a device (``reshard_attach``) and keeps
        its state; its code shares its tensors (``self.reshard_device.share(...)``) for
        ``reshard.runtime.adopt``, and reshards write into its memory (``reshard(..., out=...)``).
        Hosts: the actors' Ray nodes (actors of one machine are one host, as they are), unless
        ``devices_per_host`` is given: then, for actors on one node, logical hosts as in ``create``.
        ``torch_threads`` (0: as they are) sets torch's threads in the actors; ``caller_check_s`` as
        in ``create``. ``shutdown()`` detaches the actors and leaves them running. Actors of any
        class: ``attach``."""
        actors = list(actors)
        probe = Mesh(shape, devices_per_host=devices_per_host, axis_names=axis_names)
        if len(actors) != probe.size:
            raise ValueError(
                f"DeviceMesh.from_actors: shape {probe.shape} needs {probe.size} actors, got {len(actors)}"
            )
        for a in actors:
            if not hasattr(a, "reshard_attach"):
                raise TypeError(
                    "DeviceMesh.from_actors needs Ray actors whose class mixes in reshard.runtime.DeviceRole, "
                    f"got {a!r}"
                )
        positive_int("max_communicators", max_communicators)
        positive_int("max_programs", max_programs)
        device_options = DeviceOptions(
            op_timeout_s,
            staging_keep_bytes,
            buffer_pool_bytes,
            assembly_bytes,
            torch_threads,
            shared_memory,
            caller_check_s,
        )
        deadline = Deadline.after(positive_seconds("startup_timeout_s", startup_timeout_s))
        rt = runtime()
        session = Session.current()
        if isinstance(backend, str) and backend in rt.backends:
            name, instance = backend, rt.backends[backend]
        else:
            name, instance, _ = make_backend(backend)
        spec = backend_spec(name)
        ids = rt.registry.new_device_ids(probe.size)
        options = device_options.for_device(spec.device_type)
        refs = {d: a.reshard_attach.remote(d, instance, options) for d, a in zip(ids, actors, strict=True)}
        outcome = gather(refs, deadline, settle_s=None)
        what = f"DeviceMesh.{'attach' if _attaching(actors) else 'from_actors'}({probe.shape})"
        if not outcome.ok:
            for d, a in zip(ids, actors, strict=True):
                if d in outcome.results or d in outcome.pending:  # a busy one leaves once it attached
                    a.reshard_close.remote()
            if outcome.pending and not outcome.failures:
                busy = [actors[ids.index(d)] for d in outcome.pending]
                raise ReshardTimeout(
                    f"{what}: actors {busy} did not answer within startup_timeout_s={startup_timeout_s:g}s. An actor "
                    "that runs one call at a time serves the mesh's calls only between its own: it is busy (a Ray "
                    "Train V1 worker runs its whole train loop in one call: use Ray Train V2, the default in Ray "
                    "2.60, or give the actor max_concurrency > 1), or it is stuck"
                )
            raise failure_error(outcome, what, deadline)
        dph = 0 if devices_per_host is None else devices_per_host  # 0: hosts are the Ray nodes
        return cls._register(
            probe.shape,
            axis_names,
            dph,
            ids,
            actors,
            outcome.results,
            name,
            instance,
            session,
            (max_communicators, max_programs),
            f"DeviceMesh.from_actors{probe.shape}",
            owned=False,
            attached=True,
        )

    @classmethod
    def attach(cls, actors, shape, **options) -> DeviceMesh:
        """A mesh over ANY existing Ray actors (flat order), as they are: Ray Train, vLLM or verl
        workers, whose classes a user cannot change. The runtime's calls reach them through Ray's
        ``actor.__ray_call__`` (``reshard.runtime.device.attach``) and queue behind the actors' own work.
        Inside, code reaches its device as ``reshard.runtime.device_of(self)`` (``share``,
        ``share_state_dict``, ``local``, ...). Options as ``from_actors``; ``shutdown()`` detaches."""
        from reshard.runtime.device.attach import CallProxy

        proxies = []
        for a in actors:
            if not hasattr(a, "__ray_call__"):
                raise TypeError(f"DeviceMesh.attach needs Ray actor handles, got {a!r}")
            proxies.append(CallProxy(a))
        return cls.from_actors(proxies, shape, **options)

    @classmethod
    def _register(
        cls,
        shape,
        axis_names,
        dph: int,
        ids,
        actors,
        infos: dict,
        name: str,
        instance,
        session,
        limits: tuple[int, int],
        what: str,
        **flags,
    ) -> DeviceMesh:
        """The mesh over started devices (``infos``: what each said when ready): hosts are the
        devices' Ray nodes when they sit on several or ``dph`` is 0, else fresh logical hosts of
        ``dph`` devices; its records join this process's registry."""
        rt = runtime()
        node_of = [infos[d]["node_id"] for d in ids]
        if len(set(node_of)) > 1 or dph == 0:  # hosts are the Ray nodes
            hosts = [rt.registry.host_of_node(n) for n in node_of]
        else:
            base = rt.registry.new_logical_hosts(len(ids) // dph)
            hosts = [base[i // dph] for i in range(len(ids))]
        mesh = Mesh(shape, ids, hosts, axis_names=axis_names)
        owner = f"{what} devices {ids[0]}..{ids[-1]}"
        records = [
            DeviceRecord(
                d,
                a,
                h,
                name,
                infos[d]["node_id"],
                infos[d]["node_ip"],
                owner,
                session,
                infos[d]["shared_memory"],
                *limits,
                board=infos[d].get("board"),
                memory_domain=infos[d].get("memory_domain"),
                threaded=bool(infos[d].get("threaded")),
            )
            for d, a, h in zip(ids, actors, hosts, strict=True)
        ]
        with rt.lock:
            rt.backends.setdefault(name, instance)
            records = rt.registry.add(records)
        dmesh = cls(mesh, name, records, rt=rt, _token=_PRIVATE, **flags)
        rt.registry.register_mesh(dmesh)
        dmesh._publish()
        return dmesh

    @classmethod
    def from_devices(cls, devices, shape, *, devices_per_host: int | None = None, axis_names=None) -> DeviceMesh:
        """A view of ``shape`` over existing devices (global ids, row-major; or a DeviceMesh).

        Hosts: each device's own host, unless ``devices_per_host`` is given (fresh logical hosts,
        ``devices_per_host`` consecutive devices each; only for devices on one node)."""
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
        records = rt.registry.check(devices, "DeviceMesh.from_devices")
        backends = {r.backend for r in records}
        if len(backends) > 1:
            raise ValueError(f"DeviceMesh.from_devices: devices use different backends {sorted(backends)}; use one")
        if devices_per_host is None:
            hosts = [r.host for r in records]
        else:
            if len({r.node_id for r in records}) > 1:
                raise ValueError(
                    "DeviceMesh.from_devices: devices_per_host declares logical hosts, but these devices sit on "
                    "several Ray nodes, whose hosts are the nodes; leave devices_per_host out"
                )
            base = rt.registry.new_logical_hosts(len(devices) // devices_per_host)
            hosts = [base[i // devices_per_host] for i in range(len(devices))]
        mesh = Mesh(probe.shape, devices, hosts, axis_names=axis_names)
        dmesh = cls(mesh, backends.pop(), records, rt=rt, owned=False, _token=_PRIVATE)
        rt.registry.register_mesh(dmesh)
        dmesh._publish()
        return dmesh

    # ---------------------------------------------------------------- pickling

    def _unpublish(self, reason: str) -> None:
        """Tell the job's other processes that this mesh closed (an owner's or attached mesh: its
        devices are gone), or remove a view's entry (another live mesh of this process over the
        same abstract mesh takes it over)."""
        if self.owned or self.attached:
            directory.publish_closed(self.mesh, reason, Session.current())
            return
        live, _ = self.runtime.registry.local_mesh(self.mesh)
        if live:
            live[-1]._publish()
        else:
            directory.remove_mesh(self.mesh, Session.current(), self.runtime.id)

    def _publish(self) -> None:
        """Let every process of the job find this mesh by its abstract mesh (``resolve_mesh``)."""
        backend = self.runtime.backends.get(self.backend)
        state = None if backend is None else backend.__getstate__()  # type: ignore[attr-defined]  # object.__getstate__ (3.11)
        described = [r.describe() for r in self._records]
        directory.publish_mesh(self.mesh, self.backend, state, described, Session.current(), self.runtime.id)

    def __reduce__(self):
        backend = self.runtime.backends.get(self.backend)
        return _rebuild, (self.mesh, self.backend, backend, [r.describe() for r in self._records], self._closed)

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
    def axis_names(self):
        return self.mesh.axis_names

    @property
    def node_ids(self) -> tuple[str, ...]:
        """The Ray node of each device, by flat index."""
        return tuple(r.node_id for r in self._records)

    @property
    def shared_memory(self) -> bool:
        """Whether every device keeps its shards in shared memory (peers on its machine pull)."""
        return all(r.shared_memory for r in self._records)

    @property
    def records(self) -> tuple[DeviceRecord, ...]:
        return tuple(self._records)

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

    def __getitem__(self, axes) -> tuple[DeviceMesh, ...]:
        """The sub-meshes along mesh axes named ``axes`` (a name or a tuple of names): one view per
        position of the other axes, in mesh order, each over the devices that differ only along
        ``axes`` (e.g. ``mesh["tp"]`` on a ("dp", "tp") mesh: one "tp" group per "dp" index).
        torch's ``DeviceMesh["tp"]`` is the one holding the calling rank; a driver has none."""
        names = (axes,) if isinstance(axes, str) else tuple(axes)
        known = self.axis_names or ()
        for n in names:
            if n not in known:
                raise KeyError(f"{n!r} is not an axis of {self!r}; its axes are {list(known)}")
        picked = [known.index(n) for n in names]
        shape = tuple(self.shape[a] for a in picked)
        groups: dict[tuple[int, ...], list[tuple[int, int]]] = {}  # other axes' coordinates -> (flat index, device)
        for flat, d in enumerate(self.device_ids):
            coords = self.mesh.coords(flat)
            groups.setdefault(tuple(c for a, c in enumerate(coords) if a not in picked), []).append((flat, d))
        out = []
        for members in groups.values():
            ordered = sorted(members, key=lambda fd: tuple(self.mesh.coords(fd[0])[a] for a in picked))
            out.append(DeviceMesh.from_devices([d for _, d in ordered], shape, axis_names=names))
        return tuple(out)

    def __repr__(self) -> str:
        state = " closed" if self._closed else ""
        kind = "" if self.owned else " attached" if self.attached else " view"
        names = f", axes={list(self.axis_names)}" if self.axis_names else ""
        memory = ", shared memory" if self.shared_memory else ""
        return (
            f"DeviceMesh{self.shape}{kind}(devices={list(self.device_ids)}, hosts={list(self.host_ids)}{names}, "
            f"{self.backend}{memory}{state})"
        )

    def check_open(self) -> None:
        """Raise MeshClosed (shut down, or Ray gone) or WorkerDied (a device died) unless usable."""
        if self._closed:
            raise MeshClosed(f"{self!r}: {self._closed}; create a new mesh with DeviceMesh.create(...)")
        self.runtime.registry.check(self.device_ids, repr(self))

    # ---------------------------------------------------------------- remote calls

    def call(self, fn, *args, devices=None, timeout_s: float = 60.0, **kwargs) -> list:
        """Run ``fn(ctx, *args, **kwargs)`` on the devices at flat indices ``devices`` (default
        all), in order with this process's other calls to them, and return the results in that
        order. ``ctx`` is the actor's ``DeviceContext``; ``fn``'s own exception is raised as is."""
        self.check_open()
        timeout_s = positive_seconds("timeout_s", timeout_s)
        idx = range(self.size) if devices is None else list(devices)
        ids = [self.device_ids[i] for i in idx]
        out = self.runtime.dispatch.call({d: (fn, args, kwargs) for d in ids}, timeout_s, f"{self!r}.call({_name(fn)})")
        return [out[d] for d in ids]

    def configure(self, *, max_communicators: int | None = None, max_programs: int | None = None) -> None:
        """Change the per-device bounds of this mesh's devices (the controller enforces both; they
        take effect at the next reshard that touches the devices)."""
        self.check_open()
        for rec in self._records:
            if max_communicators is not None:
                rec.max_communicators = positive_int("max_communicators", max_communicators)
            if max_programs is not None:
                rec.max_programs = positive_int("max_programs", max_programs)

    def empty_cache(self, timeout_s: float = 60.0) -> int:
        """Give back the memory this mesh's devices keep for reuse (as ``torch.cuda.empty_cache``
        does): the freed shards kept for the next destinations (``buffer_pool_bytes``), the
        buffers new destinations are assembled in (``assembly_bytes``), this process's staging
        buffers (``staging_keep_bytes``), peers' freed shards still mapped, and torch's cached GPU
        blocks. Live tensors are untouched; the next reshards allocate again. Returns the bytes
        freed (GPU caches not counted), as ``stats()`` reported them."""
        from reshard.runtime.device.context import DeviceContext

        return sum(self.call(DeviceContext.empty_cache, timeout_s=timeout_s))

    def stats(self, timeout_s: float = 30.0) -> list[dict]:
        """Each device's state: shards and bytes, holders, cached programs, live groups, counters."""
        self.check_open()
        deadline = Deadline.after(positive_seconds("timeout_s", timeout_s))
        refs = {r.id: r.actor.reshard_stats.remote() for r in self._records}
        outcome = self.runtime.dispatch.wait(refs, deadline, "stats")
        if not outcome.ok:
            raise failure_error(outcome, f"{self!r}.stats()", deadline)
        return [outcome.results[d] for d in self.device_ids]

    # ---------------------------------------------------------------- lifetime

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Close the mesh. An owning mesh also stops its actors (after closing their
        communicators); views and copies over them become unusable. Idempotent. An owning or
        attached mesh first lets its devices finish what this process asked of them (an async
        reshard's commit is never cut halfway), for at most ``timeout_s``."""
        if self._closed:
            return
        if ray.is_initialized() and (self.owned or self.attached):
            self._finish_calls(timeout_s)
        reason = f"{self!r} was shut down"
        self._closed = "it was shut down" if self.owned else "this view was shut down"
        rt = self.runtime
        rt.registry.unregister_mesh(self, reason)
        if ray.is_initialized():
            try:
                self._unpublish(reason)
            except Exception as e:  # Ray is going away
                log.debug("%r: %s", self, e)
        if self.attached:  # the user's actors: detach them, leave them running
            live = [r for r in self._records if r.state is DeviceState.ALIVE]
            rt.close_devices(self.device_ids, reason)
            if ray.is_initialized() and live:
                ray.wait([r.actor.reshard_close.remote() for r in live], num_returns=len(live), timeout=timeout_s)
            return
        if not self.owned:
            return
        live = [r for r in self._records if r.state is DeviceState.ALIVE]
        rt.close_devices(self.device_ids, reason)
        if ray.is_initialized():
            refs = [r.actor.reshard_close.remote() for r in live]
            if refs:
                ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
            for r in self._records:
                try:
                    ray.kill(r.actor, no_restart=True)
                except Exception:  # already gone
                    pass
            node_placement.remove(self._placement_group)

    def _finish_calls(self, timeout_s: float) -> None:
        """An ordered call that does nothing on each live device: it runs after this process's
        calls before it, so when it returns they are done (a dead or stuck device: close anyway)."""
        live: dict[int, tuple] = {r.id: (_nothing, (), {}) for r in self._records if r.state is DeviceState.ALIVE}
        try:
            self.runtime.dispatch.call(live, positive_seconds("timeout_s", timeout_s), f"{self!r}.shutdown()")
        except Exception as e:  # the mesh closes whatever its devices did
            log.debug("%r: not every device finished before closing: %s", self, e)

    def __enter__(self) -> DeviceMesh:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _attaching(actors) -> bool:
    from reshard.runtime.device.attach import CallProxy

    return any(isinstance(a, CallProxy) for a in actors)


def _rebuild(mesh: Mesh, backend_name: str, backend, described, closed) -> DeviceMesh:
    """A pickled mesh in another process (or a deep copy): a non-owning handle over the same actors."""
    rt = runtime()
    with rt.lock:
        if backend is not None:
            rt.backends.setdefault(backend_name, backend)
        records = rt.registry.add([DeviceRecord(**d) for d in described])
    dmesh = DeviceMesh(mesh, backend_name, records, rt=rt, owned=False, _token=_PRIVATE)
    dmesh._closed = closed
    if closed is None:
        rt.registry.register_mesh(dmesh)
    return dmesh


def resolve_mesh(mesh: Mesh, what: str) -> DeviceMesh:
    """The live DeviceMesh whose abstract mesh is ``mesh`` (the latest one built over it): one of
    this process's, else the one a process of the job published (a Layout built on the driver and
    passed into a Ray task or actor resolves there)."""
    rt = runtime()
    live, closed = rt.registry.local_mesh(mesh)
    if not live and closed is None:
        try:
            found = directory.find_mesh(mesh, Session.current())
        except directory.EntryRefused as e:
            raise MeshClosed(f"{what}: {e}; pass the DeviceMesh itself into this task or actor (it pickles)") from None
        if isinstance(found, str):
            closed = found
        elif found is not None:
            live = [_rebuild(mesh, found.backend, _backend_from(found), found.described, None)]
    if not live:
        if closed is not None:
            raise MeshClosed(f"{what}: {closed}; create a new mesh (DeviceMesh.create)")
        raise ValueError(
            f"{what}: mesh {mesh} is not a live DeviceMesh of this job; build the layout from a "
            "DeviceMesh (Layout(device_mesh, placements)), not from a plain topology.Mesh"
        )
    dmesh = live[-1]
    dmesh.check_open()
    return dmesh


def _backend_from(found: directory.Published):
    """This process's instance of a published mesh's backend, else one made from its configuration."""
    have = runtime().backends.get(found.backend)
    if have is not None:
        return have
    cls = backend_class(found.backend)
    if found.backend_state is None or "__setstate__" not in vars(cls):
        return cls()
    instance = cls.__new__(cls)
    instance.__setstate__(found.backend_state)  # type: ignore[attr-defined]  # defined by cls (checked)
    return instance


def _nothing(ctx) -> None:
    return None


def _name(fn) -> str:
    return getattr(fn, "__name__", repr(fn))


_PRIVATE = object()
