"""``python -m bench``: our reshard beside what a user would use instead, on an embedded local Ray
cluster, in one run, every result checked bit-exact.

One pool of device actors (``bench.cases.POOL_SHAPE``, 8) serves every case through mesh views.
Per (case, size) the suite distributes one source tensor and times, interleaved round by round so
that drifting machine load hits every method alike:

* ``ours``: ``reshard(x, x.mesh, dst_layout)``, the default path (slices between actors of this
  machine pulled through shared memory), and ``ours_gloo``: ``shared_memory=False`` (every slice
  through gloo, the path between machines);
* peers (``bench.peers``): ``object_store`` (``ray.put`` of contiguous numpy pieces in the source
  actors, ``ray.get`` and assembly in the destination actors), ``rdt`` (Ray Direct Transport over a
  torch_gloo group, on plain actors of the pool's count), ``dtensor`` (torch DTensor
  ``redistribute`` over a gloo world of the device actors; same-mesh cases only);
* ceilings: ``memcpy`` (each destination actor copies its shard's bytes between resident buffers,
  all at once): the default path's; ``raw_gloo`` (the bytes that cross between actors in the gloo
  path's plan, one message per pair on a raw gloo group, ``bench.ceiling``): the gloo path's;
  ``raw_gloo_fresh``, the same into freshly mapped memory, beside it for outputs kept alive;
* ``empty_rtt``: one empty call (``reshard_ping``) to every actor of the case, gathered;
* optionally ``naive`` (``distribute(x.to_numpy(), dst_layout)``) and other strategies of ours on
  the default path (``--strategies``).

Headline mode: outputs kept alive, as a user keeps activations or weights. No result is freed
between repeats, so no destination reuses a freed shard's memory (the JSON's ``pool_hits_kept``
counts reuses, and is 0); the peers keep theirs too. Before every timed method the outputs kept so
far are released (and the devices' pools of freed memory emptied, so what follows still gets
fresh memory), untimed, and each round starts one method later in the list, so no method always
follows the same one. (How much fresh memory costs depends on what was freed just before: on a
virtual machine that hands freed memory back to its host, memory freed moments ago costs far less
to touch again than memory freed seconds ago; releasing only past a memory bound, in a fixed
order, favoured whichever method came right after a release.) Beside it the pooled mode
(``ours_pooled``, ``ours_gloo_pooled``): each output freed before the next repeat, so a destination
reuses the last one's memory (after one untimed run that fills the pool).

Each method runs once untimed per case (communicator set-up, program shipping, RDT connections)
and again at a size whose plan needs groups the case has not used yet; plans for every size are
compiled before timing. The first result of every method at every size (``--quick``: once per
case) is compared bit for bit with the source on every destination device, after its clock
stopped. Latency is the driver's wall time from the call until every destination holds its shard.

Start-up (when the suite starts its own pool): ``DeviceMesh.create(POOL_SHAPE)`` until every actor
answered, against a pool of as many bare Ray actors that import numpy until each answered a first
call; two of each, alternated (the second mesh is the suite's pool), the fastest of each compared.

Results: rich tables on the terminal, JSON in ``bench/results/local-<timestamp>.json`` and
``bench/results/latest.json`` (or ``--out``); ``python -m bench.report`` re-renders a JSON file.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

from bench import provenance  # noqa: E402
from bench.cases import (  # noqa: E402
    CASES,
    POOL_HOST_IDS,
    POOL_SHAPE,
    POOL_SIZE,
    Case,
    MeshView,
    fmt_size,
    parse_size,
    select_cases,
)
from bench.methods import (  # noqa: E402
    CEILING,
    CEILING_FRESH,
    DTENSOR,
    MEMCPY,
    NAIVE,
    OBJECT_STORE,
    OURS,
    OURS_GLOO,
    OURS_GLOO_POOLED,
    OURS_POOLED,
    PEERS,
    RDT,
    RTT,
    SCHEMA,
)

RESULTS_DIR = Path(__file__).resolve().parent / "results"
DEFAULT_SIZES = ("64KiB", "1MiB", "16MiB", "64MiB", "256MiB")
QUICK_SIZES = ("64KiB", "4MiB")
STRATEGY = "auto"  # what reshard runs by default
RTT_PER_ROUND = 3


def default_repeats(size_bytes: int) -> int:
    if size_bytes <= 1 << 20:
        return 7
    if size_bytes <= 16 << 20:
        return 5
    if size_bytes <= 64 << 20:
        return 3
    return 2


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description="Our reshard (default path and gloo path) beside the Ray object store, Ray Direct Transport "
        "and torch DTensor, with memcpy and raw-gloo ceilings, on an embedded local Ray cluster.",
    )
    p.add_argument(
        "--sizes",
        help=f"comma-separated tensor sizes (default {','.join(DEFAULT_SIZES)}); "
        "units B/KiB/MiB/GiB, bare numbers are MiB",
    )
    p.add_argument("--cases", help="comma-separated case names (default: all): " + ", ".join(c.name for c in CASES))
    p.add_argument("--peers", help=f"comma-separated peers (default: all of {', '.join(PEERS)}); 'none' for none")
    p.add_argument(
        "--strategies",
        help=f"other strategies of ours to time on the default path (default: none; '{STRATEGY}' is what ours runs)",
    )
    p.add_argument("--naive", action="store_true", help="also time distribute(x.to_numpy(), dst_layout)")
    p.add_argument(
        "--repeats",
        type=int,
        help="timed rounds per method (default: 7 up to 1 MiB, 5 up to 16 MiB, 3 up to 64, else 2)",
    )
    p.add_argument(
        "--quick", action="store_true", help=f"sizes {','.join(QUICK_SIZES)}, 2 repeats, verified once per case"
    )
    p.add_argument("--dtype", default="float32", help="element type (default float32)")
    p.add_argument("--out", help="JSON output path (default bench/results/local-<timestamp>.json + latest.json)")
    p.add_argument("--no-ceiling", action="store_true", help="skip the memcpy and raw gloo ceilings")
    p.add_argument("--no-pooled", action="store_true", help="skip the pooled mode (outputs freed between repeats)")
    p.add_argument("--no-startup", action="store_true", help="skip the start-up comparison")
    p.add_argument("--timeout", type=float, default=300.0, help="per-call timeout in seconds (default 300)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--staging-keep",
        type=parse_size,
        metavar="SIZE",
        help="runtime knob: staging bytes each device keeps between reshards "
        "(DeviceMesh.create(staging_keep_bytes=...); runtime default 64 MiB)",
    )
    p.add_argument(
        "--buffer-pool",
        type=parse_size,
        metavar="SIZE",
        help="runtime knob: idle bytes of freed shards each device keeps for reuse "
        "(DeviceMesh.create(buffer_pool_bytes=...); runtime default 256 MiB; 0 disables)",
    )
    p.add_argument(
        "--assembly",
        type=parse_size,
        metavar="SIZE",
        help="runtime knob: the buffer each device assembles new destinations in before writing "
        "them into fresh shared memory (DeviceMesh.create(assembly_bytes=...); runtime default "
        "256 MiB; 0 writes them in place)",
    )
    p.add_argument(
        "--backend",
        choices=("gloo", "nccl"),
        help="communicator backend of the device pool (default: nccl when Ray reports a GPU per "
        "device, else gloo); with nccl the peers and ceilings (CPU) are skipped",
    )
    p.add_argument(
        "--gpus-per-device",
        metavar="F|auto",
        help="with nccl: GPUs each device actor reserves; a fraction shares a GPU among several actors, "
        "each its own NCCL host (socket transport: correctness, not speed); auto: the GPUs Ray reports "
        "divided among the pool's devices, at most 1",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.sizes = args.sizes or ",".join(QUICK_SIZES)
        args.repeats = args.repeats or 2
    args.size_list = [parse_size(s) for s in (args.sizes or ",".join(DEFAULT_SIZES)).split(",") if s.strip()]
    args.case_list = select_cases([c.strip() for c in args.cases.split(",")] if args.cases else None)
    if args.repeats is not None and args.repeats < 1:
        p.error("--repeats must be at least 1")
    if args.peers is None:
        args.peer_list = list(PEERS)
    else:
        args.peer_list = [s.strip() for s in args.peers.split(",") if s.strip() and s.strip() != "none"]
        unknown = [s for s in args.peer_list if s not in PEERS]
        if unknown:
            p.error(f"unknown peers {unknown}; choose from {', '.join(PEERS)} or 'none'")
    if args.backend == "nccl":
        args.no_ceiling = True
        args.peer_list = []
    return args


# ------------------------------------------------------------------------------------ helpers


def stats_of(samples: list[float]) -> dict:
    import numpy as np

    a = np.asarray(samples, dtype=float)
    return {
        "median": float(np.median(a)),
        "min": float(a.min()),
        "max": float(a.max()),
        "p25": float(np.percentile(a, 25)),
        "p75": float(np.percentile(a, 75)),
        "n": int(a.size),
        "samples": [float(x) for x in a],
    }


def make_array(shape, dtype: str, seed: int):
    """Random data with every bit pattern exercised (floats: random mantissas and signs, no NaN)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    if dt.kind == "f":
        return (rng.standard_normal(shape, dtype=np.float32) * 1e3).astype(dt, copy=False)
    if dt.kind == "b":
        return rng.integers(0, 2, size=shape, dtype=np.uint8).astype(bool)
    info = np.iinfo(dt)
    return rng.integers(info.min, info.max, size=shape, dtype=dt, endpoint=True)


