"""Figures between GPUs, predicted from one GPU's: ``python -m bench gpu-predict [options]``.

One lent GPU measures what one GPU can (``python -m bench gpu``): its copy peak, the backend's
cost per NCCL message beside raw NCCL's, and what a whole model costs beyond its bytes. It cannot
measure NCCL between GPUs, over NVLink or a network. This predicts a weight sync there (a trainer's
FSDP shards into an inference engine's tensor-parallel ones), for our reshard and for the
gather-and-broadcast refit, from those measured figures and the plan, as a sum of parts:

- ``transfer``: the plan's messages (its buckets and its tensors' unpacked transfers, in the
  order a device issues them, NCCL windows) through the flow simulator (``topology.simulator``) on
  a ``Cluster`` preset: 8 GPUs a node joined by NVLink 4 through NVSwitch (``dgx-h100``: 450 GB/s
  per GPU and direction, as an H200 node's), nodes joined by 8 x 400 Gbit/s NICs;
- ``messages``: the most messages one device takes part in, times the backend's measured cost per
  message above raw NCCL's (``message``: between its cost in groups of 64 and alone, a range);
- ``copies``: the most bytes one device packs into and unpacks out of buckets, at the copy peak
  (``copy``), but for the windows it packs while the window before moves or unpacks while the
  next moves (double-buffered: ``BatchDeviceProgram.packed_ahead``, ``unpacked_behind``), which
  those windows' messages hide (the copy peak is 4.6 times the link's rate);
- ``tensors``: the measured cost per tensor inside a device (``model``: its whole-model call less
  its one-tensor call, per tensor) times the tree's tensors but one; every device does its own at
  once;
- ``fixed``: what one tensor's call costs beyond its copy (``model``: wall time less the bytes at
  the copy peak): Ray's round trip, the driver, the device's work for a call and for one tensor.

The refit is per tensor: the trainer's other ranks send their shards to rank 0 and rank 0
broadcasts the whole tensor to every inference GPU, at raw NCCL's cost per message, with no
Python cost of its own: a floor on its time, so its ratio to ours is a floor on ours beating it.

Every figure here is a prediction, never a measurement. The simulator's model and the preset's
link figures (vendor figures, not measured here) bound it; the parts are added as if none
overlapped; the cost per message comes from a one-rank communicator and the cost per tensor from
the CUDA IPC path on one GPU, and NCCL between GPUs may cost more of both. Pure: no Ray, no GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.gpu import qwen3_spec
from bench.provenance import header
from reshard import Layout, Replicate, Shard
from reshard.ir.plan import sim_transfers
from reshard.ir.program import Broadcast, Recv, Send
from reshard.ir.target import target_for
from reshard.passes.compile import BatchItem, CompileOptions, compile_batch
from topology import Cluster
from topology.simulator import SimKind, SimTransfer, simulate_transfers

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results"
#: The one-GPU runs the figures come from (``bench/GPU.md``): the later of two files that both
#: measured a figure gives it.
MEASURED = (
    RESULTS / "gpu-20261127-h200-13845be.json",
    RESULTS / "gpu-20261127-h200-93fca45.json",
)
PRESET = "dgx-h100"
#: Issue 30's target for a state dict against one tensor of the same bytes.
TREE_OVER_ONE = 1.3
DTYPE, ITEMSIZE = "bfloat16", 2
#: Qwen3-8B (its config.json): a model whose bytes, not its tensor count, decide.
QWEN3_8B = {"hidden": 4096, "heads": 32, "kv_heads": 8, "head_dim": 128, "mlp": 12288, "vocab": 151936, "layers": 36}


@dataclass(frozen=True)
class Figures:
    """What the one-GPU run measured, each with the file it came from (``sources``)."""

    copy_peak_Bps: float
    message_extra_s: tuple[float, float]  # (in groups of 64, alone): ours less raw NCCL's
    raw_message_s: float
    per_tensor_s: float
    fixed_s: float
    sources: dict


def measured(paths=MEASURED) -> Figures:
    """The figures of the one-GPU result files ``paths`` (module docstring); raises ``ValueError``
    naming the part no file has."""
    found: dict = {}
    for path in paths:
        data = json.loads(Path(path).read_text())
        for part in ("copy", "message", "model"):
            if part in data:
                found[part] = (data[part], Path(path).name)
    missing = [p for p in ("copy", "message", "model") if p not in found]
    if missing:
        raise ValueError(f"no result file among {[str(p) for p in paths]} has the part(s) {missing} of bench gpu")
    copy, message, models = (found[p][0] for p in ("copy", "message", "model"))
    whole = next((m for m in models if m["case"] == "whole-whole"), None)
    if whole is None:
        raise ValueError(f"{found['model'][1]}: its model part has no whole-whole case")
    peak = copy["copy_peak_GBps"] * 1e9
    ours, raw = message["ours"], message["raw"]
    extra = (
        ours["per_message_in_group_of_64_us"] * 1e-6 - raw["per_message_in_group_of_64_us"] * 1e-6,
        ours["per_message_us"] * 1e-6 - raw["per_message_us"] * 1e-6,
    )
    tree, one = whole["ours_tree_split"], whole["ours_one_split"]
    return Figures(
        copy_peak_Bps=peak,
        message_extra_s=extra,
        raw_message_s=raw["per_message_us"] * 1e-6,
        per_tensor_s=max(0.0, tree["device_call_s"] - one["device_call_s"]) / whole["tensors"],
        fixed_s=max(0.0, one["wall_s"] - whole["bytes"] / peak),
        sources={p: name for p, (_, name) in found.items()},
    )


@dataclass(frozen=True)
class Case:
    """A weight sync to predict: ``model`` (a spec as ``qwen3_spec`` gives: name, shape, tensor-
    parallel dim or None) from FSDP over ``trainers`` GPUs of node 0 to tensor parallelism over
    ``engines`` GPUs of node ``engine_node``, its first GPU after the trainers' on one node."""

    name: str
    model: str
    trainers: int
    engines: int
    engine_node: int

    @property
    def nodes(self) -> int:
        return self.engine_node + 1


