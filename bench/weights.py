"""``python -m bench weights``: a weight sync (a whole model's state dict moved from a trainer's
layout to an inference engine's) by our one-call tree reshard and by what users write instead, on
an embedded local Ray cluster, in one run, every result checked bit for bit.

Models: float32 state dicts named as the models name them, scaled to this 2-core machine: ``gpt2``
(GPT-2 small's 148 tensors, d=256, vocab 8192, 1024 positions, ~45 MiB) and ``qwen3`` (Qwen3-0.6B's
311 tensors at 1/8 width, ~29 MiB). FSDP puts every tensor ``Shard(0)``; tensor parallelism is
Megatron's: column-parallel weights (qkv, fc, gate, up) and their biases split output features,
row-parallel ones (output projections, o, down) input features; norms, row-parallel biases and
position embeddings are replicated; token embeddings and lm_head split by vocabulary rows (the
fused c_attn splits contiguously: a loader that regroups heads moves the same bytes).

Per (model, case) every method runs once untimed, then in rounds whose order rotates (this VM
favours whatever runs right after a release: ``bench/local.py``); each output is freed, untimed
and settled, right after its run; each method's first timed result is compared bit for bit with
the source arrays on every destination device. Methods: ours (one ``reshard`` of the tree on the
default path, ``shared_memory=False``, ``async_op=True``), the per-tensor loop, one 2-D tensor
whose destinations need as many bytes from other devices as the tree's (the fit's calibration;
source split like the case's, destination column-parallel), and the peers of ``bench.peers``
(the object store, a naive torch.distributed gloo refit, Ray Direct Transport; trees section).

The fit: t = tensors x per-tensor cost + bytes / bandwidth (bytes: the minimum that must cross
between devices); per path a least-squares fit over the tree and one-tensor medians of every case
in the run, and per case the two-point solution, per-tensor cost = (tree - one) / (tensors - 1).
Output (``bench.weights_report``: the fit, the targets, tables, plot): tables and targets (met / NO)
on the terminal, JSON (``bench/results/weights-<timestamp>.json``) and a PNG beside it (``--figure``).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import ray  # noqa: E402

from bench import peers, report  # noqa: E402
from bench.local import _error, _torch_version, command_line, make_array, pair_bytes, stats_of  # noqa: E402
from bench.provenance import revision  # noqa: E402
from bench.weights_report import (  # noqa: E402
    ASYNC,
    DEFAULT_METHODS,
    LOOP,
    METHODS,
    NAIVE,
    OBJECT_STORE,
    ONE,
    ONE_GLOO,
    ONE_OUT,
    OURS,
    OURS_DIRECT,
    OURS_GLOO,
    OURS_OUT,
    PEERS,
    RDT,
    fit,
    plot,
    render,
    targets,
)
from reshard import Layout, Replicate, Shard  # noqa: E402
from reshard.ir.regions import device_regions  # noqa: E402

ROOT = Path(__file__).resolve().parent
ONE_COLS = 1024  # the one tensor's columns (its rows make up the bytes)


# ------------------------------------------------------------------------------------ models


@dataclass(frozen=True, slots=True, eq=False)
class Model:
    """A state dict (name -> float32 array, in the model's order) and each tensor's tensor-parallel
    dim (None: replicated under tensor parallelism)."""

    name: str
    arrays: dict
    tp_dims: dict

    @property
    def size_bytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())


def _model(name: str, spec: list, seed: int) -> Model:
    arrays = {k: make_array(shape, "float32", seed + i) for i, (k, shape, _) in enumerate(spec)}
    return Model(name, arrays, {k: dim for k, _, dim in spec})


def gpt2(layers: int = 12, seed: int = 0) -> Model:
    """GPT-2 small's tensors at d=256, vocab 8192, 1024 positions (Conv1D: column-parallel splits
    dim 1, row-parallel dim 0)."""
    d, vocab, positions = 256, 8192, 1024
    spec = [("wte.weight", (vocab, d), 0), ("wpe.weight", (positions, d), None)]
    for i in range(layers):
        h = f"h.{i}."
        spec += [
            (h + "ln_1.weight", (d,), None),
            (h + "ln_1.bias", (d,), None),
            (h + "attn.c_attn.weight", (d, 3 * d), 1),
            (h + "attn.c_attn.bias", (3 * d,), 0),
            (h + "attn.c_proj.weight", (d, d), 0),
            (h + "attn.c_proj.bias", (d,), None),
            (h + "ln_2.weight", (d,), None),
            (h + "ln_2.bias", (d,), None),
            (h + "mlp.c_fc.weight", (d, 4 * d), 1),
            (h + "mlp.c_fc.bias", (4 * d,), 0),
            (h + "mlp.c_proj.weight", (4 * d, d), 0),
            (h + "mlp.c_proj.bias", (d,), None),
        ]
    spec += [("ln_f.weight", (d,), None), ("ln_f.bias", (d,), None)]
    return _model("gpt2", spec, seed)


def qwen3(layers: int = 28, seed: int = 0) -> Model:
    """Qwen3-0.6B's tensors at 1/8 width: hidden 128, 4 query and 2 key/value heads of 32, MLP 384,
    vocab 8192 (Linear: column-parallel splits dim 0, row-parallel dim 1)."""
    hidden, heads, kv_heads, head_dim, mlp, vocab = 128, 4, 2, 32, 384, 8192
    q, kv = heads * head_dim, kv_heads * head_dim
    spec = [("model.embed_tokens.weight", (vocab, hidden), 0)]
    for i in range(layers):
        p = f"model.layers.{i}."
        spec += [
            (p + "self_attn.q_proj.weight", (q, hidden), 0),
            (p + "self_attn.k_proj.weight", (kv, hidden), 0),
            (p + "self_attn.v_proj.weight", (kv, hidden), 0),
            (p + "self_attn.o_proj.weight", (hidden, q), 1),
            (p + "self_attn.q_norm.weight", (head_dim,), None),
            (p + "self_attn.k_norm.weight", (head_dim,), None),
            (p + "mlp.gate_proj.weight", (mlp, hidden), 0),
            (p + "mlp.up_proj.weight", (mlp, hidden), 0),
            (p + "mlp.down_proj.weight", (hidden, mlp), 1),
            (p + "input_layernorm.weight", (hidden,), None),
            (p + "post_attention_layernorm.weight", (hidden,), None),
        ]
    spec += [("model.norm.weight", (hidden,), None), ("lm_head.weight", (vocab, hidden), 0)]
    return _model("qwen3", spec, seed)


def moe(layers: int = 16, seed: int = 0, experts: int = 417) -> Model:
    """A mixture-of-experts tree: ``layers`` x ``experts`` x gate, up and down projections, each
    small (32 x 16: how FSDP leaves an expert's shard per device at scale); 20,016 tensors, 39 MiB
    (column-parallel gate and up split dim 0, row-parallel down dim 1)."""
    spec = []
    for i in range(layers):
        for e in range(experts):
            p = f"model.layers.{i}.mlp.experts.{e}."
            spec += [
                (p + "gate_proj.weight", (32, 16), 0),
                (p + "up_proj.weight", (32, 16), 0),
                (p + "down_proj.weight", (16, 32), 1),
            ]
    return _model("moe", spec, seed)


MODELS = {"gpt2": gpt2, "qwen3": qwen3, "moe": moe}
DEFAULT_MODELS = ("gpt2", "qwen3")  # moe on request: its per-tensor loop and peers take minutes


# ------------------------------------------------------------------------------------ cases


@dataclass(frozen=True, slots=True)
class WeightCase:
    """Source and destination: a kind ("fsdp", "tp", "whole") and a device count each."""

    name: str
    what: str
    src: tuple[str, int]
    dst: tuple[str, int]

    def positions(self) -> tuple[range, range]:
        """Pool positions: sources from 0, destinations from 2 (disjoint from every source)."""
        return range(self.src[1]), range(2, 2 + self.dst[1])


CASES = (
    WeightCase("fsdp2-tp2", "FSDP Shard(0) over 2 -> tensor parallel 2", ("fsdp", 2), ("tp", 2)),
    WeightCase("fsdp2-tp4", "FSDP Shard(0) over 2 -> tensor parallel 4", ("fsdp", 2), ("tp", 4)),
    WeightCase("tp2-tp4", "tensor parallel 2 -> tensor parallel 4", ("tp", 2), ("tp", 4)),
    WeightCase("1-tp2", "whole on one device -> tensor parallel 2", ("whole", 1), ("tp", 2)),
    WeightCase("tp2-1", "tensor parallel 2 -> gathered onto one device", ("tp", 2), ("whole", 1)),
)
QUICK_CASES = ("fsdp2-tp2", "tp2-tp4")


def placements(kind: str, tp_dim: int | None) -> tuple:
    if kind == "fsdp":
        return (Shard(0),)
    return (Shard(tp_dim),) if kind == "tp" and tp_dim is not None else (Replicate(),)


# ------------------------------------------------------------------------------------ payloads


class Payload:
    """What a method moves: tensors (names in order, source arrays, their ShardedTensors ``tree`` on
    ``src_mesh``) and their destination layouts on ``dst_mesh``; ``spec``, the same as plain data."""

    def __init__(self, arrays: dict, src_layouts, dst_layouts, src_mesh, dst_mesh, timeout_s: float):
        from reshard import distribute

        self.names, self.arrays, self.dst_layouts = list(arrays), list(arrays.values()), dict(dst_layouts)
        self.src_mesh, self.dst_mesh, self.timeout_s = src_mesh, dst_mesh, timeout_s
        self.tree = distribute(dict(zip(self.names, self.arrays, strict=True)), src_layouts, timeout_s=timeout_s)
        self.spec = peers.TreeSpec(
            tuple(self.names),
            tuple(self.tree[k].name for k in self.names),
            tuple(self.arrays),
            tuple(device_regions(src_layouts[k], a.shape) for k, a in zip(self.names, self.arrays, strict=True)),
            tuple(device_regions(self.dst_layouts[k], a.shape) for k, a in zip(self.names, self.arrays, strict=True)),
            src_mesh.device_ids,
            dst_mesh.device_ids,
            timeout_s,
        )

    def plan_bytes(self, shared_memory: bool) -> int:
        """Bytes our plans move between devices (one plan per tensor, as the tree compiles them)."""
        from reshard.runtime import lowered_batch

        batch = lowered_batch(self.tree, self.src_mesh, self.dst_layouts, shared_memory=shared_memory)
        return sum(sum(pair_bytes(t.plan).values()) for t in batch.tensors)

    def free(self) -> None:
        from reshard import free

        free(self.tree)


def _read_shards(ctx, names: list) -> list:
    """In a device actor: its shards ``names`` as numpy arrays."""
    return [ctx.local(n).numpy() for n in names]


def _spoil(ctx, names: list) -> None:
    """In a device actor: every byte of its shards ``names`` set to 0xFF (NaN in a float), so that
    a replay into them that misses a byte fails the bit-exact check."""
    import numpy as np

    for n in names:
        np.asarray(ctx.store.get(n)).view(np.uint8)[...] = 0xFF


# ------------------------------------------------------------------------------------ ours


class Ours:
    """Our reshard of the payload: ``mode`` "tree" (one call), "async" (``async_op=True``; the
    call's return is timed into ``returns``), "loop" (one call per tensor, default path), "out"
    (the first call makes the outputs, every later one replays into them with ``out=``, staged
    and committed all or nothing, as a weight sync does) or "direct" (the same, ``direct=True``)."""

    def __init__(self, payload: Payload, shared_memory: bool = True, mode: str = "tree"):
        self.p, self.shared_memory, self.mode = payload, shared_memory, mode
        self.out: dict | None = None
        self.returns: list[float] = []

    def run(self) -> float:
        from reshard import reshard

        p, timeout = self.p, self.p.timeout_s
        t0 = time.perf_counter()
        if self.mode == "loop":
            out = {k: reshard(p.tree[k], p.src_mesh, p.dst_layouts[k], timeout_s=timeout) for k in p.names}
        elif self.mode in ("out", "direct") and self.out is not None:
            direct = self.mode == "direct"
            out = reshard(p.tree, p.src_mesh, p.dst_layouts, out=self.out, direct=direct, timeout_s=timeout)
        elif self.mode == "async":
            work = reshard(p.tree, p.src_mesh, p.dst_layouts, async_op=True, timeout_s=timeout)
            self.returns.append(time.perf_counter() - t0)
            out = work.wait(timeout_s=timeout)
        else:
            out = reshard(p.tree, p.src_mesh, p.dst_layouts, shared_memory=self.shared_memory, timeout_s=timeout)
        dt = time.perf_counter() - t0
        self.out = out
        return dt

    def last(self) -> dict:
        """{destination device: its shards of the latest output, in tensor order}, one call each."""
        mesh = self.p.dst_mesh
        shards = mesh.call(_read_shards, [self.out[k].name for k in self.p.names], timeout_s=self.p.timeout_s)
        return dict(zip(mesh.device_ids, shards, strict=True))

    def release(self) -> None:
        from reshard import free
        from reshard.runtime import settle

        mesh, timeout = self.p.dst_mesh, self.p.timeout_s
        if self.mode not in ("out", "direct"):
            free(self.out or {})
            self.out = None
        elif self.out is not None:  # the outputs stay for the next replay (``close``), spoiled meanwhile
            mesh.call(_spoil, [self.out[k].name for k in self.p.names], timeout_s=timeout)
        settle(mesh, timeout_s=timeout)

    def close(self) -> None:
        from reshard import free

        free(self.out or {})
        self.out = None

    def moved_bytes(self) -> int:
        return self.p.plan_bytes(self.shared_memory)


# ------------------------------------------------------------------------------------ the suite


class Suite:
    """The device pool (positions 0..n-1 of ``pool``), its mesh views, the TCPStore of the naive
    refit's groups and the RDT actors, for one run."""

    def __init__(self, args, pool=None):
        from reshard import DeviceMesh
        from reshard.runtime.backends.gloo import listening_store

        self.args, self.owns_pool = args, pool is None
        need = 1 + max(p for c in args.case_list for side in c.positions() for p in side)
        if pool is None:
            pool = DeviceMesh.create((need,), backend="gloo", startup_timeout_s=180)
        elif pool.size < need:
            raise ValueError(
                f"the cases {[c.name for c in args.case_list]} need a pool of {need} devices, got {pool!r}"
            )
        self.pool, self.views = pool, {}
        self.store = listening_store("127.0.0.1", timeout_s=120)
        self.rdt, self.rdt_error = None, None
        if RDT in args.method_list:
            try:
                self.rdt = peers.tree_rdt_pool(need)
            except Exception as e:  # recorded for every case
                self.rdt_error = _error(e)

    def view(self, positions: range):
        from reshard import DeviceMesh

        key = tuple(positions)
        if key not in self.views:
            self.views[key] = DeviceMesh.from_devices([self.pool.device_ids[i] for i in key], (len(key),))
        return self.views[key]

    def actors(self, payload: Payload, rdt: bool = False) -> dict:
        """Global device id -> its device actor (``rdt``: the RDT actor of its pool position)."""
        if rdt and self.rdt is None:
            raise RuntimeError(self.rdt_error or "no RDT actors")
        at = {d: self.pool.index_of(d) for d in (*payload.src_mesh.device_ids, *payload.dst_mesh.device_ids)}
        return {d: self.rdt.actors[i] if rdt else self.pool.actor(i) for d, i in at.items()}

    def close(self) -> None:
        from bench import sockets

        try:
            self.listeners = sockets.survey(self.pool)
        except Exception as e:  # recorded: a run that cannot look still reports its results
            self.listeners = {"error": _error(e)}
        if self.rdt is not None:
            self.rdt.close()
        for v in self.views.values():
            v.shutdown()
        if self.owns_pool:
            self.pool.shutdown()

    def runners(self, key: str, tree: Payload, one: Payload, methods: dict) -> dict:
        """The case's methods (``run``, ``last``, ``release``, ``moved_bytes``); a method that
        cannot be set up records its error in ``methods``."""
        make = {
            OURS: lambda: Ours(tree),
            OURS_GLOO: lambda: Ours(tree, shared_memory=False),
            ASYNC: lambda: Ours(tree, mode="async"),
            LOOP: lambda: Ours(tree, mode="loop"),
            ONE: lambda: Ours(one),
            ONE_GLOO: lambda: Ours(one, shared_memory=False),
            OURS_OUT: lambda: Ours(tree, mode="out"),
            OURS_DIRECT: lambda: Ours(tree, mode="direct"),
            ONE_OUT: lambda: Ours(one, mode="out"),
            OBJECT_STORE: lambda: peers.ObjectStoreTree(f"os/{key}", tree.spec, self.actors(tree)),
            NAIVE: lambda: peers.NaiveRefit(f"naive/{key}", tree.spec, self.actors(tree), self.store.port),
            RDT: lambda: peers.DirectTransportTree(f"rdt/{key}", tree.spec, self.actors(tree, rdt=True)),
        }
        out = {}
        for m in self.args.method_list:
            methods[m] = {"kind": "peer" if m in PEERS else "ours"}
            try:
                out[m] = make[m]()
            except Exception as e:
                methods[m].update(error=_error(e), verified=False)
        return out

    def run(self, model: Model, case: WeightCase) -> dict:
        """Time every method on one (model, case); returns the JSON entry."""
        src_mesh, dst_mesh = (self.view(p) for p in case.positions())
        src_kind, dst_kind = case.src[0], case.dst[0]

        def payload(arrays: dict, tp_dims: dict) -> Payload:
            src = {k: Layout(src_mesh, placements(src_kind, d)) for k, d in tp_dims.items()}
            dst = {k: Layout(dst_mesh, placements(dst_kind, d)) for k, d in tp_dims.items()}
            return Payload(arrays, src, dst, src_mesh, dst_mesh, self.args.timeout)

        tree = payload(model.arrays, model.tp_dims)
        minimum = tree.spec.min_bytes()
        rows = max(4, round(minimum / 4 / ONE_COLS / 4) * 4)  # float32, rows split evenly 4 ways
        one_array = make_array((rows, ONE_COLS), "float32", self.args.seed + 10_000)
        one = payload({"one": one_array}, {"one": 1})
        entry: dict = {
            "model": model.name,
            "case": case.name,
            "what": case.what,
            "tensors": len(tree.names),
            "tensor_bytes": model.size_bytes,
            "min_bytes": minimum,
            "one_tensor": {"shape": [rows, ONE_COLS], "bytes": one_array.nbytes, "min_bytes": one.spec.min_bytes()},
            "src": f"{src_kind} on {src_mesh!r}",
            "dst": f"{dst_kind} on {dst_mesh!r}",
            "repeats": self.args.repeats,
            "methods": {},
        }
        runners = self.runners(f"{model.name}/{case.name}", tree, one, entry["methods"])
        entry["order"] = list(runners)
        try:
            time_methods(
                runners,
                {m: one if m in (ONE, ONE_GLOO, ONE_OUT) else tree for m in runners},
                entry["methods"],
                self.args.repeats,
            )
            for m, r in runners.items():  # after the timing: our first call compiles (timed as first_s)
                try:
                    entry["methods"][m]["moved_bytes"] = r.moved_bytes()
                except Exception as e:
                    entry["methods"][m].update(error=_error(e), verified=False)
            entry["descriptors"] = [s["fds"] for s in self.pool.stats()]  # per pool device, after the case
        finally:
            for m in (NAIVE, RDT, OURS_OUT, OURS_DIRECT, ONE_OUT):
                if m in runners:
                    try:
                        runners[m].close()
                    except Exception:
                        pass
            tree.free()
            one.free()
        entry["ok"] = report.case_ok(entry["methods"], counted=("ours", "peer"))
        return entry


def time_methods(runners: dict, payload_of: dict, methods: dict, repeats: int) -> None:
    """Every method once untimed (groups, programs, connections), then ``repeats`` rounds, each
    starting one method later (no method always follows the same one); each output released,
    untimed and settled, right after its run; each method's first timed result verified after its
    clock stopped. Fills ``methods[m]``: latency_s (async: also return_s), verified, error."""
    samples: dict[str, list[float]] = {m: [] for m in runners}
    returns: list[float] = []
    failed: set[str] = set()

    def attempt(m: str, timed: bool) -> None:
        r = runners[m]
        try:
            dt = r.run()
            if not timed:
                methods[m]["first_s"] = dt
            if timed:
                samples[m].append(dt)
                returns.extend(r.returns[-1:] if m == ASYNC else [])
                if "verified" not in methods[m]:
                    methods[m]["verified"], methods[m]["verify_detail"] = payload_of[m].spec.compare(r.last())
                    if not methods[m]["verified"]:
                        raise AssertionError(f"result not bit-exact: {methods[m]['verify_detail']}")
        except Exception as e:  # recorded; one broken method must not sink the suite
            failed.add(m)
            methods[m].update(error=_error(e), verified=False)
        finally:
            try:
                r.release()
            except Exception as e:
                failed.add(m)
                methods[m].setdefault("error", _error(e))

    order = list(runners)
    for m in order:
        attempt(m, False)
    for r in range(repeats):
        for m in order[r % len(order) :] + order[: r % len(order)]:
            if m not in failed:
                attempt(m, True)
    for m, vals in samples.items():
        if vals:
            methods[m]["latency_s"] = stats_of(vals)
    if returns:
        methods[ASYNC]["return_s"] = stats_of(returns)


# ------------------------------------------------------------------------------------ entry point


def _names(p, value: str | None, known, default, what: str) -> list:
    got = [s.strip() for s in value.split(",") if s.strip()] if value else list(default)
    unknown = [s for s in got if s not in known]
    if unknown or not got:
        p.error(f"unknown {what} {unknown or value!r}; choose from {', '.join(known)}")
    return got


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench weights",
        description="Whole-model weight sync: our one-call tree reshard (default and gloo paths, async, the per-tensor "
        "loop, one tensor of the same bytes) beside the Ray object store, a naive torch.distributed refit and Ray "
        "Direct Transport, on GPT-2- and Qwen3-shaped state dicts, every result checked bit-exact.",
    )
    p.add_argument("--quick", action="store_true", help=f"gpt2 only, cases {','.join(QUICK_CASES)}, 2 repeats")
    p.add_argument(
        "--models", help=f"comma-separated models of {', '.join(MODELS)} (default: {','.join(DEFAULT_MODELS)})"
    )
    p.add_argument("--cases", help="comma-separated cases (default: all): " + ", ".join(c.name for c in CASES))
    p.add_argument(
        "--methods",
        help=f"comma-separated methods (default: {', '.join(DEFAULT_METHODS)}; also {OURS_OUT}, {OURS_DIRECT}, "
        f"{ONE_OUT}: replays into the first call's outputs with out=, staged or direct=True)",
    )
    p.add_argument("--layers", type=int, help="transformer layers per model (default: the model's own, 12 / 28)")
    p.add_argument("--repeats", type=int, help="timed rounds per case (default 5; --quick 2)")
    p.add_argument("--out", help="JSON output path (default bench/results/weights-<timestamp>.json)")
    p.add_argument("--figure", help="plot path (default: the JSON path as .png; 'none': no plot)")
    p.add_argument("--timeout", type=float, default=300.0, help="per-call timeout in seconds (default 300)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.quick:
        args.models, args.cases = args.models or "gpt2", args.cases or ",".join(QUICK_CASES)
    args.repeats = args.repeats or (2 if args.quick else 5)
    if args.repeats < 1 or (args.layers is not None and args.layers < 1):
        p.error("--repeats and --layers must be at least 1")
    args.model_list = _names(p, args.models, list(MODELS), DEFAULT_MODELS, "models")
    by_name = {c.name: c for c in CASES}
    args.case_list = [by_name[c] for c in _names(p, args.cases, list(by_name), by_name, "cases")]
    args.method_list = _names(p, args.methods, METHODS, DEFAULT_METHODS, "methods")
    return args


def main(argv: list[str] | None = None, *, pool=None) -> int:
    """Run the suite; ``pool``: an existing DeviceMesh (Ray running) whose first devices serve as the
    pool positions the cases use (6 for all) instead of new ones. Returns 0 when every result was
    verified bit-exact."""
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    from rich.console import Console

    console = Console()
    console = console if console.is_terminal else Console(width=160)
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    when, t0, load = _dt.datetime.now(), time.time(), os.getloadavg()
    entries: list[dict] = []
    suite = None
    try:
        suite = Suite(args, pool)
        for name in args.model_list:
            model = MODELS[name](**({"layers": args.layers} if args.layers else {}), seed=args.seed)
            for case in args.case_list:
                console.print(
                    f"{name} ({len(model.arrays)} tensors, {model.size_bytes / 2**20:.1f} MiB) {case.name}: "
                    f"{case.what}, {args.repeats} rounds of {len(args.method_list)} methods"
                )
                t1 = time.perf_counter()
                entries.append(suite.run(model, case))
                entries[-1]["duration_s"] = time.perf_counter() - t1
    finally:
        if suite is not None:
            suite.close()
        if started:
            ray.shutdown()
    data = {
        "suite": "weights",
        "started": when.isoformat(timespec="seconds"),
        "duration_s": time.time() - t0,
        "command": command_line("weights", argv if argv is not None else sys.argv[1:]),
        "revision": revision(),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "loadavg_start": list(load),
            "loadavg_end": list(os.getloadavg()),
            "ray": ray.__version__,
            "torch": _torch_version(),
        },
        "models": args.model_list,
        "cases": [c.name for c in args.case_list],
        "methods": args.method_list,
        "repeats": args.repeats,
        "rdt_setup_s": getattr(getattr(suite, "rdt", None), "setup_s", None),
        "listeners": getattr(suite, "listeners", None),
        "results": entries,
    }
    data["fit"] = fit(entries)
    data["targets"] = targets(data)
    out = Path(args.out) if args.out else ROOT / "results" / f"weights-{when.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1))
    render(data, console)
    if args.figure != "none":
        figure = Path(args.figure) if args.figure else out.with_suffix(".png")
        plot(data, figure)
        console.print(f"figure: {figure}")
    console.print(f"results: {out}")
    return 0 if entries and all(e["ok"] for e in entries) else 1


if __name__ == "__main__":
    sys.exit(main())
