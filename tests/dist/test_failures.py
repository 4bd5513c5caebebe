"""Misuse raises clear ValueError/TypeError; runtime failures raise ReshardError subclasses in
bounded time, leave the source intact, free partial results, and leave the runtime usable."""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time

import numpy as np
import pytest
from dist_helpers import assert_bit_exact, assert_shards, groups_of, pl, random_array

from reshard import (
    DeviceMesh,
    Layout,
    MeshClosed,
    ReshardError,
    ReshardTimeout,
    Shard,
    WorkerDied,
    distribute,
    reshard,
)
from reshard.runtime import lowered_reshard
from reshard.runtime.device_options import DeviceOptions
from topology import Mesh

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def spare(ray_cluster):
    """Four devices of their own, for the tests that kill a device (one victim per test run)."""
    mesh = DeviceMesh.create((1, 4), backend="gloo", startup_timeout_s=180)
    yield mesh
    mesh.shutdown()


def _still_works(view, seed=0):
    src = view([0, 1, 4, 5], (2, 2))
    dst = view([2, 3, 6], (3,))
    x = random_array((7, 5), "float32", seed)
    y = reshard(distribute(x, Layout(src, pl("S0 S1"))), src, Layout(dst, pl("S1")))
    assert_bit_exact(y.to_numpy(), x)


# --------------------------------------------------------------------------------------- misuse


def test_wrong_number_of_placements(view):
    a = view([0, 1, 4, 5], (2, 2))
    with pytest.raises(ValueError, match=r"needs 2 placements .* got 1"):
        Layout(a, (Shard(0),))
    with pytest.raises(ValueError, match="needs 2 placements"):
        Layout(a, pl("S0 R R"))


def test_shard_dim_out_of_range_and_shape_mismatch(view):
    a = view([0, 1, 4, 5], (2, 2))
    x = np.zeros((4, 4), np.float32)
    with pytest.raises(ValueError, match=r"shards dim 2 but the tensor of shape \(4, 4\) has 2 dims"):
        distribute(x, Layout(a, pl("S2 R")))
    t = distribute(x, Layout(a, pl("S0 R")))
    with pytest.raises(ValueError, match="shards dim 5"):
        reshard(t, a, Layout(a, pl("S5 R")))
    with pytest.raises(ValueError, match=r"shape \(2, 2\) has 4 positions but 3 devices"):
        DeviceMesh.from_devices(a.device_ids[:3], (2, 2))
    _still_works(view)


def test_negative_dims(view):
    """Shard(-1) counts from the last dim (resolved against the tensor's rank); out of range is refused."""
    a = view([0, 1], (2,))
    t = distribute(np.arange(12).reshape(3, 4), Layout(a, (Shard(-1),)))
    assert t.placements == (Shard(1),)
    with pytest.raises(ValueError, match=r"shards dim -3 .* use Shard\(d\) with -2 <= d < 2"):
        distribute(np.zeros((3, 4)), Layout(a, (Shard(-3),)))
    with pytest.raises(TypeError, match="int tensor dim"):
        Shard(1.0)


def test_tensor_with_a_mesh_that_is_not_its_own(view):
    a = view([0, 1, 4, 5], (2, 2))
    b = view([2, 3, 6, 7], (2, 2))
    t = distribute(np.ones((4, 4), np.int32), Layout(a, pl("S0 R")))
    ids = re.escape(str(list(b.device_ids)))  # global ids: other tests' devices come first
    with pytest.raises(ValueError, match=rf"src_mesh DeviceMesh\(2, 2\).*{ids}.*lives on DeviceMesh\(2, 2\)"):
        reshard(t, b, Layout(b, pl("R R")))
    with pytest.raises(TypeError, match="src_mesh must be a DeviceMesh"):
        reshard(t, a.mesh, Layout(b, pl("R R")))
    with pytest.raises(ValueError, match="not a live DeviceMesh"):
        reshard(t, a, Layout(Mesh((2, 2), [900, 901, 902, 903]), pl("R R")))
    y = reshard(t, a, Layout(b, pl("R S1")))
    assert_bit_exact(y.to_numpy(), np.ones((4, 4), np.int32))


