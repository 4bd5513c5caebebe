"""Fused weights on the receiving side, as inference engines keep them: a trainer's separate q, k,
v (and gate, up) tensors written into regions of an engine's fused tensor, with no gather. A
region along the first dimension (a Linear's fused qkv, tensor-parallel by heads: each rank holds
its q, k and v rows one after the other) is a contiguous view; a region along another (GPT-2's
Conv1D c_attn, q, k and v side by side in its columns) is a strided view, written by the staged
commit. The engine shares each region under the trainer's name: that is the name map."""

from __future__ import annotations

import numpy as np
import pytest
import ray
from dist_helpers import assert_bit_exact

from reshard import DeviceMesh, Layout, ReshardError, Shard, reshard
from reshard.ir.placement import Replicate
from reshard.runtime import DeviceRole, adopt

pytestmark = pytest.mark.dist

H, D, F = 8, 6, 10  # heads' rows of q, k, v; model width; MLP rows of gate and up


def weights() -> dict:
    rng = np.random.default_rng(7)
    shapes = {"q": (H, D), "k": (H, D), "v": (H, D), "gate": (F, D), "up": (F, D), "c_q": (D, D), "c_k": (D, D),
              "c_v": (D, D)}
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


@ray.remote(num_cpus=0)
class Worker(DeviceRole):
    def trainer(self, shards: dict) -> dict:
        """A trainer rank: separate tensors, each its FSDP shard."""
        import torch

        self.state = {k: torch.from_numpy(v.copy()) for k, v in shards.items()}
        return self.reshard_device.share_state_dict(self.state)

    def engine(self, rank: int, tp: int) -> None:
        """An engine rank: fused tensors (NaN until written), each region shared under the trainer's name."""
        import torch

        h, f = H // tp, F // tp
        self.qkv = torch.full((3 * h, D), float("nan"))  # Linear, by heads: [q_r; k_r; v_r]
        self.gate_up = torch.full((2 * f, D), float("nan"))
        self.c_attn = torch.full((D, 3 * D), float("nan"))  # Conv1D, whole on every rank: [q | k | v] columns
        dev = self.reshard_device
        for i, k in enumerate("qkv"):
            dev.share(k, self.qkv[i * h : (i + 1) * h])
            dev.share(f"c_{k}", self.c_attn[:, i * D : (i + 1) * D])
        dev.share("gate", self.gate_up[:f])
        dev.share("up", self.gate_up[f:])

    def fused(self) -> dict:
        return {"qkv": self.qkv.numpy().copy(), "gate_up": self.gate_up.numpy().copy(),
                "c_attn": self.c_attn.numpy().copy()}


@pytest.fixture(scope="module")
def sides(ray_cluster):
    trainers = [Worker.remote() for _ in range(2)]
    engines = [Worker.remote() for _ in range(2)]
    t_mesh, e_mesh = DeviceMesh.from_actors(trainers, (2,)), DeviceMesh.from_actors(engines, (2,))
    yield trainers, engines, t_mesh, e_mesh
    t_mesh.shutdown()
    e_mesh.shutdown()
    for w in (*trainers, *engines):
        ray.kill(w)


def test_separate_tensors_land_in_regions_of_fused_ones(sides):
    trainers, engines, t_mesh, e_mesh = sides
    w = weights()
    fsdp = Layout(t_mesh, (Shard(0),))
    names = ray.get([t.trainer.remote({k: np.array_split(v, 2)[r] for k, v in w.items()})
                     for r, t in enumerate(trainers)], timeout=60)[0]
    tree = adopt(fsdp, names)
    ray.get([e.engine.remote(r, 2) for r, e in enumerate(engines)], timeout=60)
    tp, whole = Layout(e_mesh, (Shard(0),)), Layout(e_mesh, (Replicate(),))
    layouts = {k: whole if k.startswith("c_") else tp for k in w}
    out = adopt(layouts, {k: k for k in w})
    reshard(tree, t_mesh, layouts, out=out)
    for r, got in enumerate(ray.get([e.fused.remote() for e in engines], timeout=60)):
        h, f = H // 2, F // 2
        rows = slice(r * h, (r + 1) * h)
        assert_bit_exact(got["qkv"], np.concatenate([w["q"][rows], w["k"][rows], w["v"][rows]]))
        assert_bit_exact(got["gate_up"], np.concatenate([w["gate"][r * f : (r + 1) * f], w["up"][r * f : (r + 1) * f]]))
        assert_bit_exact(got["c_attn"], np.concatenate([w["c_q"], w["c_k"], w["c_v"]], axis=1))
    assert_bit_exact(out["c_q"].to_numpy(), w["c_q"])  # a strided region reads back as what was written
    with pytest.raises(ReshardError, match="strided view .* drop direct=True"):
        reshard(tree, t_mesh, layouts, out=out, direct=True)
    with pytest.raises(ReshardError, match="is a strided view .* reshard from a contiguous tensor"):
        reshard(out["c_q"], e_mesh, Layout(t_mesh, (Shard(0),)))
