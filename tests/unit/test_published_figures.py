"""The figures the README and the bench pages publish, checked against the tracked result files they
come from: a figure must read as its file says (rounded as printed), so a new run that changes the
file without the text, or a text edited without a run, fails here."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
#: The commit every headline figure was measured on (``bench/headline.sh``): each suite's result is
#: ``bench/results/<suite>-<HEADLINE>.json``.
HEADLINE = "18d18da"
#: The whole-model suite and its MoE tree, measured again on the code as stop 56 left it
#: (``bench/headline.sh weights weights-moe``).
WEIGHTS_RUN = "611e36e"
#: The chaos tier's run, on the commit after HEADLINE (the headline's own run got no SIGINT through).
CHAOS = "chaos-a422216.json"
#: The MoE tree and the trees' ratios, measured again after each change of the device path (the host
#: unit, its mapped pulls, the per-tensor bookkeeping, the gloo path's unit), against the commit
#: before it in one sitting: (base, new, rounds); the latest on both paths.
AB = (
    ("b3fc38f", "31f2d15", 2),
    ("a19b95b", "1163ba7", 3),
    ("681e2a8", "84a81e8", 2),
    ("39be385", "50e04d3", 3),
    ("e79f0aa", "75dc99a", 3),
    ("9aa5ba3", "6e230fa", 3),
)
#: The MoE tree alone, before and after its first call's steps were made lazily.
AB_MOE = (("6379d5d", "9642baa", 3),)
MOE = f"weights-moe-{WEIGHTS_RUN}.json"
#: The latest replays into kept outputs (``--methods ...,ours_out,...``), MoE and Qwen3.
REPLAYS_MOE = ("weights-moe-out-492c31b.json", "weights-moe-out-8484019.json")
REPLAYS_QWEN3 = ("weights-qwen3-out-492c31b.json", "weights-qwen3-out-8484019.json")
BLOCKS = ("weights-moe-out-6011c48.json", "weights-qwen3-out-6011c48.json")  # block commits, calls made again
COMMITS = ("weights-moe-out-3022d0a.json", "weights-qwen3-out-3022d0a.json")  # cheaper commits, direct block copies
ALIKE = "weights-moe-out-56e32c3.json"  # bindings shipped as outputs of one a device holds
QUOTED: list[str] = []  # every result file a figure below comes from


def result(name: str) -> dict:
    path = RESULTS / name
    assert path.is_file(), f"{name} is quoted but not tracked"
    QUOTED.append(name)
    return json.loads(path.read_text())


def headline(suite: str) -> dict:
    """The headline run's result of ``suite`` (a file, or ``suite/file`` for the simulated suites)."""
    name = f"{suite}-{HEADLINE}.json" if "/" not in suite else suite.replace("/", f"-{HEADLINE}/", 1)
    return result(name)


def framework() -> list[tuple[str, str]]:
    d = headline("framework")
    ms = {m: f"{v['median'] * 1e3:.1f} ms" for m, v in d["methods"].items()}
    lib = d["methods"]["library"]["median"]
    rel = {m: f"{v['median'] / lib:.2f}x" for m, v in d["methods"].items()}
    ratios = d["ratios"]
    return [
        ("README.md", f"takes {ratios['framework/library']:.2f}x the same sync out of the library's"),
        ("README.md", f"is {ratios['framework-gloo/framework']:.1f}x faster than through loopback gloo"),
        ("README.md", f"and peers map it: {ratios['framework-reback/library']:.2f}x"),
        *(("bench/WEIGHTS.md", f"| {ms[m]} | {rel[m]} |") for m in d["methods"]),
        ("bench/WEIGHTS.md", f"{d['model']['tensors']} float32 tensors, {d['model']['bytes'] / 2**20:.0f} MiB"),
        ("bench/WEIGHTS.md", f"`{d['command']}` (`bench/results/framework-{HEADLINE}.json`, {d['revision']})"),
    ]


def train_sync() -> list[tuple[str, str]]:
    d = headline("train-sync")
    ms = {m: f"{v['median'] * 1e3:.1f} ms" for m, v in d["methods"].items()}
    ratio = {m: f"{d['methods']['naive']['median'] / v['median']:.2f}x" for m, v in d["methods"].items()}
    return [
        ("README.md", f"synced in {ms['ours']}, {ratio['ours']} faster than"),
        ("README.md", f"({ratio['ours-direct']} with `direct=True`)"),
        *(("bench/WEIGHTS.md", f"| {ms[m]} | {ratio[m]} |") for m in d["methods"]),
        ("bench/WEIGHTS.md", f"`{d['command']}` (`bench/results/train-sync-{HEADLINE}.json`, {d['revision']})"),
        ("bench/WEIGHTS.md", f"{d['model']['tensors']} tensors, {d['model']['bytes'] / 2**20:.0f} MiB"),
    ]


