"""``python -m bench``: real reshards on an embedded local Ray cluster, against a naive baseline
and a raw-gloo ceiling measured in the same run, between the same actors.

One pool of device actors (``bench.cases.POOL_SHAPE``, 8) serves every case through mesh views.
Per (case, size) the suite distributes one source tensor and measures, interleaved round by round
so that drifting machine load hits every method alike:

* every strategy of ``reshard.STRATEGIES``: ``reshard(x, x.mesh, dst_layout, strategy=...)``;
* ``naive``: what a Ray user writes by hand: ``distribute(x.to_numpy(), dst_layout)``;
* ``raw gloo``: the bytes the default strategy's plan moves between actors, one contiguous
  message per (sender, receiver) pair, all posted at once on a raw ``ProcessGroupGloo`` built for
  the bench (``bench.ceiling``, run through the device actors' ``call`` extension point);
* ``empty RTT``: one empty ``call`` to every actor of the case, gathered (Ray's floor).

Each method runs once as a warm-up per case (at the case's first size: communicator set-up,
program shipping), and again at a later size whose plan uses communicator groups the case has not
used yet; plans for every size are computed and lowered before timing. Then ``repeats``
timed rounds per size; the first result of every method at every size is checked bit-exact against
the source array on every destination device (after its clock stopped). Latency is wall time on
the driver, from the call until the destination tensor exists (``reshard`` returns).
Results: a rich table on the terminal, JSON in ``bench/results/local-<timestamp>.json`` and
``bench/results/latest.json`` (or ``--out``); ``python -m bench.report`` re-renders a JSON file.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

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

RESULTS_DIR = Path(__file__).resolve().parent / "results"
DEFAULT_SIZES = ("64KiB", "1MiB", "16MiB", "64MiB", "256MiB")
QUICK_SIZES = ("64KiB", "4MiB")
NAIVE = "naive"
CEILING = "raw_gloo"
RTT = "empty_rtt"
RTT_PER_ROUND = 3
SCHEMA = 1


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
        description="Reshard microbenchmarks on an embedded local Ray cluster (CPU devices: slices pulled "
        "through shared memory between actors of the machine, gloo otherwise).",
    )
    p.add_argument("--sizes", help=f"comma-separated tensor sizes (default {','.join(DEFAULT_SIZES)}); "
                   "units B/KiB/MiB/GiB, bare numbers are MiB")  # fmt: skip
    p.add_argument("--cases", help="comma-separated case names (default: all): " + ", ".join(c.name for c in CASES))
    p.add_argument("--strategies", help="comma-separated strategy names (default: every one in reshard.STRATEGIES)")
    p.add_argument(
        "--repeats", type=int, help="timed rounds per method (default: 10 up to 1 MiB, 5 up to 16 MiB, else 3)"
    )
    p.add_argument("--quick", action="store_true", help=f"sizes {','.join(QUICK_SIZES)}, 2 repeats: about a minute")
    p.add_argument("--dtype", default="float32", help="element type (default float32)")
    p.add_argument("--out", help="JSON output path (default bench/results/local-<timestamp>.json + latest.json)")
    p.add_argument("--no-naive", action="store_true", help="skip the naive gather-and-distribute baseline")
    p.add_argument("--no-ceiling", action="store_true", help="skip the raw gloo ceiling")
    p.add_argument("--timeout", type=float, default=300.0, help="per-reshard timeout in seconds (default 300)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--staging-keep", type=parse_size, metavar="SIZE",
                   help="runtime knob: staging bytes each device keeps between reshards "
                   "(DeviceMesh.create(staging_keep_bytes=...); runtime default 64 MiB)")  # fmt: skip
    p.add_argument("--buffer-pool", type=parse_size, metavar="SIZE",
                   help="runtime knob: idle bytes of freed shards each device keeps for reuse "
                   "(DeviceMesh.create(buffer_pool_bytes=...); runtime default 256 MiB; 0 disables)")  # fmt: skip
    p.add_argument("--no-shared-memory", action="store_true",
                   help="reshard(shared_memory=False): every slice through the backend, none pulled through "
                   "shared memory (the path between machines)")  # fmt: skip
    p.add_argument("--backend", choices=("gloo", "nccl"),
                   help="communicator backend of the device pool (default: nccl when Ray reports a GPU per "
                   "device, else gloo); with nccl the raw-gloo ceiling is skipped")  # fmt: skip
    args = p.parse_args(argv)
    if args.backend == "nccl":
        args.no_ceiling = True
    if args.quick:
        args.sizes = args.sizes or ",".join(QUICK_SIZES)
        args.repeats = args.repeats or 2
    args.size_list = [parse_size(s) for s in (args.sizes or ",".join(DEFAULT_SIZES)).split(",") if s.strip()]
    args.case_list = select_cases([c.strip() for c in args.cases.split(",")] if args.cases else None)
    if args.repeats is not None and args.repeats < 1:
        p.error("--repeats must be at least 1")
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


def verify(tensor, source) -> tuple[bool, str]:
    """Every device's shard of ``tensor`` equals, bit for bit, its region of ``source``."""
    import numpy as np

    from reshard.regions import layout_regions

    regions = layout_regions(tensor.layout, tuple(source.shape))
    shards = tensor.local_shards()
    uint = np.dtype(f"u{source.dtype.itemsize}") if source.dtype.itemsize in (1, 2, 4, 8) else None
    for i, box in enumerate(regions):
        expected = source[tuple(slice(lo, hi) for lo, hi in box)]
        got = shards[i]
        if tuple(got.shape) != tuple(expected.shape) or got.dtype != expected.dtype:
            return (
                False,
                f"device {tensor.mesh.device_ids[i]}: got {got.dtype}{list(got.shape)}, "
                f"want {expected.dtype}{list(expected.shape)}",
            )
        same = (
            np.array_equal(got.view(uint), expected.view(uint)) if uint is not None else np.array_equal(got, expected)
        )
        if not same:
            bad = int(np.count_nonzero(got.view(uint) != expected.view(uint))) if uint is not None else -1
            return False, f"device {tensor.mesh.device_ids[i]}: {bad} of {expected.size} elements differ"
    return True, f"{len(regions)} shards bit-exact"


