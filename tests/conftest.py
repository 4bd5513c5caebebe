"""Shared by every tier: Ray's environment for a single-machine cluster, the one local Ray cluster
(``ray_cluster``) that the dist and chaos tiers run on, and the CPU stand-in for cupy.

The stand-in (tests/gpu/standin/cupy) lets tests/gpu run the NCCL backend's control logic on a
machine without a GPU. It is activated here, before any Ray cluster starts, so that Ray's workers
inherit it through ``PYTHONPATH``: where no cupy is installed, or a real cupy is installed but the
machine has no NVIDIA GPU (then the stand-in comes first on the path; tests/gpu/test_cupy_api.py
runs the API-level tests against the real cupy in a process of their own). Never when
``RESHARD_REQUIRE_GPUS`` promises GPUs, and not with ``RESHARD_GPU_STANDIN=0``. It stays on the
path for the whole session, so a real cupy is never imported beside it; tests that need no cupy
at all or the real one run in a fresh interpreter without it.
"""

import glob
import importlib.util
import os
import sys
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "token")  # Ray's default for a new local cluster, without its warning

import pytest  # noqa: E402

GPU_TIER = Path(__file__).resolve().parent / "gpu"
STANDIN = str(GPU_TIER / "standin")


def _standin_wanted() -> bool:
    if os.environ.get("RESHARD_GPU_STANDIN", "1") == "0":
        return False
    if int(os.environ.get("RESHARD_REQUIRE_GPUS", "0") or 0):
        return False  # a promised GPU run fails without cupy instead of passing on the stand-in
    spec = importlib.util.find_spec("cupy")
    return spec is None or os.path.dirname(os.path.dirname(spec.origin or "")) == STANDIN or not nvidia_gpus()


def nvidia_gpus() -> bool:
    """An NVIDIA GPU device node exists (read without importing cupy or CUDA)."""
    return bool(glob.glob("/dev/nvidia[0-9]*"))


def _activate_standin() -> bool:
    if not _standin_wanted():
        return False
    if STANDIN not in sys.path:
        sys.path.insert(0, STANDIN)
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if STANDIN not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([STANDIN, *(p for p in paths if p)])
    return True


GPU_STANDIN = _activate_standin()


def pytest_report_header(config):
    if GPU_STANDIN:
        return f"GPU tier: cupy CPU stand-in ({STANDIN}); no GPU result"
    return None


def pytest_terminal_summary(terminalreporter):
    if not GPU_STANDIN:
        return
    prefix = GPU_TIER.relative_to(terminalreporter.config.rootpath).as_posix() + "/"
    passed = [r for r in terminalreporter.stats.get("passed", []) if r.nodeid.startswith(prefix)]
    if passed:
        terminalreporter.write_line(
            f"{len(passed)} GPU-tier test(s) passed on the cupy CPU stand-in: control logic only, not a GPU result"
        )


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()
