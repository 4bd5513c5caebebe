"""Runtime mechanics: memory bound, cache bounds, the ``call`` extension point, concurrency and the
ShardedTensor API."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import ray
from dist_helpers import assert_bit_exact, assert_shards, groups_of, pl, random_array

from reshard import DeviceMesh, Layout, Replicate, Shard, distribute, plan_reshard, reshard
from reshard.ir.regions import box_shape, box_volume, layout_regions
from reshard.passes.lowering import lower_plan
from reshard.runtime import ensure_groups, lowered_reshard, runtime, runtime_stats, settle
from reshard.runtime.device_options import DeviceOptions
from reshard.runtime.device.shards import ASSEMBLY_MIN_BYTES

pytestmark = pytest.mark.dist


def _staging_bound(compiled, device: int) -> int:
    """What ``device`` may stage: the slices of one issue window side by side, at most
    ``window_ops`` of its largest unit slice sent or received over a link, and no more than
    ``window_staging_bytes`` unless one slice alone is bigger."""
    plan, options = compiled.plan, compiled.options
    sizes = [plan.transfer_bytes(t) for t in plan.transfers if t.kind.name != "COPY" and device in t.group]
    largest = max(sizes, default=0)
    return max(largest, min(options.window_ops * largest, options.window_staging_bytes))


@pytest.mark.parametrize("shared_memory", [True, False], ids=["pull", "gloo"])
@pytest.mark.parametrize("shape", [(32, 24, 16), (256, 128, 96)], ids=["staging kept", "staging trimmed"])
def test_memory_bound(view, pool, shape, shared_memory):
    """No device holds more than its destination shard plus one staging buffer for the slices of
    one issue window (plus its source shard) live during a reshard; the idle bytes of freed
    shards kept for reuse are reported apart and stay within ``buffer_pool_bytes``. Pulls need no
    staging at all: a receiver holds exactly its destination shard. A destination assembled apart
    (fresh shared memory, ``assembly_bytes``) counts twice: the shard is made from it at the end."""
    src = view([0, 1, 2, 3], (2, 2))
    dst = view([4, 5, 6, 7], (2, 2))
    keep = 1 << 20  # so that the big case's staging is trimmed after the run
    pool.call(_set_staging_keep, keep)
    try:
        _memory_case(pool, src, dst, shape, keep, pulls=shared_memory)
    finally:
        pool.call(_set_staging_keep, DeviceOptions.staging_keep_bytes)


@pytest.mark.parametrize("shared_memory", [True, False], ids=["pull", "gloo"])
def test_assembled_destinations_are_shards_like_any_other(view, pool, shared_memory):
    """Destinations big enough and of a size no freed shard has are assembled apart, come out
    bit-exact, and are shared shards the next reshard pulls from; once freed, a repeat refills
    their memory in place."""
    a = view([0, 1, 2, 3], (2, 2))
    b = view([4, 5, 6, 7], (2, 2))
    x = random_array((1000, 1046), "float32", 5)  # 2 MiB shards
    t = distribute(x, Layout(a, pl("S0 S1")))
    pool.call(_drain_pool)  # no freed shard of an earlier test serves these destinations
    to_b, to_a = Layout(b, pl("R S0")), Layout(a, pl("S1 R"))
    y = reshard(t, a, to_b, shared_memory=shared_memory)
    assert_bit_exact(y.to_numpy(), x)
    stats = {s["device"]: s for s in pool.stats()}
    assert all(stats[d]["last_run_assembled"] for d in b.device_ids)
    program = lowered_reshard(y, to_a, shared_memory=shared_memory).program
    pulls = [op for d in a.device_ids for op in program.for_device(d).ops if type(op).__name__ == "Pull"]
    assert bool(pulls) == shared_memory  # the assembled shards are shared: peers pull from them
    z = reshard(y, b, to_a, shared_memory=shared_memory)
    assert_bit_exact(z.to_numpy(), x)
    stats = {s["device"]: s for s in pool.stats()}
    assert all(stats[d]["last_run_assembled"] for d in a.device_ids)
    y.free()
    settle(pool)
    y2 = reshard(t, a, to_b, shared_memory=shared_memory)
    assert_bit_exact(y2.to_numpy(), x)
    stats = {s["device"]: s for s in pool.stats()}
    assert not any(stats[d]["last_run_assembled"] for d in b.device_ids)  # the freed shards' memory
    for u in (t, z, y2):
        u.free()


def test_empty_cache_gives_back_what_devices_keep_for_reuse(view, pool):
    """``DeviceMesh.empty_cache`` frees the pool's freed shards, the assembly buffers, the caller's
    staging buffers and mappings of peers' freed shards, and nothing a live tensor holds."""
    a = view([0, 1, 2, 3], (2, 2))
    b = view([4, 5, 6, 7], (2, 2))
    x = random_array((1000, 1046), "float32", 6)  # 2 MiB shards: assembled, staged on the gloo path
    t = distribute(x, Layout(a, pl("S0 S1")))
    pulled = reshard(t, a, Layout(b, pl("R S0")))  # b's devices map a's shards
    freed = reshard(t, a, Layout(b, pl("R R")))  # 4 MiB: no later destination takes its memory
    freed.free()
    staged = reshard(t, a, Layout(b, pl("S0 R")), shared_memory=False)  # last: a run sizes staging to its own
    settle(pool)
    before = {s["device"]: s for s in pool.stats()}
    kept = sum(s["pool_bytes"] + s["assembly_bytes"] + s["staging_bytes"] for s in before.values())
    assert all(before[d]["pool_bytes"] and before[d]["assembly_bytes"] for d in b.device_ids)
    assert all(before[d]["staging_bytes"] for d in b.device_ids)  # the gloo run's strided slices
    assert pool.empty_cache() == kept
    after = {s["device"]: s for s in pool.stats()}
    for s in after.values():
        assert s["pool_bytes"] == s["assembly_bytes"] == s["staging_bytes"] == 0
        assert s["buffers"] == before[s["device"]]["buffers"]  # live tensors untouched
    t.free()
    settle(pool)
    pool.empty_cache()  # a's devices let go of t's blocks (freed into their pools, freed here) ...
    pool.empty_cache()  # ... so b's devices drop their mappings of them
    for d in b.device_ids:
        assert after[d]["peer_maps"] > 0 and pool.stats()[pool.index_of(d)]["peer_maps"] < after[d]["peer_maps"]
    for y in (pulled, staged):
        assert_bit_exact(y.to_numpy(), x)
    again = reshard(pulled, b, Layout(a, pl("S1 S0")))  # memory is made again as needed
    assert_bit_exact(again.to_numpy(), x)
    for y in (pulled, staged, again):
        y.free()


