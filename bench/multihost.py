"""``python -m bench multihost``: reshards between Ray nodes on emulated hosts with shaped NICs,
measured against the simulator and the fluid lower bound on the PROBED cluster.

The suite brings up ``--hosts`` emulated hosts (``bench.emulate``: a network namespace and a Ray
node each, every NIC shaped full duplex to ``--nic-gbit``), measures the raw network there (TCP
round trip and one stream between two hosts, an empty Ray actor call from the head to host 1),
then runs a driver inside the head namespace that

* places three meshes with ``DeviceMesh.create(nodes=...)``: ``A`` = 2 hosts x 2 devices on hosts
  0 and 1, ``B`` = 2 x 2 on hosts 2 and 3, and ``C``, a 3 x 2 view over A's host-1 devices and B
  (a mesh size change onto partly the same devices: slices between actors of host 1 are pulled
  through shared memory);
* probes the links between the meshes' nodes (``reshard.runtime.probe_links``); every
  reshard is planned for, simulated on and bounded with that probed cluster;
* per case and size distributes one random tensor and runs every strategy once untimed (groups
  and programs set up) with its result checked bit-exact on every destination device (a SHA-256 of
  each shard, computed on the device, against the source's region), then ``repeats`` rounds that
  each time every strategy once, interleaved so that load drifting over the run (other work on
  the machine) hits every strategy alike: wall time on the driver from the call until ``reshard``
  returns;
* records ``compiled.simulate(cluster).makespan_s`` (pulls as pulls) and ``plan.lower_bound_s(cluster)`` of the plan
  each strategy ran, and small tensors' latency against one TCP round trip and one Ray call.

Targets, computed from the medians: ``auto`` <= 1.15x the bound at 256 MiB; ``auto`` at
most 3 % slower than any strategy at >= 64 MiB whose plan is not its own (``= auto`` in the table:
the same transfers, so any difference is noise); the simulator within 10 % of every measurement at
>= 64 MiB; small tensors within 3 TCP round trips plus one empty Ray call.

Results: tables on the terminal, JSON in ``bench/results/multihost-<timestamp>.json`` (or
``--out``) and a PNG (``--png``, default ``bench/figures/multihost.png``);
``python -m bench.multihost --report FILE [--markdown]`` re-renders a JSON file (ratios and
targets derived again from its medians). Needs root (see
``bench.emulate``); exits 2 with the reason where hosts cannot be emulated.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

from bench.cases import fmt_size, parse_size, tensor_shape
from bench.provenance import revision_of

RESULTS_DIR = Path(__file__).resolve().parent / "results"
FIGURE = Path(__file__).resolve().parent / "figures" / "multihost.png"
DEFAULT_SIZES = ("64MiB", "256MiB")
SMALL = 64 << 10
BIG = 64 << 20
TARGET_SIZE = 256 << 20
TARGET_X_BOUND = 1.15
TARGET_SLOWER = 0.03
TARGET_SIM_ERROR = 0.10
TARGET_SMALL_RTTS = 3
SCHEMA = 1

# name: (what, source mesh, source placements, destination mesh, destination placements); "S0" =
# Shard(0), "R" = Replicate(). Meshes: A (hosts 0, 1), B (hosts 2, 3), C (3x2 over hosts 1, 2, 3).
CASES = {
    "paper": ("(2 hosts x 2) S(0),R -> (2 x 2) R,S(1) on other hosts", "A", ("S0", "R"), "B", ("R", "S1")),
    "shard-to-rep": ("shard -> replicate: S(0),S(1) -> R,R on other hosts", "A", ("S0", "S1"), "B", ("R", "R")),
    "rep-to-shard": ("replicate -> shard: R,R -> S(0),S(1) on other hosts", "A", ("R", "R"), "B", ("S0", "S1")),
    "grow-2x2-3x2": ("mesh size change 2x2 -> 3x2 over 4 hosts (host 1 in both)", "A", ("S0", "R"), "C", ("S0", "R")),
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench multihost", description=__doc__.split("\n\n")[0])
    p.add_argument("--nic-gbit", type=float, default=1.0, help="NIC rate of every emulated host, Gbit/s (default 1)")
    p.add_argument("--sizes", default=",".join(DEFAULT_SIZES), help="tensor sizes (default 64MiB,256MiB)")
    p.add_argument("--cases", help="comma-separated cases (default all): " + ", ".join(CASES))
    p.add_argument("--strategies", help="comma-separated strategies (default every one in reshard.STRATEGIES)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per strategy and size (default 3)")
    p.add_argument("--small-repeats", type=int, default=30, help="timed runs per strategy at 64 KiB (0: skip)")
    p.add_argument("--probe-size", type=parse_size, default=16 << 20, help="bytes per probe transfer (16MiB)")
    p.add_argument("--timeout", type=float, default=300.0, help="per-reshard timeout in seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="JSON output path (default bench/results/multihost-<timestamp>.json)")
    p.add_argument("--png", default=str(FIGURE), help="figure path ('' for none)")
    p.add_argument("--report", metavar="JSON", help="re-render a results file and exit")
    p.add_argument("--markdown", action="store_true", help="with --report: Markdown tables")
    p.add_argument("--driver", nargs=2, metavar=("CONFIG", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.size_list = sorted(parse_size(s) for s in args.sizes.split(",") if s.strip())
    args.case_list = [c.strip() for c in args.cases.split(",")] if args.cases else list(CASES)
    unknown = [c for c in args.case_list if c not in CASES]
    if unknown:
        p.error(f"unknown case(s) {unknown}; choose from {', '.join(CASES)}")
    if args.repeats < 1 or args.small_repeats < 0:
        p.error("--repeats must be >= 1 and --small-repeats >= 0")
    return args


# ------------------------------------------------------------------------------------ driver side


def shard_digest(ctx, name: str) -> str:
    """On a device actor: SHA-256 of shard ``name``'s bytes."""
    t = ctx.buffers[name].contiguous()
    return hashlib.sha256(memoryview(t.numpy().reshape(-1).view(np.uint8))).hexdigest()


