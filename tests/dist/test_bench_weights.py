"""Smoke run of the weight-sync suite (``python -m bench weights``): one case of a 2-layer GPT-2-shaped
state dict, one round of every method on the session's pool (those on request too); every result verified bit-exact,
the JSON and the plot written, the fit and the targets computed. Also: the models have their
namesakes' tensors and sizes, and the peers' routes tile every destination from a holder."""

from __future__ import annotations

import json

import pytest
from dist_helpers import assert_listens_on_no_wildcard

pytestmark = pytest.mark.dist


def test_models_have_their_namesakes_tensors():
    from bench.weights import CASES, gpt2, moe, placements, qwen3

    gpt, qwen = gpt2(), qwen3()
    assert len(gpt.arrays) == 148 and 40 << 20 < gpt.size_bytes < 50 << 20
    assert len(qwen.arrays) == 311 and 20 << 20 < qwen.size_bytes < 60 << 20
    assert gpt.tp_dims["h.3.attn.c_attn.weight"] == 1 and gpt.tp_dims["h.3.mlp.c_proj.weight"] == 0
    assert qwen.tp_dims["model.layers.5.mlp.gate_proj.weight"] == 0 and qwen.tp_dims["lm_head.weight"] == 0
    assert qwen.tp_dims["model.layers.5.self_attn.o_proj.weight"] == 1
    assert gpt.tp_dims["h.0.attn.c_proj.bias"] is None and qwen.tp_dims["model.norm.weight"] is None
    experts = moe(layers=2, experts=3)
    assert len(experts.arrays) == 18 and len(moe().arrays) == 20_016
    assert experts.tp_dims["model.layers.1.mlp.experts.2.down_proj.weight"] == 1
    for case in CASES:
        src, dst = case.positions()
        assert not set(src) & set(dst), case.name
    assert str(placements("fsdp", None)[0]) == "S(0)" and str(placements("tp", None)[0]) == "R"


@pytest.mark.timeout(300)  # RDT actors import torch and form a gloo group: slow on a loaded 2-core machine
def test_bench_weights_smoke(pool, tmp_path):
    from bench.weights import METHODS, PEERS, main

    out, figure = tmp_path / "weights.json", tmp_path / "weights.png"
    argv = f"--cases fsdp2-tp2 --models gpt2 --layers 2 --repeats 1 --methods {','.join(METHODS)}".split()
    argv += ["--out", str(out), "--figure", str(figure)]
    rc = main(argv, pool=pool)
    data = json.loads(out.read_text())
    assert figure.stat().st_size > 0
    (entry,) = data["results"]
    assert entry["tensors"] == 28
    for m in METHODS:
        v = entry["methods"][m]
        assert "error" not in v, f"{m}: {v['error']}"
        assert v["verified"] is True, f"{m}: {v.get('verify_detail')}"
        assert v["latency_s"]["n"] == 1 and v["latency_s"]["median"] > 0
        least = entry["one_tensor"]["min_bytes"] if m.startswith("one_tensor") else entry["min_bytes"]
        assert v["moved_bytes"] >= least > 0, m  # nothing gets there without crossing
        assert v["first_s"] > 0, m
    assert len(entry["descriptors"]) == pool.size and all(n > 0 for n in entry["descriptors"])
    assert entry["methods"]["ours_async"]["return_s"]["median"] > 0
    assert set(data["fit"]) == {"default", "gloo"} and set(entry["fit_s"]) == {"default", "gloo"}
    targets = {t["target"]: t for t in data["targets"]}
    assert len(targets) == 8 and all(t["in_run"] != title.startswith("qwen3") for title, t in targets.items())
    faster = next(t for title, t in targets.items() if title.startswith("ours (default path) faster"))
    assert faster["cases"] == len(PEERS)
    assert all(t["met"] == (t["passed"] == t["cases"]) for t in targets.values() if t["in_run"])
    assert_listens_on_no_wildcard(data["listeners"], pool)
    assert entry["ok"] and rc == 0