def compare(shards: dict, boxes: dict, source) -> tuple[bool, str]:
    """Every device's array in ``shards`` equals, bit for bit, its box of ``source`` (``boxes``)."""
    import numpy as np

    uint = np.dtype(f"u{source.dtype.itemsize}") if source.dtype.itemsize in (1, 2, 4, 8) else None
    for d, box in boxes.items():
        expected = source[tuple(slice(lo, hi) for lo, hi in box)]
        got = np.asarray(shards[d])
        if tuple(got.shape) != tuple(expected.shape) or got.dtype != expected.dtype:
            return False, f"device {d}: got {got.dtype}{list(got.shape)}, want {expected.dtype}{list(expected.shape)}"
        if uint is not None:
            same = np.array_equal(got.view(uint), expected.view(uint))
        else:
            same = np.array_equal(got, expected)
        if not same:
            bad = int(np.count_nonzero(got.view(uint) != expected.view(uint))) if uint is not None else -1
            return False, f"device {d}: {bad} of {expected.size} elements differ"
    return True, f"{len(boxes)} shards bit-exact"


def verify(tensor, source) -> tuple[bool, str]:
    """Every device's shard of ``tensor`` (a ShardedTensor) equals its region of ``source``."""
    from reshard.ir.regions import layout_regions

    regions = layout_regions(tensor.layout, tuple(source.shape))
    ids = tensor.mesh.device_ids
    shards = tensor.local_shards()
    return compare({ids[i]: shards[i] for i in range(len(regions))}, dict(zip(ids, regions, strict=True)), source)


