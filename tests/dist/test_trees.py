"""Whole models in one call: trees of tensors (state dicts) distributed, resharded and adopted
bit-exact through the public API; one call is one compiled reshard (one run call per device, and a
replay ships no program and no binding); small tensors travel in buckets; works in flight; trees,
layouts and works used from Ray tasks; verify catches a flipped byte; out= commits all or nothing."""

from __future__ import annotations

import asyncio
import copy
import threading

import numpy as np
import pytest
import ray
from dist_helpers import assert_bit_exact, pl, random_array

from reshard import DeviceMesh, Layout, ReshardError, ReshardTimeout, Shard, WorkerDied, distribute, reshard
from reshard.runtime import Deadline, Work, adopt, runtime_stats, settle

pytestmark = pytest.mark.dist


def model(seed: int = 0, layers: int = 3) -> dict:
    """A small GPT-shaped state dict: big and small tensors, several dtypes, nested."""
    sd = {"wte": random_array((64, 16), "float32", seed), "blocks": []}
    for i in range(layers):
        sd["blocks"].append(
            {
                "attn": {
                    "w": random_array((16, 48), "float32", seed + 10 * i + 1),
                    "b": random_array((48,), "float32", seed + 10 * i + 2),
                },
                "ln": (random_array((16,), "float64", seed + 10 * i + 3), random_array((16,), "int64", seed + i)),
            }
        )
    sd["step"] = random_array((), "int32", seed + 99)
    return sd


def last_dim(mesh):
    return lambda path, t: Layout(mesh, (Shard(-1),) if len(t.shape) else (pl("R")[0],))


def flat(tree, prefix=""):
    """``{path: leaf}`` of a nested dict/list/tuple tree."""
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in flat(sub, f"{prefix}{key}.").items()}
    if isinstance(tree, list | tuple):
        return {k: v for i, sub in enumerate(tree) for k, v in flat(sub, f"{prefix}{i}.").items()}
    return {prefix[:-1]: tree}


def assert_tree(got, want) -> None:
    got, want = flat(got), flat(want)
    assert sorted(got) == sorted(want)
    for k in want:
        assert_bit_exact(got[k].to_numpy(), want[k])


@pytest.mark.parametrize("shared_memory", [True, False], ids=["default", "gloo"])
def test_a_state_dict_moves_in_one_call_and_keeps_its_structure(view, shared_memory):
    a, b = view([0, 1], (2,)), view([2, 3, 4, 5], (4,))
    sd = model()
    src = distribute(sd, last_dim(a))
    assert type(src["blocks"][0]["ln"]) is tuple and src["blocks"][1]["attn"]["w"].placements == (Shard(1),)
    before = runtime_stats()
    out = reshard(src, a, last_dim(b), shared_memory=shared_memory)
    after = runtime_stats()
    assert after["runs"] - before.get("runs", 0) == 1  # one compiled reshard for the whole tree
    assert after["run_calls"] - before.get("run_calls", 0) <= 6  # one call per participating device
    assert_tree(out, sd)
    assert_tree(src, sd)  # the sources are intact
    again = reshard(out, b, Layout(b, pl("R")), shared_memory=shared_memory)  # one Layout for every tensor
    assert_tree(again, sd)


def test_trees_of_layouts_lists_single_tensors_and_empty_trees(view):
    a, b = view([0, 1], (2,)), view([6, 7], (2,))
    xs = [random_array((5, 3), "float32", 1), random_array((7,), "int32", 2)]
    src = distribute(xs, [Layout(a, pl("S0")), Layout(a, pl("R"))])
    out = reshard(src, a, [Layout(b, pl("R")), Layout(b, pl("S0"))])
    assert isinstance(out, list) and out[1].placements == (Shard(0),)
    for got, want in zip(out, xs, strict=True):
        assert_bit_exact(got.to_numpy(), want)
    one = reshard(src[0], a, Layout(b, pl("S0")))  # a single tensor keeps working
    assert_bit_exact(one.to_numpy(), xs[0])
    assert reshard({}, a, {}) == {} and reshard([], a, Layout(b, pl("R"))) == []


def test_bad_trees_are_refused_before_anything_moves(view):
    a, b, c = view([0, 1], (2,)), view([2, 3], (2,)), view([4, 5], (2,))
    x = distribute(np.ones((4,), np.float32), Layout(a, pl("S0")))
    y = distribute(np.ones((4,), np.float32), Layout(c, pl("S0")))
    with pytest.raises(ValueError, match=r"not the mesh of 'y'"):
        reshard({"x": x, "y": y}, a, Layout(b, pl("R")))
    with pytest.raises(ValueError, match=r"does not match the tree of tensors \(at the root: keys \['z'\]"):
        reshard({"x": x, "z": x}, a, {"x": Layout(b, pl("R"))})
    with pytest.raises(TypeError, match="distribute\\(\\) it onto a mesh first"):
        reshard({"x": x, "raw": np.ones(3)}, a, Layout(b, pl("R")))
    with pytest.raises(TypeError, match="layout for 'x': is a str"):
        reshard({"x": x}, a, {"x": "R"})
    out = distribute({"x": np.zeros(4, np.float32)}, Layout(b, pl("R")))
    with pytest.raises(ValueError, match=r"out= does not match the tree of tensors"):
        reshard({"x": x}, a, Layout(b, pl("R")), out={"y": out["x"]})
    with pytest.raises(ValueError, match=r"out at 'x' is laid out"):
        reshard({"x": x}, a, Layout(b, pl("S0")), out=out)


def test_a_replay_plans_nothing_and_ships_nothing(view):
    a, b = view([0, 1], (2,)), view([2, 3, 4, 5], (4,))
    src = distribute(model(3), last_dim(a))
    layouts = last_dim(b)
    reshard(src, a, layouts, shared_memory=False)
    shipped = runtime_stats()["programs_shipped"]
    received = [s["programs_received"] for s in b.stats()]
    calls = runtime_stats()["run_calls"]
    out = reshard(src, a, layouts, shared_memory=False)
    assert runtime_stats()["programs_shipped"] == shipped
    assert [s["programs_received"] for s in b.stats()] == received
    assert runtime_stats()["run_calls"] - calls == 6
    assert_tree(out, model(3))


