"""bench/report.py: how the summary reads a target's cases."""

from __future__ import annotations

import pytest

from bench.report import _target

pytestmark = pytest.mark.unit


def test_a_targets_median_of_an_even_count_is_the_mean_of_the_middle_two():
    cases = [("a", 1.0), ("b", 4.0), ("c", 2.0), ("d", 3.0)]
    t = _target("t", "m", cases, lambda v: v <= 3.0, lambda v: f"{v:.1f}")
    assert (t["median"], t["median_str"]) == (2.5, "2.5")
    assert (t["passed"], t["cases"], t["met"], t["worst_case"]) == (3, 4, False, "a")


def test_a_case_that_failed_counts_against_the_target_and_not_in_the_median():
    t = _target("t", "m", [("a", 1.0), ("b", None), ("c", 3.0)], lambda v: True, str)
    assert (t["median"], t["passed"], t["cases"], t["met"]) == (2.0, 2, 3, False)