def pair_bytes(plan) -> dict[tuple[int, int], int]:
    """(sender, receiver) -> bytes that cross between the two actors in ``plan``."""
    from reshard.ir.plan import TransferKind

    out: dict[tuple[int, int], int] = {}
    for t in plan.transfers:
        if t.kind is TransferKind.COPY:
            continue
        n = plan.transfer_bytes(t)
        for d in t.dsts:
            out[(t.src, d)] = out.get((t.src, d), 0) + n
    return out


def program_bytes(program, itemsize: int) -> dict:
    """CPU-side byte traffic of a lowered program, summed over devices: local copies, bytes pulled
    from peers' shards through shared memory, bytes that pass through staging (send and receive
    side), bytes received over communicators."""
    from reshard.ir.program import MESSAGE_OPS, Copy, Pull, op_numel, writes

    out = {"copy_bytes": 0, "pull_bytes": 0, "staged_bytes": 0, "recv_bytes": 0, "ops": 0}
    for dp in program.devices:
        for op in dp.all_ops:
            n = op_numel(op) * itemsize
            out["ops"] += 1
            if isinstance(op, Copy):
                out["copy_bytes"] += n
                continue
            if isinstance(op, Pull):
                out["pull_bytes"] += n
                continue
            if not isinstance(op, MESSAGE_OPS):  # publications, scaling: no bytes of their own
                continue
            if op.staging is not None:
                out["staged_bytes"] += n
            if writes(op) is not None:
                out["recv_bytes"] += n
    return out


def _pool_state(ctx, drain: bool) -> tuple[int, int]:
    """In a device actor: (hits, misses) of its pool of freed shards; ``drain``: empty the pool
    first (its memory goes back to the system), so the next shards are fresh memory."""
    if drain:
        ctx.store.clear_pool()
    m = ctx.store.memory()
    return m["pool_hits"], m["pool_misses"]


def command_line(suite: str, argv) -> str:
    """The command a result records (``bench.provenance.command_line``)."""
    return provenance.command_line(" ".join(["python -m bench", *([suite] if suite else [])]), argv)


def recorded_run(suite: str, argv, out: str | None, run) -> tuple[dict, Path]:
    """``run()`` on this process's Ray (an embedded local cluster if none is up), its result under
    the header every result file carries (command, revision, versions), written as JSON to ``out``
    or ``bench/results/<suite>-<timestamp>.json``; the data and the path."""
    import ray

    when = _dt.datetime.now()
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        result = run()
    finally:
        if started:
            ray.shutdown()
    data = {
        "suite": suite,
        "command": command_line(suite, argv),
        "revision": provenance.revision(),
        "when": when.isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": _torch_version(),
        "ray": ray.__version__,
        "cpus": os.cpu_count(),
        **result,
    }
    path = Path(out) if out else RESULTS_DIR / f"{suite}-{when:%Y%m%d-%H%M%S}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return data, path


# ------------------------------------------------------------------------------------ methods


class Ours:
    """``reshard`` of one (case, size) on one path; its outputs live in ``kept`` until ``release``."""

    def __init__(self, x, dst_layout, strategy: str, shared_memory: bool, timeout_s: float):
        self.x, self.dst_layout, self.strategy = x, dst_layout, strategy
        self.shared_memory, self.timeout_s = shared_memory, timeout_s
        self.kept: list = []
        self.breakdown: list[dict] = []

    def run(self, keep: bool) -> float:
        from reshard import reshard
        from reshard.runtime import runtime

        runtime().batches.last_run = {}
        t0 = time.perf_counter()
        y = reshard(
            self.x,
            self.x.mesh,
            self.dst_layout,
            strategy=self.strategy,
            timeout_s=self.timeout_s,
            shared_memory=self.shared_memory,
        )
        dt = time.perf_counter() - t0
        if runtime().batches.last_run:
            self.breakdown.append(_split(dt, runtime().batches.last_run))
        self.kept.append(y)
        return dt

    def check(self, source) -> tuple[bool, str]:
        return verify(self.kept[-1], source)

    def release(self) -> None:
        for y in self.kept:
            y.free()
        self.kept = []


class Naive(Ours):
    """``distribute(x.to_numpy(), dst_layout)``: gather on the driver, then scatter."""

    def __init__(self, x, dst_layout, timeout_s: float):
        super().__init__(x, dst_layout, "", True, timeout_s)

    def run(self, keep: bool) -> float:
        from reshard import distribute

        t0 = time.perf_counter()
        full = self.x.to_numpy(timeout_s=self.timeout_s)
        y = distribute(full, self.dst_layout, timeout_s=self.timeout_s)
        dt = time.perf_counter() - t0
        self.kept.append(y)
        return dt


