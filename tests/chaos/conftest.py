"""The chaos tier: on the shared local Ray cluster (``ray_cluster``, tests/conftest.py); each test
starts the device actors it kills."""

from __future__ import annotations

import os

os.environ.setdefault("RAY_IGNORE_UNHANDLED_ERRORS", "1")  # the failed runs nobody reads back


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
