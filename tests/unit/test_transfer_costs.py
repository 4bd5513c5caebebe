"""scheduler.transfer_costs: per-boundary transfer durations from reshard plans, fed to simulate."""

from __future__ import annotations

import pytest

from reshard import Layout, Replicate, Shard, plan_reshard
from scheduler import eager_one_f_one_b, one_f_one_b, simulate
from scheduler.pipeline_plan import check_deadlock_free, global_transfer_order, plan_pipeline
from scheduler.transfer_costs import Boundary, linear_boundaries, plan_duration_s, transfer_costs
from topology import Cluster

pytestmark = pytest.mark.unit

GB = 1e9


def p3(num_hosts: int) -> Cluster:
    return Cluster.homogeneous(num_hosts, 4, nic_GBps=1.25, intra_host_GBps=100.0, latency_us=0.0, name="p3")


def stage_layouts(cluster: Cluster, n_stages: int, placements=None):
    placements = placements or (Replicate(), Replicate())
    meshes = [cluster.mesh((1, 4), hosts=(h,)) for h in range(n_stages)]
    return [Layout(m, placements) for m in meshes]


def test_replicated_host_to_host_crosses_the_network_once():
    cluster = p3(2)
    a, b = stage_layouts(cluster, 2)
    plan = plan_reshard((1024, 1024), "float32", a, b, cluster=cluster)
    # 4 MiB leave host 0 and enter host 1 once (the NIC is the bottleneck), then fan out inside it
    assert plan_duration_s(plan, cluster) == pytest.approx(4 * 2**20 / (1.25 * GB), rel=0.05)


def test_transfer_costs_linear_pipeline_gives_simulate_kwargs():
    cluster = p3(4)
    layouts = stage_layouts(cluster, 4)
    boundaries = linear_boundaries((1024, 1024), "float32", [(layouts[i], layouts[i + 1]) for i in range(3)])
    costs = transfer_costs(boundaries, cluster)
    assert len(costs.transfer_s) == len(costs.backward_transfer_s) == 3
    assert all(t > 0 for t in costs.transfer_s)
    assert costs.transfer_s == costs.backward_transfer_s  # symmetric layouts
    assert not costs.skip_transfer_s
    result = simulate(one_f_one_b(4, 4), forward_s=0.01, backward_s=0.02, **costs.simulate_kwargs())
    assert result.iteration_s > simulate(one_f_one_b(4, 4), forward_s=0.01, backward_s=0.02).iteration_s
    assert set(costs.to_dict()) >= {"transfer_s", "backward_transfer_s", "skip_transfer_s"}


def test_gradient_plan_swaps_layouts():
    cluster = p3(2)
    src = Layout(cluster.mesh((1, 4), hosts=(0,)), (Replicate(), Shard(0)))
    dst = Layout(cluster.mesh((1, 2), hosts=(1,)), (Replicate(), Replicate()))
    costs = transfer_costs([Boundary(0, 1, (64, 64), "float32", src, dst)], cluster)
    fwd, bwd = costs.forward_plans[(0, 1)], costs.backward_plans[(0, 1)]
    assert (fwd.src, fwd.dst) == (src, dst)
    assert (bwd.src, bwd.dst) == (dst, src)


def test_skip_connections_are_costed_and_simulated():
    cluster = p3(4)
    layouts = stage_layouts(cluster, 4)
    boundaries = linear_boundaries((256, 256), "float32", [(layouts[i], layouts[i + 1]) for i in range(3)])
    boundaries.append(Boundary(0, 3, (2048, 1024), "float32", layouts[0], layouts[3]))
    costs = transfer_costs(boundaries, cluster)
    assert set(costs.skip_transfer_s) == {(0, 3)}
    assert costs.skip_transfer_s[(0, 3)] > max(costs.transfer_s)
    result = simulate(eager_one_f_one_b(4, 8), forward_s=0.01, backward_s=0.02, **costs.simulate_kwargs())
    assert result.iteration_s > 0