def pair_bytes(plan) -> dict[tuple[int, int], int]:
    """(sender, receiver) -> bytes that cross between the two actors in ``plan``."""
    from reshard.plan import TransferKind

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
    from reshard.program import Copy, Pull, op_numel, writes

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
            if op.staging is not None:
                out["staged_bytes"] += n
            if writes(op) is not None:
                out["recv_bytes"] += n
    return out


def _git_rev() -> str:
    try:
        root = Path(__file__).resolve().parent.parent
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "bench", "reshard", "topology"],
            cwd=root, capture_output=True, text=True, timeout=5,
        ).stdout.strip()  # fmt: skip
        return (rev.stdout.strip() or "unknown") + ("+dirty" if dirty else "")
    except Exception:
        return "unknown"


# ------------------------------------------------------------------------------------ the suite


class Suite:
    """The device pool, its mesh views and the ceiling's store, for one run."""

    def __init__(self, args, console, progress=None, task=None, pool=None):
        import torch.distributed as dist

        from reshard import DeviceMesh

        self.args = args
        self.console = console
        self.progress = progress
        self.task = task
        self.owns_pool = pool is None
        options = {}
        if getattr(args, "staging_keep", None) is not None:
            options["staging_keep_bytes"] = args.staging_keep
        if getattr(args, "buffer_pool", None) is not None:
            options["buffer_pool_bytes"] = args.buffer_pool
        if getattr(args, "backend", None) is not None:
            options["backend"] = args.backend
        self.pool = DeviceMesh.create(POOL_SHAPE, startup_timeout_s=180, **options) if pool is None else pool
        if tuple(self.pool.shape) != POOL_SHAPE:
            raise ValueError(f"the local suite needs a pool mesh of shape {POOL_SHAPE}, got {self.pool!r}")
        _check_host_pattern(MeshView(POOL_SHAPE, tuple(range(POOL_SIZE)), POOL_HOST_IDS), self.pool)
        self.views: dict[MeshView, object] = {}
        self.store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False,
                                   timeout=_dt.timedelta(seconds=120))  # fmt: skip
        self.ceiling_groups: set[str] = set()

    def close(self) -> None:
        from bench import ceiling

        for key in self.ceiling_groups:
            try:
                self.call_each({d: (ceiling.teardown, (key,), {}) for d in self.pool.device_ids}, 30.0)
            except Exception:
                pass
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
        from reshard.runtime.driver import runtime

        return runtime().call(calls, timeout_s, "bench")

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
        up on this case (plan caching for other shapes is done here, untimed);
        ``checked``: methods whose result was already verified (the first result of each
        method not in it is verified, outside its timing)."""
        import ray

        from bench import ceiling
        from reshard import Layout, distribute, reshard
        from reshard.runtime import lowered_reshard
        from reshard.runtime.driver import runtime

        args = self.args
        shape = case.shape_for(size_bytes, args.dtype)
        source = make_array(shape, args.dtype, args.seed)
        tensor_bytes = int(source.nbytes)
        src_mesh, dst_mesh = self.bind(case.src), self.bind(case.dst)
        src_layout = Layout(src_mesh, case.src_placements)
        dst_layout = Layout(dst_mesh, case.dst_placements)
        devices = sorted(set(src_mesh.device_ids) | set(dst_mesh.device_ids))
        actors = self.actors(devices)
        x = distribute(source, src_layout, timeout_s=args.timeout)
        label = f"{case.name} {fmt_size(size_bytes)}"

        # What reshard will run for this shape, planned and lowered before any timing (its caches).
        shared_memory = not getattr(args, "no_shared_memory", False)
        lowered = {s: lowered_reshard(x, dst_layout, strategy=s, shared_memory=shared_memory) for s in strategies}
        plans = {s: low.plan for s, low in lowered.items()}
        default = "auto" if "auto" in strategies else strategies[0]
        pairs = pair_bytes(plans[default])
        entry: dict = {
            "case": case.name,
            "what": case.what,
            "layouts": str(case),
            "src": str(src_layout),
            "dst": str(dst_layout),
            "size_bytes": size_bytes,
            "tensor_bytes": tensor_bytes,
            "shape": list(shape),
            "dtype": args.dtype,
            "devices": len(devices),
            "repeats": repeats,
            "moved_bytes": sum(pairs.values()),
            "methods": {},
        }
        for s, plan in plans.items():
            moved = sum(pair_bytes(plan).values())
            entry["methods"][s] = {
                "kind": "strategy",
                "transfers": len(plan.transfers),
                "moved_bytes": moved,
                **program_bytes(lowered[s].program, source.dtype.itemsize),
            }
        if not args.no_naive:
            entry["methods"][NAIVE] = {"kind": "baseline"}
        if not args.no_ceiling:
            entry["methods"][CEILING] = {"kind": "ceiling", "pairs": len(pairs), "moved_bytes": sum(pairs.values()),
                                         "plan": default}  # fmt: skip
        entry["methods"][RTT] = {"kind": "rtt", "actors": len(devices)}

        # ---- method runners: run(check) -> seconds (a list for RTT); check: verify the result
        breakdown: dict[str, list[dict]] = {s: [] for s in strategies}

        def run_strategy(strategy: str, check: bool) -> float:
            runtime().last_run = {}
            t0 = time.perf_counter()
            y = reshard(x, src_mesh, dst_layout, strategy=strategy, timeout_s=args.timeout, shared_memory=shared_memory)
            dt = time.perf_counter() - t0
            if runtime().last_run:
                breakdown[strategy].append(_split(dt, runtime().last_run))
            if check:
                _record_check(entry["methods"][strategy], y, source)
            y.free()
            return dt

        def run_naive(check: bool) -> float:
            t0 = time.perf_counter()
            full = x.to_numpy(timeout_s=args.timeout)
            y = distribute(full, dst_layout, timeout_s=args.timeout)
            dt = time.perf_counter() - t0
            del full
            if check:
                _record_check(entry["methods"][NAIVE], y, source)
            y.free()
            return dt

        raw = ceiling.RawTransfer(case.name, pairs, self.call_each, self.store.port, args.timeout)
        in_actor = raw.in_actor

        def run_ceiling(check: bool) -> float:
            return raw.run()

        def run_rtt(check: bool) -> list[float]:
            out = []
            for _ in range(RTT_PER_ROUND):
                t0 = time.perf_counter()
                ray.get([a.reshard_ping.remote() for a in actors], timeout=60)
                out.append(time.perf_counter() - t0)
            return out

        runners: dict = {s: (lambda check, s=s: run_strategy(s, check)) for s in strategies}
        if not args.no_naive:
            runners[NAIVE] = run_naive
        if not args.no_ceiling and pairs:
            raw.setup()  # join the raw group (once per device set), allocate send buffers: untimed
            self.ceiling_groups.add(raw.key)
            runners[CEILING] = run_ceiling
        elif not args.no_ceiling:
            entry["methods"][CEILING]["error"] = "nothing crosses between actors"
        runners[RTT] = run_rtt

        samples: dict[str, list[float]] = {m: [] for m in runners}
        failed: set[str] = set()

        def attempt(m: str, timed: bool, check: bool) -> None:
            if m in failed:
                return
            try:
                out = runners[m](check)
                if timed:
                    samples[m] += out if isinstance(out, list) else [out]
                else:
                    entry["methods"][m]["warmup_s"] = out[0] if isinstance(out, list) else out
            except Exception as e:  # record and go on: one broken strategy must not sink the suite
                failed.add(m)
                entry["methods"][m]["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                if m not in (CEILING, RTT):
                    entry["methods"][m]["verified"] = False

        stats = runtime().stats
        try:
            for m in runners:  # warm-up once per (case, method), and again for communicator groups not used yet
                wkey = CEILING + raw.key if m == CEILING else m
                new_groups = [("group", g) for g in lowered[m].groups] if m in lowered else []
                if wkey not in warmed or not warmed.issuperset(new_groups):
                    warmed.update(new_groups)
                    self.advance(f"{label} warm-up {m}")
                    attempt(m, False, m in (NAIVE, *strategies))
                    checked.add(m)
                    warmed.add(wkey)
                    breakdown.get(m, []).clear()
                    if m == CEILING:
                        in_actor.clear()
                else:
                    self.advance(None)
            created = stats["groups_created"]
            for r in range(repeats):
                for m in runners:
                    self.advance(f"{label} round {r + 1}/{repeats} {m}")
                    check = m in (NAIVE, *strategies) and m not in checked
                    attempt(m, True, check)
                    checked.add(m)
        finally:
            x.free()
            if raw.key in self.ceiling_groups:
                try:
                    raw.release()
                except Exception:
                    pass

        # communicators the runtime had to (re-)create inside timed rounds (cache evictions)
        entry["groups_created_timed"] = stats["groups_created"] - created
        for m, vals in samples.items():
            if vals:
                entry["methods"][m]["latency_s"] = stats_of(vals)
        for m, parts in breakdown.items():
            if parts:
                entry["methods"][m]["breakdown_s"] = {k: _median([p[k] for p in parts]) for k in parts[0]}
        if in_actor:
            entry["methods"][CEILING]["in_actor_s"] = stats_of(in_actor)
        derive_ratios(entry)
        for m, v in entry["methods"].items():
            if v["kind"] in ("strategy", "baseline") and "verified" not in v and m in checked:
                v["verified_earlier"] = True  # --quick: this method's result was verified at a smaller size
        entry["ok"] = all(
            (v.get("verified") is True or v.get("verified_earlier", False)) and "error" not in v
            for v in entry["methods"].values() if v["kind"] in ("strategy", "baseline")
        )  # fmt: skip
        return entry


def _split(wall: float, per_device: dict) -> dict:
    """Where one reshard's wall time went, from the slowest device's point of view.

    ``ray_overhead``: driver wall minus the slowest device's ``run`` (dispatch, argument and result
    transport, the driver's own planning/bookkeeping, gather); ``actor_setup``: run minus program
    (decode, allocate the destination); ``copy_stage``: program minus communication (local copies,
    staging); ``comm``: time inside gloo calls (including waiting for peers)."""
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


def _median(vals: list[float]) -> float:
    v = sorted(vals)
    n = len(v)
    return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2


def _record_check(method: dict, tensor, source) -> None:
    ok, detail = verify(tensor, source)
    method["verified"] = ok
    method["verify_detail"] = detail
    if not ok:
        raise AssertionError(f"result not bit-exact: {detail}")


def _check_host_pattern(view: MeshView, dmesh) -> None:
    """The runtime's hosts must group the view's devices as the case says (up to renaming)."""
    want, got = view.resolved_host_ids, dmesh.host_ids
    if len({(a, b) for a, b in zip(want, got, strict=True)}) != len(set(want)) or len(set(want)) != len(set(got)):
        raise RuntimeError(f"mesh view {view}: runtime hosts {list(got)} do not group devices like {list(want)}")


def derive_ratios(entry: dict) -> None:
    """Effective bandwidth and the ratios the targets speak of, from medians."""
    methods = entry["methods"]

    def med(name):
        m = methods.get(name, {})
        return m.get("latency_s", {}).get("median")

    naive, ceil, rtt = med(NAIVE), med(CEILING), med(RTT)
    for name, m in methods.items():
        t = med(name)
        if t is None or m["kind"] == "rtt":
            continue
        m["eff_GBps"] = entry["tensor_bytes"] / t / 1e9
        if m["kind"] == "strategy":
            if naive:
                m["speedup_vs_naive"] = naive / t
            if ceil:
                m["frac_of_ceiling"] = ceil / t  # = effective bandwidth / ceiling's, same bytes
            if rtt:
                m["x_empty_rtt"] = t / rtt


# ------------------------------------------------------------------------------------ entry point


def main(argv: list[str] | None = None, *, pool=None) -> int:
    """Run the suite; ``pool``: an existing 2x4 DeviceMesh to use instead of starting 8 actors
    (Ray must then be running). Returns 0 when every result was verified bit-exact."""
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    import ray
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from bench import report
    from reshard import STRATEGIES

    console = Console()
    strategies = list(STRATEGIES)
    if args.strategies:
        wanted = [s.strip() for s in args.strategies.split(",") if s.strip()]
        unknown = [s for s in wanted if s not in STRATEGIES]
        if unknown:
            console.print(f"[red]unknown strategies {unknown}; registered: {', '.join(STRATEGIES)}")
            return 2
        strategies = wanted
    started_ray = False
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        started_ray = True
    t_start = time.time()
    when = _dt.datetime.now()
    load_start = os.getloadavg()
    entries: list[dict] = []
    n_methods = len(strategies) + 1 + (not args.no_naive) + (not args.no_ceiling)
    total = sum(n_methods * (1 + (args.repeats or default_repeats(s))) for s in args.size_list) * len(args.case_list)
    console = Console(width=max(console.width, 150)) if not console.is_terminal else console
    suite = None
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
            suite = Suite(args, console, progress, task, pool=pool)
            for case in args.case_list:
                warmed: set = set()
                checked: set[str] = set()  # --quick: verify once per case; else once per size
                for size in sorted(args.size_list):
                    if not args.quick:
                        checked = set()
                    repeats = args.repeats or default_repeats(size)
                    entries.append(suite.run(case, size, strategies, repeats, warmed, checked))
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
        "command": "python -m bench " + " ".join(argv if argv is not None else sys.argv[1:]),
        "git": _git_rev(),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "loadavg_start": list(load_start),
            "loadavg_end": list(os.getloadavg()),
            "ray": ray.__version__,
            "torch": _torch_version(),
        },  # fmt: skip
        "pool": list(POOL_SHAPE),
        "staging_keep_bytes": args.staging_keep,
        "buffer_pool_bytes": getattr(args, "buffer_pool", None),
        "shared_memory": not getattr(args, "no_shared_memory", False),
        "dtype": args.dtype,
        "sizes": args.size_list,
        "cases": [c.name for c in args.case_list],
        "strategies": strategies,
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
