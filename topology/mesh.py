"""Abstract device meshes: a grid of global device ids, each placed on a host."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True, init=False)
class Mesh:
    """An n-D grid of devices, independent of any runtime.

    ``device_ids`` and ``host_ids`` are flat, row-major over ``shape``. Two meshes that name the
    same device id name the same device; two devices with the same host id share a host (a NIC).
    By default axis 0 enumerates hosts: ``devices_per_host`` is the product of the other axes.
    """

    shape: tuple[int, ...]
    device_ids: tuple[int, ...]
    host_ids: tuple[int, ...]
    axis_names: tuple[str, ...] | None
    _hash: int = field(compare=False, repr=False)

    def __init__(
        self,
        shape,
        device_ids=None,
        host_ids=None,
        *,
        devices_per_host: int | None = None,
        axis_names=None,
    ):
        shape = _as_shape(shape)
        size = math.prod(shape)
        if device_ids is None:
            device_ids = range(size)
        device_ids = tuple(int(d) for d in device_ids)
        if len(device_ids) != size:
            raise ValueError(
                f"Mesh{shape} has {size} positions but {len(device_ids)} device_ids were given; "
                f"pass exactly one device id per position"
            )
        if len(set(device_ids)) != size or min(device_ids) < 0:
            raise ValueError(f"Mesh{shape}: device_ids must be distinct non-negative ints, got {device_ids}")
        if host_ids is None:
            dph = default_devices_per_host(shape) if devices_per_host is None else devices_per_host
            if not isinstance(dph, int) or dph <= 0 or size % dph:
                raise ValueError(
                    f"devices_per_host={dph!r} must be a positive int dividing the mesh size {size} "
                    f"(mesh shape {shape}); e.g. devices_per_host={default_devices_per_host(shape)}"
                )
            host_ids = tuple(d // dph for d in device_ids)
        elif devices_per_host is not None:
            raise ValueError("pass either host_ids or devices_per_host, not both")
        host_ids = tuple(int(h) for h in host_ids)
        if len(host_ids) != size or min(host_ids) < 0:
            raise ValueError(f"Mesh{shape}: need {size} non-negative host_ids, got {host_ids}")
        if axis_names is not None:
            axis_names = tuple(str(a) for a in axis_names)
            if len(axis_names) != len(shape) or len(set(axis_names)) != len(axis_names):
                raise ValueError(f"axis_names {axis_names} must be {len(shape)} distinct names for mesh {shape}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "device_ids", device_ids)
        object.__setattr__(self, "host_ids", host_ids)
        object.__setattr__(self, "axis_names", axis_names)
        object.__setattr__(self, "_hash", hash((shape, device_ids, host_ids, axis_names)))

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"Mesh({self.shape}, devices={_compact(self.device_ids)}, hosts={_compact(self.host_ids)})"

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return len(self.device_ids)

    @property
    def hosts(self) -> tuple[int, ...]:
        """Distinct host ids, in order of first appearance."""
        return tuple(dict.fromkeys(self.host_ids))

    def coords(self, flat_index: int) -> tuple[int, ...]:
        """Mesh coordinates of the device at ``flat_index`` (row-major)."""
        out = []
        for n in reversed(self.shape):
            flat_index, c = divmod(flat_index, n)
            out.append(c)
        return tuple(reversed(out))

    def host_of(self, device_id: int) -> int:
        return self.host_ids[self.device_ids.index(device_id)]

    def to_msgpack_obj(self) -> list:
        return [list(self.shape), list(self.device_ids), list(self.host_ids), self.axis_names and list(self.axis_names)]

    @classmethod
    def from_msgpack_obj(cls, obj) -> Mesh:
        shape, devices, hosts, names = obj
        return cls(tuple(shape), devices, hosts, axis_names=names)


def device_hosts(*meshes: Mesh, hosts: Mapping[int, int] | None = None) -> dict[int, int]:
    """Global device id -> host id over ``meshes``, in order of first appearance.

    Without ``hosts``: the meshes' own host ids (a device that two meshes place on different hosts
    is an error). With ``hosts`` (an override, e.g. every device of one shared-memory machine on
    one host): its entries for the meshes' devices, each of which it must name.
    """
    if hosts is None:
        out: dict[int, int] = {}
        for mesh in meshes:
            for d, h in zip(mesh.device_ids, mesh.host_ids, strict=True):
                if out.setdefault(d, h) != h:
                    raise ValueError(
                        f"device {d} sits on host {out[d]} in one mesh but on host {h} in {mesh}; "
                        f"give the meshes the same host ids for a shared device"
                    )
        return out
    if not isinstance(hosts, Mapping):
        raise TypeError(f"hosts must map global device ids to host ids (a dict), got {type(hosts).__name__}")
    out = {}
    for mesh in meshes:
        for d in mesh.device_ids:
            if d not in hosts:
                raise ValueError(f"hosts has no host for device {d} of {mesh}; map every device of the meshes")
            h = hosts[d]
            if not isinstance(h, numbers.Integral) or isinstance(h, bool) or h < 0:
                raise ValueError(f"hosts maps device {d} to {h!r}; host ids are non-negative ints")
            out[d] = int(h)
    return out


def default_devices_per_host(shape: tuple[int, ...]) -> int:
    """Axis 0 enumerates hosts: every other axis lies inside one host."""
    return math.prod(shape[1:])


def _as_shape(shape) -> tuple[int, ...]:
    if isinstance(shape, int):
        shape = (shape,)
    try:
        shape = tuple(shape)
    except TypeError:
        raise TypeError(f"mesh shape must be a tuple of positive ints, got {shape!r}") from None
    if not shape or any(not isinstance(n, int) or isinstance(n, bool) or n <= 0 for n in shape):
        raise ValueError(f"mesh shape must be a non-empty tuple of positive ints, got {shape!r}")
    return shape


def _compact(ids: tuple[int, ...]) -> str:
    if len(ids) > 1 and ids == tuple(range(ids[0], ids[0] + len(ids))):
        return f"{ids[0]}..{ids[-1]}"
    return str(list(ids)) if len(ids) <= 16 else f"[{', '.join(map(str, ids[:8]))}, ... ({len(ids)})]"