def test_durations_are_the_plans_simulated_makespans():
    cluster = p3(2)
    a, b = stage_layouts(cluster, 2)
    costs = transfer_costs([Boundary(0, 1, (8, 8), "float32", a, b)], cluster)
    fwd, bwd = costs.forward_plans[(0, 1)], costs.backward_plans[(0, 1)]
    assert costs.transfer_s == (fwd.simulate(cluster).makespan_s,)
    assert costs.backward_transfer_s == (bwd.simulate(cluster).makespan_s,)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda c, ls: [Boundary(0, 1, (8, 8), "float32", ls[0], ls[1])], "no boundary for stage 1 -> 2"),
        (lambda c, ls: [Boundary(0, 1, (8, 8), "float32", ls[0], ls[0])], "share devices"),
        (lambda c, ls: [Boundary(1, 0, (8, 8), "float32", ls[0], ls[1])], "higher stage"),
    ],
)
def test_bad_boundaries(make, match):
    cluster = p3(3)
    layouts = stage_layouts(cluster, 3)
    with pytest.raises(ValueError, match=match):
        transfer_costs(make(cluster, layouts), cluster, n_stages=3)


def test_bad_layout_for_shape_and_bad_cluster():
    cluster = p3(2)
    a = Layout(cluster.mesh((1, 4), hosts=(0,)), (Replicate(), Shard(2)))
    b = stage_layouts(cluster, 2)[1]
    with pytest.raises(ValueError, match="shards dim 2"):
        Boundary(0, 1, (8, 8), "float32", a, b)
    good = stage_layouts(cluster, 2)
    with pytest.raises(TypeError, match="topology.Cluster"):
        transfer_costs([Boundary(0, 1, (8, 8), "float32", good[0], good[1])], object())


def test_eager_target_in_simulation():
    """4 stages x 8 microbatches, forward transfer = half a forward step (backward = 2 forwards):
    eager 1F1B is no slower than 1F1B and within 10 % of the communication-free iteration."""
    n, m, f = 4, 8, 1.0
    kwargs = dict(forward_s=f, backward_s=2 * f, transfer_s=f / 2)
    eager = simulate(eager_one_f_one_b(n, m), **kwargs).iteration_s
    ofob = simulate(one_f_one_b(n, m), **kwargs).iteration_s
    free = simulate(eager_one_f_one_b(n, m), forward_s=f, backward_s=2 * f).iteration_s
    assert eager <= ofob
    assert eager <= 1.10 * free


@pytest.mark.parametrize("make", [one_f_one_b, eager_one_f_one_b])
@pytest.mark.parametrize("overlap", [True, False])
def test_global_transfer_order_is_deadlock_free(make, overlap):
    schedule = make(4, 8, skips=[(0, 3)])
    order = global_transfer_order(schedule)
    check_deadlock_free(schedule, order, overlap=overlap)
    plan = plan_pipeline(schedule, overlap=overlap)
    assert [s.peak_activations for s in plan.stages] == list(schedule.peak_activations)
    # every lane is a subsequence of the global order, each payload on exactly one lane
    assert sum(len(v) for v in plan.lanes.values()) == len(order)


def test_a_bad_order_is_reported_with_the_grid():
    from scheduler import ScheduleError

    schedule = one_f_one_b(2, 3)  # stage 0: F0 F1 B0 F2 B1 B2
    order = list(global_transfer_order(schedule))
    forward = [p for p in order if p.src == 0]
    rest = [p for p in order if p.src != 0]
    # lane 0 -> 1 moving F2 first: F2 needs B0, which needs F0 on stage 1, queued behind F2
    with pytest.raises(ScheduleError, match="deadlocks") as info:
        check_deadlock_free(schedule, [*reversed(forward), *rest], overlap=True)
    assert "clk" in str(info.value)
