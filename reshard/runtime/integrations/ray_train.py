"""Ray Train: every rank of a ``TorchTrainer``'s worker group as one device mesh, and weight syncs
that every rank calls at the same point of its step while one rank drives them.

Inside the train function (Ray Train V2, the default since Ray 2.51)::

    from reshard.integrations import ray_train

    group = ray_train.attach()                                        # every rank
    sync = group.weight_sync(model.state_dict(), out=config["engine"])  # every rank, once
    for batch in data:
        ...; optimizer.step()
        sync()                                                         # every rank, each step

``attach`` exchanges the workers' actor handles over the ranks' process group (torch.distributed,
which ``TorchTrainer`` set up), and the driving rank (0 unless told) attaches them all
(``DeviceMesh.attach``) while the others wait inside the call; every rank then is a device
(``reshard.runtime.current_device()``). ``weight_sync`` shares the rank's state dict as it is
(FSDP2's DTensors with their placements; no copy) and returns ``sync``: every rank calls it after
its optimizer step; the ranks meet, the driving rank reshards the whole tree into ``out`` (handles
of the inference side's tensors, e.g. ``adopt`` of what its actors shared) in one call, and the
ranks meet again before any of them goes on to write its parameters. An error on the driving rank
is raised on every rank.

A worker that runs its train function on the thread that serves calls (Ray Train V1, any
single-threaded actor busy in one long call) cannot be attached: ``attach`` raises on every rank
with the error that names the busy actors. Workers of other frameworks need the same three things:
a process group (or any all-gather) to exchange handles, actors that serve calls while they train
or generate (verl's and vLLM's workers run their loops in a thread too), and one point in their
loop where every rank calls ``sync``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from reshard.errors import ReshardError

DEFAULT_TIMEOUT_S = 120.0


@dataclass
class WorkerGroup:
    """What ``attach`` returns on every rank: its ``rank`` in a group of ``world``; ``mesh``, the
    group's DeviceMesh on the driving rank (None elsewhere); ``device``, this rank's device."""

    rank: int
    world: int
    drive_rank: int
    mesh: Any
    device: Any
    process_group: Any = None
    timeout_s: float = DEFAULT_TIMEOUT_S

    @property
    def drives(self) -> bool:
        return self.rank == self.drive_rank

    def run(self, fn: Callable[[], Any]) -> Any:
        """Every rank calls it: the ranks meet, the driving rank runs ``fn()`` while the others wait
        here, and the ranks meet again; ``fn``'s result on the driving rank (None elsewhere). If
        ``fn`` raised, every rank raises a ``ReshardError`` that carries its message."""
        import torch.distributed as dist

        dist.barrier(group=self.process_group)  # every rank is done writing what fn reads
        result, caught = None, None
        if self.drives:
            try:
                result = fn()
            except Exception as e:
                caught = e
        said = [None if caught is None else f"{type(caught).__name__}: {caught}"]
        dist.broadcast_object_list(said, src=self.drive_rank, group=self.process_group)
        if said[0] is not None:
            if caught is not None:
                raise ReshardError(f"rank {self.rank} (driving): {said[0]}") from caught
            raise ReshardError(f"rank {self.rank}: the driving rank {self.drive_rank} failed: {said[0]}")
        return result

    def share(self, state_dict, prefix: str = "", *, reback: bool = False):
        """``share_state_dict`` of this rank's tensors, no copy (``reback``: their storage moved into
        shared memory once, in place; peers then map it); the tree of names, on every rank."""
        return self.device.share_state_dict(state_dict, prefix=prefix, reback=reback)

    def weight_sync(
        self, state_dict, out, dst_layouts=None, *, prefix: str = "", reback: bool = False, **options
    ) -> Callable[[], Any]:
        """Every rank, once: share ``state_dict`` and return ``sync()``, which every rank calls at the
        same point of each step (after its optimizer step): one ``reshard`` of the whole tree into
        ``out`` (a tree of handles of the receivers' tensors, shaped as the state dict; on the
        driving rank, others may pass None) laid out as ``out`` is, or as ``dst_layouts``;
        ``reback``: as ``share``'s (a sync on one machine then maps the trainers' memory instead of
        reading it across processes); ``options`` go to ``reshard`` (``timeout_s``, ``direct``,
        ``dtype``, ...)."""
        from reshard.pytree import flatten, unflatten
        from reshard.runtime import adopt, reshard

        names = self.share(state_dict, prefix=prefix, reback=reback)
        tree = self.run(lambda: adopt(self.mesh, names, timeout_s=self.timeout_s))  # once every rank shared
        if not self.drives:
            return lambda: self.run(lambda: None)
        if dst_layouts is None:
            leaves, _, treedef = flatten(out, lambda x: hasattr(x, "layout"))
            dst_layouts = unflatten(treedef, [t.layout for t in leaves])
        return lambda: self.run(lambda: reshard(tree, self.mesh, dst_layouts, out=out, **options))


def attach(
    shape=None, *, drive_rank: int = 0, process_group=None, timeout_s: float = DEFAULT_TIMEOUT_S, **options
) -> WorkerGroup:
    """Every rank of the worker group calls it in its train function: the workers become one
    DeviceMesh of ``shape`` (default ``(world,)``, in rank order), made and held by ``drive_rank``
    (module docstring). ``process_group``: the ranks' torch.distributed group (default: the world
    ``TorchTrainer`` set up); ``options`` go to ``DeviceMesh.attach`` (``shared_memory``, ...).
    Raises ``ReshardError`` on every rank when the driving rank could not attach the group."""
    import ray
    import torch.distributed as dist

    from reshard.runtime import DeviceMesh, current_device

    if not dist.is_initialized():
        raise RuntimeError(
            "reshard.integrations.ray_train.attach: torch.distributed is not initialised in this worker; call it "
            "inside a TorchTrainer's train function (or init_process_group first)"
        )
    rank, world = dist.get_rank(process_group), dist.get_world_size(process_group)
    handles: list = [None] * world
    dist.all_gather_object(handles, ray.get_runtime_context().current_actor, group=process_group)
    mesh, error = None, None
    if rank == drive_rank:
        try:
            mesh = DeviceMesh.attach(handles, tuple(shape or (world,)), startup_timeout_s=timeout_s, **options)
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
    said = [error]
    dist.broadcast_object_list(said, src=drive_rank, group=process_group)
    if said[0] is not None:
        raise ReshardError(f"ray_train.attach: rank {drive_rank} could not attach the worker group: {said[0]}")
    return WorkerGroup(rank, world, drive_rank, mesh, current_device(), process_group, timeout_s)


__all__ = ["WorkerGroup", "attach"]