def test_a_layout_changed_in_the_same_dict_between_calls_is_the_one_used(view):
    a, b = view([0, 1], (2,)), view([2, 3], (2,))
    want = {f"w{i}": random_array((8, 6), "float32", 50 + i) for i in range(4)}
    src = distribute(want, Layout(a, pl("S0")))
    layouts = {k: Layout(b, pl("S0")) for k in want}
    for _ in range(2):
        out = reshard(src, a, layouts)
        assert all(t.placements == pl("S0") for t in out.values())
    layouts["w2"] = Layout(b, pl("S1"))  # the same dict and shapes, one layout replaced
    out = reshard(src, a, layouts)
    assert [out[k].placements for k in want] == [pl("S0"), pl("S0"), pl("S1"), pl("S0")]
    for k in want:
        assert_bit_exact(out[k].to_numpy(), want[k])


def test_a_replay_into_the_same_outputs_checks_again_what_changed_and_holds_none_of_them(view):
    """A sync loop's replays into kept outputs skip checking again what cannot have changed (the
    same handles for the same layouts, dtypes and shapes), but another layout or a freed output
    still fails before anything moves, and outputs the user drops are released."""
    import gc
    import weakref

    a, b = view([0, 1], (2,)), view([2, 3], (2,))
    want = {f"w{i}": random_array((8, 6), "float32", 60 + i) for i in range(4)}
    src = distribute(want, Layout(a, pl("S0")))
    layouts = {k: Layout(b, pl("S0")) for k in want}
    out = reshard(src, a, layouts)
    for _ in range(2):
        assert reshard(src, a, layouts, out=out) is out
    assert_tree(out, want)
    with pytest.raises(ValueError, match=r"out at 'w1' is laid out .*S\(0\).* the reshard produces .*S\(1\)"):
        reshard(src, a, {**layouts, "w1": Layout(b, pl("S1"))}, out=out)
    out["w3"].free()
    with pytest.raises(ValueError, match="output at 'w3'.* was freed"):
        reshard(src, a, layouts, out=out)
    kept = weakref.ref(out["w0"])
    del out
    gc.collect()
    assert kept() is None


def test_a_call_of_the_same_objects_is_made_again_and_any_change_makes_it_anew(view):
    """A sync loop calls reshard with the same tree, layouts and outputs every step: the call is
    made again from one of the latest (``_Call.again``: nothing per tensor checked or worked out
    again). Another source under a key, another layout or a freed source makes it anew, and it
    holds no tensor the user drops."""
    import gc
    import weakref

    from reshard.runtime.driver import resharding

    a, b = view([0, 1], (2,)), view([2, 3], (2,))
    want = {f"w{i}": random_array((8, 6), "float32", 70 + i) for i in range(4)}
    src = distribute(want, Layout(a, pl("S0")))
    layouts = {k: Layout(b, pl("S0")) for k in want}
    first = reshard(src, a, layouts)
    latest = resharding._recent[0]
    assert_tree(reshard(src, a, layouts), want)
    assert resharding._recent[0] is latest, "made again from the latest call"
    out = reshard(src, a, layouts, out=first)  # into outputs: anew, then again
    latest = resharding._recent[0]
    assert reshard(src, a, layouts, out=first) is out is first
    assert resharding._recent[0] is latest
    assert_tree(reshard(src, a, layouts), want)  # the call into fresh outputs: made again too
    assert resharding._recent[0] is latest, "a few latest calls are kept"
    want["w1"] = random_array((8, 6), "float32", 80)
    src["w1"] = distribute({"w1": want["w1"]}, Layout(a, pl("S0")))["w1"]
    reshard(src, a, layouts, out=first)
    assert resharding._recent[0] is not latest, "another source under a key"
    assert_tree(first, want)
    other = {**layouts, "w2": Layout(b, pl("R"))}
    moved = reshard(src, a, other)
    assert moved["w2"].layout == other["w2"]
    assert_tree(moved, want)
    src["w0"].free()
    with pytest.raises(ValueError, match="reshard source 'w0'.* was freed"):
        reshard(src, a, other)
    kept = weakref.ref(src["w3"])
    del src, moved
    gc.collect()
    assert kept() is None


def test_small_tensors_travel_in_buckets_and_big_ones_stream(view):
    from reshard.runtime import lowered_reshard  # noqa: F401 - the single-tensor view stays available
    from reshard.runtime.driver.resharding import _Call, _compile

    a, b = view([0, 1], (2,)), view([2, 3], (2,))
    small = {f"b{i}": np.full((8,), i, np.float32) for i in range(20)}
    src = distribute({**small, "big": random_array((512, 64), "float32", 7)}, lambda p, t: Layout(a, pl("S0")))
    layouts = lambda p, t: Layout(b, pl("R"))  # noqa: E731
    compiled = _compile(_Call(src, a, layouts, None, False), "auto", None, False, 4096)
    assert compiled.program.buckets >= 1 and compiled.program.buckets < 20
    out = reshard(src, a, layouts, shared_memory=False, bucket_bytes=4096)
    for i in range(20):
        assert_bit_exact(out[f"b{i}"].to_numpy(), small[f"b{i}"])


def test_a_target_registered_again_compiles_the_next_call_for_it(view):
    """``register_target`` replacing the gloo target's windows (one message at a time): the next
    call of the same tree compiles for the new target and moves bit-exact; with the old target
    back, the call made for it is replayed."""
    from dataclasses import replace

    from reshard.ir.target import TARGETS, register_target
    from reshard.runtime import lowered_batch

    a, b = view([0, 1], (2,)), view([2, 3], (2,))
    small = {f"b{i}": np.full((8,), i, np.float32) for i in range(20)}
    src = distribute(small, lambda p, t: Layout(a, pl("S0")))
    layouts = lambda p, t: Layout(b, pl("R"))  # noqa: E731
    before = lowered_batch(src, a, layouts, shared_memory=False, bucket_bytes=64)
    gloo = TARGETS["gloo"]
    assert any(p.windows for p in before.program.devices)  # windows of several buckets
    register_target(replace(gloo, window_ops=1))
    try:
        after = lowered_batch(src, a, layouts, shared_memory=False, bucket_bytes=64)
        assert after is not before and not any(p.windows for p in after.program.devices)  # one at a time
        out = reshard(src, a, layouts, shared_memory=False, bucket_bytes=64)
        for k, x in small.items():
            assert_bit_exact(out[k].to_numpy(), x)
    finally:
        register_target(gloo)
    assert lowered_batch(src, a, layouts, shared_memory=False, bucket_bytes=64) is before