def test_a_partial_reshards_scratch_buffer_is_reused_by_the_next(view, pool):
    """Devices that combine contributions in a scratch buffer give it back to their pool after the
    run, so a repeated reduction (gradients every step) combines in warm memory. (Pulls combine
    straight into the destination: the gloo path is the one with scratch buffers.)"""
    from reshard.ir.placement import Partial

    src = view([0, 1], (2,))  # both contributions on one host: one device combines them, sends one
    dst = view([4, 5, 6], (3,))
    parts = [random_array((600, 500), "int32", seed) for seed in (7, 8)]
    t = distribute(dict(enumerate(parts)), Layout(src, (Partial("sum"),)))
    layout = Layout(dst, pl("R"))
    program = lowered_reshard(t, layout, shared_memory=False).program
    scratchy = [d for d in (*src.device_ids, *dst.device_ids) if program.for_device(d).tmp]
    assert scratchy, "this layout pair must combine in scratch buffers"
    pool.call(_drain_pool)
    outputs = []
    for run in range(2):
        settle(pool)
        before = {s["device"]: s["pool_hits"] for s in pool.stats()}
        outputs.append(reshard(t, src, layout, shared_memory=False))
        assert_bit_exact(outputs[-1].to_numpy(), parts[0] + parts[1])
        hits = {s["device"]: s["pool_hits"] - before[s["device"]] for s in pool.stats()}
        assert all(hits[d] == run for d in scratchy), (run, hits)  # the second run's scratch: the first's
    for u in (t, *outputs):
        u.free()


def _drain_pool(ctx):
    ctx.store.clear_pool()


def _set_staging_keep(ctx, nbytes):
    staging = ctx.controller(ctx.caller).staging
    staging.keep_bytes = nbytes
    staging.trim()


