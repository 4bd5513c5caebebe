"""Hypothesis strategies shared by the pure-layer property tests: random meshes (1-D to 3-D,
disjoint / overlapping / identical), layouts, uneven shapes, dtypes and strategies; numpy
oracles that do not use the code under test; hand-written programs for the executor and the
validator."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from reshard import STRATEGIES, Layout, Replicate, Shard
from reshard.dtypes import ITEMSIZE
from reshard.ir.placement import Partial, ReduceOp
from reshard.ir.program import Buffer, DeviceProgram, Program, Publish, Pull, Recv, Send
from reshard.ir.regions import layout_regions
from topology import Mesh

HOST_SPAN = 3  # global device d lives on host d // HOST_SPAN in every mesh
SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ------------------------------------------------------------------------------------ generators


@st.composite
def mesh_shapes(draw, max_size=8):
    ndim = draw(st.integers(1, 3))
    shape = []
    for _ in range(ndim):
        room = max_size // math.prod(shape) if shape else max_size
        shape.append(draw(st.integers(1, max(1, min(4, room)))))
    return tuple(shape)


def make_mesh(shape, ids) -> Mesh:
    return Mesh(shape, ids, [d // HOST_SPAN for d in ids])


@st.composite
def mesh_pairs(draw):
    src_shape = draw(mesh_shapes())
    dst_shape = draw(mesh_shapes())
    n_src, n_dst = math.prod(src_shape), math.prod(dst_shape)
    src_ids = draw(st.permutations(range(n_src)))
    mode = draw(st.sampled_from(["disjoint", "overlap", "same"]))
    if mode == "same" and dst_shape == src_shape:
        return make_mesh(src_shape, src_ids), make_mesh(src_shape, src_ids)
    if mode == "disjoint":
        dst_ids = [n_src + i for i in draw(st.permutations(range(n_dst)))]
    else:
        universe = list(range(n_src + n_dst))
        dst_ids = draw(st.permutations(universe))[:n_dst]
    return make_mesh(src_shape, src_ids), make_mesh(dst_shape, dst_ids)


def placements(draw, mesh_ndim, tensor_ndim, partial: ReduceOp | None = None):
    """One placement per mesh axis; negative shard dims too; with ``partial``, at least one axis is
    Partial(partial) when the mesh has an axis to spare for it."""
    choices = (
        [Replicate()] + [Shard(d) for d in range(tensor_ndim)] + [Shard(d - tensor_ndim) for d in range(tensor_ndim)]
    )
    out = [draw(st.sampled_from(choices)) for _ in range(mesh_ndim)]
    if partial is not None:
        for a in sorted(draw(st.sets(st.integers(0, mesh_ndim - 1), min_size=1))):
            out[a] = Partial(partial)
    return tuple(out)


@st.composite
def problems(draw):
    src_mesh, dst_mesh = draw(mesh_pairs())
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.lists(st.integers(0, 7), min_size=ndim, max_size=ndim)))
    src = Layout(src_mesh, placements(draw, src_mesh.ndim, ndim))
    dst = Layout(dst_mesh, placements(draw, dst_mesh.ndim, ndim))
    dtype = draw(st.sampled_from(sorted(ITEMSIZE)))
    strategy = draw(st.sampled_from(sorted(STRATEGIES)))
    return shape, dtype, src, dst, strategy


# ------------------------------------------------------------------------------------ independent oracles


def torch_chunk_pieces(n: int, k: int) -> list[tuple[int, int]]:
    """torch.chunk semantics, padded to ``k`` pieces: size ceil(n/k) each, trailing ones short or empty."""
    size = -(-n // k) if n else 0
    out = []
    for i in range(k):
        lo = min(i * size, n)
        out.append((lo, min(lo + size, n)))
    return out


def expected_region(layout: Layout, shape, flat: int):
    mesh = layout.mesh
    coords = np.unravel_index(flat, mesh.shape)
    box = []
    for dim, n in enumerate(shape):
        lo, hi = 0, n
        for axis, p in enumerate(layout.placements):
            if isinstance(p, Shard) and p.dim % len(shape) == dim:  # negative dims count from the last
                a, b = torch_chunk_pieces(hi - lo, mesh.shape[axis])[coords[axis]]
                lo, hi = lo + a, lo + b
        box.append((lo, hi))
    return tuple(box)


def mask(shape, box) -> np.ndarray:
    m = np.zeros(shape, dtype=bool)
    m[tuple(slice(lo, hi) for lo, hi in box)] = True
    return m


def regions_by_device(layout: Layout, shape) -> dict[int, tuple]:
    return dict(zip(layout.mesh.device_ids, layout_regions(layout, shape), strict=True))


def contributions_of(src: Layout, shape, dtype, seed) -> dict:
    """A random full tensor per contribution of ``src`` (one per coordinate of its Partial axes):
    integers, or quarter-integers in float64 (so ``avg`` is exact)."""
    rng = np.random.default_rng(seed)
    layout = src.for_shape(shape)
    keys = {layout.contribution(i) for i in range(layout.mesh.size)}
    if dtype == "float64":
        return {k: rng.integers(-8, 8, size=shape).astype(dtype) / 4 for k in sorted(keys)}
    return {k: rng.integers(-1000, 1000, size=shape).astype(dtype) for k in sorted(keys)}


def reduced(contributions: dict, op: ReduceOp) -> np.ndarray:
    fold = {ReduceOp.SUM: np.add, ReduceOp.AVG: np.add, ReduceOp.MAX: np.maximum, ReduceOp.MIN: np.minimum}[op]
    values = list(contributions.values())
    out = values[0].copy()
    for v in values[1:]:
        out = fold(out, v)
    return out / len(values) if op is ReduceOp.AVG else out


# ------------------------------------------------------------------------------------ properties

SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def partial_problems(draw):
    """Problems with a Partial source (every reduce op; integers, so results are exact, except
    ``avg`` on float64), the destination Partial at times too."""
    src_mesh, dst_mesh = draw(mesh_pairs())
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.lists(st.integers(0, 6), min_size=ndim, max_size=ndim)))
    op = draw(st.sampled_from(list(ReduceOp)))
    src = Layout(src_mesh, placements(draw, src_mesh.ndim, ndim, partial=op))
    dst_partial = draw(st.sampled_from([None, op]))
    dst = Layout(dst_mesh, placements(draw, dst_mesh.ndim, ndim, partial=dst_partial))
    dtype = "float64" if op is ReduceOp.AVG else draw(st.sampled_from(["int32", "int64"]))
    strategy = draw(st.sampled_from(sorted(STRATEGIES)))
    return shape, dtype, src, dst, strategy


# ------------------------------------------------------------------------------------ programs


def publish_in_window(order=("recv_a", "publish", "recv_b")) -> Program:
    """Device 1 receives ``a`` from 0 and ``b`` from 2 in one window and publishes ``a`` in it;
    device 2 pulls the relay ``a`` from 1, then sends ``b``. ``order``: device 1's ops."""
    a, b = ((0, 2),), ((2, 4),)
    ops = {"recv_a": Recv(0, (0, 1), a), "publish": Publish(2, a, 1), "recv_b": Recv(1, (2, 1), b)}
    return Program(
        "float32",
        (4,),
        (
            DeviceProgram(0, (4,), None, (Send(0, (0, 1), Buffer.SRC, a),), 0, ((0, 1),)),
            DeviceProgram(1, None, (4,), tuple(ops[k] for k in order), 0, ((0, 1), (1, 2)), windows=(3,)),
            DeviceProgram(
                2,
                (4,),
                (2,),
                (Pull(2, 1, a, a, buffer=Buffer.DST, after=1), Send(1, (2, 1), Buffer.SRC, b)),
                0,
                ((1, 2),),
                windows=(1, 1),
                relays=((1, (4,)),),
            ),
        ),
    )
