"""Analysis, tables and plot of weight-sync results (``bench.weights`` JSON): the fit, the targets.

``python -m bench.weights_report results.json [--figure PNG]`` re-renders a results file (no Ray).
The method names and target thresholds live here (pure), shared with the suite that runs them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

OURS, OURS_GLOO, ASYNC, LOOP = "ours", "ours_gloo", "ours_async", "per_tensor_loop"
ONE, ONE_GLOO = "one_tensor", "one_tensor_gloo"
OURS_OUT, OURS_DIRECT, ONE_OUT = "ours_out", "ours_direct", "one_tensor_out"  # replays into kept outputs, on request
OBJECT_STORE, NAIVE, RDT = "object_store", "naive_refit", "rdt"
PEERS = (OBJECT_STORE, NAIVE, RDT)
DEFAULT_METHODS = (OURS, OURS_GLOO, ASYNC, LOOP, ONE, ONE_GLOO, *PEERS)
METHODS = (*DEFAULT_METHODS, OURS_OUT, OURS_DIRECT, ONE_OUT)
PATHS = {"default": (OURS, ONE), "gloo": (OURS_GLOO, ONE_GLOO)}  # path -> (tree, one tensor)
TREE_X_ONE, LOOP_X, PER_TENSOR_MS, ASYNC_FRAC = 1.3, 2.5, 0.05, 0.25
QWEN3_X_ONE = 1.5  # the 311-tensor model's tree against one tensor of the same bytes


# ------------------------------------------------------------------------------------ analysis


def _med(entry: dict, method: str) -> float | None:
    return entry["methods"].get(method, {}).get("latency_s", {}).get("median")


def fit(entries: list[dict]) -> dict:
    """Per path: least squares of t = tensors * c + bytes * s over the tree and one-tensor medians
    of every entry (bytes in MiB for conditioning; bandwidth = 1 / s); per entry the two-point
    solution (``calibration``) and the fit time (``fit_s``)."""
    out = {}
    for path, (tree_m, one_m) in PATHS.items():
        rows, times = [], []
        for e in entries:
            t_tree, t_one = _med(e, tree_m), _med(e, one_m)
            if t_tree is None or t_one is None:
                continue
            pts = [(e["tensors"], e["min_bytes"] / 2**20), (1, e["one_tensor"]["min_bytes"] / 2**20)]
            rows += pts
            times += [t_tree, t_one]
            c, s = np.linalg.solve(np.array(pts), np.array([t_tree, t_one]))
            e.setdefault("calibration", {})[path] = {"per_tensor_s": float(c), "bandwidth_GBps": _gbps(s)}
        if not rows:
            continue
        (c, s), *_ = np.linalg.lstsq(np.array(rows), np.array(times), rcond=None)
        out[path] = {"per_tensor_s": float(c), "bandwidth_GBps": _gbps(s), "points": len(rows)}
        for e in entries:
            if path in e.get("calibration", {}):
                e.setdefault("fit_s", {})[path] = float(e["tensors"] * c + e["min_bytes"] / 2**20 * s)
    return out


def _gbps(s_per_mib: float) -> float | None:
    return 2**20 / s_per_mib / 1e9 if s_per_mib > 0 else None


def _target(title: str, vals: list, ok, worst=max) -> dict:
    """``vals``: (where, ratio or None); a missing ratio (an error) fails."""
    have = [(w, v) for w, v in vals if v is not None]
    bad = worst(have, key=lambda wv: wv[1]) if have else ("", None)
    return {
        "target": title,
        "cases": len(vals),
        "passed": sum(1 for _, v in have if ok(v)),
        "worst": bad[1],
        "worst_case": bad[0],
        "met": bool(vals) and all(v is not None and ok(v) for _, v in vals),
        "in_run": bool(vals),
    }


def targets(data: dict) -> list[dict]:
    """The suite's targets, as ratios of medians inside this run."""
    res = data["results"]

    def ratio(e, a, b):
        x, y = _med(e, a), _med(e, b)
        return None if x is None or y is None else x / y

    def where(e, extra=""):
        return f"{e['model']} {e['case']}" + (f" vs {extra}" if extra else "")

    out = []
    for path, (tree_m, one_m) in PATHS.items():
        vals = [(where(e), ratio(e, tree_m, one_m)) for e in res if e["model"] == "gpt2"]
        out.append(
            _target(
                f"gpt2 tree <= {TREE_X_ONE}x one tensor of the same bytes ({path} path)",
                vals,
                lambda v: v <= TREE_X_ONE,
            )
        )
    vals = [(where(e), ratio(e, OURS, ONE)) for e in res if e["model"] == "qwen3"]
    out.append(
        _target(
            f"qwen3 tree <= {QWEN3_X_ONE}x one tensor of the same bytes (default path)",
            vals,
            lambda v: v <= QWEN3_X_ONE,
        )
    )
    vals = [(where(e), ratio(e, LOOP, OURS)) for e in res]
    out.append(_target(f"tree >= {LOOP_X}x faster than the per-tensor loop", vals, lambda v: v >= LOOP_X, worst=min))
    for path in PATHS:
        c = data["fit"].get(path, {}).get("per_tensor_s")
        vals = [("least squares", None if c is None else c * 1e3)]
        out.append(
            _target(
                f"per-tensor cost in the fit <= {PER_TENSOR_MS} ms ({path} path; ms)",
                vals,
                lambda v: v <= PER_TENSOR_MS,
            )
        )
    vals = [(where(e, p), ratio(e, p, OURS)) for e in res for p in PEERS if p in e["methods"]]
    out.append(_target("ours (default path) faster than every peer (peer / ours)", vals, lambda v: v > 1, worst=min))
    vals = [(where(e), _async_frac(e)) for e in res if ASYNC in e["methods"]]
    out.append(
        _target(f"async_op=True returns within {ASYNC_FRAC:.0%} of the blocking call", vals, lambda v: v <= ASYNC_FRAC)
    )
    return out


