"""``python -m bench gpu``: the GPU data plane, measured on whatever GPUs the machine has (one is
enough), every result checked bit for bit, beside the device's ceilings and the peers a GPU user
would pick. One JSON with the GPU, its driver and every version (``bench/results/gpu-*.json``).

Parts, in order (each in its own process where NCCL's once-per-process settings would mix):
  copy     the device's copy peak: torch ``copy_`` of 1 GiB device to device, CUDA events (tensor
           bytes per second; a copy reads and writes each byte).
  message  the fixed cost of one message through the backend (a 256-byte broadcast on a 1-rank
           communicator, issued and waited for) against raw NCCL's through cupy on the same call
           (issued, then ``cudaStreamSynchronize``); and per message of a batch of 64 issued as
           one group and waited for once.
  tensor   one bfloat16 tensor from 1 MiB up, between two meshes of device actors sharing the
           GPU: pulled through CUDA IPC (fresh output, and ``out=`` with ``direct=True``), and
           the same through NCCL where the GPU is shared over sockets (``shared_memory=False``).
  model    Qwen3-0.6B's bfloat16 state dict (311 tensors, its real shapes, 1.19 GB) from a trainer
           mesh to an inference mesh on the same GPU (whole model on one actor each; and FSDP
           over 2 actors to 2-way tensor parallel), against one tensor of the same bytes laid out
           alike, and against two refits users write: each tensor's CUDA IPC handle through Ray
           and a copy at the receiver (colocated weight sync as verl and slime do), and a
           torch.distributed NCCL broadcast of every tensor from the trainer (a gather-and-broadcast
           refit; two ranks on one GPU talk over sockets).
  windows  the same state dict whole -> whole through NCCL messages (``shared_memory=False``: its
           64 MiB buckets, in windows of at most 256 MiB), with the NCCL target's windows
           double-buffered (packed and unpacked on a side stream beside another window's
           messages) and not, round by round in one run.

Every timing is a median of ``--repeats`` after one untimed run. A result on the CPU stand-in is not
a GPU result; this bench refuses to run there.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.provenance import revision

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

ROOT = Path(__file__).resolve().parent
MiB = 1 << 20
CALL_S = 600.0  # a device call making a model's tensors (18,432 of them for the MoE case)
GiB = 1 << 30
COLS = 1024  # a tensor of n bytes is bfloat16 (n / 2048) x 1024

#: Qwen3-0.6B: hidden 1024, 16 query and 8 key/value heads of 128, MLP 3072, vocab 151936, 28
#: layers, tied embeddings; tensor-parallel dims as Megatron splits them (None: replicated).
#: The stand-in checks the script's logic, not speed: one layer and a small vocabulary of the model.
DRY_RUN_LAYERS, DRY_RUN_VOCAB = 1, 4096
QWEN3 = {"hidden": 1024, "heads": 16, "kv_heads": 8, "head_dim": 128, "mlp": 3072, "vocab": 151936, "layers": 28}


def qwen3_spec(
    layers: int | None = None, vocab: int | None = None, config: dict = QWEN3
) -> list[tuple[str, tuple[int, ...], int | None]]:
    """The state dict of a Qwen3 model of ``config`` (``QWEN3``'s keys): name, shape, tensor-parallel dim."""
    c = config if vocab is None else {**config, "vocab": vocab}
    hidden, hd, mlp = c["hidden"], c["head_dim"], c["mlp"]
    q, kv = c["heads"] * hd, c["kv_heads"] * hd
    spec: list[tuple[str, tuple[int, ...], int | None]] = [("model.embed_tokens.weight", (c["vocab"], hidden), 0)]
    for i in range(c["layers"] if layers is None else layers):
        p = f"model.layers.{i}."
        spec += [
            (p + "self_attn.q_proj.weight", (q, hidden), 0),
            (p + "self_attn.k_proj.weight", (kv, hidden), 0),
            (p + "self_attn.v_proj.weight", (kv, hidden), 0),
            (p + "self_attn.o_proj.weight", (hidden, q), 1),
            (p + "self_attn.q_norm.weight", (hd,), None),
            (p + "self_attn.k_norm.weight", (hd,), None),
            (p + "mlp.gate_proj.weight", (mlp, hidden), 0),
            (p + "mlp.up_proj.weight", (mlp, hidden), 0),
            (p + "mlp.down_proj.weight", (hidden, mlp), 1),
            (p + "input_layernorm.weight", (hidden,), None),
            (p + "post_attention_layernorm.weight", (hidden,), None),
        ]
    spec += [("model.norm.weight", (hidden,), None), ("lm_head.weight", (c["vocab"], hidden), 0)]
    return spec


def moe_spec(layers: int = 48, experts: int = 128) -> list[tuple[str, tuple[int, ...], int | None]]:
    """A mixture-of-experts model's expert weights as a state dict names them (Qwen3-30B-A3B's count:
    48 layers of 128 experts, gate, up and down each: 18,432 tensors), each 64 x 256 (small, so
    that the count, not the bytes, decides)."""
    spec: list[tuple[str, tuple[int, ...], int | None]] = []
    for layer in range(layers):
        for e in range(experts):
            p = f"model.layers.{layer}.mlp.experts.{e}."
            spec += [
                (p + "gate_proj.weight", (64, 256), 0),
                (p + "up_proj.weight", (64, 256), 0),
                (p + "down_proj.weight", (256, 64), 1),
            ]
    return spec


# ------------------------------------------------------------------------------------------------
# what runs on device actors (``DeviceMesh.call``) and in the peers' actors


def make_shards(ctx, names_shapes, seed: int) -> list:
    """bfloat16 tensors of pseudo-random bits in this device's memory (``ctx.empty``: peers on its
    GPU pull them), shared under their names; returns a checksum of each."""
    import cupy

    out = []
    for i, (name, shape) in enumerate(names_shapes):
        t = ctx.empty(shape, "bfloat16")
        bits = cupy.from_dlpack(t.view(__import__("torch").int16)).reshape(-1)
        for lo in range(0, bits.size, CHUNK):
            n = min(CHUNK, bits.size - lo)
            idx = cupy.arange(lo, lo + n, dtype=cupy.uint64)
            bits[lo : lo + n] = ((idx * 2654435761 + (seed * 7919 + i)) >> 11).astype(cupy.uint16).view(cupy.int16)
        ctx.share(name, t)
        out.append(checksum(bits))
    return out


def checksums_of(ctx, names) -> list:
    import cupy

    return [checksum(cupy.from_dlpack(ctx.local(n).view(__import__("torch").int16)).reshape(-1)) for n in names]


CHUNK = 1 << 26  # elements per step of a fill or a checksum (bounded temporaries)


def checksum(bits) -> int:
    """A position-weighted sum of int16 bits (catches a wrong, missing or moved element)."""
    import cupy

    total = 0
    for lo in range(0, bits.size, CHUNK):
        n = min(CHUNK, bits.size - lo)
        weights = cupy.arange(lo, lo + n, dtype=cupy.int64) % 1009 + 1
        total += int((bits[lo : lo + n].astype(cupy.int64) * weights).sum())
    return total


def unshare_all(ctx) -> None:
    for name in list(ctx.store.users):
        ctx.unshare(name)


class TorchPeer:
    """One process of a refit users write (module docstring): holds bfloat16 tensors of the shapes
    given, and moves them by CUDA IPC handles or by a torch.distributed broadcast."""

    def __init__(self, shapes, seed: int, fill: bool):
        import cupy
        import torch

        torch.cuda.set_device(0)
        self.tensors = []
        for i, shape in enumerate(shapes):
            t = torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
            if fill:  # the bits make_shards gives the same shapes and seed
                bits = cupy.from_dlpack(t.view(torch.int16)).reshape(-1)
                idx = cupy.arange(bits.size, dtype=cupy.uint64)
                bits[...] = ((idx * 2654435761 + (seed * 7919 + i)) >> 11).astype(cupy.uint16).view(cupy.int16)
            self.tensors.append(t)
        torch.cuda.synchronize()

    def checksums(self) -> list:
        import cupy
        import torch

        return [checksum(cupy.from_dlpack(t.view(torch.int16)).reshape(-1)) for t in self.tensors]

    def handles(self) -> list:
        """Each tensor's CUDA IPC handle (torch's reduction, as ``torch.multiprocessing`` sends it)."""
        from torch.multiprocessing.reductions import reduce_tensor

        return [reduce_tensor(t) for t in self.tensors]

    def load(self, handles) -> float:
        """Open every handle and copy the tensor into this peer's own (a colocated refit's receiver)."""
        import torch

        t0 = time.perf_counter()
        for (rebuild, args), mine in zip(handles, self.tensors, strict=True):
            mine.copy_(rebuild(*args))
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def init_group(self, rank: int, port: int) -> None:
        import torch.distributed as dist

        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        self.broadcast_all()  # connects

    def broadcast_all(self) -> float:
        import torch
        import torch.distributed as dist

        t0 = time.perf_counter()
        for t in self.tensors:
            dist.broadcast(t, src=0)
        torch.cuda.synchronize()
        return time.perf_counter() - t0


# ------------------------------------------------------------------------------------------------
# parts


def part_copy(repeats: int) -> dict:
    import torch

    out = {}
    for nbytes in (256 * MiB, GiB):
        a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        b = torch.empty_like(a)
        b.copy_(a)
        times = []
        for _ in range(max(repeats, 10)):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            b.copy_(a)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        s = statistics.median(times)
        out[str(nbytes)] = {"seconds": s, "GBps": nbytes / s / 1e9}
        del a, b
        torch.cuda.empty_cache()
    return {"copy_peak_GBps": max(v["GBps"] for v in out.values()), "sizes": out}


def part_message_raw(n: int) -> dict:
    import cupy
    from cupy.cuda import nccl

    comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    buf = cupy.zeros(256, dtype=cupy.uint8)
    stream = cupy.cuda.Stream(non_blocking=True)

    def one():
        comm.bcast(buf.data.ptr, 256, nccl.NCCL_UINT8, 0, stream.ptr)

    for _ in range(50):
        one()
        stream.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        one()
        stream.synchronize()
    each = (time.perf_counter() - t0) / n
    t0 = time.perf_counter()
    for _ in range(n // 64):
        nccl.groupStart()
        for _ in range(64):
            one()
        nccl.groupEnd()
        stream.synchronize()
    batched = (time.perf_counter() - t0) / (n // 64 * 64)
    return {"per_message_us": each * 1e6, "per_message_in_group_of_64_us": batched * 1e6}


def part_message_ours(n: int) -> dict:
    import cupy

    from reshard.runtime.backends.nccl import NcclBackend

    backend = NcclBackend()
    backend.setup_actor(0, 0)
    (comm,) = backend.connect_many(backend.local_rendezvous([(0,)]), 0, 60)
    buf = cupy.zeros(256, dtype=cupy.uint8)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        for _ in range(50):
            comm.broadcast(buf, 0)
        t0 = time.perf_counter()
        for _ in range(n):
            comm.broadcast(buf, 0)
        each = (time.perf_counter() - t0) / n
        t0 = time.perf_counter()
        for _ in range(n // 64):
            with backend.grouped(timeout_s=60, wait=False):
                for _ in range(64):
                    comm.broadcast(buf, 0)
            backend.synchronize(time.monotonic() + 60)
        batched = (time.perf_counter() - t0) / (n // 64 * 64)
    backend.close()
    return {"per_message_us": each * 1e6, "per_message_in_group_of_64_us": batched * 1e6}


def _timed(fn, repeats: int, after=None) -> list[float]:
    fn_result = fn()
    if after is not None:
        after(fn_result)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
        if after is not None:
            after(result)
    return times


def _split(fn) -> dict:
    """Where one call's time goes: its wall time here, the longest device call (the actor's whole
    call) and the longest program run inside it (``RunResult``)."""
    from reshard.runtime import runtime

    t0 = time.perf_counter()
    result = fn()
    wall = time.perf_counter() - t0
    last = runtime().batches.last_run or {}
    _free(result)
    return {
        "wall_s": wall,
        "device_call_s": max((r.run_s for r in last.values()), default=0.0),
        "program_s": max((r.elapsed_s for r in last.values()), default=0.0),
    }


def _free(result) -> None:
    from reshard import free

    free(result)  # a tree: one call per device


def part_tensor(pool, sizes: list[int], repeats: int, nccl_sizes: list[int]) -> list[dict]:
    from reshard import DeviceMesh, Layout, Replicate, adopt, reshard

    a = DeviceMesh.from_devices(pool.device_ids[:1], (1,))
    b = DeviceMesh.from_devices(pool.device_ids[1:2], (1,))
    rows = []
    for nbytes in sizes:
        shape = (nbytes // (2 * COLS), COLS)
        (sums,) = a.call(make_shards, [(f"x{nbytes}", shape)], 1)
        b.call(make_shards, [(f"y{nbytes}", shape)], 2)
        x = adopt(Layout(a, (Replicate(),)), f"x{nbytes}")
        out = adopt(Layout(b, (Replicate(),)), f"y{nbytes}")
        dst = Layout(b, (Replicate(),))
        row = {"bytes": nbytes}
        fresh = reshard(x, a, dst)
        row["bit_exact"] = b.call(checksums_of, [fresh.name]) == [sums]
        fresh.free()
        row["ipc_fresh_s"] = _timed(lambda: reshard(x, a, dst), repeats, _free)  # noqa: B023
        row["ipc_fresh_split"] = _split(lambda: reshard(x, a, dst))  # noqa: B023
        row["ipc_direct_s"] = _timed(lambda: reshard(x, a, dst, out=out, direct=True), repeats)  # noqa: B023
        row["bit_exact"] &= b.call(checksums_of, [out.name]) == [sums]
        row["ipc_out_s"] = _timed(lambda: reshard(x, a, dst, out=out), repeats)  # noqa: B023
        if nbytes in nccl_sizes:
            row["nccl_fresh_s"] = _timed(lambda: reshard(x, a, dst, shared_memory=False), repeats, _free)  # noqa: B023
        a.call(unshare_all)
        b.call(unshare_all)
        rows.append(row)
        fresh_ms, direct_ms = (statistics.median(row[k]) * 1e3 for k in ("ipc_fresh_s", "ipc_direct_s"))
        exact = row["bit_exact"]
        print(
            f"tensor {nbytes >> 20} MiB: ipc {fresh_ms:.2f} ms, direct {direct_ms:.2f} ms, bit-exact {exact}",
            flush=True,
        )
    return rows


def _tp_layout(mesh, dim):
    from reshard import Layout, Replicate, Shard

    return Layout(mesh, (Replicate(),) if dim is None else (Shard(dim),))


def part_model(
    pool, repeats: int, layers: int | None, peers: bool, moe: bool, rows: list, save, vocab: int | None = None
) -> None:
    """The model cases into ``rows``, saved after each (a part cut short keeps what it measured);
    ``layers`` and ``vocab``: of the Qwen3-shaped model, when not its own."""
    cases = [("whole-whole", (1,), (1,)), ("fsdp2-tp2", (2,), (2,))]
    spec = qwen3_spec(layers, vocab)
    rows += _model_cases(pool, repeats, "qwen3", spec, cases)
    save()
    if peers:
        rows[0]["peers"] = part_peers([s for _, s, _ in spec], repeats)
        save()
    if moe:
        rows += _model_cases(pool, repeats, "moe", moe_spec(4 if layers else 48), [("whole-whole", (1,), (1,))])
        save()


def _model_cases(pool, repeats: int, model: str, spec, cases) -> list[dict]:
    from reshard import DeviceMesh, Layout, Replicate, Shard, adopt, reshard

    shapes = [s for _, s, _ in spec]
    total = sum(2 * int(__import__("math").prod(s)) for s in shapes)
    one_shape = (total // (2 * COLS), COLS)
    rows = []
    for case, src_shape, dst_shape in cases:
        n_src, n_dst = src_shape[0], dst_shape[0]
        src = DeviceMesh.from_devices(pool.device_ids[:n_src], src_shape)
        dst = DeviceMesh.from_devices(pool.device_ids[2 : 2 + n_dst], dst_shape)
        names = {k: f"{model}/{case}/{k}" for k, _, _ in spec}
        if n_src == 1:
            (made,) = src.call(make_shards, [(names[k], s) for k, s, _ in spec], 3, timeout_s=CALL_S)
            src_layout = {k: Layout(src, (Replicate(),)) for k, _, _ in spec}
        else:  # FSDP: every tensor Shard(0) over the trainer's devices, each making its own shard
            for i in range(n_src):
                local = [(names[k], _chunk(s, 0, n_src, i)) for k, s, _ in spec]
                src.call(make_shards, local, 3 + i, devices=[i], timeout_s=CALL_S)
            src_layout = {k: Layout(src, (Shard(0),)) for k, _, _ in spec}
        tree = adopt(src_layout, names)
        dst_layout = {k: (Layout(dst, (Replicate(),)) if n_dst == 1 else _tp_layout(dst, d)) for k, _, d in spec}
        row: dict = {"model": model, "case": case, "tensors": len(spec), "bytes": total}
        first = time.perf_counter()
        y = reshard(tree, src, dst_layout)
        row["first_call_s"] = time.perf_counter() - first
        if n_src == n_dst == 1:  # the whole model landed bit for bit (the tests check the other layouts)
            row["bit_exact"] = dst.call(checksums_of, [y[k].name for k, _, _ in spec]) == [made]
        _free(y)
        row["ours_tree_s"] = _timed(lambda: reshard(tree, src, dst_layout), repeats, _free)  # noqa: B023
        row["ours_tree_split"] = _split(lambda: reshard(tree, src, dst_layout))  # noqa: B023
        # one tensor of the same bytes, laid out alike (sharded on dim 0 at the source, by columns at TP)
        if n_src == 1:
            src.call(make_shards, [(f"{model}/{case}/one", one_shape)], 5)
            one = adopt(Layout(src, (Replicate(),)), f"{model}/{case}/one")
        else:
            for i in range(n_src):
                src.call(make_shards, [(f"{model}/{case}/one", _chunk(one_shape, 0, n_src, i))], 5 + i, devices=[i])
            one = adopt(Layout(src, (Shard(0),)), f"{model}/{case}/one")
        one_dst = Layout(dst, (Replicate(),) if n_dst == 1 else (Shard(1),))
        row["ours_one_s"] = _timed(lambda: reshard(one, src, one_dst), repeats, _free)  # noqa: B023
        row["ours_one_split"] = _split(lambda: reshard(one, src, one_dst))  # noqa: B023
        src.call(unshare_all)
        rows.append(row)
        tree_ms, one_ms = (statistics.median(row[k]) * 1e3 for k in ("ours_tree_s", "ours_one_s"))
        print(
            f"model {model} {case} ({len(spec)} tensors): tree {tree_ms:.2f} ms, one tensor {one_ms:.2f} ms, "
            f"first call {row['first_call_s']:.2f} s",
            flush=True,
        )
    return rows


def part_windows(pool, repeats: int, layers: int | None, vocab: int | None) -> dict:
    """The ``windows`` part (module docstring): each way compiled and checked once, then timed in
    alternating rounds (``register_target`` replaces the NCCL target; the old one is put back)."""
    from dataclasses import replace

    from reshard import DeviceMesh, Layout, Replicate, adopt, reshard
    from reshard.ir.target import TARGETS, register_target
    from reshard.runtime import lowered_batch

    spec = qwen3_spec(layers, vocab)
    a = DeviceMesh.from_devices(pool.device_ids[:1], (1,))
    b = DeviceMesh.from_devices(pool.device_ids[1:2], (1,))
    names = {k: f"windows/{k}" for k, _, _ in spec}
    (made,) = a.call(make_shards, [(names[k], s) for k, s, _ in spec], 4, timeout_s=CALL_S)
    tree = adopt({k: Layout(a, (Replicate(),)) for k in names}, names)
    dst = {k: Layout(b, (Replicate(),)) for k in names}
    nccl = TARGETS["nccl"]
    ways = {"double": replace(nccl, double_buffer=True), "single": replace(nccl, double_buffer=False)}
    row: dict = {"tensors": len(spec), "bucket_bytes": nccl.bucket_bytes}

    def move():
        return reshard(tree, a, dst, shared_memory=False)

    try:
        for way, target in ways.items():
            register_target(target)
            program = lowered_batch(tree, a, dst, shared_memory=False).program.for_device(a.device_ids[0])
            row[f"{way}_windows"] = len(program.issue_windows)
            y = move()
            row[f"{way}_bit_exact"] = b.call(checksums_of, [y[k].name for k in names]) == [made]
            _free(y)
            row[f"{way}_s"] = []
        for _ in range(repeats):
            for way, target in ways.items():
                register_target(target)
                t0 = time.perf_counter()
                y = move()
                row[f"{way}_s"].append(time.perf_counter() - t0)
                _free(y)
    finally:
        register_target(nccl)
        a.call(unshare_all)
    double_ms, single_ms = (statistics.median(row[f"{w}_s"]) * 1e3 for w in ways)
    print(
        f"windows: {row['double_windows']} of them; double-buffered {double_ms:.2f} ms, single {single_ms:.2f} ms, "
        f"bit-exact {row['double_bit_exact'] and row['single_bit_exact']}",
        flush=True,
    )
    return row


def part_peers(shapes, repeats: int) -> dict:
    """The two refits users write, whole model on one process each (module docstring)."""
    import ray

    gpu = 0.125
    Peer = ray.remote(num_gpus=gpu, num_cpus=0)(TorchPeer)
    trainer = Peer.remote(shapes, 3, True)
    infer = Peer.remote(shapes, 0, False)
    expect = ray.get(trainer.checksums.remote())
    ipc = [ray.get(infer.load.remote(trainer.handles.remote())) for _ in range(repeats + 1)]
    ipc_ok = ray.get(infer.checksums.remote()) == expect
    ray.kill(trainer)
    ray.kill(infer)
    peers = {"ipc_refit_s": ipc[1:], "ipc_refit_bit_exact": ipc_ok}
    port = _free_port()
    env = {"NCCL_SOCKET_IFNAME": "lo"}
    trainer = Peer.options(runtime_env={"env_vars": {**env, "NCCL_HOSTID": "peer-0"}}).remote(shapes, 3, True)
    infer = Peer.options(runtime_env={"env_vars": {**env, "NCCL_HOSTID": "peer-1"}}).remote(shapes, 0, False)
    try:
        ray.get([trainer.init_group.remote(0, port), infer.init_group.remote(1, port)], timeout=300)
        times = []
        for _ in range(max(2, repeats // 2)):
            t0 = time.perf_counter()
            ray.get([trainer.broadcast_all.remote(), infer.broadcast_all.remote()], timeout=300)
            times.append(time.perf_counter() - t0)
        peers["broadcast_refit_s"] = times
        peers["broadcast_refit_bit_exact"] = ray.get(infer.checksums.remote()) == ray.get(trainer.checksums.remote())
    except Exception as e:  # reported, not hidden: the refit could not run here
        peers["broadcast_refit_error"] = f"{type(e).__name__}: {e}"
    finally:
        ray.kill(trainer)
        ray.kill(infer)
    print(
        f"peers: ipc refit {statistics.median(peers['ipc_refit_s']) * 1e3:.2f} ms"
        + (
            f", broadcast refit {statistics.median(peers['broadcast_refit_s']) * 1e3:.1f} ms"
            if "broadcast_refit_s" in peers
            else f", broadcast refit: {peers.get('broadcast_refit_error')}"
        ),
        flush=True,
    )
    return peers


def _chunk(shape, dim: int, n: int, i: int) -> tuple[int, ...]:
    """Shard ``i`` of ``n`` of ``shape`` along ``dim`` as torch.chunk cuts it."""
    size = shape[dim]
    step = -(-size // n)
    lo, hi = min(size, i * step), min(size, (i + 1) * step)
    return tuple(hi - lo if d == dim else s for d, s in enumerate(shape))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------------


def _sub(part: str, n: int) -> dict:
    """``part`` in a process of its own (NCCL reads some settings once per process)."""
    code = f"import json, bench.gpu as g; print('RESULT', json.dumps(g.part_{part}({n})))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=str(ROOT.parent)
    )
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"bench gpu part {part} failed: {out.stderr[-3000:]}")


def machine() -> dict:
    import cupy
    import torch

    from reshard.runtime.backends.cuda_buffers import import_nccl

    _, nccl = import_nccl()
    p = torch.cuda.get_device_properties(0)
    try:
        driver = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        driver = "unknown"
    import ray

    return {
        "gpu": p.name,
        "gpu_memory_bytes": p.total_memory,
        "sms": p.multi_processor_count,
        "gpus": torch.cuda.device_count(),
        "driver": driver,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cupy": cupy.__version__,
        "nccl": nccl.get_version(),
        "ray": ray.__version__,
        "python": sys.version.split()[0],
        "host_cpus": os.cpu_count(),
    }


def targets(data: dict) -> list[dict]:
    out = []
    peak = data.get("copy", {}).get("copy_peak_GBps")  # a run without the copy part judges no share of it
    big = [r for r in data.get("tensor", []) if r["bytes"] >= 64 * MiB]
    if big and peak:
        best = max(r["bytes"] / statistics.median(r["ipc_direct_s"]) / 1e9 / peak for r in big)
        out.append(
            {
                "target": "CUDA IPC reshard of one tensor >= 64 MiB: >= 70 % of the copy peak",
                "value": f"{best:.0%} (best size, out= direct)",
                "met": best >= 0.7,
            }
        )
    for row in data.get("model", []):
        ratio = statistics.median(row["ours_tree_s"]) / statistics.median(row["ours_one_s"])
        goal = 1.3 if row.get("model", "qwen3") == "qwen3" else 2.0
        what = "Qwen3 bf16 state dict" if goal == 1.3 else f"MoE-shaped tree of {row['tensors']} tensors (beside)"
        value = f"{ratio:.2f}x, first call {row['first_call_s']:.2f} s"
        out.append(
            {
                "target": f"{what} ({row['case']}) <= {goal}x one tensor of the same bytes",
                "value": value,
                "met": ratio <= goal,
            }
        )
        peers = row.get("peers") or {}
        if "broadcast_refit_s" in peers:
            speed = statistics.median(peers["broadcast_refit_s"]) / statistics.median(row["ours_tree_s"])
            out.append(
                {
                    "target": "the same against the gather-and-broadcast refit: >= 3x faster",
                    "value": f"{speed:.1f}x",
                    "met": speed >= 3,
                }
            )
        if "ipc_refit_s" in peers:
            speed = statistics.median(peers["ipc_refit_s"]) / statistics.median(row["ours_tree_s"])
            out.append(
                {"target": "(beside) against the per-tensor CUDA IPC refit", "value": f"{speed:.2f}x", "met": None}
            )
    m = data.get("message")
    if m:
        extra = m["ours"]["per_message_us"] - m["raw"]["per_message_us"]
        out.append(
            {
                "target": "fixed cost per message through the backend <= 30 us above raw NCCL's",
                "value": f"{extra:+.1f} us ({m['ours']['per_message_us']:.1f} vs {m['raw']['per_message_us']:.1f})",
                "met": extra <= 30,
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench gpu", description=__doc__.splitlines()[0])
    p.add_argument("--out", help="JSON path (default bench/results/gpu-<timestamp>.json)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--max-bytes", type=int, default=16 * GiB, help="largest single tensor (default 16 GiB)")
    p.add_argument("--quick", action="store_true", help="tensors up to 256 MiB, 4 layers of the model, 3 repeats")
    p.add_argument("--parts", default="copy,message,tensor,model,peers,moe,windows")
    p.add_argument("--dry-run", action="store_true", help="on the CPU stand-in: the reshard parts' logic, no measure")
    args = p.parse_args(argv)
    import cupy

    standin = getattr(cupy, "_standin", False)
    if standin != args.dry_run:
        print(
            "python -m bench gpu measures a GPU; --dry-run checks its logic on the CPU stand-in, and only there",
            file=sys.stderr,
        )
        return 2
    if standin:
        args.parts = ",".join(p for p in args.parts.split(",") if p in ("message", "tensor", "model", "moe", "windows"))
        args.repeats, args.max_bytes, args.quick = 1, 16 * MiB, True
    elif args.quick:
        args.repeats, args.max_bytes = 3, 256 * MiB
    parts = args.parts.split(",")
    from bench.local import command_line

    data: dict = {
        "revision": revision(),
        "command": command_line("gpu", argv or sys.argv[1:]),
        "when": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    out = Path(args.out) if args.out else ROOT / "results" / f"gpu-{_dt.datetime.now():%Y%m%d-%H%M%S}.json"

    def save() -> None:  # after every part: a run cut short keeps what it measured
        if not standin:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(data, indent=1) + "\n")

    if not standin:
        data["machine"] = machine()
        print(json.dumps(data["machine"]), flush=True)
    if "copy" in parts:
        data["copy"] = part_copy(args.repeats)
        print(f"copy peak {data['copy']['copy_peak_GBps']:.0f} GB/s", flush=True)
        save()
    if "message" in parts:
        n = 2000
        data["message"] = {"raw": _sub("message_raw", n), "ours": _sub("message_ours", n)}
        print(f"per message: raw {data['message']['raw']}, ours {data['message']['ours']}", flush=True)
        save()
    if "tensor" in parts or "model" in parts or "windows" in parts:
        import ray

        from reshard import DeviceMesh
        from reshard.runtime.backends.nccl import NcclBackend

        ray.init(num_gpus=0 if standin else 1, include_dashboard=False, log_to_driver=False)
        share = 0 if standin else 0.125  # stand-in GPUs are per process, not Ray resources
        backend = NcclBackend(timeout_s=300, gpus_per_device=share, gpu_sharing="hostid")
        pool = DeviceMesh.create((6,), backend=backend, startup_timeout_s=300)
        try:
            if "tensor" in parts:
                sizes = [s for s in (MiB, 16 * MiB, 64 * MiB, 256 * MiB, GiB, 4 * GiB, 16 * GiB) if s <= args.max_bytes]
                data["tensor"] = part_tensor(pool, sizes, args.repeats, [MiB, 64 * MiB])
                save()
            if "model" in parts:
                data["model"] = []
                part_model(
                    pool,
                    args.repeats,
                    DRY_RUN_LAYERS if standin else 4 if args.quick else None,
                    "peers" in parts,
                    "moe" in parts,
                    data["model"],
                    save,
                    DRY_RUN_VOCAB if standin else None,
                )
            if "windows" in parts:
                layers, vocab = (DRY_RUN_LAYERS, DRY_RUN_VOCAB) if standin else (4 if args.quick else None, None)
                data["windows"] = part_windows(pool, args.repeats, layers, vocab)
                save()
        finally:
            pool.shutdown()
            ray.shutdown()
    if standin:
        print("dry run on the CPU stand-in: every reshard checked, nothing measured")
        return 0
    data["targets"] = targets(data)
    for t in data["targets"]:
        met = {True: "met", False: "NOT met", None: "-"}[t["met"]]
        print(f"target: {t['target']}: {t['value']} [{met}]")
    save()
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
