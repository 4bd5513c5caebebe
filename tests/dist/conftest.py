"""One local Ray cluster and one pool of 8 device actors for the whole dist suite.

Actors that import torch take seconds each to start on 2 cores, so every test builds its meshes
as views over the pool (``DeviceMesh.from_devices``); only tests that kill or shut down devices
start their own small meshes.
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "token")  # Ray's default for a new local cluster, without its warning

import pytest  # noqa: E402


def pytest_collection_modifyitems(items):
    """Functions defined in test modules run inside the actors (``DeviceMesh.call``): pickle them
    by value, since the actors cannot import the test modules."""
    import sys

    from ray import cloudpickle

    for name in {item.module.__name__ for item in items if item.get_closest_marker("dist")}:
        cloudpickle.register_pickle_by_value(sys.modules[name])
    if "dist_helpers" in sys.modules:
        cloudpickle.register_pickle_by_value(sys.modules["dist_helpers"])



@pytest.fixture(scope="session")
def pool(ray_cluster):
    """A 2x4 mesh (2 logical hosts of 4 devices): 8 actors shared by every dist test."""
    from reshard import DeviceMesh

    mesh = DeviceMesh.create((2, 4), backend="gloo", startup_timeout_s=180)
    yield mesh
    mesh.shutdown()


@pytest.fixture
def view(pool):
    """``view(flat_indices, shape, devices_per_host=None)``: a mesh over pool devices."""
    from reshard import DeviceMesh

    made = []

    def make(indices, shape, devices_per_host=None):
        m = DeviceMesh.from_devices([pool.device_ids[i] for i in indices], shape, devices_per_host=devices_per_host)
        made.append(m)
        return m

    yield make
    for m in made:
        m.shutdown()


@pytest.fixture
def gate(ray_cluster):
    """A ``Gate`` actor: a victim's run says it arrived and waits to be let go."""
    from dist_helpers import Gate

    actor = ray_cluster.remote(num_cpus=0)(Gate).remote()
    yield actor
    ray_cluster.get(actor.release.remote())  # a victim still held goes on
    ray_cluster.kill(actor)