def _async_frac(e: dict) -> float | None:
    ret, blocking = e["methods"][ASYNC].get("return_s", {}).get("median"), _med(e, OURS)
    return None if ret is None or not blocking else ret / blocking


# ------------------------------------------------------------------------------------ output

LABELS = {
    OURS: "ours",
    OURS_GLOO: "ours gloo",
    ASYNC: "ours async",
    LOOP: "per-tensor loop",
    ONE: "one tensor",
    ONE_GLOO: "one tensor gloo",
    OURS_OUT: "ours out=",
    OURS_DIRECT: "ours out= direct",
    ONE_OUT: "one tensor out=",
    OBJECT_STORE: "object store",
    NAIVE: "naive refit",
    RDT: "RDT",
}


def _ms(t: float | None) -> str:
    return "-" if t is None else (f"{t * 1e3:.1f}" if t < 0.1 else f"{t * 1e3:.0f}")


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def _methods(data: dict) -> list[str]:
    return [m for m in METHODS if any(m in e["methods"] for e in data["results"])]


def times_table(data: dict) -> tuple:
    names = _methods(data)
    rows = []
    for e in data["results"]:
        row = [e["model"], e["case"], str(e["tensors"]), _mib(e["tensor_bytes"])]
        for m in names:
            v = e["methods"].get(m, {})
            row.append("ERROR" if "error" in v else _ms(_med(e, m)))
            if m == ASYNC:
                row.append(_ms(v.get("return_s", {}).get("median")))
        rows.append(row + [_ms(e.get("fit_s", {}).get("default"))])
    title = (
        "Median ms per method (ours async: until wait() returned; async return: until the call returned); "
        "fit: tensors x per-tensor cost + bytes / bandwidth (default path)"
    )
    labels = [label for m in names for label in ((LABELS[m], "async return") if m == ASYNC else (LABELS[m],))]
    return title, ["model", "case", "tensors", "MiB", *labels, "fit"], rows


def bytes_table(data: dict) -> tuple:
    names = _methods(data)
    rows = []
    for e in data["results"]:
        row = [e["model"], e["case"], _mib(e["min_bytes"])]
        for m in names:
            v = e["methods"].get(m, {})
            least = e["one_tensor"]["min_bytes"] if m in (ONE, ONE_GLOO) else e["min_bytes"]
            row.append(f"{v['moved_bytes'] / least:.2f}x" if "moved_bytes" in v and least else "-")
        rows.append(row)
    title = "Bytes moved between devices / the minimum that must cross (one tensor: its own minimum)"
    return title, ["model", "case", "min MiB", *(LABELS[m] for m in names)], rows


