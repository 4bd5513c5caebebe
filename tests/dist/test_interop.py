"""Meshes over the user's own actors and DTensor interop: trainer actors hold their weights as
torch DTensors (a real torch.distributed gloo world between them), the driver adopts them without a
copy and reshards them, in place, into inference actors' own tensors, which read them back as
DTensors of their own world; failures leave the inference weights untouched unless direct."""

from __future__ import annotations

import numpy as np
import pytest
import ray
from dist_helpers import assert_bit_exact

from reshard import DeviceMesh, Layout, ReshardError, Shard, reshard
from reshard.ir.placement import Replicate
from reshard.runtime import DeviceRole, adopt
from reshard.runtime.device import cross_memory

pytestmark = pytest.mark.dist

ROWS, COLS = 8, 6


@ray.remote(num_cpus=0)
class Worker(DeviceRole):
    """A user's actor: its own state, its own torch.distributed world, and the device role."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world
        self.weights = None

    def join_world(self, port: int) -> None:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=self.rank, world_size=self.world)

    def make_dtensor_weights(self, full) -> None:
        """The trainer's weights: a DTensor sharded by rows over its 1-D world, shared as is."""
        import torch
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard as TorchShard
        from torch.distributed.tensor import distribute_tensor

        mesh = init_device_mesh("cpu", (self.world,))
        self.weights = distribute_tensor(torch.from_numpy(full), mesh, [TorchShard(0)])
        self.reshard_device.from_dtensor("weights", self.weights)

    def make_plain_weights(self, shape) -> None:
        """The inference side's weights: a plain tensor in shard memory, shared to be written into."""
        import torch

        self.weights = self.reshard_device.empty(shape, torch.float64)
        self.weights.fill_(-1.0)
        self.reshard_device.share("weights", self.weights)

    def read_weights(self):
        return self.weights.numpy().copy()

    def as_dtensor(self, name: str):
        """Our result as a DTensor of this actor's own world: full_tensor() gathers it there."""
        from torch.distributed.device_mesh import init_device_mesh

        dt = self.reshard_device.to_dtensor(name, init_device_mesh("cpu", (self.world,)))
        return tuple(type(p).__name__ for p in dt.placements), dt.full_tensor().numpy()

    def share_model(self):
        """FSDP2's way: the whole state dict as DTensors, shared as one tree."""
        return self.reshard_device.share_state_dict({"layer": {"weight": self.weights}}, prefix="model.")

    def distribute_own_dtensor(self, mesh) -> str:
        """``distribute`` of a DTensor sharded over this world: this process holds one shard only."""
        from reshard import distribute

        try:
            distribute(self.weights, mesh)
        except TypeError as e:
            return str(e)
        return "accepted"

    def user_method(self) -> str:
        return f"rank {self.rank} still serves its own calls"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def worlds(ray_cluster):
    trainers = [Worker.remote(r, 2) for r in range(2)]
    infer = [Worker.remote(r, 2) for r in range(2)]
    for group in (trainers, infer):
        port = _free_port()
        ray.get([w.join_world.remote(port) for w in group], timeout=120)
    t_mesh = DeviceMesh.from_actors(trainers, (2,))
    i_mesh = DeviceMesh.from_actors(infer, (2,))
    yield trainers, infer, t_mesh, i_mesh
    t_mesh.shutdown()
    i_mesh.shutdown()
    assert ray.get(trainers[0].user_method.remote(), timeout=30).startswith("rank 0")  # detached, still running
    for w in (*trainers, *infer):
        ray.kill(w)