@pytest.mark.parametrize("bad", ["complex64", "uint64", "torch.complex64", "list", "big-endian"])
def test_unsupported_dtypes(view, bad):
    import torch

    a = view([0, 1], (2,))
    array = {
        "complex64": np.zeros(3, np.complex64),
        "uint64": np.zeros(3, np.uint64),
        "torch.complex64": torch.zeros(3, dtype=torch.complex64),
        "list": [[1, 2], [3]],  # local shards of lists: not arrays
        "big-endian": np.zeros(3, ">f4"),
    }[bad]
    with pytest.raises(TypeError, match="unsupported dtype|numpy array or a torch tensor|byte order '>f4'"):
        distribute(array, Layout(a, pl("S0")))


def test_int16_stays_int16_and_bfloat16_stays_bfloat16(view):
    """An int16 tensor and a bfloat16 one hold the same storage; each keeps its own name."""
    import torch

    a = view([0, 1], (2,))
    ints = distribute(np.arange(6, dtype=np.int16), Layout(a, pl("S0")))
    halves = distribute(torch.arange(6, dtype=torch.bfloat16), Layout(a, pl("S0")))
    assert ints.dtype_name == "int16" and halves.dtype_name == "bfloat16"
    assert ints.to_numpy().dtype == np.int16 and halves.to_torch().dtype == torch.bfloat16
    assert_bit_exact(ints.to_numpy(), np.arange(6, dtype=np.int16))


@pytest.mark.parametrize("shape", [(0,), (2, 0), ()])
def test_zero_size_meshes(ray_cluster, shape):
    with pytest.raises(ValueError, match="positive ints"):
        DeviceMesh.create(shape)


def test_devices_per_host_must_divide(pool):
    with pytest.raises(ValueError, match=r"devices_per_host=4 must be a positive int dividing the mesh size 6.*e\.g\."):
        DeviceMesh.create((2, 3), devices_per_host=4)
    with pytest.raises(ValueError, match="devices_per_host=3"):
        DeviceMesh.from_devices(pool.device_ids[:4], (4,), devices_per_host=3)


def test_bad_strategy_and_timeout(view):
    a = view([0, 1], (2,))
    t = distribute(np.arange(4), Layout(a, pl("S0")))
    with pytest.raises(ValueError, match="unknown strategy 'nope'"):
        reshard(t, a, Layout(a, pl("R")), strategy="nope")
    with pytest.raises(ValueError, match="timeout_s"):
        reshard(t, a, Layout(a, pl("R")), timeout_s=0)
    t.free()
    with pytest.raises(ValueError, match="was freed"):
        reshard(t, a, Layout(a, pl("R")))


# --------------------------------------------------------------------------------------- shutdown


def test_shut_down_meshes(view, ray_cluster):
    a = view([0, 1], (2,))
    x = random_array((6, 4), "float32", 1)
    t = distribute(x, Layout(a, pl("S0")))
    v = view([2, 3], (2,))
    layout = Layout(v, pl("S1"))
    v.shutdown()
    with pytest.raises(MeshClosed, match="shut down"):
        reshard(t, a, layout)
    # a mesh that owns its actors
    own = DeviceMesh.create((1,), backend="gloo", startup_timeout_s=180)
    on_own = distribute(x, Layout(own, pl("R")))
    own_layout = Layout(own, pl("R"))
    own.shutdown()
    own.shutdown()  # idempotent
    with pytest.raises(MeshClosed, match="shut down"):
        reshard(t, a, own_layout)
    with pytest.raises(MeshClosed):
        on_own.to_numpy()
    with pytest.raises(MeshClosed):
        reshard(on_own, own, Layout(a, pl("R")))
    with pytest.raises(MeshClosed):
        distribute(x, own_layout)
    with pytest.raises(MeshClosed):
        DeviceMesh.from_devices(own.device_ids, (1,))
    with pytest.raises(MeshClosed):
        own.call(lambda ctx: ctx.device)
    assert_shards(t, x)
    _still_works(view, 2)


