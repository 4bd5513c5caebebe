"""Paper-scale microbenchmarks by simulation: ``python -m bench --simulate [options]``.

Reproduces the single-sender suite of "On Optimizing the Communication of Model Parallelism"
(section 5.1.1: a 1x1 source mesh broadcasting a replicated tensor to 1x1..1x4 and 2x2..4x2
meshes) and its eight multi-sender cases (the paper's table) on a simulated cluster
(``topology.Cluster`` presets, ``topology.simulator``). For every case and strategy it reports
the simulated latency, the effective bandwidth (tensor bytes / latency) and the ratio to the fluid
lower bound (``reshard.ir.cost``), as rich tables, a JSON file and a PNG bar chart in ``--out``.
``--planning-time`` measures planning times (paper cases cold, cached, and 1024 -> 1024 device
reshards); ``--random N`` adds statistics over N random cases.

Pure apart from rich and matplotlib (Agg): runs anywhere, no Ray, no GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench.provenance import header
from reshard import STRATEGIES, Layout, Replicate, Shard, plan_reshard
from reshard.ir.target import window_ops_for
from reshard.ir.tasks import plan_unit_tasks
from reshard.planner import clear_plan_cache
from topology import PRESETS, Cluster

R = Replicate()
BASELINES = ("send_recv", "allgather", "broadcast", "broadcast_size", "broadcast_order")
STRATEGY_ORDER = (*BASELINES, "auto")
LABELS = {
    "send_recv": "Send/Recv",
    "allgather": "Alpa (scatter + all-gather)",
    "broadcast": "Broadcast, no load balance",
    "broadcast_size": "Broadcast, size balance",
    "broadcast_order": "Broadcast, order balance (paper)",
    "auto": "auto (ours)",
}
SHORT = {
    "send_recv": "send/recv",
    "allgather": "allgather",
    "broadcast": "bcast",
    "broadcast_size": "bcast+size",
    "broadcast_order": "bcast+order",
    "auto": "auto",
}
COLORS = {
    "send_recv": "#c7c7c7",
    "allgather": "#9ecae1",
    "broadcast": "#fdd0a2",
    "broadcast_size": "#fdae6b",
    "broadcast_order": "#e6550d",
    "auto": "#2c7fb8",
}
MULTI = {
    1: "dim0 on H, R(host) -> same",
    2: "fully replicated -> dim0 on H, R(host)",
    3: "dim1 on H, R(host) -> dim0 on H, R(host)",
    4: "dim1 flat -> dim0 flat",
    5: "dim0 over devices-in-host, R over hosts -> dim0 on H, R(host)",
    6: "dim0 on H -> dim0 split 3 on H (3072x1024x170)",
    7: "1xD dim0 over devices -> fully replicated",
    8: "dim1 on H, R(host) -> dim2 on H, R(host)",
}


@dataclass(frozen=True)
class Case:
    suite: str
    name: str
    what: str
    shape: tuple[int, ...]
    src: Layout
    dst: Layout
    dtype: str = "int32"

    @property
    def size_bytes(self) -> int:
        return math.prod(self.shape) * 4


def paper_cases(cluster: Cluster, hosts: int = 2, size_single: int = 1 << 30, size_multi: int = 2 << 30):
    """The paper's cases on ``cluster``; ``hosts`` = hosts of the multi-sender meshes (paper: 2).

    Meshes of one case use disjoint hosts, source first (host 0, 1, ...). D = devices per host.
    """
    d = cluster.devices_per_host
    out: list[Case] = []
    src1 = cluster.mesh((1, 1), hosts=[0])
    single_shape = (size_single // 4,)
    for k in range(1, d + 1):
        dst = cluster.mesh((1, k), hosts=[1])
        out.append(Case("single", f"1x{k}", f"1x1 -> 1x{k} replicated", single_shape, _rep(src1), _rep(dst)))
    for n in range(2, max(4, hosts) + 1):
        dst = cluster.mesh((n, 2), hosts=range(1, n + 1))
        out.append(Case("single", f"{n}x2", f"1x1 -> {n}x2 replicated", single_shape, _rep(src1), _rep(dst)))
    shape = _multi_shape(size_multi)
    src, dst = cluster.mesh((hosts, d), hosts=range(hosts)), cluster.mesh((hosts, d), hosts=range(hosts, 2 * hosts))
    pairs = {
        1: ((Shard(0), R), (Shard(0), R)),
        2: ((R, R), (Shard(0), R)),
        3: ((Shard(1), R), (Shard(0), R)),
        4: ((Shard(1), Shard(1)), (Shard(0), Shard(0))),
        5: ((R, Shard(0)), (Shard(0), R)),
        8: ((Shard(1), R), (Shard(2), R)),
    }
    for k in range(1, 9):
        if k == 6:
            dst6 = cluster.mesh((hosts + 1, d), hosts=range(hosts, 2 * hosts + 1))
            case = ((Shard(0), R), (Shard(0), R))
            out.append(
                Case("multi", "case 6", MULTI[6], _case6_shape(size_multi), Layout(src, case[0]), Layout(dst6, case[1]))
            )
            continue
        if k == 7:
            src7, dst7 = cluster.mesh((1, d), hosts=[0]), cluster.mesh((hosts, d), hosts=range(1, hosts + 1))
            out.append(Case("multi", "case 7", MULTI[7], shape, Layout(src7, (R, Shard(0))), _rep(dst7)))
            continue
        s, t = pairs[k]
        out.append(Case("multi", f"case {k}", MULTI[k], shape, Layout(src, s), Layout(dst, t)))
    return out


def _rep(mesh) -> Layout:
    return Layout.replicated(mesh)


def _multi_shape(size_bytes: int) -> tuple[int, int, int]:
    numel = max(1, size_bytes // 4)
    if numel >= 1 << 20:
        return (1024, 1024, max(1, numel >> 20))
    return (64, 64, max(1, numel // 4096))


def _case6_shape(size_bytes: int) -> tuple[int, int, int]:
    numel = max(1, size_bytes // 4)
    if numel >= 3072 * 1024:
        return (3072, 1024, numel // (3072 * 1024))  # 2 GiB: 3072 x 1024 x 170, as in the paper
    return (192, 64, max(1, numel // (192 * 64)))


def required_hosts(hosts: int) -> int:
    return max(2 * hosts + 1, max(4, hosts) + 1)


# ---------------------------------------------------------------------------------------------
# measuring


def evaluate(case: Case, cluster: Cluster, strategies=STRATEGY_ORDER) -> dict:
    """Every strategy's simulated latency, bandwidth, ratio to the bound, transfers, groups."""
    out = {}
    lb = None
    for name in strategies:
        t0 = time.perf_counter()
        plan = plan_reshard(case.shape, case.dtype, case.src, case.dst, strategy=name, cluster=cluster)
        plan_s = time.perf_counter() - t0
        if lb is None:
            lb = plan.lower_bound_s(cluster)
        sim = plan.simulate(cluster)
        groups = {tuple(sorted(t.group)) for t in plan.transfers if len(t.group) > 1}
        out[name] = {
            "latency_s": sim.makespan_s,
            "bandwidth_GBps": case.size_bytes / sim.makespan_s / 1e9 if sim.makespan_s else math.inf,
            "ratio": sim.makespan_s / lb if lb else 1.0,
            "transfers": len(plan.transfers),
            "groups": len(groups),
            "network_bytes": sim.network_bytes,
            "planning_s": plan_s,
        }
    return {
        "suite": case.suite,
        "name": case.name,
        "what": case.what,
        "shape": list(case.shape),
        "dtype": case.dtype,
        "size_bytes": case.size_bytes,
        "src": str(case.src),
        "dst": str(case.dst),
        "lower_bound_s": lb,
        "lower_bound_GBps": case.size_bytes / lb / 1e9 if lb else math.inf,
        "strategies": out,
    }


