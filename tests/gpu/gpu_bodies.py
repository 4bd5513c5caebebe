"""Functions the GPU tests run inside rank actors (``RankSet.call``): ``fn(actor, *args)`` with
``actor.backend`` (an NcclBackend) and ``actor.device``. conftest.py registers this module with
Ray's cloudpickle by value, so the workers need not import it."""

from __future__ import annotations

import os
import time

import numpy as np


def environment(actor) -> dict:
    import torch

    uuids = [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
    keys = ("NCCL_HOSTID", "NCCL_COMM_BLOCKING", "NCCL_MULTI_RANK_GPU_ENABLE", "NCCL_SOCKET_IFNAME")
    return {"uuids": uuids, "pid": os.getpid(), **{k: os.environ.get(k) for k in keys}}


def reserved_gpu_bytes(ctx) -> int:
    """What cupy's memory pool holds on this device actor's GPU (``DeviceMesh.call``): where the
    runtime's shards live."""
    import cupy

    with cupy.cuda.Device(ctx.cuda_device):
        return int(cupy.get_default_memory_pool().total_bytes())


def lonely_recv(actor, group, seconds: float):
    """A recv that no member ever sends: must time out and abort (and tell the others)."""
    import cupy

    comm = actor.backend.communicator(group)
    peer = 1 - group.index(actor.device) if len(group) == 2 else 0
    try:
        with actor.backend.grouped(timeout_s=seconds):
            comm.recv(cupy.zeros(1 << 20, dtype=cupy.float32), peer)
    except Exception as e:
        return type(e).__name__, comm.aborted
    return "completed", comm.aborted


def told_of_abort(actor, group, timeout_s: float):
    """Wait for another member's abort notice, then show that the next operation fails at once."""
    import cupy

    from reshard.runtime.backends.nccl import peer_aborts

    comm = actor.backend.communicator(group)
    heard = peer_aborts().wait(comm.uid, timeout_s)
    try:
        comm.broadcast(cupy.zeros(8, dtype=cupy.float32), 0)
    except Exception as e:
        return type(e).__name__, heard
    return "completed", heard


def abort_group(actor, group):
    actor.backend.communicator(group).abort()
    return True


def blocked_recv(actor, group, peer: int, seconds: float):
    """A recv with a long deadline; returns how it ended."""
    import cupy

    comm = actor.backend.communicator(group)
    try:
        comm.recv(cupy.zeros(1 << 20, dtype=cupy.float32), peer)
    except Exception as e:
        return type(e).__name__
    return "completed"


def aborted_from_another_thread(actor, group, peer: int, seconds: float):
    """A recv that no member answers runs on a thread of this actor, holding the backend while it
    polls; the calling thread then aborts the communicator, as a controller's abort does from the
    actor's control thread. Returns how the recv ended and what it said."""
    import threading

    import cupy

    comm = actor.backend.communicator(group)
    comm.timeout_s = seconds  # the recv would wait this long without the abort
    polled = actor.backend.stats["batches"]
    outcome = {}

    def recv():
        try:
            comm.recv(cupy.zeros(1 << 20, dtype=cupy.float32), peer)
            outcome["end"] = ("completed", "")
        except Exception as e:
            outcome["end"] = (type(e).__name__, str(e))

    t = threading.Thread(target=recv)
    t.start()
    while actor.backend.stats["batches"] == polled and t.is_alive():  # until the recv polls
        time.sleep(1e-3)
    comm.abort()
    t.join(seconds)
    return outcome.get("end", ("still running", "")), comm.aborted


def two_channels(actor, rdvs, timeout_s: float):
    """Two communicators of one group (two rendezvous, as two channels make): both work, and closing
    one leaves the other working. Returns what each broadcast delivered and the channels' states."""
    import cupy

    first, second = actor.backend.connect_many(list(rdvs), actor.device, timeout_s)
    got = []
    for comm in (first, second, first):
        x = cupy.full(16, 10 * (comm is first) + 20 * (comm is second) + actor.device, dtype=cupy.int32)
        comm.broadcast(x, 0)
        got.append(int(x[0]))
        if comm is second:
            second.close()
    return got, first.closed, second.closed, first is second


def try_connect(actor, rdvs, timeout_s: float):
    """Create this device's communicators of ``rdvs``; the error's class name if that fails."""
    from reshard.runtime.backends.nccl import bootstrap_root_threads

    mine = [r for r in rdvs if actor.device in r.group]
    try:
        actor.backend.connect_many(mine, actor.device, timeout_s)
        kind = "connected"
    except Exception as e:
        kind = type(e).__name__
    return kind, sorted(actor.backend.live_groups()), bootstrap_root_threads()


def exchange_bits(actor, group, dtype_name: str, seed: int):
    """Every rank broadcasts its random tensor (all bit patterns) from its rank in turn; returns
    what arrived as raw bytes, and the all-reduce of the ranks' device ids."""
    import torch

    comm = actor.backend.communicator(group)
    dtype = getattr(torch, dtype_name)
    out = []
    for root in range(len(group)):
        g = torch.Generator().manual_seed(seed + root)
        raw = torch.randint(0, 256, (4097 * 8,), dtype=torch.uint8, generator=g)
        x = (raw % 2).bool() if dtype is torch.bool else raw.view(dtype)
        buf = x.cuda() if group.index(actor.device) == root else torch.empty_like(x, device="cuda")
        comm.broadcast(buf, root)
        out.append(buf.cpu().view(torch.uint8).numpy().tobytes())
    s = torch.full((1000,), actor.device + 1, dtype=torch.int64, device="cuda")
    comm.all_reduce(s, "sum")
    return out, int(s[0])


def send_after_long_kernel(actor, group, peer: int, n: int):
    """Write the buffer behind ~0.5 s of GPU sleep on a side stream, then send it."""
    import torch

    comm = actor.backend.communicator(group)
    a = torch.zeros(n, device="cuda", dtype=torch.int32)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    written = torch.cuda.Event()
    with torch.cuda.stream(side):
        torch.cuda._sleep(1_000_000_000)
        a.fill_(7)
        written.record(side)
        pending = not written.query()
        comm.send(a, peer)
    return pending


def recv_values(actor, group, peer: int, n: int):
    import torch

    comm = actor.backend.communicator(group)
    b = torch.full((n,), -1, device="cuda", dtype=torch.int32)
    comm.recv(b, peer)
    return sorted(set(b.cpu().tolist()))


# -- CUDA IPC (tests/gpu/test_cuda_ipc.py): run through ``DeviceMesh.call`` on device contexts


def ipc_allocate(ctx, name: str, n: int, value: float):
    """A shard of ``n`` float32 ``value``s in this device's IPC memory; its descriptor."""
    import cupy

    t = ctx.store.allocate((n,), "float32")
    t[...] = value
    cupy.cuda.Device(ctx.cuda_device).synchronize()
    ctx.store.put(name, t, "test", "float32")
    return ctx.store.descriptor(t)


def ipc_pull(ctx, holder: int, desc):
    """Device ``holder``'s shard ``desc`` copied here through CUDA IPC, tenure-checked after."""
    view = ctx.peers.get(holder, desc, np.dtype(np.float32))
    out = view.copy().get()
    ctx.peers.check(holder, desc)
    return out


def ipc_free(ctx, name: str) -> None:
    ctx.store.free(name)


def ipc_opened(ctx) -> int:
    return len(ctx.peers.maps)


def ipc_limit(ctx, blocks: int) -> tuple[int, int]:
    """Keep at most ``blocks`` peer blocks open here; returns the blocks open and retired now."""
    ctx.peers.limit = blocks
    return ipc_counts(ctx)


def ipc_counts(ctx) -> tuple[int, int]:
    """Peer blocks open here: kept, and retired past the limit (closed once no run reads them)."""
    return len(ctx.peers.maps), len(ctx.peers.retired)


def ipc_recent(ctx) -> int:
    """Sets of pulled shards kept viewed here for the next runs that pull the same."""
    return len(ctx.peers.recent)


def kernel_commits(ctx) -> int:
    """Commits of a run into users' tensors that copied every result by one kernel."""
    return ctx.counters.get("kernel_commits", 0)


def slow_every_op(ctx, seconds: float) -> None:
    """Before every op of this device's runs, a kernel keeps the run's stream busy for
    ``seconds``: whatever a run queues lands late, so a call that returned before its stream got
    there would hand out old bytes."""

    def hook(run, op):
        _hold(seconds)

    ctx.before_op = hook


def slow_streams(ctx, op_s: float, side_s: float) -> None:
    """Before every op of this device's runs the run's stream is kept busy for ``op_s``, and before
    every copy a run queues on its side stream (a window packed ahead, or unpacked behind) that
    stream for ``side_s``; ``side_copies(ctx)`` counts those. A stream that got ahead of the other
    where an event should hold it would copy or send the wrong bytes."""
    ctx.counters["side_copies"] = 0

    def hook(run, op):
        side = isinstance(op, tuple)
        ctx.counters["side_copies"] += side
        _hold(side_s if side else op_s)

    ctx.before_op = hook


def side_copies(ctx) -> int:
    return ctx.counters.get("side_copies", 0)


def fail_at_bucket(ctx, index: int, side_s: float) -> None:
    """This device's next run raises before its bucket number ``index`` (from 0), and keeps its
    side stream busy for ``side_s`` before every copy there."""
    import itertools

    count = itertools.count()

    def hook(run, op):
        if isinstance(op, tuple):
            _hold(side_s)
        elif next(count) == index:
            ctx.before_op = None
            raise RuntimeError("injected failure between windows")

    ctx.before_op = hook


def side_streams_idle(ctx) -> list[bool]:
    """Whether each side stream of this device's callers has done all that was queued on it."""
    import cupy

    sides = [s.stream._side for s in ctx.controllers.values() if s.stream._side is not None]
    return [cupy.cuda.runtime.streamQuery(s.ptr) == 0 for s in sides]


def shard_bytes(ctx, names: list) -> list:
    """This device's shards ``names`` copied to the host on this thread's stream (the legacy default
    stream, which a run's non-blocking streams do not wait for), all in one call."""
    import cupy

    return [cupy.asnumpy(ctx.store.get(n)) for n in names]


def no_hook(ctx) -> None:
    ctx.before_op = None


def _hold(seconds: float) -> None:
    """The current stream kept busy for ``seconds`` (the stand-in's sleep, or a spinning kernel)."""
    import cupy

    if not seconds:
        return
    if getattr(cupy, "_standin", False):
        from cupy import _control

        _control.sleep(seconds)
    else:
        _spin(seconds)


def _spin(seconds: float) -> None:
    """A GPU kernel that spins ``seconds`` on the current stream."""
    import cupy

    kernel = cupy.RawKernel(
        r"""extern "C" __global__ void spin(long long ns) {
            long long start = clock64(); (void)start;
            for (long long t = 0; t < ns; t += 1000) __nanosleep(1000);
        }""",
        "spin",
    )
    kernel((1,), (1,), (np.int64(int(seconds * 1e9)),))


# -- a tensor-parallel pipeline on NCCL device actors (tests/gpu/test_nccl_pipeline.py), the model of
# tests/dist/test_pipeline.py with its parameters on each device's own torch device

PIPE_M, PIPE_D_IN, PIPE_H, PIPE_F, PIPE_C = 4, 6, 8, 12, 3


def pipe_params(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    d, h, f, c = PIPE_D_IN, PIPE_H, PIPE_F, PIPE_C
    shapes = {"w0": (d, h), "b0": (h,), "w1": (h, f), "b1": (f,), "w2": (f, h), "b2": (h,), "w3": (h, c), "b3": (c,)}
    return {k: rng.standard_normal(s) * 0.5 for k, s in shapes.items()}


def _param(ctx, a):
    import torch

    return torch.tensor(a, dtype=torch.float64, device=ctx.torch_device, requires_grad=True)


def pipe_setup0(ctx, p=None):
    return {"w0": _param(ctx, p["w0"]), "b0": _param(ctx, p["b0"])}


def pipe_forward0(ctx, x):
    import torch

    return torch.tanh(x @ ctx.state["w0"] + ctx.state["b0"])


def pipe_setup1(ctx, p=None):
    c, half = ctx.coords[1], PIPE_F // 2
    return {
        "w1": _param(ctx, p["w1"][:, c * half : (c + 1) * half]),
        "b1": _param(ctx, p["b1"][c * half : (c + 1) * half]),
        "w2": _param(ctx, p["w2"][c * half : (c + 1) * half, :]),
        "b2": _param(ctx, p["b2"]),
    }


def pipe_forward1(ctx, x):
    import torch

    s = ctx.state
    x = ctx.copy_to_tp(x)
    h = torch.tanh(x @ s["w1"] + s["b1"])
    return ctx.reduce_from_tp(h @ s["w2"]) + s["b2"]


def pipe_setup2(ctx, p=None):
    return {"w3": _param(ctx, p["w3"]), "b3": _param(ctx, p["b3"])}


def pipe_forward2(ctx, x):
    out = x @ ctx.state["w3"] + ctx.state["b3"]
    return ((out - ctx.target) ** 2).sum()


def pipe_grads(ctx, reduce_axis=None):
    out = {}
    for name, p in ctx.state.items():
        g = p.grad.detach().clone()
        if reduce_axis is not None:
            g = ctx.all_reduce(g, axis=reduce_axis)
        out[name] = g.cpu().numpy()
        p.grad = None
    return out


def share_device_array(ctx, name: str, n: int) -> None:
    """The user's own device memory (``arange(n)``, float32) shared as shard ``name``."""
    import cupy

    ctx.share(name, cupy.arange(n, dtype=cupy.float32))