def example() -> list[tuple[str, str]]:
    d = headline("example-weight-sync")
    ms = {k: f"{v * 1e3:.0f} ms" for k, v in d["median_s"].items()}
    assert all(d["bit_exact"].values())
    return [
        (
            "README.md",
            f"`reshard(out=, direct=True)` {ms['reshard(out=, direct=True)']}, the default staged `out=` "
            f"{ms['reshard(out=)']}, through gloo {ms['reshard(out=, shared_memory=False)']}, Ray's object store "
            f"{ms['object store: trainers put, inference get']}, gather-to-driver "
            f"{ms['naive: gather to driver, ray.put']}",
        ),
        ("README.md", f"`python examples/weight_sync.py` ({d['tensors']} per-parameter tensors"),
    ]


def simulated() -> list[tuple[str, str]]:
    d = headline("simulated/simulated_p3.8xlarge_2hosts.json")
    small = headline("simulated-small/simulated_p3.8xlarge_2hosts.json")["random"]
    times = headline("simulated/planning_p3.16xlarge.json")["times"]
    ratio = {k: max(c["strategies"][k]["ratio"] for c in d["cases"]) for k in ("auto", "allgather", "send_recv")}
    case4 = next(c for c in d["cases"] if c["name"] == "case 4")["strategies"]["broadcast_order"]["ratio"]
    never_slower = all(
        c["strategies"]["auto"]["latency_s"] <= min(v["latency_s"] for v in c["strategies"].values()) * (1 + 1e-9)
        for c in d["cases"]
    )
    rnd = d["random"]
    cold = max(t["cpu_s"] for t in times["paper_cold"].values())
    large = max(t["cpu_s"] for t in times["large"].values())
    assert never_slower and ratio["auto"] <= 1.002
    return [
        ("README.md", f"`{d['command'].split(' --out')[0]}`): on all eight multi-sender cases"),
        ("README.md", f"the paper's own planner (`broadcast_order`) is {case4:.2f}× on case 4"),
        (
            "README.md",
            f"Alpa's `allgather` up to {ratio['allgather']:.2f}×, `send_recv` up to {ratio['send_recv']:.2f}×",
        ),
        ("README.md", f"`auto` has a geometric-mean ratio of {rnd['auto']['geomean_ratio']:.3f} to the bound"),
        ("README.md", f"(the best baseline {rnd['broadcast_order']['geomean_ratio']:.3f})"),
        ("README.md", f"for 1–64 MiB tensors {small['auto']['geomean_ratio']:.3f}"),
        ("README.md", f"paper cases ≤ {cold * 1e3:.0f} ms cold, cached ≤ {max(times['cached_us'].values()):.0f} µs"),
        ("README.md", f"1024 → 1024 devices ≤ {large:.2f} s CPU"),
        *(("bench/SIMULATED.md", row) for row in random_rows()),
    ]


def random_rows() -> list[str]:
    """SIMULATED.md's rows of random-case statistics, each from its tracked run."""
    rows = []
    for suite, cluster, label in (
        ("simulated", "p3.8xlarge", "p3.8xlarge, 64 MiB..2 GiB"),
        ("simulated-p3.16xlarge", "p3.16xlarge", "p3.16xlarge, 64 MiB..2 GiB"),
        ("simulated-small", "p3.8xlarge", "p3.8xlarge, 1 MiB..64 MiB"),
    ):
        r = headline(f"{suite}/simulated_{cluster}_2hosts.json")["random"]
        auto, best, vs = r["auto"], r["broadcast_order"]["geomean_ratio"], r["auto_vs_best_baseline"]
        bold = "**" if "GiB" in label else ""
        rows.append(
            f"| {label} | {r['cases']} | {bold}{auto['geomean_ratio']:.3f}{bold} ({auto['max_ratio']:.2f}) "
            f"| {best:.3f} "
            f"| {bold}{vs['max']:.3f}{bold} ({vs['geomean']:.3f}) |"
        )
    for suite, label in (("simulated-tiny-gloo", "gloo, windows of 4"), ("simulated-tiny", "nccl, windows of 16")):
        r = headline(f"{suite}/simulated_p3.8xlarge_2hosts.json")["random"]
        one = r["auto_one_at_a_time"]
        rows.append(
            f"| {label} | **{r['auto']['geomean_ratio']:.3f}** ({r['auto']['max_ratio']:.2f}) "
            f"| {one['geomean_ratio']:.3f} ({one['max_ratio']:.2f}) |"
        )
    return rows


