"""How a failed pipeline iteration reads (``scheduler.runtime.pipeline``): the root cause first,
then every other worker's error on a line of its own, earliest first."""

from __future__ import annotations

import pytest

from scheduler.runtime.pipeline import FOLLOW_ON_SHOWN, PipelineTimeout, _as_error

pytestmark = pytest.mark.unit


def _error(stage, device, t, kind="timeout", **extra):
    return {
        "kind": kind,
        "stage": stage,
        "device": device,
        "microbatch": 0,
        "phase": "B",
        "type": "TimeoutError",
        "message": f"waited on stage {stage}\nsecond line",
        "traceback": "tb",
        "time": t,
        **extra,
    }


def test_the_follow_on_errors_are_listed_after_the_root_cause():
    errors = [
        _error(1, 2, 3.0, transfer="recv B0 2->1"),
        _error(0, 0, 1.0),
        _error(2, 4, 2.0, transfer="send B0 2->1"),
    ]
    e = _as_error(errors)
    assert isinstance(e, PipelineTimeout) and e.device == 0 and len(e.errors) == 3
    text = str(e)
    head, follow = text.split("--- follow-on errors, earliest first ---\n")
    assert head.startswith("stage 0 (device 0) backward of microbatch 0 timed out") and "(+2 follow-on" in head
    assert follow.splitlines() == [
        "  stage 2 (device 4) B0 [send B0 2->1] timeout: TimeoutError: waited on stage 2",
        "  stage 1 (device 2) B0 [recv B0 2->1] timeout: TimeoutError: waited on stage 1",
    ]


def test_a_long_list_is_cut_and_says_where_the_rest_is():
    errors = [_error(0, 0, 0.0)] + [_error(1, d, 1.0 + d) for d in range(FOLLOW_ON_SHOWN + 3)]
    text = str(_as_error(errors))
    assert text.count("\n  stage 1") == FOLLOW_ON_SHOWN and text.endswith("... and 3 more (PipelineError.errors)")
