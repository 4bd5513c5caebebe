"""A Ray Train job syncing its weights into tensor-parallel inference workers, as RL loops do.

    python examples/ray_train_sync.py            # 4 steps
    python examples/ray_train_sync.py --quick    # 2 steps (what tests/dist/test_examples.py runs)

Trainers: a ``TorchTrainer`` (Ray Train V2) of two CPU workers (gloo) trains a Hugging Face Llama
built from a config (no download: 2 layers, hidden 64, 4 query and 2 key/value heads, vocab 503),
sharded with FSDP2's ``fully_shard``, in float32. Its train function makes three library calls
(``reshard.integrations.ray_train``): ``attach``, ``weight_sync`` and, after every optimizer step,
``sync()``.

Inference: two workers laid out as vLLM lays out a 2-way tensor-parallel Llama, in bfloat16: each
rank holds a fused ``qkv_proj`` (its query heads' rows, then its key and value heads' rows) and a
fused ``gate_up_proj`` per layer, ``o_proj`` and ``down_proj`` split by input features, the
embedding and the head split by vocabulary rows, the norms whole. Each rank shares every region
under the trainer's name (the name map), so one ``reshard`` writes the trainer's separate q, k, v,
gate and up tensors into the fused ones, cast to bfloat16 by the senders, with no gather.

Check, every step: every region of both workers equals the trainers' ``full_tensor()`` cast to
bfloat16 by torch, bit for bit (the workers start from NaN).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
from dataclasses import dataclass

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import ray  # noqa: E402

TP = 2
PLAN = {  # torch-style tensor-parallel plan of the inference side (``reshard.tensor_parallel_layouts``)
    "model.embed_tokens": "vocab",
    "lm_head": "vocab",
    "*.q_proj": "colwise",
    "*.k_proj": "colwise",
    "*.v_proj": "colwise",
    "*.o_proj": "rowwise",
    "*.gate_proj": "colwise",
    "*.up_proj": "colwise",
    "*.down_proj": "rowwise",
}
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def llama():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=503,
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    return LlamaForCausalLM(config)


def shapes() -> dict:
    return {k: tuple(v.shape) for k, v in llama().state_dict().items()}


def boxes(rank: int) -> dict:
    """Each trainer tensor's box on inference rank ``rank`` (the plan's layouts, as ``torch.chunk``)."""
    from reshard.ir.regions import layout_regions
    from reshard.tp_plans import tensor_parallel_layouts
    from topology import Mesh

    layout = tensor_parallel_layouts(Mesh((TP,), list(range(TP)), [0] * TP), PLAN)

    class Shaped:
        def __init__(self, shape):
            self.shape = shape

    return {k: layout_regions(layout(k, Shaped(s)), s)[rank] for k, s in shapes().items()}


@ray.remote(num_cpus=0)
class InferenceWorker:
    """One tensor-parallel rank, laid out as vLLM lays it out (module docstring)."""

    def __init__(self, rank: int):
        import torch

        self.rank, self.regions, self.tensors = rank, {}, {}
        by_layer: dict = {}
        for name, box in boxes(rank).items():
            rows = [hi - lo for lo, hi in box]
            module, _, _ = name.rpartition(".")
            parent, _, leaf = module.rpartition(".")
            fused = next((f for f, parts in FUSED.items() if leaf in parts), None)
            if fused is None:
                self.tensors[name] = torch.full(rows, float("nan"), dtype=torch.bfloat16)
                self.regions[name] = self.tensors[name]
            else:
                by_layer.setdefault((parent, fused), []).append((FUSED[fused].index(leaf), name, rows))
        for (parent, fused), parts in by_layer.items():
            parts.sort()
            whole = torch.full((sum(r[0] for _, _, r in parts), parts[0][2][1]), float("nan"), dtype=torch.bfloat16)
            self.tensors[f"{parent}.{fused}.weight"] = whole
            at = 0
            for _, name, (n, _) in parts:
                self.regions[name] = whole[at : at + n]  # a region of the fused tensor, under the trainer's name
                at += n

    def share(self) -> dict:
        from reshard.runtime import current_device

        device = current_device()
        for name, region in self.regions.items():
            device.share(name, region)
        return {name: name for name in self.regions}

    def check(self, full: dict) -> bool:
        """Every region equals its slice of the trainers' weights (bfloat16 bit patterns)."""
        import torch

        for name, box in boxes(self.rank).items():
            want = full[name][tuple(slice(lo, hi) for lo, hi in box)]
            if not torch.equal(self.regions[name].view(torch.int16), torch.from_numpy(want)):
                return False
        return True

    def fused(self) -> list:
        return sorted(k for k in self.tensors if k.rpartition(".")[0].rpartition(".")[2] in FUSED)


@ray.remote(num_cpus=0)
class Log:
    def __init__(self):
        self.rows: list = []

    def add(self, row) -> None:
        self.rows.append(row)

    def read(self) -> list:
        return self.rows


def train(config):
    import torch
    from torch.distributed.fsdp import fully_shard

    from reshard.integrations import ray_train

    model = llama()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    group = ray_train.attach()
    sync = group.weight_sync(model.state_dict(), out=config["targets"] if group.drives else None, dtype=torch.bfloat16)
    tokens = torch.arange(32).reshape(2, 16) % 503
    for step in range(config["steps"]):
        loss = model(tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        sync()
        full = {k: v.full_tensor().to(torch.bfloat16).view(torch.int16).numpy() for k, v in model.state_dict().items()}
        if group.drives:
            ref = ray.put(full)
            exact = all(ray.get([w.check.remote(ref) for w in config["workers"]], timeout=120))
            ray.get(config["log"].add.remote({"step": step, "loss": float(loss), "exact": exact}), timeout=60)


@dataclass
class Report:
    steps: list
    fused: list


def main(argv=None) -> Report:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from reshard import DeviceMesh
    from reshard.runtime import adopt
    from reshard.tp_plans import tensor_parallel_layouts

    args = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    args.add_argument("--quick", action="store_true", help="2 steps")
    args = args.parse_args(argv)
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actors cannot import this file
    workers = [InferenceWorker.remote(r) for r in range(TP)]
    log = Log.remote()
    mesh = DeviceMesh.attach(workers, (TP,))
    previous = signal.getsignal(signal.SIGINT)
    try:
        names = ray.get([w.share.remote() for w in workers], timeout=120)[0]
        layout = tensor_parallel_layouts(mesh, PLAN)
        model = llama()
        targets = adopt({k: layout(k, model.state_dict()[k]) for k in names}, names)
        with tempfile.TemporaryDirectory() as storage:
            TorchTrainer(
                train,
                train_loop_config={"targets": targets, "workers": workers, "log": log, "steps": 2 if args.quick else 4},
                torch_config=TorchConfig(backend="gloo"),
                scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5}),
                run_config=RunConfig(storage_path=storage, name="ray-train-sync"),
            ).fit()
        report = Report(ray.get(log.read.remote(), timeout=60), ray.get(workers[0].fused.remote(), timeout=60))
    finally:
        signal.signal(signal.SIGINT, previous)  # fit() leaves Ray Train's own SIGINT handler installed
        mesh.shutdown()
        for a in (*workers, log):
            ray.kill(a)
        if started:
            ray.shutdown()
    for row in report.steps:
        print(
            f"step {row['step']}: loss {row['loss']:.4f}, inference regions equal the trainers' bf16 "
            f"weights: {row['exact']}"
        )
    print(f"fused on each worker: {', '.join(report.fused)}")
    return report


if __name__ == "__main__":
    sys.exit(0 if all(r["exact"] for r in main().steps) else 1)
