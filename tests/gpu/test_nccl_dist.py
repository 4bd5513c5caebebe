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

pytestmark = pytest.mark.gpu(1)

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


def test_results_are_written_when_reshard_returns(view):
    """A slow GPU (a kernel holding the run's stream before every op) changes nothing for the
    caller: a reshard returns once its stream finished, so reads from another stream (the reads'
    own) and another process see the new bytes, into fresh outputs and with ``out=``."""
    import numpy as np
    from gpu_bodies import no_hook, slow_every_op

    from reshard import Layout, Replicate, Shard, distribute, reshard

    a = view([0, 1], (2,))
    b = view([2, 3], (2,))
    x = np.arange(96 * 32, dtype=np.float32).reshape(96, 32)
    t = distribute(x, Layout(a, (Shard(0),)))
    out = distribute(np.zeros_like(x), Layout(b, (Shard(1),)))
    for mesh in (a, b):
        mesh.call(slow_every_op, 0.05)
    try:
        for shared_memory in (True, False):  # CUDA IPC pulls, NCCL messages
            y = reshard(t, a, Layout(b, (Replicate(),)), shared_memory=shared_memory)
            np.testing.assert_array_equal(y.to_numpy(), x)
            reshard(t, a, Layout(b, (Shard(1),)), out=out, shared_memory=shared_memory)
            np.testing.assert_array_equal(out.to_numpy(), x)
            out = distribute(np.zeros_like(x), Layout(b, (Shard(1),)))
    finally:
        for mesh in (a, b):
            mesh.call(no_hook)


@pytest.mark.parametrize("slow", ["run stream", "side stream"])
def test_windows_packed_ahead_send_their_own_bytes(view, slow):
    """A tree sent over NCCL in many windows of small buckets: the sender packs each next window on
    a side stream while the window before moves. Whichever stream is slow (the run's, held before
    every op; or the side stream, held before every pack), every tensor arrives bit-exact: a pack
    waits for the last use of its staging region, and a window is sent only once packed."""
    import numpy as np
    from gpu_bodies import no_hook, packed_ahead, slow_packs_ahead

    from reshard import Layout, Replicate, Shard, distribute, reshard

    a = view([0], (1,))
    b = view([1], (1,))
    xs = {f"w{i}": np.arange(1024, dtype=np.float32) * (i + 1) for i in range(40)}
    tree = {k: distribute(x, Layout(a, (Replicate(),))) for k, x in xs.items()}
    layouts = {k: Layout(b, (Shard(0),)) for k in xs}
    op_s, pack_s = (0.02, 0.0) if slow == "run stream" else (0.0, 0.3)
    a.call(slow_packs_ahead, op_s, pack_s)
    try:
        y = reshard(tree, a, layouts, shared_memory=False, bucket_bytes=4096)  # 40 buckets: 3 windows of 16
        assert a.call(packed_ahead) == [2]
    finally:
        a.call(no_hook)
    for k, x in xs.items():
        np.testing.assert_array_equal(y[k].to_numpy(), x)


def test_no_socket_listens_on_every_interface(view):
    """After NCCL reshards (communicators, abort notices, the rendezvous store), neither the
    driver nor a device listens or is bound on a wildcard address."""
    import numpy as np

    from bench.sockets import survey, wildcards
    from reshard import Layout, Replicate, Shard, distribute, reshard

    a = view([0, 1], (2,))
    b = view([2, 3], (2,))
    x = np.arange(64 * 16, dtype=np.float32).reshape(64, 16)
    t = distribute(x, Layout(a, (Shard(0),)))
    y = reshard(t, a, Layout(b, (Replicate(),)), shared_memory=False)
    np.testing.assert_array_equal(y.to_numpy(), x)
    both = view([0, 1, 2, 3], (4,))
    found = survey(both)
    udp = [s for got in found.values() for s in got["listening"] if s[0] == "udp"]
    assert udp, "no abort-notice socket: the NCCL backend was not used"
    assert wildcards(found) == {}
