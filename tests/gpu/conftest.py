"""Skip logic for GPU tests.

Every test here carries the ``gpu`` marker; ``@pytest.mark.gpu(n)`` says it needs ``n`` visible
GPUs (default 1; ``gpu(0)`` needs cupy with NCCL but no GPU). A test is skipped, never failed,
when cupy / NCCL is missing or fewer GPUs are visible than it needs.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

_PROBE: dict = {}


def _probe() -> tuple[str | None, int]:
    """(reason cupy/NCCL is unusable or None, visible GPU count), computed once per session."""
    if not _PROBE:
        reason, count = None, 0
        try:
            from reshard.runtime import cuda_buffers

            cuda_buffers.import_nccl()
        except ImportError as e:
            reason = str(e)
        if reason is None:
            from reshard.runtime.nccl import visible_gpu_count

            count = visible_gpu_count()
        _PROBE.update(reason=reason, count=count)
    return _PROBE["reason"], _PROBE["count"]


def gpus_needed(item) -> int | None:
    marker = item.get_closest_marker("gpu")
    if marker is None:
        return None
    return int(marker.args[0]) if marker.args else 1


def pytest_runtest_setup(item):
    need = gpus_needed(item)
    if need is None:
        return
    reason, count = _probe()
    if reason is not None:
        pytest.skip(f"cupy/NCCL unavailable ({reason})")
    if count < need:
        pytest.skip(f"needs {need} GPU(s), {count} visible")


@pytest.fixture(scope="session")
def gpu_count() -> int:
    return _probe()[1]


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray session: reuses one that is already running (the dist suite's), else starts one
    with every visible GPU and shuts it down at the end."""
    ray = pytest.importorskip("ray")
    started = False
    if not ray.is_initialized():
        ray.init(num_cpus=max(2, os.cpu_count() or 2), num_gpus=_probe()[1], include_dashboard=False,
                 log_to_driver=False)  # fmt: skip
        started = True
    yield ray
    if started:
        ray.shutdown()
