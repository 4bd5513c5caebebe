"""CompileTarget: a backend's facts that decide how its devices' programs are sequenced."""

from __future__ import annotations

import pytest

from reshard.ir.target import WINDOW_BYTES, CompileTarget
from reshard.passes.compile import CompileOptions
from reshard.passes.sequencing import OVERLAP_COPY_BYTES

pytestmark = pytest.mark.unit


def test_cpu_devices_window_their_gloo_messages_and_copy_beside_them():
    options = CompileOptions.for_target(CompileTarget("gloo", "cpu"))
    assert (options.window_ops, options.window_bytes, options.overlap_copy_bytes) == (
        4,
        WINDOW_BYTES,
        OVERLAP_COPY_BYTES,
    )


def test_gpu_devices_issue_one_message_at_a_time_and_copy_on_their_streams():
    options = CompileOptions.for_target(CompileTarget("nccl", "cuda"))
    assert (options.window_ops, options.overlap_copy_bytes) == (1, None)
