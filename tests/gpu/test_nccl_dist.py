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


@pytest.mark.parametrize("slow", ["run streams", "the sender's side stream", "the receiver's side stream"])
def test_windows_packed_ahead_and_unpacked_behind_move_their_own_bytes(view, slow):
    """A tree sent over NCCL in many windows of small buckets: the sender packs each next window,
    and the receiver unpacks each window but the last, on a side stream while the window beside
    moves. Whichever streams are slow (the runs', held before every op; or a side stream, held
    before every copy there), every tensor arrives bit-exact: a pack waits for the last use of
    its staging region and a window is sent only once packed; an unpack waits for its window to
    land, a window lands in staging only once the unpack before it there is done, and the call
    returns only once every unpack is."""
    import numpy as np
    from gpu_bodies import no_hook, shard_bytes, side_copies, slow_streams

    from reshard import Layout, Replicate, Shard, distribute, reshard

    a = view([0], (1,))
    b = view([1], (1,))
    rng = np.random.default_rng(len(slow))  # other bytes than the case before, whose freed outputs' memory is reused
    xs = {f"w{i}": rng.standard_normal(1024).astype(np.float32) for i in range(40)}
    tree = {k: distribute(x, Layout(a, (Replicate(),))) for k, x in xs.items()}
    layouts = {k: Layout(b, (Shard(0),)) for k in xs}
    a.call(slow_streams, 0.02 if slow == "run streams" else 0.0, 0.3 if "sender" in slow else 0.0)
    b.call(slow_streams, 0.02 if slow == "run streams" else 0.0, 0.3 if "receiver" in slow else 0.0)
    try:
        y = reshard(tree, a, layouts, shared_memory=False, bucket_bytes=4096)  # 40 buckets: 3 windows of 16
        (got,) = b.call(shard_bytes, [y[k].name for k in xs])  # at once: a late unpack would not have landed
        assert a.call(side_copies) == [2] and b.call(side_copies) == [2]  # windows 1, 2 packed; 0, 1 unpacked
    finally:
        for mesh in (a, b):
            mesh.call(no_hook)
    for k, x, shard in zip(xs, xs.values(), got, strict=True):
        np.testing.assert_array_equal(shard, x, err_msg=k)


def test_a_run_that_fails_between_windows_waits_for_its_side_copies(view):
    """A receiver's run fails before its second window while its first is still being unpacked on
    the side stream (held there): the failure reaches the caller only once that stream is done
    (it writes memory the failure frees), and the next reshard is bit-exact."""
    import numpy as np
    from gpu_bodies import fail_at_bucket, no_hook, shard_bytes, side_streams_idle

    from reshard import Layout, Replicate, Shard, distribute, reshard
    from reshard.errors import ReshardError

    a = view([0], (1,))
    b = view([1], (1,))
    rng = np.random.default_rng(7)
    xs = {f"w{i}": rng.standard_normal(1024).astype(np.float32) for i in range(40)}
    tree = {k: distribute(x, Layout(a, (Replicate(),))) for k, x in xs.items()}
    layouts = {k: Layout(b, (Shard(0),)) for k in xs}
    b.call(fail_at_bucket, 16, 0.5)  # the first bucket of the second window
    try:
        with pytest.raises(ReshardError, match="injected failure between windows"):
            reshard(tree, a, layouts, shared_memory=False, bucket_bytes=4096)
        assert all(idle for idles in b.call(side_streams_idle) for idle in idles)
    finally:
        b.call(no_hook)
    y = reshard(tree, a, layouts, shared_memory=False, bucket_bytes=4096)
    (got,) = b.call(shard_bytes, [y[k].name for k in xs])
    for k, x, shard in zip(xs, xs.values(), got, strict=True):
        np.testing.assert_array_equal(shard, x, err_msg=k)


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