def fit_table(data: dict) -> tuple:
    rows = []
    for e in data["results"]:
        for path, (tree_m, one_m) in PATHS.items():
            cal = e.get("calibration", {}).get(path)
            if cal:
                bw = "-" if cal["bandwidth_GBps"] is None else f"{cal['bandwidth_GBps']:.2f}"
                rows.append(
                    [
                        e["model"],
                        e["case"],
                        path,
                        _ms(_med(e, one_m)),
                        _ms(_med(e, tree_m)),
                        f"{cal['per_tensor_s'] * 1e3:.3f}",
                        bw,
                        _ms(e["fit_s"][path]),
                    ]
                )
    for path, f in data["fit"].items():
        bw = "-" if f["bandwidth_GBps"] is None else f"{f['bandwidth_GBps']:.2f}"
        rows.append(
            ["all", f"least squares, {f['points']} points", path, "", "", f"{f['per_tensor_s'] * 1e3:.3f}", bw, ""]
        )
    title = "Fit: per case from the tree and one tensor of as many bytes (two points); least squares over every case"
    return title, ["model", "case", "path", "one ms", "tree ms", "per tensor ms", "GB/s", "fit ms"], rows


def targets_table(data: dict) -> tuple:
    rows = [
        [
            t["target"],
            f"{t['passed']}/{t['cases']}",
            "-" if t["worst"] is None else f"{t['worst']:.3f} ({t['worst_case']})",
            "met" if t["met"] else "NO",
        ]
        for t in data["targets"]
        if t["in_run"]
    ]
    title = f"Targets (ratios inside this run; models {', '.join(data['models'])}; cases {', '.join(data['cases'])})"
    return title, ["target", "passed", "worst ratio (where)", "met"], rows


def render(data: dict, console) -> None:
    from rich.table import Table

    for title, head, rows in (times_table(data), bytes_table(data), fit_table(data), targets_table(data)):
        table = Table(title=title, title_justify="left", pad_edge=False)
        for i, h in enumerate(head):
            table.add_column(h, justify="left" if i < 3 else "right", overflow="fold")
        for row in rows:
            table.add_row(*[("[red]" + c) if c in ("NO", "ERROR") else c for c in row])
        console.print(table)
    for e in data["results"]:
        for m, v in e["methods"].items():
            if v.get("verified") is not True or "error" in v:
                console.print(f"[red]{e['model']} {e['case']} {m}: {v.get('error') or v.get('verify_detail')}")
    n = sum(1 for e in data["results"] for v in e["methods"].values() if v.get("verified") is True)
    console.print(f"verified bit-exact: {n} results (every destination device, every tensor)")


def plot(data: dict, path: Path) -> None:
    """Median time per method per (model, case), log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res, names = data["results"], _methods(data)
    x, width = np.arange(len(res)), 0.84 / max(1, len(names))
    fig, ax = plt.subplots(figsize=(max(7.0, 1.5 * len(res) + 3), 4.8))
    for j, m in enumerate(names):
        ys = [(_med(e, m) or np.nan) * 1e3 for e in res]
        ax.bar(x + (j - (len(names) - 1) / 2) * width, ys, width, label=LABELS[m])
    ax.set_yscale("log")
    ax.set_xticks(x, [f"{e['model']}\n{e['case']}" for e in res])
    ax.set_ylabel("median ms (log)")
    ax.set_title(f"Weight sync, one run ({data['started']}, {data['machine']['cpus']} CPUs): time per method")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(axis="y", which="both", alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.weights_report", description=__doc__.splitlines()[0])
    p.add_argument("path", help="a results file of python -m bench weights")
    p.add_argument("--figure", help="also plot it into this PNG")
    args = p.parse_args(argv)
    from rich.console import Console

    data = json.loads(Path(args.path).read_text())
    console = Console()
    render(data, console if console.is_terminal else Console(width=160))
    if args.figure:
        plot(data, Path(args.figure))
    return 0


if __name__ == "__main__":
    sys.exit(main())