# --------------------------------------------------------------------------------------- failures

#: The only time assertions here catch hangs: a failure that must not wait for its deadline runs
#: with a long timeout (LONG_S) and must raise within HANG_S; the tests synchronise on events, so a
#: loaded machine makes them slower, never red.
HANG_S = 30.0
LONG_S = 120.0
HOLD_S = 120.0  # how long a held victim waits to be let go if the test never does


def _hold_at_first_op(ctx, gate):
    """The next run holds before its first op (mid-run: its destination allocated, its groups
    connected): it tells ``gate`` and waits to be let go."""
    import ray

    def hook(run, op):
        ctx.before_op = None
        ray.get(gate.arrive.remote())
        ray.get(gate.wait_released.remote(HOLD_S))

    ctx.before_op = hook


def _exit_at_first_communication(ctx):
    from reshard.ir.program import Copy

    def hook(run, op):
        if not isinstance(op, Copy):
            os._exit(1)

    ctx.before_op = hook


def _on_arrival(gate, action):
    """A thread that runs ``action`` once the held victim has arrived (the main thread is in reshard)."""
    import ray

    def run():
        if ray.get(gate.wait_arrived.remote(HOLD_S), timeout=HOLD_S + 30):
            action()

    thread = threading.Thread(target=run, name="on-arrival", daemon=True)
    thread.start()
    return thread


def _groups_and_buffers(pool, indices):
    stats = pool.stats()
    return {i: (groups_of(stats[i]), set(stats[i]["buffers"])) for i in indices}


#: The failure tests run both ways: pulls through shared memory (the default) and gloo only, whose
#: failure path also aborts communicators and drops the failed run's groups on the survivors.
TRANSPORTS = pytest.mark.parametrize(("shared_memory", "spare_base"), [(True, 0), (False, 2)], ids=["pull", "gloo"])


@TRANSPORTS
def test_worker_exits_mid_reshard(pool, view, spare, shared_memory, spare_base):
    victim = spare.device_ids[spare_base]
    src = view([0, 1], (2,))
    dst = DeviceMesh.from_devices([victim, pool.device_ids[2], pool.device_ids[3]], (3,))
    x = random_array((600, 64), "float32", 2)
    t = distribute(x, Layout(src, pl("S0")))
    dst_layout = Layout(dst, pl("S1"))
    before = _groups_and_buffers(pool, [0, 1, 2, 3])
    compiled = lowered_reshard(t, dst_layout, shared_memory=shared_memory)  # what the failed run uses
    DeviceMesh.from_devices([victim], (1,)).call(_exit_at_first_communication)
    t0 = time.monotonic()
    with pytest.raises(WorkerDied, match=rf"\[{victim}\] died.*source tensor is intact"):
        reshard(t, src, dst_layout, timeout_s=LONG_S, shared_memory=shared_memory)
    assert time.monotonic() - t0 < HANG_S, "the survivors must not wait for their deadline"
    assert_shards(t, x)  # the source is intact and usable
    after = _groups_and_buffers(pool, [0, 1, 2, 3])
    for i in range(4):
        groups, buffers = after[i]
        assert buffers <= before[i][1], "partial destination shards must be freed"
        assert not any(victim in g for g in groups)
        assert not set(compiled.groups) & groups, "survivors must drop the groups of the failed run"
    with pytest.raises(WorkerDied, match="died"):
        reshard(t, src, dst_layout, shared_memory=shared_memory)
    y = reshard(t, src, Layout(view([2, 3, 4], (3,)), pl("S1")), shared_memory=shared_memory)  # the same survivors
    assert_bit_exact(y.to_numpy(), x)
    _still_works(view, 3)


