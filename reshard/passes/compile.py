"""compile_reshard: everything decided about one reshard, in one pure function.

plan (``plan_reshard``) -> ``validate_plan`` -> lower -> pulls (transfers inside one shared-memory
domain become copies out of the sender's source shard, or, for relays, out of its destination
shard once it published the slice) -> sequencing (order and overlap of local
ops, issue windows; groups connect in order of first use) -> ``validate_program`` -> msgpack, one
blob per participating device. The runtime ships the blobs; its executor runs each device's ops in
the order given and decides nothing. Results are cached by their inputs.

``compile_batch``: many tensors in one reshard (a model's state dict): each compiled as above, then
the small ones' messages packed into buckets (``reshard.passes.packing``), ``validate_batch``, one blob
per device holding its part of every tensor.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache

from reshard.ir.batch import BatchProgram
from reshard.ir.cost import lower_bound_s, resolve_cluster
from reshard.ir.layout import Layout
from reshard.ir.plan import ReshardPlan
from reshard.ir.program import Buffer, Group, Program, Publish, Pull
from reshard.ir.serialize import encode_batch_device_program, encode_device_program
from reshard.ir.target import CompileTarget
from reshard.passes.lowering import lower_plan
from reshard.passes.packing import BUCKET_BYTES, pack_batch
from reshard.passes.pulls import last_write, to_pulls
from reshard.passes.sequencing import OVERLAP_COPY_BYTES, WINDOW_BYTES, WINDOW_STAGING_BYTES, sequence_program
from reshard.passes.validate import validate_batch, validate_plan, validate_program
from reshard.planner import plan_reshard


@dataclass(frozen=True, slots=True)
class CompileOptions:
    """How programs are sequenced (``reshard.passes.sequencing``): ``overlap_copy_bytes`` (None: local ops
    never run on the helper thread, e.g. GPU devices), ``window_ops``, ``window_staging_bytes`` and
    ``window_bytes``; a batch's bucket windows alternate between two halves of the staging where
    ``double_buffer`` (``reshard.passes.packing``)."""

    overlap_copy_bytes: int | None = OVERLAP_COPY_BYTES
    window_ops: int = 1
    window_staging_bytes: int = WINDOW_STAGING_BYTES
    window_bytes: int = WINDOW_BYTES
    double_buffer: bool = False

    @classmethod
    def for_target(cls, target: CompileTarget) -> CompileOptions:
        """How ``target``'s devices run their programs: messages in its windows, and local copies
        beside them only where its devices copy on a helper thread (CPUs)."""
        overlap = OVERLAP_COPY_BYTES if target.copies_beside_messages else None
        return cls(
            overlap_copy_bytes=overlap,
            window_ops=target.window_ops,
            window_bytes=target.window_bytes,
            window_staging_bytes=target.window_staging_bytes,
            double_buffer=target.double_buffer,
        )


@dataclass(frozen=True, slots=True, eq=False)
class CompiledReshard:
    """A reshard ready to ship: the plan, the validated program, and per participating device its
    program as msgpack. Participants are the devices that run ops or receive a destination shard."""

    plan: ReshardPlan
    program: Program
    blobs: Mapping[int, bytes] = field(repr=False)
    participants: tuple[int, ...]
    groups: tuple[Group, ...]
    pull_sources: Mapping[int, tuple[int, ...]]
    relay_sources: Mapping[int, tuple[int, ...]]
    domains: tuple[tuple[int, Hashable], ...]
    options: CompileOptions = CompileOptions()

    @property
    def pulled(self) -> dict[int, int | None]:
        """The plan's transfers (by index) that run as pulls, each with the transfer that brings
        its holder the bytes (a relay: the last before its publication that writes into them) or
        None (a source shard): what ``plan.simulate(pulled=)`` takes."""
        out: dict[int, int | None] = {}
        for p in self.program.devices:
            for i, op in enumerate(p.ops):
                if isinstance(op, Publish):
                    j = last_write(p.ops, i, op.box)
                    out[op.step] = None if j is None else p.ops[j].step
        for p in self.program.devices:
            for op in p.all_ops:
                if isinstance(op, Pull) and op.buffer is Buffer.SRC:
                    out[op.step] = None
        return out

    def simulate(self, cluster=None):
        """The plan simulated as it runs: its pulled transfers as pulls, messages issued in windows of
        ``options.window_ops``, local ops beside them where the options overlap them
        (``ReshardPlan.simulate``)."""
        options = self.options
        return self.plan.simulate(
            cluster,
            pulled=self.pulled,
            window=options.window_ops,
            window_bytes=options.window_bytes,
            local_beside=options.overlap_copy_bytes is not None,
        )


def compile_reshard(
    shape,
    dtype,
    src: Layout,
    dst: Layout,
    *,
    strategy: str = "auto",
    cluster=None,
    domains: Mapping[int, Hashable | None] | None = None,
    publishers: Iterable[int] | None = None,
    options: CompileOptions = CompileOptions(),
) -> CompiledReshard:
    """Compile moving a ``dtype`` tensor of ``shape`` from ``src`` to ``dst``: plan it
    (``strategy``, for ``cluster``), lower the plan to one program per device and validate both;
    the pure half of ``reshard``, cached per signature. Raises ``PlanError`` for what it cannot plan.

    ``domains`` maps devices to their shared-memory domain (e.g. their machine; None or absent:
    none): transfers inside one domain become pulls, and the planner counts the devices of one
    domain as one host (their transfers cost no network). ``publishers``: the devices whose
    destination shards peers may pull relays from (None: every device with a domain).
    ``cluster``: the cost model the planner plans for (``plan_reshard``)."""
    shared = tuple(sorted((d, dom) for d, dom in (domains or {}).items() if dom is not None))
    relaying = None if publishers is None else frozenset(publishers)
    return _compile(tuple(shape), dtype, src, dst, strategy, cluster, shared, relaying, options)


@lru_cache(maxsize=512)
def _compile(shape, dtype, src, dst, strategy, cluster, domains, publishers, options, hosts=None) -> CompiledReshard:
    domain_of = dict(domains)
    plan = plan_reshard(
        shape,
        dtype,
        src,
        dst,
        strategy=strategy,
        cluster=cluster,
        hosts=planning_hosts(src, dst, domain_of) if hosts is None else dict(hosts),
    )
    validate_plan(plan)
    program = lower_plan(plan)
    validate_program(program)
    program = to_pulls(program, domain_of, publishers)
    program = sequence_program(
        program,
        overlap_copy_bytes=options.overlap_copy_bytes,
        window_ops=options.window_ops,
        window_staging_bytes=options.window_staging_bytes,
        window_bytes=options.window_bytes,
    )
    validate_program(program)
    participants = tuple(p.device for p in program.devices if p.ops or p.background or p.dst_shape is not None)
    blobs = {d: encode_device_program(program.for_device(d), program.dtype) for d in participants}
    return CompiledReshard(
        plan,
        program,
        blobs,
        participants,
        program.groups,
        program.pull_sources,
        program.relay_sources,
        domains,
        options,
    )


def planning_hosts(src: Layout, dst: Layout, domain_of: Mapping[int, Hashable]) -> dict[int, int] | None:
    """The device -> host map to plan with: the meshes' hosts, except that the devices of one
    shared-memory domain share one host (the lowest host id among them). None: no domains."""
    return domain_hosts((src.mesh, dst.mesh), domain_of)


def domain_hosts(meshes, domain_of: Mapping[int, Hashable]) -> dict[int, int] | None:
    """``planning_hosts`` over any meshes (a batch's: one map for all its tensors)."""
    if not domain_of:
        return None
    hosts: dict[int, int] = {}
    for mesh in meshes:
        hosts.update(zip(mesh.device_ids, mesh.host_ids, strict=True))
    merged: dict[Hashable, int] = {}
    for d, dom in domain_of.items():
        if d in hosts:
            merged[dom] = min(merged.get(dom, hosts[d]), hosts[d])
    return {d: merged[domain_of[d]] if d in domain_of else h for d, h in hosts.items()}


@dataclass(frozen=True, slots=True, eq=False)
class CompiledBatch:
    """Many tensors' reshards compiled into one (``compile_batch``): each tensor's
    ``CompiledReshard`` (``tensors``), the packed ``BatchProgram``, and per participating device its
    part as msgpack. ``pull_sources[device][tensor]``: the devices whose source shards of that
    tensor it pulls; ``relay_sources[device]``: the devices it pulls relays from; ``results[device]``:
    the tensors it holds a shard of afterwards, in order (what a commit copies, an abandon drops)."""

    tensors: tuple[CompiledReshard, ...]
    program: BatchProgram
    blobs: Mapping[int, bytes] = field(repr=False)
    participants: tuple[int, ...]
    groups: tuple[Group, ...]
    pull_sources: Mapping[int, Mapping[int, tuple[int, ...]]]
    relay_sources: Mapping[int, tuple[int, ...]]
    bucket_bytes: int
    results: Mapping[int, tuple[int, ...]] = field(repr=False)

    def lower_bound_s(self, cluster=None) -> float:
        """The fluid lower bound (``reshard.ir.cost``) of moving every tensor of the batch: all their
        unit tasks served at once, each host's bytes summed over the tensors."""
        hosts: dict[int, int] = {}
        tasks: list = []
        for c in self.tensors:
            hosts.update(c.plan.host_map)
            tasks += c.plan.tasks
        return lower_bound_s(tuple(tasks), hosts, resolve_cluster(cluster, hosts))


@dataclass(frozen=True, slots=True)
class BatchItem:
    """One tensor of a batch: its ``shape`` and ``dtype``, from ``src`` to ``dst``; ``domains`` and
    ``publishers`` as ``compile_reshard`` takes them (``domains`` as sorted ``(device, domain)``
    pairs; ``publishers`` None: every device with a domain). ``hosts``: the device -> host map it is
    planned on, as sorted pairs (None: from ``domains``, as ``planning_hosts``); a batch gives every
    tensor the same one, whichever of its shards peers can pull (``domain_hosts``), so that one
    cost model fits them all."""

    shape: tuple[int, ...]
    dtype: str
    src: Layout
    dst: Layout
    domains: tuple[tuple[int, Hashable], ...] = ()
    publishers: frozenset[int] | None = None
    hosts: tuple[tuple[int, int], ...] | None = None


def compile_batch(
    items: Iterable[BatchItem],
    *,
    strategy: str = "auto",
    cluster=None,
    options: CompileOptions = CompileOptions(),
    bucket_bytes: int = BUCKET_BYTES,
) -> CompiledBatch:
    """Compile moving every tensor of ``items`` in one reshard: each compiled as
    ``compile_reshard`` does (cached per problem), then the small ones' messages packed into
    buckets of at most ``bucket_bytes`` (``reshard.passes.packing``), validated and encoded per device.
    Cached by its inputs."""
    return _compile_batch(tuple(items), strategy, cluster, options, int(bucket_bytes))


@lru_cache(maxsize=64)
def _compile_batch(items, strategy, cluster, options, bucket_bytes) -> CompiledBatch:
    singles = tuple(
        _compile(i.shape, i.dtype, i.src, i.dst, strategy, cluster, i.domains, i.publishers, options, i.hosts)
        for i in items
    )
    hosts: dict[int, int] = {}
    for c in singles:
        hosts.update(c.plan.host_map)
    batch = pack_batch(
        [c.program for c in singles],
        bucket_bytes=bucket_bytes,
        window_ops=options.window_ops,
        window_bytes=options.window_bytes,
        window_staging_bytes=options.window_staging_bytes,
        double_buffer=options.double_buffer,
        hosts=hosts,
    )
    validate_batch(batch)
    alike: dict = {}  # (layout, shape) -> its shard_meta: tensors alike share one (encoded once)
    metas = []
    for i in items:
        key = (i.dst, tuple(i.shape))
        meta = alike.get(key)
        if meta is None:
            meta = alike[key] = shard_meta(i.dst, i.shape)
        metas.append(meta)
    blobs = {
        p.device: encode_batch_device_program(
            p, {part.tensor: metas[part.tensor][p.device] for part in p.parts if part.program.dst_shape is not None}
        )
        for p in batch.devices
    }
    pulls: dict[int, dict[int, tuple[int, ...]]] = {}
    relays: dict[int, set[int]] = {}
    for t, c in enumerate(singles):
        for d, holders in c.pull_sources.items():
            pulls.setdefault(d, {})[t] = holders
        for d, holders in c.relay_sources.items():
            relays.setdefault(d, set()).update(holders)
    return CompiledBatch(
        singles,
        batch,
        blobs,
        tuple(p.device for p in batch.devices),
        batch.groups,
        pulls,
        {d: tuple(sorted(h)) for d, h in relays.items()},
        bucket_bytes,
        {p.device: tuple(part.tensor for part in p.parts if part.program.dst_shape is not None) for p in batch.devices},
    )


def shard_meta(layout: Layout, shape) -> dict[int, dict]:
    """Per destination device, what its shard is a shard of (kept with the shard, for DTensor)."""
    return {
        d: {
            "shape": tuple(shape),
            "placements": layout.placements,
            "mesh_shape": layout.mesh.shape,
            "coordinate": layout.mesh.coords(flat),
        }
        for flat, d in enumerate(layout.mesh.device_ids)
    }