def planning_times(cluster_name: str, hosts: int, reps: int = 5) -> dict:
    """Cold planning time of auto on every paper case, cached lookups, and 1024 -> 1024 reshards.

    Times are CPU seconds of this process (``time.process_time``), median of ``reps``, so that a
    busy machine does not inflate them; wall seconds alongside.
    """
    cluster = Cluster.preset(cluster_name, required_hosts(hosts))
    out: dict = {"paper_cold": {}, "cached_us": {}, "large": {}}
    for case in paper_cases(cluster, hosts):
        cpu, wall = _cold(case.shape, case.src, case.dst, cluster, reps)
        out["paper_cold"][f"{case.suite} {case.name}"] = {"cpu_s": cpu, "wall_s": wall}
        plan_reshard(case.shape, case.dtype, case.src, case.dst, cluster=cluster)
        n = 20000
        t0 = time.process_time()
        for _ in range(n):
            plan_reshard(case.shape, case.dtype, case.src, case.dst, cluster=cluster)
        out["cached_us"][f"{case.suite} {case.name}"] = (time.process_time() - t0) / n * 1e6
    per_host = PRESETS[cluster_name][0]
    n_hosts = 1024 // per_host
    big = Cluster.preset(cluster_name, 2 * n_hosts)
    src = big.mesh((n_hosts, per_host), hosts=range(n_hosts))
    dst = big.mesh((n_hosts, per_host), hosts=range(n_hosts, 2 * n_hosts))
    shape = (1 << 14, 1 << 12, 64)  # 16 GiB of int32
    for name, (s, t) in {
        "dim0 on H -> dim0 on H": ((Shard(0), R), (Shard(0), R)),
        "R -> dim0 on H": ((R, R), (Shard(0), R)),
        "dim0 on H -> dim0 flat": ((Shard(0), R), (Shard(0), Shard(0))),
        "dim1 on H -> dim0 on H": ((Shard(1), R), (Shard(0), R)),
        "(S0,S1) -> (S1,S0)": ((Shard(0), Shard(1)), (Shard(1), Shard(0))),
    }.items():
        src_l, dst_l = Layout(src, s), Layout(dst, t)
        cpu, wall = _cold(shape, src_l, dst_l, big, 1)
        plan = plan_reshard(shape, "int32", src_l, dst_l, cluster=big)
        out["large"][name] = {
            "devices": f"{src.size} -> {dst.size}",
            "unit_tasks": len(plan.tasks),
            "transfers": len(plan.transfers),
            "cpu_s": cpu,
            "wall_s": wall,
        }
    return out