CASES = (
    Case("Qwen3-0.6B, one node: FSDP 4 GPUs -> TP 4 GPUs", "qwen3-0.6b", 4, 4, 0),
    Case("Qwen3-0.6B, two nodes: FSDP 8 -> TP 8", "qwen3-0.6b", 8, 8, 1),
    Case("Qwen3-8B, one node: FSDP 4 GPUs -> TP 4 GPUs", "qwen3-8b", 4, 4, 0),
    Case("Qwen3-8B, two nodes: FSDP 8 -> TP 8", "qwen3-8b", 8, 8, 1),
)


def spec_of(model: str):
    """``model``'s state dict as ``qwen3_spec`` gives it."""
    if model == "qwen3-0.6b":
        return qwen3_spec()
    if model == "qwen3-8b":
        return qwen3_spec(config=QWEN3_8B)
    raise ValueError(f"unknown model {model!r}; choose qwen3-0.6b or qwen3-8b")


def meshes(case: Case):
    """``case``'s cluster, trainers' mesh and engines' mesh (each a host's row of GPUs)."""
    cluster = Cluster.preset(PRESET, case.nodes)
    first = 0 if case.engine_node else case.trainers
    if first + case.engines > cluster.devices_per_host or case.trainers > cluster.devices_per_host:
        raise ValueError(f"{case.name}: more GPUs than a node of {PRESET} has ({cluster.devices_per_host})")
    trainers = cluster.mesh((1, case.trainers), hosts=(0,))
    engines = cluster.mesh((1, case.engines), hosts=(case.engine_node,), devices=range(first, first + case.engines))
    return cluster, trainers, engines


