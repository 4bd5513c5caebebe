"""Where a reshard's time goes: a timeline across the driver and the device actors.

``python -m bench.timeline --case shard-to-rep --size 64MiB --strategy auto [--repeats 5] [--cprofile]``

Instruments the device actors through the runtime's ``call`` extension point only (no runtime
edit): inside each actor process it wraps the device's inbox (a run call asking for its turn)
and the executor's ``execute``, and sets the ``before_op`` hook, recording wall-clock timestamps
(one machine: one clock). The driver records when ``reshard`` was called and when it
returned. Per run it prints, relative to the call:

* ``arrive``   when each actor's run call arrived (Ray dispatch; ``setup`` includes its wait for
  its turn),
* ``program``  the actor's program (ops), and inside it the time in each op,
* ``return``   from the last actor's end to ``reshard`` returning (result transport + gather).

``--cprofile`` also profiles the driver's ``reshard`` call and each actor's program.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

from bench.cases import CASES_BY_NAME, POOL_SHAPE, fmt_size, parse_size  # noqa: E402

# ------------------------------------------------------------------ actor side (run through call)


def install(ctx, cprofile: bool = False) -> int:
    """Timestamp this actor's run calls (their turn in its inbox), programs and ops (idempotent).
    Returns the pid."""
    from reshard.runtime.device import actor

    if getattr(ctx, "_tl_installed", False):
        ctx._tl_cprofile = cprofile
        return os.getpid()
    ctx._tl_log = []
    ctx._tl_cprofile = cprofile
    ctx._tl_stats = None
    log = ctx._tl_log
    turn, execute = ctx.inbox.turn, actor.execute
    ctx._tl_originals = execute

    def timed_turn(ticket, deadline, what="call"):
        if what.startswith("the reshard into"):  # a run call arrived (it may wait for its turn)
            log.append(("run", time.time()))
        return turn(ticket, deadline, what)

    def timed_execute(*a, **k):
        log.append(("program", time.time()))
        prof = None
        if ctx._tl_cprofile:
            import cProfile

            prof = cProfile.Profile()
            prof.enable()
        try:
            return execute(*a, **k)
        finally:
            if prof is not None:
                prof.disable()
                import io
                import pstats

                s = io.StringIO()
                pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(12)
                ctx._tl_stats = s.getvalue()
            log.append(("end", time.time()))

    def before_op(run, op):
        log.append((f"op{op.step}:{type(op).__name__}", time.time()))

    ctx.inbox.turn, actor.execute = timed_turn, timed_execute
    ctx.before_op = before_op
    ctx._tl_installed = True
    return os.getpid()


def take(ctx) -> tuple[list, str | None]:
    out, stats = list(ctx._tl_log), ctx._tl_stats
    ctx._tl_log.clear()
    ctx._tl_stats = None
    return out, stats


def uninstall(ctx) -> None:
    from reshard.runtime.device import actor

    if getattr(ctx, "_tl_installed", False):
        del ctx.inbox.turn  # the class's method again
        actor.execute = ctx._tl_originals
    ctx.before_op = None
    ctx._tl_installed = False


# ------------------------------------------------------------------ driver


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.timeline", description=__doc__.splitlines()[0])
    p.add_argument("--case", default="shard-to-rep", choices=sorted(CASES_BY_NAME))
    p.add_argument("--size", default="64MiB")
    p.add_argument("--strategy", default="auto")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--cprofile", action="store_true")
    p.add_argument("--gloo", action="store_true", help="the gloo path (reshard(..., shared_memory=False))")
    args = p.parse_args(argv)

    import cProfile
    import io
    import pstats

    import ray

    from bench.local import Suite, make_array
    from reshard import Layout, distribute, reshard

    started = False
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        started = True
    case = CASES_BY_NAME[args.case]
    size = parse_size(args.size)
    ns = argparse.Namespace(timeout=300.0, dtype=args.dtype)
    suite = Suite(ns, None)
    try:
        src_mesh, dst_mesh = suite.bind(case.src), suite.bind(case.dst)
        shape = case.shape_for(size, args.dtype)
        source = make_array(shape, args.dtype, 0)
        x = distribute(source, Layout(src_mesh, case.src_placements))
        dst_layout = Layout(dst_mesh, case.dst_placements)
        devices = sorted(set(src_mesh.device_ids) | set(dst_mesh.device_ids))
        actors = suite.actors(devices)

        def each(fn, *fn_args):
            out = suite.call_each({d: (fn, fn_args, {}) for d in devices}, 60.0)
            return [out[d] for d in devices]

        each(install, args.cprofile)
        print(
            f"{case.name} {fmt_size(size)} {args.strategy}{' gloo' if args.gloo else ''}: {case}  (pool {POOL_SHAPE})"
        )
        path = {"shared_memory": False} if args.gloo else {}
        reshard(x, src_mesh, dst_layout, strategy=args.strategy, **path).free()  # warm-up
        each(take)
        for r in range(args.repeats):
            prof = cProfile.Profile() if args.cprofile else None
            t0 = time.time()
            if prof:
                prof.enable()
            y = reshard(x, src_mesh, dst_layout, strategy=args.strategy, **path)
            if prof:
                prof.disable()
            t1 = time.time()
            logs = each(take)
            y.free()
            print(f"\nrun {r + 1}: wall {(t1 - t0) * 1e3:.1f} ms")
            ends = []
            for d, (log, stats) in zip(devices, logs, strict=True):
                if not log:
                    print(f"  device {d}: no run")
                    continue
                marks = dict()
                for k, t in log:
                    marks.setdefault(k, t)
                arrive = (marks["run"] - t0) * 1e3
                prog = marks.get("program", marks["run"])
                end = marks.get("end", prog)
                ends.append(end)
                ops = [(k, t) for k, t in log if k.startswith("op")]
                spans = []
                for i, (k, t) in enumerate(ops):
                    nxt = ops[i + 1][1] if i + 1 < len(ops) else end
                    spans.append(f"{k.split(':')[1][:5]}@{(t - t0) * 1e3:.0f}+{(nxt - t) * 1e3:.0f}")
                setup, program, done = (prog - marks["run"]) * 1e3, (end - prog) * 1e3, (end - t0) * 1e3
                print(
                    f"  device {d}: arrive {arrive:6.1f}  setup {setup:5.1f}  program {program:6.1f}  "
                    f"done {done:6.1f}  ops {' '.join(spans)}"
                )
                if stats:
                    print("    " + "\n    ".join(stats.splitlines()[:22]))
            if ends:
                print(f"  return: last actor done -> reshard returned {(t1 - max(ends)) * 1e3:.1f} ms")
            if prof:
                s = io.StringIO()
                pstats.Stats(prof, stream=s).sort_stats("cumtime").print_stats(18)
                print("  driver cProfile (cumulative):\n    " + "\n    ".join(s.getvalue().splitlines()[:40]))
        t0 = time.time()
        ray.get([a.reshard_ping.remote() for a in actors])
        print(f"\nempty call round trip to the {len(actors)} actors: {(time.time() - t0) * 1e3:.1f} ms")
        each(uninstall)
        x.free()
    finally:
        suite.close()
        if started:
            ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