def local() -> list[tuple[str, str]]:
    from bench.report import target_rows

    d = headline("local")
    target = {(t["target"], t["method"]): t for t in d["targets"]}
    kept = target[("default path faster than every peer", "ours")]
    gloo = target[("gloo path >= 85% of raw gloo (>= 64 MiB)", "ours_gloo")]
    small = target[("<= 64 KiB, cached plan: <= 1.5x an empty Ray call", "ours")]
    pooled, fresh = [], []
    for r in d["results"]:
        m = r["methods"]
        peers = [m[k]["latency_s"]["median"] for k in ("object_store", "rdt", "dtensor") if "latency_s" in m[k]]
        pooled.append(min(peers) / m["ours_pooled"]["latency_s"]["median"])
        if r["size_bytes"] >= 64 << 20:
            fresh.append(m["ours_gloo"]["frac_of_fresh_ceiling"])
    verified = sum(v.get("verified", False) for r in d["results"] for v in r["methods"].values())
    head, rows = target_rows(d)
    return [
        ("README.md", f"`{d['command']}`, 10 layout pairs × 64 KiB–256 MiB, all {verified} results"),
        (
            "README.md",
            f"faster than every peer in {kept['passed']} of {kept['cases']} comparisons (median {kept['median']:.2f}×)",
        ),
        ("README.md", f"faster than every peer in {sum(p > 1 for p in pooled)} of {len(pooled)} case-sizes"),
        ("README.md", f"Small tensors take {small['median']:.2f}× an empty Ray call"),
        ("README.md", f"median {gloo['median'] * 100:.0f} % of a raw gloo transfer"),
        ("README.md", f"{statistics.median(fresh) * 100:.0f} % of the same raw transfer into fresh memory"),
        ("README.md", f"starts in {d['startup']['ratio']:.2f}× the time of 8 bare numpy actors"),
        ("bench/LOCAL.md", f"`{d['command']}` on commit {d['revision']}"),
        *(("bench/LOCAL.md", "| " + " | ".join(row) + " |") for row in rows),
        ("bench/LOCAL.md", f"reaches a median of {statistics.median(fresh) * 100:.0f} % at >= 64 MiB"),
    ]


def pipeline() -> list[tuple[str, str]]:
    d = headline("pipeline")
    said = {t["target"]: t["value"].split()[0] for t in d["targets"]}  # "1.057 x (rounds ...)" -> "1.057"

    def value(start: str) -> str:
        return next(v for k, v in said.items() if k.startswith(start))

    error = next(v for k, v in ((t["target"], t["value"]) for t in d["targets"]) if "predicts" in k).split()[3]
    return [
        ("README.md", f"eager 1F1B takes {value('sim 4x8: eager 1F1B <= 1.10')}× the no-communication time"),
        ("README.md", f"ran at {value('real 4x8: eager 1F1B with overlap')}× the compute-only run"),
        ("README.md", f"without overlap {value('real 4x8: eager 1F1B without overlap')}× slower again"),
        ("README.md", f"predicted the real iteration times within {error.lstrip('+').rstrip('%')} %"),
        ("README.md", f"made eager 1F1B without overlap {value('real 4x8: eager 1F1B no overlap, pull')}× the time"),
        ("README.md", f"(with overlap: {value('real 4x8: eager 1F1B overlap, pull')}×)"),
        *(("bench/PIPELINE.md", f"**{v}**") for k, v in said.items() if k.startswith("real 4x8")),
        ("bench/PIPELINE.md", f"`{d['command']}` on\ncommit {d['revision']}"),
    ]


def multihost() -> list[tuple[str, str]]:
    d = headline("multihost")
    target = {t["target"].split(" (")[0]: t for t in d["targets"]}
    sim = target["simulator within 10 % of measured"]
    slower = target["auto never > 3 % slower than another plan"]
    big = {r["case"]: r["methods"] for r in d["results"] if r["size_bytes"] == 256 << 20}
    small = [r for r in d["results"] if r["size_bytes"] == 64 << 10]
    auto = [m["auto"]["x_bound"] for m in big.values()]
    ms = [r["methods"]["auto"]["latency_s"]["median"] * 1e3 for r in small]
    x_empty = [r["methods"]["auto"]["latency_s"]["median"] / r["empty_call_all_s"]["median"] for r in small]
    paper, grow = big["paper"], big["grow-2x2-3x2"]
    others = min(v["x_bound"] for k, v in grow.items() if k != "auto")
    mh = headline("multihost-weights")
    tree, one = mh["stats"]["tree"]["median"], mh["stats"]["one"]["median"]
    hidden = next(t["value"] for t in mh["targets"] if "hides" in t["target"])
    assert all(r["methods"][k]["verified"] for r in d["results"] for k in r["methods"])
    return [
        ("README.md", f"`auto` takes {min(auto):.2f}-{max(auto):.2f}× the fluid bound at 256 MiB"),
        ("README.md", f"never more than {100 * slower['worst']:.1f} % slower than another plan"),
        ("README.md", f"{paper['auto']['x_bound']:.2f}× on the paper's\n  multi-sender case"),
        (
            "README.md",
            f"(`send_recv` {paper['send_recv']['x_bound']:.2f}×, "
            f"Alpa's `allgather` {paper['allgather']['x_bound']:.2f}×, "
            f"the paper's `broadcast_order`\n  {paper['broadcast_order']['x_bound']:.2f}×)",
        ),
        ("README.md", f"{grow['auto']['x_bound']:.2f}× on a 2×2 → 3×2 mesh change (baselines ≥ {others:.2f}×)"),
        ("README.md", f"{big['rep-to-shard']['auto']['x_bound']:.2f}× on replicate → shard"),
        ("README.md", f"{big['shard-to-rep']['auto']['x_bound']:.2f}× on\n  shard → replicate"),
        (
            "README.md",
            f"within 10 % of all {sim['cases']}\n  measurements (worst {sim['worst_str']}, {sim['worst_case']})",
        ),
        (
            "README.md",
            f"small tensors at {min(ms):.0f}-{max(ms):.0f} ms,\n  {min(x_empty):.1f}-{max(x_empty):.1f}× an empty call",
        ),
        ("README.md", f"a 45 MiB sync takes {tree / mh['bound_tree_s']:.2f}× the fluid bound of its bytes"),
        ("README.md", f"(one tensor of the same\n  bytes {one / mh['bound_one_s']:.2f}×)"),
        ("README.md", f"hides {100 * hidden:.0f} % of its time"),
        ("bench/MULTIHOST.md", f"`{d['command']}` at {d['started']} (git {d['revision']})"),
        ("bench/WEIGHTS.md", f"`{mh['command']}` (root;\ncommit {mh['revision']}"),
        (
            "bench/WEIGHTS.md",
            f"| {tree * 1e3:.0f} | {mh['bound_tree_s'] * 1e3:.0f} | {tree / mh['bound_tree_s']:.2f} |",
        ),
        ("bench/WEIGHTS.md", f"| {one * 1e3:.0f} | {mh['bound_one_s'] * 1e3:.0f} | {one / mh['bound_one_s']:.2f} |"),
    ]