def _placements(names):
    from reshard import Replicate, Shard

    return tuple(Replicate() if n == "R" else Shard(int(n[1:])) for n in names)


def _say(text: str) -> None:
    print(f"[driver {time.strftime('%H:%M:%S')}] {text}", flush=True)


def drive(config: dict) -> dict:
    """Inside the head namespace: place the meshes, probe, run every case (module docstring)."""
    from bench.emulate import connect, host_addresses

    ray = connect()
    from bench.local import make_array, stats_of
    from reshard import DeviceMesh, Layout, distribute
    from reshard.ir.regions import layout_regions
    from reshard.runtime import lowered_reshard, probe_links, runtime
    from topology.cluster import GUESSED_GLOO, Cluster

    addrs = host_addresses()
    _say(f"placing meshes on {len(addrs)} nodes")
    a = DeviceMesh.create((2, 2), nodes=[addrs[0], addrs[1]], startup_timeout_s=600)
    b = DeviceMesh.create((2, 2), nodes=[addrs[2], addrs[3]], startup_timeout_s=600)
    c = DeviceMesh.from_devices([*a.device_ids[2:], *b.device_ids], (3, 2))
    meshes = {"A": a, "B": b, "C": c}
    _say(f"meshes {a!r}, {b!r}, {c!r}; probing")
    links = probe_links(a, b, size_bytes=config["probe_size"])
    _say(str(links))
    rt = runtime()
    out: dict = {
        "meshes": {
            k: {"shape": list(m.shape), "hosts": list(m.host_ids), "nodes": list(m.node_ids)} for k, m in meshes.items()
        },
        "links": {
            "node_ids": list(links.node_ids),
            "nic_GBps": list(links.nic_GBps),
            "intra_host_GBps": links.intra_host_GBps,
            "latency_us": links.latency_us,
            "intra_host_latency_us": links.intra_host_latency_us,
            "size_bytes": links.size_bytes,
        },
        "host_of_node": {n: h for m in meshes.values() for n, h in zip(m.node_ids, m.host_ids, strict=True)},
        "results": [],
    }
    devices = sorted({d for m in (a, b) for d in m.device_ids})
    actors = [m.actor(m.index_of(d)) for m in (a, b) for d in m.device_ids]
    sizes = list(config["sizes"]) + ([SMALL] if config["small_repeats"] else [])
    for case in config["cases"]:
        what, src_key, src_p, dst_key, dst_p = CASES[case]
        src_mesh, dst_mesh = meshes[src_key], meshes[dst_key]
        src_layout, dst_layout = Layout(src_mesh, _placements(src_p)), Layout(dst_mesh, _placements(dst_p))
        for size in sizes:
            small = size == SMALL
            shape = tensor_shape(size, 4, 2)
            source = make_array(shape, "float32", config["seed"])
            expected = [
                hashlib.sha256(
                    memoryview(
                        np.ascontiguousarray(source[tuple(slice(lo, hi) for lo, hi in box)]).reshape(-1).view(np.uint8)
                    )
                ).hexdigest()
                for box in layout_regions(dst_layout, shape)
            ]
            x = distribute(source, src_layout, timeout_s=config["timeout"])
            entry = {
                "case": case,
                "what": what,
                "src": str(src_layout),
                "dst": str(dst_layout),
                "size_bytes": size,
                "shape": list(shape),
                "methods": {},
            }
            load = os.getloadavg()[0]
            plans = {}
            for s in config["strategies"]:
                compiled = lowered_reshard(x, dst_layout, strategy=s)
                plan = plans[s] = compiled.plan
                cluster = rt.planning_cluster(dst_mesh.backend, plan.host_map)
                guessed = Cluster.for_hosts(
                    plan.host_map,
                    nic_GBps=GUESSED_GLOO["nic_GBps"],
                    intra_host_GBps=GUESSED_GLOO["intra_host_GBps"],
                    latency_us=GUESSED_GLOO["latency_us"],
                    intra_host_latency_us=GUESSED_GLOO["intra_host_latency_us"],
                    backend="gloo",
                )
                entry["methods"][s] = {
                    "transfers": len(plan.transfers),
                    "simulated_s": compiled.simulate(cluster).makespan_s,
                    "simulated_guess_s": compiled.simulate(guessed).makespan_s,
                    "bound_s": plan.lower_bound_s(cluster),
                    "cluster": str(cluster),
                }
            if "auto" in plans:
                for s, m in entry["methods"].items():
                    m["same_plan_as_auto"] = plans[s].transfers == plans["auto"].transfers
            samples: dict[str, list[float]] = {s: [] for s in config["strategies"]}

            run = (x, src_mesh, dst_layout, config["timeout"])
            for s in config["strategies"]:  # warm-up (groups, programs) and the bit-exact check, untimed
                _attempt(run, s, entry["methods"][s], expected)
            for _ in range(config["small_repeats"] if small else config["repeats"]):
                for s in config["strategies"]:  # interleaved: load drifting over the run hits every strategy
                    dt = _attempt(run, s, entry["methods"][s], None)
                    if dt is not None:
                        samples[s].append(dt)
            for s, m in entry["methods"].items():
                if samples[s]:
                    m["latency_s"] = stats_of(samples[s])
                med = m.get("latency_s", {}).get("median")
                _say(
                    f"{case} {fmt_size(size)} {s}: measured {med if med is None else round(med, 4)} s, "
                    f"simulated {m['simulated_s']:.4f} s, bound {m['bound_s']:.4f} s, "
                    f"{m.get('verify_detail') or m.get('error')}"
                )
            entry["loadavg"] = [load, os.getloadavg()[0]]
            if small:
                pings = []
                for _ in range(config["small_repeats"]):
                    t0 = time.perf_counter()
                    ray.get([act.reshard_ping.remote() for act in actors], timeout=60)
                    pings.append(time.perf_counter() - t0)
                entry["empty_call_all_s"] = stats_of(pings)
            x.free()
            out["results"].append(entry)
    for m in (a, b):
        m.shutdown()
    out["devices"] = devices
    return out


