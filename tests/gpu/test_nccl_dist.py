"""The dist suite's reshard bodies (tests/dist/test_reshard.py), run on NCCL device actors.

The bodies are imported unchanged; only their fixtures differ: ``pool`` is one device actor per
GPU (at most 8; NCCL backend) instead of 8 gloo actors, or, on a machine with ONE GPU, four device
actors sharing it (a quarter GPU each, each its own NCCL host: the one-GPU tier). ``view`` maps
the pool indices a test uses, in order of first use, onto the pool (a case that needs more
distinct devices than the pool has is skipped). Placement on logical hosts changes with the
mapping; bit-exactness must not.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import sys

import pytest

from reshard.runtime.nccl import NcclBackend

pytestmark = pytest.mark.gpu(1)
SHARED_GPU_POOL = 4  # device actors on a single GPU

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
def pool(ray_cluster, gpus, require_pool):
    from reshard import DeviceMesh

    total = gpus.total
    require_pool(1, total)
    if total >= 2:
        n, need, backend = min(total, 8), min(total, 8), NcclBackend(timeout_s=120)
    else:
        n, need = SHARED_GPU_POOL, 1
        backend = NcclBackend(timeout_s=120, gpus_per_device=1 / SHARED_GPU_POOL, gpu_sharing="hostid")
    gpus.wait_free(need)
    mesh = DeviceMesh.create((n,), backend=backend, startup_timeout_s=180)
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
            pytest.skip(f"the case needs {len(slots)} distinct devices, the NCCL pool has {pool.size}")
        devices = [pool.device_ids[slots[i]] for i in indices]
        m = DeviceMesh.from_devices(devices, shape, devices_per_host=devices_per_host)
        made.append(m)
        return m

    yield make
    for m in made:
        m.shutdown()


def _reserved(ctx) -> int:
    import torch

    return int(torch.cuda.memory_reserved())


def test_empty_cache_gives_back_torchs_cached_gpu_blocks(view):
    import numpy as np

    from reshard import Layout, Replicate, Shard, distribute, reshard
    from reshard.runtime import settle

    a = view([0, 1], (2,))
    b = view([1, 0], (2,))
    x = np.arange(1 << 22, dtype=np.float32).reshape(2048, 2048)  # 16 MiB: 8 MiB shards, 16 MiB replicas
    t = distribute(x, Layout(a, (Shard(0),)))
    y = reshard(t, a, Layout(b, (Replicate(),)))
    np.testing.assert_array_equal(y.to_numpy(), x)
    y.free()
    settle(b)
    cached = b.call(_reserved)
    b.empty_cache()
    assert all(now < before for now, before in zip(b.call(_reserved), cached, strict=True))  # the replicas' blocks
    np.testing.assert_array_equal(t.to_numpy(), x)  # live shards untouched
    t.free()
