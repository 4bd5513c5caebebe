"""CompileTarget: a backend's facts that decide how its devices' programs are sequenced."""

from __future__ import annotations

import pytest

from reshard.ir.target import WINDOW_BYTES, CompileTarget, target_for
from reshard.passes.compile import CompileOptions
from reshard.passes.sequencing import OVERLAP_COPY_BYTES

pytestmark = pytest.mark.unit


def test_cpu_devices_window_their_gloo_messages_and_copy_beside_them():
    options = CompileOptions.for_target(target_for("gloo"))
    assert (options.window_ops, options.window_bytes, options.overlap_copy_bytes) == (
        4,
        WINDOW_BYTES,
        OVERLAP_COPY_BYTES,
    )


def test_gpu_devices_issue_a_round_as_one_group_and_copy_on_their_streams():
    target = target_for("nccl")
    options = CompileOptions.for_target(target)
    assert options.window_ops > 1 and options.overlap_copy_bytes is None
    assert target.bucket_bytes >= 16 << 20 > target_for("gloo").bucket_bytes  # tens of MiB, gloo's 1 MiB
    assert options.double_buffer and not CompileOptions.for_target(target_for("gloo")).double_buffer


def test_an_undeclared_backend_sends_one_message_at_a_time():
    target = target_for("custom", "cpu")
    assert (target.window_ops, target.device_type) == (1, "cpu")


def test_a_registered_target_is_what_compilation_reads():
    from reshard.ir.target import TARGETS, register_target

    try:
        register_target(CompileTarget("loop", "cpu", window_ops=3, bucket_bytes=4096))
        assert target_for("loop").bucket_bytes == 4096 and CompileOptions.for_target(target_for("loop")).window_ops == 3
    finally:
        TARGETS.pop("loop", None)


def test_targets_refuse_sizes_that_are_not_positive():
    with pytest.raises(ValueError, match="bucket_bytes must be a positive int"):
        CompileTarget("x", "cpu", bucket_bytes=0)


def test_targets_refuse_a_double_buffer_that_is_not_a_bool():
    with pytest.raises(ValueError, match="double_buffer must be a bool"):
        CompileTarget("x", "cuda", double_buffer=1)
