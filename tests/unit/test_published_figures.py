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


def result(name: str) -> dict:
    path = RESULTS / name
    assert path.is_file(), f"{name} is quoted but not tracked"
    return json.loads(path.read_text())


def framework() -> list[tuple[str, str]]:
    d = result("framework-20261127-213001.json")
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
        ("bench/WEIGHTS.md", f"(`bench/results/framework-20261127-213001.json`, {d['revision']})"),
    ]


def train_sync() -> list[tuple[str, str]]:
    d = result("train-sync-20261127-213022.json")
    ms = {m: f"{v['median'] * 1e3:.1f} ms" for m, v in d["methods"].items()}
    ratio = {m: f"{d['methods']['naive']['median'] / v['median']:.2f}x" for m, v in d["methods"].items()}
    return [
        ("README.md", f"synced in {ms['ours']}, {ratio['ours']} faster than"),
        ("README.md", f"({ratio['ours-direct']} with `direct=True`)"),
        *(("bench/WEIGHTS.md", f"| {ms[m]} | {ratio[m]} |") for m in d["methods"]),
        ("bench/WEIGHTS.md", f"(`bench/results/train-sync-20261127-213022.json`, {d['revision']})"),
        ("bench/WEIGHTS.md", f"{d['model']['tensors']} tensors, {d['model']['bytes'] / 2**20:.0f} MiB"),
    ]


def pipeline() -> list[tuple[str, str]]:
    d = result("pipeline-20261126-062238.json")
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
        ("README.md", f"(with overlap: the same, {value('real 4x8: eager 1F1B overlap, pull')}×)"),
    ]


def multihost() -> list[tuple[str, str]]:
    def target(name: str, start: str) -> dict:
        return next(t for t in result(name)["targets"] if t["target"].startswith(start))

    before = target("multihost-20261123-windows.json", "simulator within 10 %")
    sim = target("multihost-20261124-duplex.json", "simulator within 10 %")
    bound = target("multihost-20261124-duplex.json", "auto <= 1.15x")
    assert before["passed"] == before["cases"]
    return [
        ("README.md", f"simulator is within 10 % of all {before['cases']} measurements"),
        ("README.md", f"the simulator within 10 % of {sim['passed']} of {sim['cases']}"),
        ("README.md", f"(worst {100 * sim['worst']:+.1f} %, {sim['worst_case']})"),
        ("README.md", f"within {bound['worst_str'].removesuffix('x')}× of the bound on all four cases"),
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


def faults() -> list[tuple[str, str]]:
    one = result("chaos-20261128-27c26e7.json")["summary"]
    syncs = sum(n for k, n in one["steps_by_kind"].items() if k.startswith("model sync"))
    hosts = result("netchaos-20261127-42c30d3.json")["summary"]
    over = max(k["time_to_error_max_s"] - k["timeout_s"] for k in hosts["by_kind"].values() if k["time_to_error_max_s"])
    soak = result("task-soak-20261127.json")
    commit = result("commit-chaos-20261128-b9002a2.json")["summary"]
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
    d = result("weights-20261128-faef63d.json")
    fit = d["fit"]
    ratios: dict[str, list[float]] = {}
    for r in d["results"]:
        m = r["methods"]
        ratios.setdefault(r["model"], []).append(
            m["ours"]["latency_s"]["median"] / m["one_tensor"]["latency_s"]["median"]
        )
    span = {k: f"{min(v):.1f}-{max(v):.1f}×" for k, v in ratios.items()}
    (moe,) = result("weights-moe-20261128-faef63d.json")["results"]
    moe_ours, moe_one = moe["methods"]["ours"], moe["methods"]["one_tensor"]
    return [
        (
            "README.md",
            f"per-tensor cost at {fit['default']['per_tensor_s'] * 1e3:.3f} ms (default path), "
            f"{fit['gloo']['per_tensor_s'] * 1e3:.3f} ms (gloo)",
        ),
        (
            "README.md",
            f"a tree still takes {span['gpt2']} one tensor of the same bytes for the 148-tensor model and "
            f"{span['qwen3']} for the 311-tensor one",
        ),
        ("bench/WEIGHTS.md", f"default path {fit['default']['per_tensor_s'] * 1e3:.3f} ms per tensor"),
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


CLAIMS = [*framework(), *train_sync(), *pipeline(), *multihost(), *gpu(), *faults(), *weights()]


@pytest.mark.parametrize("doc, text", CLAIMS, ids=[f"{d}: {t[:48]}" for d, t in CLAIMS])
def test_a_published_figure_reads_as_its_result_file_says(doc, text):
    body = " ".join((ROOT / doc).read_text().split())  # line breaks of the text do not count
    assert " ".join(text.split()) in body, f"{doc} should say {text!r} (its tracked result file does)"
