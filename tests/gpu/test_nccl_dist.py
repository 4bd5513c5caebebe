"""The dist suite's reshard bodies (tests/dist/test_reshard.py), run on NCCL device actors.

The bodies are imported unchanged; only their fixtures differ: ``pool`` is one device actor per
free GPU (NCCL backend) instead of 8 gloo actors, and ``view`` maps the pool indices a test uses,
in order of first use, onto those GPUs (a case that needs more distinct devices than there are
GPUs is skipped). Placement on logical hosts changes with the mapping; bit-exactness must not.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import sys

import pytest

from reshard.runtime.nccl import NcclBackend

pytestmark = pytest.mark.gpu(2)

_DIST = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "dist")
_OUR_FIXTURES = {"view", "pool", "ray_cluster"}


def _reuse(module_name: str) -> list[str]:
    """Re-export the ``test_*`` functions of tests/dist/<module_name>.py that need only our fixtures."""
    path = os.path.join(_DIST, f"{module_name}.py")
    if not os.path.exists(path):
        return []
    if _DIST not in sys.path:
        sys.path.insert(0, _DIST)  # the dist bodies import dist_helpers
    spec = importlib.util.spec_from_file_location(f"_nccl_reuse_{module_name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    found = []
    for name, fn in vars(module).items():
        if not name.startswith("test_") or not inspect.isfunction(fn):
            continue
        argnames = set()
        for mark in getattr(fn, "pytestmark", []):
            if mark.name == "parametrize":
                params = mark.args[0]
                if isinstance(params, str):
                    params = params.split(",")
                argnames.update(p.strip() for p in params)
        if set(inspect.signature(fn).parameters) <= _OUR_FIXTURES | argnames:
            globals()[name] = fn
            found.append(name)
    return found


REUSED = _reuse("test_reshard")


@pytest.mark.gpu(0)
def test_the_dist_bodies_were_found():
    assert REUSED, f"no reusable test bodies in {_DIST}/test_reshard.py"


@pytest.fixture(scope="module")
def pool(ray_cluster):
    from reshard import DeviceMesh

    free = int(ray_cluster.available_resources().get("GPU", 0))
    if free < 2:
        pytest.skip(f"needs 2 free GPUs in the Ray cluster, {free} free (another pool holds them?)")
    mesh = DeviceMesh.create((min(free, 8),), backend=NcclBackend(timeout_s=120), startup_timeout_s=180)
    yield mesh
    mesh.shutdown()


@pytest.fixture
def view(pool):
    """``view(pool_indices, shape, devices_per_host=None)`` as in tests/dist, over the GPU pool."""
    from reshard import DeviceMesh

    slots: dict[int, int] = {}
    made = []

    def make(indices, shape, devices_per_host=None):
        indices = [int(i) for i in indices]
        for i in indices:
            slots.setdefault(i, len(slots))
        if len(slots) > pool.size:
            pytest.skip(f"the case needs {len(slots)} distinct devices, the GPU pool has {pool.size}")
        devices = [pool.device_ids[slots[i]] for i in indices]
        m = DeviceMesh.from_devices(devices, shape, devices_per_host=devices_per_host)
        made.append(m)
        return m

    yield make
    for m in made:
        m.shutdown()
