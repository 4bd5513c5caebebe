"""What-ifs for the runtime, measured in one run against the runtime as it is.

``python -m bench.whatif --cases same-mesh,shard-to-rep --sizes 64KiB,64MiB [--strategy auto]``

Per (case, size), interleaved round by round, median driver wall time of:

* ``reshard``     the runtime as it is (``reshard(...)``);
* ``keep``        the same, with each device keeping its staging buffer between reshards (the
                  runtime's own ``staging_keep_bytes`` knob, raised through ``call``; measured on
                  the second of two back-to-back runs, the first re-creating the buffer);
* ``async``       the runtime's SAME lowered ``DeviceProgram``s and communicators, run by a
                  prototype asynchronous interpreter through the actors' ``call`` extension point:
                  every communication op posted at once (tag = global step; each group's members
                  still enqueue its ops in the one global order, so no cross-group wait cycle),
                  local COPY ops done while transfers fly, a temporary per staged op, one wait at
                  the end (a relay, which reads received data, waits first);
* ``async+pool``  the prototype with destination shards and staging temporaries taken from a
                  per-actor pool of freed buffers (no fresh, page-faulting memory per reshard);
* ``raw gloo``    ``bench.ceiling``: the same bytes between the same actors, one message per pair.

The prototype is benchmark code (``reshard`` never uses it); its results are checked bit-exact.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from bench.cases import fmt_size, parse_size, select_cases  # noqa: E402

_POOL: dict = {}  # (shape, dtype) -> freed tensors, per actor process


def _take(shape, tdt, pooled: bool):
    import torch

    if pooled:
        free = _POOL.get((tuple(shape), tdt))
        if free:
            return free.pop()
    return torch.empty(tuple(shape), dtype=tdt)


def _give(t, pooled: bool) -> None:
    if pooled and t is not None:
        _POOL.setdefault((tuple(t.shape), t.dtype), []).append(t)


# ------------------------------------------------------------------ actor side


def run_async(ctx, program, dtype: str, src_name: str | None, dst_name: str, pooled: bool = False) -> dict:
    """Run one device's ``DeviceProgram`` asynchronously (see the module doc)."""
    import torch.distributed as dist

    from reshard.lowering import Buffer, OpKind
    from reshard.runtime.executor import torch_dtype
    from reshard.runtime.groups import group_key

    t0 = time.perf_counter()
    tdt = torch_dtype(dtype)
    src = ctx.buffers[src_name] if program.src_shape is not None else None
    dst = _take(program.dst_shape, tdt, pooled) if program.dst_shape is not None else None
    pending: list = []  # (work, finalize or None, temporary or None)
    copies = []

    def sl(box):
        return tuple(slice(lo, hi) for lo, hi in box)

    def wait_all():
        for work, fin, tmp in pending:
            work.wait()
            if fin is not None:
                fin()
            _give(tmp, pooled)
        pending.clear()

    for op in program.ops:
        if op.kind is OpKind.COPY:
            copies.append(op)
            continue
        key = group_key(op.group)
        pg = ctx.communicator(key).pg
        root = key.index(op.group[0])
        me = key.index(program.device)
        receiving = op.kind is OpKind.RECV or (op.kind is OpKind.BROADCAST and me != root)
        tmp = None
        if receiving:
            view = dst[sl(op.write)]
            if op.stage:
                t = tmp = _take(op.shape, tdt, pooled)
                fin = lambda v=view, t=t: v.copy_(t)  # noqa: E731
            else:
                t, fin = view, None
        else:
            if op.read_buffer is Buffer.DST:
                wait_all()  # a relay reads what an earlier op received
            view = (dst if op.read_buffer is Buffer.DST else src)[sl(op.read)]
            if op.stage:
                t = tmp = _take(op.shape, tdt, pooled)
                t.copy_(view)
            else:
                t = view
            fin = None
        if op.kind is OpKind.BROADCAST:
            opts = dist.BroadcastOptions()
            opts.rootRank = root
            opts.rootTensor = 0
            work = pg.broadcast([t], opts)
        elif op.kind is OpKind.SEND:
            work = pg.send([t], key.index(op.group[1]), op.step)
        else:
            work = pg.recv([t], root, op.step)
        pending.append((work, fin, tmp))
    posted = time.perf_counter()
    for op in copies:
        buf = dst if op.read_buffer is Buffer.DST else src
        dst[sl(op.write)].copy_(buf[sl(op.read)])
    copied = time.perf_counter()
    wait_all()
    if dst is not None:
        ctx.buffers[dst_name] = dst
    end = time.perf_counter()
    return {"post_s": posted - t0, "copy_s": copied - posted, "wait_s": end - copied, "run_s": end - t0}


def free(ctx, name: str, pooled: bool = False) -> None:
    _give(ctx.buffers.pop(name, None), pooled)


def drain(ctx) -> None:
    _POOL.clear()


def set_staging_keep(ctx, nbytes: int) -> int:
    """The runtime's ``staging_keep_bytes`` knob, per device; trims to it now."""
    old = ctx.staging.keep_bytes
    ctx.staging.keep_bytes = nbytes
    ctx.staging.trim()
    return old


