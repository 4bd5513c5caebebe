"""Shared helpers of the dist tests."""

from __future__ import annotations

import numpy as np

from reshard import Replicate, Shard
from reshard.dtypes import BIT_PATTERN
from reshard.ir.regions import layout_regions


def pl(spec: str):
    """``"S0 R S1"`` -> (Shard(0), Replicate(), Shard(1))."""
    return tuple(Replicate() if p == "R" else Shard(int(p[1:])) for p in spec.split())


def random_array(shape, dtype: str, seed: int = 0):
    """Random bit patterns of ``dtype`` (numpy array; a torch tensor for the dtypes numpy lacks:
    bfloat16, float8)."""
    rng = np.random.default_rng(seed)
    if dtype == "bool":
        return rng.integers(0, 2, size=shape).astype(bool)
    storage = BIT_PATTERN.get(dtype, dtype)
    n = int(np.prod(shape, dtype=np.int64)) * np.dtype(storage).itemsize
    a = np.frombuffer(rng.bytes(n), dtype=np.uint8).view(storage).reshape(shape).copy()
    if dtype in BIT_PATTERN:
        import torch

        return torch.from_numpy(a).view(getattr(torch, dtype))
    return a


def bits(a) -> np.ndarray:
    """Bit pattern of a numpy array or torch tensor, for bit-exact comparison (NaNs included)."""
    try:
        import torch

        if isinstance(a, torch.Tensor):
            name = str(a.dtype).removeprefix("torch.")
            a = a.view(getattr(torch, BIT_PATTERN[name])).numpy() if name in BIT_PATTERN else a.numpy()
    except ImportError:
        pass
    a = np.ascontiguousarray(a)
    return a.reshape(-1).view(np.uint8) if a.size else np.zeros(0, np.uint8)


def assert_bit_exact(got, expected) -> None:
    assert tuple(got.shape) == tuple(expected.shape), (got.shape, expected.shape)
    names = [str(a.dtype).removeprefix("torch.") for a in (got, expected)]
    assert names[0] == names[1], names
    assert np.array_equal(bits(got), bits(expected))


def assert_shards(tensor, full) -> None:
    """Every device holds exactly its region of ``full``."""
    shards = tensor.local_shards(as_torch=tensor.dtype_name in BIT_PATTERN)
    regions = layout_regions(tensor.layout, tuple(full.shape))
    assert sorted(shards) == list(range(tensor.mesh.size))
    for i, box in enumerate(regions):
        expected = full[tuple(slice(lo, hi) for lo, hi in box)]
        assert_bit_exact(shards[i], expected)


def read(tensor):
    return tensor.to_torch() if tensor.dtype_name in BIT_PATTERN else tensor.to_numpy()


def groups_of(stats: dict, channel: str = "") -> set[tuple[int, ...]]:
    """The device tuples of the live reshard communicators in a device's ``stats()``."""
    return {g for (_, (ch, g)) in stats["groups"] if ch == channel}


class Gate:
    """A victim's run says it arrived at an op and waits to be let go (an async Ray actor)."""

    def __init__(self):
        import asyncio

        self.arrived, self.released = asyncio.Event(), asyncio.Event()

    async def arrive(self) -> None:
        self.arrived.set()

    async def release(self) -> None:
        self.released.set()

    async def wait_arrived(self, timeout_s: float) -> bool:
        return await _within(self.arrived, timeout_s)

    async def wait_released(self, timeout_s: float) -> bool:
        return await _within(self.released, timeout_s)


async def _within(event, timeout_s: float) -> bool:
    import asyncio

    try:
        await asyncio.wait_for(event.wait(), timeout_s)
        return True
    except asyncio.TimeoutError:
        return False


def assert_listens_on_no_wildcard(found: dict, pool) -> None:
    """The run recorded its driver's and every device's sockets: the stores and gloo pairs it
    opened are among them, and none listens on every interface."""
    from bench.sockets import wildcards

    assert set(found) == {"driver", *(f"device {d}" for d in pool.device_ids)}, found
    assert any(proto == "tcp" for proto, _, _ in found["driver"]["listening"]), "the driver's store is missing"
    assert wildcards(found) == {}
