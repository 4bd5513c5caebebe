"""NCCL backend through cupy.

``gpu(0)``: cupy + NCCL installed, no GPU needed (type codes, unique ids, the batched rendezvous
through Ray actors). ``gpu`` (one GPU): one-rank communicators in this process: in-place
broadcast, send-to-self, grouped calls, staging of non-contiguous views, dtypes, stream order,
timeouts. ``gpu(2)``: one Ray actor per GPU: broadcast groups, send/recv, grouped exchanges,
eviction and a missing peer. Everything skips cleanly without cupy or GPUs (see conftest.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from reshard.errors import ReshardError, ReshardTimeout
from reshard.runtime import cuda_buffers as cb
from reshard.runtime.nccl import NcclBackend, assign_id_hosts, generate_unique_ids

pytestmark = pytest.mark.gpu

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _torch_cuda():
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


# ============================================================================================
# cupy + NCCL, no GPU


@pytest.mark.gpu(0)
def test_type_codes_match_cupys_nccl_constants():
    from cupy.cuda import nccl

    for code, name in cb.NCCL_TYPE_NAMES.items():
        assert getattr(nccl, name) == code, name


@pytest.mark.gpu(0)
def test_unique_ids_are_fresh_128_byte_strings():
    ids = generate_unique_ids(4)
    assert len(set(ids)) == 4 and all(isinstance(u, bytes) and len(u) == 128 for u in ids)


@pytest.fixture(scope="module")
def cpu_members(ray_cluster):
    """Three CPU-only actors: NCCL unique ids need no GPU, so the rendezvous runs anywhere."""
    ray = ray_cluster

    @ray.remote(num_cpus=0)
    class Member:
        def sleep(self, seconds):
            time.sleep(seconds)

        def pid(self):
            return os.getpid()

    actors = {d: Member.remote() for d in range(3)}
    ray.get([a.pid.remote() for a in actors.values()], timeout=120)
    yield actors
    for a in actors.values():
        ray.kill(a)


@pytest.mark.gpu(0)
def test_rendezvous_gets_every_id_from_a_member_in_one_batched_round_trip(cpu_members):
    groups = [(0, 1), (1, 2), (0, 1, 2), (2,), (0, 2)]
    backend = NcclBackend()
    t0 = time.monotonic()
    rdvs = backend.rendezvous(groups, cpu_members, timeout_s=60)
    elapsed = time.monotonic() - t0
    assert [r.group for r in rdvs] == groups
    uids = [r.info["uid"] for r in rdvs]
    assert len(set(uids)) == len(groups) and all(len(u) == 128 for u in uids)
    hosts = assign_id_hosts(groups)
    assert all(r.info["host"] == hosts[r.group] and r.info["host"] in r.group for r in rdvs)
    assert elapsed < 30


@pytest.mark.gpu(0)
def test_rendezvous_times_out_instead_of_hanging(cpu_members, ray_cluster):
    busy = cpu_members[1].sleep.remote(8)  # actor 1 cannot answer for 8 s
    t0 = time.monotonic()
    with pytest.raises(ReshardTimeout, match="unique ids"):
        NcclBackend().rendezvous([(0, 1), (1,), (1, 2)], cpu_members, timeout_s=1.0)
    assert time.monotonic() - t0 < 6
    ray_cluster.get(busy, timeout=60)


@pytest.mark.gpu(0)
def test_rendezvous_names_devices_without_actors(cpu_members):
    with pytest.raises(ValueError, match=r"\[7\]"):
        NcclBackend().rendezvous([(0, 7)], cpu_members)


# ============================================================================================
# one GPU, one-rank communicators in this process


@pytest.fixture
def backend():
    b = NcclBackend(timeout_s=30)
    yield b
    b.close()


@pytest.fixture
def comm(backend):
    (rdv,) = backend.local_rendezvous([(0,)])
    return backend.connect(rdv, 0, 30)


def test_one_rank_broadcast_leaves_the_buffer_in_place(comm):
    import cupy

    x = cupy.arange(1000, dtype=cupy.float32)
    ptr = x.data.ptr
    comm.broadcast(x, 0)
    assert x.data.ptr == ptr
    np.testing.assert_array_equal(cupy.asnumpy(x), np.arange(1000, dtype=np.float32))


def test_send_to_self_needs_a_group_call_and_arrives(backend, comm):
    import cupy

    a = cupy.arange(4096, dtype=cupy.int64) * 3
    b = cupy.zeros_like(a)
    with backend.grouped():
        comm.send(a, 0)
        comm.recv(b, 0)
    np.testing.assert_array_equal(cupy.asnumpy(b), cupy.asnumpy(a))


def test_communicators_are_cached_by_group_and_rendezvous(backend):
    (rdv,) = backend.local_rendezvous([(0,)])
    comm = backend.connect(rdv, 0, 30)
    assert backend.connect(rdv, 0, 30) is comm
    assert backend.live_groups() == [(0,)] and backend.stats["created"] == 1
    # a new rendezvous for a live group means the driver re-created it: the old one is replaced
    (rdv2,) = backend.local_rendezvous([(0,)])
    comm2 = backend.connect(rdv2, 0, 30)
    assert comm2 is not comm and comm.aborted and backend.live_groups() == [(0,)]


def test_rank_and_device_are_checked(backend, comm):
    import cupy

    with pytest.raises(ValueError, match="out of range"):
        comm.broadcast(cupy.zeros(3), 1)
    with pytest.raises(TypeError, match="torch CUDA tensors or cupy arrays"):
        comm.broadcast(np.zeros(3), 0)
    (rdv,) = backend.local_rendezvous([(5,)])
    with pytest.raises(ValueError, match="serves device 0"):
        backend.connect(rdv, 5, 30)


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "int64", "int32", "int8", "uint8", "bool"])
def test_cupy_dtypes_round_trip_through_send_to_self(backend, comm, dtype):
    import cupy

    rng = np.random.default_rng(0)
    host = (rng.integers(0, 2, 777) if dtype == "bool" else rng.integers(-100, 100, 777)).astype(dtype)
    a = cupy.asarray(host)
    b = cupy.zeros_like(a)
    with backend.grouped():
        comm.send(a, 0)
        comm.recv(b, 0)
    np.testing.assert_array_equal(cupy.asnumpy(b), host)


def test_non_contiguous_views_pass_through_one_reusable_staging_buffer(backend, comm):
    import cupy

    src = cupy.arange(64 * 48, dtype=cupy.float32).reshape(64, 48)
    backend.reserve_staging(64 * 16 * 4)
    cap, gen = backend._staging.capacity_bytes, backend._staging.alloc.generation
    for k in range(5):
        dst = cupy.zeros((64, 48), dtype=cupy.float32)
        with backend.grouped():
            comm.send(src[:, 8 + k : 24 + k], 0)  # strided read: packed into staging
            comm.recv(dst[:, 16:32], 0)  # strided write: unpacked from staging
        np.testing.assert_array_equal(cupy.asnumpy(dst[:, 16:32]), cupy.asnumpy(src[:, 8 + k : 24 + k]))
        assert not cupy.asnumpy(dst[:, :16]).any() and not cupy.asnumpy(dst[:, 32:]).any()
    assert backend._staging.capacity_bytes == cap and backend._staging.alloc.generation == gen
    assert backend._staging.alloc.used_bytes == 0


def test_contiguous_slices_are_sent_in_place_without_staging(backend, comm):
    import cupy

    buf = cupy.arange(100, dtype=cupy.int32)
    out = cupy.zeros(100, dtype=cupy.int32)
    with backend.grouped():
        comm.send(buf[10:30], 0)
        comm.recv(out[50:70], 0)
    np.testing.assert_array_equal(cupy.asnumpy(out[50:70]), np.arange(10, 30))
    assert backend._staging.alloc.high_water_bytes == 0


def test_many_operations_in_one_group_wait_once(backend, comm):
    import cupy

    xs = [cupy.full(1 << 16, i, dtype=cupy.float32) for i in range(16)]
    ys = [cupy.zeros(1 << 16, dtype=cupy.float32) for _ in range(16)]
    batches = backend.stats["batches"]
    with backend.grouped():
        for x, y in zip(xs, ys, strict=True):
            comm.send(x, 0)
            comm.recv(y, 0)
    assert backend.stats["batches"] == batches + 1
    assert all(float(y[0]) == i and float(y[-1]) == i for i, y in enumerate(ys))


def test_zero_size_transfers_are_skipped(comm):
    import cupy

    comm.broadcast(cupy.zeros((0, 5), dtype=cupy.float32), 0)


def test_closed_or_aborted_communicators_refuse_work(backend):
    import cupy

    (rdv,) = backend.local_rendezvous([(0,)])
    c = backend.connect(rdv, 0, 30)
    c.close()
    assert backend.live_groups() == []
    with pytest.raises(ReshardError, match="closed"):
        c.broadcast(cupy.zeros(3), 0)
    c2 = backend.connect(backend.local_rendezvous([(0,)])[0], 0, 30)
    assert c2 is not c
    c2.abort()
    with pytest.raises(ReshardError, match="aborted"):
        c2.broadcast(cupy.zeros(3), 0)


def test_a_failed_group_block_aborts_its_communicators(backend, comm):
    import cupy

    with pytest.raises(RuntimeError, match="boom"):
        with backend.grouped():
            comm.send(cupy.zeros(8), 0)
            raise RuntimeError("boom")
    assert comm.aborted and backend.live_groups() == []


def test_torch_tensors_bfloat16_bool_and_stream_order(backend, comm):
    torch = _torch_cuda()
    if torch is None:
        pytest.skip("torch without CUDA")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        # produced on a side stream by a long kernel chain: the comm stream must wait for it
        a = torch.arange(1 << 22, device="cuda", dtype=torch.float32)
        for _ in range(20):
            a = a * 1.0 + 0.0
        a = a.to(torch.bfloat16)
        flags = (torch.arange(1000, device="cuda") % 3) == 0
        b = torch.empty_like(a)
        f = torch.zeros_like(flags)
        with backend.grouped():
            comm.send(a, 0)
            comm.recv(b, 0)
            comm.send(flags, 0)
            comm.recv(f, 0)
        # consumers on the side stream see the arrived data without an explicit sync
        same = bool(torch.equal(a, b)) and bool(torch.equal(flags, f))
    assert same
    m = torch.arange(60, device="cuda", dtype=torch.float16).reshape(6, 10)
    out = torch.zeros_like(m)
    with backend.grouped():
        comm.send(m[:, 2:5], 0)  # non-contiguous torch view: staged
        comm.recv(out[:, 7:10], 0)
    assert torch.equal(out[:, 7:10], m[:, 2:5])


def test_cupy_and_torch_buffers_mix_zero_copy(backend, comm):
    torch = _torch_cuda()
    if torch is None:
        pytest.skip("torch without CUDA")
    import cupy

    t = torch.arange(256, device="cuda", dtype=torch.int32)
    c = cupy.from_dlpack(t)  # same memory
    assert c.data.ptr == t.data_ptr()
    out = cupy.zeros(256, dtype=cupy.int32)
    with backend.grouped():
        comm.send(t, 0)
        comm.recv(out, 0)
    np.testing.assert_array_equal(cupy.asnumpy(out), np.arange(256, dtype=np.int32))


def test_env_is_applied_before_communicators_are_created():
    b = NcclBackend(env={"NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple"})
    try:
        b.connect(b.local_rendezvous([(0,)])[0], 0, 30)
        assert os.environ["NCCL_ALGO"] == "Ring" and os.environ["NCCL_PROTO"] == "Simple"
    finally:
        b.close()


def _run_isolated(code: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    """Failure paths leave NCCL threads behind: run them in their own interpreter."""
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout_s, env=env
    )


def test_creating_a_group_whose_peer_never_joins_times_out():
    out = _run_isolated(
        """
        import os, sys, time
        from reshard.errors import ReshardTimeout
        from reshard.runtime.nccl import NcclBackend
        b = NcclBackend()
        (rdv,) = b.local_rendezvous([(0, 1)])   # device 1 never connects
        t0 = time.monotonic()
        try:
            b.connect(rdv, 0, 3.0)
        except ReshardTimeout as e:
            print("TIMEOUT", round(time.monotonic() - t0, 1), "poisoned" if b._poisoned else "usable")
        sys.stdout.flush()
        os._exit(0)  # NCCL threads of the failed init may still be blocked
        """
    )
    assert "TIMEOUT" in out.stdout, out.stdout + out.stderr
    assert float(out.stdout.split()[1]) < 3.0 + 5.0 + 2.0


# ============================================================================================
# through the runtime: device actors (one GPU each) of reshard.runtime, NCCL backend
#
# Functions shipped to actors are defined inside the tests (cloudpickle sends them by value; the
# test module itself is not importable in the workers).


def test_reshard_on_a_one_gpu_mesh_keeps_data_bit_exact(ray_cluster):
    from reshard import DeviceMesh, Layout, Replicate, Shard, distribute, reshard

    mesh = DeviceMesh.create((1,), backend=NcclBackend(timeout_s=60))
    try:
        x = np.arange(48 * 40, dtype=np.float32).reshape(48, 40)
        a = distribute(x, Layout(mesh, (Shard(1),)))
        b = reshard(a, mesh, Layout(mesh, (Replicate(),)))
        np.testing.assert_array_equal(b.to_numpy(), x)
        (info,) = mesh.call(lambda ctx: (str(ctx.torch_device), type(ctx.backend).__name__))
        assert info == ("cuda:0", "NcclBackend")
    finally:
        mesh.shutdown()


@pytest.fixture(scope="module")
def gpu_mesh(ray_cluster):
    """One device actor per GPU (at most 4), NCCL backend, ONE live communicator per device (so the
    runtime's LRU bound evicts, and this backend destroys, all the time)."""
    from reshard import DeviceMesh

    free = int(ray_cluster.available_resources().get("GPU", 0))
    if free < 2:
        pytest.skip(f"needs 2 free GPUs in the Ray cluster, {free} free (another pool holds them?)")
    mesh = DeviceMesh.create((min(free, 4),), backend=NcclBackend(timeout_s=60), max_communicators=1)
    yield mesh
    mesh.shutdown()


@pytest.mark.gpu(2)
def test_broadcast_groups_over_all_gpus(gpu_mesh):
    from reshard.runtime import ensure_groups

    devs = list(gpu_mesh.device_ids)
    group = tuple(devs)
    ensure_groups([group])

    def body(ctx, group, root, n):
        import cupy

        x = cupy.zeros(n, dtype=cupy.float32)
        if ctx.device == root:
            x[...] = cupy.arange(n, dtype=cupy.float32) * 3
        ctx.communicator(group).broadcast(x, list(group).index(root))
        return cupy.asnumpy(x)

    for root in (devs[-1], devs[0]):
        for r in gpu_mesh.call(body, group, root, 1 << 20, timeout_s=120):
            np.testing.assert_array_equal(r, np.arange(1 << 20, dtype=np.float32) * 3)


@pytest.mark.gpu(2)
def test_grouped_exchange_with_strided_torch_and_cupy_buffers(gpu_mesh):
    from reshard.runtime import ensure_groups

    group = tuple(gpu_mesh.device_ids[:2])
    ensure_groups([group])

    def body(ctx, group, n):
        import cupy
        import torch

        me = list(group).index(ctx.device)
        comm = ctx.communicator(group)
        src = torch.zeros((n, 3), dtype=torch.bfloat16, device="cuda")
        src[:, 1] = torch.arange(n, device="cuda") % 100 + me  # strided: staged
        got = torch.zeros((n, 3), dtype=torch.bfloat16, device="cuda")
        flags = cupy.arange(n) % (2 + me) == 0  # bool, travels as bytes
        got_flags = cupy.zeros(n, dtype=cupy.bool_)
        with ctx.backend.grouped():  # both ranks send and receive at once: one NCCL group call
            comm.send(src[:, 1], 1 - me)
            comm.recv(got[:, 2], 1 - me)
            comm.send(flags, 1 - me)
            comm.recv(got_flags, 1 - me)
        return got[:, 2].float().cpu().numpy(), cupy.asnumpy(got_flags)

    (va, fa), (vb, fb) = gpu_mesh.call(body, group, 4099, devices=[0, 1], timeout_s=120)
    ref = np.arange(4099) % 100
    np.testing.assert_array_equal(va, ref + 1)
    np.testing.assert_array_equal(vb, ref)
    np.testing.assert_array_equal(fa, np.arange(4099) % 3 == 0)
    np.testing.assert_array_equal(fb, np.arange(4099) % 2 == 0)


@pytest.mark.gpu(2)
@pytest.mark.parametrize("dtype", ["float32", "float16", "int64", "int8", "uint8", "bool", "bfloat16"])
@pytest.mark.parametrize("case", ["shard_to_replicate", "dim0_to_dim1", "one_to_other"])
def test_reshard_between_gpus_is_bit_exact(gpu_mesh, dtype, case):
    import torch

    from reshard import DeviceMesh, Layout, Replicate, Shard, distribute, reshard

    devs = gpu_mesh.device_ids
    if case == "shard_to_replicate":
        src_mesh = dst_mesh = DeviceMesh.from_devices(devs[:2], (2,))
        src_p, dst_p = (Shard(0),), (Replicate(),)  # broadcast groups
    elif case == "dim0_to_dim1":
        src_mesh = dst_mesh = DeviceMesh.from_devices(devs[:2], (2,))
        src_p, dst_p = (Shard(0),), (Shard(1),)  # send/recv, strided slices
    else:
        src_mesh, dst_mesh = DeviceMesh.from_devices(devs[:1], (1,)), DeviceMesh.from_devices(devs[1:2], (1,))
        src_p, dst_p = (Replicate(),), (Replicate(),)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-100, 100, (37, 26), generator=g)
    x = (x > 0) if dtype == "bool" else x.to(getattr(torch, dtype))
    a = distribute(x, Layout(src_mesh, src_p))
    b = reshard(a, src_mesh, Layout(dst_mesh, dst_p), timeout_s=120)
    assert torch.equal(b.to_torch(), x)
    assert torch.equal(a.to_torch(), x)  # the source is intact


