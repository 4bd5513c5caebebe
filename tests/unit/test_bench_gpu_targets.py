"""bench/gpu.py: the targets a run judges from the parts it measured."""

from __future__ import annotations

import pytest

from bench.gpu import MiB, targets

pytestmark = pytest.mark.unit


def test_a_run_without_the_copy_part_judges_the_rest():
    data = {
        "tensor": [{"bytes": 64 * MiB, "ipc_direct_s": [0.001]}],
        "message": {"ours": {"per_message_us": 40.0}, "raw": {"per_message_us": 5.0}},
    }
    got = targets(data)
    assert [t["target"] for t in got] == ["fixed cost per message through the backend <= 30 us above raw NCCL's"]
    assert got[0]["met"] is False
    data["copy"] = {"copy_peak_GBps": 100.0}
    share = targets(data)[0]
    assert share["target"].startswith("CUDA IPC reshard") and share["met"] is False  # 67 GB/s of 100