class Peer:
    """A ``bench.peers`` method (``run(keep)``, ``last()``, ``release()``) and its destinations' boxes."""

    def __init__(self, impl, dst_boxes: dict):
        self.impl, self.dst_boxes = impl, dst_boxes

    def run(self, keep: bool) -> float:
        return self.impl.run(keep)

    def check(self, source) -> tuple[bool, str]:
        return compare(self.impl.last(), self.dst_boxes, source)

    def release(self) -> None:
        self.impl.release()


# ------------------------------------------------------------------------------------ the suite


class Suite:
    """The device pool, its mesh views, the stores of the gloo ceilings and the DTensor world,
    and the RDT actors, for one run."""

    def __init__(self, args, console, progress=None, task=None, pool=None):
        from reshard import DeviceMesh
        from reshard.runtime.backends.gloo import listening_store

        self.args = args
        self.console = console
        self.progress = progress
        self.task = task
        self.owns_pool = pool is None
        self.create_s: float | None = None
        if pool is None:
            t0 = time.perf_counter()
            pool = DeviceMesh.create(POOL_SHAPE, startup_timeout_s=180, **mesh_options(args))
            self.create_s = time.perf_counter() - t0
        self.pool = pool
        if tuple(self.pool.shape) != POOL_SHAPE:
            raise ValueError(f"the local suite needs a pool mesh of shape {POOL_SHAPE}, got {self.pool!r}")
        _check_host_pattern(MeshView(POOL_SHAPE, tuple(range(POOL_SIZE)), POOL_HOST_IDS), self.pool)
        self.views: dict[MeshView, object] = {}
        self.store = listening_store("127.0.0.1", timeout_s=120)
        self.ceiling_groups: set[str] = set()
        self.rdt = None
        self.rdt_error: str | None = None
        self.dtensor = None
        self.dtensor_error: str | None = None

    def start_rdt(self) -> None:
        """The RDT actors and their group (untimed; the error is recorded for every case)."""
        from bench import peers

        try:
            self.rdt = peers.RdtPool(POOL_SIZE)
        except Exception as e:
            self.rdt_error = _error(e)

    def dtensor_world(self):
        from bench import peers

        if self.dtensor is None and self.dtensor_error is None:
            try:
                self.dtensor = peers.DTensorWorld(list(self.pool.device_ids), self.call_each, self.store.port)
            except Exception as e:
                self.dtensor_error = _error(e)
        return self.dtensor

    def close(self) -> None:
        from bench import ceiling, sockets

        try:
            self.listeners = sockets.survey(self.pool)
        except Exception as e:  # recorded: a run that cannot look still reports its results
            self.listeners = {"error": _error(e)}
        for key in self.ceiling_groups:
            try:
                self.call_each({d: (ceiling.teardown, (key,), {}) for d in self.pool.device_ids}, 30.0)
            except Exception:
                pass
        if self.dtensor is not None:
            try:
                self.dtensor.close()
            except Exception:
                pass
        if self.rdt is not None:
            self.rdt.close()
        for view in self.views.values():
            if view is not self.pool:
                view.shutdown()
        if self.owns_pool:
            self.pool.shutdown()

    # ---------------------------------------------------------------- meshes

    def bind(self, view: MeshView):
        """The DeviceMesh of a case's mesh view over the pool (created once, reused)."""
        from reshard import DeviceMesh

        if view in self.views:
            return self.views[view]
        devices = [self.pool.device_ids[p] for p in view.device_ids]
        if view.host_ids is not None and view.shape == POOL_SHAPE and tuple(view.device_ids) == tuple(range(POOL_SIZE)):
            dmesh = self.pool
        elif view.host_ids is not None:
            dmesh = DeviceMesh.from_devices(devices, view.shape)  # the pool's own hosts
        else:
            dmesh = DeviceMesh.from_devices(devices, view.shape, devices_per_host=view.devices_per_host)
        _check_host_pattern(view, dmesh)
        self.views[view] = dmesh
        return dmesh

    def call_each(self, calls: dict, timeout_s: float) -> dict:
        """Run ``fn(ctx, *args, **kwargs)`` per device (the runtime's ordered calls)."""
        from reshard.runtime import runtime

        return runtime().dispatch.call(calls, timeout_s, "bench")

    def pool_state(self, drain: bool) -> tuple[int, int]:
        """(hits, misses) of the pools of freed shards, summed over the devices; ``drain`` empties them."""
        out = self.call_each({d: (_pool_state, (drain,), {}) for d in self.pool.device_ids}, 60.0)
        return sum(h for h, _ in out.values()), sum(m for _, m in out.values())

    def actors(self, devices) -> list:
        return [self.pool.actor(self.pool.index_of(d)) for d in devices]

    def advance(self, what: str | None = None) -> None:
        if self.progress is not None:
            if what:
                self.progress.update(self.task, description=what)
            self.progress.advance(self.task)

    # ---------------------------------------------------------------- one (case, size)

    def run(
        self, case: Case, size_bytes: int, strategies: list[str], repeats: int, warmed: set, checked: set[str]
    ) -> dict:
        """Measure one (case, size). ``warmed``: methods (and communicator groups) already warmed
        up on this case; ``checked``: methods whose result was already verified (the first result
        of each method not in it is verified, outside its timing)."""
        import ray

        from bench import ceiling, peers
        from reshard import Layout, distribute
        from reshard.ir.regions import box_volume, layout_regions
        from reshard.runtime import lowered_reshard, runtime

        args = self.args
        shape = case.shape_for(size_bytes, args.dtype)
        source = make_array(shape, args.dtype, args.seed)
        itemsize = source.dtype.itemsize
        src_mesh, dst_mesh = self.bind(case.src), self.bind(case.dst)
        src_layout = Layout(src_mesh, case.src_placements)
        dst_layout = Layout(dst_mesh, case.dst_placements)
        devices = sorted(set(src_mesh.device_ids) | set(dst_mesh.device_ids))
        src_boxes = dict(zip(src_mesh.device_ids, layout_regions(src_layout, shape), strict=True))
        dst_boxes = dict(zip(dst_mesh.device_ids, layout_regions(dst_layout, shape), strict=True))
        out_bytes = sum(box_volume(b) for b in dst_boxes.values()) * itemsize
        x = distribute(source, src_layout, timeout_s=args.timeout)
        label = f"{case.name} {fmt_size(size_bytes)}"

        # What reshard runs for this shape on each path, compiled before any timing (its caches).
        paths = {OURS: (STRATEGY, True), OURS_GLOO: (STRATEGY, False), **{s: (s, True) for s in strategies}}
        lowered = {m: lowered_reshard(x, dst_layout, strategy=s, shared_memory=shm) for m, (s, shm) in paths.items()}
        pairs = pair_bytes(lowered[OURS_GLOO].plan)
        pieces = peers.assign_pieces(src_boxes, dst_boxes)
        entry: dict = {
            "case": case.name,
            "what": case.what,
            "layouts": str(case),
            "src": str(src_layout),
            "dst": str(dst_layout),
            "size_bytes": size_bytes,
            "tensor_bytes": int(source.nbytes),
            "output_bytes": out_bytes,
            "shape": list(shape),
            "dtype": args.dtype,
            "devices": len(devices),
            "repeats": repeats,
            "moved_bytes": sum(pairs.values()),
            "methods": {},
        }
        methods = entry["methods"]
        for m, (s, shm) in paths.items():
            methods[m] = {
                "kind": "ours" if m in (OURS, OURS_GLOO) else "strategy",
                "strategy": s,
                "mode": "kept",
                "path": "shared_memory" if shm else "gloo",
                "ceiling": MEMCPY if shm else CEILING,
                "transfers": len(lowered[m].plan.transfers),
                "moved_bytes": sum(pair_bytes(lowered[m].plan).values()),
                **program_bytes(lowered[m].program, itemsize),
            }
        pooled = {} if args.no_pooled else {OURS_POOLED: OURS, OURS_GLOO_POOLED: OURS_GLOO}
        for m, base in pooled.items():
            methods[m] = {**methods[base], "mode": "pooled"}
        if args.naive:
            methods[NAIVE] = {"kind": "baseline", "mode": "kept"}
        for p in args.peer_list:
            methods[p] = {"kind": "peer", "mode": "kept", "pieces": sum(len(v) for v in pieces.values())}
        if not args.no_ceiling:
            methods[MEMCPY] = {"kind": "ceiling", "for_path": "shared_memory", "bytes": out_bytes}
            methods[CEILING] = {
                "kind": "ceiling",
                "for_path": "gloo",
                "pairs": len(pairs),
                "moved_bytes": sum(pairs.values()),
                "plan": "gloo path",
            }
            methods[CEILING_FRESH] = {**methods[CEILING], "memory": "fresh"}
            for m in paths:  # outputs kept alive land in fresh memory: so does this ceiling's receive
                if not paths[m][1]:
                    methods[m]["fresh_ceiling"] = CEILING_FRESH
        methods[RTT] = {"kind": "rtt", "actors": len(devices)}

        # ---- the runners: keeping ones (run(keep), check(source), release()) and the others (run())
        runners: dict = {m: Ours(x, dst_layout, s, shm, args.timeout) for m, (s, shm) in paths.items()}
        for m, base in pooled.items():
            runners[m] = Ours(x, dst_layout, STRATEGY, paths[base][1], args.timeout)
        if args.naive:
            runners[NAIVE] = Naive(x, dst_layout, args.timeout)
        closers = []
        key = f"{case.name}/{size_bytes}"
        for p in args.peer_list:
            try:
                if p == OBJECT_STORE:
                    handles = dict(zip(devices, self.actors(devices), strict=True))
                    impl = peers.ObjectStore(
                        f"os/{key}", handles, x.name, src_boxes, dst_boxes, pieces, args.dtype, args.timeout
                    )
                elif p == RDT:
                    if self.rdt is None:
                        raise RuntimeError(self.rdt_error or "no RDT actors")
                    position = {d: self.pool.index_of(d) for d in devices}
                    impl = peers.DirectTransport(
                        f"rdt/{key}", self.rdt, position, source, src_boxes, dst_boxes, pieces, args.timeout
                    )
                    closers.append(impl.close)
                else:
                    if case.src != case.dst or tuple(case.src.device_ids) != tuple(range(POOL_SIZE)):
                        methods[p]["skipped"] = "not a same-mesh case over the whole pool"
                        continue
                    world = self.dtensor_world()
                    if world is None:
                        raise RuntimeError(self.dtensor_error)
                    impl = peers.DTensorPeer(
                        f"dt/{key}", world, x.name, case.src.shape, case.src_placements, case.dst_placements, shape
                    )
                    closers.append(impl.close)
                runners[p] = Peer(impl, dst_boxes)
            except Exception as e:
                methods[p]["error"] = _error(e)
        keepers = [m for m in runners if m not in pooled]
        raw = memcpy = None
        if not args.no_ceiling:
            dst_bytes = {d: box_volume(b) * itemsize for d, b in dst_boxes.items()}
            memcpy = peers.Memcpy(f"mc/{key}", dst_bytes, self.call_each, args.timeout)
            runners[MEMCPY] = memcpy.run
            raw = ceiling.RawTransfer(case.name, pairs, self.call_each, self.store.port, args.timeout)
            if pairs:
                raw.setup()  # join the raw group (once per device set), allocate send buffers: untimed
                self.ceiling_groups.add(raw.key)
                runners[CEILING] = raw.run
                runners[CEILING_FRESH] = lambda: raw.run(fresh=True)
            else:
                methods[CEILING]["error"] = methods[CEILING_FRESH]["error"] = "nothing crosses between actors"
        actors = self.actors(devices)

        def run_rtt() -> list[float]:
            out = []
            for _ in range(RTT_PER_ROUND):
                t0 = time.perf_counter()
                ray.get([a.reshard_ping.remote() for a in actors], timeout=60)
                out.append(time.perf_counter() - t0)
            return out

        runners[RTT] = run_rtt
        samples: dict[str, list[float]] = {m: [] for m in runners}
        failed: set[str] = set()

        def attempt(m: str, timed: bool, keep: bool = False) -> None:
            if m in failed:
                return
            r = runners[m]
            try:
                out = r.run(keep) if m in keepers or m in pooled else r()
                if m in keepers or m in pooled:
                    if m not in checked and (timed or m not in pooled):  # pooled: a result in reused memory
                        ok, detail = r.check(source)
                        methods[m]["verified"], methods[m]["verify_detail"] = ok, detail
                        checked.add(m)
                        if not ok:
                            raise AssertionError(f"result not bit-exact: {detail}")
                    if m in pooled:
                        r.release()
                if timed:
                    samples[m] += out if isinstance(out, list) else [out]
                else:
                    methods[m]["warmup_s"] = out[0] if isinstance(out, list) else out
            except Exception as e:  # record and go on: one broken method must not sink the suite
                failed.add(m)
                methods[m]["error"] = _error(e)
                if m in keepers or m in pooled:
                    methods[m]["verified"] = False

        def release_all() -> None:
            for m in keepers:
                if m not in failed:
                    try:
                        runners[m].release()
                    except Exception as e:
                        failed.add(m)
                        methods[m]["error"] = _error(e)
            self.pool_state(drain=True)

        stats = runtime().stats
        created = stats["groups_created"]
        releases = 0
        try:
            # ---- warm-up: once per (case, method), again for communicator groups not used yet
            for m in runners:
                wkey = m + raw.key if m in (CEILING, CEILING_FRESH) and raw is not None else m
                groups = [("group", g) for g in lowered[m].groups] if m in lowered else []
                if m in pooled or (wkey in warmed and warmed.issuperset(groups)):
                    self.advance(None)
                    continue
                warmed.update(groups)
                warmed.add(wkey)
                self.advance(f"{label} warm-up {m}")
                attempt(m, False)
                if m in keepers and m not in failed:
                    runners[m].release()
            for r in (raw, memcpy, getattr(runners.get(DTENSOR), "impl", None)):
                if r is not None:
                    r.in_actor.clear()
            if raw is not None:
                raw.in_actor_fresh.clear()
            for m in keepers:
                getattr(runners[m], "breakdown", []).clear()
            created = stats["groups_created"]

            # ---- headline: outputs kept alive, nothing reused
            release_all()
            hits0, misses0 = self.pool_state(drain=False)
            kept = False
            headline = [m for m in runners if m not in pooled]
            for r in range(repeats):
                for m in headline[r % len(headline) :] + headline[: r % len(headline)]:  # rotated: no fixed neighbours
                    if m in keepers and m not in failed:
                        if kept:  # every method starts from the same state
                            release_all()
                            releases += 1
                        kept = True
                    self.advance(f"{label} round {r + 1}/{repeats} {m}")
                    attempt(m, True, keep=True)
            hits1, misses1 = self.pool_state(drain=False)
            entry["pool_hits_kept"], entry["pool_misses_kept"] = hits1 - hits0, misses1 - misses0
            entry["kept_releases"] = releases
            release_all()

            # ---- pooled: each output freed before the next repeat (after one untimed run per path)
            if pooled:
                for m in pooled:
                    self.advance(f"{label} pooled warm-up {m}")
                    attempt(m, False)
                for r in range(repeats):
                    for m in pooled:
                        self.advance(f"{label} pooled round {r + 1}/{repeats} {m}")
                        attempt(m, True)
                hits2, misses2 = self.pool_state(drain=False)
                entry["pool_hits_pooled"], entry["pool_misses_pooled"] = hits2 - hits1, misses2 - misses1
        finally:
            for m in runners:
                if m in keepers or m in pooled:
                    try:
                        runners[m].release()
                    except Exception:
                        pass
            for close in closers:
                try:
                    close()
                except Exception:
                    pass
            x.free()
            for r in (raw, memcpy):
                if r is not None:
                    try:
                        r.release()
                    except Exception:
                        pass
            try:
                self.pool_state(drain=True)
            except Exception:
                pass

        # communicators the runtime had to (re-)create inside timed rounds (cache evictions)
        entry["groups_created_timed"] = stats["groups_created"] - created
        for m, vals in samples.items():
            if vals:
                methods[m]["latency_s"] = stats_of(vals)
        for m in keepers + list(pooled):
            parts = getattr(runners[m], "breakdown", None)
            if parts:
                methods[m]["breakdown_s"] = {k: statistics.median([p[k] for p in parts]) for k in parts[0]}
        for name, inner in (
            (CEILING, raw and raw.in_actor),
            (CEILING_FRESH, raw and raw.in_actor_fresh),
            (MEMCPY, memcpy and memcpy.in_actor),
        ):
            if inner:
                methods[name]["in_actor_s"] = stats_of(inner)
        if DTENSOR in runners and runners[DTENSOR].impl.in_actor:
            methods[DTENSOR]["in_actor_s"] = stats_of(runners[DTENSOR].impl.in_actor)
        derive_ratios(entry)
        for m, v in methods.items():
            if v["kind"] in ("ours", "strategy", "baseline", "peer") and "verified" not in v and m in checked:
                v["verified_earlier"] = True  # --quick: this method's result was verified at a smaller size
        from bench.report import case_ok

        entry["ok"] = case_ok(methods)
        return entry