def _cold(shape, src, dst, cluster, reps) -> tuple[float, float]:
    cpu, wall = [], []
    for _ in range(reps):
        clear_plan_cache()
        c0, w0 = time.process_time(), time.perf_counter()
        plan_reshard(shape, "int32", src, dst, cluster=cluster)
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    return statistics.median(cpu), statistics.median(wall)


def random_case(rng: random.Random, cluster: Cluster, *, min_log2=26, max_log2=31):
    """A random reshard: meshes of up to 8 hosts x min(8, D) devices, random placements, an uneven
    shape of 2**min_log2..2**max_log2 bytes (float32), on disjoint hosts, shared hosts, or
    overlapping host sets. Returns (kind, shape, src layout, dst layout)."""
    per = cluster.devices_per_host
    kind = rng.choice(("disjoint", "shared", "overlap"))
    if kind == "disjoint":
        pool = rng.sample(range(16), 16)
        pools = (pool[:8], pool[8:])
    elif kind == "shared":
        pool = rng.sample(range(16), 8)
        pools = (pool, pool)
    else:
        pools = (list(range(8)), list(range(4, 12)))
    ndim = rng.randint(1, 3)

    def mesh(pool):
        n = rng.randint(1, 8)
        hosts = rng.sample(pool, n)
        k = rng.choice([x for x in (1, 2, 4, 8) if x <= per])
        shape = (n, k) if k < 4 or rng.random() < 0.7 else (n, 2, k // 2)
        return cluster.mesh(shape, hosts=hosts, devices=rng.sample(range(per), k))

    def layout(m):
        return Layout(m, tuple(rng.choice((R, Shard(rng.randrange(ndim)))) for _ in m.shape))

    dims = [rng.choice((rng.randint(1, 64), rng.randint(64, 1500))) for _ in range(ndim)]
    scale = (2 ** rng.uniform(min_log2, max_log2) / 4 / math.prod(dims)) ** (1 / ndim)
    shape = tuple(max(1, int(n * scale)) for n in dims)
    return kind, shape, layout(mesh(pools[0])), layout(mesh(pools[1]))


def random_stats(cluster_name: str, n: int, seed: int = 0, backend: str | None = None, **size) -> dict:
    """auto vs the baselines and the bound over ``n`` random cases on a 16-host ``cluster_name``
    (with ``backend``'s collectives and issue windows, default the preset's). Also auto's plans
    with every device issuing one message at a time (``auto_one_at_a_time``), where the backend
    issues windows."""
    cluster = Cluster.preset(cluster_name, 16)
    if backend is not None:
        cluster = dataclasses.replace(cluster, backend=backend)
    window = window_ops_for(cluster.backend)
    rng = random.Random(seed)
    rows: list[dict] = []
    while len(rows) < n:
        kind, shape, src, dst = random_case(rng, cluster, **size)
        if not plan_unit_tasks(shape, 4, src, dst):
            continue
        times = {}
        for name in STRATEGY_ORDER:
            plan = plan_reshard(shape, "float32", src, dst, strategy=name, cluster=cluster)
            times[name] = plan.simulate(cluster).makespan_s
        lb = plan.lower_bound_s(cluster)
        if window > 1:
            times["auto_one_at_a_time"] = plan.simulate(cluster, window=1).makespan_s
        rows.append({"kind": kind, "shape": list(shape), "src": str(src), "dst": str(dst), "lb": lb, **times})
    stats = {
        "cluster": cluster_name,
        "backend": cluster.backend,
        "window_ops": window,
        "cases": n,
        "seed": seed,
        "log2_bytes": [size.get("min_log2", 26), size.get("max_log2", 31)],
    }
    for name in [*STRATEGY_ORDER, *(["auto_one_at_a_time"] if window > 1 else [])]:
        ratios = [r[name] / r["lb"] for r in rows]
        stats[name] = {"geomean_ratio": _geomean(ratios), "max_ratio": max(ratios)}
    vs_best = [r["auto"] / min(r[b] for b in BASELINES) for r in rows]
    stats["auto_vs_best_baseline"] = {"max": max(vs_best), "geomean": _geomean(vs_best)}
    for kind in ("disjoint", "shared", "overlap"):
        ratios = [r["auto"] / r["lb"] for r in rows if r["kind"] == kind]
        if ratios:
            stats[f"auto_{kind}"] = {"cases": len(ratios), "geomean_ratio": _geomean(ratios), "max_ratio": max(ratios)}
    worst = max(rows, key=lambda r: r["auto"] / r["lb"])
    stats["worst"] = {k: worst[k] for k in ("kind", "shape", "src", "dst")} | {"ratio": worst["auto"] / worst["lb"]}
    return stats


def _geomean(xs) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


# ---------------------------------------------------------------------------------------------
# reporting


def print_tables(results: list[dict], title: str) -> None:
    from rich.table import Table

    console = _console()
    console.rule(title)
    for r in results:
        table = Table(
            title=f"{r['suite']}-sender {r['name']}: {r['what']} ({_fmt_bytes(r['size_bytes'])})\n"
            f"{r['src']} -> {r['dst']}",
            title_justify="left",
        )
        for col in ("strategy", "latency", "bandwidth", "vs bound", "transfers", "groups"):
            table.add_column(col, justify="left" if col == "strategy" else "right")
        best = min(s["latency_s"] for s in r["strategies"].values())
        for name, s in r["strategies"].items():
            style = "bold green" if s["latency_s"] <= best * (1 + 1e-9) else None
            table.add_row(
                LABELS.get(name, name),
                _fmt_s(s["latency_s"]),
                f"{s['bandwidth_GBps']:.3f} GB/s",
                f"{s['ratio']:.3f}x",
                str(s["transfers"]),
                str(s["groups"]),
                style=style,
            )
        table.add_row("lower bound", _fmt_s(r["lower_bound_s"]), f"{r['lower_bound_GBps']:.3f} GB/s", "1.000x", "", "")
        console.print(table)
    summary = Table(title="ratio to the lower bound (simulated latency / bound)", title_justify="left")
    summary.add_column("case")
    for name in STRATEGY_ORDER:
        summary.add_column(SHORT[name], justify="right")
    for r in results:
        cells = [f"{r['strategies'][n]['ratio']:.3f}" if n in r["strategies"] else "" for n in STRATEGY_ORDER]
        summary.add_row(f"{r['suite']} {r['name']}", *cells)
    console.print(summary)


def plot(results: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    suites = [("single", "Single sender (1 GiB, 1x1 source)"), ("multi", "Multiple senders (the paper's cases)")]
    fig, axes = plt.subplots(1, 2, figsize=(15, 4.8), gridspec_kw={"width_ratios": [1, 1.15]}, constrained_layout=True)
    names = [n for n in STRATEGY_ORDER if any(n in r["strategies"] for r in results)]
    width = 0.8 / len(names)
    for ax, (suite, label) in zip(axes, suites, strict=True):
        rows = [r for r in results if r["suite"] == suite]
        if not rows:
            ax.set_visible(False)
            continue
        for k, name in enumerate(names):
            xs = [i - 0.4 + width * (k + 0.5) for i in range(len(rows))]
            ys = [r["strategies"][name]["bandwidth_GBps"] for r in rows]
            ax.bar(xs, ys, width, color=COLORS[name], edgecolor="#444444", linewidth=0.4, label=LABELS[name])
        for i, r in enumerate(rows):
            ax.hlines(r["lower_bound_GBps"], i - 0.42, i + 0.42, colors="black", linewidth=1.6, label="_")
        ax.hlines([], 0, 0, colors="black", linewidth=1.6, label="fluid lower bound (best possible)")
        ax.set_xticks(range(len(rows)), [r["name"].replace("case ", "") for r in rows])
        ax.set_xlabel("destination mesh" if suite == "single" else "case")
        ax.set_ylabel("effective bandwidth, GB/s (higher is better)")
        ax.set_title(label, fontsize=11)
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
        ax.spines[["top", "right"]].set_visible(False)
    handles, labels = axes[1].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=4, frameon=False, fontsize=9)
    fig.suptitle(title, fontsize=12)
    fig.savefig(path, dpi=150)
    plt.close(fig)


def _console():
    from rich.console import Console

    console = Console()
    if not console.is_terminal:
        console = Console(width=150)
    return console


def _fmt_s(s: float) -> str:
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} us"


