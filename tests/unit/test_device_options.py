"""DeviceOptions: one set of defaults and one validation for both ways of making device actors."""

from __future__ import annotations

import inspect

import pytest

from reshard.runtime.device_options import DeviceOptions
from reshard.runtime.driver.mesh import DeviceMesh

pytestmark = pytest.mark.unit
SHARED = ("op_timeout_s", "staging_keep_bytes", "buffer_pool_bytes", "assembly_bytes", "shared_memory")


@pytest.mark.parametrize("make", [DeviceMesh.create, DeviceMesh.from_actors])
def test_both_constructors_default_to_the_same_options(make):
    params = inspect.signature(make).parameters
    assert {name: params[name].default for name in SHARED} == {name: getattr(DeviceOptions, name) for name in SHARED}


@pytest.mark.parametrize(
    ("field", "bad", "says"),
    [
        ("op_timeout_s", 0, "positive finite number of seconds"),
        ("op_timeout_s", float("inf"), "positive finite number of seconds"),
        ("staging_keep_bytes", -1, "0 keeps none"),
        ("buffer_pool_bytes", 1.5, "0 disables the pool"),
        ("assembly_bytes", True, "0 writes destinations in place"),
        ("torch_threads", -2, "0 leaves them as they are"),
        ("caller_check_s", -1, "positive finite number of seconds"),
    ],
)
def test_bad_options_are_refused_naming_the_option(field, bad, says):
    with pytest.raises(ValueError, match=f"{field} must be .*{says}" if "seconds" not in says else says):
        DeviceOptions(**{field: bad})


def test_every_device_is_told_its_options_and_device_type():
    options = DeviceOptions(op_timeout_s=5, torch_threads=0)
    shipped = options.for_device("cpu")
    assert isinstance(shipped, DeviceOptions) and shipped.device_type == "cpu"  # typed across the boundary
    assert shipped == DeviceOptions(op_timeout_s=5.0, torch_threads=0, device_type="cpu")
    assert options.for_device("cuda").shared_memory is True  # GPU devices: CUDA IPC pulls
    assert DeviceOptions(shared_memory=False).for_device("cuda").shared_memory is False
    with pytest.raises(ValueError, match="device_type must be 'cpu', 'cuda' or None"):
        DeviceOptions(device_type="tpu")