def test_dtensor_weights_resharded_in_place_into_inference_actors(worlds):
    trainers, infer, t_mesh, i_mesh = worlds
    full = np.arange(ROWS * COLS, dtype=np.float64).reshape(ROWS, COLS) / 8
    ray.get([w.make_dtensor_weights.remote(full) for w in trainers], timeout=60)
    ray.get([w.make_plain_weights.remote((ROWS, COLS)) for w in infer], timeout=60)
    weights = adopt(t_mesh, "weights")  # the layout comes from the DTensors
    assert weights.placements == (Shard(0),) and weights.shape == (ROWS, COLS)
    assert_bit_exact(weights.to_numpy(), full)
    target = adopt(Layout(i_mesh, (Replicate(),)), "weights")
    out = reshard(weights, t_mesh, Layout(i_mesh, (Replicate(),)), out=target)
    assert out is target
    for got in ray.get([w.read_weights.remote() for w in infer], timeout=60):
        assert_bit_exact(got, full)  # the inference actors' own tensors hold the new weights
    result = reshard(weights, t_mesh, Layout(i_mesh, (Shard(1),)))
    for placements, gathered in ray.get([w.as_dtensor.remote(result.name) for w in infer], timeout=60):
        assert placements == ("Shard",)  # full_tensor() is a collective of the inference world: both take part
        assert_bit_exact(gathered, full)
    assert ray.get(trainers[1].user_method.remote(), timeout=30).startswith("rank 1")


@pytest.mark.skipif(not cross_memory.available(), reason="this kernel does not let the user read its processes")
def test_framework_tensors_are_pulled_out_of_their_owners_memory(worlds):
    """The trainers' DTensor shards are torch's own memory, not the library's: the inference
    actors on this machine read their slices out of it (cross-memory attach), no message sent."""
    from reshard.ir.program import Pull
    from reshard.runtime import lowered_reshard
    from reshard.runtime.messages import CROSS_MEMORY

    trainers, infer, t_mesh, i_mesh = worlds
    layout = Layout(i_mesh, (Shard(1),))
    for step in (1, 2):  # new tensors shared under the same name: read where they are now, not where they were
        full = np.arange(ROWS * COLS, dtype=np.float64).reshape(ROWS, COLS) * step
        ray.get([w.make_dtensor_weights.remote(full) for w in trainers], timeout=60)
        weights = adopt(t_mesh, "weights")
        assert {d[0] for d in weights._shared.values()} == {CROSS_MEMORY} and len(weights._shared) == 2
        lowered = lowered_reshard(weights, layout)
        assert {type(op) for p in lowered.program.devices for op in p.all_ops} == {Pull} and not lowered.groups
        assert_bit_exact(reshard(weights, t_mesh, layout).to_numpy(), full)


def _fail_next_run(ctx):
    from reshard.ir.program import Copy, Pull

    def hook(run, op):
        if not isinstance(op, Copy | Pull):
            ctx.before_op = None
            raise RuntimeError("injected failure")

    ctx.before_op = hook


def test_a_failed_reshard_leaves_staged_outputs_untouched(worlds):
    trainers, infer, t_mesh, i_mesh = worlds
    full = np.full((ROWS, COLS), 7.0)
    ray.get([w.make_dtensor_weights.remote(full) for w in trainers], timeout=60)
    ray.get([w.make_plain_weights.remote((ROWS, COLS)) for w in infer], timeout=60)
    weights = adopt(t_mesh, "weights")
    target = adopt(Layout(i_mesh, (Replicate(),)), "weights")
    i_mesh.call(_fail_next_run, devices=[1])
    with pytest.raises(ReshardError, match="injected failure"):
        reshard(weights, t_mesh, Layout(i_mesh, (Replicate(),)), out=target, shared_memory=False)
    for got in ray.get([w.read_weights.remote() for w in infer], timeout=60):
        assert (got == -1.0).all()  # staged, then committed: nothing was written
    reshard(weights, t_mesh, Layout(i_mesh, (Replicate(),)), out=target, direct=True, shared_memory=False)
    for got in ray.get([w.read_weights.remote() for w in infer], timeout=60):
        assert_bit_exact(got, full)


