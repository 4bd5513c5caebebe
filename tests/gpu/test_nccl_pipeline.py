"""A pipeline on NCCL device actors: three stage meshes, tensor parallelism inside the second
(all-reduces on the stage's communicators), activations and gradients on lanes that each run on a
stream and communicators of their own; losses and gradients equal a single-process torch
reference."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
from gpu_bodies import (
    PIPE_C,
    PIPE_D_IN,
    PIPE_H,
    PIPE_M,
    pipe_forward0,
    pipe_forward1,
    pipe_forward2,
    pipe_grads,
    pipe_params,
    pipe_setup0,
    pipe_setup1,
    pipe_setup2,
)

from reshard import Layout, Replicate, Shard
from scheduler import eager_one_f_one_b, one_f_one_b, schedule_from_orders

pytestmark = pytest.mark.gpu(1)


def _reference(params, xs, ys):
    import torch

    t = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in params.items()}
    losses = []
    for x, y in zip(xs, ys, strict=True):
        h0 = torch.tanh(torch.from_numpy(x) @ t["w0"] + t["b0"])
        h1 = torch.tanh(h0 @ t["w1"] + t["b1"])
        loss = ((h1 @ t["w2"] + t["b2"]) @ t["w3"] + t["b3"] - torch.from_numpy(y)).pow(2).sum()
        loss.backward()
        losses.append(float(loss.detach()))
    return losses, {k: v.grad.numpy() for k, v in t.items()}


def _no_transfer_beside_compute(result):
    """NCCL lanes run only between a device's computes (a kernel waiting for its peer while the
    compute loads a kernel would hang the GPU): no send or receive of a stage's first device
    overlaps one of its computes."""
    for stage in range(result.schedule.n_stages):
        events = [e for e in result.events if e.stage == stage]
        computes = [e for e in events if e.kind in ("forward", "backward")]
        transfers = [e for e in events if e.kind in ("send", "recv")]
        assert computes and transfers
        for t in transfers:
            for c in computes:
                assert t.end_s <= c.start_s or c.end_s <= t.start_s, f"stage {stage}: {t} overlaps {c}"


def test_a_tensor_parallel_pipeline_on_nccl_matches_torch(pool):
    from reshard import DeviceMesh
    from scheduler.runtime import Pipeline, Stage

    ids = pool.device_ids
    m0, m1, m2 = (DeviceMesh.from_devices(ids[a:b], s) for a, b, s in ((0, 2, (1, 2)), (2, 4, (1, 2)), (4, 5, (1, 1))))
    params = pipe_params()
    rows = Layout(m0, (Replicate(), Shard(0)))
    whole1, whole2 = Layout(m1, (Replicate(), Replicate())), Layout(m2, (Replicate(), Replicate()))
    stages = [
        Stage(
            m0,
            pipe_forward0,
            setup=partial(pipe_setup0, p=params),
            in_shape=(PIPE_M, PIPE_D_IN),
            in_layout=rows,
            out_shape=(PIPE_M, PIPE_H),
            out_layout=rows,
            dtype="float64",
        ),
        Stage(
            m1,
            pipe_forward1,
            setup=partial(pipe_setup1, p=params),
            in_shape=(PIPE_M, PIPE_H),
            in_layout=whole1,
            out_shape=(PIPE_M, PIPE_H),
            out_layout=whole1,
            dtype="float64",
        ),
        Stage(
            m2,
            pipe_forward2,
            setup=partial(pipe_setup2, p=params),
            in_shape=(PIPE_M, PIPE_H),
            in_layout=whole2,
            dtype="float64",
        ),
    ]
    pipe = Pipeline(stages, timeout_s=120)
    try:
        assert not pipe.pull_lanes  # GPU devices: every lane sends through NCCL
        crossed = schedule_from_orders(
            "crossed", [["F0", "F1", "B0", "B1"], ["F1", "F0", "B0", "B1"], ["F0", "B0", "F1", "B1"]], 2
        )
        with pytest.raises(ValueError, match="cannot run on these GPU meshes.*stuck at stage 0"):
            pipe.plan(crossed)  # stage 1 reads F1 before F0: stage 0's send of F0 would wait forever
        rng = np.random.default_rng(1)
        xs = [rng.standard_normal((PIPE_M, PIPE_D_IN)) for _ in range(4)]
        ys = [rng.standard_normal((PIPE_M, PIPE_C)) for _ in range(4)]
        want_losses, want = _reference(params, xs, ys)
        for schedule, overlap in ((eager_one_f_one_b(3, 4), True), (one_f_one_b(3, 4), False)):
            result = pipe.run(schedule, inputs=xs, targets=ys, overlap=overlap)
            np.testing.assert_allclose(result.losses, want_losses, rtol=1e-10)
            _no_transfer_beside_compute(result)
            assert result.rendezvous and result.predicted().iteration_s > 0  # predicted as the lanes ran
            g0 = pipe.apply(pipe_grads, 1, stages=[0])[0]
            g1 = pipe.apply(pipe_grads, stages=[1])[0]
            g2 = pipe.apply(pipe_grads, stages=[2])[0][0]
            np.testing.assert_array_equal(g0[0]["w0"], g0[1]["w0"])  # the all-reduce gives the same bits
            got = {
                "w0": g0[0]["w0"],
                "b0": g0[0]["b0"],
                "w1": np.concatenate([g1[0]["w1"], g1[1]["w1"]], axis=1),
                "w2": np.concatenate([g1[0]["w2"], g1[1]["w2"]], axis=0),
                "w3": g2["w3"],
                "b3": g2["b3"],
            }
            for name, g in got.items():
                np.testing.assert_allclose(g, want[name], rtol=1e-9, atol=1e-12, err_msg=f"{schedule.name} {name}")
    finally:
        pipe.close()
        for m in (m0, m1, m2):
            m.shutdown()