def gpu() -> list[tuple[str, str]]:
    d = result("gpu-20261127-h200-93fca45.json")
    whole = next(m for m in d["model"] if m["case"] == "whole-whole")
    tree, one = statistics.median(whole["ours_tree_s"]), statistics.median(whole["ours_one_s"])
    message = d["message"]
    return [
        (
            "README.md",
            f"{message['ours']['per_message_us']:.0f} µs per NCCL message through the backend against "
            f"{message['raw']['per_message_us']:.1f} µs raw",
        ),
        ("README.md", f"{whole['tensors']} tensors in {tree * 1e3:.1f} ms ({tree / one:.1f}x one tensor"),
    ]


def reading_path() -> list[tuple[str, str]]:
    d = headline("path")
    n = {
        (path, step): len(sides["all"])
        for path, steps in d.items()
        if path in ("pulls", "network")
        for step, sides in steps.items()
    }
    warm = d["pulls"]["warm"]
    return [
        ("README.md", f"(`{d['command']}`): {n['pulls', 'warm']}\nfor a repeated reshard"),
        (
            "README.md",
            f"({len(warm['driver'])} on the driver, {len(warm['devices'])} on the\ndevices), "
            f"{n['pulls', 'cold']} for its first",
        ),
        ("README.md", f"{n['network', 'warm']} and {n['network', 'cold']} through the network"),
    ]


def soak() -> list[tuple[str, str]]:
    d = headline("soak")
    dev = d["summary"]["devices"].values()
    rss = f"{min(v['rss_mib_min'] for v in dev):.1f}-{max(v['rss_mib_max'] for v in dev):.1f} MiB"
    drift = (
        f"+{min(v['rss_mib_per_1000_ops'] for v in dev):.1f} to +{max(v['rss_mib_per_1000_ops'] for v in dev):.1f} MiB"
    )
    fds = f"({min(v['fds_min'] for v in dev)}-{max(v['fds_max'] for v in dev)}, drift 0)"
    driver = d["summary"]["driver"]
    assert not d["mismatches"] and all(v["fds_min"] == v["fds_max"] for v in dev)
    return [
        ("RELIABILITY.md", f"`{d['command']}`, tracked `bench/results/soak-{HEADLINE}.json`): {d['ops']:,} operations"),
        ("RELIABILITY.md", f"in {d['elapsed_s']} s,\n0 mismatches"),
        ("RELIABILITY.md", f"RSS {rss}\n(fitted drift {drift} per 1,000 operations"),
        ("RELIABILITY.md", f"open descriptors constant\n{fds}"),
        ("RELIABILITY.md", f"the driver's RSS {driver['rss_mib_min']:.1f}-{driver['rss_mib_max']:.1f} MiB"),
    ]


CHAOS_FAULTS = {"SIGSTOP+SIGCONT": "SIGSTOP + SIGCONT", "allocation failure (RLIMIT_AS)": "allocation failure"}


def chaos_rows(summary: dict) -> list[str]:
    """RELIABILITY.md's table of a chaos run, one row per fault kind."""

    def s(v):
        return "–" if v is None else f"{v:.2f}"

    rows = []
    for kind, k in summary["by_kind"].items():
        phases = ", ".join(f"{p} {n}" for p, n in sorted(k["by_phase_transport"].items()))
        outcomes = ", ".join(f"{o} {n}" for o, n in sorted(k["outcomes"].items(), key=lambda x: (-x[1], x[0])))
        took = (
            "–"
            if k["time_to_error_max_s"] is None
            else " / ".join(s(k[f"time_to_error_{q}_s"]) for q in ("p50", "p99", "max"))
        )
        rows.append(
            f"| {CHAOS_FAULTS.get(kind, kind)} | {k['steps']} ({phases}) | {outcomes} | {k['timeout_s']:g} | {took} "
            f"| {k['over_timeout_plus_2s']} |"
        )
    return rows


