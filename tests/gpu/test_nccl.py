"""NCCL backend through cupy.

``gpu(0)``: cupy + NCCL installed, no GPU needed (type codes, the status cupy raises for
ncclInProgress, unique ids and the bootstrap threads they leave, the batched rendezvous through
Ray actors with its settings and version checks). ``gpu`` (one GPU): one-rank communicators in this
process: in-place broadcast, send-to-self, grouped calls, staging of non-contiguous views, dtypes,
all_reduce, stream order against a long kernel, destroy, timeouts. ``gpu(2)``: one Ray actor per
GPU: broadcast groups, send/recv, grouped exchanges, eviction and a missing peer. Several actors
sharing one GPU are in test_one_gpu_tier.py. Everything skips cleanly without cupy or GPUs, and
fails instead when RESHARD_REQUIRE_GPUS promised them (see conftest.py).
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
from reshard.runtime.backends import cuda_buffers as cb
from reshard.runtime.backends.nccl import (
    NCCL_IN_PROGRESS,
    NcclBackend,
    assign_id_hosts,
    generate_unique_ids,
    nccl_status,
)

pytestmark = pytest.mark.gpu

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ============================================================================================
# cupy + NCCL, no GPU


@pytest.mark.gpu(0)
def test_type_codes_match_cupys_nccl_constants():
    from cupy.cuda import nccl

    for code, name in cb.NCCL_TYPE_NAMES.items():
        assert getattr(nccl, name) == code, name


@pytest.mark.gpu(0)
def test_cupys_in_progress_status_is_recognised():
    from cupy.cuda import nccl

    for code in (NCCL_IN_PROGRESS, 2):
        with pytest.raises(Exception) as info:  # noqa: B017 - cupy 14 raises KeyError(7), cupy 13 may differ
            raise nccl.NcclError(code)
        assert nccl_status(info.value) == code


@pytest.mark.gpu(0)
def test_cupy_has_every_call_the_backend_makes():
    import cupy
    from cupy.cuda import nccl, runtime

    for name in ("groupStart", "groupEnd", "get_unique_id", "get_version", "NcclCommunicator", "NcclError"):
        assert callable(getattr(nccl, name)), name
    for name in ("bcast", "send", "recv", "allReduce", "check_async_error", "abort", "destroy"):
        assert callable(getattr(nccl.NcclCommunicator, name)), name
    for name in ("eventQuery", "getDeviceCount", "runtimeGetVersion", "CUDARuntimeError"):
        assert callable(getattr(runtime, name)), name
    for name in ("Stream", "Event", "Device", "ExternalStream"):
        assert callable(getattr(cupy.cuda, name)), name


@pytest.mark.gpu(0)
def test_unique_ids_are_fresh():
    ids = generate_unique_ids(4)
    assert len(set(ids)) == 4 and all(isinstance(u, bytes) and len(u) == 128 for u in ids)


@pytest.mark.gpu(0)
def test_each_unique_id_leaves_a_bootstrap_root_until_its_group_forms():
    """What NCCL does (measured here, no GPU needed): every id starts a root thread with a
    listening socket that waits for all ranks; nobody joins these, so all of them stay."""
    out = _run_isolated(
        """
        from reshard.runtime.backends.nccl import NcclBackend, bootstrap_root_threads, generate_unique_ids
        NcclBackend().arrive()  # as in an actor: NCCL_SET_THREAD_NAME=1 before the first NCCL call
        before = bootstrap_root_threads()
        generate_unique_ids(5)
        print(before, bootstrap_root_threads())
        """
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", "5"]


@pytest.fixture(scope="module")
def cpu_members(ray_cluster):
    """Three CPU-only actors: NCCL unique ids need no GPU, so the rendezvous runs anywhere."""
    ray = ray_cluster

    @ray.remote(num_cpus=0)
    class Member:
        def sleep(self, seconds):
            time.sleep(seconds)  # keeps the actor busy: the rendezvous must time out, not hang

        def pid(self):
            return os.getpid()

    actors = {d: Member.remote() for d in range(3)}
    ray.get([a.pid.remote() for a in actors.values()], timeout=120)
    yield actors
    for a in actors.values():
        ray.kill(a)


@pytest.mark.gpu(0)
def test_rendezvous_gets_ids_settings_and_abort_addresses_in_one_batched_round_trip(cpu_members, ray_cluster):
    groups = [(0, 1), (1, 2), (0, 1, 2), (2,), (0, 2), (0, 1)]  # (0, 1) twice: two channels, two communicators
    backend = NcclBackend()
    rdvs = backend.rendezvous(groups, cpu_members, timeout_s=60)
    assert [r.group for r in rdvs] == groups
    uids = [r.info["uid"] for r in rdvs]
    assert len(set(uids)) == len(groups) and all(len(u) == 128 for u in uids)
    hosts = assign_id_hosts(groups)
    assert all(r.info["host"] == h and h in r.group for r, h in zip(rdvs, hosts, strict=True))
    pids = ray_cluster.get([cpu_members[d].pid.remote() for d in range(3)], timeout=60)
    for r in rdvs:
        assert r.info["v"] == 2 and len(r.info["abort_to"]) == len(r.group)
        assert len({tuple(a) for a in r.info["abort_to"]}) == len(r.group)  # one side channel per process
    assert len(set(pids)) == 3
    # the members' static reports are cached: the next rendezvous asks only the id hosts
    assert sorted(backend._members) == [0, 1, 2]
    (again,) = backend.rendezvous([(0, 2)], cpu_members, timeout_s=60)
    assert again.info["abort_to"] == next(r.info["abort_to"] for r in rdvs if r.group == (0, 2))


@pytest.mark.gpu(0)
def test_rendezvous_refuses_members_whose_nccl_settings_differ(cpu_members, ray_cluster):
    def set_algo(actor_self, value):
        old = os.environ.pop("NCCL_ALGO", None)
        if value is not None:
            os.environ["NCCL_ALGO"] = value
        return old

    old = ray_cluster.get(cpu_members[2].__ray_call__.remote(set_algo, "Tree"), timeout=60)
    try:
        with pytest.raises(ValueError, match=r"device 0 has NCCL_ALGO=\S+, device 2 has NCCL_ALGO=Tree"):
            NcclBackend().rendezvous([(0, 1), (0, 2)], cpu_members, timeout_s=60)
        NcclBackend().rendezvous([(0, 1)], cpu_members, timeout_s=60)  # groups without device 2 are fine
    finally:
        ray_cluster.get(cpu_members[2].__ray_call__.remote(set_algo, old), timeout=60)


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
    # a rendezvous names one communicator (its unique id): a second one for the same group is a
    # second channel, and both stay live
    (rdv2,) = backend.local_rendezvous([(0,)])
    comm2 = backend.connect(rdv2, 0, 30)
    assert comm2 is not comm and not comm.aborted and backend.live_groups() == [(0,), (0,)]
    assert backend.connect(rdv, 0, 30) is comm and backend.stats["created"] == 2


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
    backend.reserve_staging(2 * 64 * 16 * 4)  # the send's and the receive's segments, in one group
    cap, gen = backend._staging_buffer().capacity_bytes, backend._staging_buffer().alloc.generation
    for k in range(5):
        dst = cupy.zeros((64, 48), dtype=cupy.float32)
        with backend.grouped():
            comm.send(src[:, 8 + k : 24 + k], 0)  # strided read: packed into staging
            comm.recv(dst[:, 16:32], 0)  # strided write: unpacked from staging
        np.testing.assert_array_equal(cupy.asnumpy(dst[:, 16:32]), cupy.asnumpy(src[:, 8 + k : 24 + k]))
        assert not cupy.asnumpy(dst[:, :16]).any() and not cupy.asnumpy(dst[:, 32:]).any()
    assert backend._staging_buffer().capacity_bytes == cap and backend._staging_buffer().alloc.generation == gen
    assert backend._staging_buffer().alloc.used_bytes == 0


def test_contiguous_slices_are_sent_in_place_without_staging(backend, comm):
    import cupy

    buf = cupy.arange(100, dtype=cupy.int32)
    out = cupy.zeros(100, dtype=cupy.int32)
    with backend.grouped():
        comm.send(buf[10:30], 0)
        comm.recv(out[50:70], 0)
    np.testing.assert_array_equal(cupy.asnumpy(out[50:70]), np.arange(10, 30))
    assert backend._staging_buffer().alloc.high_water_bytes == 0


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


@pytest.mark.gpu(1, torch_cuda=True)
def test_torch_bfloat16_bool_and_strided_views(backend, comm):
    import torch

    a = torch.arange(1 << 16, device="cuda", dtype=torch.float32).to(torch.bfloat16)
    flags = (torch.arange(1000, device="cuda") % 3) == 0
    b = torch.empty_like(a)
    f = torch.zeros_like(flags)
    with backend.grouped():
        comm.send(a, 0)
        comm.recv(b, 0)
        comm.send(flags, 0)
        comm.recv(f, 0)
    assert torch.equal(a, b) and torch.equal(flags, f)
    m = torch.arange(60, device="cuda", dtype=torch.float16).reshape(6, 10)
    out = torch.zeros_like(m)
    with backend.grouped():
        comm.send(m[:, 2:5], 0)  # non-contiguous torch view: staged
        comm.recv(out[:, 7:10], 0)
    assert torch.equal(out[:, 7:10], m[:, 2:5])


@pytest.mark.gpu(1, torch_cuda=True)
def test_the_comm_stream_waits_for_a_long_kernel_that_writes_the_buffer(backend, comm):
    """The buffer is written on a side stream behind ~0.5 s of GPU sleep. If the comm stream did not
    wait for the producer's event, NCCL would read the old zeros while the sleep still runs."""
    import torch

    a = torch.zeros(1 << 20, device="cuda", dtype=torch.int32)
    b = torch.full_like(a, -1)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    written = torch.cuda.Event()
    with torch.cuda.stream(side):
        torch.cuda._sleep(1_000_000_000)  # about 0.5 s of GPU clock cycles
        a.fill_(7)
        written.record(side)
        assert not written.query()  # the write is still pending when NCCL is asked to read
        with backend.grouped():
            comm.send(a, 0)
            comm.recv(b, 0)
        got = b.clone()  # a consumer on the producer's stream, ordered after the arrival
    torch.cuda.synchronize()
    assert bool((got == 7).all())