def _memory_case(pool, src, dst, shape, keep, pulls):
    x = random_array(shape, "float32", 11)
    t = distribute(x, Layout(src, pl("S2 S1")))  # every slice is strided on both sides
    layout = Layout(dst, pl("S0 S1"))
    settle(pool)
    hits = {s["device"]: s["pool_hits"] for s in pool.stats()}
    # bucket_bytes=1: no slice is packed, each strided one passes through staging on its own
    y = reshard(t, src, layout, strategy="send_recv", shared_memory=pulls, bucket_bytes=1)
    assert_bit_exact(y.to_numpy(), x)
    compiled = lowered_reshard(t, layout, strategy="send_recv", shared_memory=pulls)
    program = compiled.program
    stats = pool.stats()
    staged = 0
    for mesh, tensor in ((src, t), (dst, y)):
        for device, box in zip(mesh.device_ids, layout_regions(tensor.layout, shape), strict=True):
            s = stats[pool.index_of(device)]
            assert s["buffers"][tensor.name] == box_volume(box) * 4
            assert s["staging_bytes"] <= keep  # an idle actor keeps at most staging_keep_bytes
    for device, box in zip(dst.device_ids, layout_regions(layout, shape), strict=True):
        s = stats[pool.index_of(device)]
        dst_bytes = box_volume(box) * 4
        assert s["assembly_bytes"] <= s["assembly_limit_bytes"]
        pooled = s["pool_hits"] > hits[device]
        # a big destination the pool could not give is assembled apart, and counts twice
        assert s["last_run_assembled"] == (not pooled and ASSEMBLY_MIN_BYTES <= dst_bytes <= s["assembly_bytes"])
        if s["last_run_assembled"]:
            dst_bytes *= 2
        if pulls:  # every slice copied straight from the holder's shard: nothing staged
            assert s["last_run_peak_bytes"] == dst_bytes and s["staging_bytes"] == 0
            continue
        assert s["last_run_peak_bytes"] <= dst_bytes + _staging_bound(compiled, device)
        staged += s["last_run_peak_bytes"] > dst_bytes
        assert program.for_device(device).staging_bytes <= _staging_bound(compiled, device)
    for device in () if pulls else src.device_ids:  # senders: staging only, never a full copy
        s = stats[pool.index_of(device)]
        assert s["last_run_peak_bytes"] <= _staging_bound(compiled, device)
    assert pulls or staged, "this layout pair must exercise the staging path"
    for d in () if pulls else (*src.device_ids, *dst.device_ids):
        need = program.for_device(d).staging_bytes
        # kept for the next run when within the bound, freed otherwise
        assert stats[pool.index_of(d)]["staging_bytes"] == (need if need <= keep else 0)
    for s in stats:  # the pool's idle bytes: reported apart from live buffers, bounded
        assert 0 <= s["pool_bytes"] <= s["pool_limit_bytes"]

    # A repeated reshard after freeing its result reuses the freed memory: same live bound, the
    # destination shard comes out of the pool (which holds it idle between the two runs).
    settle(pool)
    before = {s["device"]: s for s in pool.stats()}
    y.free()
    settle(pool)
    idle = {s["device"]: s["pool_bytes"] for s in pool.stats()}
    for device, box in zip(dst.device_ids, layout_regions(layout, shape), strict=True):
        assert idle[device] >= box_volume(box) * 4  # the freed shard went idle into the pool
    y2 = reshard(t, src, layout, strategy="send_recv", shared_memory=pulls)
    assert_bit_exact(y2.to_numpy(), x)
    settle(pool)
    after = {s["device"]: s for s in pool.stats()}
    for device, box in zip(dst.device_ids, layout_regions(layout, shape), strict=True):
        s = after[device]
        dst_bytes = box_volume(box) * 4
        assert not s["last_run_assembled"]  # the pool's block is filled in place
        assert s["last_run_peak_bytes"] <= dst_bytes + _staging_bound(compiled, device)
        assert s["pool_hits"] > before[device]["pool_hits"]  # destination taken from the pool
        assert s["buffers"][y2.name] == dst_bytes
        assert s["pool_bytes"] == idle[device] - dst_bytes
        assert s["pool_bytes"] <= s["pool_limit_bytes"]
    y2.free()
    t.free()


def test_communicator_and_program_cache_bounds(view, pool):
    mesh = view(range(8), (2, 4))
    mesh.configure(max_communicators=3, max_programs=2)
    try:
        x = random_array((16, 12), "int32", 12)
        t = distribute(x, Layout(mesh, pl("S0 S1")))
        layouts = [pl("S1 S0"), pl("R S0"), pl("S1 R"), pl("S0 S0")]
        for spec in layouts:
            layout = Layout(mesh, spec)
            y = reshard(t, mesh, layout, strategy="send_recv", shared_memory=False)  # communicators only
            assert_bit_exact(y.to_numpy(), x)
            compiled = lowered_reshard(t, layout, strategy="send_recv", shared_memory=False)
            for i, s in enumerate(pool.stats()):
                needed = sum(1 for g in compiled.groups if pool.device_ids[i] in g)
                assert len(groups_of(s)) <= max(3, needed), (i, groups_of(s), needed)
                assert len([p for p in s["programs"] if p[0] == runtime().id]) <= 2  # the bound is per controller
        shipped = runtime_stats()["programs_shipped"]
        reshard(t, mesh, Layout(mesh, layouts[0]), strategy="send_recv", shared_memory=False)  # evicted: shipped again
        assert runtime_stats()["programs_shipped"] > shipped
    finally:
        mesh.configure(max_communicators=64, max_programs=256)


