"""Element types the runtime moves, by canonical name (no torch import needed).

Three of them have no numpy type (bfloat16 and the two float8 formats): numpy arrays hold them as
their bit patterns (``BIT_PATTERN``), and a name travels beside every such array, since an int16
array alone does not say whether it holds int16 or bfloat16."""

from __future__ import annotations

ITEMSIZE = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint32": 4,
    "uint16": 2,
    "uint8": 1,
    "bool": 1,
}

#: dtypes numpy has no type for -> the numpy type that holds their bit patterns
BIT_PATTERN = {"bfloat16": "int16", "float8_e4m3fn": "uint8", "float8_e5m2": "uint8"}

_ALIASES = {
    "double": "float64",
    "float": "float32",
    "half": "float16",
    "long": "int64",
    "int": "int32",
    "bool_": "bool",
    "short": "int16",
}


def dtype_name(dtype) -> str:
    """Canonical name of a numpy dtype, torch dtype or dtype name; TypeError if unsupported."""
    name = getattr(dtype, "name", None) if not isinstance(dtype, str) else dtype
    if isinstance(dtype, type) and dtype.__module__ == "numpy":  # a scalar type: np.float32
        import numpy as np

        name = np.dtype(dtype).name
    if name is None:
        name = str(dtype)
    name = name.removeprefix("torch.")
    name = _ALIASES.get(name, name)
    if name not in ITEMSIZE:
        raise TypeError(f"unsupported dtype {dtype!r}; supported: {', '.join(ITEMSIZE)}")
    return name


def storage_name(name: str) -> str:
    """The numpy type name that holds dtype ``name`` (itself, or its bit pattern's)."""
    return BIT_PATTERN.get(name, name)


def itemsize(dtype) -> int:
    return ITEMSIZE[dtype_name(dtype)]


#: Casts a reshard applies in flight (``reshard(..., dtype=)``): between these floating types, as
#: torch's ``Tensor.to`` rounds; to float8 from any of them with a scale (``reshard.Scaled``).
CASTABLE = ("float64", "float32", "float16", "bfloat16")


def cast_name(src: str, dst) -> str:
    """The canonical name of ``dst`` (any dtype spelling) for a cast from ``src``; ValueError when a
    reshard cannot cast between them."""
    name = dtype_name(dst)
    if name != src and (src not in CASTABLE or name not in CASTABLE):
        raise ValueError(
            f"a reshard casts between {', '.join(CASTABLE)} only, not {src} -> {name} (to float8 with a scale: "
            "dtype=reshard.Scaled(...))"
        )
    return name