@TRANSPORTS
def test_worker_killed_during_big_reshard(pool, view, spare, ray_cluster, gate, shared_memory, spare_base):
    """The victim holds at its first op (it told the gate so): it is killed mid-run."""
    victim = spare.device_ids[spare_base + 1]
    src = view([4, 5], (2,))
    dst = DeviceMesh.from_devices([pool.device_ids[6], victim], (2,))
    x = random_array((1024, 2048), "float32", 3)  # 8 MiB
    t = distribute(x, Layout(src, pl("S0")))
    DeviceMesh.from_devices([victim], (1,)).call(_hold_at_first_op, gate)
    killer = _on_arrival(gate, lambda: ray_cluster.kill(spare.actor(spare_base + 1)))
    t0 = time.monotonic()
    try:
        with pytest.raises(WorkerDied, match=rf"\[{victim}\] died"):
            reshard(t, src, Layout(dst, pl("R")), strategy="broadcast", timeout_s=LONG_S, shared_memory=shared_memory)
    finally:
        killer.join(HOLD_S + 60)
    assert time.monotonic() - t0 < HANG_S, "the survivors must not wait for their deadline"
    assert_shards(t, x)
    y = reshard(t, src, Layout(view([6, 7], (2,)), pl("R")), strategy="broadcast", shared_memory=shared_memory)
    assert_bit_exact(y.to_numpy(), x)
    _still_works(view, 4)


@TRANSPORTS
def test_timeout_is_bounded_and_recoverable(pool, view, ray_cluster, gate, shared_memory, spare_base):
    """A device stuck mid-run (held at the gate past the timeout) makes the reshard time out; once it
    goes on, the same reshard succeeds and the staging it used is trimmed."""
    src = view([0, 1], (2,))
    dst = view([2, 3], (2,))
    x = random_array((64, 32), "int32", 5)
    t = distribute(x, Layout(src, pl("S0")))
    layout = Layout(dst, pl("R"))
    pool.call(_hold_at_first_op, gate, devices=[2])
    t0 = time.monotonic()
    with pytest.raises(ReshardTimeout, match="timeout_s=1s"):
        reshard(t, src, layout, timeout_s=1.0, shared_memory=shared_memory)
    assert time.monotonic() - t0 < 1 + HANG_S
    ray_cluster.get(gate.release.remote())
    y = reshard(t, src, layout, timeout_s=30, shared_memory=shared_memory)
    assert_bit_exact(y.to_numpy(), x)
    assert_shards(t, x)
    stats = pool.stats()
    assert all(s["staging_bytes"] <= DeviceOptions.staging_keep_bytes for s in stats)
    _still_works(view, 5)


@pytest.mark.parametrize(
    "shared_memory, error",
    [(True, "device {holder}'s source shard is gone"), (False, "source shard .* is missing")],
    ids=["pull", "backend"],
)
def test_error_inside_actor_is_a_reshard_error(pool, view, shared_memory, error):
    """A program that cannot run (its source shard is gone) fails cleanly, the runtime lives on:
    the holder's own check when it would send, the puller's when it would map the shard."""
    src = view([0, 1], (2,))
    dst = view([4, 5], (2,))
    t = distribute(np.arange(4096, dtype=np.int64), Layout(src, pl("S0")))
    assert src.call(_lose, t.name, devices=[1]) == [True]
    t0 = time.monotonic()
    with pytest.raises(ReshardError, match=error.format(holder=src.device_ids[1])):
        reshard(t, src, Layout(dst, pl("R")), timeout_s=LONG_S, shared_memory=shared_memory)
    assert time.monotonic() - t0 < HANG_S, "the peers of the failed device must not wait for their deadline"
    _still_works(view, 6)