def _transfer(ctx, group, root, n):
    import torch

    comm = ctx.communicator(group)
    peer = 1 - comm.rank
    if ctx.device == root:
        comm.send(torch.arange(n, dtype=torch.float32), peer)
        return None
    t = torch.empty(n, dtype=torch.float32)
    comm.recv(t, peer)
    return float(t.sum())


def test_call_and_raw_transfer(pool):
    a, b = pool.device_ids[1], pool.device_ids[6]
    ensure_groups([(b, a)])
    out = pool.call(_transfer, (a, b), a, 1000, devices=[1, 6])
    assert out == [None, float(sum(range(1000)))]
    assert pool.call(lambda ctx: (ctx.device, str(ctx.torch_device)), devices=[3]) == [(pool.device_ids[3], "cpu")]


def _run_local_program(ctx, program):
    import torch

    src = torch.arange(12, dtype=torch.int64).reshape(3, 4)
    dst = torch.empty(3, 4, dtype=torch.int64)
    ctx.run_program(program, src, dst)
    return bool(torch.equal(src, dst))


def test_context_runs_a_device_program(view):
    mesh = view([2], (1,))
    layout = Layout(mesh, pl("R"))
    program = lower_plan(plan_reshard((3, 4), "int64", layout, Layout(mesh, pl("S0"))))
    assert mesh.call(_run_local_program, program.for_device(mesh.device_ids[0])) == [True]


def test_concurrent_reshards(view):
    a = view([0, 1, 4, 5], (2, 2))
    b = view([2, 3, 6, 7], (2, 2))
    c = view([1, 2, 3], (3,))
    x = random_array((9, 7), "float64", 13)
    t = distribute(x, Layout(a, pl("S0 S1")))
    errors = []

    def worker(dst_layout):
        try:
            for _ in range(4):
                assert_bit_exact(reshard(t, a, dst_layout).to_numpy(), x)
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [
        threading.Thread(target=worker, args=(lay,))
        for lay in (Layout(b, pl("S1 S0")), Layout(c, pl("S0")), Layout(a, pl("R R")))
    ]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not errors, errors


def test_sharded_tensor_api(view):
    import torch

    a = view([0, 1, 4, 5], (2, 2))
    x = random_array((5, 3), "bfloat16", 14)
    t = distribute(x, Layout(a, pl("S0 R")))
    assert t.shape == (5, 3) and t.dtype_name == "bfloat16" and t.torch_dtype == torch.bfloat16
    assert t.mesh is a and t.device_mesh is a and t.layout == Layout(a, pl("S0 R")) and t.placements == pl("S0 R")
    assert "bfloat16[5, 3]" in repr(t)
    with pytest.raises(TypeError, match="to_torch"):
        t.to_numpy()
    with pytest.raises(TypeError, match="as_torch=True"):
        t.local_shards()
    assert torch.equal(t.to_torch().view(torch.int16), x.view(torch.int16))
    shards = t.local_shards(as_torch=True)
    assert [tuple(s.shape) for s in shards.values()] == [(3, 3), (3, 3), (2, 3), (2, 3)]
    assert_shards(t, x)
    t.free()
    t.free()
    with pytest.raises(ValueError, match="freed"):
        t.to_torch()
    y = distribute(np.arange(3, dtype=np.uint8), Layout(a, pl("S0 S0")))  # chunks [0:2] [2:3], then halves
    shards = y.local_shards()
    assert [s.tolist() for s in shards.values()] == [[0], [1], [2], []]
    assert y.dtype == np.uint8 and torch.equal(y.full_tensor(), torch.arange(3, dtype=torch.uint8))
    with pytest.raises(TypeError, match=r"full_tensor\(\)"):
        np.asarray(y)


def _held(ctx, names) -> list[bool]:
    return [n in ctx.store for n in names]


