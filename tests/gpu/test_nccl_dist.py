"""The dist suite's reshard bodies (tests/dist/test_reshard.py), run on NCCL device actors.

The bodies are imported unchanged; only their fixtures differ: ``pool`` is one device actor per
GPU (at most 8; NCCL backend) instead of 8 gloo actors, or, on a machine with ONE GPU, eight device
actors sharing it (an eighth of a GPU each, each its own NCCL host: the one-GPU tier). ``view`` maps
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
from gpu_bodies import reserved_gpu_bytes

from reshard.runtime.backends.nccl import NcclBackend

pytestmark = pytest.mark.gpu(1)
SHARED_GPU_POOL = 8  # device actors on a single GPU (and on the CPU stand-in)

_DIST = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "dist")
# The bodies that run on an NCCL pool, named one by one: the others mix in a gloo mesh (refused:
# both meshes must use one backend) or assert shared-memory pulls, which CUDA tensors do not use.
ALLOWED = (
    "test_layout_pairs",
    "test_every_dtype",
    "test_every_strategy",
    "test_zero_d_and_empty",
    "test_zero_d_torch_scalar",
    "test_same_mesh",
    "test_repeated_reshard_ships_programs_once",
    "test_chain_of_reshards",
    "test_torch_input_and_output",
    "test_partial_sources_arrive_reduced",
    "test_distribute_checks_local_shards",
)


def _load(module_name: str):
    if _DIST not in sys.path:
        sys.path.insert(0, _DIST)  # the dist bodies import dist_helpers
    path = os.path.join(_DIST, f"{module_name}.py")
    spec = importlib.util.spec_from_file_location(f"_nccl_reuse_{module_name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_BODIES = _load("test_reshard")
MISSING = [name for name in ALLOWED if not inspect.isfunction(getattr(_BODIES, name, None))]
for _name in ALLOWED:
    if _name not in MISSING:
        globals()[_name] = getattr(_BODIES, _name)


@pytest.mark.gpu(0)
def test_every_allowed_dist_body_exists():
    assert not MISSING, f"tests/dist/test_reshard.py no longer has {MISSING}: update ALLOWED"


@pytest.fixture(scope="module")
def pool(ray_cluster, gpus, require_pool):
    from reshard import DeviceMesh

    total = gpus.total
    require_pool(1, total)
    if gpus.standin:  # every actor process has a stand-in GPU of its own: nothing to reserve or share
        n, need, backend = SHARED_GPU_POOL, 0, NcclBackend(timeout_s=120, gpus_per_device=0)
    elif total >= 2:
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


def test_empty_cache_gives_back_the_cached_gpu_blocks(view):
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
    cached = b.call(reserved_gpu_bytes)
    b.empty_cache()
    now = b.call(reserved_gpu_bytes)
    assert all(a < c for a, c in zip(now, cached, strict=True))  # the replicas' blocks went back
    np.testing.assert_array_equal(t.to_numpy(), x)  # live shards untouched
    t.free()
