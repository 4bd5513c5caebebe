"""Casts in flight (``reshard(..., dtype=)``): the senders cast their shards before anything
crosses, so a float32 tree arrives as bfloat16 with half the bytes on the wire (float8 divided by
its scales: a quarter), every value exactly torch's own cast of the same tensor; per leaf by a tree
or a callable; misuse refused by name."""

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
          "f64": random_array((8, 4), "float64", 3)}
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
                                         r"float8_e4m3fn \(to float8 with a scale: dtype=reshard.Scaled"):
        reshard(t, src, Layout(dst, pl("R")), dtype="float8_e4m3fn")
    with pytest.raises(ValueError, match="not float32 -> int32"):
        reshard(t, src, Layout(dst, pl("R")), dtype=np.int32)
    with pytest.raises(TypeError, match="unsupported dtype"):
        reshard(t, src, Layout(dst, pl("R")), dtype="complex64")


def torch_scaled(x: np.ndarray, scales: np.ndarray, block, dtype: torch.dtype) -> torch.Tensor:
    """torch's own ``(x / scale).to(dtype)``, the scales repeated over their blocks, in float32."""
    s = torch.from_numpy(np.asarray(scales, dtype=np.float32))
    for axis, b in enumerate(block or ()):
        s = s.repeat_interleave(b, dim=axis)
    if block:
        s = s[tuple(slice(0, n) for n in x.shape)]
    return (torch.from_numpy(x).float() / s).to(dtype)


def assert_same_bits(got, want: torch.Tensor) -> None:
    have = got.to_torch()
    assert have.dtype == want.dtype and tuple(have.shape) == tuple(want.shape)
    assert torch.equal(have.view(torch.uint8), want.view(torch.uint8))


def test_float8_with_a_scale_per_tensor_or_per_block_is_cast_by_its_senders(view):
    """A float32/bfloat16 state dict arrives as float8 divided by its scales (one per tensor, or
    one per 4x4 block, as block-quantised engines keep them), every value torch's own cast of the
    same division, with a quarter of float32's bytes on the wire; into the receivers' own float8
    tensors too."""
    from reshard import Scaled

    src, dst = view([0, 1, 2], (3,)), view([3, 4], (2,))
    rng = np.random.default_rng(9)
    sd = {"w": (rng.standard_normal((10, 9)) * 300).astype(np.float32),  # some past float8's range: saturated
          "bf": random_array((6, 8), "float32", 5), "b": random_array((9,), "float32", 6)}
    tree = distribute(sd, Layout(src, pl("S0")))
    tree["bf"] = reshard(tree["bf"], src, Layout(src, pl("S1")), dtype="bfloat16")  # a bfloat16 source
    blocks = rng.uniform(0.5, 2.0, size=(3, 3)).astype(np.float32)  # ceil(10 / 4) x ceil(9 / 4)
    dtypes = {"w": Scaled("float8_e4m3fn", blocks, block=(4, 4)), "bf": Scaled(torch.float8_e5m2, 0.25),
              "b": Scaled("float8_e4m3fn", np.float32(0.07))}
    want = {"w": torch_scaled(sd["w"], blocks, (4, 4), torch.float8_e4m3fn),
            "bf": (tree["bf"].to_torch().float() / 0.25).to(torch.float8_e5m2),
            "b": torch_scaled(sd["b"], np.float32(0.07), None, torch.float8_e4m3fn)}
    to = lambda path, t: Layout(dst, pl("S1") if path == "w" else pl("R"))  # noqa: E731
    for shared_memory in (True, False):
        got = reshard(tree, src, to, dtype=dtypes, shared_memory=shared_memory)
        for k in sd:
            assert_same_bits(got[k], want[k])
    plain = wire_bytes(lowered_batch({"w": tree["w"]}, src, to, shared_memory=False))
    cast = wire_bytes(lowered_batch({"w": tree["w"]}, src, to, shared_memory=False, dtype={"w": dtypes["w"]}))
    assert plain == 4 * cast, (plain, cast)
    out = distribute({"w": torch.zeros((10, 9)).to(torch.float8_e4m3fn)}, lambda p, t: Layout(dst, pl("S1")))
    assert reshard({"w": tree["w"]}, src, to, out=out, dtype={"w": dtypes["w"]}) is out
    assert_same_bits(out["w"], want["w"])
    with pytest.raises(ValueError, match=r"out at 'w' is float8_e4m3fn\[10, 9\] but the reshard moves float32"):
        reshard({"w": tree["w"]}, src, to, out=out)
    with pytest.raises(ValueError, match=r"dtype for 'w': Scaled: a tensor of shape \[10, 9\] in blocks \[4, 4\] "
                                         r"takes scales of shape \[3, 3\], got \[2, 2\]"):
        reshard({"w": tree["w"]}, src, to, dtype={"w": Scaled("float8_e4m3fn", blocks[:2, :2], block=(4, 4))})