def faults() -> list[tuple[str, str]]:
    one = result(CHAOS)["summary"]  # one commit after the headline (RELIABILITY.md says why)
    syncs = sum(n for k, n in one["steps_by_kind"].items() if k.startswith("model sync"))
    hosts = headline("netchaos")["summary"]
    over = max(k["time_to_error_max_s"] - k["timeout_s"] for k in hosts["by_kind"].values() if k["time_to_error_max_s"])
    soak = headline("task-soak")
    commit = headline("commit-chaos")["summary"]
    assert not one["violations"] and not hosts["violations"] and not commit["violations"]
    return [
        ("README.md", f"{one['steps']} seeded chaos steps with {one['faults_injected']} injected faults"),
        ("README.md", f"{syncs} whole-model `out=`\n  syncs"),
        ("README.md", f"with {one['commit_time_faults']} faults at commit time"),
        (
            "RELIABILITY.md",
            f"{one['steps']} steps (reshard {one['steps_by_kind']['reshard']}, as a Work "
            f"{one['steps_by_kind']['reshard, async_op']}; model syncs\n{syncs}",
        ),
        ("RELIABILITY.md", f"**{one['commit_time_faults']} of\nthem at commit time, 0 invariant violations"),
        ("RELIABILITY.md", f"report tracked:\n`bench/results/{CHAOS}`"),
        *(("RELIABILITY.md", row) for row in chaos_rows(one)),
        (
            "README.md",
            f"{hosts['steps']} seeded steps with {hosts['faults_injected']} faults "
            f"({hosts['faults_landed']} landed), 0 invariant violations",
        ),
        ("README.md", f"every failed call raised within timeout + {over:.2f} s"),
        ("README.md", f"{soak['processes']} short-lived processes each pushing a"),
        (
            "README.md",
            f"{commit['steps']} whole-model `out=`\n  syncs with {commit['caller_kills']} caller kills, "
            f"{commit['commit_time_faults']} of them during a commit",
        ),
        (
            "RELIABILITY.md",
            f"{commit['steps']} steps, **{commit['caller_kills']} caller kills, {commit['commit_time_faults']} "
            f"of them during a commit, 0 violations**; {commit['landed']} syncs",
        ),
    ]


def weights() -> list[tuple[str, str]]:
    from bench.weights_report import _ms

    d = result(f"weights-{WEIGHTS_RUN}.json")
    fit = d["fit"]
    rows = []
    for r in d["results"]:
        m = r["methods"]
        med = {k: v["latency_s"]["median"] for k, v in m.items()}
        cells = [med["ours"], med["ours_gloo"], m["ours_async"]["return_s"]["median"], med["per_tensor_loop"]]
        cells += [med[k] for k in ("one_tensor", "object_store", "naive_refit", "rdt")]
        rows.append(f"| {r['model']} | {r['case']} | " + " | ".join(_ms(c) for c in cells) + " |")
    span = {k: f"{min(v):.1f}-{max(v):.1f}×" for k, v in tree_ratios(d).items()}
    moe_run = result(MOE)
    moe = moe_run["results"][0]
    moe_ours, moe_one = moe["methods"]["ours"], moe["methods"]["one_tensor"]
    ab_rows = [row for base, new, rounds in AB for row in ab_table(base, new, rounds)]
    ab_rows += [row for base, new, rounds in AB_MOE for row in ab_table(base, new, rounds, ("moe",))]
    per_tensor = (
        f"{fit['default']['per_tensor_s'] * 1e3:.3f} ms (default path), "
        f"{fit['gloo']['per_tensor_s'] * 1e3:.3f} ms (gloo)"
    )
    return [
        ("README.md", f"per-tensor cost at {per_tensor}"),
        (
            "README.md",
            f"a tree still takes {span['gpt2']} one tensor of the same bytes for the 148-tensor model and "
            f"{span['qwen3']} for the 311-tensor one",
        ),
        ("bench/WEIGHTS.md", f"`{d['command']}` (`bench/results/weights-{WEIGHTS_RUN}.json`, {d['revision']}"),
        *(("bench/WEIGHTS.md", row) for row in rows),
        ("bench/WEIGHTS.md", f"default path {fit['default']['per_tensor_s'] * 1e3:.3f} ms per tensor"),
        ("bench/WEIGHTS.md", f"`{moe_run['command']}` (`bench/results/{MOE}`, {moe_run['revision']}"),
        *(("bench/WEIGHTS.md", row) for row in ab_rows),
        (
            "README.md",
            f"its first call in {moe_ours['first_s']:.2f} s, a replay in {moe_ours['latency_s']['median']:.2f} s "
            f"({moe_ours['latency_s']['median'] / moe_one['latency_s']['median']:.0f}× one tensor of the same bytes)",
        ),
        (
            "bench/WEIGHTS.md",
            f"First call (compile, ship, run) {moe_ours['first_s']:.2f} s; replay median "
            f"{moe_ours['latency_s']['median']:.2f} s against {moe_one['latency_s']['median'] * 1e3:.1f} ms",
        ),
        (
            "bench/WEIGHTS.md",
            f"{min(moe['descriptors'])}-{max(moe['descriptors'])} open descriptors per device after the case",
        ),
    ]