def _lose(ctx, name: str) -> bool:
    """Shard ``name`` gone as a drop leaves it (its tenure ended: peers' descriptors of it stop
    reading), but its memory not pooled for reuse. Whether it lay in a shared block or in private
    memory depends on what the device held before (``SMALL_SHARD_BYTES``, ``max_blocks``)."""
    t = ctx.store.shards.pop(name, None)
    if t is not None:
        ctx.store.shared.end(t, ctx.store.placed.pop(name, None))
    return t is not None


def _trimmed_mapping(ctx) -> int:
    """The bytes this process maps, after handing the allocator's free memory back (else a new
    buffer could still come out of the heap)."""
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


@contextlib.contextmanager
def _capped(mesh, margin: int = 1 << 20):
    """The address space of ``mesh``'s one device capped just above what it maps (``RLIMIT_AS``, set
    from outside: lifting it needs nothing of the device), so its next big allocations fail."""
    import resource

    pid = mesh.call(lambda ctx: os.getpid())[0]
    limits = resource.prlimit(pid, resource.RLIMIT_AS)
    resource.prlimit(pid, resource.RLIMIT_AS, (mesh.call(_trimmed_mapping)[0] + margin, limits[1]))
    try:
        yield
    finally:
        resource.prlimit(pid, resource.RLIMIT_AS, limits)


def test_a_call_ray_fails_before_it_reaches_the_device_does_not_stall_the_next():
    """Ray fails an ordered call on the device before the device sees it (its 64 MiB argument cannot
    be allocated there: the address space is capped from outside): the call raises a ReshardError
    naming the device, and the next call runs at once instead of waiting for its turn behind a
    call that never comes."""
    own = DeviceMesh.create((1,), backend="gloo", startup_timeout_s=180)
    try:
        d = own.device_ids[0]
        with _capped(own), pytest.raises(ReshardError, match=rf"device {d}: System error"):
            own.call(lambda ctx, payload: len(payload), bytes(64 << 20), timeout_s=LONG_S)
        assert own.call(lambda ctx: ctx.device, timeout_s=LONG_S) == [d]  # without: waits for the lost call, times out
        assert not own.stats()[0]["calls"]["waiting"]
    finally:
        own.shutdown()


def test_a_fired_call_ray_fails_before_it_reaches_the_device_does_not_stall_the_next():
    """The same for a call nobody waits for (a release, a free: ``Dispatch.fire``): once Ray failed
    it, the next operation sees that (``Dispatch.sweep_fired``), and its call runs at once."""
    import ray

    from reshard.runtime.driver.controller import runtime

    own = DeviceMesh.create((1,), backend="gloo", startup_timeout_s=180)
    try:
        d = own.device_ids[0]
        dispatch = runtime().dispatch
        with _capped(own):
            fired = dispatch.fire(
                [d],
                lambda rec: lambda t: rec.actor.reshard_call.remote(
                    t, lambda ctx, payload: len(payload), (bytes(64 << 20),), {}, LONG_S
                ),
            )
            ready, _ = ray.wait(fired, timeout=LONG_S)
        with pytest.raises(ray.exceptions.RaySystemError):
            ray.get(ready)
        assert own.call(lambda ctx: ctx.device, timeout_s=LONG_S) == [d]  # without: waits for the lost call, times out
        assert not own.stats()[0]["calls"]["waiting"]
    finally:
        own.shutdown()


