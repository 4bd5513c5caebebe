"""The examples, run for real at their ``--quick`` sizes on the session's Ray cluster.

``examples/ray_train_sync.py``: a Ray Train V2 job (FSDP2, a Hugging Face Llama) syncs every step
into two tensor-parallel inference workers with fused qkv and gate_up, cast to bfloat16 in flight.

``examples/weight_sync.py``: 2-way tensor-parallel trainers push their whole state dict after every
step, in one call, into four inference actors laid out differently; the inference weights must
equal a single-process reference bit for bit on every sync path (and beside the trainers' compute,
async), and those checks must be able to fail.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.dist

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _example(name: str):
    """Import ``examples/<name>.py`` (not a package) under ``name``."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_weight_sync_quick_is_bit_exact_on_every_path(ray_cluster):
    ws = _example("weight_sync")
    report = ws.main(["--quick", "--overlap"])
    assert len(report.steps) == ws.QUICK.steps == 2
    paths = len(ws.SyncPath)
    for step in report.steps:
        assert step.trainer_losses == (step.reference_loss,) * ws.TRAIN_TP  # bit-identical floats
        assert step.inference_bit_exact == (True,) * (paths + 1), step  # and the sync beside the compute
        assert step.overlap_s is not None and min(step.overlap_s) > 0
        assert step.gathered_bit_exact, step
        assert step.logits_close and step.logits_max_abs_err < 1e-4, step
        assert abs(step.inference_loss - step.reference_eval_loss) < 1e-4
        assert len(step.sync_s) == paths and all(t > 0 for t in step.sync_s)
    assert report.steps[1].reference_loss != report.steps[0].reference_loss  # the weights moved
    assert report.ok
    assert report.delivered_bytes > report.weight_bytes // 2


def _bump(ctx, name):
    ctx.local(name).view(-1)[0] += 1.0


def test_weight_sync_checks_catch_a_wrong_or_missing_bucket(ray_cluster):
    ws = _example("weight_sync")
    cfg = ws.QUICK
    want = ws.Reference(cfg, ws.init_weights(cfg)).weights()
    with ws.started(cfg) as a:
        for path in ws.SyncPath:
            ray_cluster.get([i.poison.remote() for i in a.inference], timeout=60)
            if path in (ws.SyncPath.RESHARD, ws.SyncPath.RESHARD_DIRECT, ws.SyncPath.RESHARD_GLOO):
                ws.sync(path, a, [n for n in want if n != "head.weight"])  # all but the head: it stays NaN
                assert not ws.inference_bit_exact(a, want), path
            ws.sync(path, a)
            assert ws.inference_bit_exact(a, want), path
        a.i_mesh.call(_bump, "layers.0.attn.qkv.weight", devices=[2])
        assert not ws.inference_bit_exact(a, want)
        full = ws.sync(ws.SyncPath.NAIVE, a)
        assert all(np.array_equal(full[n], want[n]) for n in want)
        assert ws.inference_bit_exact(a, want)


def test_ray_train_sync_quick_fills_fused_bf16_regions_bit_exact(ray_cluster):
    pytest.importorskip("ray.train.torch", reason="ray[train] is not installed (the test extra has it)")
    pytest.importorskip("transformers", reason="transformers is not installed (the test extra has it)")
    example = _example("ray_train_sync")
    report = example.main(["--quick"])
    assert [r["step"] for r in report.steps] == [0, 1] and all(r["exact"] for r in report.steps), report.steps
    assert report.steps[0]["loss"] != report.steps[1]["loss"]
    assert "model.layers.0.self_attn.qkv_proj.weight" in report.fused and len(report.fused) == 4
