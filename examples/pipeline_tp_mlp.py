"""Train a 3-stage pipelined MLP with tensor parallelism inside the middle stage, on local Ray.

    python examples/pipeline_tp_mlp.py [--steps 3] [--microbatches 4]

Stage 0: a 1x1 mesh, ``tanh(x W0)``. Stage 1: a 1x2 mesh, a column-parallel linear (W1 split by
columns) then a row-parallel one (W2 split by rows), the partial sums all-reduced
(``ctx.reduce_from_tp``) and the input gradient all-reduced (``ctx.copy_to_tp``). Stage 2: a 1x1
mesh, a linear layer and the squared-error loss. Eager 1F1B moves activations and gradients between
the stage meshes with reshard programs while the stages compute. Each step is checked against the
same model trained in one process with torch.
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import numpy as np  # noqa: E402

ROWS, D_IN, HIDDEN, FFN, OUT = 8, 16, 32, 64, 4
LR = 0.02


def _param(a):
    import torch

    return torch.tensor(a, dtype=torch.float64, requires_grad=True)


def setup_embed(ctx, p):
    return {"w0": _param(p["w0"])}


def embed(ctx, x):
    import torch

    return torch.tanh(x @ ctx.state["w0"])


def setup_mlp(ctx, p):
    c, half = ctx.coords[1], FFN // 2  # this device's column / row block
    return {"w1": _param(p["w1"][:, c * half : (c + 1) * half]), "w2": _param(p["w2"][c * half : (c + 1) * half])}


def mlp(ctx, x):
    import torch

    h = torch.relu(ctx.copy_to_tp(x) @ ctx.state["w1"])  # column parallel
    return x + ctx.reduce_from_tp(h @ ctx.state["w2"])  # row parallel + residual


def setup_head(ctx, p):
    return {"w3": _param(p["w3"])}


def head(ctx, x):
    return ((x @ ctx.state["w3"] - ctx.target) ** 2).mean()


def sgd(ctx, lr):
    import torch

    with torch.no_grad():
        for p in ctx.state.values():
            p -= lr * p.grad
            p.grad = None


def reference(params, xs, ys):
    import torch

    t = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    losses = []
    for x, y in zip(xs, ys, strict=True):
        h = torch.tanh(torch.from_numpy(x) @ t["w0"])
        h = h + torch.relu(h @ t["w1"]) @ t["w2"]
        loss = ((h @ t["w3"] - torch.from_numpy(y)) ** 2).mean()
        loss.backward()
        losses.append(float(loss.detach()))
    return losses, {k: params[k] - LR * t[k].grad.numpy() for k in params}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--microbatches", type=int, default=4)
    args = ap.parse_args(argv)

    import ray

    from reshard import DeviceMesh, Layout, Replicate
    from scheduler import eager_one_f_one_b
    from scheduler.runtime import Pipeline, Stage

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # actors cannot import this script
    rng = np.random.default_rng(0)
    shapes = {"w0": (D_IN, HIDDEN), "w1": (HIDDEN, FFN), "w2": (FFN, HIDDEN), "w3": (HIDDEN, OUT)}
    params = {k: rng.standard_normal(s) / np.sqrt(s[0]) for k, s in shapes.items()}
    m = args.microbatches
    xs = [rng.standard_normal((ROWS, D_IN)) for _ in range(m)]
    ys = [rng.standard_normal((ROWS, OUT)) for _ in range(m)]

    pool = DeviceMesh.create((1, 4))
    m0, m1, m2 = (DeviceMesh.from_devices(pool.device_ids[a:b], (1, b - a)) for a, b in ((0, 1), (1, 3), (3, 4)))

    def rep(mesh):
        return Layout(mesh, (Replicate(), Replicate()))

    act = (ROWS, HIDDEN)
    stages = [
        Stage(
            m0,
            embed,
            setup=partial(setup_embed, p=params),
            in_shape=(ROWS, D_IN),
            in_layout=rep(m0),
            out_shape=act,
            out_layout=rep(m0),
            dtype="float64",
        ),
        Stage(
            m1,
            mlp,
            setup=partial(setup_mlp, p=params),
            in_shape=act,
            in_layout=rep(m1),
            out_shape=act,
            out_layout=rep(m1),
            dtype="float64",
        ),
        Stage(m2, head, setup=partial(setup_head, p=params), in_shape=act, in_layout=rep(m2), dtype="float64"),
    ]
    ok = True
    with Pipeline(stages) as pipe:
        for step in range(args.steps):
            want, params = reference(params, xs, ys)
            result = pipe.run(eager_one_f_one_b(3, m), inputs=xs, targets=ys)
            pipe.apply(sgd, LR)
            w2 = np.concatenate(
                [r["w2"] for r in pipe.apply(lambda ctx: {"w2": ctx.state["w2"].detach().numpy()}, stages=[1])[0]]
            )
            close = np.allclose(result.losses, want, rtol=1e-10) and np.allclose(w2, params["w2"], rtol=1e-10)
            ok &= close
            print(
                f"step {step}: loss {sum(result.losses):.6f} (torch {sum(want):.6f}) "
                f"{'matches' if close else 'DIFFERS'}; iteration {result.iteration_s * 1e3:.1f} ms, "
                f"peak activations {result.peak_activations}"
            )
    for mesh in (m0, m1, m2, pool):
        mesh.shutdown()
    ray.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
