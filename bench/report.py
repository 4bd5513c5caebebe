"""Tables and target checks for local-suite results (``bench.local`` JSON, schema 2).

``python -m bench.report [results.json] [--markdown]`` re-renders a results file (default
``bench/results/latest.json``) as rich tables, or as Markdown for ``bench/LOCAL.md``.

Which ceiling applies to which path: the default path (slices pulled through shared memory) is
measured against ``memcpy`` (each destination actor copying its shard's bytes between resident
buffers, all at once); the gloo path (``shared_memory=False``) against ``raw gloo`` (the bytes
that cross between actors, one message per pair on a raw gloo group), and with outputs kept alive
also against ``raw gloo fresh`` (the same receives into freshly mapped memory, as a kept output's
must be; the issue's target stays the resident one). "x RTT" divides by an empty
Ray call (``reshard_ping``) to every actor of the case; "x peer" is the peer's latency over ours.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from bench.cases import fmt_size
from bench.methods import (
    CEILING,
    CEILING_FRESH,
    MEMCPY,
    NAIVE,
    OBJECT_STORE,
    OURS,
    OURS_GLOO,
    OURS_GLOO_POOLED,
    OURS_POOLED,
    PEERS,
    RTT,
    SCHEMA,
)
from bench.provenance import revision_of

LABELS = {
    OURS: "ours",
    OURS_GLOO: "ours gloo",
    OURS_POOLED: "ours pooled",
    OURS_GLOO_POOLED: "ours gloo pooled",
    OBJECT_STORE: "object store",
    "rdt": "RDT",
    "dtensor": "DTensor",
    NAIVE: "naive",
    MEMCPY: "memcpy",
    CEILING: "raw gloo",
    CEILING_FRESH: "raw gloo fresh",
    RTT: "empty RTT",
}
BIG = 64 << 20  # the gloo path's bandwidth target applies from here up
SMALL = 64 << 10  # the latency target applies up to here
TARGET_GLOO_FRAC = 0.85
TARGET_SMALL_X_RTT = 1.5
TARGET_STARTUP_X = 2.0


def case_ok(methods: dict, counted=("ours", "strategy", "baseline", "peer")) -> bool:
    """Whether a case of a run went right: every method of a ``counted`` kind that ran was verified
    bit-exact (or, ``--quick``, at a smaller size). A peer that failed (its ``error``) is reported
    in the table and the JSON, not counted: another library timing out is no fault of ours, and
    must not fail the run; a peer that ran and returned wrong bytes is (the harness is wrong)."""
    return all(
        (v.get("verified") is True or v.get("verified_earlier", False)) and "error" not in v
        for v in methods.values()
        if v["kind"] in counted and "skipped" not in v and not (v["kind"] == "peer" and "error" in v)
    )


def _label(name: str) -> str:
    return LABELS.get(name, name)


def _med(m: dict) -> float | None:
    return m.get("latency_s", {}).get("median")


def _spread(m: dict) -> float | None:
    lat = m.get("latency_s")
    if not lat or not lat["median"]:
        return None
    return (lat["max"] - lat["min"]) / lat["median"]


def _ms(t: float | None) -> str:
    if t is None:
        return "-"
    ms = t * 1e3
    return f"{ms:.1f}" if ms < 100 else f"{ms:.0f}"


def _status(m: dict) -> str | None:
    if "error" in m:
        return "ERROR"
    if "skipped" in m:
        return "n/a"
    return None


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:.0f}%"


def _methods(data: dict) -> list[str]:
    """Every timed method of the run, in table order."""
    seen: dict[str, None] = {}
    for e in data["results"]:
        for name in e["methods"]:
            seen[name] = None
    order = [RTT, MEMCPY, CEILING, CEILING_FRESH, OURS, OURS_GLOO, *PEERS, OURS_POOLED, OURS_GLOO_POOLED, NAIVE]
    return [n for n in order if n in seen] + [n for n in seen if n not in order]


def _peers(data: dict) -> list[str]:
    return [p for p in PEERS if p in data.get("peers", ())]


def latency_rows(data: dict) -> tuple[list[str], list[list[str]]]:
    """Median latency in ms ± half the min-max range (% of the median), per (case, size) and method."""
    names = _methods(data)
    head = ["case", "size", *(_label(n) for n in names)]
    rows = []
    for e in data["results"]:
        row = [e["case"], fmt_size(e["size_bytes"])]
        for n in names:
            m = e["methods"].get(n, {})
            t, sp = _med(m), _spread(m)
            row.append(_status(m) or ("-" if t is None else f"{_ms(t)} ±{sp * 50:.0f}%"))
        rows.append(row)
    return head, rows


def bandwidth_rows(data: dict) -> tuple[list[str], list[list[str]]]:
    """Effective bandwidth, GB/s = tensor bytes / median latency."""
    names = [n for n in _methods(data) if n != RTT]
    head = ["case", "size", "output", "moved", *(_label(n) for n in names)]
    rows = []
    for e in data["results"]:
        row = [e["case"], fmt_size(e["size_bytes"]), fmt_size(e["output_bytes"]), fmt_size(e["moved_bytes"])]
        for n in names:
            m = e["methods"].get(n, {})
            row.append(_status(m) or ("-" if "eff_GBps" not in m else f"{m['eff_GBps']:.3f}"))
        rows.append(row)
    return head, rows


def _fastest_peer(m: dict) -> float | None:
    vals = [v for p, v in m.get("x_faster_than", {}).items() if p in PEERS]
    return min(vals) if vals else None


def path_rows(data: dict, kept: str, pooled: str) -> tuple[list[str], list[list[str]]]:
    """One path of ours against its ceiling and each peer, outputs kept; pooled mode beside it."""
    peers = _peers(data)
    ceiling = next((e["methods"][kept]["ceiling"] for e in data["results"] if kept in e["methods"]), MEMCPY)
    fresh = next(
        (e["methods"][kept]["fresh_ceiling"] for e in data["results"] if "fresh_ceiling" in e["methods"].get(kept, {})),
        None,
    )
    head = [
        "case",
        "size",
        f"% of {_label(ceiling)}",
        *([f"% of {_label(fresh)}"] if fresh else []),
        *(f"x {_label(p)}" for p in peers),
        f"pooled % of {_label(ceiling)}",
        "pooled x fastest peer",
    ]
    rows = []
    for e in data["results"]:
        m, mp = e["methods"].get(kept, {}), e["methods"].get(pooled, {})
        row = [e["case"], fmt_size(e["size_bytes"]), _status(m) or _pct(m.get("frac_of_ceiling"))]
        if fresh:
            row.append(_status(m) or _status(e["methods"].get(fresh, {})) or _pct(m.get("frac_of_fresh_ceiling")))
        for p in peers:
            pm = e["methods"].get(p, {})
            row.append(_status(m) or _status(pm) or _x(m.get("x_faster_than", {}).get(p)))
        row += [_status(mp) or _pct(mp.get("frac_of_ceiling")), _status(mp) or _x(_fastest_peer(mp))]
        rows.append(row)
    return head, rows


def rtt_rows(data: dict) -> tuple[list[str], list[list[str]]]:
    """Small tensors: median latency / median empty Ray round trip to the same actors."""
    names = [n for n in _methods(data) if n not in (RTT, MEMCPY, CEILING, CEILING_FRESH)]
    head = ["case", "size", "empty RTT ms", *(_label(n) for n in names)]
    rows = []
    for e in data["results"]:
        if e["size_bytes"] > SMALL:
            continue
        row = [e["case"], fmt_size(e["size_bytes"]), _ms(_med(e["methods"].get(RTT, {})))]
        for n in names:
            m = e["methods"].get(n, {})
            row.append(_status(m) or _x(m.get("x_empty_rtt")))
        rows.append(row)
    return head, rows


def startup_rows(data: dict) -> tuple[list[str], list[list[str]]]:
    s = data.get("startup")
    if not s:
        return [], []
    head = [
        f"DeviceMesh.create({tuple(s['mesh_shape'])}) s",
        f"{s['bare_actors']} bare numpy actors s",
        "ratio of the fastest",
    ]
    mesh, bare = (", ".join(f"{v:.2f}" for v in s[k]) for k in ("mesh_create_s", "bare_s"))
    return head, [[mesh, bare, _x(s["ratio"])]]


def _target(title: str, method: str, vals: list, ok, fmt, worst_is_max: bool = False) -> dict:
    """``vals``: (label, value or None) in scope; a missing value (an error) fails."""
    have = [(lab, v) for lab, v in vals if v is not None]
    passed = [v for _, v in have if ok(v)]
    nums = [v for _, v in have]
    median = statistics.median(nums) if nums else None
    worst = (max if worst_is_max else min)(have, key=lambda lv: lv[1]) if have else None
    return {
        "target": title,
        "method": method,
        "cases": len(vals),
        "passed": len(passed),
        "median": median,
        "worst": worst[1] if worst else None,
        "worst_case": worst[0] if worst else "",
        "median_str": fmt(median) if nums else "-",
        "worst_str": fmt(worst[1]) if worst else "-",
        "met": bool(vals) and len(passed) == len(vals),
        "in_run": bool(vals),
    }


def targets(data: dict) -> list[dict]:
    """The local suite's targets, on the headline mode (outputs kept alive)."""
    res = data["results"]

    def where(e, extra=""):
        return f"{e['case']} {fmt_size(e['size_bytes'])}" + (f" vs {_label(extra)}" if extra else "")

    def ratio(e, method, key, sub=None):
        v = e["methods"].get(method, {}).get(key)
        return v.get(sub) if isinstance(v, dict) else v

    def faster(v):
        return f"{v:.2f}x"

    peers = _peers(data)
    in_scope = [(e, p) for e in res for p in peers if p in e["methods"] and "skipped" not in e["methods"][p]]
    out = [
        _target(
            "default path faster than every peer",
            OURS,
            [(where(e, p), ratio(e, OURS, "x_faster_than", p)) for e, p in in_scope],
            lambda v: v > 1,
            faster,
        ),
        _target(
            f"gloo path >= {TARGET_GLOO_FRAC:.0%} of raw gloo (>= {fmt_size(BIG)})",
            OURS_GLOO,
            [(where(e), ratio(e, OURS_GLOO, "frac_of_ceiling")) for e in res if e["size_bytes"] >= BIG],
            lambda v: v >= TARGET_GLOO_FRAC,
            lambda v: f"{v:.0%}",
        ),
        _target(
            "gloo path faster than the object store",
            OURS_GLOO,
            [
                (where(e), ratio(e, OURS_GLOO, "x_faster_than", OBJECT_STORE))
                for e in res
                if OBJECT_STORE in e["methods"]
            ],
            lambda v: v > 1,
            faster,
        ),
    ]
    for method in (OURS, OURS_GLOO):
        out.append(
            _target(
                f"<= {fmt_size(SMALL)}, cached plan: <= {TARGET_SMALL_X_RTT}x an empty Ray call",
                method,
                [(where(e), ratio(e, method, "x_empty_rtt")) for e in res if e["size_bytes"] <= SMALL],
                lambda v: v <= TARGET_SMALL_X_RTT,
                faster,
                worst_is_max=True,
            )
        )
    s = data.get("startup")
    label = f"DeviceMesh.create({tuple(s['mesh_shape'])})" if s else "DeviceMesh.create"
    out.append(
        _target(
            f"mesh start-up <= {TARGET_STARTUP_X:g}x bare numpy actors",
            "start-up",
            [(label, s["ratio"])] if s else [],
            lambda v: v <= TARGET_STARTUP_X,
            faster,
            worst_is_max=True,
        )
    )
    return out


