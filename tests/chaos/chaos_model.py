"""The model a chaos run keeps in sync: a few tensors on a destination mesh, written by whole-model
``reshard(..., out=...)`` steps, and what every device holds of them.

``Model.versions`` reads every live device's shard of every tensor and says which version each
one holds: the one the outputs held before the step (``OLD``), the one the step wrote (``NEW``),
either (``SAME``: the two agree there, an empty shard say), or neither (``TORN``: half of each, or
other bits).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import ray

from reshard import Layout, Replicate, Shard, distribute, free
from reshard.ir.regions import layout_regions

OLD, NEW, SAME, TORN = "old", "new", "same", "torn"
DTYPES = ("float64", "float32", "float16", "int64", "int32", "int8", "uint8", "bool")  # numpy's own
MAX_ELEMENTS = 4096


@dataclass
class Model:
    """The outputs (``outs``: name -> ShardedTensor on ``mesh``) and the bits they hold (``expected``)."""

    mesh: object
    outs: dict
    expected: dict
    syncs: int = 0  # the syncs it served

    @property
    def devices(self) -> tuple[int, ...]:
        return tuple(self.mesh.device_ids)

    def shapes(self) -> dict:
        return {k: (v.shape, v.dtype.name) for k, v in self.expected.items()}

    def versions(self, alive, new: dict, timeout_s: float) -> dict:
        """``{(tensor, device): OLD | NEW | SAME | TORN}`` over the live devices of the model."""
        seen = {}
        for name, t in self.outs.items():
            regions = layout_regions(t.layout, t.shape)
            for i, d in enumerate(self.devices):
                if d not in alive:
                    continue
                box = tuple(slice(lo, hi) for lo, hi in regions[i])
                got = ray.get(alive[d].reshard_fetch.remote(t.name, timeout_s), timeout=timeout_s + 30)
                old, now = _same(got, self.expected[name][box]), _same(got, new[name][box])
                seen[(name, d)] = SAME if old and now else OLD if old else NEW if now else TORN
        return seen

    def free(self) -> None:
        try:
            free(self.outs)
        except Exception:  # its devices died with the Ray session's view of them: nothing to free
            pass
        self.outs = {}


def new_data(rng: np.random.Generator, shapes: dict) -> dict:
    """A version of the model's tensors: random bits of each shape and dtype."""
    out = {}
    for name, (shape, dtype) in shapes.items():
        n = int(np.prod(shape))
        if dtype == "bool":
            out[name] = rng.integers(0, 2, size=shape).astype(bool)
        else:
            item = np.dtype(dtype).itemsize
            out[name] = np.frombuffer(rng.bytes(n * item), dtype=dtype).reshape(shape).copy()
    return out


def random_shapes(rng) -> dict:
    """3-5 tensors, 1-3 dimensions, up to ``MAX_ELEMENTS`` elements, random numpy dtypes."""
    shapes = {}
    for k in range(rng.randint(3, 5)):
        ndim = rng.randint(1, 3)
        dims = tuple(rng.randint(1, 24) for _ in range(ndim))
        while int(np.prod(dims)) > MAX_ELEMENTS:
            dims = tuple(max(1, d // 2) for d in dims)
        shapes[f"layer{k}"] = (dims, rng.choice(DTYPES))
    return shapes


def random_layouts(rng, mesh, shapes: dict) -> dict:
    return {
        name: Layout(
            mesh, tuple(Replicate() if rng.random() < 0.3 else Shard(rng.randrange(len(shape))) for _ in mesh.shape)
        )
        for name, (shape, _) in shapes.items()
    }


def build(rng, data_rng, mesh, timeout_s: float) -> Model:
    """A new model on ``mesh``: random tensors distributed in random layouts."""
    shapes = random_shapes(rng)
    data = new_data(data_rng, shapes)
    layouts = random_layouts(rng, mesh, shapes)
    outs = distribute(data, lambda path, t: layouts[path], timeout_s=timeout_s)
    return Model(mesh, outs, data)


def _same(got: np.ndarray, expected: np.ndarray) -> bool:
    if tuple(got.shape) != tuple(expected.shape):
        return False
    return np.array_equal(np.ascontiguousarray(got).view(np.uint8), np.ascontiguousarray(expected).view(np.uint8))
