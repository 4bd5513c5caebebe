"""Pipeline runtime on the local Ray pool: gradients equal a single-process torch reference with
tensor parallelism inside a stage; pull lanes (stage meshes of one machine) give the same bits as
lanes that send through gloo; measured peak activations equal the schedule's; bad input and
failures surface on the driver, located, without hangs, and the actors stay usable."""

from __future__ import annotations

import time

import numpy as np
import pytest

from reshard import Layout, Replicate, Shard
from scheduler import Schedule, ScheduleError, eager_one_f_one_b, gpipe, one_f_one_b

pytestmark = pytest.mark.dist

M, D_IN, H, F, C = 4, 6, 8, 12, 3  # rows per microbatch, widths
LR = 0.05


def init_params(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    shapes = {"w0": (D_IN, H), "b0": (H,), "w1": (H, F), "b1": (F,), "w2": (F, H), "b2": (H,), "w3": (H, C), "b3": (C,)}
    return {k: rng.standard_normal(s) * 0.5 for k, s in shapes.items()}


def data(n_micro: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    xs = [rng.standard_normal((M, D_IN)) for _ in range(n_micro)]
    ys = [rng.standard_normal((M, C)) for _ in range(n_micro)]
    return xs, ys


# ------------------------------------------------------------------ stage callables (run in actors)


def _tensor(a):
    import torch

    return torch.tensor(a, dtype=torch.float64, requires_grad=True)


def setup0(ctx, p=None):
    return {"w0": _tensor(p["w0"]), "b0": _tensor(p["b0"])}


def forward0(ctx, x):  # batch rows sharded over the 1x2 mesh; weights replicated
    import torch

    s = ctx.state
    return torch.tanh(x @ s["w0"] + s["b0"])


def setup1(ctx, p=None):
    c = ctx.coords[1]  # column-parallel w1 / row-parallel w2 over the mesh's second axis
    half = F // 2
    return {
        "w1": _tensor(p["w1"][:, c * half : (c + 1) * half]),
        "b1": _tensor(p["b1"][c * half : (c + 1) * half]),
        "w2": _tensor(p["w2"][c * half : (c + 1) * half, :]),
        "b2": _tensor(p["b2"]),
    }


def forward1(ctx, x):
    import torch

    s = ctx.state
    x = ctx.copy_to_tp(x)  # identity forward, all-reduce of the input gradient backward
    h = torch.tanh(x @ s["w1"] + s["b1"])
    return ctx.reduce_from_tp(h @ s["w2"]) + s["b2"]  # all-reduce forward, identity backward


def setup2(ctx, p=None):
    return {"w3": _tensor(p["w3"]), "b3": _tensor(p["b3"])}


def forward2(ctx, x):
    s = ctx.state
    out = x @ s["w3"] + s["b3"]
    return ((out - ctx.target) ** 2).sum()


def grads(ctx, reduce_axis=None):
    """Parameter gradients of this device (summed over `reduce_axis` of the stage mesh)."""
    out = {}
    for name, p in ctx.state.items():
        g = p.grad.detach().clone()
        if reduce_axis is not None:
            g = ctx.all_reduce(g, axis=reduce_axis)
        out[name] = g.numpy()
    return out


def sgd_step(ctx, lr, reduce_axis=None):
    import torch

    with torch.no_grad():
        for p in ctx.state.values():
            g = p.grad if reduce_axis is None else ctx.all_reduce(p.grad.clone(), axis=reduce_axis)
            p -= lr * g
            p.grad = None


# ------------------------------------------------------------------ reference


def reference_step(params: dict, xs, ys):
    import torch

    t = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in params.items()}
    losses = []
    for x, y in zip(xs, ys, strict=True):
        h0 = torch.tanh(torch.from_numpy(x) @ t["w0"] + t["b0"])
        h1 = torch.tanh(h0 @ t["w1"] + t["b1"])
        h2 = h1 @ t["w2"] + t["b2"]
        loss = ((h2 @ t["w3"] + t["b3"] - torch.from_numpy(y)) ** 2).sum()
        loss.backward()
        losses.append(float(loss.detach()))
    grads = {k: v.grad.numpy().copy() for k, v in t.items()}
    stepped = {k: params[k] - LR * grads[k] for k in params}
    return losses, grads, stepped


# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def model_pipeline(pool):
    """Stage 0: 1x2 mesh, batch rows sharded. Stage 1: 1x2 mesh, tensor parallel (column- then
    row-parallel linear). Stage 2: 1x1, loss. Reshards: S(0) -> R (gather into both TP devices),
    R -> R across meshes, and the gradients back (R -> S(0) scatters rows)."""
    from functools import partial

    from reshard import DeviceMesh
    from scheduler.runtime import Pipeline, Stage

    ids = pool.device_ids
    m0 = DeviceMesh.from_devices(ids[0:2], (1, 2))
    m1 = DeviceMesh.from_devices(ids[2:4], (1, 2))
    m2 = DeviceMesh.from_devices(ids[4:5], (1, 1))
    params = init_params()
    rows = Layout(m0, (Replicate(), Shard(0)))
    stages = [
        Stage(m0, forward0, setup=partial(setup0, p=params), in_shape=(M, D_IN), in_layout=rows,
              out_shape=(M, H), out_layout=rows, dtype="float64"),
        Stage(m1, forward1, setup=partial(setup1, p=params), in_shape=(M, H),
              in_layout=Layout(m1, (Replicate(), Replicate())), out_shape=(M, H),
              out_layout=Layout(m1, (Replicate(), Replicate())), dtype="float64"),
        Stage(m2, forward2, setup=partial(setup2, p=params), in_shape=(M, H),
              in_layout=Layout(m2, (Replicate(), Replicate())), dtype="float64"),
    ]
    pipe = Pipeline(stages, timeout_s=60)
    yield pipe, params, stages
    pipe.close()
    for m in (m0, m1, m2):
        m.shutdown()


def pipeline_grads(pipe) -> dict[str, np.ndarray]:
    g0 = pipe.apply(grads, 1, stages=[0])[0]  # rows sharded over axis 1: sum the partial grads
    g1 = pipe.apply(grads, stages=[1])[0]
    g2 = pipe.apply(grads, stages=[2])[0][0]
    np.testing.assert_array_equal(g0[0]["w0"], g0[1]["w0"])  # the all-reduce gives the same bits
    np.testing.assert_array_equal(g1[0]["b2"], g1[1]["b2"])
    return {
        "w0": g0[0]["w0"], "b0": g0[0]["b0"],
        "w1": np.concatenate([g1[0]["w1"], g1[1]["w1"]], axis=1),
        "b1": np.concatenate([g1[0]["b1"], g1[1]["b1"]]),
        "w2": np.concatenate([g1[0]["w2"], g1[1]["w2"]], axis=0),
        "b2": g1[0]["b2"], "w3": g2["w3"], "b3": g2["b3"],
    }


def step_pipeline(pipe) -> None:
    pipe.apply(sgd_step, LR, 1, stages=[0])
    pipe.apply(sgd_step, LR, stages=[1, 2])


# ------------------------------------------------------------------ tests


def test_tensor_parallel_pipeline_matches_torch_reference(model_pipeline):
    pipe, params, _ = model_pipeline
    assert pipe.pull_lanes == {(0, 1), (1, 0), (1, 2), (2, 1)}  # one machine, shared memory: every lane pulls
    xs, ys = data(4)
    schedules = [eager_one_f_one_b(3, 4), one_f_one_b(3, 4)]
    for step, (schedule, overlap) in enumerate(zip(schedules, (True, False), strict=True)):
        ref_losses, ref_grads, params = reference_step(params, xs, ys)
        result = pipe.run(schedule, inputs=xs, targets=ys, overlap=overlap)
        np.testing.assert_allclose(result.losses, ref_losses, rtol=1e-10, err_msg=f"step {step}")
        got = pipeline_grads(pipe)
        for name, want in ref_grads.items():
            np.testing.assert_allclose(got[name], want, rtol=1e-9, atol=1e-12, err_msg=f"step {step} {name}")
        assert result.peak_activations == schedule.peak_activations
        step_pipeline(pipe)  # both sides take the same SGD step, so step 1 checks trained weights


def test_pull_lanes_give_the_bits_that_message_lanes_give(model_pipeline):
    """The same model through lanes that send through gloo (``shared_memory=False``) and through
    pull lanes: the same losses and gradients, bit for bit, over two schedules."""
    from scheduler.runtime import Pipeline

    _, _, stages = model_pipeline  # fresh pipelines: both start from the initial weights
    pulled, sent = Pipeline(stages, timeout_s=60), Pipeline(stages, timeout_s=60, shared_memory=False)
    try:
        assert not sent.pull_lanes and pulled.pull_lanes
        xs, ys = data(5, seed=3)
        for schedule in (one_f_one_b(3, 5), gpipe(3, 5)):
            results = []
            for p in (pulled, sent):
                results.append((p.run(schedule, inputs=xs, targets=ys).losses, pipeline_grads(p)))
                p.apply(lambda ctx: [setattr(w, "grad", None) for w in ctx.state.values()])
            (pulled_losses, pulled_grads), (sent_losses, sent_grads) = results
            assert pulled_losses == sent_losses
            for name, g in sent_grads.items():
                np.testing.assert_array_equal(pulled_grads[name], g, err_msg=f"{schedule.name} {name}")
    finally:
        pulled.close()
        sent.close()


@pytest.mark.parametrize("make", [gpipe, one_f_one_b, eager_one_f_one_b])
def test_measured_peak_activations_equal_the_schedule(model_pipeline, make):
    pipe, _, _ = model_pipeline
    xs, ys = data(6, seed=2)
    schedule = make(3, 6)
    result = pipe.run(schedule, inputs=xs, targets=ys)
    assert result.peak_activations == schedule.peak_activations
    assert len(result.forward_s[1]) == 6 and len(result.backward_s[1]) == 6
    assert set(result.transfer_s) == {(0, 1), (1, 2), (2, 1), (1, 0)}
    assert result.iteration_s > 0 and result.predicted().iteration_s > 0 and not result.rendezvous
    pipe.apply(lambda ctx: [setattr(p, "grad", None) for p in ctx.state.values()])


# ------------------------------------------------------------------ bad input and failures


def fwd_small(ctx, x):
    import torch

    s = ctx.state
    if s.get("fail") == (ctx.stage, ctx.microbatch):
        raise ValueError(f"boom at microbatch {ctx.microbatch}")
    if s.get("sleep") == (ctx.stage, ctx.microbatch):
        time.sleep(2.5)
    if s.get("bad_shape") == (ctx.stage, ctx.microbatch):
        return torch.zeros(3, 3)
    if ctx.stage == 1:
        return x.sum()
    return torch.full((2, 3), float(ctx.microbatch))


def bwd_small(ctx, grad):
    import torch

    if ctx.state.get("fail_b") == (ctx.stage, ctx.microbatch):
        raise KeyError("backward boom")
    return None if ctx.stage == 0 else torch.ones(2, 3)


def setup_small(ctx):
    return {}


@pytest.fixture(scope="module")
def small_pipeline(pool):
    from reshard import DeviceMesh
    from scheduler.runtime import Pipeline, Stage

    a = DeviceMesh.from_devices(pool.device_ids[5:6], (1, 1))
    b = DeviceMesh.from_devices(pool.device_ids[6:7], (1, 1))
    stages = [
        Stage(a, fwd_small, bwd_small, setup_small, out_shape=(2, 3), out_layout=Layout(a, (Replicate(), Replicate()))),
        Stage(b, fwd_small, bwd_small, setup_small, in_shape=(2, 3), in_layout=Layout(b, (Replicate(), Replicate()))),
    ]
    pipe = Pipeline(stages, timeout_s=30)
    yield pipe
    pipe.close()
    a.shutdown()
    b.shutdown()


def set_state(ctx, key, value):
    ctx.state[key] = value


def test_callable_error_names_stage_and_microbatch_then_pipeline_still_works(small_pipeline):
    from scheduler.runtime import PipelineError

    pipe = small_pipeline
    pipe.apply(set_state, "fail", (1, 2), stages=[1])
    t0 = time.monotonic()
    with pytest.raises(
        PipelineError, match=r"stage 1 \(device \d+\) forward of microbatch 2 raised ValueError"
    ) as info:
        pipe.run(eager_one_f_one_b(2, 4))
    assert time.monotonic() - t0 < 10
    err = info.value
    assert (err.kind, err.stage, err.microbatch, err.phase) == ("user", 1, 2, "F")
    assert "boom at microbatch 2" in str(err) and "Traceback" in err.remote_traceback
    pipe.apply(set_state, "fail", None, stages=[1])
    result = pipe.run(eager_one_f_one_b(2, 4))
    assert result.losses == [0.0, 6.0, 12.0, 18.0]


def test_backward_error_is_located(small_pipeline):
    from scheduler.runtime import PipelineError

    pipe = small_pipeline
    pipe.apply(set_state, "fail_b", (1, 3), stages=[1])
    with pytest.raises(PipelineError, match=r"stage 1 .* backward of microbatch 3 raised KeyError") as info:
        pipe.run(gpipe(2, 4), overlap=False)
    assert info.value.phase == "B"
    pipe.apply(set_state, "fail_b", None, stages=[1])
    assert pipe.run(gpipe(2, 4)).peak_activations == (4, 4)


def test_output_of_the_wrong_shape_is_located(small_pipeline):
    from scheduler.runtime import PipelineError

    pipe = small_pipeline
    pipe.apply(set_state, "bad_shape", (0, 1), stages=[0])
    expected = r"stage 0 .* microbatch 1 raised ValueError: forward returned an output shard of shape \(3, 3\)"
    with pytest.raises(PipelineError, match=expected) as info:
        pipe.run(eager_one_f_one_b(2, 3))
    assert "has shape (2, 3)" in str(info.value)
    pipe.apply(set_state, "bad_shape", None, stages=[0])
    assert pipe.run(eager_one_f_one_b(2, 3)).losses == [0.0, 6.0, 12.0]


def test_slow_callable_times_out_located_then_pipeline_recovers(small_pipeline):
    from scheduler.runtime import PipelineTimeout

    pipe = small_pipeline
    pipe.apply(set_state, "sleep", (1, 1), stages=[1])
    t0 = time.monotonic()
    with pytest.raises(PipelineTimeout, match="stage 1 .* forward of microbatch 1 timed out") as info:
        pipe.run(one_f_one_b(2, 3), timeout_s=1.0)
    assert time.monotonic() - t0 < 20
    assert info.value.stage == 1 and info.value.microbatch == 1
    pipe.apply(set_state, "sleep", None, stages=[1])
    assert pipe.run(one_f_one_b(2, 3)).losses == [0.0, 6.0, 12.0]


def _fail_first_lane_op(ctx, kind: str):
    state = {"armed": True}

    def hook(run, op):
        from reshard.ir import program

        if state["armed"] and run.groups.channel.startswith("pipeline:") and isinstance(op, getattr(program, kind)):
            state["armed"] = False
            raise RuntimeError("injected link failure")

    ctx.before_op = hook


def _clear_hook(ctx):
    ctx.before_op = None


@pytest.mark.parametrize(
    "shared_memory, kind, stage, where",
    [(False, "Send", 0, r"stage 0 .*send F0 0->1"), (True, "Pull", 1, r"stage 1 .*recv F0 0->1")],
    ids=["message-lane", "pull-lane"],
)
def test_transfer_failure_surfaces_fast_and_the_lane_recovers(small_pipeline, pool, shared_memory, kind, stage, where):
    """A lane's first transfer fails (its sender's send, or its receiver's pull): the iteration
    fails fast naming it, and the next one works (message lanes get fresh communicators)."""
    from scheduler.runtime import Pipeline, PipelineError

    pipe = Pipeline(small_pipeline.stages, timeout_s=30, shared_memory=shared_memory)
    try:
        assert bool(pipe.pull_lanes) == shared_memory
        pipe.run(eager_one_f_one_b(2, 2))
        victim = pool.device_ids.index(pipe.meshes[stage].device_ids[0])
        pool.call(_fail_first_lane_op, kind, devices=[victim])
        try:
            t0 = time.monotonic()
            with pytest.raises(PipelineError, match=where + r".* transfer failed") as info:
                pipe.run(eager_one_f_one_b(2, 4))
            assert time.monotonic() - t0 < 15
            assert info.value.kind == "transfer"
        finally:
            pool.call(_clear_hook, devices=[victim])
        assert pipe.run(eager_one_f_one_b(2, 4)).losses == [0.0, 6.0, 12.0, 18.0]
    finally:
        pipe.close()


def test_invalid_schedule_shows_the_grid(small_pipeline):
    good = one_f_one_b(2, 2)
    bad = Schedule(good.name, 2, 2, good.streams, tuple(reversed(good.clock_table)))
    with pytest.raises(ScheduleError) as info:
        small_pipeline.run(bad)
    assert "clk" in str(info.value) and ">>" in str(info.value)
    with pytest.raises(ValueError, match="3 stages"):
        small_pipeline.run(one_f_one_b(3, 2))
    with pytest.raises(ValueError, match="inputs"):
        small_pipeline.run(one_f_one_b(2, 2), inputs=[np.zeros((2, 3))])


def test_bad_pipeline_definitions():
    from scheduler.runtime import Pipeline, Stage
    from topology import Mesh

    a, b = Mesh((1, 1), [100]), Mesh((1, 2), [101, 102])
    la, lb = Layout(a, (Replicate(), Replicate())), Layout(b, (Replicate(), Shard(1)))

    def f(ctx, x):
        return x

    with pytest.raises(ValueError, match="at least one stage"):
        Pipeline([])
    with pytest.raises(ValueError, match="n_microbatches must be >= 1"):
        eager_one_f_one_b(2, 0)
    with pytest.raises(ValueError, match=r"stage 0 produces \(4, 8\) .* stage 1 expects an input of shape \(4, 6\)"):
        Pipeline([Stage(a, f, out_shape=(4, 8), out_layout=la), Stage(b, f, in_shape=(4, 6), in_layout=lb)])
    bad = Layout(a, (Replicate(), Shard(2)))
    with pytest.raises(ValueError, match="stage 0: out_layout does not fit out_shape"):
        Pipeline([Stage(a, f, out_shape=(4, 8), out_layout=bad), Stage(b, f, in_shape=(4, 8), in_layout=lb)])
    with pytest.raises(ValueError, match="not on the stage's mesh"):
        Pipeline([Stage(a, f, out_shape=(4, 8), out_layout=lb), Stage(b, f, in_shape=(4, 8), in_layout=lb)])
    with pytest.raises(ValueError, match="in_shape and in_layout are required"):
        Pipeline([Stage(a, f, out_shape=(4, 8), out_layout=la), Stage(b, f)])
    with pytest.raises(ValueError, match="share device"):
        Pipeline([Stage(a, f, out_shape=(4, 8), out_layout=la), Stage(a, f, in_shape=(4, 8), in_layout=la)])
    with pytest.raises(TypeError, match="forward must be callable"):
        Pipeline([Stage(a, None)])