def test_free_of_a_tree_drops_every_handles_shards_on_every_mesh_at_once(view):
    """``free(tree)``: handles on two meshes, one freed before, in nested containers; every
    shard is dropped on every device of its mesh, every handle is freed, a second free does
    nothing; what is not a handle is refused, naming its type, before anything is freed."""
    from reshard import free

    a, b = view([0, 1], (2,)), view([2, 3], (2,))
    on_a = distribute({f"w{i}": random_array((4, 2), "float32", 20 + i) for i in range(3)}, Layout(a, pl("S0")))
    on_b = distribute({"v": random_array((6,), "float32", 30)}, Layout(b, pl("S0")))
    with pytest.raises(TypeError, match="ndarray at 1 is neither a leaf nor a dict, list or tuple of them"):
        free([on_a["w0"], np.zeros(2)])
    assert not on_a["w0"].freed
    on_a["w2"].free()
    names_a, names_b = [t.name for t in on_a.values()], [on_b["v"].name]
    free({"a": on_a, "b": [on_b["v"]]})
    free(on_a)
    assert all(t.freed for t in (*on_a.values(), on_b["v"]))
    settle(a, timeout_s=30)
    settle(b, timeout_s=30)
    assert a.call(_held, names_a) == [[False] * 3] * 2 and b.call(_held, names_b) == [[False]] * 2


def test_named_axes_torch_placements_and_negative_dims(pool):
    """Meshes with axis names: sub-meshes by name, layouts by name or PartitionSpec; torch's own
    placement objects and Shard(-1) work wherever ours do."""
    from torch.distributed.tensor import Replicate as TorchReplicate
    from torch.distributed.tensor import Shard as TorchShard

    mesh = DeviceMesh.from_devices(pool.device_ids[:4], (2, 2), axis_names=("dp", "tp"))
    assert str(Layout(mesh, pl("S0 R"))) == "(dp: S(0), tp: R) on mesh (2, 2)"
    tp = mesh["tp"]
    assert [m.device_ids for m in tp] == [pool.device_ids[0:2], pool.device_ids[2:4]]
    assert [m.device_ids for m in mesh["dp"]] == [pool.device_ids[0:4:2], pool.device_ids[1:4:2]]
    with pytest.raises(KeyError, match="'pp' is not an axis"):
        mesh["pp"]
    x = random_array((6, 4), "int32", 21)
    by_name = Layout.from_spec(mesh, {"tp": Shard(-1)})
    assert by_name == Layout(mesh, (Replicate(), Shard(-1)))
    assert Layout.from_spec(mesh, (None, "tp")).for_shape(x.shape) == by_name.for_shape(x.shape)
    t = distribute(x, by_name)
    assert t.layout.placements == (Replicate(), Shard(1))  # resolved against the tensor's rank
    y = reshard(t, mesh, Layout(mesh, (TorchShard(0), TorchReplicate())))
    assert y.placements == (Shard(0), Replicate())
    assert_bit_exact(y.to_numpy(), x)
    with pytest.raises(ValueError, match="'ep' is not an axis"):
        Layout.from_spec(mesh, {"ep": Shard(0)})


def test_views_keep_device_hosts(pool):
    v = DeviceMesh.from_devices([pool.device_ids[i] for i in (0, 1, 4, 5)], (2, 2))
    assert v.host_ids == (pool.host_ids[0], pool.host_ids[0], pool.host_ids[4], pool.host_ids[4])
    w = DeviceMesh.from_devices(v, (4,), devices_per_host=2)
    assert w.host_ids[0] == w.host_ids[1] != w.host_ids[2] == w.host_ids[3]
    assert not w.owned and pool.owned
    assert box_shape(((0, 2), (1, 3))) == (2, 2)
    v.shutdown()
    w.shutdown()


def test_nccl_mesh_without_enough_gpus_is_refused_at_once(ray_cluster):
    import ray

    if ray.cluster_resources().get("GPU", 0) >= 2:
        pytest.skip("this Ray cluster has GPUs for an NCCL mesh")
    with pytest.raises(ValueError, match=r"backend 'nccl' needs 2 GPU\(s\).*backend='gloo'"):
        DeviceMesh.create((2,), backend="nccl")


def test_cluster_from_the_live_ray_cluster(ray_cluster):
    import ray

    from topology import Cluster

    cluster = Cluster.from_ray()
    assert cluster.num_hosts == len([n for n in ray.nodes() if n["Alive"]])
    assert cluster.backend == ("nccl" if ray.cluster_resources().get("GPU", 0) else "gloo")


