"""Smoke run of the local benchmark suite (``python -m bench``): every case at 64 KiB, one repeat,
on the session's pool of 8 device actors, ours on both paths and in both modes beside every peer
(the object store, Ray Direct Transport, DTensor on the same-mesh case) and both ceilings; the
JSON it writes is complete, every result was verified bit-exact, kept outputs never reused freed
memory and pooled ones did. Also: which source supplies which piece to the object store and RDT."""

from __future__ import annotations

import json

import pytest
from dist_helpers import assert_listens_on_no_wildcard

pytestmark = pytest.mark.dist


def test_assign_pieces_tiles_every_destination_from_holders():
    from bench.cases import CASES
    from bench.peers import assign_pieces
    from reshard.ir.regions import box_volume, contains, intersect, layout_regions

    for case in CASES:
        shape = case.shape_for(1 << 20)
        src, dst = case.layouts()
        src_boxes = dict(zip(src.mesh.device_ids, layout_regions(src, shape), strict=True))
        dst_boxes = dict(zip(dst.mesh.device_ids, layout_regions(dst, shape), strict=True))
        pieces = assign_pieces(src_boxes, dst_boxes)
        assert set(pieces) == set(dst_boxes), case.name
        sent = dict.fromkeys(src_boxes, 0)
        for d, ps in pieces.items():
            assert sum(box_volume(p.box) for p in ps) == box_volume(dst_boxes[d]), (case.name, d)
            for i, p in enumerate(ps):
                assert contains(dst_boxes[d], p.box) and contains(src_boxes[p.src], p.box), (case.name, d, p)
                assert all(intersect(p.box, q.box) is None for q in ps[i + 1 :]), (case.name, d)
                if d in src_boxes and contains(src_boxes[d], p.box):
                    assert p.src == d, f"{case.name}: device {d} holds {p.box} but gets it from {p.src}"
                if p.src != d:
                    sent[p.src] += box_volume(p.box)
        # replicas share the sending: holders of one box send within one piece of each other
        by_box: dict = {}
        for s, box in src_boxes.items():
            by_box.setdefault(box, []).append(sent[s])
        for box, loads in by_box.items():
            biggest = max((box_volume(p.box) for ps in pieces.values() for p in ps), default=0)
            assert max(loads) - min(loads) <= biggest, (case.name, box, loads)


@pytest.mark.timeout(600)  # RDT actors import torch and form a gloo group: slow on a loaded 2-core machine
def test_bench_local_smoke(pool, tmp_path):
    from bench.cases import CASES, POOL_SIZE, fmt_size
    from bench.local import main
    from bench.methods import (
        CEILING,
        CEILING_FRESH,
        DTENSOR,
        MEMCPY,
        OURS,
        OURS_GLOO,
        OURS_GLOO_POOLED,
        OURS_POOLED,
        PEERS,
        RTT,
        SCHEMA,
    )

    out = tmp_path / "local.json"
    rc = main(["--sizes", "64KiB", "--repeats", "1", "--out", str(out)], pool=pool)
    data = json.loads(out.read_text())

    assert data["schema"] == SCHEMA and data["peers"] == list(PEERS)
    assert data["startup"] is None  # a given pool: nothing started, nothing to compare
    got = {(e["case"], e["size_bytes"]) for e in data["results"]}
    assert got == {(c.name, 64 << 10) for c in CASES}
    ours = (OURS, OURS_GLOO, OURS_POOLED, OURS_GLOO_POOLED)
    for e in data["results"]:
        where = f"{e['case']} ({e['layouts']})"
        case = next(c for c in CASES if c.name == e["case"])
        same_mesh = case.src == case.dst and tuple(case.src.device_ids) == tuple(range(POOL_SIZE))
        for name in (*ours, *PEERS):
            m = e["methods"][name]
            if name == DTENSOR and not same_mesh:
                assert "skipped" in m and "latency_s" not in m, where
                continue
            assert "error" not in m, f"{where} {name}: {m['error']}"
            assert m["verified"] is True, f"{where} {name}: {m.get('verify_detail')}"
            assert m["latency_s"]["n"] == 1 and m["latency_s"]["median"] > 0
            assert m["eff_GBps"] > 0 and m["x_empty_rtt"] > 0
        peers_run = {p for p in PEERS if "latency_s" in e["methods"][p]}
        assert peers_run == ({*PEERS} if same_mesh else {*PEERS} - {DTENSOR}), where
        for name in ours:
            m = e["methods"][name]
            assert m["ceiling"] == (MEMCPY if m["path"] == "shared_memory" else CEILING), where
            assert m["frac_of_ceiling"] > 0 and set(m["x_faster_than"]) == peers_run, where
            kept_gloo = m["path"] == "gloo" and m["mode"] == "kept"
            assert ("frac_of_fresh_ceiling" in m) == kept_gloo and m.get("frac_of_fresh_ceiling", 1) > 0, where
        for name in (MEMCPY, CEILING, CEILING_FRESH, RTT):
            assert e["methods"][name]["latency_s"]["median"] > 0, where
        assert e["pool_hits_kept"] == 0 and e["pool_misses_kept"] > 0, f"{where}: kept outputs reused freed memory"
        assert e["pool_hits_pooled"] > 0, f"{where}: the pooled mode never reused a freed shard"
        assert e["groups_created_timed"] == 0, where
        assert e["ok"], where
    targets = {(t["target"], t["method"]): t for t in data["targets"]}
    assert len(targets) == 6
    for t in targets.values():
        if t["in_run"]:
            assert 0 <= t["passed"] <= t["cases"] and t["met"] == (t["passed"] == t["cases"]), t
    faster = targets[("default path faster than every peer", OURS)]
    assert faster["cases"] == len(CASES) * 2 + 1  # object store and RDT everywhere, DTensor on same-mesh
    small = [t for (title, _), t in targets.items() if title.startswith(f"<= {fmt_size(64 << 10)}")]
    assert [t["cases"] for t in small] == [len(CASES)] * 2
    assert_listens_on_no_wildcard(data["listeners"], pool)
    assert rc == 0