@pytest.mark.gpu(2)
def test_the_runtimes_bound_destroys_evicted_communicators_on_every_member(gpu_mesh):
    from reshard.runtime import ensure_groups

    a, b = gpu_mesh.device_ids[:2]

    def use(ctx, group):
        import cupy

        x = cupy.full(16, ctx.device == group[0], dtype=cupy.float32)
        ctx.communicator(group).broadcast(x, 0)
        return float(x.sum())

    def live(ctx):
        return sorted(ctx.backend.live_groups()), ctx.backend.stats["destroyed"]

    ensure_groups([(a, b)])
    assert gpu_mesh.call(use, (a, b), devices=[0, 1], timeout_s=120) == [16.0, 16.0]
    (_, destroyed_a0), (_, destroyed_b0) = gpu_mesh.call(live, devices=[0, 1])
    ensure_groups([(a,)])  # device a is at its bound (1): (a, b) is dropped on a now, on b at b's next call
    ensure_groups([(b,)])
    gpu_mesh.call(lambda ctx: use(ctx, (ctx.device,)), devices=[0, 1], timeout_s=120)
    (live_a, destroyed_a), (live_b, destroyed_b) = gpu_mesh.call(live, devices=[0, 1])
    assert live_a == [(a,)] and live_b == [(b,)]
    assert destroyed_a == destroyed_a0 + 1 and destroyed_b == destroyed_b0 + 1
    ensure_groups([(a, b)])  # and back: a new generation of the pair
    assert gpu_mesh.call(use, (a, b), devices=[0, 1], timeout_s=120) == [16.0, 16.0]