def _attempt(run: tuple, strategy: str, m: dict, expected: list[str] | None) -> float | None:
    """One reshard of ``run`` = (tensor, its mesh, destination layout, timeout) with ``strategy``:
    its wall time, or None when it failed (recorded in ``m``, and later attempts skipped). With
    ``expected`` digests, checks the result bit-exact on every destination device (untimed)."""
    from reshard import reshard

    if "error" in m:
        return None
    x, src_mesh, dst_layout, timeout_s = run
    try:
        t0 = time.perf_counter()
        y = reshard(x, src_mesh, dst_layout, strategy=strategy, timeout_s=timeout_s)
        dt = time.perf_counter() - t0
        if expected is not None:
            got = y.mesh.call(shard_digest, y.name, timeout_s=timeout_s)
            bad = [i for i, (g, e) in enumerate(zip(got, expected, strict=True)) if g != e]
            m["verified"] = not bad
            m["verify_detail"] = f"{len(got)} shards bit-exact" if not bad else f"shards {bad} differ"
        y.free()
        return dt
    except Exception as e:  # record and go on: one broken strategy must not sink the suite
        m["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        m["verified"] = m.get("verified", False)
        return None


def driver_main(config_json: str, out_path: str) -> int:
    result = drive(json.loads(config_json))
    Path(out_path).write_text(json.dumps(result))
    return 0


# ------------------------------------------------------------------------------------ targets, tables


def _med(m: dict) -> float | None:
    return m.get("latency_s", {}).get("median")


def derive(data: dict) -> None:
    """Ratios per (case, size, strategy): measured / simulated, measured / bound, measured / the
    fastest strategy's measurement; for ``auto`` also ``x_best_other``: measured / the fastest
    among itself and the strategies whose plan differs from its own (a strategy that runs the very
    same plan differs from it by noise only); small tensors: measured / (3 RTT + one Ray call)."""
    small_bound = (TARGET_SMALL_RTTS * data["raw"]["round_trip_us"] + data["raw"]["actor_call_us"]) * 1e-6
    data["small_bound_s"] = small_bound
    for e in data["results"]:
        meds = {s: _med(m) for s, m in e["methods"].items() if _med(m) is not None}
        best = min(meds.values(), default=None)
        for s, m in e["methods"].items():
            t = meds.get(s)
            if t is None:
                continue
            m["x_simulated"] = t / m["simulated_s"] if m["simulated_s"] else None
            m["x_bound"] = t / m["bound_s"] if m["bound_s"] else None
            m["x_best"] = t / best
            if s == "auto":
                other = [meds[o] for o, n in e["methods"].items() if o in meds and not n.get("same_plan_as_auto")]
                m["x_best_other"] = t / min(other)
            if e["size_bytes"] <= SMALL:
                m["x_small_bound"] = t / small_bound


def targets(data: dict) -> list[dict]:
    """The issue's four targets with the numbers that decide them."""
    res = data["results"]

    def row(title, vals, ok, fmt, size=lambda v: v):
        vals = [v for v in vals if v[1] is not None]
        if not vals:
            return {
                "target": title,
                "cases": 0,
                "passed": 0,
                "met": False,
                "worst": None,
                "worst_str": "-",
                "worst_case": "-",
            }
        failing = [v for v in vals if not ok(v[1])]
        worst = max(failing or vals, key=lambda v: size(v[1]))
        return {
            "target": title,
            "cases": len(vals),
            "passed": len(vals) - len(failing),
            "met": not failing,
            "worst": worst[1],
            "worst_str": fmt.format(worst[1]),
            "worst_case": worst[0],
        }

    def label(e, s=None):
        return f"{e['case']} {fmt_size(e['size_bytes'])}" + (f" {s}" if s else "")

    auto = [(label(e), e["methods"].get("auto", {}).get("x_bound")) for e in res if e["size_bytes"] == TARGET_SIZE]
    slower = [
        (label(e), e["methods"]["auto"].get("x_best_other", 1.0) - 1.0 if "auto" in e["methods"] else None)
        for e in res
        if e["size_bytes"] >= BIG
    ]
    sim = [
        (label(e, s), (m.get("x_simulated") or 0) - 1.0 if m.get("x_simulated") else None)
        for e in res
        if e["size_bytes"] >= BIG
        for s, m in e["methods"].items()
    ]
    small = [
        (label(e, s), m.get("x_small_bound"))
        for e in res
        if e["size_bytes"] <= SMALL
        for s, m in e["methods"].items()
        if s == "auto"
    ]
    return [
        row(f"auto <= {TARGET_X_BOUND}x the fluid bound at 256 MiB", auto, lambda v: v <= TARGET_X_BOUND, "{:.2f}x"),
        row("auto never > 3 % slower than another plan (>= 64 MiB)", slower, lambda v: v <= TARGET_SLOWER, "{:+.1%}"),
        row(
            "simulator within 10 % of measured (every strategy, >= 64 MiB)",
            sim,
            lambda v: abs(v) <= TARGET_SIM_ERROR,
            "{:+.1%}",
            abs,
        ),
        row("small tensors (64 KiB, auto) <= 3 TCP RTT + one Ray call", small, lambda v: v <= 1.0, "{:.2f}x"),
    ]


def _ms(t) -> str:
    return "-" if t is None else f"{t * 1e3:.1f}" if t < 1 else f"{t * 1e3:.0f}"


def tables(data: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    out = []
    head = [
        "case",
        "size",
        "strategy",
        "plan",
        "measured ms",
        "spread",
        "simulated ms",
        "meas/sim",
        "bound ms",
        "meas/bound",
        "meas/best",
        "bit-exact",
    ]
    rows = []
    for e in data["results"]:
        if e["size_bytes"] <= SMALL:
            continue
        for s, m in e["methods"].items():
            lat = m.get("latency_s", {})
            spread = f"±{(lat['max'] - lat['min']) / lat['median'] * 50:.0f}%" if lat.get("median") else "-"
            rows.append(
                [
                    e["case"],
                    fmt_size(e["size_bytes"]),
                    s,
                    "= auto" if m.get("same_plan_as_auto") and s != "auto" else "",
                    "ERROR" if "error" in m else _ms(_med(m)),
                    spread,
                    _ms(m["simulated_s"]),
                    f"{m['x_simulated']:.2f}" if m.get("x_simulated") else "-",
                    _ms(m["bound_s"]),
                    f"{m['x_bound']:.2f}" if m.get("x_bound") else "-",
                    f"{m['x_best']:.2f}" if m.get("x_best") else "-",
                    "yes" if m.get("verified") else "NO",
                ]
            )
    out.append(
        ("Reshards between emulated hosts: measured (median) vs simulated vs fluid bound, probed cluster", head, rows)
    )
    small = [e for e in data["results"] if e["size_bytes"] <= SMALL]
    if small:
        bound = data["small_bound_s"]
        head = [
            "case",
            "strategy",
            "median ms",
            "p25-p75 ms",
            f"/ (3 RTT + call = {_ms(bound)} ms)",
            "empty call to all 8 actors ms",
            "bit-exact",
        ]
        rows = []
        for e in small:
            floor = e.get("empty_call_all_s", {}).get("median")
            for s, m in e["methods"].items():
                lat = m.get("latency_s", {})
                rows.append(
                    [
                        e["case"],
                        s,
                        "ERROR" if "error" in m else _ms(lat.get("median")),
                        f"{_ms(lat.get('p25'))}-{_ms(lat.get('p75'))}" if lat else "-",
                        f"{m['x_small_bound']:.1f}x" if m.get("x_small_bound") else "-",
                        _ms(floor),
                        "yes" if m.get("verified") else "NO",
                    ]
                )
        out.append((f"Small tensors ({fmt_size(SMALL)}), cached plans", head, rows))
    head = ["target", "passed", "worst (case)", "met"]
    rows = [
        [
            t["target"],
            f"{t['passed']}/{t['cases']}",
            f"{t['worst_str']} ({t['worst_case']})",
            "yes" if t["met"] else "NO",
        ]
        for t in data["targets"]
    ]
    out.append(("Targets", head, rows))
    return out


def header(data: dict) -> str:
    raw, links = data["raw"], data["links"]
    loads = [v for e in data["results"] for v in e.get("loadavg", ())] or [0.0]
    nics = ", ".join(f"{v:.4f}" if v else "-" for v in links["nic_GBps"])
    return (
        f"`{data['command']}` at {data['started']} (git {revision_of(data)}), {data['duration_s']:.0f} s; "
        f"{data['hosts']} emulated hosts, NIC {data['nic_gbit']:g} Gbit/s = {data['nic_gbit'] / 8:.4f} GB/s; "
        f"TCP: round trip {raw['round_trip_us']:.0f} us, one stream {raw['stream_GBps']:.4f} GB/s; empty Ray "
        f"actor call head -> host 1 {raw['actor_call_us']:.0f} us. Probed (gloo, {links['size_bytes'] >> 20} MiB): "
        f"NIC per node {nics} GB/s, intra-node {links['intra_host_GBps'] or 0:.3f} GB/s, message latency "
        f"{links['latency_us'] or 0:.0f} us (network), {links['intra_host_latency_us'] or 0:.0f} us (in a node). "
        f"Load average over the cases {min(loads):.1f}-{max(loads):.1f} on {data['machine']['cpus']} CPUs "
        "(every emulated host shares them)."
    )


def render(data: dict, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=160)
    console.print(header(data), markup=False)
    for title, head, rows in tables(data):
        table = Table(title=title, title_justify="left", pad_edge=False)
        for i, h in enumerate(head):
            table.add_column(h, justify="left" if i < 3 or title == "Targets" else "right")
        last = None
        for r in rows:
            if last is not None and r[:2] != last and title != "Targets":
                table.add_section()
            last = r[:2]
            table.add_row(*[("[red]" + c) if c in ("NO", "ERROR") else c for c in r])
        console.print(table)


def markdown(data: dict) -> str:
    out = [header(data), ""]
    for title, head, rows in tables(data):
        out += [f"**{title}**", "", "| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
        out += ["| " + " | ".join(r) + " |" for r in rows]
        out.append("")
    return "\n".join(out)


def plot(data: dict, path: str) -> None:
    """Per case at the largest size: measured (median, min-max), simulated and bound per strategy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    top = max(e["size_bytes"] for e in data["results"])
    entries = [e for e in data["results"] if e["size_bytes"] == top]
    fig, axes = plt.subplots(1, len(entries), figsize=(4.2 * len(entries), 4.2), squeeze=False)
    for ax, e in zip(axes[0], entries, strict=True):
        names = list(e["methods"])
        xs = np.arange(len(names))
        meas = [_med(e["methods"][s]) or 0 for s in names]
        lo = [m - (e["methods"][s].get("latency_s", {}).get("min") or m) for s, m in zip(names, meas, strict=True)]
        hi = [(e["methods"][s].get("latency_s", {}).get("max") or m) - m for s, m in zip(names, meas, strict=True)]
        sim = [e["methods"][s]["simulated_s"] for s in names]
        ax.bar(xs - 0.2, meas, 0.4, yerr=[lo, hi], label="measured", color="#4477aa")
        ax.bar(xs + 0.2, sim, 0.4, label="simulated", color="#ccbb44")
        bound = min(e["methods"][s]["bound_s"] for s in names)
        ax.axhline(bound, color="#aa3377", linestyle="--", label="fluid bound")
        ax.set_xticks(xs, names, rotation=45, ha="right", fontsize=8)
        ax.set_title(f"{e['case']} {fmt_size(top)}", fontsize=9)
        ax.set_ylabel("seconds")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"{data['hosts']} emulated hosts, {data['nic_gbit']:g} Gbit/s NICs (probed cluster)", fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)


# ------------------------------------------------------------------------------------ entry point


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.driver:
        return driver_main(*args.driver)
    if args.report:
        data = json.loads(Path(args.report).read_text())
        derive(data)  # ratios and targets as this version defines them, from the recorded medians
        data["targets"] = targets(data)
        print(markdown(data)) if args.markdown else render(data)
        return 0
    from bench import emulate
    from bench.local import command_line
    from bench.provenance import revision
    from reshard import STRATEGIES

    ok, why = emulate.available()
    if not ok:
        print(f"python -m bench multihost: cannot emulate hosts here: {why}", file=sys.stderr)
        return 2
    strategies = [s.strip() for s in args.strategies.split(",")] if args.strategies else list(STRATEGIES)
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        print(f"unknown strategies {unknown}; registered: {', '.join(STRATEGIES)}", file=sys.stderr)
        return 2
    config = {
        "sizes": args.size_list,
        "cases": args.case_list,
        "strategies": strategies,
        "repeats": args.repeats,
        "small_repeats": args.small_repeats,
        "probe_size": args.probe_size,
        "timeout": args.timeout,
        "seed": args.seed,
    }
    when = _dt.datetime.now()
    t0 = time.time()
    hosts = 4
    top = max(args.size_list + [SMALL])
    store_mib = max(512, 2 * (top >> 20) + 256)
    with emulate.EmulatedCluster(
        hosts,
        nic_gbit=args.nic_gbit,
        cpus_per_host=1,
        object_store_mib=store_mib,
        progress=lambda msg: print(f"[emulate] {msg}", flush=True),
    ) as cluster:
        raw = {
            "round_trip_us": cluster.round_trip_us(0, 1),
            "stream_GBps": cluster.stream_GBps(1, 0),
            "actor_call_us": cluster.actor_call_us(1),
        }
        print(f"[emulate] raw network: {json.dumps({k: round(v, 4) for k, v in raw.items()})}", flush=True)
        out_file = cluster.run_dir / "driver-result.json"
        done = cluster.run(
            [sys.executable, "-m", "bench.multihost", "--driver", json.dumps(config), str(out_file)],
            timeout_s=7200,
            capture_output=False,
        )
        if done.returncode != 0:
            print(f"the driver failed ({done.returncode})", file=sys.stderr)
            return 1
        result = json.loads(out_file.read_text())
    data = {
        "schema": SCHEMA,
        "suite": "multihost",
        "started": when.isoformat(timespec="seconds"),
        "duration_s": time.time() - t0,
        "command": command_line("multihost", argv),
        "revision": revision(),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "loadavg_end": list(os.getloadavg())},
        "hosts": hosts,
        "nic_gbit": args.nic_gbit,
        "raw": raw,
        "config": config,
        **result,
    }
    derive(data)
    data["targets"] = targets(data)
    path = Path(args.out) if args.out else RESULTS_DIR / f"multihost-{when.strftime('%Y%m%d-%H%M%S')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))
    if args.png:
        plot(data, args.png)
    render(data)
    print(f"results: {path}" + (f", figure: {args.png}" if args.png else ""))
    verified = all(m.get("verified") for e in data["results"] for m in e["methods"].values())
    return 0 if verified else 1


if __name__ == "__main__":
    sys.exit(main())