def predict(case: Case, figures: Figures, one_tensor: bool = False) -> dict:
    """Our reshard of ``case``'s model (or of one tensor of its bytes, split on dim 0 both sides)
    and the refit's, as the module docstring sums them."""
    cluster, trainers, engines = meshes(case)
    spec = spec_of(case.model)
    if one_tensor:
        nbytes = sum(math.prod(shape) for _, shape, _ in spec) * ITEMSIZE
        spec = [("one", (nbytes // ITEMSIZE // 1024, 1024), 0)]
    items = [
        BatchItem(
            tuple(shape),
            DTYPE,
            Layout(trainers, (Replicate(), Shard(0))),
            Layout(engines, (Replicate(), Replicate() if dim is None else Shard(dim))),
        )
        for _, shape, dim in spec
    ]
    target = target_for("nccl")
    batch = compile_batch(
        items, cluster=cluster, options=CompileOptions.for_target(target), bucket_bytes=target.bucket_bytes
    )
    transfers, messages, copied = _transfers(batch)
    hosts = {d: h for c in batch.tensors for d, h in c.plan.host_map.items()}
    sim = simulate_transfers(
        transfers, hosts, cluster, backend="nccl", window=target.window_ops, window_bytes=target.window_bytes
    )
    most = max(messages.values(), default=0)
    parts = {
        "transfer_s": sim.makespan_s,
        "messages_s": [most * e for e in figures.message_extra_s],
        "copies_s": max(copied.values(), default=0) / figures.copy_peak_Bps,
        "tensors_s": figures.per_tensor_s * (len(spec) - 1),  # the first: in ``fixed``
        "fixed_s": figures.fixed_s,
    }
    base = parts["transfer_s"] + parts["copies_s"] + parts["tensors_s"] + parts["fixed_s"]
    return {
        "tensors": len(spec),
        "bytes": sum(math.prod(shape) for _, shape, _ in spec) * ITEMSIZE,
        "messages_per_device": most,
        "parts": parts,
        "ours_s": [base + m for m in parts["messages_s"]],
        "bound_s": batch.lower_bound_s(cluster),
        "refit_s": _refit_s(spec, cluster, trainers, engines, figures.raw_message_s),
    }


def _transfers(batch):
    """The batch's messages for the simulator (its buckets, then every tensor's transfers that no
    bucket carries, in order), each device's message count, and the bytes it packs and unpacks
    that no window's messages hide (module docstring)."""
    buckets: dict = {}
    messages: dict[int, int] = {}
    copied: dict[int, int] = {}
    packed = set()
    for p in batch.program.devices:
        for window, ahead, behind in zip(p.issue_windows, p.packed_ahead, p.unpacked_behind, strict=True):
            for b in window:
                buckets[b.step] = b
                messages[p.device] = messages.get(p.device, 0) + 1
                hidden = ahead if b.group[0] == p.device else behind
                copied[p.device] = copied.get(p.device, 0) + (0 if hidden else sum(q.nbytes for q in b.pieces))
                packed.update((piece.tensor, piece.step) for piece in b.pieces)
        for part in p.parts:
            n = sum(isinstance(op, (Send, Recv, Broadcast)) for op in part.program.all_ops)
            messages[p.device] = messages.get(p.device, 0) + n
    out = []
    for step in sorted(buckets):
        group, nbytes = buckets[step].group, buckets[step].nbytes
        kind = SimKind.P2P if len(group) == 2 else SimKind.BROADCAST
        out.append(SimTransfer(kind, group[0], tuple(group[1:]), nbytes))
    for t, c in enumerate(batch.tensors):
        for i, s in enumerate(sim_transfers(c.plan.transfers, c.plan.itemsize)):
            if (t, i) not in packed:
                out.append(s)
    return out, messages, copied


def _refit_s(spec, cluster, trainers, engines, per_message_s: float) -> float:
    """The gather-and-broadcast refit (module docstring), simulated tensor by tensor."""
    root, others = trainers.device_ids[0], trainers.device_ids[1:]
    transfers, messages = [], 0
    for _, shape, _ in spec:
        nbytes = math.prod(shape) * ITEMSIZE
        shard = nbytes // len(trainers.device_ids)
        transfers += [SimTransfer(SimKind.P2P, d, (root,), shard) for d in others]
        transfers.append(SimTransfer(SimKind.BROADCAST, root, tuple(engines.device_ids), nbytes))
        messages += len(others) + 1
    hosts = dict(zip(trainers.device_ids, trainers.host_ids, strict=True))
    hosts.update(zip(engines.device_ids, engines.host_ids, strict=True))
    sim = simulate_transfers(transfers, hosts, cluster, backend="nccl")
    return sim.makespan_s + messages * per_message_s


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench gpu-predict", description=__doc__.split("\n\n")[0])
    ap.add_argument("--from", dest="paths", nargs="+", type=Path, default=list(MEASURED), help="one-GPU result files")
    ap.add_argument("--cases", nargs="+", choices=[c.model for c in CASES] + ["all"], default=["all"])
    ap.add_argument("--out", type=Path, default=None, help="write the predictions as JSON here")
    args = ap.parse_args(argv)
    figures = measured(args.paths)
    cases = [c for c in CASES if "all" in args.cases or c.model in args.cases]
    rows = []
    for case in cases:
        tree, one = predict(case, figures), predict(case, figures, one_tensor=True)
        rows.append({"case": case.name, "model": case.model, "tree": tree, "one_tensor": one, **_targets(tree, one)})
    _print(rows, figures)
    if args.out is not None:
        result = {**header("python -m bench gpu-predict", argv), "preset": PRESET, "figures": figures.__dict__}
        args.out.write_text(json.dumps({**result, "cases": rows}, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


def _targets(tree: dict, one: dict) -> dict:
    """How ``tree`` stands against issue 30's two ratios, and the cost per tensor (in a device)
    under which its slower estimate would meet ``TREE_OVER_ONE`` (None: not even at none)."""
    slow = tree["ours_s"][1]
    rest = slow - tree["parts"]["tensors_s"]
    room = TREE_OVER_ONE * one["ours_s"][1] - rest
    return {
        "tree_over_one": [t / o for t, o in zip(tree["ours_s"], one["ours_s"], strict=True)],
        "refit_over_ours": [tree["refit_s"] / t for t in reversed(tree["ours_s"])],
        "per_tensor_for_target_s": room / tree["tensors"] if room > 0 else None,
    }


def _print(rows: list[dict], figures: Figures) -> None:
    from rich.console import Console
    from rich.table import Table

    def span(pair, unit=1e3, fmt="{:.1f}") -> str:
        lo, hi = (fmt.format(x * unit) for x in pair)
        return lo if lo == hi else f"{lo}-{hi}"

    table = Table(
        title=f"Predicted on {PRESET} nodes (NOT measured), from {', '.join(sorted(set(figures.sources.values())))}"
    )
    for col in (
        "case",
        "tensors",
        "GB",
        "ours ms",
        "transfer ms",
        "bound ms",
        "one tensor ms",
        "tree / one",
        "refit floor ms",
        "refit floor / ours",
        f"per tensor for {TREE_OVER_ONE}x",
    ):
        table.add_column(col, justify="left" if col == "case" else "right")
    for r in rows:
        tree, one, need = r["tree"], r["one_tensor"], r["per_tensor_for_target_s"]
        table.add_row(
            r["case"],
            str(tree["tensors"]),
            f"{tree['bytes'] / 1e9:.2f}",
            span(tree["ours_s"]),
            f"{tree['parts']['transfer_s'] * 1e3:.1f}",
            f"{tree['bound_s'] * 1e3:.1f}",
            span(one["ours_s"]),
            span(r["tree_over_one"], 1, "{:.2f}") + "x",
            f"{tree['refit_s'] * 1e3:.1f}",
            span(r["refit_over_ours"], 1, "{:.2f}") + "x",
            "-" if need is None else f"{need * 1e6:.1f} µs",
        )
    Console(width=200).print(table)
    grouped, alone = (x * 1e6 for x in figures.message_extra_s)
    print(
        f"measured, one GPU: {figures.per_tensor_s * 1e6:.1f} µs per tensor in a device, "
        f"{figures.fixed_s * 1e3:.2f} ms per call, {grouped:.1f}-{alone:.1f} µs per message above raw NCCL, "
        f"copy peak {figures.copy_peak_Bps / 1e9:.0f} GB/s"
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