@pytest.mark.gpu(2)
def test_a_peer_that_never_sends_times_out_and_aborts_instead_of_hanging(gpu_mesh):
    from reshard.runtime import ensure_groups, runtime

    group = tuple(gpu_mesh.device_ids[:2])
    ensure_groups([group])

    def lonely_recv(ctx, group, seconds):
        import cupy

        comm = ctx.communicator(group)
        t0 = time.monotonic()
        try:
            with ctx.backend.grouped(timeout_s=seconds):
                comm.recv(cupy.zeros(1 << 20, dtype=cupy.float32), 0)
        except Exception as e:
            return type(e).__name__, time.monotonic() - t0, comm.aborted
        return "completed", time.monotonic() - t0, comm.aborted

    kind, elapsed, aborted = gpu_mesh.call(lonely_recv, group, 3.0, devices=[1], timeout_s=120)[0]
    assert kind == "ReshardTimeout" and aborted and elapsed < 3.0 + 5.0
    # what the driver does after a failed run: forget the group everywhere, re-create it on next use
    for g, _gen in runtime().groups.forget([group]):
        gpu_mesh.call(lambda ctx, g: ctx.groups.abort([g]), g, devices=[0, 1], timeout_s=60)
    ensure_groups([group])

    def ping(ctx, group):
        import cupy

        x = cupy.full(64, ctx.device == group[0], dtype=cupy.float32)
        ctx.communicator(group).broadcast(x, 0)
        return float(x.sum())

    assert gpu_mesh.call(ping, group, devices=[0, 1], timeout_s=120) == [64.0, 64.0]
