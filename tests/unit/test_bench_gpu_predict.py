"""bench/gpu_predict.py: figures between GPUs, predicted from the tracked one-GPU results."""

from __future__ import annotations

import json

import pytest

from bench import gpu_predict
from reshard import Layout, Replicate, Shard
from reshard.ir.plan import sim_transfers
from reshard.ir.target import target_for
from reshard.passes.compile import BatchItem, CompileOptions, compile_batch
from topology.simulator import SimKind

pytestmark = pytest.mark.unit


def test_the_figures_are_the_tracked_one_gpu_results():
    f = gpu_predict.measured()
    files = {p.name: json.loads(p.read_text()) for p in gpu_predict.MEASURED}
    copy = files[f.sources["copy"]]["copy"]
    message = files[f.sources["message"]]["message"]
    (whole,) = [m for m in files[f.sources["model"]]["model"] if m["case"] == "whole-whole"]
    assert f.copy_peak_Bps == copy["copy_peak_GBps"] * 1e9
    assert f.message_extra_s[1] == pytest.approx(
        (message["ours"]["per_message_us"] - message["raw"]["per_message_us"]) * 1e-6
    )
    tree, one = whole["ours_tree_split"]["device_call_s"], whole["ours_one_split"]["device_call_s"]
    assert f.per_tensor_s == pytest.approx((tree - one) / whole["tensors"])
    assert 0 < f.fixed_s < whole["ours_one_split"]["wall_s"]
    assert f.sources["message"] == f.sources["model"] == "gpu-20261127-h200-93fca45.json", "the later file's"


def test_a_missing_part_is_named(tmp_path):
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps({"message": {}}))
    with pytest.raises(ValueError, match=r"\['copy', 'model'\]"):
        gpu_predict.measured([path])


def test_a_prediction_is_its_parts_and_its_messages_carry_the_plans_bytes():
    case = gpu_predict.CASES[0]  # Qwen3-0.6B, one node
    f = gpu_predict.measured()
    tree, one = gpu_predict.predict(case, f), gpu_predict.predict(case, f, one_tensor=True)
    for p in (tree, one):
        parts = p["parts"]
        rest = parts["transfer_s"] + parts["copies_s"] + parts["tensors_s"] + parts["fixed_s"]
        assert p["ours_s"] == [pytest.approx(rest + m) for m in parts["messages_s"]]
        assert parts["transfer_s"] >= p["bound_s"] * (1 - 1e-9), "a simulated plan never beats the fluid bound"
    assert tree["bytes"] == one["bytes"] and tree["tensors"] == 311 and one["tensors"] == 1
    assert tree["parts"]["tensors_s"] == pytest.approx(310 * f.per_tensor_s)
    cluster, trainers, engines = gpu_predict.meshes(case)
    assert set(trainers.device_ids).isdisjoint(engines.device_ids) and set(trainers.host_ids) == {0}
    items = [
        BatchItem(
            shape, "bfloat16", Layout(trainers, (Replicate(), Shard(0))), Layout(engines, (Replicate(), Shard(0)))
        )
        for shape in ((4096, 1024), (1024,), (8, 8))
    ]
    target = target_for("nccl")
    batch = compile_batch(items, cluster=cluster, options=CompileOptions.for_target(target), bucket_bytes=1 << 20)
    transfers, messages, copied = gpu_predict._transfers(batch)
    planned = [s for c in batch.tensors for s in sim_transfers(c.plan.transfers, c.plan.itemsize)]
    moved = [s for s in planned if s.kind is not SimKind.COPY]
    assert sum(s.size_bytes for s in transfers if s.kind is not SimKind.COPY) >= sum(s.size_bytes for s in moved)
    assert len(transfers) < len(planned), "small tensors travel in buckets: fewer messages than transfers"
    assert set(messages) == set(trainers.device_ids) | set(engines.device_ids) and min(messages.values()) > 0
    assert max(copied.values()) > 0


def test_copies_hide_the_windows_packed_and_unpacked_while_another_moves():
    """Forty small tensors from one GPU to another in 4 KiB buckets, windows of 16: double-buffered,
    the copies on the critical path are the sender's packing of its first window and the
    receiver's unpacking of its last."""
    from dataclasses import replace

    from topology import Mesh

    src, dst = Mesh((1,), (0,), (0,)), Mesh((1,), (1,), (1,))
    items = [BatchItem((2048,), "bfloat16", Layout(src, (Replicate(),)), Layout(dst, (Replicate(),)))] * 40
    total = 40 * 4096
    for double in (False, True):
        options = replace(CompileOptions.for_target(target_for("nccl")), double_buffer=double)
        batch = compile_batch(items, strategy="send_recv", options=options, bucket_bytes=4096)
        assert batch.program.for_device(0).windows == (16, 16, 8)
        _, _, copied = gpu_predict._transfers(batch)
        assert copied == ({0: 16 * 4096, 1: 8 * 4096} if double else {0: total, 1: total})


def test_the_command_writes_every_case(tmp_path, capsys):
    out = tmp_path / "predicted.json"
    assert gpu_predict.main(["--cases", "qwen3-0.6b", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [c["case"] for c in data["cases"]] == [c.name for c in gpu_predict.CASES if c.model == "qwen3-0.6b"]
    assert data["command"].startswith("python -m bench gpu-predict") and data["revision"]
    assert "NOT measured" in capsys.readouterr().out