def replays() -> list[tuple[str, str]]:
    """WEIGHTS.md's latest figures for replays into kept outputs (``out=``): the MoE tree's and the
    Qwen3 tree's, of two runs each."""
    moe, final = result(REPLAYS_MOE[0]), result(REPLAYS_MOE[1])
    m, f = (medians(d["results"][0]) for d in (moe, final))
    first = moe["results"][0]["methods"]["ours"]["first_s"]
    before, after = (result(name) for name in REPLAYS_QWEN3)
    out, fresh, was = ratios(after, "ours_out", "one_tensor_out"), ratios(after, "ours"), ratios(before, "ours")
    return [
        (
            "bench/WEIGHTS.md",
            f"At {moe['revision']} (`--out bench/results/{REPLAYS_MOE[0]}`): fresh outputs {m['ours']:.2f} s "
            f"(first call {first:.2f} s), `out=` {m['ours_out']:.2f} s "
            f"({m['ours_out'] / m['one_tensor_out']:.1f}× one tensor's {m['one_tensor_out'] * 1e3:.1f} ms with "
            f"`out=`), `out=` with `direct=True` {m['ours_direct']:.2f} s, one tensor {m['one_tensor'] * 1e3:.1f} ms "
            "fresh",
        ),
        (
            "bench/WEIGHTS.md",
            f"At {final['revision']}, where a device's commit finds its outputs from its run's program and binding "
            f"instead of receiving 20,016 names again (`--out bench/results/{REPLAYS_MOE[1]}`, a slower sitting: one "
            f"tensor took {f['one_tensor'] * 1e3:.1f} ms against {m['one_tensor'] * 1e3:.1f} ms above): fresh outputs "
            f"{f['ours']:.2f} s, `out=` {f['ours_out']:.2f} s ({f['ours_out'] / f['one_tensor_out']:.1f}× one "
            f"tensor's {f['one_tensor_out'] * 1e3:.1f} ms with `out=`), `out=` with `direct=True` "
            f"{f['ours_direct']:.2f} s.",
        ),
        (
            "bench/WEIGHTS.md",
            f"`{after['command']}`): `out=` {ratio_span(out)} one tensor with `out=` ({within(out)} of 5), "
            f"fresh outputs {ratio_span(fresh)} ({within(fresh)} of 5; fsdp2-tp4 the one over; the same command at "
            f"{before['revision']}, `bench/results/{REPLAYS_QWEN3[0]}`, measured {ratio_span(was)}, "
            f"{within(was)} of 5).",
        ),
    ]


def block_commits() -> list[tuple[str, str]]:
    """WEIGHTS.md's figures for the replays at the commit that copies a unit's results block to
    block and makes a call of the same objects again: the MoE tree's and the Qwen3 tree's."""
    moe, qwen3 = (result(name) for name in BLOCKS)
    m = medians(moe["results"][0])
    out, fresh = ratios(qwen3, "ours_out", "one_tensor_out"), ratios(qwen3, "ours")
    over = [c["case"] for c, r in zip(qwen3["results"], out, strict=True) if r > 1.5]
    return [
        (
            "bench/WEIGHTS.md",
            f"At {moe['revision']} (`--out bench/results/{BLOCKS[0]}`): `out=` {m['ours_out']:.2f} s "
            f"({m['ours_out'] / m['one_tensor_out']:.1f}× one tensor's {m['one_tensor_out'] * 1e3:.1f} ms with "
            f"`out=`), `out=` with `direct=True` {m['ours_direct']:.2f} s, fresh outputs {m['ours']:.2f} s "
            f"({m['ours'] / m['one_tensor']:.1f}× one tensor's {m['one_tensor'] * 1e3:.1f} ms)",
        ),
        (
            "bench/WEIGHTS.md",
            f"Qwen3 at {qwen3['revision']} (`bench/results/{BLOCKS[1]}`, the command above): `out=` "
            f"{ratio_span(out)} one tensor with `out=` ({within(out)} of 5; {', '.join(over) or 'none'} over), "
            f"fresh outputs {ratio_span(fresh)} ({within(fresh)} of 5)",
        ),
    ]