def test_works_run_while_the_caller_goes_on_and_order_behind_each_other(view):
    a, b = view([0, 1], (2,)), view([2, 3], (2,))
    sd = {"w": random_array((32, 8), "float32", 5), "b": random_array((8,), "float32", 6)}
    src = distribute(sd, last_dim(a))
    out = distribute({k: np.zeros_like(v) for k, v in sd.items()}, last_dim(b))
    works = [reshard(src, a, last_dim(b), async_op=True, shared_memory=s) for s in (True, False)]
    assert all(isinstance(w, Work) for w in works)
    for w in works:
        assert_tree(w.wait(timeout_s=60), sd)
        assert w.done()
    into = reshard(src, a, last_dim(b), out=out, async_op=True)  # writes out
    back = reshard(out, b, last_dim(a), async_op=True)  # reads out: ordered after the first
    assert into.wait() is out
    assert_tree(back.wait(), sd)
    assert_tree(asyncio.run(_awaited(reshard(src, a, last_dim(b), async_op=True))), sd)
    with pytest.raises(ValueError, match="mesh axis 0 shards dim 0"):  # misuse: at the call, before anything moves
        reshard({"s": distribute(np.float32(1), Layout(a, pl("R")))}, a, Layout(b, pl("S0")), async_op=True)
    other = copy.deepcopy(src["w"])  # another handle on the same shards...
    other.free()  # ...frees them for every handle: the sending devices will find no source shard
    work = reshard(src, a, last_dim(b), async_op=True, shared_memory=False)  # the senders run it, after the free
    with pytest.raises(ReshardError, match="source shard (is gone|.* is missing)"):
        work.wait()


async def _awaited(work):
    return await work


def test_errors_of_a_work_surface_at_wait_and_a_dropped_one_leaks_nothing(pool, view):
    a, b = view([0, 1], (2,)), view([2, 3], (2,))
    src = distribute({"x": random_array((64,), "float32", 1)}, Layout(a, pl("S0")))
    settle(pool)
    before = [set(s["buffers"]) for s in b.stats()]
    reshard(src, a, Layout(b, pl("R")), async_op=True)  # dropped at once
    import gc

    runtime().works.after(frozenset({src["x"].name}), frozenset({src["x"].name}), Deadline.after(60))  # it finished
    gc.collect()
    settle(b)
    assert all(set(s["buffers"]) <= names for s, names in zip(b.stats(), before, strict=True))
    src["x"].free()
    with pytest.raises(ValueError, match="was freed"):
        reshard(src, a, Layout(b, pl("R")), async_op=True)


def runtime():
    from reshard.runtime import runtime as rt

    return rt()


@ray.remote(num_cpus=0)
def _push_from_a_task(tree, src_mesh, layouts, out):
    """A trainer's own process: trees, meshes and layouts built on the driver, used here; the work
    goes back to the driver."""
    work = reshard(tree, src_mesh, layouts, out=out, async_op=True)
    return work, {k: v.to_numpy() for k, v in work.wait().items()}


def test_trees_and_layouts_work_in_ray_tasks(view):
    a, b = view([0, 1], (2,)), view([4, 5, 6, 7], (4,))
    sd = {"w": random_array((16, 8), "float32", 2), "b": random_array((8,), "float32", 3)}
    src = distribute(sd, last_dim(a))
    layouts = {"w": Layout(b, pl("S0")), "b": Layout(b, pl("R"))}  # built here, resolved there
    out = distribute({k: np.zeros_like(v) for k, v in sd.items()}, layouts)
    work, got = ray.get(_push_from_a_task.remote(src, a, layouts, out), timeout=120)
    assert work.done() and sorted(work.wait()) == sorted(sd)  # a work pickles with its outcome
    for k in sd:
        assert_bit_exact(got[k], sd[k])
        assert_bit_exact(out[k].to_numpy(), sd[k])
        assert_bit_exact(work.wait()[k].to_numpy(), sd[k])


def _flip_one_byte(ctx):
    def after(runs):
        ctx.after_run = None
        for r in runs.values():
            if r.dst is not None and r.dst.size:
                flat_bytes = r.dst.reshape(-1).view(np.uint8)
                flat_bytes[0] ^= 0xFF
                return

    ctx.after_run = after


@pytest.mark.parametrize("shared_memory", [True, False], ids=["default", "gloo"])
def test_verify_names_a_flipped_byte_and_commits_nothing(view, shared_memory):
    a, b = view([0, 1], (2,)), view([2, 3], (2,))
    sd = {"w": random_array((16, 8), "float32", 4), "b": random_array((8,), "float32", 5)}
    src = distribute(sd, last_dim(a))
    out = distribute({k: np.zeros_like(v) for k, v in sd.items()}, last_dim(b))
    assert_tree(reshard(src, a, last_dim(b), verify=True, shared_memory=shared_memory), sd)
    b.call(_flip_one_byte, devices=[1])
    with pytest.raises(ReshardError, match=r"verify: tensor '(w|b)' on device \d+: the slice .* differs"):
        reshard(src, a, last_dim(b), verify=True, shared_memory=shared_memory)
    b.call(_flip_one_byte, devices=[0])
    with pytest.raises(ReshardError, match="no output was changed"):
        reshard(src, a, last_dim(b), out=out, verify=True, shared_memory=shared_memory)
    for v in out.values():
        assert not v.to_numpy().any()  # every output still holds its old values


def _hold_then_exit(ctx, gate):
    """The next run holds before its first op, tells ``gate``, and its actor exits once let go."""
    import os

    def hook(run, op):
        ctx.before_op = None
        ray.get(gate.arrive.remote())
        ray.get(gate.wait_released.remote(60))
        os._exit(1)

    ctx.before_op = hook