@pytest.mark.parametrize("shared_memory", [True, False], ids=["pull", "gloo"])
def test_allocation_failure_is_a_clean_reshard_error(pool, view, shared_memory):
    """A receiver that cannot get memory (its address space capped) fails the reshard with a
    ReshardError that says so, fast; the source is intact, nothing is left behind, and the same
    reshard succeeds once the device has memory again."""
    # A device of its own (it may not survive), without a pool: the warm-up's freed shard must not
    # serve the capped run's allocation.
    own = DeviceMesh.create((1,), backend="gloo", startup_timeout_s=180, buffer_pool_bytes=0)
    try:
        src = view([0, 1], (2,))
        dst = DeviceMesh.from_devices([pool.device_ids[2], own.device_ids[0]], (2,))
        x = random_array((1024, 512), "float32", 7)  # 2 MiB: each receiver maps or allocates all of it
        t = distribute(x, Layout(src, pl("S0")))
        reshard(t, src, Layout(dst, pl("R")), shared_memory=False).free()  # libraries loaded: what fails is the shard
        before = _groups_and_buffers(pool, [0, 1, 2])
        t0 = time.monotonic()
        with _capped(own):  # Ray's own buffers fit, the 2 MiB destination does not
            with pytest.raises(ReshardError, match=rf"device {own.device_ids[0]}.*(memory|allocate)") as err:
                reshard(t, src, Layout(dst, pl("R")), timeout_s=LONG_S, shared_memory=shared_memory)
        assert time.monotonic() - t0 < HANG_S, "the peers of the failed device must not wait for their deadline"
        assert "is gone" not in str(err.value), "a device out of memory must not blame its peer's shard"
        assert_shards(t, x)
        after = _groups_and_buffers(pool, [0, 1, 2])
        assert all(after[i][1] <= before[i][1] for i in range(3)), "partial destination shards must be freed"
        assert not own.stats()[0]["buffers"]
        y = reshard(t, src, Layout(dst, pl("R")), shared_memory=shared_memory)
        assert_bit_exact(y.to_numpy(), x)
    finally:
        own.shutdown()


def test_a_tensor_freed_through_another_handle_is_never_read(view):
    """``free()`` on one handle drops the shards for every handle: resharding through a copy must
    then fail, never return the bytes of the tensor that reused that memory."""
    import copy

    holder = view([0], (1,))
    x = np.arange(4096, dtype=np.float32)
    a = distribute(x, Layout(holder, pl("R")))
    b = copy.deepcopy(a)  # another handle on the same shards
    a.free()
    other = np.full(4096, 7.0, dtype=np.float32)
    c = distribute(other, Layout(holder, pl("R")))  # the same byte size: it may reuse the freed memory
    with pytest.raises((ValueError, ReshardError), match="freed|gone|missing"):
        reshard(b, holder, Layout(view([1], (1,)), pl("R")))  # a pure pull from device 0
    assert_shards(c, other)


# --------------------------------------------------------------------------------------- gloo backend


def test_gloo_backend_close_stops_its_store():
    """``close`` drops the controller's store (which owns its listening descriptor) and no more."""
    import datetime

    import torch.distributed as dist

    from reshard.runtime.backends.gloo import GlooBackend

    backend = GlooBackend(host="127.0.0.1")
    info = backend.rendezvous([(0, 1)], {})[0].info
    backend.close()
    backend.close()  # idempotent
    assert backend.store_address is None
    with pytest.raises(RuntimeError, match="(?i)connect|timed out|timeout"):
        dist.TCPStore(info["host"], info["port"], is_master=False, timeout=datetime.timedelta(seconds=1))


def test_join_barrier_never_lets_a_store_wait_time_out(capfd):
    """A member waiting for its group's peers polls the rendezvous store without timed-out waits:
    torch logs each timed-out TCPStore wait, and formatting that warning looks the store's address
    up in reverse DNS, which stalls for seconds when the resolver throttles (a waiting peer would
    overrun its deadline and hold the store connection that aborts need)."""
    from reshard.runtime.backends.gloo import GlooBackend

    backend = GlooBackend(host="127.0.0.1")
    try:
        [rdv] = backend.rendezvous([(0, 1)], {})
        with pytest.raises(ReshardTimeout, match=r"devices \[1\] never joined"):
            backend.connect(rdv, 0, timeout_s=0.5)
    finally:
        backend.close()
    assert "timed out" not in capfd.readouterr().err