def test_a_local_cluster_the_library_starts_keeps_rays_token_auth(tmp_path):
    """``DeviceMesh.create`` without a running Ray starts one with Ray's default token auth (never
    turned off); a fresh interpreter with its own home, so its token is its own."""
    import os
    import subprocess
    import sys

    code = (
        "import os, ray\n"
        "from reshard.runtime.driver.mesh import ensure_ray\n"
        "from ray._raylet import AuthenticationMode, get_authentication_mode\n"
        "ensure_ray()\n"
        "try:\n"
        "    print('MODE', get_authentication_mode() == AuthenticationMode.TOKEN, os.environ.get('RAY_AUTH_MODE'))\n"
        "finally:\n"
        "    ray.shutdown()\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH") and k != "RAY_ADDRESS"}
    env["HOME"] = str(tmp_path)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "MODE True token" in done.stdout, done.stdout + done.stderr[-3000:]
    assert (tmp_path / ".ray" / "auth_token").stat().st_size > 0


def _skew_clock(ctx, seconds: float) -> None:
    """This device's wall clock runs ``seconds`` off (0: back to the real one)."""
    import time

    real = getattr(time, "_unskewed", time.time)
    time._unskewed = real
    time.time = real if seconds == 0 else (lambda: real() + seconds)


def test_devices_whose_clocks_are_hours_off_keep_the_callers_timeout(view):
    """Deadlines travel as budgets measured on each host: a device whose wall clock is an hour
    ahead or behind neither drops a call as late nor waits past the caller's timeout."""
    a, b = view([0, 1], (2,)), view([2, 3], (2,))
    x = random_array((32, 8), "float32", 7)
    out = distribute(np.zeros_like(x), Layout(b, (Shard(1),)))
    b.call(_skew_clock, 3600.0, devices=[0])
    b.call(_skew_clock, -3600.0, devices=[1])
    try:
        t = distribute(x, Layout(a, (Shard(0),)), timeout_s=30)
        for shared_memory in (True, False):
            y = reshard(t, a, Layout(b, (Replicate(),)), shared_memory=shared_memory, timeout_s=30)
            assert_bit_exact(y.to_numpy(), x)
            reshard(t, a, Layout(b, (Shard(1),)), out=out, shared_memory=shared_memory, timeout_s=30)
            assert_bit_exact(out.to_numpy(), x)
            out = distribute(np.zeros_like(x), Layout(b, (Shard(1),)))
        assert b.call(lambda ctx: 1, timeout_s=30) == [1, 1]
    finally:
        b.call(_skew_clock, 0.0)


@ray.remote(num_cpus=0)
class _FreshProcess:
    """A process that never saw the destination mesh: only a Layout over it arrives."""

    def move(self, x, layout) -> tuple[bool, np.ndarray]:
        knew = runtime().registry.local_mesh(layout.mesh)[0] != []
        y = reshard(x, x.mesh, layout)
        got = y.to_numpy()
        y.free()
        return knew, got


def test_a_layout_alone_finds_its_mesh_through_the_jobs_directory(view):
    a, b = view([0, 1], (2,)), view([4, 5, 6], (3,))
    x = random_array((12, 6), "float32", 11)
    t = distribute(x, Layout(a, (Shard(0),)))
    there = _FreshProcess.remote()
    try:
        knew, got = ray.get(there.move.remote(t, Layout(b, (Shard(1),))), timeout=120)
    finally:
        ray.kill(there)
    assert not knew  # resolved from the directory's entry, not from a handle that came along
    assert_bit_exact(got, x)


class _Runs:
    """Unpickled, it creates ``path``: the proof that an entry's pickle ran."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def test_directory_entries_that_are_not_this_jobs_data_are_refused_and_never_run(tmp_path):
    """Whatever a process with the cluster's token writes under a mesh's key is read as data:
    a pickle, a pickled object in a device's handle, an entry of another job: each is refused by
    name, and nothing in it runs."""
    import pickle

    import msgpack

    from reshard.errors import MeshClosed
    from reshard.runtime.driver import directory
    from reshard.runtime.driver.device_registry import Session
    from topology import Mesh
    from topology.runtime import publish

    mesh = Mesh((2,), (900001, 900002), (77, 77))  # no such devices: only the directory knows it
    session = Session.current()
    marker = tmp_path / "ran"
    record = {"id": 900001, "actor": pickle.dumps(_Runs(marker)), "session": [session.name, session.job]}
    entry = {
        "format": directory.FORMAT, "session": [session.name, session.job], "backend": "gloo",
        "mesh": [[2], [900001, 900002], [77, 77], None], "backend_state": None, "devices": [record, record],
    }
    other_job = dict(entry, session=[session.name, "ffffffff"])
    forged = {
        "is not msgpack": pickle.dumps(_Runs(marker)),
        r"names \w+\.open; only Ray actor handles are read": msgpack.packb(entry),
        "written by another session or job": msgpack.packb(other_job),
    }
    for says, blob in forged.items():
        publish(directory._key(mesh, session), blob)
        with pytest.raises(MeshClosed, match=says):
            distribute(np.zeros(4, np.float32), Layout(mesh, (Shard(0),)), timeout_s=10)
        assert not marker.exists()


@ray.remote(num_cpus=0)
class _Pusher:
    """A trainer's process: pushes a state dict into tensors it does not own, then dies."""

    def push(self, tree, src_mesh, layouts, out) -> bool:
        reshard(tree, src_mesh, layouts, out=out, shared_memory=False)  # gloo: communicators, staging
        return True

    def ping(self) -> None:
        pass