def cheaper_commits() -> list[tuple[str, str]]:
    """WEIGHTS.md's and README's figures for the replays once a commit reads the caller's results
    first and a direct write copies block to block, against the block commits' run before."""
    (moe, qwen3), before = (result(name) for name in COMMITS), medians(result(BLOCKS[0])["results"][0])
    alike = result(ALIKE)
    m = medians(moe["results"][0])
    out, fresh = ratios(qwen3, "ours_out", "one_tensor_out"), ratios(qwen3, "ours")
    over = [c["case"] for c, r in zip(qwen3["results"], out, strict=True) if r > 1.5]
    first = first_of(moe, "ours_out")
    tp4 = [medians(c)["one_tensor_out"] * 1e3 for c in qwen3["results"] if c["case"].endswith("tp4")]
    old_tp4 = [medians(c)["one_tensor_out"] * 1e3 for c in result(BLOCKS[1])["results"] if c["case"].endswith("tp4")]
    return [
        (
            "bench/WEIGHTS.md",
            f"At {moe['revision']} (the replay command above with `--out bench/results/{COMMITS[0]}`): `out=` "
            f"{m['ours_out']:.2f} s ({m['ours_out'] / m['one_tensor_out']:.1f}× one tensor's "
            f"{m['one_tensor_out'] * 1e3:.1f} ms with `out=`), `out=` with `direct=True` {m['ours_direct']:.2f} s, "
            f"fresh outputs {m['ours']:.2f} s ({m['ours'] / m['one_tensor']:.1f}× one tensor's "
            f"{m['one_tensor'] * 1e3:.1f} ms); the first `out=` call {first:.2f} s",
        ),
        ("bench/WEIGHTS.md", f"one tensor's `out=` fell by a larger share ({before['one_tensor_out'] * 1e3:.1f} ms at"),
        (
            "bench/WEIGHTS.md",
            f"Qwen3 at {qwen3['revision']} (`bench/results/{COMMITS[1]}`, the Qwen3 command above): `out=` "
            f"{ratio_span(out)} one tensor with `out=` ({within(out)} of 5; {', '.join(over) or 'none'} over), "
            f"fresh outputs {ratio_span(fresh)} ({within(fresh)} of 5); one tensor's `out=` in the two tp4 cases "
            f"{tp4[0]:.1f} and {tp4[1]:.1f} ms ({old_tp4[0]:.1f} and {old_tp4[1]:.1f} ms at 6011c48)",
        ),
        (
            "README.md",
            f"A replay of it into kept outputs (`out=`, a weight sync's step) takes {m['ours_out']:.2f} s, "
            f"{m['ours_out'] / m['one_tensor_out']:.1f}× one tensor of the same bytes with `out=` "
            f"({m['one_tensor_out'] * 1e3:.1f} ms, {before['one_tensor_out'] * 1e3:.1f} ms before a commit's fixed "
            f"cost fell, when the replay took {before['ours_out']:.2f} s, "
            f"{before['ours_out'] / before['one_tensor_out']:.1f}×",
        ),
        ("README.md", f"2×, not met), and {m['ours_direct']:.2f} s with `direct=True`."),
        (
            "bench/WEIGHTS.md",
            f"The same command at {alike['revision']} (`bench/results/{ALIKE}`, a slower sitting: fresh outputs "
            f"{medians(alike['results'][0])['ours']:.2f} s): the first `out=` call "
            f"{first_of(alike, 'ours_out'):.2f} s; "
            f"the first `direct=True` call {first_of(alike, 'ours_direct'):.2f} s",
        ),
    ]


def first_of(run: dict, method: str) -> float:
    """The first timed call of ``method`` (a sync's first ``out=`` call: its first round)."""
    return run["results"][0]["methods"][method]["latency_s"]["samples"][0]


def medians(case: dict) -> dict[str, float]:
    return {k: v["latency_s"]["median"] for k, v in case["methods"].items()}


def ratios(run: dict, method: str, base: str = "one_tensor") -> list[float]:
    """Each case's median of ``method`` over that of ``base``."""
    return [medians(case)[method] / medians(case)[base] for case in run["results"]]


def ratio_span(r: list[float]) -> str:
    return f"{min(r):.2f}-{max(r):.2f}×"


def within(r: list[float], bound: float = 1.5) -> int:
    """How many of the ratios ``r`` are at most ``bound`` (issue 30's 1.5×)."""
    return sum(x <= bound for x in r)


def latest_ab() -> list[tuple[str, str]]:
    """The README's sentences on the latest A/B of the weight sync (its last row of ``AB``)."""
    base, new, rounds = AB[-1]
    runs = {
        (m, rev): [result(f"weights-{m}-{rev}-ab{r}.json") for r in range(1, rounds + 1)]
        for m in ("moe", "trees")
        for rev in (base, new)
    }
    qwen3 = [tree_ratios(d)["qwen3"] for d in runs["trees", new]]
    medians = [statistics.median(q) for q in qwen3]
    within = sum(r <= 1.5 for q in qwen3 for r in q)

    def span(rev: str, figure, method: str) -> str:
        got = [figure(d["results"][0]["methods"][method]) for d in runs["moe", rev]]
        low, high = f"{min(got):.2f}", f"{max(got):.2f}"
        return f"{low} s" if low == high else f"{low}-{high} s"

    def replays(rev: str, method: str = "ours") -> str:
        return span(rev, lambda ours: ours["latency_s"]["median"], method)

    def first_calls(rev: str, method: str = "ours") -> str:
        return span(rev, lambda ours: ours["first_s"], method)

    return [
        (
            "README.md",
            f"in the latest, the 311-tensor tree takes {min(map(min, qwen3)):.2f}-{max(map(max, qwen3)):.2f}× "
            "(median case "
            f"{min(medians):.2f}-{max(medians):.2f}×; {within} of {sum(map(len, qwen3))} case-rounds within 1.5×)",
        ),
        (
            "README.md",
            f"latest A/B, a replay in {replays(new)} against {replays(base)} for the commit before, and a first call "
            f"in {first_calls(new)} against {first_calls(base)}",
        ),
        (
            "README.md",
            f"over gloo (the path between machines) a replay in {replays(new, 'ours_gloo')} against "
            f"{replays(base, 'ours_gloo')}, and a first call in {first_calls(new, 'ours_gloo')} against "
            f"{first_calls(base, 'ours_gloo')}",
        ),
    ]


