"""Ray Train V2 with FSDP2 and a Hugging Face model, as a user runs them: a ``TorchTrainer`` of two
CPU workers (gloo) trains a GPT-2 built from a config (no download), sharded with ``fully_shard``;
after every optimizer step one ``sync()`` (``reshard.integrations.ray_train``) writes the weights
into two inference actors' own models (attached with ``DeviceMesh.attach``), float32 as trained
or cast in flight to the engines' bfloat16. Every step the inference weights equal the trainers'
``full_tensor()`` (cast as torch casts) bit for bit, and the inference model's logits equal those
of a model loaded with them."""

from __future__ import annotations

import signal

import numpy as np
import pytest
import ray

pytest.importorskip("ray.train.torch", reason="ray[train] is not installed (the test extra has it)")
pytest.importorskip("transformers", reason="transformers is not installed (the test extra has it)")

pytestmark = pytest.mark.dist

STEPS = 3


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    # vocab 503: uneven shards over two ranks
    config = GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=503, n_positions=32, bos_token_id=0, eos_token_id=0)
    import torch

    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


def bits(t):
    """A tensor's bit pattern as numpy (bfloat16 has no numpy type)."""
    import torch

    return t.detach().view({2: torch.int16, 4: torch.int32}[t.element_size()]).numpy().copy()


@ray.remote(num_cpus=0)
class Engine:
    """An inference worker of the user's: its own model, in its own memory."""

    def __init__(self, dtype: str):
        import torch

        self.model = tiny_gpt2().to(getattr(torch, dtype)).eval()
        for p in self.model.parameters():
            p.data.fill_(float("nan"))  # nothing left from the init: every value must come from the sync

    def share(self) -> dict:
        from reshard.runtime import current_device

        return current_device().share_state_dict(self.model.state_dict())

    def weights(self) -> dict:
        return {k: bits(v) for k, v in self.model.state_dict().items()}

    def logits(self, tokens):
        import torch

        with torch.no_grad():
            return bits(self.model(torch.tensor(tokens)).logits)


@ray.remote(num_cpus=0)
class Log:
    """What the driving rank saw at each step (Ray Train V2 returns metrics only with a checkpoint)."""

    def __init__(self):
        self.steps = []

    def add(self, step: dict) -> None:
        self.steps.append(step)

    def read(self) -> list:
        return self.steps


def train(config):
    import torch
    from torch.distributed.fsdp import fully_shard

    from reshard.integrations import ray_train

    model = tiny_gpt2()
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    group = ray_train.attach()
    dtype = getattr(torch, config["dtype"])
    sync = group.weight_sync(model.state_dict(), out=config["engine"] if group.drives else None, dtype=dtype,
                             reback=config["reback"])
    tokens = torch.arange(16).reshape(2, 8) % 503
    for step in range(STEPS):
        loss = model(tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        sync()
        full = {k: bits(v.full_tensor().to(dtype)) for k, v in model.state_dict().items()}  # every rank
        exact = True
        if group.drives:
            for engine in config["engines"]:
                got = ray.get(engine.weights.remote(), timeout=60)
                exact &= all(np.array_equal(got[k], full[k]) for k in full)
            ray.get(config["log"].add.remote({"step": step, "exact": bool(exact), "loss": float(loss)}), timeout=60)


@pytest.mark.parametrize("dtype, reback", [("float32", False), ("bfloat16", True)], ids=["float32", "bf16-reback"])
def test_ray_train_fsdp2_syncs_hugging_face_weights_into_inference_actors(ray_cluster, tmp_path, dtype, reback):
    """``reback``: FSDP2's parameters moved into shared memory when shared (peers map them); FSDP2
    trains on, its views following the storage."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from reshard import DeviceMesh, Layout, Replicate
    from reshard.runtime import adopt

    engines = [Engine.remote(dtype) for _ in range(2)]
    log = Log.remote()
    i_mesh = DeviceMesh.attach(engines, (2,))
    try:
        names = ray.get(engines[0].share.remote(), timeout=60)
        assert ray.get(engines[1].share.remote(), timeout=60) == names
        targets = adopt(Layout(i_mesh, (Replicate(),)), names)
        trainer = TorchTrainer(
            train,
            train_loop_config={"engine": targets, "engines": engines, "log": log, "dtype": dtype, "reback": reback},
            torch_config=TorchConfig(backend="gloo"),
            scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5}),
            run_config=RunConfig(storage_path=str(tmp_path), name="sync"),
        )
        previous = signal.getsignal(signal.SIGINT)
        try:
            result = trainer.fit()
        finally:  # fit() leaves Ray Train's own SIGINT handler installed: later tests' interrupts would exit
            signal.signal(signal.SIGINT, previous)
        assert result.error is None
        steps = ray.get(log.read.remote(), timeout=60)
        assert [s["step"] for s in steps] == list(range(STEPS)) and all(s["exact"] for s in steps), steps
        assert steps[0]["loss"] != steps[-1]["loss"]  # it trained: the weights synced differ each step
        tokens = (np.arange(16).reshape(2, 8) % 503).tolist()
        synced = ray.get(engines[0].weights.remote(), timeout=60)
        import torch

        torch_dtype = getattr(torch, dtype)
        reference = tiny_gpt2().to(torch_dtype).eval()
        reference.load_state_dict({k: torch.from_numpy(v).view(torch_dtype) for k, v in synced.items()})
        with torch.no_grad():
            want = bits(reference(torch.tensor(tokens)).logits)
        for engine in engines:
            np.testing.assert_array_equal(ray.get(engine.logits.remote(tokens), timeout=60), want)
    finally:
        i_mesh.shutdown()
        for a in (*engines, log):
            ray.kill(a)


def test_a_failure_on_the_driving_rank_is_raised_on_every_rank():
    """``WorkerGroup.run`` over a one-rank gloo group (the other ranks' side is the broadcast)."""
    import torch.distributed as dist

    from reshard import ReshardError
    from reshard.integrations import ray_train

    assert not dist.is_initialized(), "this test makes its own one-rank world"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        workers = ray_train.WorkerGroup(rank=0, world=1, drive_rank=0, mesh=None, device=None)
        assert workers.run(lambda: 42) == 42
        with pytest.raises(ReshardError, match=r"rank 0 \(driving\): ZeroDivisionError") as caught:
            workers.run(lambda: 1 / 0)
        assert isinstance(caught.value.__cause__, ZeroDivisionError)
    finally:
        dist.destroy_process_group()
