"""bench/report.py: how the summary reads a target's cases."""

from __future__ import annotations

import pytest

from bench.report import _target, case_ok

pytestmark = pytest.mark.unit


def test_a_targets_median_of_an_even_count_is_the_mean_of_the_middle_two():
    cases = [("a", 1.0), ("b", 4.0), ("c", 2.0), ("d", 3.0)]
    t = _target("t", "m", cases, lambda v: v <= 3.0, lambda v: f"{v:.1f}")
    assert (t["median"], t["median_str"]) == (2.5, "2.5")
    assert (t["passed"], t["cases"], t["met"], t["worst_case"]) == (3, 4, False, "a")


def test_a_case_that_failed_counts_against_the_target_and_not_in_the_median():
    t = _target("t", "m", [("a", 1.0), ("b", None), ("c", 3.0)], lambda v: True, str)
    assert (t["median"], t["passed"], t["cases"], t["met"]) == (2.0, 2, 3, False)


def test_a_peer_that_failed_is_reported_and_does_not_fail_the_case():
    """Another library timing out is no fault of ours: its error stays in the results, the case
    (and the run's exit status) is decided by our methods, the baselines and the peers that ran."""
    ours = {"kind": "ours", "verified": True}
    failed = {"kind": "peer", "error": "TimeoutError: ray::RdtActor.assemble()"}
    assert case_ok({"ours": ours, "rdt": failed})
    assert not case_ok({"ours": ours, "store": {"kind": "peer", "verified": False}}), "wrong bytes count"
    assert not case_ok({"ours": {"kind": "ours", "error": "ReshardError: ..."}, "rdt": failed})
    assert case_ok({"ours": {"kind": "ours", "verified_earlier": True}, "dt": {"kind": "peer", "skipped": "..."}})
