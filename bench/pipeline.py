"""``python -m bench pipeline``: pipeline schedules with communication overlapped, real and simulated.

REAL (the local Ray cluster): ``--stages`` stages of one device each, ``--microbatches``
microbatches, synthetic stage compute of controlled duration (``time.sleep``: it releases the GIL
and leaves the 2 cores to the transfers), real activation / gradient transfers through the
pipeline runtime (reshard programs on gloo, as between machines: ``shared_memory=False``). The
payload is calibrated in the run so that a forward transfer takes about ``--transfer-ratio`` of a
forward step. Configurations, interleaved round by round (``--repeats``) so that drifting machine
load hits all alike:

* GPipe, 1F1B, eager 1F1B, each with overlap (communication threads, sends right after the
  producing compute, receives posted ahead) and without (each compute waits for its sends);
* each schedule COMPUTE-ONLY: the same pipeline with 4-byte payloads (dependencies, no data);
* for every run, ``scheduler.simulate``'s prediction from that run's measured mean compute and
  transfer durations;
* LANES: eager 1F1B with and without overlap, the same payload through gloo lanes and through pull
  lanes (the default between stage meshes of one machine: receivers copy activations straight out
  of the senders' shared memory, ``scheduler.runtime.pull_lanes``), paired round by round. A pull
  lane's "send" is the sender's copy into its ring, so the simulator's prediction is not asked of
  those runs.

SIMULATED (paper scale, ``--cluster``, default p3.8xlarge): the target shape (forward transfer = half
a forward step) in abstract units, a GPT-like and a U-Transformer-like pipeline (skip connections
to non-adjacent stages) with per-boundary transfer durations from reshard plans simulated on the
cluster (``scheduler.transfer_costs``; ``ReshardPlan.simulate`` when present).

Output: rich tables, JSON ``bench/results/pipeline-<timestamp>.json`` (and ``pipeline-latest.json``),
a PNG Gantt chart (``...-timeline.png``: compute and sends per stage, measured and predicted).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

from scheduler import eager_one_f_one_b, gpipe, one_f_one_b, simulate  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"
SCHEMA = 1
SCHEDULES = {"GPipe": gpipe, "1F1B": one_f_one_b, "eager-1F1B": eager_one_f_one_b}
LANES = "lanes: eager-1F1B "  # the label prefix of the gloo-vs-pulls configurations
ROW_BYTES = 1024 * 4  # payload rows of 1024 float32

# targets
REAL_EAGER_VS_COMPUTE_ONLY = 1.15
REAL_NO_OVERLAP_SLOWER = 1.03  # "measurably": median >= 3 % slower and the repeat ranges do not overlap
REAL_PREDICTION_ERROR = 0.20
SIM_EAGER_VS_NO_COMM = 1.10


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench pipeline", description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", type=int, default=4, help="pipeline stages, one device each (default 4)")
    p.add_argument("--microbatches", type=int, default=8, help="microbatches per iteration (default 8)")
    p.add_argument("--forward-ms", type=float, default=60.0, help="synthetic forward step, ms (default 60)")
    p.add_argument("--backward-ratio", type=float, default=2.0, help="backward / forward duration (default 2)")
    p.add_argument("--transfer-ratio", type=float, default=0.5, help="forward transfer / forward step (default 0.5)")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds per configuration (default 5)")
    p.add_argument("--cluster", default="p3.8xlarge", help="cluster preset for the simulated part")
    p.add_argument("--no-real", action="store_true", help="skip the real (Ray) part")
    p.add_argument("--no-sim", action="store_true", help="skip the simulated part")
    p.add_argument("--quick", action="store_true", help="3 repeats, 30 ms forward: about a minute")
    p.add_argument("--out", help="JSON path (default bench/results/pipeline-<timestamp>.json + pipeline-latest.json)")
    p.add_argument("--timeout", type=float, default=120.0, help="per-iteration timeout, s (default 120)")
    args = p.parse_args(argv)
    if args.quick:
        args.repeats = min(args.repeats, 3)
        args.forward_ms = min(args.forward_ms, 30.0)
    if args.stages < 2 or args.microbatches < 1 or args.repeats < 1:
        p.error("need --stages >= 2, --microbatches >= 1, --repeats >= 1")
    if args.stages > 8:
        p.error("--stages > 8: keep the actor count small on this machine")
    return args


# ------------------------------------------------------------------------------------------- real


def _synthetic_stage_fns(forward_s: float, backward_s: float, n_stages: int, shape: tuple[int, ...]):
    def setup(ctx):
        import torch

        return {"out": torch.ones(shape), "grad": torch.ones(shape)}

    def forward(ctx, x):
        time.sleep(forward_s)
        return ctx.state["out"] if ctx.stage < n_stages - 1 else 0.0

    def backward(ctx, grad):
        time.sleep(backward_s)
        return ctx.state["grad"] if ctx.stage > 0 else None

    return setup, forward, backward


def _make_pipeline(
    meshes, forward_s: float, backward_s: float, rows: int, timeout_s: float, *, shared_memory: bool = False
):
    from reshard import Layout, Replicate
    from scheduler.runtime import Pipeline, Stage

    n = len(meshes)
    shape = (rows, 1024) if rows > 0 else (1,)
    setup, forward, backward = _synthetic_stage_fns(forward_s, backward_s, n, shape)
    stages = []
    for i, m in enumerate(meshes):
        layout = Layout(m, (Replicate(), Replicate()))
        stages.append(
            Stage(
                m,
                forward,
                backward,
                setup,
                in_shape=None if i == 0 else shape,
                in_layout=None if i == 0 else layout,
                out_shape=None if i == n - 1 else shape,
                out_layout=None if i == n - 1 else layout,
                name=f"stage{i}",
            )
        )
    return Pipeline(stages, timeout_s=timeout_s, shared_memory=shared_memory)


def _median_forward_transfer(result) -> float:
    xs = [d for (a, b), ds in result.transfer_s.items() if b == a + 1 for d in ds]
    return statistics.median(xs) if xs else 0.0


def _slope(xs: list[float], ys: list[float]) -> float:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0


def _record(result, label: str) -> dict:
    predicted = result.predicted()
    sim_in = result.simulate_inputs()
    return {
        "config": label,
        "schedule": result.schedule.name,
        "overlap": result.overlap,
        "iteration_s": result.iteration_s,
        "driver_s": result.driver_s,
        "predicted_s": predicted.iteration_s,
        "prediction_error": result.iteration_s / predicted.iteration_s - 1 if predicted.iteration_s else None,
        "peak_activations": list(result.peak_activations),
        "analytic_peak_activations": list(result.schedule.peak_activations),
        "mean_forward_s": statistics.fmean(sim_in["forward_s"]),
        "mean_backward_s": statistics.fmean(sim_in["backward_s"]),
        "mean_transfer_s": statistics.fmean(sim_in["transfer_s"]) if sim_in["transfer_s"] else 0.0,
        "mean_backward_transfer_s": (
            statistics.fmean(sim_in["backward_transfer_s"]) if sim_in["backward_transfer_s"] else 0.0
        ),
        "simulate_inputs": sim_in,
        "mean_forward_arrival_s": statistics.fmean(
            [d for (a, b), ds in result.arrival_s.items() if b == a + 1 for d in ds] or [0.0]
        ),
    }


def run_real(args, console) -> dict:
    import ray

    from reshard import DeviceMesh

    n, m = args.stages, args.microbatches
    f_s = args.forward_ms / 1e3
    b_s = f_s * args.backward_ratio
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    t0 = time.perf_counter()
    pool = DeviceMesh.create((1, n), startup_timeout_s=300)
    meshes = [DeviceMesh.from_devices([d], (1, 1)) for d in pool.device_ids]
    console.print(f"[dim]{n} device actors ready in {time.perf_counter() - t0:.1f} s[/dim]")
    pipes = []
    try:
        # calibrate the payload: a forward transfer ~ transfer_ratio x forward step in the eager
        # 1F1B run with overlap (the configuration the targets are about). Three sizes around a
        # first guess, measured round-robin (so load drift hits all alike), a line t = a + b * bytes
        # through the per-size medians, solved for the target; then one check and, if it is more
        # than 20 % off, one proportional correction.
        target = args.transfer_ratio * f_s
        guess = max(1, int(target * 1.0e9 / ROW_BYTES))  # 1 GB/s
        probes = {r: _make_pipeline(meshes, f_s, b_s, r, args.timeout) for r in (guess // 2, guess, 2 * guess)}
        pipes.extend(probes.values())
        samples: dict[int, list[float]] = {r: [] for r in probes}
        for _ in range(3):  # the first round is a warm-up (workers, communicators)
            for r, pipe in probes.items():
                samples[r].append(_median_forward_transfer(pipe.run(eager_one_f_one_b(n, m))))
        medians = {r: statistics.median(v[1:]) for r, v in samples.items()}
        xs, ys = list(medians), [medians[r] for r in medians]
        slope = _slope(xs, ys)
        rows = guess
        if slope > 0:
            intercept = statistics.fmean(ys) - slope * statistics.fmean(xs)
            rows = int(min(4 * guess, max(guess // 4, (target - intercept) / slope)))
        for pipe in probes.values():
            pipe.close()
            pipes.remove(pipe)
        calibration = [{"rows": r, "bytes": r * ROW_BYTES, "forward_transfer_s": samples[r]} for r in probes]
        comm = None
        for _ in range(2):
            if comm is not None:
                comm.close()
                pipes.remove(comm)
            comm = _make_pipeline(meshes, f_s, b_s, rows, args.timeout)
            comm_rows = rows
            pipes.append(comm)
            comm.run(eager_one_f_one_b(n, m))
            measured = statistics.median(_median_forward_transfer(comm.run(eager_one_f_one_b(n, m))) for _ in range(2))
            calibration.append({"rows": rows, "bytes": rows * ROW_BYTES, "forward_transfer_s": [measured]})
            console.print(
                f"[dim]calibration: {rows * ROW_BYTES / 2**20:.1f} MiB -> forward transfer "
                f"{measured * 1e3:.1f} ms (target {target * 1e3:.1f} ms; probes "
                + ", ".join(f"{r * ROW_BYTES / 2**20:.1f} MiB {medians[r] * 1e3:.1f} ms" for r in probes)
                + ")[/dim]"
            )
            if abs(measured / target - 1) <= 0.20:
                break
            rows = max(1, int(rows * min(2.0, max(0.5, target / max(measured, 1e-6)))))
        tiny = _make_pipeline(meshes, f_s, b_s, 0, args.timeout)
        pipes.append(tiny)
        tiny.run(eager_one_f_one_b(n, m))
        pulled = _make_pipeline(meshes, f_s, b_s, comm_rows, args.timeout, shared_memory=True)
        pipes.append(pulled)
        pulled.run(eager_one_f_one_b(n, m))

        # per schedule a GROUP of three runs back to back (compute-only, overlap, no overlap), the
        # order inside a group and of the groups rotated every round: the ratios that the targets
        # use are taken inside one group, so machine load that drifts over seconds cancels out
        groups = []
        for name, make in SCHEDULES.items():
            groups.append(
                [
                    (f"{name} compute-only", tiny, make(n, m), True),
                    (f"{name} overlap", comm, make(n, m), True),
                    (f"{name} no overlap", comm, make(n, m), False),
                ]
            )
        groups.append(
            [
                (f"{LANES}gloo, overlap", comm, eager_one_f_one_b(n, m), True),
                (f"{LANES}pulls, overlap", pulled, eager_one_f_one_b(n, m), True),
                (f"{LANES}gloo, no overlap", comm, eager_one_f_one_b(n, m), False),
                (f"{LANES}pulls, no overlap", pulled, eager_one_f_one_b(n, m), False),
            ]
        )
        configs = [c for g in groups for c in g]
        runs: dict[str, list] = {label: [] for label, *_ in configs}
        results: dict[str, list] = {label: [] for label, *_ in configs}
        for r in range(args.repeats):
            for gi in range(len(groups)):
                group = groups[(gi + r) % len(groups)]
                for ci in range(len(group)):
                    label, pipe, schedule, overlap = group[(ci + r) % len(group)]
                    result = pipe.run(schedule, overlap=overlap)
                    runs[label].append(_record(result, label) | {"round": r})
                    results[label].append(result)
            console.print(f"[dim]round {r + 1}/{args.repeats} done[/dim]")
        # the median run of eager overlap / no overlap, for the timeline
        timelines = {}
        for label in ("eager-1F1B overlap", "eager-1F1B no overlap", "eager-1F1B compute-only"):
            rs = sorted(results[label], key=lambda x: x.iteration_s)
            chosen = rs[len(rs) // 2]
            pred = chosen.predicted()
            timelines[label] = {
                "measured": [[e.stage, e.kind, e.label, e.start_s, e.end_s] for e in chosen.events],
                "predicted": [
                    [s, ev.kind.value, ev.label, ev.start_s, ev.end_s]
                    for s, row in enumerate(pred.events)
                    for ev in row
                ],
                "iteration_s": chosen.iteration_s,
                "predicted_s": pred.iteration_s,
            }
    finally:
        for p in pipes:
            p.close()
        for mm in meshes:
            mm.shutdown()
        pool.shutdown()
        if started:
            ray.shutdown()
    summary = {}
    for label, rs in runs.items():
        its = [x["iteration_s"] for x in rs]
        summary[label] = {
            "median_s": statistics.median(its),
            "min_s": min(its),
            "max_s": max(its),
            "median_predicted_s": statistics.median(x["predicted_s"] for x in rs),
            "median_prediction_error": statistics.median(x["prediction_error"] for x in rs),
            "worst_prediction_error": max((x["prediction_error"] for x in rs), key=abs),
            "peaks_match": all(x["peak_activations"] == x["analytic_peak_activations"] for x in rs),
            "peak_activations": rs[0]["peak_activations"],
            "analytic_peak_activations": rs[0]["analytic_peak_activations"],
            "mean_forward_s": statistics.fmean(x["mean_forward_s"] for x in rs),
            "mean_transfer_s": statistics.fmean(x["mean_transfer_s"] for x in rs),
            "mean_backward_transfer_s": statistics.fmean(x["mean_backward_transfer_s"] for x in rs),
            "mean_forward_arrival_s": statistics.fmean(x["mean_forward_arrival_s"] for x in rs),
        }
        summary[label]["transfer_over_forward"] = statistics.median(
            x["mean_transfer_s"] / x["mean_forward_s"] for x in rs
        )  # median over runs: one noisy round does not move it
    return {
        "config": {
            "stages": n,
            "microbatches": m,
            "forward_s": f_s,
            "backward_s": b_s,
            "transfer_ratio_target": args.transfer_ratio,
            "repeats": args.repeats,
            "payload_bytes": comm_rows * ROW_BYTES,
            "compute": "time.sleep",
            "pull_lanes": sorted(pulled.pull_lanes),
        },
        "calibration": calibration,
        "runs": runs,
        "summary": summary,
        "timelines": timelines,
        "targets": real_targets(summary, runs, n, m),
    }


def paired_ratios(runs: dict, num: str, den: str) -> list[float]:
    """Per round, iteration(num) / iteration(den): both ran in the same group, seconds apart."""
    by_round = {x["round"]: x["iteration_s"] for x in runs[den]}
    return [x["iteration_s"] / by_round[x["round"]] for x in runs[num] if x["round"] in by_round]


def real_targets(summary: dict, runs: dict, n: int, m: int) -> list[dict]:
    out = []
    ratios = paired_ratios(runs, "eager-1F1B overlap", "eager-1F1B compute-only")
    ratio = statistics.median(ratios)
    out.append(
        {
            "target": f"real {n}x{m}: eager 1F1B with overlap <= {REAL_EAGER_VS_COMPUTE_ONLY:.2f} x compute-only "
            f"(median of per-round ratios)",
            "value": f"{ratio:.3f} x (rounds {', '.join(f'{x:.3f}' for x in ratios)})",
            "ok": ratio <= REAL_EAGER_VS_COMPUTE_ONLY,
        }
    )
    slower = paired_ratios(runs, "eager-1F1B no overlap", "eager-1F1B overlap")
    wins = sum(x > 1 for x in slower) / len(slower)
    out.append(
        {
            "target": f"real {n}x{m}: eager 1F1B without overlap measurably slower (median per-round ratio "
            f">= {REAL_NO_OVERLAP_SLOWER:.2f}, slower in >= 80 % of rounds)",
            "value": f"{statistics.median(slower):.3f} x, slower in {wins:.0%} of rounds",
            "ok": statistics.median(slower) >= REAL_NO_OVERLAP_SLOWER and wins >= 0.8,
        }
    )
    comm = {k: v for k, v in summary.items() if "compute-only" not in k and not k.startswith(LANES)}
    worst_label, worst = max(comm.items(), key=lambda kv: abs(kv[1]["median_prediction_error"]))
    out.append(
        {
            "target": f"real: simulator predicts the iteration time within {REAL_PREDICTION_ERROR:.0%} (every config)",
            "value": f"worst median error {worst['median_prediction_error']:+.1%} ({worst_label})",
            "ok": all(abs(v["median_prediction_error"]) <= REAL_PREDICTION_ERROR for v in comm.values()),
        }
    )
    out.append(
        {
            "target": "real: measured peak held activations per stage == schedule's analytic counts",
            "value": "; ".join(
                f"{k.split()[0]} {v['peak_activations']}"
                for k, v in summary.items()
                if k.endswith(" overlap") and "no" not in k and not k.startswith(LANES)
            ),
            "ok": all(v["peaks_match"] for v in summary.values()),
        }
    )
    # without overlap every transfer is on the critical path: pull lanes must be faster; with
    # overlap both hide their transfers behind compute: the same within the bench's 3 % noise bar
    for mode, bound in (("no overlap", 1.0), ("overlap", REAL_NO_OVERLAP_SLOWER)):
        ratios = paired_ratios(runs, f"{LANES}pulls, {mode}", f"{LANES}gloo, {mode}")
        pulled, sent = summary[f"{LANES}pulls, {mode}"], summary[f"{LANES}gloo, {mode}"]
        out.append(
            {
                "target": f"real {n}x{m}: eager 1F1B {mode}, pull lanes vs gloo lanes on one machine: iteration "
                f"(median of per-round ratios) < {bound:.2f} x",
                "value": f"{statistics.median(ratios):.3f} x (rounds {', '.join(f'{x:.3f}' for x in ratios)}); forward "
                f"payload on its way {_ms(pulled['mean_forward_arrival_s'])} vs "
                f"{_ms(sent['mean_forward_arrival_s'])} ms",
                "ok": statistics.median(ratios) < bound,
            }
        )
    return out


# -------------------------------------------------------------------------------------- simulated


# GPT-like and U-Transformer-like configurations (paper §5.2 style, sizes of our choosing).
# Compute per stage from a FLOP model: a transformer layer's forward is 24 b s h^2 + 4 b s^2 h
# FLOPs; backward twice that; a stage's 4 V100s (Megatron tensor parallelism) run at
# V100_FP16_FLOPS x MFU each. Activations cross stages replicated over each stage's 1x4 mesh.
V100_FP16_FLOPS = 125e12
MFU = 0.40
MODELS = {
    "GPT-like": {
        "stages": 4,
        "microbatches": 8,
        "layers": 32,
        "hidden": 2560,
        "seq": 1024,
        "batch": 4,
        "skips": [],
        "skip_width": 1,
    },
    "U-Transformer-like": {
        "stages": 6,
        "microbatches": 12,
        "layers": 24,
        "hidden": 2048,
        "seq": 1024,
        "batch": 4,
        "skips": [(0, 5), (1, 4)],
        "skip_width": 2,  # encoder features concatenated into the decoder
    },
}


def _layer_flops(b: int, s: int, h: int) -> float:
    return 24.0 * b * s * h * h + 4.0 * b * s * s * h


def model_durations(cfg: dict, cluster) -> dict:
    from reshard import Layout, Replicate
    from scheduler.transfer_costs import Boundary, transfer_costs

    n = cfg["stages"]
    per_stage_layers = cfg["layers"] / n
    f_s = (
        per_stage_layers
        * _layer_flops(cfg["batch"], cfg["seq"], cfg["hidden"])
        / (cluster.devices_per_host * V100_FP16_FLOPS * MFU)
    )
    shape = (cfg["batch"] * cfg["seq"], cfg["hidden"])
    skip_shape = (cfg["batch"] * cfg["seq"], cfg["hidden"] * cfg["skip_width"])
    meshes = [cluster.mesh((1, cluster.devices_per_host), hosts=(i,)) for i in range(n)]
    layouts = [Layout(mm, (Replicate(), Replicate())) for mm in meshes]
    boundaries = [Boundary(i, i + 1, shape, "float16", layouts[i], layouts[i + 1]) for i in range(n - 1)]
    boundaries += [Boundary(i, j, skip_shape, "float16", layouts[i], layouts[j]) for i, j in cfg["skips"]]
    costs = transfer_costs(boundaries, cluster, n_stages=n)
    return {"forward_s": f_s, "backward_s": 2 * f_s, "costs": costs, "activation_bytes": math.prod(shape) * 2}


def _sim_table(n: int, m: int, forward_s, backward_s, skips=(), **xfer) -> dict:
    out = {}
    for name, make in SCHEDULES.items():
        schedule = make(n, m, skips=skips)
        row = {}
        for overlap in (True, False):
            r = simulate(schedule, forward_s=forward_s, backward_s=backward_s, overlap=overlap, **xfer)
            row["overlap" if overlap else "no_overlap"] = r
        zero_skips = {pair: 0.0 for pair in schedule.skips}
        row["no_comm"] = simulate(schedule, forward_s=forward_s, backward_s=backward_s, skip_transfer_s=zero_skips)
        out[name] = row
    return out


def run_sim(args, console) -> dict:
    from topology import Cluster

    n, m = args.stages, args.microbatches
    unit = _sim_table(n, m, 1.0, args.backward_ratio, transfer_s=args.transfer_ratio)
    out = {
        "unit": {
            "stages": n,
            "microbatches": m,
            "forward_s": 1.0,
            "backward_s": args.backward_ratio,
            "transfer_s": args.transfer_ratio,
            "results": _sim_json(unit),
        }
    }
    eager, ofob, free = (unit["eager-1F1B"]["overlap"], unit["1F1B"]["overlap"], unit["eager-1F1B"]["no_comm"])
    out["targets"] = [
        {
            "target": f"sim {n}x{m}, transfer = {args.transfer_ratio:g} forward: eager 1F1B <= 1F1B",
            "value": f"{eager.iteration_s:.2f} vs {ofob.iteration_s:.2f}",
            "ok": eager.iteration_s <= ofob.iteration_s,
        },
        {
            "target": f"sim {n}x{m}: eager 1F1B <= {SIM_EAGER_VS_NO_COMM:.2f} x no-communication iteration",
            "value": f"{eager.iteration_s / free.iteration_s:.3f} x",
            "ok": eager.iteration_s <= SIM_EAGER_VS_NO_COMM * free.iteration_s,
        },
    ]
    out["cluster"] = args.cluster
    out["models"] = {}
    out["_tables"] = {"unit": unit}
    for name, cfg in MODELS.items():
        cluster = Cluster.preset(args.cluster, cfg["stages"])
        d = model_durations(cfg, cluster)
        costs = d["costs"]
        table = _sim_table(
            cfg["stages"],
            cfg["microbatches"],
            d["forward_s"],
            d["backward_s"],
            skips=cfg["skips"],
            **costs.simulate_kwargs(),
        )
        out["_tables"][name] = table
        out["models"][name] = {
            "config": cfg,
            "forward_s": d["forward_s"],
            "backward_s": d["backward_s"],
            "activation_bytes": d["activation_bytes"],
            "transfer_costs": costs.to_dict(),
            "results": _sim_json(table),
        }
    return out


def _sim_json(table: dict) -> dict:
    return {
        name: {
            k: {
                "iteration_s": r.iteration_s,
                "bubble_fraction": r.bubble_fraction,
                "peak_activations": list(r.peak_activations),
            }
            for k, r in row.items()
        }
        for name, row in table.items()
    }


# ------------------------------------------------------------------------------------------ output


def _skip_costs(costs: dict) -> str:
    """ ", skips a 1.2, b 3.4 ms" for a model's skip connections' transfer costs ("" for none)."""
    return f", skips {', '.join(f'{k} {_ms(x)}' for k, x in costs.items())} ms" if costs else ""


def _ms(t: float) -> str:
    return f"{t * 1e3:.0f}" if t >= 0.1 else f"{t * 1e3:.1f}"


def print_real(real: dict, console) -> None:
    from rich.table import Table

    cfg = real["config"]
    ratio = real["summary"]["eager-1F1B overlap"]["transfer_over_forward"]
    t = Table(
        title=f"REAL local Ray: {cfg['stages']} stages x {cfg['microbatches']} microbatches, forward "
        f"{cfg['forward_s'] * 1e3:.0f} ms (sleep), backward {cfg['backward_s'] * 1e3:.0f} ms, payload "
        f"{cfg['payload_bytes'] / 2**20:.1f} MiB (eager overlap: forward transfer = {ratio:.2f} forward step, median), "
        f"median of {cfg['repeats']} rounds",
    )
    for col in (
        "config",
        "iteration ms",
        "range ms",
        "vs compute-only (lanes: vs gloo), paired",
        "predicted ms",
        "pred. error",
        "fwd xfer ms",
        "bwd xfer ms",
        "fwd arrival ms",
        "peak act. (measured = analytic)",
    ):
        t.add_column(col, justify="left" if col.startswith(("config", "peak")) else "right")
    s = real["summary"]
    for label, v in s.items():
        base = (
            f"{LANES}gloo, {label.rsplit(', ', 1)[1]}"
            if label.startswith(LANES)
            else f"{label.split()[0]} compute-only"
        )
        paired = statistics.median(paired_ratios(real["runs"], label, base))
        t.add_row(
            label,
            _ms(v["median_s"]),
            f"{_ms(v['min_s'])}-{_ms(v['max_s'])}",
            f"{paired:.3f}",
            _ms(v["median_predicted_s"]),
            f"{v['median_prediction_error']:+.1%}",
            _ms(v["mean_transfer_s"]),
            _ms(v["mean_backward_transfer_s"]),
            _ms(v["mean_forward_arrival_s"]),
            f"{v['peak_activations']} {'==' if v['peaks_match'] else '!='} {v['analytic_peak_activations']}",
        )
    console.print(t)


def print_sim(sim: dict, console) -> None:
    from rich.table import Table

    u = sim["unit"]
    for title, table, extra in [
        (
            f"SIMULATED, units of one forward step: {u['stages']} stages x {u['microbatches']} microbatches, "
            f"backward {u['backward_s']:g}, transfer {u['transfer_s']:g}",
            sim["_tables"]["unit"],
            None,
        ),
        *[
            (
                f"SIMULATED {name} on {sim['cluster']} ({m['config']['stages']} stages x "
                f"{m['config']['microbatches']} microbatches, skips {m['config']['skips'] or 'none'}): forward "
                f"{m['forward_s'] * 1e3:.1f} ms, backward {m['backward_s'] * 1e3:.1f} ms, transfers "
                f"{', '.join(_ms(x) for x in m['transfer_costs']['transfer_s'])} ms"
                + _skip_costs(m["transfer_costs"]["skip_transfer_s"])
                + " (plan.simulate)",
                sim["_tables"][name],
                name,
            )
            for name, m in sim["models"].items()
        ],
    ]:
        scale = 1.0 if extra is None else 1e3
        unit = "" if extra is None else " ms"
        t = Table(title=title)
        for col in (
            "schedule",
            f"overlap{unit}",
            f"no overlap{unit}",
            f"no comm{unit}",
            "overlap / no comm",
            "bubble (overlap)",
            "peak activations",
        ):
            t.add_column(col, justify="left" if col in ("schedule", "peak activations") else "right")
        for name, row in table.items():
            o, no, free = row["overlap"], row["no_overlap"], row["no_comm"]
            t.add_row(
                name,
                f"{o.iteration_s * scale:.2f}",
                f"{no.iteration_s * scale:.2f}",
                f"{free.iteration_s * scale:.2f}",
                f"{o.iteration_s / free.iteration_s:.3f}",
                f"{o.bubble_fraction:.1%}",
                str(list(o.peak_activations)),
            )
        console.print(t)


def print_targets(targets: list[dict], console) -> None:
    from rich.table import Table

    t = Table(title="TARGETS")
    t.add_column("target")
    t.add_column("measured", justify="right")
    t.add_column("ok")
    for x in targets:
        t.add_row(x["target"], x["value"], "[green]yes[/green]" if x["ok"] else "[red]NO[/red]")
    console.print(t)


# ------------------------------------------------------------------------------------------ timeline

COLORS = {"forward": "#4C72B0", "backward": "#DD8452", "send_F": "#55A868", "send_B": "#C44E52"}


def _draw(ax, events, n_stages: int, title: str, xmax: float) -> None:
    """One Gantt panel: per stage a compute row (forward blue, backward orange, microbatch numbers)
    and two thin send rows below it (activations green, gradients red; skip connections hatched).
    Sends of one link run one after another; white edges separate them."""
    for stage, kind, label, start, end in events:
        y = n_stages - 1 - stage
        if kind in ("forward", "backward"):
            ax.barh(y + 0.17, end - start, left=start, height=0.46, color=COLORS[kind], edgecolor="white", lw=0.6)
            if end - start > xmax / 80:
                ax.text(
                    (start + end) / 2, y + 0.17, label.lstrip("FB"), ha="center", va="center", fontsize=6, color="white"
                )
            continue
        if kind == "recv":  # the send rows show the transfer; a receive also counts its waiting
            continue
        # "send": labels "F3->1" (measured) or "S3F->1" (simulated)
        head, _, peer = label.partition("->")
        phase = "B" if "B" in head else "F"
        skip = peer.isdigit() and abs(int(peer) - stage) > 1
        row = y - 0.16 if phase == "F" else y - 0.34
        ax.barh(
            row,
            end - start,
            left=start,
            height=0.15,
            color=COLORS["send_" + phase],
            edgecolor="white",
            lw=0.4,
            hatch="////" if skip else None,
        )
    ax.set_yticks(range(n_stages))
    ax.set_yticklabels([f"stage {n_stages - 1 - i}" for i in range(n_stages)], fontsize=8)
    ax.set_ylim(-0.55, n_stages - 0.45)
    ax.set_xlim(0, xmax)
    ax.set_title(title, fontsize=9, loc="left")
    ax.grid(axis="x", lw=0.3, alpha=0.5)


def real_panels(real: dict) -> list:
    n = real["config"]["stages"]
    panels = []
    for label in ("eager-1F1B overlap", "eager-1F1B no overlap", "eager-1F1B compute-only"):
        tl = real["timelines"][label]
        panels.append((tl["measured"], n, f"REAL {label}: measured {tl['iteration_s'] * 1e3:.0f} ms (median run)"))
    tl = real["timelines"]["eager-1F1B overlap"]
    panels.append(
        (
            tl["predicted"],
            n,
            f"SIMULATED eager-1F1B overlap from that run's measured durations: {tl['predicted_s'] * 1e3:.0f} ms",
        )
    )
    return panels


def sim_panels(sim: dict) -> list:
    panels = []
    for name in sim["models"]:
        table = sim["_tables"][name]
        for sched in ("1F1B", "eager-1F1B"):
            r = table[sched]["overlap"]
            events = [[s, e.kind.value, e.label, e.start_s, e.end_s] for s, row in enumerate(r.events) for e in row]
            panels.append(
                (
                    events,
                    len(r.events),
                    f"SIMULATED {name} on {sim['cluster']}, {sched} with overlap: {r.iteration_s * 1e3:.0f} ms",
                )
            )
    return panels


def draw_timeline(path: Path, panels: list, *, shared_x: bool) -> None:
    """Stacked Gantt panels ``(events, n_stages, title)``; ``shared_x`` gives all one time axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    heights = [0.5 * n + 0.7 for _, n, _ in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(14, sum(heights) + 0.6), gridspec_kw={"height_ratios": heights})
    axes = list(axes) if len(panels) > 1 else [axes]
    overall = max(e[4] for events, _, _ in panels for e in events)
    for ax, (events, n, title) in zip(axes, panels, strict=True):
        xmax = overall if shared_x else max(e[4] for e in events)
        _draw(ax, events, n, title, xmax * 1.01)
        ax.set_xlabel("seconds from the iteration start", fontsize=8)
        ax.tick_params(axis="x", labelsize=7)
    handles = [
        Patch(color=COLORS["forward"], label="forward"),
        Patch(color=COLORS["backward"], label="backward"),
        Patch(color=COLORS["send_F"], label="send activation"),
        Patch(color=COLORS["send_B"], label="send gradient"),
        Patch(facecolor="white", edgecolor="grey", hatch="////", label="skip connection"),
    ]
    fig.legend(handles=handles, loc="upper right", ncol=5, fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) if args.out else RESULTS_DIR / f"pipeline-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    from bench.local import command_line
    from bench.provenance import revision

    data: dict = {
        "schema": SCHEMA,
        "command": command_line("pipeline", argv if argv is not None else sys.argv[1:]),
        "revision": revision(),
        "when": stamp,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "load_avg": _load()},
    }
    targets: list[dict] = []
    real = sim = None
    if not args.no_sim:
        sim = run_sim(args, console)
        print_sim(sim, console)
        targets += sim["targets"]
    if not args.no_real:
        real = run_real(args, console)
        print_real(real, console)
        targets += real["targets"]
    data["machine"]["load_avg_after"] = _load()
    pngs = {}
    if real:
        pngs["real"] = out.with_name(out.stem + "-timeline.png")
        draw_timeline(pngs["real"], real_panels(real), shared_x=True)
    if sim:
        pngs["sim"] = out.with_name(out.stem + "-timeline-sim.png")
        draw_timeline(pngs["sim"], sim_panels(sim), shared_x=False)
    data["real"] = real
    data["sim"] = None if sim is None else {k: v for k, v in sim.items() if k != "_tables"}
    data["targets"] = targets
    data["timeline_png"] = {k: v.name for k, v in pngs.items()}  # beside the JSON
    out.write_text(json.dumps(data, indent=1, default=str))
    if not args.out:
        (RESULTS_DIR / "pipeline-latest.json").write_text(out.read_text())
        for k, v in pngs.items():
            name = "pipeline-latest-timeline.png" if k == "real" else "pipeline-latest-timeline-sim.png"
            (RESULTS_DIR / name).write_bytes(v.read_bytes())
    print_targets(targets, console)
    console.print(f"results: {out}")
    for v in pngs.values():
        console.print(f"timeline: {v}")
    return 0 if all(t["ok"] for t in targets) else 1


def _load() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


if __name__ == "__main__":
    sys.exit(main())