def _error(e: BaseException) -> str:
    """One line naming what failed; a Ray task's error names its cause (its first line is only the
    task's name)."""
    cause = getattr(e, "cause", None)
    text = str(cause if isinstance(cause, BaseException) else e)
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


def _split(wall: float, per_device: dict) -> dict:
    """Where one reshard's wall time went, from the slowest device's point of view.

    ``ray_overhead``: driver wall minus the slowest device's ``run`` (dispatch, argument and result
    transport, the driver's own planning/bookkeeping, gather); ``actor_setup``: run minus program
    (decode, allocate the destination); ``copy_stage``: program minus communication (local copies,
    pulls, staging); ``comm``: time inside gloo calls (including waiting for peers)."""
    stats = [{"run_s": r.run_s, "elapsed_s": r.elapsed_s, "comm_s": r.comm_s} for r in (per_device or {}).values()]
    if not stats:
        return {"wall": wall}
    slow = max(stats, key=lambda v: v["run_s"])
    return {
        "wall": wall,
        "ray_overhead": wall - slow["run_s"],
        "actor_setup": slow["run_s"] - slow.get("elapsed_s", 0.0),
        "copy_stage": slow.get("elapsed_s", 0.0) - slow.get("comm_s", 0.0),
        "comm": slow.get("comm_s", 0.0),
        "max_comm": max(v.get("comm_s", 0.0) for v in stats),
        "max_copy_stage": max(v.get("elapsed_s", 0.0) - v.get("comm_s", 0.0) for v in stats),
    }