def test_all_reduce_of_one_rank_keeps_values_and_refuses_types_nccl_cannot_reduce(backend, comm):
    import cupy

    x = cupy.arange(1000, dtype=cupy.float32) - 500
    comm.all_reduce(x, "sum")
    np.testing.assert_array_equal(cupy.asnumpy(x), np.arange(1000, dtype=np.float32) - 500)
    m = cupy.arange(48, dtype=cupy.int64).reshape(6, 8)
    comm.all_reduce(m[:, 2:5], "max")  # strided: staged in and out
    np.testing.assert_array_equal(cupy.asnumpy(m), np.arange(48).reshape(6, 8))
    flags = cupy.arange(10) % 2 == 0
    comm.all_reduce(flags, "sum")  # bool sum is logical or
    np.testing.assert_array_equal(cupy.asnumpy(flags), np.arange(10) % 2 == 0)
    with pytest.raises(TypeError, match="cannot reduce int16"):
        comm.all_reduce(cupy.zeros(4, dtype=cupy.int16), "sum")
    with pytest.raises(ValueError, match="unknown reduce op"):
        comm.all_reduce(x, "mean")


def test_destroy_reads_the_async_error_first_and_frees_the_communicator(backend, comm):
    import cupy

    comm.broadcast(cupy.ones(16, dtype=cupy.float32), 0)
    destroyed = backend.stats["destroyed"]
    backend.destroy([(0,)])
    assert backend.live_groups() == [] and comm.closed and backend.stats["destroyed"] == destroyed + 1
    assert comm.raw.comm == 0


