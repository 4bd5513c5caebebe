"""Bit-exact reshards through the public API over views of the shared 8-actor pool.

Pool flat indices 0-3 sit on one logical host, 4-7 on the other.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from dist_helpers import assert_bit_exact, assert_shards, pl, random_array, read

from reshard import STRATEGIES, Layout, Replicate, Shard, distribute, reshard
from reshard.dtypes import ITEMSIZE
from reshard.runtime import runtime_stats

pytestmark = pytest.mark.dist

# (id, src pool indices, src shape, src placements, dst pool indices, dst shape, dst placements, tensor shape)
CASES = [
    ("2x2->1x3 disjoint", [0, 1, 4, 5], (2, 2), "S0 S1", [2, 3, 6], (1, 3), "R S1", (7, 10)),
    ("1x4->2x2 overlapping", [0, 1, 2, 3], (1, 4), "R S0", [2, 3, 6, 7], (2, 2), "S1 S0", (9, 5)),
    ("2x4->2x2 subset", range(8), (2, 4), "S0 R", [0, 1, 4, 5], (2, 2), "R S1", (6, 8)),
    ("flat8 dim1->dim0", range(8), (2, 4), "S1 S1", range(8), (2, 4), "S0 S0", (8, 16)),
    ("replicated->hosts", range(8), (2, 4), "R R", range(8), (2, 4), "S0 R", (4, 6)),
    ("uneven, empty trailing shard", [0, 1, 2, 3], (4,), "S0", [4, 5, 6], (3,), "S0", (5, 3)),
    ("uneven 3-D", [0, 4], (2, 1), "S2 R", [1, 2, 5, 6, 7, 3], (2, 3), "S0 S2", (3, 4, 5)),
    ("one dim on two axes", [0, 1, 2], (3,), "S1", [4, 5, 6, 7], (2, 2), "S1 S1", (2, 11)),
    ("more shards than rows", [0, 1, 2, 3], (2, 2), "S0 S0", [5, 6], (1, 2), "R S0", (3,)),
    ("3-D mesh -> 1-D", range(8), (2, 2, 2), "S0 S1 S2", [1, 3, 5, 7], (4,), "S1", (4, 6, 8)),
    ("1x1 -> 2x2 replicate", [7], (1, 1), "R R", [0, 1, 4, 5], (2, 2), "R R", (3, 5)),
    ("2x2 -> 1x1 gather", [0, 1, 4, 5], (2, 2), "S1 S0", [6], (1, 1), "R R", (6, 4)),
    ("non-contiguous slices (staging)", [0, 1, 2, 3], (2, 2), "S2 S1", [4, 5, 6, 7], (2, 2), "S0 S1", (6, 7, 9)),
]


#: Every bit-exactness test runs both ways: slices pulled through shared memory where sender and
#: receivers share a machine (the default), and everything through gloo (``shared_memory=False``).
TRANSPORTS = pytest.mark.parametrize("shared_memory", [True, False], ids=["pull", "gloo"])


def _run_case(view, case, dtype="float32", strategy="auto", seed=0, shared_memory=True):
    _, si, ss, sp, di, ds, dp, shape = case
    src = view(list(si), ss)
    dst = view(list(di), ds)
    x = random_array(shape, dtype, seed)
    t = distribute(x, Layout(src, pl(sp)))
    y = reshard(t, src, Layout(dst, pl(dp)), strategy=strategy, shared_memory=shared_memory)
    assert y.shape == tuple(shape) and y.dtype_name == dtype and y.mesh is dst
    assert_bit_exact(read(y), x)
    assert_shards(y, x)
    assert_bit_exact(read(t), x)  # the source is intact
    return t, y


@TRANSPORTS
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_layout_pairs(view, case, shared_memory):
    _run_case(view, case, shared_memory=shared_memory)


@TRANSPORTS
@pytest.mark.parametrize("dtype", sorted(ITEMSIZE))
@pytest.mark.parametrize("case", [CASES[0], CASES[-1]], ids=["broadcast", "staged"])
def test_every_dtype(view, case, dtype, shared_memory):
    _run_case(view, case, dtype, seed=len(dtype), shared_memory=shared_memory)


def _strategy_cases():
    picks = [CASES[0], CASES[2], CASES[4], CASES[5], CASES[-1]]
    return [(s, c) for s in sorted(STRATEGIES) for c in picks]


@TRANSPORTS
@pytest.mark.parametrize(("strategy", "case"), _strategy_cases(), ids=lambda v: v if isinstance(v, str) else v[0])
def test_every_strategy(view, strategy, case, shared_memory):
    _run_case(view, case, "int32", strategy=strategy, shared_memory=shared_memory)


@pytest.mark.parametrize(
    ("shape", "sp", "dp"),
    [((), "R R", "R R"), ((0,), "S0 R", "R S0"), ((4, 0), "S0 S1", "S1 R"), ((0, 3, 2), "R S2", "S1 S0")],
    ids=["0-d", "empty 1-D", "empty inner", "empty outer"],
)
@TRANSPORTS
def test_zero_d_and_empty(view, shape, sp, dp, shared_memory):
    src = view([0, 1, 4, 5], (2, 2))
    dst = view([2, 6, 3, 7], (2, 2))
    x = random_array(shape, "float64", 3)
    t = distribute(x, Layout(src, pl(sp)))
    for d in (dst, src):  # cross-mesh and same-mesh
        y = reshard(t, src, Layout(d, pl(dp)), shared_memory=shared_memory)
        assert_bit_exact(y.to_numpy(), x)
        assert_shards(y, x)


def test_zero_d_torch_scalar(view):
    import torch

    src = view([3], (1,))
    dst = view([4, 5], (2,))
    t = distribute(torch.tensor(2.5, dtype=torch.float16), Layout(src, pl("R")))
    y = reshard(t, src, Layout(dst, pl("R")))
    out = y.to_torch()
    assert out.shape == () and out.dtype == torch.float16 and float(out) == 2.5


@pytest.mark.parametrize(("sp", "dp"), [("S0 S1", "S1 S0"), ("S0 S1", "R R"), ("S0 R", "S0 R"), ("R R", "S1 S0")])
@TRANSPORTS
def test_same_mesh(view, sp, dp, shared_memory):
    mesh = view([0, 1, 4, 5], (2, 2))
    x = random_array((5, 6), "int64", 4)
    t = distribute(x, Layout(mesh, pl(sp)))
    y = reshard(t, mesh, Layout(mesh, pl(dp)), shared_memory=shared_memory)
    assert_bit_exact(y.to_numpy(), x)
    assert_shards(y, x)
    assert_shards(t, x)


@TRANSPORTS
def test_repeated_reshard_ships_programs_once(view, pool, shared_memory):
    src = view([0, 1, 2, 3], (2, 2))
    dst = view([4, 5, 6], (1, 3))
    x = random_array((10, 9), "float32", 5)
    t = distribute(x, Layout(src, pl("S0 S1")))
    layout = Layout(dst, pl("R S0"))
    reshard(t, src, layout, strategy="broadcast", shared_memory=shared_memory)
    before = runtime_stats()
    received = [s["programs_received"] for s in pool.stats()]
    for _ in range(3):
        y = reshard(t, src, layout, strategy="broadcast", shared_memory=shared_memory)
        assert_bit_exact(y.to_numpy(), x)
    after = runtime_stats()
    assert after["programs_shipped"] == before["programs_shipped"]
    assert after.get("rendezvous_calls", 0) == before.get("rendezvous_calls", 0)
    assert after["runs"] == before["runs"] + 3
    # one call per participating actor: with pulls only the 3 receivers run anything (CUDA shards
    # are not in shared memory: on NCCL pools every sender runs too)
    pulls = shared_memory is not False and bool(t._shared)
    assert after["run_calls"] - before["run_calls"] == 3 * (3 if pulls else 7)
    assert [s["programs_received"] for s in pool.stats()] == received
    # a new tensor of the same shape, dtype and layouts reuses the same programs as well
    t2 = distribute(random_array((10, 9), "float32", 6), Layout(src, pl("S0 S1")))
    reshard(t2, src, layout, strategy="broadcast", shared_memory=shared_memory)
    assert runtime_stats()["programs_shipped"] == before["programs_shipped"]


def test_chain_of_reshards(view):
    """A tensor hops over several meshes and layouts and comes back unchanged."""
    x = random_array((12, 10, 3), "int8", 7)
    meshes = [
        (view(range(8), (2, 4)), "S0 S1"),
        (view([1, 2, 3], (3,)), "S2"),
        (view([7, 6, 5, 4], (2, 2)), "R S0"),
        (view([0, 4], (1, 2)), "S1 S0"),
        (view(range(8), (2, 4)), "S0 S1"),
    ]
    mesh, spec = meshes[0]
    t = distribute(x, Layout(mesh, pl(spec)))
    for mesh2, spec2 in meshes[1:]:
        t = reshard(t, mesh, Layout(mesh2, pl(spec2)))
        mesh = mesh2
        assert_shards(t, x)
    assert_bit_exact(t.to_numpy(), x)


def test_torch_input_and_output(view):
    import torch

    src = view([0, 1], (2,))
    dst = view([2, 3, 4], (3,))
    x = torch.arange(35, dtype=torch.int32).reshape(5, 7)
    t = distribute(x.t(), Layout(src, pl("S0")))  # non-contiguous input
    y = reshard(t, src, Layout(dst, pl("S1")))
    assert torch.equal(y.to_torch(), x.t().contiguous())
    assert np.array_equal(y.to_numpy(), x.t().numpy())


# ------------------------------------------------------------------------------ shared memory


def test_pulls_replace_messages_between_actors_of_one_machine(view):
    """On one machine every slice read from a source shard is pulled: no communicator, and the
    senders run nothing; shared_memory=False sends everything through gloo."""
    from reshard.ir.program import MESSAGE_OPS, Pull
    from reshard.runtime import lowered_reshard

    src = view([0, 1, 2, 3], (2, 2))
    x = random_array((12, 10), "float64", 7)
    t = distribute(x, Layout(src, pl("S0 S1")))
    assert sorted(t._shared) == list(src.device_ids)
    dst = view([4, 5, 6], (1, 3))
    layout = Layout(dst, pl("R S1"))
    for pulls in (True, False):
        lowered = lowered_reshard(t, layout, strategy="broadcast", shared_memory=pulls)
        kinds = {type(op) for p in lowered.program.devices for op in p.all_ops}
        if pulls:
            assert kinds == {Pull} and not lowered.groups
            assert set(lowered.participants) == set(dst.device_ids)
        else:
            assert Pull not in kinds and kinds & set(MESSAGE_OPS) and lowered.groups
        y = reshard(t, src, layout, strategy="broadcast", shared_memory=pulls)
        assert_bit_exact(y.to_numpy(), x)
        assert_shards(t, x)


def _open_fds(ctx):
    import os

    return len(os.listdir("/proc/self/fd"))


def test_shared_shards_release_their_memory(view, pool):
    """Each shard lives in its own memfd; freeing tensors closes them (up to what the pool of
    freed shards keeps), so repeated distribute/reshard/free cycles leak no descriptors."""
    src = view([0, 1], (2,))
    dst = view([2, 3], (2,))
    x = random_array((64, 33), "int32", 8)

    def cycle(i):
        t = distribute(x + i, Layout(src, pl("S0")))
        y = reshard(t, src, Layout(dst, pl("S1")))
        assert_bit_exact(y.to_numpy(), x + i)
        t.free()
        y.free()

    cycle(0)
    before = pool.call(_open_fds, devices=[0, 1, 2, 3])
    for i in range(1, 25):
        cycle(i)
    after = pool.call(_open_fds, devices=[0, 1, 2, 3])
    assert all(a <= b + 2 for a, b in zip(after, before, strict=True)), (before, after)


def test_private_memory_mesh(view, ray_cluster):
    """A mesh created with shared_memory=False keeps private shards: reshards to and from it go
    through gloo."""
    from reshard import DeviceMesh
    from reshard.ir.program import Pull
    from reshard.runtime import lowered_reshard

    own = DeviceMesh.create((1,), backend="gloo", shared_memory=False, startup_timeout_s=180)
    try:
        assert not own.shared_memory and "shared memory" not in repr(own)
        x = random_array((9, 4), "int8", 9)
        t = distribute(x, Layout(own, pl("R")))
        assert not t._shared
        dst = view([0, 1], (2,))
        y = reshard(t, own, Layout(dst, pl("S0")))
        assert_bit_exact(y.to_numpy(), x)
        back = Layout(own, pl("R"))
        assert Pull not in {type(op) for p in lowered_reshard(y, back).program.devices for op in p.all_ops}
        assert_bit_exact(reshard(y, dst, back).to_numpy(), x)
    finally:
        own.shutdown()


def test_relays_inside_a_machine_are_pulled_from_the_relaying_device(view, ray_cluster):
    """Slices from private source devices (no shared memory: "another machine") cross once, to one
    destination device, which publishes each as it lands; its peers pull them out of its
    destination shard, with no relay message. Bit-exact, again with the cached program, and the
    relaying device's shard stays its own."""
    from reshard import DeviceMesh
    from reshard.passes.compile import planning_hosts
    from reshard.ir.program import Publish, Pull
    from reshard.runtime import lowered_reshard
    from reshard.runtime.driver.resharding import memory_domains
    from topology import Cluster

    own = DeviceMesh.create((2,), backend="gloo", shared_memory=False, startup_timeout_s=180)
    try:
        x = random_array((256, 192), "float32", 11)  # big enough that relaying beats two windows of sends
        t = distribute(x, Layout(own, pl("S0")))
        dst = view([0, 1, 2, 3], (2, 2))
        layout = Layout(dst, pl("R R"))
        hosts = planning_hosts(t.layout, layout, memory_domains(t, dst))
        cluster = dataclasses.replace(
            Cluster.for_hosts(hosts, nic_GBps=0.12, intra_host_GBps=2.8), backend="gloo", latency_us=900
        )
        lowered = lowered_reshard(t, layout, cluster=cluster)
        publishers = {h for hs in lowered.relay_sources.values() for h in hs}
        assert publishers and lowered.relay_sources, "the plan relays nothing"
        for p in lowered.program.devices:
            if p.device in publishers:
                assert any(isinstance(op, Publish) for op in p.ops)
            relayed = [op for op in p.all_ops if isinstance(op, Pull) and op.after]
            assert all(op.holder in publishers for op in relayed)
            assert not any(g for g in p.connect if set(g) <= set(dst.device_ids)), "a relay message is left"
        for _ in range(2):
            y = reshard(t, own, layout, cluster=cluster)
            assert_bit_exact(y.to_numpy(), x)
            assert_shards(y, x)
            y.free()
        out = distribute(np.zeros_like(x), layout)  # staged for a commit, the relays still in shared memory
        assert reshard(t, own, layout, cluster=cluster, out=out) is out
        assert_shards(out, x)
    finally:
        own.shutdown()