def test_out_commits_all_or_nothing_when_a_device_dies_mid_sync(view, gate):
    a = view([0, 1], (2,))
    b = DeviceMesh.create((3,), backend="gloo", startup_timeout_s=180)
    try:
        sd = {f"t{i}": random_array((12, 6), "float32", 20 + i) for i in range(4)}
        src = distribute(sd, lambda p, t: Layout(a, pl("S0")))
        out = distribute({k: np.full_like(v, 7.0) for k, v in sd.items()}, lambda p, t: Layout(b, pl("S1")))
        old = {k: v.local_shards() for k, v in out.items()}
        b.call(_hold_then_exit, gate, devices=[2])
        work = reshard(src, a, lambda p, t: Layout(b, pl("S1")), out=out, async_op=True, timeout_s=60)
        assert ray.get(gate.wait_arrived.remote(60), timeout=90)
        ray.get(gate.release.remote())
        with pytest.raises(WorkerDied):
            work.wait()
        for k, v in out.items():  # the survivors all kept their old values
            for flat_index in (0, 1):
                got = ray.get(b.actors[flat_index].reshard_fetch.remote(v.name), timeout=30)
                assert_bit_exact(got, old[k][flat_index])
    finally:
        b.shutdown()


def _hold_after_run(ctx, gate):
    """The next run, its ops done, tells ``gate`` and waits to be let go."""

    def hook(runs):
        ctx.after_run = None
        ray.get(gate.arrive.remote())
        ray.get(gate.wait_released.remote(60))

    ctx.after_run = hook


def _shards(ctx, names):
    return [ctx.local(n).numpy().copy() for n in names]


def test_out_whose_results_come_late_is_not_known_then_all_old(view, gate):
    """A run that ends after the controller gave up: the error says the outcome is not known yet
    (the devices decide it from the runs' results), and every device ends with its old values
    (a run that ends after its deadline fails, so no device commits)."""
    a = view([0, 1], (2,))
    b = view([2, 3, 4], (3,))
    sd = {f"t{i}": random_array((12, 6), "float32", 30 + i) for i in range(3)}
    src = distribute(sd, lambda p, t: Layout(a, pl("S0")))
    out = distribute({k: np.full_like(v, 5.0) for k, v in sd.items()}, lambda p, t: Layout(b, pl("S1")))
    names = [v.name for v in out.values()]
    old = b.call(_shards, names)
    b.call(_hold_after_run, gate, devices=[2])
    work = reshard(src, a, lambda p, t: Layout(b, pl("S1")), out=out, async_op=True, timeout_s=10)
    assert ray.get(gate.wait_arrived.remote(60), timeout=90)
    with pytest.raises(ReshardTimeout, match="Whether the outputs changed is not known yet"):
        work.wait()
    ray.get(gate.release.remote())
    assert_same_shards(b.call(_shards, names), old)  # ordered after the commits