def _check_host_pattern(view: MeshView, dmesh) -> None:
    """The runtime's hosts must group the view's devices as the case says (up to renaming)."""
    want, got = view.resolved_host_ids, dmesh.host_ids
    if len({(a, b) for a, b in zip(want, got, strict=True)}) != len(set(want)) or len(set(want)) != len(set(got)):
        raise RuntimeError(f"mesh view {view}: runtime hosts {list(got)} do not group devices like {list(want)}")


def derive_ratios(entry: dict) -> None:
    """Effective bandwidth and the ratios the targets speak of, from medians: for our methods the
    fraction of their path's ceiling (ceiling latency / ours), x an empty Ray round trip, and how
    many times faster than each peer (peer latency / ours)."""
    methods = entry["methods"]

    def med(name):
        return methods.get(name, {}).get("latency_s", {}).get("median")

    rtt = med(RTT)
    for name, m in methods.items():
        t = med(name)
        if t is None or m["kind"] == "rtt":
            continue
        m["eff_GBps"] = entry["tensor_bytes"] / t / 1e9
        if m["kind"] == "ceiling":
            continue
        if rtt:
            m["x_empty_rtt"] = t / rtt
        if m["kind"] in ("ours", "strategy"):
            if med(m["ceiling"]):
                m["frac_of_ceiling"] = med(m["ceiling"]) / t
            if med(m.get("fresh_ceiling")):
                m["frac_of_fresh_ceiling"] = med(m["fresh_ceiling"]) / t
            m["x_faster_than"] = {p: med(p) / t for p in (*PEERS, NAIVE) if med(p)}