def _wait_dead(ping) -> None:
    """Until the killed actor's ``ping`` fails (``ray.kill`` is asynchronous: a call may still run)."""
    give_up = time.monotonic() + 60
    while True:
        try:
            ray.get(ping.remote(), timeout=60)
        except ray.exceptions.RayActorError:
            return
        assert time.monotonic() < give_up, "the killed actor still answers"


def _kept(ctx) -> dict:
    import os

    return {
        "controllers": sorted(ctx.controllers),
        "callers": ctx.inbox.known(),
        "groups": sum(len(s.groups) for s in ctx.controllers.values()),
        "staging": sum(s.staging.nbytes for s in ctx.controllers.values()),
        "store_connections": len(ctx.backend._clients),
        "fds": len(os.listdir("/proc/self/fd")),
    }


def _check_callers_now(ctx) -> dict:
    return ctx.check_callers(idle_s=0.0)


def test_what_devices_kept_for_processes_that_ended_is_freed(view):
    """Three short-lived processes each push a state dict with ``out=``; once they are killed,
    each device frees their communicators, staging, programs, call order and store connections
    (they ran on this machine: their pids are gone), and the driver goes on. A live caller that went idle only
    gives back its staging."""
    a, b = view([0, 1], (2,)), view([2, 3], (2,))
    both = DeviceMesh.from_devices([*a.device_ids, *b.device_ids], (4,))
    sd = {"w": random_array((64, 48), "float32", 21), "b": random_array((48,), "float32", 22)}
    src = distribute(sd, Layout(a, (Shard(0),)))
    layouts = {"w": Layout(b, (Shard(1),)), "b": Layout(b, (Replicate(),))}
    out = distribute({k: np.zeros_like(v) for k, v in sd.items()}, layouts)
    reshard(src, a, layouts, out=out, shared_memory=False)
    before = both.call(_kept)
    pushers = [_Pusher.remote() for _ in range(3)]
    for p in pushers:
        assert ray.get(p.push.remote(src, a, layouts, out), timeout=120)
    during = both.call(_kept)
    for p, (was, now) in enumerate(zip(before, during, strict=True)):
        assert len(set(now["controllers"]) - set(was["controllers"])) == 3, (p, was, now)
        assert now["groups"] > was["groups"] and now["fds"] > was["fds"], (p, was, now)
    for p in pushers:
        ray.kill(p)
        _wait_dead(p.ping)
    me, forgotten = runtime().id, [set() for _ in before]
    give_up = time.monotonic() + 120
    while True:  # until every device learned from Ray that the three owners died (seconds after)
        for seen, done in zip(forgotten, both.call(_check_callers_now), strict=True):
            seen.update(done["forgotten"])
        after = both.call(_kept)
        if all(set(now["controllers"]) <= set(was["controllers"]) for was, now in zip(before, after, strict=True)):
            break
        assert time.monotonic() < give_up, (before, after)
    for was, busy, now, seen in zip(before, during, after, forgotten, strict=True):
        assert me not in seen and me in now["controllers"] and now["callers"] <= was["callers"], (was, now, seen)
        assert now["groups"] <= was["groups"] and now["store_connections"] <= was["store_connections"], (was, now)
        assert now["fds"] < busy["fds"], (busy, now)  # Ray keeps a few of its own to the dead processes
    fresh = distribute({k: np.zeros_like(v) for k, v in sd.items()}, layouts)
    reshard(src, a, layouts, out=fresh, shared_memory=False)  # the driver's state is what it was
    for k in sd:
        assert_bit_exact(fresh[k].to_numpy(), sd[k])

    idle = _Pusher.remote()  # a live caller that went idle: its staging is given back, nothing else
    try:
        assert ray.get(idle.push.remote(src, a, layouts, out), timeout=120)
        held = both.call(_kept)
        both.call(_check_callers_now)
        trimmed = both.call(_kept)
        for was, now in zip(held, trimmed, strict=True):
            assert now["controllers"] == was["controllers"] and now["groups"] == was["groups"], (was, now)
            assert now["staging"] < was["staging"], (was, now)
        fresh = distribute({k: np.zeros_like(v) for k, v in sd.items()}, layouts)
        assert ray.get(idle.push.remote(src, a, layouts, fresh), timeout=120)  # its state still works
        for k in sd:
            assert_bit_exact(fresh[k].to_numpy(), sd[k])
    finally:
        ray.kill(idle)


