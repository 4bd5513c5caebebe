"""Element types the runtime moves, by canonical name (no torch import needed)."""

from __future__ import annotations

ITEMSIZE = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}

_ALIASES = {
    "double": "float64", "float": "float32", "half": "float16", "long": "int64", "int": "int32", "bool_": "bool",
}  # fmt: skip


def dtype_name(dtype) -> str:
    """Canonical name of a numpy dtype, torch dtype or dtype name; TypeError if unsupported."""
    name = getattr(dtype, "name", None) if not isinstance(dtype, str) else dtype
    if name is None:
        name = str(dtype)
    name = name.removeprefix("torch.")
    name = _ALIASES.get(name, name)
    if name not in ITEMSIZE:
        raise TypeError(f"unsupported dtype {dtype!r}; supported: {', '.join(ITEMSIZE)}")
    return name


def itemsize(dtype) -> int:
    return ITEMSIZE[dtype_name(dtype)]