@pytest.mark.gpu(1, torch_cuda=True)
def test_cupy_and_torch_buffers_mix_zero_copy(backend, comm):
    import cupy
    import torch

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


def test_creating_a_group_whose_peer_never_joins_times_out_and_the_backend_stays_usable():
    """Non-blocking creation: the caller's own thread aborts the half-made communicator at the
    deadline (no thread is inside NCCL), the process neither crashes nor exits, and the same
    backend then creates and uses a new communicator."""
    out = _run_isolated(
        """
        import os, sys
        import cupy
        from reshard.errors import ReshardTimeout
        from reshard.runtime.backends.nccl import NcclBackend
        b = NcclBackend()
        (rdv,) = b.local_rendezvous([(0, 1)])   # device 1 never connects
        try:
            b.connect(rdv, 0, 3.0)
            print("CONNECTED")
        except ReshardTimeout as e:
            print("TIMEOUT", b.live_groups(), os.environ.get("NCCL_COMM_BLOCKING"))
        (one,) = b.local_rendezvous([(0,)])
        x = cupy.arange(8, dtype=cupy.float32)
        b.connect(one, 0, 30).broadcast(x, 0)
        print("USABLE", float(x.sum()))
        sys.stdout.flush()
        """
    )
    assert out.returncode == 0, out.stdout + out.stderr
    # non-blocking by its own configuration: the process environment untouched
    assert out.stdout.split("\n")[:2] == ["TIMEOUT [] None", "USABLE 28.0"], out.stdout + out.stderr