def tree_ratios(d: dict, tree: str = "ours", one: str = "one_tensor") -> dict[str, list[float]]:
    """Per model of a weights run: each case's tree median over one tensor's (of the methods
    ``tree`` and ``one``: the default path's, or gloo's)."""
    out: dict[str, list[float]] = {}
    for r in d["results"]:
        med = {k: v["latency_s"]["median"] for k, v in r["methods"].items()}
        out.setdefault(r["model"], []).append(med[tree] / med[one])
    return out


def ab_table(base: str, new: str, rounds: int, models=("moe", "trees")) -> list[str]:
    """The rows of a WEIGHTS.md table of an A/B of commits ``base`` and ``new`` (``rounds`` each),
    of the MoE tree and the two smaller trees, or of the ``models`` given."""
    files = [f"weights-{m}-{rev}-ab{r}.json" for m in models for rev in (base, new) for r in range(1, rounds + 1)]
    runs = {name: result(name) for name in files}

    def row(what: str, model: str, cell) -> str:
        sides = [
            ", ".join(cell(runs[f"weights-{model}-{rev}-ab{r}.json"]) for r in range(1, rounds + 1))
            for rev in (base, new)
        ]
        return f"| {what} | {sides[0]} | {sides[1]} |"

    def median(d: dict, method: str) -> float:
        return d["results"][0]["methods"][method]["latency_s"]["median"]

    def span(model: str, tree: str = "ours", one: str = "one_tensor"):
        def cell(d: dict) -> str:
            ratios = tree_ratios(d, tree, one)[model]
            return f"{min(ratios):.2f}-{max(ratios):.2f}×"

        return cell

    gloo = all("ours_gloo" in d["results"][0]["methods"] for d in runs.values())  # both paths measured
    rows = [
        row("MoE replay, median", "moe", lambda d: f"{median(d, 'ours'):.2f} s"),
        row("MoE first call", "moe", lambda d: f"{d['results'][0]['methods']['ours']['first_s']:.2f} s"),
        row(
            "MoE against one tensor of the same bytes",
            "moe",
            lambda d: f"{median(d, 'ours') / median(d, 'one_tensor'):.0f}×",
        ),
    ]
    if gloo:
        rows += [
            row("MoE over gloo, replay median", "moe", lambda d: f"{median(d, 'ours_gloo'):.2f} s"),
            row(
                "MoE over gloo, first call",
                "moe",
                lambda d: f"{d['results'][0]['methods']['ours_gloo']['first_s']:.2f} s",
            ),
            row(
                "MoE over gloo against one tensor over gloo",
                "moe",
                lambda d: f"{median(d, 'ours_gloo') / median(d, 'one_tensor_gloo'):.0f}×",
            ),
        ]
    if "trees" not in models:
        return rows
    rows += [
        row("GPT-2 tree against one tensor", "trees", span("gpt2")),
        row("Qwen3 tree against one tensor", "trees", span("qwen3")),
        row(
            "per-tensor cost in the fit (GPT-2 and Qwen3)",
            "trees",
            lambda d: f"{d['fit']['default']['per_tensor_s'] * 1e3:.3f} ms",
        ),
    ]
    if gloo:
        rows += [
            row(
                "Qwen3 tree over gloo against one tensor over gloo",
                "trees",
                span("qwen3", "ours_gloo", "one_tensor_gloo"),
            ),
            row(
                "per-tensor cost in the fit over gloo",
                "trees",
                lambda d: f"{d['fit']['gloo']['per_tensor_s'] * 1e3:.3f} ms",
            ),
        ]
    return rows


CLAIMS = [
    *framework(),
    *train_sync(),
    *example(),
    *weights(),
    *latest_ab(),
    *replays(),
    *block_commits(),
    *cheaper_commits(),
    *simulated(),
    *local(),
    *pipeline(),
    *multihost(),
    *gpu(),
    *faults(),
    *soak(),
    *reading_path(),
]


@pytest.mark.parametrize("doc, text", CLAIMS, ids=[f"{d}: {t[:48]}" for d, t in CLAIMS])
def test_a_published_figure_reads_as_its_result_file_says(doc, text):
    body = " ".join((ROOT / doc).read_text().split())  # line breaks of the text do not count
    assert " ".join(text.split()) in body, f"{doc} should say {text!r} (its tracked result file does)"


def test_every_quoted_result_names_a_clean_revision_and_its_command():
    """A figure's result file says which commit it measured (a clean tree: no ``+dirty``) and the exact
    command; the headline figures all come from one commit."""
    for name in sorted(set(QUOTED)):
        data = json.loads((RESULTS / name).read_text())
        rev = data.get("revision") or data.get("git") or ""
        assert rev and rev != "unknown" and not rev.endswith("+dirty"), f"{name} names no clean revision ({rev!r})"
        assert data.get("command"), f"{name} records no command"
        if f"-{HEADLINE}" in name:
            assert rev == HEADLINE, f"{name} measured {rev}, not the headline commit {HEADLINE}"
