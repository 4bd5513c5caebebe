"""``python -m bench framework`` end to end at a small size: every method bit-exact, the framework's
tensors pulled (cross-memory reads) and the gloo method's sent."""

from __future__ import annotations

import json

import pytest

from bench import framework
from reshard.runtime.device import cross_memory

pytestmark = [
    pytest.mark.dist,
    pytest.mark.skipif(not cross_memory.available(), reason="this kernel does not let the user read its processes"),
]


def test_bench_framework_runs_every_method_bit_exact(ray_cluster, tmp_path):
    out = tmp_path / "framework.json"
    assert framework.main(["--layers", "1", "--repeats", "1", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert all(m["verified"] for m in data["methods"].values())
    assert data["moves"]["framework"]["pull_ops"] > 0 and data["moves"]["framework"]["message_ops"] == 0
    assert data["moves"]["framework-reback"]["pull_ops"] > 0
    assert data["moves"]["framework-gloo"]["pull_ops"] == 0 and data["moves"]["framework-gloo"]["message_ops"] > 0
    assert data["targets"]["framework/library"]["value"] > 0