def _fmt_bytes(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"


def parse_size(text: str) -> int:
    """'1GiB', '64MiB', '512KiB', '1G', '4096' (bytes) -> bytes."""
    t = text.strip().lower().replace(" ", "")
    units = {
        "gib": 1 << 30,
        "g": 1 << 30,
        "gb": 1 << 30,
        "mib": 1 << 20,
        "m": 1 << 20,
        "mb": 1 << 20,
        "kib": 1 << 10,
        "k": 1 << 10,
        "kb": 1 << 10,
        "b": 1,
        "": 1,
    }
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num) :]
    if not num or unit not in units:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: use e.g. 1GiB, 64MiB, 512KiB")
    return int(float(num) * units[unit])


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench --simulate", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--cluster", default="p3.8xlarge", choices=[*PRESETS, "all"], help="cluster preset (default p3.8xlarge)"
    )
    ap.add_argument("--hosts", type=int, default=2, help="hosts per multi-sender mesh (paper: 2)")
    ap.add_argument("--size", type=parse_size, help="tensor size (default: 1GiB single sender, 2GiB multi-sender)")
    ap.add_argument("--out", type=Path, default=Path("bench/results"), help="output directory (default bench/results)")
    ap.add_argument("--suite", choices=("single", "multi", "all"), default="all")
    ap.add_argument("--strategies", nargs="+", default=list(STRATEGY_ORDER), choices=sorted(STRATEGIES))
    ap.add_argument("--planning-time", action="store_true", help="measure planning times instead")
    ap.add_argument("--random", type=int, default=0, metavar="N", help="also: statistics over N random cases")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--random-backend",
        choices=("nccl", "gloo"),
        help="random cases with this backend (default: the preset's, nccl)",
    )
    ap.add_argument(
        "--random-log2",
        type=int,
        nargs=2,
        default=(26, 31),
        metavar=("LO", "HI"),
        help="random tensor sizes between 2**LO and 2**HI bytes (default 26 31: 64 MiB to 2 GiB)",
    )
    args = ap.parse_args(argv)
    if args.hosts < 1:
        ap.error("--hosts must be >= 1")
    args.out.mkdir(parents=True, exist_ok=True)
    clusters = list(PRESETS) if args.cluster == "all" else [args.cluster]
    for name in clusters:
        tag = f"{name}_{args.hosts}hosts" + (f"_{args.size}B" if args.size else "")
        if args.planning_time:
            times = planning_times(name, args.hosts)
            _print_planning(times, name)
            planning = {**header("python -m bench --simulate", argv), "times": times}
            (args.out / f"planning_{name}.json").write_text(json.dumps(planning, indent=1))
            continue
        cluster = Cluster.preset(name, required_hosts(args.hosts))
        sizes = {} if args.size is None else {"size_single": args.size, "size_multi": args.size}
        cases = [c for c in paper_cases(cluster, args.hosts, **sizes) if args.suite in ("all", c.suite)]
        results = [evaluate(c, cluster, args.strategies) for c in cases]
        title = f"Cross-mesh resharding, simulated on {args.hosts}-host meshes of {name} ({cluster})"
        print_tables(results, title)
        report = {
            **header("python -m bench --simulate", argv),
            "cluster": _cluster_obj(cluster),
            "hosts": args.hosts,
            "cases": results,
        }
        if args.random:
            lo, hi = args.random_log2
            report["random"] = random_stats(name, args.random, args.seed, args.random_backend, min_log2=lo, max_log2=hi)
            _print_random(report["random"])
        (args.out / f"simulated_{tag}.json").write_text(json.dumps(report, indent=1))
        plot(
            results,
            args.out / f"simulated_{tag}.png",
            f"Cross-mesh resharding on {name} (simulated, {args.hosts}-host meshes)",
        )
        print(f"wrote {args.out / f'simulated_{tag}.json'} and .png")
    return 0


