"""Smoke run of the local benchmark suite (``python -m bench``): every case x strategy at 1 MiB,
one repeat, on the session's pool of 8 device actors; the JSON it writes is complete and every
result was verified bit-exact."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.dist


def test_bench_local_smoke(pool, tmp_path):
    from bench.cases import CASES
    from bench.local import CEILING, NAIVE, RTT, main
    from reshard import STRATEGIES

    out = tmp_path / "local.json"
    rc = main(["--sizes", "1MiB", "--repeats", "1", "--out", str(out)], pool=pool)
    data = json.loads(out.read_text())

    assert data["strategies"] == list(STRATEGIES)
    got = {(e["case"], e["size_bytes"]) for e in data["results"]}
    assert got == {(c.name, 1 << 20) for c in CASES}
    for e in data["results"]:
        where = f"{e['case']} ({e['layouts']})"
        for name in (*STRATEGIES, NAIVE):
            m = e["methods"][name]
            assert "error" not in m, f"{where} {name}: {m['error']}"
            assert m["verified"] is True, f"{where} {name}: {m.get('verify_detail')}"
            assert m["latency_s"]["n"] == 1 and m["latency_s"]["median"] > 0
            assert m["eff_GBps"] > 0
        for name in STRATEGIES:
            assert {"speedup_vs_naive", "frac_of_ceiling", "x_empty_rtt"} <= set(e["methods"][name]), where
        assert e["methods"][CEILING]["latency_s"]["median"] > 0, where
        assert e["methods"][RTT]["latency_s"]["median"] > 0, where
        assert e["ok"], where
    assert rc == 0
