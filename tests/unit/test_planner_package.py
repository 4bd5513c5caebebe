"""The planner package: its registry, an import graph without cycles, and planning with a device ->
host override (``plan_reshard(hosts=...)``: validated, carried by the plan, used by the strategies,
by ``plan.simulate`` and by ``plan.lower_bound_s``)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from problems import SETTINGS, problems

from reshard import STRATEGIES, Layout, Replicate, ReshardPlan, Shard, plan_reshard, validate_plan
from reshard.planner import register
from topology import Cluster, Mesh

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
R = Replicate()


def test_strategies_register_in_a_fixed_order_and_names_are_unique():
    assert list(STRATEGIES) == ["send_recv", "broadcast", "broadcast_size", "broadcast_order", "allgather", "auto"]
    with pytest.raises(ValueError, match="'auto' is registered already"):
        register("auto")(lambda problem: ())
    assert STRATEGIES["auto"].__module__ == "reshard.planner.auto"


def _imports(path: Path, package: str) -> set[str]:
    """The repository modules ``path`` imports at module level or inside functions."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        out |= {n for n in names if n.split(".")[0] in ("reshard", "topology")}
    return out


def test_the_pure_planning_modules_import_no_cycle():
    modules = {}
    for package in ("reshard", "topology"):
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
            if not name.startswith("reshard.runtime") and name not in ("reshard", "topology.runtime"):
                modules[name] = path
    graph = {m: {i for i in _imports(p, m) if i in modules and i != m} for m, p in modules.items()}
    assert {"reshard.planner.auto", "reshard.ir.plan", "reshard.ir.cost"} <= set(graph)
    state: dict[str, int] = {}

    def visit(m: str, trail: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                pytest.fail("import cycle: " + " -> ".join([*trail[trail.index(n) :], n]))
            if n not in state:
                visit(n, [*trail, n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


# ------------------------------------------------------------------------------------ host override


def _layouts():
    """Device 0 on host 0 and device 1 on host 1 hold the tensor; device 2 on host 2 needs it."""
    src = Layout(Mesh((2, 1), [0, 1], [0, 1]), (R, R))
    dst = Layout(Mesh((1, 1), [2], [2]), (R, R))
    return src, dst


def test_the_plan_carries_its_hosts_and_keeps_the_layouts():
    src, dst = _layouts()
    plain = plan_reshard((1000,), "float32", src, dst)
    assert plain.hosts == ((0, 0), (1, 1), (2, 2))
    moved = plan_reshard((1000,), "float32", src, dst, hosts={0: 0, 1: 5, 2: 5})
    assert moved.hosts == ((0, 0), (1, 5), (2, 5)) and moved.host_map == {0: 0, 1: 5, 2: 5}
    assert (moved.src, moved.dst) == (src, dst)  # the layouts stay the tensor's
    assert plan_reshard((1000,), "float32", src, dst, hosts={2: 5, 1: 5, 0: 0}) is moved  # cached by the map
    # extra devices are not part of the plan
    assert plan_reshard((1000,), "float32", src, dst, hosts={0: 0, 1: 5, 2: 5, 9: 1}).hosts == moved.hosts


@pytest.mark.parametrize("strategy", ["send_recv", "allgather", "auto"])
def test_strategies_plan_with_the_override(strategy):
    src, dst = _layouts()
    # with the meshes' hosts both holders are remote: the lowest id sends; with device 1 on the
    # receiver's host, device 1 does (an intra-host link)
    plain = plan_reshard((1000,), "float32", src, dst, strategy=strategy)
    moved = plan_reshard((1000,), "float32", src, dst, strategy=strategy, hosts={0: 0, 1: 5, 2: 5})
    assert [t.src for t in plain.transfers] == [0]
    assert [t.src for t in moved.transfers] == [1]
    assert plain.simulate().network_bytes == 4000 and moved.simulate().network_bytes == 0
    assert moved.lower_bound_s() < plain.lower_bound_s()
    validate_plan(moved)


def test_simulate_and_the_bound_use_the_plans_hosts():
    src = Layout(Mesh((2, 2), [0, 1, 2, 3], [0, 0, 1, 1]), (Shard(0), R))
    dst = Layout(Mesh((2, 2), [4, 5, 6, 7], [2, 2, 3, 3]), (R, Shard(0)))
    one_host = dict.fromkeys(range(8), 0)
    plan = plan_reshard((64, 64), "float32", src, dst, hosts=one_host)
    cluster = Cluster.homogeneous(1, 8, 1.0, 100.0)
    assert plan.simulate(cluster).network_bytes == 0
    assert plan.lower_bound_s() == plan.lower_bound_s(Cluster.for_hosts(one_host)) > 0  # the default cluster
    with pytest.raises(ValueError, match="places 8 distinct devices on host 0"):
        plan.simulate(Cluster.homogeneous(4, 2, 1.0, 100.0))  # fits the meshes' hosts, not the plan's


def test_bad_host_overrides_are_refused():
    src, dst = _layouts()
    with pytest.raises(ValueError, match="no host for device 2"):
        plan_reshard((8,), "float32", src, dst, hosts={0: 0, 1: 1})
    with pytest.raises(ValueError, match=r"maps device 1 to '1'; host ids are non-negative ints"):
        plan_reshard((8,), "float32", src, dst, hosts={0: 0, 1: "1", 2: 2})
    with pytest.raises(ValueError, match="maps device 0 to -1"):
        plan_reshard((8,), "float32", src, dst, hosts={0: -1, 1: 1, 2: 2})
    with pytest.raises(TypeError, match="hosts must map global device ids"):
        plan_reshard((8,), "float32", src, dst, hosts=[(0, 0), (1, 1), (2, 2)])
    plan = plan_reshard((8,), "float32", src, dst)
    with pytest.raises(ValueError, match="sorted"):
        ReshardPlan(
            plan.shape, plan.dtype, src, dst, plan.strategy, plan.tasks, plan.transfers, ((1, 1), (0, 0), (2, 2))
        )
    with pytest.raises(ValueError, match="no host for device 2"):
        ReshardPlan(plan.shape, plan.dtype, src, dst, plan.strategy, plan.tasks, plan.transfers, ((0, 0), (1, 1)))


def test_a_device_on_two_hosts_needs_an_override():
    src = Layout(Mesh((2,), [0, 1], [0, 0]), (Shard(0),))
    dst = Layout(Mesh((2,), [1, 2], [1, 1]), (Shard(0),))
    with pytest.raises(ValueError, match="device 1 sits on host 0 in one mesh but on host 1"):
        plan_reshard((8,), "float32", src, dst)
    plan = plan_reshard((8,), "float32", src, dst, hosts={0: 0, 1: 0, 2: 1})
    validate_plan(plan)


@SETTINGS
@given(problems(), st.integers(1, 4))
def test_plans_with_any_host_override_stay_valid(problem, span):
    shape, dtype, src, dst, strategy = problem
    devices = {*src.mesh.device_ids, *dst.mesh.device_ids}
    hosts = {d: d // span for d in devices}
    plan = plan_reshard(shape, dtype, src, dst, strategy=strategy, hosts=hosts)
    assert plan.host_map == hosts
    validate_plan(plan)
    assert plan.simulate().makespan_s >= plan.lower_bound_s() * (1 - 1e-9)


def test_duplex_rounds_let_a_relay_forward_while_it_receives():
    """Device 4 takes two slices off the network and relays each to 5. One transfer per device per
    round, it forwards only after both arrived; one per direction of its link (``duplex``: gloo's
    windows), it forwards slice 0 in the round that brings slice 1, and before it in its order."""
    from reshard.ir.plan import TransferKind
    from reshard.planner.order import Item, order_items

    a, b = ((0, 2),), ((2, 4),)
    items = [
        Item(TransferKind.SEND, a, 0, (4,), 0, 8, True, ((0, 0), (1, 2))),
        Item(TransferKind.SEND, b, 1, (4,), 1, 8, True, ((0, 0), (1, 2))),
        Item(TransferKind.SEND, a, 4, (5,), 0, 8, False, after=0),
        Item(TransferKind.SEND, b, 4, (5,), 1, 8, False, after=1),
    ]
    for how in ("lpt", "color"):
        plain = [(t.src, t.box) for t in order_items(items, how)]
        assert plain == [(0, a), (1, b), (4, a), (4, b)]
        duplex = [(t.src, t.box) for t in order_items(items, how, duplex=True)]
        assert duplex == [(0, a), (4, a), (1, b), (4, b)]