# ------------------------------------------------------------------------------ Partial sources


@TRANSPORTS
@pytest.mark.parametrize("op", ["sum", "max", "min", "avg"])
def test_partial_sources_arrive_reduced(view, shared_memory, op):
    """Every device's contribution (``distribute`` of local shards) reduced on the way: exact for
    integers, and for avg of float64 values whose sum is exact."""
    from reshard.ir.placement import Partial

    src = view([0, 1, 4, 5], (2, 2))  # contributions along axis 1, rows sharded along axis 0
    dst = view([2, 3, 6], (3,))
    rng = np.random.default_rng(17)
    dtype = np.float64 if op == "avg" else np.int32
    parts = [rng.integers(-50, 50, size=(6, 5)).astype(dtype) for _ in range(2)]
    reduce = {"sum": np.add, "max": np.maximum, "min": np.minimum, "avg": np.add}[op]
    want = reduce(parts[0], parts[1]) / (2 if op == "avg" else 1)
    layout = Layout(src, (Shard(0), Partial(op)))
    shards = {flat: parts[flat % 2][(flat // 2) * 3 : (flat // 2 + 1) * 3] for flat in range(4)}
    t = distribute(shards, layout)
    assert t.shape == (6, 5)
    for spec in ("S1", "R"):
        y = reshard(t, src, Layout(dst, pl(spec)), shared_memory=shared_memory)
        assert_bit_exact(y.to_numpy(), want.astype(dtype))
    back = reshard(t, src, Layout(src, (Replicate(), Partial(op))), shared_memory=shared_memory)
    shards = back.local_shards()  # the value at coordinate 0 of the Partial axis, zeros elsewhere
    assert_bit_exact(shards[0], want.astype(dtype))
    assert_bit_exact(shards[1], np.zeros_like(want, dtype=dtype))


def test_distribute_checks_local_shards(view):
    a = view([0, 1], (2,))
    with pytest.raises(ValueError, match="flat device 1 has shape"):
        distribute({0: np.zeros((3, 2)), 1: np.zeros((3, 3))}, Layout(a, pl("S0")))
    with pytest.raises(ValueError, match="missing \\[1\\]"):
        distribute({0: np.zeros((3, 2))}, Layout(a, pl("S0")))
    t = distribute([np.arange(3), np.arange(3, 5)], Layout(a, pl("S0")))  # uneven: 3 + 2
    assert t.shape == (5,) and t.to_numpy().tolist() == list(range(5))