def test_claims_cost_a_few_store_calls_and_closed_views_leave_no_entry(pool, monkeypatch):
    """Host and device-id numbers are claimed in O(1) store calls however many were claimed
    before (a view with logical hosts claims new ones each time); a view's directory entry goes
    when it closes."""
    import uuid

    from reshard.runtime.driver import directory
    from reshard.runtime.driver.device_registry import Session
    from topology import runtime as topo

    real, calls = topo._kv(), []

    class Counting:
        def __getattr__(self, name):
            def counted(*args, **kwargs):
                calls.append(name)
                return getattr(real, name)(*args, **kwargs)

            return counted

    monkeypatch.setattr(topo, "_kv", Counting)
    kind = f"claims-{uuid.uuid4().hex[:8]}"
    assert [topo.claim(kind, "x") for _ in range(200)] == list(range(200))
    assert len(calls) <= 3 * 200, len(calls)  # scanning from 0 would cost 20,100 puts

    v = DeviceMesh.from_devices(pool.device_ids[:2], (2,), devices_per_host=1)  # fresh logical hosts
    key = directory._key(v.mesh, Session.current())
    assert topo.lookup(key) is not None
    v.shutdown()
    assert topo.lookup(key) is None


@ray.remote(num_cpus=0)
class _Holder:
    """A process holding a tensor of its own and a copy of the driver's."""

    def hold(self, mesh, copy) -> tuple[str, str]:
        self.own = distribute(np.arange(8, dtype=np.float32), Layout(mesh, (Shard(0),)))
        self.copy = copy
        settle(mesh)  # its holds are on the devices
        return self.own.name, self.copy._holder

    def ping(self) -> None:
        pass


def _holders(ctx) -> dict:
    return {name: sorted(held) for name, held in ctx.store.holders.items()}


def test_the_handles_of_a_process_that_ended_let_go_of_their_shards(view):
    """Killed, a process's handles can never release what they hold; once the devices learn it
    ended, its own tensor's shards go and its copy's hold on the driver's tensor goes, which
    stays the driver's."""
    m = view([0, 1], (2,))
    x = random_array((8, 4), "float32", 31)
    mine = distribute(x, Layout(m, (Shard(0),)))
    holder = _Holder.remote()
    own, copy_holder = ray.get(holder.hold.remote(m, mine), timeout=120)
    for held in m.call(_holders):
        assert own in held and copy_holder in held[mine.name], held
    ray.kill(holder)
    _wait_dead(holder.ping)
    give_up = time.monotonic() + 120
    while any(own in held for held in m.call(_holders)):  # until the devices learned it ended
        m.call(_check_callers_now)
        assert time.monotonic() < give_up
    for held in m.call(_holders):
        assert held[mine.name] == [mine.name], held  # the driver's own hold, and no other
    assert_bit_exact(mine.to_numpy(), x)


@ray.remote(num_cpus=0)
def _controllers_seen(mesh, tensor):
    """In a task: the controller the unpickled mesh and tensor reach, and this process's own."""
    return mesh.runtime.id, tensor.mesh.runtime.id, runtime().id


def test_a_mesh_holds_the_controller_of_the_process_it_lives_in(view):
    """Handles reach their controller through their mesh: the process's own, and in another process
    (a pickled handle) that process's, which orders the calls made there."""
    a = view([0, 1], (2,))
    t = distribute(random_array((4, 4), "float32", 3), Layout(a, pl("S0")))
    assert a.runtime is runtime() and t.mesh.runtime is runtime()
    mesh_there, tensor_there, own_there = ray.get(_controllers_seen.remote(a, t))
    assert mesh_there == tensor_there == own_there != runtime().id
