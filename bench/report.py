"""Tables and target checks for local-suite results (``bench.local`` JSON).

``python -m bench.report [results.json] [--markdown]`` re-renders a results file (default
``bench/results/latest.json``) as rich tables, or as Markdown for ``bench/LOCAL.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.cases import fmt_size

NAIVE, CEILING, RTT = "naive", "raw_gloo", "empty_rtt"
BIG = 64 << 20  # targets on bandwidth apply from here up
SMALL = 64 << 10  # the latency target applies up to here
TARGET_FRAC_OF_CEILING = 0.70
TARGET_SPEEDUP_VS_NAIVE = 2.0
TARGET_X_RTT = 2.0


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


def _strategies(data: dict) -> list[str]:
    return list(data["strategies"])


def _cell_latency(m: dict) -> str:
    if "error" in m:
        return "ERROR"
    t, sp = _med(m), _spread(m)
    return "-" if t is None else f"{_ms(t)} ±{sp * 50:.0f}%"


def latency_rows(data: dict) -> tuple[list[str], list[list[str]]]:
    """Median latency in ms ± half the min-max range (% of the median), per (case, size) and method."""
    strategies = _strategies(data)
    head = ["case", "size", "empty RTT", "raw gloo", "naive", *strategies]
    rows = []
    for e in data["results"]:
        ms = e["methods"]
        rows.append([e["case"], fmt_size(e["size_bytes"]),
                     *(_cell_latency(ms.get(n, {})) for n in (RTT, CEILING, NAIVE, *strategies))])  # fmt: skip
    return head, rows


def bandwidth_rows(data: dict) -> tuple[list[str], list[list[str]]]:
    """Effective bandwidth, GB/s = tensor bytes / median latency."""
    strategies = _strategies(data)
    head = ["case", "size", "moved", "raw gloo", "naive", *strategies]
    rows = []
    for e in data["results"]:
        ms = e["methods"]
        row = [e["case"], fmt_size(e["size_bytes"]), fmt_size(e["moved_bytes"])]
        for name in (CEILING, NAIVE, *strategies):
            m = ms.get(name, {})
            row.append("ERROR" if "error" in m else "-" if "eff_GBps" not in m else f"{m['eff_GBps']:.3f}")
        rows.append(row)
    return head, rows


def ratio_rows(data: dict) -> tuple[list[str], list[list[str]]]:
    """Per strategy: speed-up over naive (x) and bandwidth as a fraction of the raw gloo ceiling."""
    strategies = _strategies(data)
    head = ["case", "size", *strategies]
    rows = []
    for e in data["results"]:
        row = [e["case"], fmt_size(e["size_bytes"])]
        for s in strategies:
            m = e["methods"].get(s, {})
            if "error" in m:
                row.append("ERROR")
                continue
            a = f"{m['speedup_vs_naive']:.2f}x" if "speedup_vs_naive" in m else "-"
            b = f"{m['frac_of_ceiling'] * 100:.0f}%" if "frac_of_ceiling" in m else "-"
            row.append(f"{a} {b}")
        rows.append(row)
    return head, rows


def rtt_rows(data: dict) -> tuple[list[str], list[list[str]]]:
    """Small tensors: median latency / median empty Ray round trip to the same actors."""
    strategies = _strategies(data)
    head = ["case", "size", "empty RTT ms", *strategies]
    rows = []
    for e in data["results"]:
        if e["size_bytes"] > SMALL:
            continue
        rtt = _med(e["methods"].get(RTT, {}))
        row = [e["case"], fmt_size(e["size_bytes"]), _ms(rtt)]
        for s in strategies:
            m = e["methods"].get(s, {})
            row.append("ERROR" if "error" in m else f"{m['x_empty_rtt']:.2f}x" if "x_empty_rtt" in m else "-")
        rows.append(row)
    return head, rows


def targets(data: dict) -> list[dict]:
    """The three targets, per strategy, over the cases that fall in their scope."""
    out = []
    specs = [
        ("bandwidth >= 70% of raw gloo", lambda e: e["size_bytes"] >= BIG, "frac_of_ceiling",
         lambda v: v >= TARGET_FRAC_OF_CEILING, "{:.0%}"),
        (">= 2x faster than naive (64 MiB)", lambda e: e["size_bytes"] == BIG, "speedup_vs_naive",
         lambda v: v >= TARGET_SPEEDUP_VS_NAIVE, "{:.1f}x"),
        ("latency <= 2x empty RTT (<= 64 KiB)", lambda e: e["size_bytes"] <= SMALL, "x_empty_rtt",
         lambda v: v <= TARGET_X_RTT, "{:.1f}x"),
    ]  # fmt: skip
    for title, scope, key, ok, fmt in specs:
        for s in _strategies(data):
            vals = [(e["case"], e["size_bytes"], e["methods"].get(s, {}).get(key)) for e in data["results"] if scope(e)]
            vals = [v for v in vals if v[2] is not None]
            if not vals:
                continue
            passed = [v for v in vals if ok(v[2])]
            worst = min(vals, key=lambda v: v[2]) if key != "x_empty_rtt" else max(vals, key=lambda v: v[2])
            nums = sorted(v[2] for v in vals)
            out.append({
                "target": title,
                "strategy": s,
                "metric": key,
                "cases": len(vals),
                "passed": len(passed),
                "median": nums[len(nums) // 2],
                "worst": worst[2],
                "worst_case": f"{worst[0]} {fmt_size(worst[1])}",
                "median_str": fmt.format(nums[len(nums) // 2]),
                "worst_str": fmt.format(worst[2]),
                "met": len(passed) == len(vals),
            })  # fmt: skip
    return out


def target_rows(data: dict) -> tuple[list[str], list[list[str]]]:
    head = ["target", "strategy", "passed", "median", "worst (case)", "met"]
    rows = [
        [t["target"], t["strategy"], f"{t['passed']}/{t['cases']}", t["median_str"],
         f"{t['worst_str']} ({t['worst_case']})", "yes" if t["met"] else "NO"]
        for t in data.get("targets") or targets(data)
    ]  # fmt: skip
    return head, rows


def _tables(data: dict):
    out = [
        ("Latency: median ms ± half the min-max range (% of the median)", *latency_rows(data)),
        (
            "Effective bandwidth GB/s (tensor bytes / median latency); moved = bytes crossing actors",
            *bandwidth_rows(data),
        ),
        ("Each strategy: x faster than naive, and bandwidth as % of the raw gloo ceiling", *ratio_rows(data)),
    ]
    head, rows = rtt_rows(data)
    if rows:
        out.append(("Small tensors: latency / empty Ray round trip to the same actors", head, rows))
    out.append(("Targets", *target_rows(data)))
    return out


def header(data: dict) -> str:
    m = data.get("machine", {})
    load = ""
    if "loadavg_start" in m:
        load = f"; load average {m['loadavg_start'][0]:.1f} at start, {m['loadavg_end'][0]:.1f} at end"
    return (
        f"`{data['command']}` at {data['started']} (git {data['git']}), {data['duration_s']:.0f} s; "
        f"{m.get('cpus')} CPUs, ray {m.get('ray')}, torch {m.get('torch')}{load}; dtype {data['dtype']}; "
        + ("slices between actors of this machine pulled through shared memory"
           if data.get("shared_memory", False) else "every slice through the backend (no shared memory)")
    )  # fmt: skip


def render(data: dict, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    console.print(header(data), markup=False)
    for title, head, rows in _tables(data):
        table = Table(title=title, title_justify="left", show_lines=False, pad_edge=False)
        for i, h in enumerate(head):
            table.add_column(h, justify="left" if i < 2 or title == "Targets" else "right", overflow="fold")
        last = None
        for row in rows:
            if last is not None and row[0] != last and title != "Targets":
                table.add_section()
            last = row[0]
            table.add_row(*[("[red]" + c) if c in ("NO", "ERROR") else c for c in row])
        console.print(table)
    bad = [(e["case"], e["size_bytes"], m) for e in data["results"] for m, v in e["methods"].items()
           if v.get("verified") is False or "error" in v]  # fmt: skip
    if bad:
        for case, size, m in bad:
            v = next(e for e in data["results"] if e["case"] == case and e["size_bytes"] == size)["methods"][m]
            console.print(f"[red]{case} {fmt_size(size)} {m}: {v.get('error') or v.get('verify_detail')}")
    else:
        n = sum(1 for e in data["results"] for v in e["methods"].values() if v.get("verified"))
        console.print(f"verified bit-exact: {n} results (every destination shard of every strategy and the baseline)")


def markdown(data: dict) -> str:
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
