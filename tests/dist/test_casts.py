"""Casts in flight (``reshard(..., dtype=)``): the senders cast their shards before anything
crosses, so a float32 tree arrives as bfloat16 with half the bytes on the wire, every value exactly
torch's own cast of the same tensor; per leaf by a tree or a callable; misuse refused by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dist_helpers import assert_bit_exact, pl, random_array

from reshard import Layout, distribute, reshard
from reshard.runtime import lowered_batch

pytestmark = pytest.mark.dist


def assert_torch_cast(got, x: np.ndarray, dtype: torch.dtype) -> None:
    """``got`` (a ShardedTensor) holds exactly ``torch.from_numpy(x).to(dtype)``, bit for bit."""
    want = torch.from_numpy(x).to(dtype)
    have = got.to_torch()
    assert have.dtype == dtype and tuple(have.shape) == tuple(want.shape)
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[want.element_size()]
    assert torch.equal(have.view(bits), want.view(bits))


def wire_bytes(batch) -> int:
    from bench.local import pair_bytes

    return sum(sum(pair_bytes(t.plan).values()) for t in batch.tensors)


def test_a_tree_cast_by_its_senders(view):
    src, dst = view([0, 1], (2,)), view([2, 3], (2,))
    sd = {"w": random_array((16, 12), "float32", 1), "b": random_array((12,), "float32", 2),
          "f64": random_array((8, 4), "float64", 3)}  # fmt: skip
    tree = distribute(sd, Layout(src, pl("S0")))
    to = Layout(dst, pl("S0"))
    for shared_memory in (True, False):
        got = reshard(tree, src, to, dtype="bfloat16", shared_memory=shared_memory)
        for k, x in sd.items():
            assert_torch_cast(got[k], x, torch.bfloat16)
    plain = wire_bytes(lowered_batch(tree, src, to, shared_memory=False))
    cast = wire_bytes(lowered_batch(tree, src, to, shared_memory=False, dtype=torch.bfloat16))
    assert plain > 0 and plain >= 2 * cast, (plain, cast)  # float32 -> bfloat16: half; float64 -> bfloat16: a quarter
    per_leaf = reshard(tree, src, to, dtype=lambda path, t: {"w": torch.float16, "f64": "float32"}.get(path))
    assert [per_leaf[k].dtype_name for k in sd] == ["float16", "float32", "float32"]
    assert_torch_cast(per_leaf["w"], sd["w"], torch.float16)
    assert_torch_cast(per_leaf["f64"], sd["f64"], torch.float32)
    assert_bit_exact(per_leaf["b"].to_numpy(), sd["b"])


def test_a_cast_into_the_receivers_own_tensors(view):
    src, dst = view([0, 1], (2,)), view([2, 3], (2,))
    x = random_array((10, 6), "float32", 4)
    t = distribute(x, Layout(src, pl("S0")))
    out = distribute(np.zeros((10, 6), np.float16), Layout(dst, pl("R")))
    assert reshard(t, src, Layout(dst, pl("R")), out=out, dtype="float16") is out
    assert_torch_cast(out, x, torch.float16)
    with pytest.raises(ValueError, match=r"out is float16\[10, 6\] but the reshard moves float32.*pass dtype="):
        reshard(t, src, Layout(dst, pl("R")), out=out)
    with pytest.raises(ValueError, match="casts between float64, float32, float16, bfloat16 only, not float32 -> "
                                         "float8_e4m3fn"):  # fmt: skip
        reshard(t, src, Layout(dst, pl("R")), dtype="float8_e4m3fn")
    with pytest.raises(ValueError, match="not float32 -> int32"):
        reshard(t, src, Layout(dst, pl("R")), dtype=np.int32)
    with pytest.raises(TypeError, match="unsupported dtype"):
        reshard(t, src, Layout(dst, pl("R")), dtype="complex64")