# ------------------------------------------------------------------ driver


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.whatif", description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="rep-to-shard,shard-to-rep,flat-dim,2d-transpose,2x4-to-2x2,same-mesh")
    p.add_argument("--sizes", default="64KiB,64MiB")
    p.add_argument("--strategy", default="auto")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dtype", default="float32")
    args = p.parse_args(argv)

    import statistics

    import ray

    from bench import ceiling
    from bench.local import Suite, make_array, pair_bytes, verify
    from reshard import Layout, distribute, plan_reshard, reshard
    from reshard.runtime import ShardedTensor, ensure_groups
    from reshard.runtime.driver import runtime

    started = False
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        started = True
    suite = Suite(argparse.Namespace(timeout=300.0, dtype=args.dtype), None)
    names = iter(range(1, 1 << 30))

    def actor_of(d):
        return suite.pool.actor(suite.pool.index_of(d))

    methods = ("reshard", "keep", "async", "async+pool", "raw gloo")
    med = statistics.median
    try:
        print(f"strategy {args.strategy}; median ms over {args.repeats} interleaved rounds "
              f"(ratio to reshard in brackets); async split = post/copy/wait of the slowest device")  # fmt: skip
        print(f"{'case':14} {'size':>7} " + " ".join(f"{m:>16}" for m in methods))
        for case in select_cases(args.cases.split(",")):
            src_mesh, dst_mesh = suite.bind(case.src), suite.bind(case.dst)
            dst_layout = Layout(dst_mesh, case.dst_placements)
            for size in [parse_size(s) for s in args.sizes.split(",")]:
                shape = case.shape_for(size, args.dtype)
                source = make_array(shape, args.dtype, 0)
                x = distribute(source, Layout(src_mesh, case.src_placements))
                plan = plan_reshard(shape, args.dtype, x.layout, dst_layout, strategy=args.strategy)
                prog = runtime().lower(plan).program
                ensure_groups(prog.groups)
                parts = [(suite.pool.actor(suite.pool.index_of(dp.device)), dp) for dp in prog.devices
                         if dp.ops or dp.dst_shape is not None]  # fmt: skip
                every = [suite.pool.actor(i) for i in range(suite.pool.size)]
                raw = ceiling.RawTransfer(f"whatif-{case.name}", pair_bytes(plan), actor_of, suite.store.port)
                raw.setup()
                splits: list[dict] = []

                def run_proto(pooled: bool, check: bool = False, x=x, parts=parts, source=source, shape=shape,
                              dst_mesh=dst_mesh, dst_layout=dst_layout, splits=splits):  # fmt: skip
                    name = f"whatif{next(names)}"
                    t0 = time.perf_counter()
                    out = ray.get([a.call.remote(run_async, dp, args.dtype, x.name, name, pooled) for a, dp in parts])
                    dt = time.perf_counter() - t0
                    if check:
                        ok, detail = verify(ShardedTensor(dst_mesh, dst_layout, shape, args.dtype, name), source)
                        if not ok:
                            raise AssertionError(f"async prototype not bit-exact: {detail}")
                    ray.get([a.call.remote(free, name, pooled) for a, _ in parts])
                    if pooled:
                        splits.append(max(out, key=lambda o: o["run_s"]))
                    return dt

                def run_reshard(x=x, src_mesh=src_mesh, dst_layout=dst_layout):
                    t0 = time.perf_counter()
                    y = reshard(x, src_mesh, dst_layout, strategy=args.strategy)
                    dt = time.perf_counter() - t0
                    y.free()
                    return dt

                def run_keep(every=every, run_reshard=run_reshard):
                    ray.get([a.call.remote(set_staging_keep, 1 << 40) for a in every])
                    run_reshard()  # re-creates the staging buffer, which is now kept
                    dt = run_reshard()
                    ray.get([a.call.remote(set_staging_keep, 1 << 20) for a in every])  # runtime default
                    return dt

                runs = {
                    "reshard": run_reshard,
                    "keep": run_keep,
                    "async": lambda: run_proto(False),
                    "async+pool": lambda: run_proto(True),
                    "raw gloo": raw.run,
                }
                run_reshard()
                run_proto(False, check=True)
                run_proto(True, check=True)
                raw.run()
                splits.clear()
                samples: dict[str, list[float]] = {m: [] for m in methods}
                for _ in range(args.repeats):
                    for m in methods:
                        samples[m].append(runs[m]())
                x.free()
                raw.release()
                ray.get([a.call.remote(drain) for a in every])
                base = med(samples["reshard"])
                cells = [f"{med(samples[m]) * 1e3:7.1f} [{med(samples[m]) / base:4.2f}]" for m in methods]
                sp = {k: med(s[k] for s in splits) * 1e3 for k in ("post_s", "copy_s", "wait_s")}
                print(f"{case.name:14} {fmt_size(size):>7} " + " ".join(f"{c:>16}" for c in cells)
                      + f"   split {sp['post_s']:.0f}/{sp['copy_s']:.0f}/{sp['wait_s']:.0f}", flush=True)  # fmt: skip
    finally:
        suite.close()
        if started:
            ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
