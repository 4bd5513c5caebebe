"""Shared by every tier: Ray's environment for a single-machine cluster, and the one local Ray
cluster (``ray_cluster``) that the dist and chaos tiers run on."""

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()