def test_bad_interop_input(worlds):
    trainers, infer, t_mesh, i_mesh = worlds
    ray.get([w.make_plain_weights.remote((ROWS, COLS)) for w in infer], timeout=60)
    with pytest.raises(ValueError, match="did not all share their placements"):
        adopt(i_mesh, "weights")
    target = adopt(Layout(i_mesh, (Replicate(),)), "weights")
    ray.get([w.make_dtensor_weights.remote(np.zeros((ROWS, COLS))) for w in trainers], timeout=60)
    with pytest.raises(ValueError, match=r"shared a shard of \(8, 6\) laid out \('S\(0\)',\)"):
        adopt(Layout(t_mesh, (Replicate(),)), "weights")  # the DTensor says rows are sharded
    src = adopt(Layout(i_mesh, (Replicate(),)), "weights")
    with pytest.raises(ValueError, match="out is laid out"):
        reshard(src, i_mesh, Layout(i_mesh, (Shard(0),)), out=target)
    with pytest.raises(ValueError, match="pass them as out="):
        reshard(src, i_mesh, Layout(i_mesh, (Shard(0),)), direct=True)
    with pytest.raises(TypeError, match="DeviceRole"):
        DeviceMesh.from_actors([object(), object()], (2,))
    with pytest.raises(Exception, match="holds no shard 'nothing'"):
        adopt(Layout(i_mesh, (Replicate(),)), "nothing")


def test_holds_and_frees_still_in_flight_when_the_mesh_closed_do_nothing(ray_cluster):
    """Handles release their shards asynchronously: one that reaches an actor after its mesh was
    shut down (the actor detached, its shards already dropped) must not fail there."""
    from reshard.runtime.messages import Ticket

    w = Worker.remote(0, 1)
    try:
        DeviceMesh.from_actors([w], (1,)).shutdown()
        late = Ticket("a controller whose mesh is gone", 1)
        assert ray.get(w.reshard_free.remote(late, ("x",)), timeout=30) == 0
        assert ray.get(w.reshard_acquire.remote(late, "x", "h"), timeout=30) is False
        assert ray.get(w.reshard_release.remote(late, "x", "h"), timeout=30) is None
        assert ray.get(w.user_method.remote(), timeout=30).startswith("rank 0")
    finally:
        ray.kill(w)


def test_a_dtensor_state_dict_is_shared_and_adopted_as_one_tree(worlds):
    trainers, infer, t_mesh, i_mesh = worlds
    full = np.arange(ROWS * COLS, dtype=np.float64).reshape(ROWS, COLS) / 4
    ray.get([w.make_dtensor_weights.remote(full) for w in trainers], timeout=60)
    names = ray.get([w.share_model.remote() for w in trainers], timeout=60)
    assert names[0] == names[1] == {"layer": {"weight": "model.layer.weight"}}
    tree = adopt(t_mesh, names[0])  # placements from the DTensors
    assert tree["layer"]["weight"].placements == (Shard(0),)
    assert_bit_exact(tree["layer"]["weight"].to_numpy(), full)
    moved = reshard(tree, t_mesh, {"layer": {"weight": Layout(i_mesh, (Replicate(),))}})
    assert_bit_exact(moved["layer"]["weight"].to_numpy(), full)
    said = ray.get(trainers[0].distribute_own_dtensor.remote(t_mesh), timeout=60)
    assert "sharded over 2 ranks" in said and "from_dtensor" in said and "adopt" in said


def _reback_after_a_plain_share(ctx) -> str:
    import torch

    t = torch.zeros(8)
    ctx.share("plain", t)
    try:
        ctx.share("again", t, reback=True)
    except ValueError as e:
        return str(e)
    finally:
        ctx.unshare("plain")
    return "accepted"


def test_a_storage_shared_without_reback_is_not_moved_later(worlds):
    """Moving a storage would leave the arrays kept over it pointing at freed memory: refused."""
    _, _, _, i_mesh = worlds
    said = i_mesh.call(_reback_after_a_plain_share, devices=[0])[0]
    assert "a tensor over the same storage was shared without reback" in said