# ------------------------------------------------------------------------------------ entry point


def mesh_options(args) -> dict:
    """The runtime knobs of the command line, as ``DeviceMesh.create`` arguments."""
    options = {}
    if getattr(args, "staging_keep", None) is not None:
        options["staging_keep_bytes"] = args.staging_keep
    if getattr(args, "buffer_pool", None) is not None:
        options["buffer_pool_bytes"] = args.buffer_pool
    if getattr(args, "assembly", None) is not None:
        options["assembly_bytes"] = args.assembly
    if getattr(args, "backend", None) is not None:
        options["backend"] = args.backend
    share = getattr(args, "gpus_per_device", None)
    if share is not None and getattr(args, "backend", None) == "nccl":
        import ray

        from reshard.runtime.backends.nccl import NcclBackend

        per = min(1.0, ray.cluster_resources().get("GPU", 0.0) / POOL_SIZE) if share == "auto" else float(share)
        options["backend"] = NcclBackend(gpus_per_device=per, gpu_sharing="hostid" if per < 1 else "auto")
    return options


def mesh_startup_s(args) -> float:
    """Seconds ``DeviceMesh.create(POOL_SHAPE)`` takes (every actor answered); the mesh is shut down."""
    from reshard import DeviceMesh

    t0 = time.perf_counter()
    mesh = DeviceMesh.create(POOL_SHAPE, startup_timeout_s=180, **mesh_options(args))
    dt = time.perf_counter() - t0
    mesh.shutdown()
    return dt


