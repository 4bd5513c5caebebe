"""Per-boundary transfer durations of a pipeline, from reshard plans costed on a cluster.

Pure (stdlib + the pure planning layer): every cross-stage tensor is described by a `Boundary`
(global shape, dtype, the producer's layout on its stage mesh, the consumer's layout on its mesh).
`transfer_costs` plans the activation move (producer -> consumer) and the gradient move back
(consumer's layout -> producer's layout, same shape) with `reshard.plan_reshard`, costs each plan on
a `topology.Cluster` and returns the durations in the form `scheduler.simulate` takes::

    costs = transfer_costs(boundaries, cluster)
    simulate(schedule, forward_s=..., backward_s=..., **costs.simulate_kwargs())

Costing: ``plan.simulate(cluster).makespan_s``, the network simulator of the reshard layer, on
the plan's own device -> host map.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from reshard.dtypes import dtype_name
from reshard.ir.layout import Layout
from reshard.ir.plan import ReshardPlan
from reshard.planner import plan_reshard
from topology.cluster import Cluster


@dataclass(frozen=True, slots=True)
class Boundary:
    """One tensor that stage `src_stage` produces and stage `dst_stage` consumes, per microbatch.

    `src` is its layout on the producer's mesh, `dst` on the consumer's mesh. Its gradient travels
    back with the layouts swapped. `dst_stage == src_stage + 1` is a pipeline boundary; a larger
    gap is a skip connection.
    """

    src_stage: int
    dst_stage: int
    shape: tuple[int, ...]
    dtype: str
    src: Layout
    dst: Layout

    def __post_init__(self) -> None:
        for name in ("src_stage", "dst_stage"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"Boundary {name} must be an int >= 0, got {v!r}")
        if self.dst_stage <= self.src_stage:
            raise ValueError(f"Boundary {self.src_stage} -> {self.dst_stage}: activations flow to a higher stage")
        object.__setattr__(self, "shape", tuple(int(n) for n in self.shape))
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        for name in ("src", "dst"):
            layout = getattr(self, name)
            if not isinstance(layout, Layout):
                raise TypeError(f"Boundary {name} must be a reshard.Layout, got {type(layout).__name__}")
            layout.check_shape(self.shape)
        if set(self.src.mesh.device_ids) & set(self.dst.mesh.device_ids):
            raise ValueError(
                f"Boundary {self.src_stage} -> {self.dst_stage}: the stage meshes share devices "
                f"{sorted(set(self.src.mesh.device_ids) & set(self.dst.mesh.device_ids))}; pipeline stages "
                f"must sit on disjoint meshes"
            )

    @property
    def is_skip(self) -> bool:
        return self.dst_stage > self.src_stage + 1

    @property
    def size_bytes(self) -> int:
        from reshard.dtypes import itemsize

        n = 1
        for d in self.shape:
            n *= d
        return n * itemsize(self.dtype)


@dataclass(frozen=True, slots=True)
class TransferCosts:
    """Durations, in seconds, of every cross-stage transfer of one microbatch.

    transfer_s[b] / backward_transfer_s[b]: activation b -> b + 1 / gradient b + 1 -> b.
    skip_transfer_s[(i, j)]: the skip connection (the simulator takes one duration for both
    directions: the larger of the two). forward_plans / backward_plans keep the plans by
    (src_stage, dst_stage) of the forward boundary.
    """

    transfer_s: tuple[float, ...]
    backward_transfer_s: tuple[float, ...]
    skip_transfer_s: Mapping[tuple[int, int], float]
    forward_plans: Mapping[tuple[int, int], ReshardPlan] = field(repr=False, default_factory=dict)
    backward_plans: Mapping[tuple[int, int], ReshardPlan] = field(repr=False, default_factory=dict)
    skip_backward_s: Mapping[tuple[int, int], float] = field(default_factory=dict)

    def simulate_kwargs(self) -> dict:
        """Keyword arguments for `scheduler.simulate`."""
        kwargs: dict = {
            "transfer_s": self.transfer_s,
            "backward_transfer_s": self.backward_transfer_s,
        }
        if self.skip_transfer_s:
            kwargs["skip_transfer_s"] = dict(self.skip_transfer_s)
        return kwargs

    def to_dict(self) -> dict:
        return {
            "transfer_s": list(self.transfer_s),
            "backward_transfer_s": list(self.backward_transfer_s),
            "skip_transfer_s": {f"{i}->{j}": s for (i, j), s in sorted(self.skip_transfer_s.items())},
            "skip_backward_s": {f"{j}->{i}": s for (i, j), s in sorted(self.skip_backward_s.items())},
        }


def plan_duration_s(plan: ReshardPlan, cluster: Cluster) -> float:
    """Seconds ``plan`` takes on ``cluster``: ``plan.simulate(cluster).makespan_s``."""
    return float(plan.simulate(cluster).makespan_s)


def transfer_costs(
    boundaries: Iterable[Boundary],
    cluster: Cluster,
    *,
    n_stages: int | None = None,
    strategy: str = "auto",
) -> TransferCosts:
    """Plan and cost every boundary's activation and gradient transfer on `cluster`.

    `boundaries` must include exactly one adjacent boundary b -> b + 1 for b in 0 .. n_stages - 2
    (`n_stages` defaults to the highest stage named + 1) and any number of skip connections.
    """
    if not isinstance(cluster, Cluster):
        raise TypeError(f"cluster must be a topology.Cluster, got {type(cluster).__name__}")
    boundaries = list(boundaries)
    for b in boundaries:
        if not isinstance(b, Boundary):
            raise TypeError(f"boundaries must be Boundary values, got {type(b).__name__}")
    if n_stages is None:
        n_stages = max((b.dst_stage for b in boundaries), default=0) + 1
    if n_stages < 2:
        raise ValueError("transfer_costs needs at least 2 stages (one boundary)")
    by_pair: dict[tuple[int, int], Boundary] = {}
    for b in boundaries:
        pair = (b.src_stage, b.dst_stage)
        if pair in by_pair:
            raise ValueError(f"two boundaries for stages {pair[0]} -> {pair[1]}")
        if b.dst_stage >= n_stages:
            raise ValueError(f"boundary {pair[0]} -> {pair[1]} names a stage >= n_stages={n_stages}")
        by_pair[pair] = b
    missing = [i for i in range(n_stages - 1) if (i, i + 1) not in by_pair]
    if missing:
        raise ValueError(f"no boundary for stage {missing[0]} -> {missing[0] + 1}; every adjacent pair needs one")
    forward_plans: dict[tuple[int, int], ReshardPlan] = {}
    backward_plans: dict[tuple[int, int], ReshardPlan] = {}
    fwd: dict[tuple[int, int], float] = {}
    bwd: dict[tuple[int, int], float] = {}
    for pair, b in sorted(by_pair.items()):
        forward_plans[pair] = plan_reshard(b.shape, b.dtype, b.src, b.dst, strategy=strategy, cluster=cluster)
        backward_plans[pair] = plan_reshard(b.shape, b.dtype, b.dst, b.src, strategy=strategy, cluster=cluster)
        fwd[pair] = plan_duration_s(forward_plans[pair], cluster)
        bwd[pair] = plan_duration_s(backward_plans[pair], cluster)
    adjacent = [(i, i + 1) for i in range(n_stages - 1)]
    skips = sorted(p for p in by_pair if p not in adjacent)
    return TransferCosts(
        transfer_s=tuple(fwd[p] for p in adjacent),
        backward_transfer_s=tuple(bwd[p] for p in adjacent),
        skip_transfer_s={p: max(fwd[p], bwd[p]) for p in skips},
        forward_plans=forward_plans,
        backward_plans=backward_plans,
        skip_backward_s={p: bwd[p] for p in skips},
    )


def linear_boundaries(
    shapes: Sequence[Sequence[int]] | Sequence[int],
    dtype: str,
    layouts: Sequence[tuple[Layout, Layout]],
) -> list[Boundary]:
    """Adjacent boundaries b -> b + 1 from per-boundary (producer layout, consumer layout) pairs.

    `shapes` is one shape for every boundary or one shape per boundary.
    """
    if shapes and isinstance(shapes[0], int):
        shapes = [tuple(shapes)] * len(layouts)  # type: ignore[assignment]
    if len(shapes) != len(layouts):
        raise ValueError(f"{len(shapes)} shapes for {len(layouts)} boundaries")
    return [
        Boundary(b, b + 1, tuple(shape), dtype, src, dst)  # type: ignore[arg-type]
        for b, (shape, (src, dst)) in enumerate(zip(shapes, layouts, strict=True))
    ]