def target_rows(data: dict) -> tuple[list[str], list[list[str]]]:
    head = ["target", "method", "passed", "median", "worst (case)", "met"]
    rows = []
    for t in data.get("targets") or targets(data):
        if not t["in_run"]:
            rows.append([t["target"], _label(t["method"]), "-", "-", "-", "not in this run"])
            continue
        rows.append(
            [
                t["target"],
                _label(t["method"]),
                f"{t['passed']}/{t['cases']}",
                t["median_str"],
                f"{t['worst_str']} ({t['worst_case']})",
                "yes" if t["met"] else "NO",
            ]
        )
    return head, rows


def _tables(data: dict):
    out = [
        (
            "Latency: median ms ± half the min-max range (% of the median); outputs kept alive unless 'pooled'",
            *latency_rows(data),
        ),
        (
            "Default path (pulls through shared memory), outputs kept: % of the memcpy ceiling, x faster than each "
            "peer; pooled mode beside it",
            *path_rows(data, OURS, OURS_POOLED),
        ),
        (
            "Gloo path (shared_memory=False), outputs kept: % of the raw gloo ceiling (and of raw gloo into fresh "
            "memory), x faster than each peer; pooled mode beside it",
            *path_rows(data, OURS_GLOO, OURS_GLOO_POOLED),
        ),
        (
            "Effective bandwidth GB/s (tensor bytes / median latency); output = destination bytes, moved = bytes "
            "crossing actors",
            *bandwidth_rows(data),
        ),
    ]
    head, rows = rtt_rows(data)
    if rows:
        out.append(("Small tensors: latency / empty Ray round trip to the same actors", head, rows))
    head, rows = startup_rows(data)
    if rows:
        out.append(("Mesh start-up: until every actor answered a first call", head, rows))
    out.append(("Targets (outputs kept alive)", *target_rows(data)))
    return out