def startup_entry(mesh_s: list[float], bare_s: list[float]) -> dict:
    """The start-up comparison: the fastest of each kind of pool, as the machine's load drifts."""
    return {
        "mesh_shape": list(POOL_SHAPE),
        "mesh_create_s": mesh_s,
        "bare_actors": POOL_SIZE,
        "bare_s": bare_s,
        "ratio": min(mesh_s) / min(bare_s),
    }


def main(argv: list[str] | None = None, *, pool=None) -> int:
    """Run the suite; ``pool``: an existing 2x4 DeviceMesh to use instead of starting 8 actors
    (Ray must then be running; the start-up comparison is skipped). Returns 0 when every result
    was verified bit-exact."""
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    import ray
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from bench import peers, report
    from reshard import STRATEGIES

    console = Console()
    strategies: list[str] = []
    if args.strategies:
        strategies = [s.strip() for s in args.strategies.split(",") if s.strip() and s.strip() != STRATEGY]
        unknown = [s for s in strategies if s not in STRATEGIES]
        if unknown:
            console.print(f"[red]unknown strategies {unknown}; registered: {', '.join(STRATEGIES)}")
            return 2
    started_ray = False
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        started_ray = True
    t_start = time.time()
    when = _dt.datetime.now()
    load_start = os.getloadavg()
    entries: list[dict] = []
    n_methods = 3 + len(strategies) + len(args.peer_list) + args.naive + 2 * (not args.no_ceiling)
    n_pooled = 0 if args.no_pooled else 2
    total = len(args.case_list) * sum(
        n_methods * (1 + (args.repeats or default_repeats(s))) + n_pooled * (2 + (args.repeats or default_repeats(s)))
        for s in args.size_list
    )
    console = Console(width=max(console.width, 150)) if not console.is_terminal else console
    suite = None
    startup = None
    try:
        with Progress(
            TextColumn("[bold]{task.description}", table_column=None),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=False,
        ) as progress:
            task = progress.add_task("starting device actors", total=total)
            measure = pool is None and not args.no_startup
            bare: list[float] = []
            mesh: list[float] = []
            if measure:  # alternated: bare, mesh, bare, then the suite's own pool
                progress.update(task, description=f"start-up: {POOL_SIZE} bare actors, DeviceMesh.create, again")
                bare.append(peers.bare_startup_s(POOL_SIZE))
                mesh.append(mesh_startup_s(args))
                bare.append(peers.bare_startup_s(POOL_SIZE))
            suite = Suite(args, console, progress, task, pool=pool)
            if measure:
                mesh.append(suite.create_s)
                startup = startup_entry(mesh, bare)
            if RDT in args.peer_list:
                progress.update(task, description="starting the RDT actors and their torch_gloo group")
                suite.start_rdt()
            for case in args.case_list:
                warmed: set = set()
                checked: set[str] = set()  # --quick: verify once per case; else once per size
                for size in sorted(args.size_list):
                    if not args.quick:
                        checked = set()
                    repeats = args.repeats or default_repeats(size)
                    t0 = time.perf_counter()
                    entries.append(suite.run(case, size, strategies, repeats, warmed, checked))
                    entries[-1]["duration_s"] = time.perf_counter() - t0
            progress.update(task, description="done")
    finally:
        if suite is not None:
            suite.close()
        if started_ray:
            ray.shutdown()
    data = {
        "schema": SCHEMA,
        "suite": "local",
        "started": when.isoformat(timespec="seconds"),
        "duration_s": time.time() - t_start,
        "command": command_line("", argv if argv is not None else sys.argv[1:]),
        "revision": provenance.revision(),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "loadavg_start": list(load_start),
            "loadavg_end": list(os.getloadavg()),
            "ray": ray.__version__,
            "torch": _torch_version(),
        },
        "pool": list(POOL_SHAPE),
        "staging_keep_bytes": args.staging_keep,
        "buffer_pool_bytes": args.buffer_pool,
        "assembly_bytes": args.assembly,
        "dtype": args.dtype,
        "sizes": args.size_list,
        "cases": [c.name for c in args.case_list],
        "strategy": STRATEGY,
        "strategies": strategies,
        "peers": args.peer_list,
        "rdt_setup_s": None if suite is None or suite.rdt is None else suite.rdt.setup_s,
        "startup": startup,
        "listeners": getattr(suite, "listeners", None),
        "results": entries,
    }
    data["targets"] = report.targets(data)
    out = _write(data, args.out, when)
    report.render(data, console)
    console.print(f"results: {out}")
    return 0 if all(e["ok"] for e in entries) else 1


def _torch_version() -> str:
    try:
        import torch

        return torch.__version__
    except Exception:
        return "unknown"


def _write(data: dict, out: str | None, when) -> Path:
    if out:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=1))
        return path
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"local-{when.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(data, indent=1))
    shutil.copyfile(path, RESULTS_DIR / "latest.json")
    return path


if __name__ == "__main__":
    sys.exit(main())
