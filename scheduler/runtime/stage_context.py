"""What a stage's callables see of their device (``ctx``): its position, its state, and the
collectives over the stage mesh, differentiable where tensor parallelism needs them."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from scheduler.runtime.specs import WorkerSpec


class StageDevice(Protocol):
    """What a stage context reads of the worker that owns it (``StageWorker``)."""

    spec: WorkerSpec
    torch_device: torch.device

    def all_reduce(self, tensor: torch.Tensor, axis: int | None) -> torch.Tensor: ...


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, worker, axis, backward_reduce):
        ctx.worker, ctx.axis, ctx.backward_reduce = worker, axis, backward_reduce
        if backward_reduce:
            return tensor.clone()
        return worker.all_reduce(tensor.detach().clone(), axis)

    @staticmethod
    def backward(ctx, grad):
        if ctx.backward_reduce:
            return ctx.worker.all_reduce(grad.contiguous().clone(), ctx.axis), None, None, None
        return grad, None, None, None


class StageContext:
    """What a stage callable sees of its device: position, state, intra-stage collectives."""

    def __init__(self, worker: StageDevice):
        self._worker = worker
        self.state: Any = None

    @property
    def stage(self) -> int:
        return self._worker.spec.stage

    @property
    def device(self) -> int:
        return self._worker.spec.device

    @property
    def coords(self) -> tuple[int, ...]:
        """This device's position in the stage mesh."""
        return self._worker.spec.coords

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return self._worker.spec.mesh_shape

    @property
    def torch_device(self) -> torch.device:
        """Where this device's tensors live: create the stage's parameters there."""
        return self._worker.torch_device

    def all_reduce(self, tensor: torch.Tensor, axis: int | None = None) -> torch.Tensor:
        """Sum `tensor` over the stage mesh (or over mesh axis `axis` only); returns the sum, the
        same bits on every device. Not differentiable; see `reduce_from_tp` / `copy_to_tp`."""
        return self._worker.all_reduce(tensor, axis)

    def reduce_from_tp(self, tensor: torch.Tensor, axis: int | None = None) -> torch.Tensor:
        """Tensor parallelism's "g": all-reduce forward, identity backward (after a row-parallel
        linear layer)."""
        return _AllReduce.apply(tensor, self._worker, axis, False)

    def copy_to_tp(self, tensor: torch.Tensor, axis: int | None = None) -> torch.Tensor:
        """Tensor parallelism's "f": identity forward, all-reduce backward (before a
        column-parallel linear layer whose input is replicated)."""
        return _AllReduce.apply(tensor, self._worker, axis, True)


class MicrobatchContext:
    """Per-microbatch context: `saved` lives from this microbatch's forward to its backward."""

    def __init__(self, stage_ctx: StageContext, microbatch: int, target: Any):
        self.stage_ctx = stage_ctx
        self.microbatch = microbatch
        self.target = target
        self.saved: dict[str, Any] = {}

    def __getattr__(self, name: str) -> Any:  # state, stage, device, coords, all_reduce, ...
        return getattr(self.stage_ctx, name)