def _cluster_obj(c: Cluster) -> dict:
    return {
        "name": c.name,
        "num_hosts": c.num_hosts,
        "devices_per_host": c.devices_per_host,
        "nic_GBps": c.nic_GBps,
        "intra_host_GBps": c.intra_host_GBps,
        "latency_us": c.latency_us,
        "backend": c.backend,
    }


def _print_planning(t: dict, name: str) -> None:
    from rich.table import Table

    console = _console()
    table = Table(title=f"auto planning time on {name} (CPU time, median)", title_justify="left")
    for col in ("case", "cold", "wall", "cached"):
        table.add_column(col, justify="right")
    for case, v in t["paper_cold"].items():
        table.add_row(
            case, f"{v['cpu_s'] * 1e3:.2f} ms", f"{v['wall_s'] * 1e3:.2f} ms", f"{t['cached_us'][case]:.1f} us"
        )
    console.print(table)
    table = Table(title="1024 -> 1024 devices (16 GiB int32)", title_justify="left")
    for col in ("reshard", "devices", "unit tasks", "transfers", "cold CPU", "cold wall"):
        table.add_column(col, justify="right")
    for case, v in t["large"].items():
        table.add_row(
            case, v["devices"], str(v["unit_tasks"]), str(v["transfers"]), f"{v['cpu_s']:.3f} s", f"{v['wall_s']:.3f} s"
        )
    console.print(table)


def _print_random(s: dict) -> None:
    from rich.table import Table

    lo, hi = s["log2_bytes"]
    title = (
        f"{s['cases']} random cases on {s['cluster']}, {s['backend']}, windows of {s['window_ops']} "
        f"(seed {s['seed']}, 2**{lo} to 2**{hi} bytes)"
    )
    table = Table(title=title, title_justify="left")
    for col in ("strategy", "geomean vs bound", "max vs bound"):
        table.add_column(col, justify="right")
    labels = LABELS | {"auto_one_at_a_time": "auto's plans, one message at a time"}
    for name in (*STRATEGY_ORDER, "auto_one_at_a_time"):
        if name in s:
            table.add_row(labels[name], f"{s[name]['geomean_ratio']:.3f}", f"{s[name]['max_ratio']:.3f}")
    _console().print(table)
    vs = s["auto_vs_best_baseline"]
    print(f"auto / best baseline: max {vs['max']:.4f}, geomean {vs['geomean']:.4f}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
