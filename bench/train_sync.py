"""``python -m bench train-sync``: the weight sync of a Ray Train job as users run it, against the
naive refit they write instead, in one run.

A ``TorchTrainer`` (Ray Train V2) of two CPU workers (gloo) trains a Hugging Face GPT-2 built from a
config (no download: 10 blocks, d=384, vocab 8192; 125 tensors, 81 MiB of float32), sharded with
FSDP2's ``fully_shard``. Two inference actors hold their own copy of the model. After each
optimizer step the train function moves the weights into them by one of three methods, in turn
step by step, timed on rank 0 from the first rank's call to the return of the last engine:

- ``ours``: ``sync()`` of ``reshard.integrations.ray_train`` (set up with ``attach`` and
  ``weight_sync``: three library calls in the train function), all or nothing (staged, then
  committed into the engines' tensors);
- ``ours-direct``: the same with ``direct=True`` (written straight into the engines' tensors: no
  second copy, but a failed sync may leave some of them new);
- ``naive``: every rank gathers each parameter (``full_tensor()``), rank 0 puts the state dict in
  Ray's object store (``ray.put``) and each engine gets it and loads it (``load_state_dict``).

Every sync of every method is checked bit for bit on both engines against the trainers'
``full_tensor()`` (untimed). The target: ours >= 5x faster than naive. JSON goes to
``bench/results/train-sync-<timestamp>.json``.
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import numpy as np  # noqa: E402
import ray  # noqa: E402

from bench.local import recorded_run, stats_of  # noqa: E402

ROOT = Path(__file__).resolve().parent
TARGET = 5.0  # naive / ours
METHODS = ("ours", "ours-direct", "naive")
SETUP_CALLS = 2  # attach, weight_sync (then sync() each step)


def gpt2(layers: int):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=layers, n_head=6, n_embd=384, vocab_size=8192, n_positions=1024, bos_token_id=0, eos_token_id=0
    )
    return GPT2LMHeadModel(config)


@ray.remote(num_cpus=0)
class Engine:
    """An inference worker: its own model in its own memory."""

    def __init__(self, layers: int):
        self.model = gpt2(layers).eval()

    def share(self) -> dict:
        from reshard.runtime import current_device

        return current_device().share_state_dict(self.model.state_dict())

    def load(self, state) -> None:
        self.model.load_state_dict(state)

    def digests(self) -> dict:
        import hashlib

        state = self.model.state_dict()
        return {k: hashlib.blake2b(v.detach().numpy().tobytes()).hexdigest() for k, v in state.items()}


@ray.remote(num_cpus=0)
class Log:
    def __init__(self):
        self.rows: list = []

    def add(self, row: dict) -> None:
        self.rows.append(row)

    def read(self) -> list:
        return self.rows


def train(config):
    import hashlib

    import torch
    from torch.distributed.fsdp import fully_shard

    from reshard.integrations import ray_train

    model = gpt2(config["layers"])
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    engines, log = config["engines"], config["log"]
    group = ray_train.attach()
    out = config["targets"] if group.drives else None
    sync = group.weight_sync(model.state_dict(), out=out)
    direct = group.weight_sync(model.state_dict(), out=out, direct=True)
    tokens = torch.arange(64).reshape(2, 32)

    def naive():
        full = {k: v.full_tensor() for k, v in model.state_dict().items()}
        if group.drives:
            ref = ray.put(full)
            ray.get([e.load.remote(ref) for e in engines], timeout=600)
        torch.distributed.barrier()

    for step in range(config["steps"]):
        model(tokens, labels=tokens).loss.backward()
        opt.step()
        opt.zero_grad()
        method = METHODS[step % len(METHODS)]
        torch.distributed.barrier()
        t0 = time.perf_counter()
        {"ours": sync, "ours-direct": direct, "naive": naive}[method]()
        dt = time.perf_counter() - t0
        want = {
            k: hashlib.blake2b(v.full_tensor().detach().numpy().tobytes()).hexdigest()
            for k, v in model.state_dict().items()
        }
        if group.drives:
            exact = all(d == want for d in ray.get([e.digests.remote() for e in engines], timeout=600))
            ray.get(log.add.remote({"step": step, "method": method, "s": dt, "exact": exact}), timeout=60)


def run(args) -> dict:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from reshard import DeviceMesh, Layout, Replicate
    from reshard.runtime import adopt

    engines = [Engine.remote(args.layers) for _ in range(2)]
    log = Log.remote()
    mesh = DeviceMesh.attach(engines, (2,))
    try:
        names = ray.get(engines[0].share.remote(), timeout=args.timeout_s)
        ray.get(engines[1].share.remote(), timeout=args.timeout_s)
        targets = adopt(Layout(mesh, (Replicate(),)), names)
        previous = signal.getsignal(signal.SIGINT)
        with tempfile.TemporaryDirectory() as storage:
            trainer = TorchTrainer(
                train,
                train_loop_config={
                    "layers": args.layers,
                    "steps": len(METHODS) * (args.repeats + 1),
                    "engines": engines,
                    "log": log,
                    "targets": targets,
                },
                torch_config=TorchConfig(backend="gloo"),
                scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5}),
                run_config=RunConfig(storage_path=storage, name="train-sync"),
            )
            try:
                trainer.fit()
            finally:  # fit() leaves Ray Train's own SIGINT handler installed
                signal.signal(signal.SIGINT, previous)
        rows = ray.get(log.read.remote(), timeout=60)
    finally:
        mesh.shutdown()
        for a in (*engines, log):
            ray.kill(a)
    timed = rows[len(METHODS) :]  # the first step of each method is its warm-up
    methods = {}
    for m in METHODS:
        mine = [r for r in timed if r["method"] == m]
        methods[m] = {**stats_of([r["s"] for r in mine]), "verified": all(r["exact"] for r in rows if r["method"] == m)}
    ratio = methods["naive"]["median"] / methods["ours"]["median"]
    model = gpt2(args.layers)
    return {
        "model": {
            "name": "gpt2",
            "layers": args.layers,
            "d": 384,
            "vocab": 8192,
            "tensors": len(model.state_dict()),
            "bytes": sum(p.numel() * 4 for p in model.parameters()),
        },
        "setup": "TorchTrainer (Ray Train V2), 2 CPU workers, gloo, FSDP2 fully_shard -> 2 inference actors "
        "(full copies, attached)",
        "library_calls": {"setup": SETUP_CALLS, "per_step": 1},
        "methods": methods,
        "ratios": {f"naive/{m}": methods["naive"]["median"] / methods[m]["median"] for m in ("ours", "ours-direct")},
        "targets": {"naive/ours": {"goal": f">= {TARGET}x", "value": ratio, "met": ratio >= TARGET}},
    }


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench train-sync", description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=10, help="GPT-2 blocks (10: 125 tensors, 81 MiB)")
    p.add_argument("--repeats", type=int, default=5, help="timed syncs per method")
    p.add_argument("--timeout-s", type=float, default=300.0)
    p.add_argument("--out", help="JSON path (default bench/results/train-sync-<timestamp>.json)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(argv or [])
    args = parse_args(argv)
    data, path = recorded_run("train-sync", argv, args.out, lambda: run(args))
    m = data["model"]
    print(f"GPT-2 {m['layers']} blocks: {m['tensors']} tensors, {m['bytes'] / 2**20:.0f} MiB")
    for name, s in data["methods"].items():
        print(
            f"{name:6s} median {s['median'] * 1e3:8.1f} ms  (p25 {s['p25'] * 1e3:.1f}, p75 {s['p75'] * 1e3:.1f})"
            f"  n {s['n']}  bit-exact {s['verified']}"
        )
    t = data["targets"]["naive/ours"]
    print(f"naive / ours-direct {data['ratios']['naive/ours-direct']:.2f}x")
    print(
        f"naive / ours {t['value']:.2f}x (goal {t['goal']}: {'met' if t['met'] else 'NO'}); library calls in the "
        f"train function: {SETUP_CALLS} to set up, 1 per step"
    )
    print(f"wrote {path.relative_to(ROOT.parent) if path.is_relative_to(ROOT.parent) else path}")
    return 0 if all(s["verified"] for s in data["methods"].values()) and np.isfinite(t["value"]) else 1


__all__ = ["main"]