@pytest.mark.gpu(1, torch_cuda=True)
def test_our_communicators_stay_non_blocking_where_torch_made_its_nccl_first():
    """NCCL reads NCCL_COMM_BLOCKING once per process; torch.distributed's group initialises NCCL
    first, blocking. Ours are non-blocking by their own configuration all the same: a creation
    whose peer never joins times out cleanly (a blocking one would be stuck inside NCCL), and
    neither the environment nor torch's group is touched."""
    out = _run_isolated(
        """
        import os, sys
        import torch, torch.distributed as dist
        from reshard.errors import ReshardTimeout
        from reshard.runtime.backends.nccl import NcclBackend
        dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29533", rank=0, world_size=1)
        t = torch.ones(4, device="cuda")
        dist.all_reduce(t)
        b = NcclBackend()
        (rdv,) = b.local_rendezvous([(0, 1)])   # device 1 never connects
        try:
            b.connect(rdv, 0, 3.0)
            print("CONNECTED")
        except ReshardTimeout:
            print("TIMEOUT", os.environ.get("NCCL_COMM_BLOCKING"))
        dist.all_reduce(t)
        print("TORCH", float(t.sum()))
        dist.destroy_process_group()
        sys.stdout.flush()
        """
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.split("\n")[:2] == ["TIMEOUT None", "TORCH 4.0"], out.stdout + out.stderr


# ============================================================================================
# through the runtime: device actors (one GPU each) of reshard.runtime, NCCL backend
#
# Functions shipped to actors are defined inside the tests (cloudpickle sends them by value; the
# test module itself is not importable in the workers).


@pytest.mark.gpu(1)
def test_reshard_on_a_one_gpu_mesh_keeps_data_bit_exact(ray_cluster, gpus):
    from reshard import DeviceMesh, Layout, Replicate, Shard, distribute, reshard

    gpus.wait_free(1)
    mesh = DeviceMesh.create((1,), backend=NcclBackend(timeout_s=60, gpus_per_device=gpus.reserve(1.0)))
    try:
        x = np.arange(48 * 40, dtype=np.float32).reshape(48, 40)
        a = distribute(x, Layout(mesh, (Shard(1),)))
        b = reshard(a, mesh, Layout(mesh, (Replicate(),)))
        np.testing.assert_array_equal(b.to_numpy(), x)
        (info,) = mesh.call(lambda ctx: (ctx.device_type, type(ctx.backend).__name__))
        assert info == ("cuda:0", "NcclBackend")
    finally:
        mesh.shutdown()


@pytest.fixture(scope="module")
def gpu_mesh(ray_cluster, gpus, require_pool):
    """One device actor per GPU (at most 4), NCCL backend, through the public API."""
    from reshard import DeviceMesh

    require_pool(2, gpus.total)
    n = min(gpus.total, 4)
    gpus.wait_free(n)
    mesh = DeviceMesh.create((n,), backend=NcclBackend(timeout_s=60, gpus_per_device=gpus.reserve(1.0)))
    yield mesh
    mesh.shutdown()


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