def assert_same_shards(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        for x, y in zip(g, w, strict=True):
            assert_bit_exact(x, y)


@ray.remote(num_cpus=0)
class PlainWorker:
    """A framework's worker: no DeviceRole, methods of its own."""

    def __init__(self):
        self.weights = {}

    def make_weights(self, shapes: dict, value: float):
        import torch

        from reshard.runtime import device_of

        self.weights = {k: torch.full(s, value) for k, s in shapes.items()}
        return device_of(self).share_state_dict(self.weights, prefix="m.")

    def total(self) -> float:
        return float(sum(t.sum() for t in self.weights.values()))

    def make_weights_in_a_thread(self, shapes: dict, value: float):
        """As a train function would: a thread of its own, no handle on the actor instance."""
        import threading

        import torch

        from reshard.runtime import current_device

        out = {}

        def train_fn():
            self.weights = {k: torch.full(s, value) for k, s in shapes.items()}
            out["names"] = current_device().share_state_dict(self.weights, prefix="m.")

        thread = threading.Thread(target=train_fn)
        thread.start()
        thread.join()
        return out["names"]


def _weight_names(ctx):
    return sorted(ctx.actor.weights)


def test_any_thread_of_an_attached_actor_reaches_its_device_and_calls_reach_the_actor(view):
    from reshard.runtime import current_device

    with pytest.raises(RuntimeError, match="this process is not a device"):
        current_device()  # the driver
    a = view([0, 1], (2,))
    workers = [PlainWorker.remote() for _ in range(2)]
    mesh = DeviceMesh.attach(workers, (2,))
    try:
        assert len(set(mesh.mesh.host_ids)) == 1  # actors of one machine are one host
        names = ray.get([w.make_weights_in_a_thread.remote({"w": (4, 3)}, 2.0) for w in workers], timeout=120)[0]
        assert names == {"w": "m.w"}
        assert mesh.call(_weight_names) == [["w"], ["w"]]  # the actor's own objects, no module globals
        weights = adopt(Layout(mesh, pl("R")), names)
        sd = {"w": np.arange(12, dtype=np.float32).reshape(4, 3)}
        src = distribute(sd, lambda p, t: Layout(a, pl("S0")))
        assert reshard(src, a, Layout(mesh, pl("R")), out=weights) is weights
        assert ray.get([w.total.remote() for w in workers], timeout=60) == [66.0, 66.0]
    finally:
        mesh.shutdown()
        for w in workers:
            ray.kill(w)


def test_attach_makes_any_actor_a_device_and_adopts_its_state_dict(view):
    a = view([0, 1], (2,))
    workers = [PlainWorker.remote() for _ in range(2)]
    mesh = DeviceMesh.attach(workers, (2,))
    try:
        shapes = {"w": (4, 3), "b": (3,)}
        names = ray.get([w.make_weights.remote(shapes, -1.0) for w in workers], timeout=120)[0]
        assert names == {"w": "m.w", "b": "m.b"}
        weights = adopt(Layout(mesh, pl("R")), names)  # the same tree of handles, one call per device
        sd = {k: np.arange(np.prod(s), dtype=np.float32).reshape(s) for k, s in shapes.items()}
        src = distribute(sd, lambda p, t: Layout(a, pl("S0")))
        assert reshard(src, a, Layout(mesh, pl("R")), out=weights) is weights
        expected = float(sum(v.sum() for v in sd.values()))
        assert ray.get([w.total.remote() for w in workers], timeout=60) == [expected, expected]
    finally:
        mesh.shutdown()
        for w in workers:
            ray.kill(w)


def test_a_copy_of_a_tree_holds_every_shard_until_it_is_dropped(view):
    """A tree's copy (``copy.deepcopy``, a pickle into a task) takes and gives back its holds
    through the queue (a call per device for the whole tree): it reads bit-exact once the original
    is gone, and once it is gone too the devices hold none of the shards."""
    import gc

    a = view([0, 1], (2,))
    sd = {f"w{i}": random_array((4, 3), "float32", i) for i in range(64)}
    tree = distribute(sd, Layout(a, pl("S0")))
    names = [t.name for t in tree.values()]
    copied = copy.deepcopy(tree)
    del tree
    gc.collect()
    settle(a)
    for k, v in sd.items():
        assert_bit_exact(copied[k].to_numpy(), v)
    assert all(len(h) == 1 for held in a.call(_holders, names) for h in held)
    del copied
    gc.collect()
    settle(a)
    assert a.call(_holders, names) == [[None] * len(names)] * 2


def _holders(ctx, names) -> list:
    return [ctx.store.holders.get(n) for n in names]


def test_adopting_a_tree_holds_each_shard_once_and_a_refused_tree_none(view):
    """Every tensor of a tree is checked before any is held, then all are at once (one call per
    device): a tree refused for its last tensor leaves no hold on the others, an adopted one one
    hold per shard."""
    workers = [PlainWorker.remote() for _ in range(2)]
    mesh = DeviceMesh.attach(workers, (2,))
    try:
        names = ray.get([w.make_weights.remote({"a": (4, 3), "b": (3,)}, 1.0) for w in workers], timeout=120)[0]
        before = mesh.call(_holders, ["m.a", "m.b"])
        with pytest.raises(ValueError, match="did not all share their placements"):
            adopt({"a": Layout(mesh, pl("R")), "b": mesh}, names)  # b: plain tensors, no placements to take
        assert mesh.call(_holders, ["m.a", "m.b"]) == before  # in order after anything the adopt sent
        weights = adopt(Layout(mesh, pl("R")), names)
        held = mesh.call(_holders, ["m.a", "m.b"])
        assert all(len(h) == len(b) + 1 for hs, bs in zip(held, before) for h, b in zip(hs, bs)), held
        assert weights["a"].shape == (4, 3) and weights["b"].shape == (3,)
    finally:
        mesh.shutdown()
        for w in workers:
            ray.kill(w)


@ray.remote(num_cpus=0)
def _dtensor_on_one_rank(mesh, port: int):
    """A process holding a whole DTensor (a world of one rank): distribute takes its placements."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        full = torch.arange(24, dtype=torch.float32).reshape(4, 6)
        dt = distribute_tensor(full, init_device_mesh("cpu", (1,)), [_torch_shard0()])
        t = distribute({"w": dt}, mesh)["w"]
        return t.placements == (Shard(0),), t.to_numpy()
    finally:
        dist.destroy_process_group()


def _torch_shard0():
    from torch.distributed.tensor import Shard as TorchShard

    return TorchShard(0)


def test_distribute_takes_a_whole_dtensor_with_its_placements(view):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    a = view([0], (1,))
    placed, got = ray.get(_dtensor_on_one_rank.remote(a, port), timeout=120)
    assert placed
    assert_bit_exact(got, np.arange(24, dtype=np.float32).reshape(4, 6))


def test_a_read_waits_for_the_pending_work_that_writes_it(view, gate, monkeypatch):
    """``to_numpy`` of an ``out=`` tensor while an async sync into it is still running returns the
    new values, never the old or a mix: the read waits for the work."""
    a, b = view([0, 1], (2,)), view([2, 3], (2,))
    sd = {"w": random_array((16, 8), "float32", 40)}
    src = distribute(sd, last_dim(a))
    out = distribute({"w": np.zeros_like(sd["w"])}, last_dim(b))
    b.call(_hold_after_run, gate, devices=[0])
    work = reshard(src, a, last_dim(b), out=out, async_op=True)
    assert ray.get(gate.wait_arrived.remote(60), timeout=90)  # the run holds: nothing committed yet
    works, progress, got = runtime().works, threading.Event(), {}
    waits_for_works = works.after

    def after(reads, writes, deadline):
        progress.set()
        waits_for_works(reads, writes, deadline)

    monkeypatch.setattr(works, "after", after)

    def read():
        try:
            got["w"] = out["w"].to_numpy()
        finally:
            progress.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert progress.wait(60)  # the reader waits for the work, or (wrongly) read already
    ray.get(gate.release.remote())
    reader.join(120)
    assert work.wait() is out
    assert_bit_exact(got["w"], sd["w"])


def _hold_before_commit(ctx, gate):
    """The next commit here tells ``gate`` before it decides, and waits to be let go."""

    def hook(stage, run):
        if stage == "before":
            ctx.commit_hook = None
            ray.get(gate.arrive.remote())
            ray.get(gate.wait_released.remote(60))

    ctx.commit_hook = hook


def _hold_at_op(ctx, gate, skip):
    """The next run holds at its op number ``skip`` (from 0), tells ``gate`` and waits to be let go."""
    count = iter(range(skip + 1))

    def hook(run, op):
        if next(count, None) == skip:
            ctx.before_op = None
            ray.get(gate.arrive.remote())
            ray.get(gate.wait_released.remote(60))

    ctx.before_op = hook


def _until_the_read_waits(actor, ref) -> None:
    """Until the device says the read ``ref`` waits for a write (or the read returned)."""
    for _ in range(1200):
        if ray.wait([ref], timeout=0.05)[0]:
            return  # it did not wait: what it read is checked
        if ray.get(actor.reshard_stats.remote(), timeout=30)["shard_locks"]["reads_waiting"]:
            return
    raise AssertionError("the read neither waited nor returned")


@pytest.mark.parametrize("direct", [False, True], ids=["commit", "direct"])
def test_a_read_from_another_process_during_a_write_waits_and_sees_it_whole(view, gate, direct):
    """A read that skips this process's order (another process's ``reshard_fetch``) while an
    ``out=`` commit decides, or while a ``direct`` run has written part of its output, waits for
    the write and returns the new values whole, never the old or half of each."""
    a, b = view([0, 1], (2,)), view([2, 3], (2,))
    w = random_array((16, 8), "float32", 42)
    src = distribute({"w": w}, last_dim(a))
    out = distribute({"w": np.zeros_like(w)}, lambda p, t: Layout(b, pl("S0")))
    if direct:
        b.call(_hold_at_op, gate, 1, devices=[0])  # its first pull landed, in place
    else:
        b.call(_hold_before_commit, gate, devices=[0])
    work = reshard(src, a, lambda p, t: Layout(b, pl("S0")), out=out, direct=direct, async_op=True)
    assert ray.get(gate.wait_arrived.remote(60), timeout=90)
    read = b.actors[0].reshard_fetch.remote(out["w"].name)
    _until_the_read_waits(b.actors[0], read)
    ray.get(gate.release.remote())
    assert_bit_exact(ray.get(read, timeout=90), w[:8])
    assert work.wait() is out
    assert ray.get(b.actors[0].reshard_stats.remote(), timeout=30)["shard_locks"] == {
        "shards_written": 0,
        "reads": 0,
        "reads_waiting": 0,
    }


def _version_of(ctx, name):
    return ctx.store.version(name)


def _committed(ctx, name, run):
    """As if sync ``run`` had committed into shard ``name`` here."""
    ctx.store.wrote([name], run)


def test_a_read_waits_until_every_device_holds_the_same_sync_and_names_a_split(view):
    """A read whose devices were last committed into by different syncs (another process's sync
    reached some of them first, or a commit failed on some) reads again until they agree; when
    they never do, it raises naming which devices hold which sync."""
    a, b = view([0, 1], (2,)), view([2, 3], (2,))
    w = random_array((16, 8), "float32", 43)
    src = distribute({"w": w}, last_dim(a))
    out = distribute({"w": np.zeros_like(w)}, lambda p, t: Layout(b, pl("S0")))
    name = out["w"].name
    assert b.call(_version_of, name) == [None, None]
    reshard(src, a, lambda p, t: Layout(b, pl("S0")), out=out)
    synced = b.call(_version_of, name)
    assert synced[0] is not None and synced == [synced[0]] * 2
    b.call(_committed, name, "another", devices=[1])
    with pytest.raises(
        ReshardError,
        match=rf"different syncs \(devices \[{b.device_ids[0]}\] hold sync .*; devices "
        rf"\[{b.device_ids[1]}\] hold sync another\)",
    ):
        out["w"].to_numpy(timeout_s=1)
    fetches = ray.get(b.actors[1].reshard_stats.remote(), timeout=30)["fetches"]
    got = {}
    reader = threading.Thread(target=lambda: got.update(w=out["w"].to_numpy(timeout_s=60)))
    reader.start()
    for _ in range(1200):  # until it read device 1 again at least once (it waits for the devices to agree)
        if ray.get(b.actors[1].reshard_stats.remote(), timeout=30)["fetches"] >= fetches + 2 or not reader.is_alive():
            break
        ray.wait([b.actors[1].reshard_ping.remote()], timeout=0.05)
    assert reader.is_alive()
    b.call(_committed, name, synced[0], devices=[1])
    reader.join(60)
    assert_bit_exact(got["w"], w)


def test_one_call_has_one_deadline_whatever_it_waits_for(view, monkeypatch):
    """The wait for earlier works that touch a call's tensors counts against the call's own
    ``timeout_s``: both use one deadline (two would let a blocking call take twice its timeout)."""
    a, b = view([0, 1], (2,)), view([2, 3], (2,))
    src = distribute({"w": random_array((8, 4), "float32", 41)}, last_dim(a))
    rt, seen = runtime(), []
    waits_for_works, submits = rt.works.after, rt.batches.submit

    def after(reads, writes, deadline):
        seen.append(("after", deadline))
        waits_for_works(reads, writes, deadline)

    def submit_batch(compiled, sources, run, deadline, *args, **kwargs):
        seen.append(("submit", deadline))
        return submits(compiled, sources, run, deadline, *args, **kwargs)

    monkeypatch.setattr(rt.works, "after", after)
    monkeypatch.setattr(rt.batches, "submit", submit_batch)
    reshard(src, a, last_dim(b), timeout_s=30)
    assert [k for k, _ in seen] == ["after", "submit"]
    assert seen[0][1] is seen[1][1]


def _freeze(ctx, name):
    """Shard ``name`` here becomes read-only (as an array loaded with ``np.load(mmap_mode="r")``)."""
    ctx.store.get(name).flags.writeable = False


def _thaw(ctx, name):
    ctx.store.get(name).flags.writeable = True


@pytest.mark.parametrize("direct", [False, True], ids=["staged", "direct"])
def test_a_read_only_output_fails_the_sync_before_any_output_changes(view, direct):
    """One read-only output on one device: the error names it, and every output keeps its old
    values (checked before anything is written, not output by output); ``direct`` writes are
    all or nothing only on that device (the others may have written theirs, as documented)."""
    a, b = view([0, 1], (2,)), view([2, 3], (2,))
    sd = {f"t{i}": random_array((8, 4), "float32", 50 + i) for i in range(3)}
    src = distribute(sd, last_dim(a))
    out = distribute({k: np.full_like(v, 3.0) for k, v in sd.items()}, last_dim(b))
    b.call(_freeze, out["t2"].name, devices=[0])
    try:
        with pytest.raises(ReshardError, match=rf"device {b.device_ids[0]}: output shard .* is read-only"):
            reshard(src, a, last_dim(b), out=out, direct=direct)
        for k in sd:
            kept = out[k].local_shards()
            for i in [0] if direct else [0, 1]:
                assert_bit_exact(kept[i], np.full_like(kept[i], 3.0))
    finally:
        b.call(_thaw, out["t2"].name, devices=[0])
    assert reshard(src, a, last_dim(b), out=out, direct=direct) is out
    assert_tree(out, sd)
    b.call(_freeze, out["t2"].name, devices=[0])  # the same arrays, read-only after a sync that passed
    try:
        with pytest.raises(ReshardError, match=rf"device {b.device_ids[0]}: output shard .* is read-only"):
            reshard(distribute({k: v + 1 for k, v in sd.items()}, last_dim(a)), a, last_dim(b), out=out, direct=direct)
        for k, v in sd.items():
            kept, want = out[k].local_shards(), np.split(v, 2, axis=-1)
            for i in [0] if direct else [0, 1]:
                assert_bit_exact(kept[i], want[i])
    finally:
        b.call(_thaw, out["t2"].name, devices=[0])


def _after_commit(ctx, gate):
    """The next commit here tells ``gate`` once it decided and copied (or not)."""

    def hook(stage, run):
        if stage == "after":
            ctx.commit_hook = None
            ray.get(gate.arrive.remote())

    ctx.commit_hook = hook


@ray.remote(num_cpus=0)
class _Pusher:
    """A trainer pushing weights from an actor of its own (it owns its runs' results)."""

    def push(self, tree, src_mesh, layouts, out) -> bool:
        self.work = reshard(tree, src_mesh, layouts, out=out, async_op=True)
        return True


def test_out_commits_on_every_destination_when_the_caller_dies_mid_sync(view, gate):
    """The caller (a Ray actor) dies while a run is still going: every run succeeds, and each
    destination learns that from the participants, not from the dead caller's results (which Ray
    drops with it), so all commit: one version everywhere, whoever asked."""
    from dist_helpers import Gate

    a, b = view([0, 1], (2,)), view([2, 3], (2,))
    sd = {f"t{i}": random_array((8, 6), "float32", 60 + i) for i in range(3)}
    src = distribute(sd, last_dim(a))
    out = distribute({k: np.full_like(v, 9.0) for k, v in sd.items()}, last_dim(b))
    done = [ray.remote(num_cpus=0)(Gate).remote() for _ in range(2)]
    pusher = _Pusher.remote()
    try:
        for i in range(2):
            b.call(_after_commit, done[i], devices=[i])
        b.call(_hold_after_run, gate, devices=[1])
        assert ray.get(pusher.push.remote(src, a, last_dim(b), out), timeout=120)
        assert ray.get(gate.wait_arrived.remote(60), timeout=90)  # a run holds: no commit has decided
        ray.kill(pusher)
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(pusher.push.remote(src, a, last_dim(b), out), timeout=60)  # it is gone
        ray.get(gate.release.remote())
        assert all(ray.get([g.wait_arrived.remote(150) for g in done], timeout=180))
        assert_tree(out, sd)  # every output on both devices holds the new values
    finally:
        for g in done:
            ray.kill(g)


def test_a_tensor_parallel_plan_lays_out_a_whole_state_dict_in_one_call(view):
    from reshard import tensor_parallel_layouts

    a, b = view([0, 1], (2,)), view([2, 3, 4, 5], (4,))
    sd = {
        "embed.weight": random_array((50, 8), "float32", 70),  # 50 rows over 4: 13, 13, 13, 11
        "layers.0.attn.qkv.weight": random_array((24, 8), "float32", 71),
        "layers.0.attn.qkv.bias": random_array((24,), "float32", 72),
        "layers.0.attn.out.weight": random_array((8, 8), "float32", 73),
        "layers.0.attn.out.bias": random_array((8,), "float32", 74),
    }
    plan = {"embed": "vocab", "layers.*.attn.qkv": "colwise", "layers.*.attn.out": "rowwise"}
    out = reshard(distribute(sd, last_dim(a)), a, tensor_parallel_layouts(b, plan))
    assert_tree(out, sd)
    shapes = {k: [s.shape for s in v.local_shards().values()] for k, v in out.items()}
    assert shapes["embed.weight"] == [(13, 8), (13, 8), (13, 8), (11, 8)]
    assert shapes["layers.0.attn.out.weight"] == [(8, 2)] * 4 and shapes["layers.0.attn.out.bias"] == [(8,)] * 4


@ray.remote(num_cpus=0)
class _BusyWorker:
    """A single-threaded actor whose one thread is taken (as a Ray Train V1 worker's train loop)."""

    def hold(self, gate) -> None:
        ray.get(gate.arrive.remote())
        ray.get(gate.wait_released.remote(120))


def test_attaching_a_busy_single_threaded_actor_says_so(gate):
    worker = _BusyWorker.remote()
    try:
        held = worker.hold.remote(gate)
        assert ray.get(gate.wait_arrived.remote(60), timeout=90)
        with pytest.raises(
            ReshardTimeout, match=r"DeviceMesh.attach\(\(1,\)\): actors .* did not answer .* busy .* V1"
        ):
            DeviceMesh.attach([worker], (1,), startup_timeout_s=2)
        ray.get(gate.release.remote())
        ray.get(held, timeout=60)
    finally:
        ray.kill(worker)


def _waits_behind(mesh, device: int, what: str) -> bool:
    """Whether a call ``what`` of this process waits for its turn on flat device ``device``."""
    stats = ray.get(mesh._records[device].actor.reshard_stats.remote(), timeout=30)
    return what in stats["calls"]["waiting"].values()


def test_shutting_a_mesh_down_lets_a_pending_commit_finish(gate):
    """``shutdown`` while an async ``out=`` reshard still runs: the mesh closes only after every
    device did what this process asked before, so the commit is never cut halfway."""
    from reshard import Replicate

    mesh = DeviceMesh.create((2,), backend="gloo", startup_timeout_s=180)
    try:
        x = random_array((8, 6), "float32", 80)
        src = distribute(x, Layout(mesh, (Shard(0),)))
        out = distribute(np.zeros_like(x), Layout(mesh, (Replicate(),)))
        mesh.call(_hold_after_run, gate, devices=[1])
        work = reshard(src, mesh, Layout(mesh, (Replicate(),)), out=out, async_op=True, shared_memory=False)
        assert ray.get(gate.wait_arrived.remote(60), timeout=90)  # device 1's run holds: no commit yet
        closing = threading.Thread(target=mesh.shutdown, kwargs={"timeout_s": 120})
        closing.start()
        while closing.is_alive() and not _waits_behind(mesh, 1, "call(_nothing)"):
            closing.join(0.05)  # until shutdown returned, or its call waits behind the commit
        ray.get(gate.release.remote())
        closing.join(150)
        assert work.wait(60) is out  # committed everywhere before the devices closed
    finally:
        mesh.shutdown()


def _pool_counts(ctx) -> tuple[int, int]:
    return ctx.store.pool.hits, ctx.store.pool.misses


@pytest.mark.parametrize("shape", [(64, 32), (512, 32)], ids=["small-unit", "large"])
def test_a_staged_sync_gives_its_staging_back_for_the_next(view, shape):
    """An ``out=`` sync stages its results, commits them, then frees them into the pool: the next
    sync of the same tree stages into that memory, fresh memory none (a leftover reference kept
    it out of the pool: every sync made fresh memory, 2x the time of a direct one on this VM).
    Small shards are staged in one block per run (``host_unit``), larger ones one by one."""
    a, b = view([0, 1], (2,)), view([2, 3], (2,))
    sd = {f"w{i}": random_array(shape, "float32", 70 + i) for i in range(4)}
    src = distribute(sd, last_dim(a))
    out = distribute({k: np.zeros_like(v) for k, v in sd.items()}, last_dim(b))
    reshard(src, a, last_dim(b), out=out)
    before = b.call(_pool_counts)
    reshard(src, a, last_dim(b), out=out)
    after = b.call(_pool_counts)
    assert all(n[0] > m[0] and n[1] == m[1] for n, m in zip(after, before, strict=True)), (before, after)
    for k, v in sd.items():
        assert_bit_exact(out[k].to_numpy(), v)


def _open_descriptors(ctx) -> int:
    import os

    return len(os.listdir("/proc/self/fd"))


def test_a_tree_of_thousands_of_small_tensors_costs_no_descriptor_per_shard(view):
    """MoE-like: 5,000 small tensors. Their shards stay in private memory, read by peers across
    processes (a shared block per shard ran a 12,000-tensor tree out of descriptors)."""
    a, b = view([0, 1], (2,)), view([2, 3], (2,))
    sd = {f"experts.{i}.w": random_array((16, 64), "float32", i) for i in range(5000)}
    src = distribute(sd, Layout(a, pl("S0")))
    out = reshard(src, a, Layout(b, pl("S1")))
    assert max(b.call(_open_descriptors) + a.call(_open_descriptors)) < 1000
    for k in ("experts.0.w", "experts.4999.w"):
        assert_bit_exact(out[k].to_numpy(), sd[k])


def _shared_blocks(ctx) -> int:
    return len(ctx.store.shared.blocks)


def test_a_tree_of_more_large_shards_than_the_block_budget_keeps_descriptors_bounded(view):
    """1,100 tensors whose shards are 16 KiB, too large to stay private by size: a device gives
    ``MAX_BLOCKS`` of them a shared block and keeps the rest in private memory, which peers read
    by cross-memory attach; moved there and back bit-exact."""
    from reshard.runtime.device.shared_memory import MAX_BLOCKS, PEER_MAPS

    a, b = view([0, 1], (2,)), view([2, 3], (2,))
    n = MAX_BLOCKS + 76
    sd = {f"experts.{i}.w": random_array((64, 128), "float32", i) for i in range(n)}
    src = distribute(sd, Layout(a, pl("S0")))
    out = reshard(src, a, Layout(b, pl("S1")))
    back = reshard(out, b, Layout(a, pl("S0")))
    assert max(b.call(_shared_blocks) + a.call(_shared_blocks)) <= MAX_BLOCKS  # a: sources and `back`
    # two descriptors per block, one per peer's block mapped (at most PEER_MAPS): bounded, whatever the tree
    assert max(b.call(_open_descriptors) + a.call(_open_descriptors)) < 2 * MAX_BLOCKS + PEER_MAPS + 300
    for k in ("experts.0.w", f"experts.{n // 2}.w", f"experts.{n - 1}.w"):
        assert_bit_exact(out[k].to_numpy(), sd[k])
        assert_bit_exact(back[k].to_numpy(), sd[k])


def test_a_tree_whose_tensors_differ_in_what_peers_can_pull_is_planned_on_one_host_map(view):
    """A tensor with an empty source shard (not in shared memory: nothing to pull) and one cast in
    flight (casts are not pulled) beside tensors that are pulled: every tensor of the call is
    planned on the same hosts (a map merged from each tensor's own made the cost model too small
    for some of them: ``ValueError: the plan uses host ...``)."""
    a = view([0, 1, 2], (3,))
    b = view([3, 4], (2,))
    sd = {
        "full": random_array((6, 4), "float32", 80),
        "uneven": random_array((2, 4), "float32", 81),
        "cast": random_array((6, 4), "float32", 82),
    }
    src = distribute(sd, lambda p, t: Layout(a, pl("S0")))
    assert len(src["uneven"]._shared) < len(src["full"]._shared)  # device 2's shard of it is empty
    out = reshard(src, a, last_dim(b), dtype={"full": "float32", "uneven": "float32", "cast": "float64"})
    assert_bit_exact(out["full"].to_numpy(), sd["full"])
    assert_bit_exact(out["uneven"].to_numpy(), sd["uneven"])
    assert_bit_exact(out["cast"].to_numpy(), sd["cast"].astype(np.float64))


def _share_strided(ctx, full, coords: dict) -> None:
    """Share this device's shard of ``full`` as FSDP2 over tensor parallelism lays it out on a
    (dp, tp) mesh: torch's own ``_StridedShard(0, split_factor=tp)`` then ``Shard(0)``."""
    import torch
    from torch.distributed.tensor.placement_types import Shard as TorchShard
    from torch.distributed.tensor.placement_types import _StridedShard

    i, j = coords[ctx.device]
    strided = _StridedShard(0, split_factor=2)
    mine = strided._split_tensor(torch.from_numpy(full), 2, with_padding=False)[0][i]
    mine = TorchShard(0)._split_tensor(mine, 2, with_padding=False)[0][j].contiguous()
    ctx.share(
        "fsdp_tp.w", mine, shape=full.shape, placements=(strided, TorchShard(0)), mesh_shape=(2, 2), coordinate=(i, j)
    )


def _placements_of(ctx, name) -> list[str]:
    return [str(p) for p in (ctx.store.meta.get(name) or {}).get("placements") or ()]


def test_a_dtensor_sharded_by_fsdp2_over_tensor_parallelism_is_resharded_as_torch_laid_it_out(view):
    """FSDP2 over tensor parallelism shards a weight by rows twice, tensor-parallel axis first
    (torch's ``_StridedShard``): the shards each device shares, with torch's placements, are
    adopted and gathered bit-exact, and resharded into another layout."""
    a = view([0, 1, 2, 3], (2, 2))
    b = view([4, 5], (2,))
    full = random_array((12, 5), "float32", 90)
    a.call(_share_strided, full, {d: a.mesh.coords(k) for k, d in enumerate(a.device_ids)})
    w = adopt(a, "fsdp_tp.w")
    assert str(w.layout.placements[0]) == "_S(0, 2)"
    assert_bit_exact(w.to_numpy(), full)
    assert_bit_exact(reshard(w, a, Layout(b, pl("S0"))).to_numpy(), full)
    assert_bit_exact(reshard(w, a, Layout(b, pl("R"))).local_shards()[1], full)
    back = reshard(reshard(w, a, Layout(b, pl("S0"))), b, w.layout)  # into the strided layout
    shards = back.local_shards()
    for k in range(4):
        assert_bit_exact(shards[k], w.local_shards()[k])
    assert a.call(_placements_of, back.name) == [["_S(0, 2)", "S(0)"]] * 4  # what a DTensor of it is made with