def check_schema(data: dict) -> None:
    if data.get("schema") != SCHEMA:
        raise SystemExit(
            f"results of schema {data.get('schema')}; this report reads schema {SCHEMA}: render the file with "
            f"bench/report.py as of the run's git revision ({revision_of(data)})"
        )


def header(data: dict) -> str:
    m = data.get("machine", {})
    load = ""
    if "loadavg_start" in m:
        load = f"; load average {m['loadavg_start'][0]:.1f} at start, {m['loadavg_end'][0]:.1f} at end"
    hits = sum(e.get("pool_hits_kept", 0) for e in data["results"])
    releases = sum(e.get("kept_releases", 0) for e in data["results"])
    return (
        f"`{data['command']}` at {data['started']} (git {revision_of(data)}), {data['duration_s']:.0f} s; "
        f"{m.get('cpus')} CPUs, ray {m.get('ray')}, torch {m.get('torch')}{load}; dtype {data['dtype']}; "
        f"outputs kept alive: {hits} reuses of freed memory, kept outputs released {releases} times, untimed "
        + (f"(limit {fmt_size(data['keep_limit_bytes'])})" if "keep_limit_bytes" in data else "(before every method)")
    )


def render(data: dict, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    check_schema(data)
    console = console or Console()
    console.print(header(data), markup=False)
    for title, head, rows in _tables(data):
        table = Table(title=title, title_justify="left", show_lines=False, pad_edge=False)
        targets_table = title.startswith("Targets")
        for i, h in enumerate(head):
            table.add_column(h, justify="left" if i < 2 or targets_table else "right", overflow="fold")
        last = None
        for row in rows:
            if last is not None and row[0] != last and not targets_table:
                table.add_section()
            last = row[0]
            table.add_row(*[("[red]" + c) if c in ("NO", "ERROR") else c for c in row])
        console.print(table)
    bad = [
        (e["case"], e["size_bytes"], m)
        for e in data["results"]
        for m, v in e["methods"].items()
        if v.get("verified") is False or "error" in v
    ]
    if bad:
        for case, size, m in bad:
            v = next(e for e in data["results"] if e["case"] == case and e["size_bytes"] == size)["methods"][m]
            console.print(f"[red]{case} {fmt_size(size)} {m}: {v.get('error') or v.get('verify_detail')}", markup=True)
    else:
        n = sum(1 for e in data["results"] for v in e["methods"].values() if v.get("verified"))
        console.print(f"verified bit-exact: {n} results (every destination shard of ours, each peer and baseline)")


def markdown(data: dict) -> str:
    check_schema(data)
    out = [header(data), ""]
    for title, head, rows in _tables(data):
        out.append(f"**{title}**\n")
        out.append("| " + " | ".join(head) + " |")
        out.append("|" + "|".join("---" for _ in head) + "|")
        out += ["| " + " | ".join(r) + " |" for r in rows]
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__.splitlines()[0])
    p.add_argument("path", nargs="?", default=str(Path(__file__).resolve().parent / "results" / "latest.json"))
    p.add_argument("--markdown", action="store_true")
    args = p.parse_args(argv)
    data = json.loads(Path(args.path).read_text())
    if args.markdown:
        print(markdown(data))
    else:
        from rich.console import Console

        console = Console()
        render(data, console if console.is_terminal else Console(width=150))
    return 0


if __name__ == "__main__":
    sys.exit(main())
