"""The chaos tier: one local Ray cluster; each test starts the device actors it kills."""

from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_IGNORE_UNHANDLED_ERRORS", "1")  # the failed runs nobody reads back

import pytest  # noqa: E402


def pytest_collection_modifyitems(items):
    """The chaos tier runs last (it starts and kills devices of its own; other tiers' tests name
    their pool's device ids). Functions of the chaos modules run inside the actors
    (``DeviceMesh.call``, hooks): pickle them by value, since the actors cannot import the test
    modules."""
    import sys

    items.sort(key=lambda item: item.get_closest_marker("chaos") is not None)  # stable: others keep their order

    from ray import cloudpickle

    names = {item.module.__name__ for item in items if item.get_closest_marker("chaos")}
    if names:
        import chaos_harness

        names.add(chaos_harness.__name__)
    for name in names:
        cloudpickle.register_pickle_by_value(sys.modules[name])


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()
