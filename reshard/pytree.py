"""Trees of tensors (a model's state dict, nested dicts, lists and tuples), flattened and rebuilt.

``flatten(tree, is_leaf)`` returns the leaves in a fixed order (dict keys in insertion order,
sequences in order) with their paths, and a ``TreeDef`` that ``unflatten`` rebuilds the same kind
of tree from (dict subclasses such as OrderedDict, named tuples and lists included). A path names a
leaf as a state dict does: keys and indices joined by dots (``"h.0.attn.weight"``); a leaf at the
root has the path ``""``. ``None`` is an empty subtree, as in JAX.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class TreeDef:
    """The shape of a tree: a leaf (``kind`` "leaf"), ``None``, or a container of child trees."""

    kind: str  # "leaf", "none", "dict", "list", "tuple", "namedtuple"
    type: Any = None  # the container's own type (a dict subclass, a named tuple class)
    keys: tuple = ()  # dict keys, in order
    children: tuple[TreeDef, ...] = ()

    @property
    def num_leaves(self) -> int:
        if self.kind == "leaf":
            return 1
        return sum(c.num_leaves for c in self.children)


LEAF = TreeDef("leaf")
NONE = TreeDef("none")


def flatten(tree, is_leaf: Callable[[Any], bool], leaf_type: type | None = None) -> tuple[list, list[str], TreeDef]:
    """``(leaves, paths, treedef)`` of ``tree``; ``is_leaf(x)`` says what is a leaf (and so is an
    object of exactly ``leaf_type``: a flat dict of them is seen by their types, not a call each).
    Anything else that is not a dict, list, tuple or None raises TypeError naming its path."""
    if type(tree) is dict and tree:  # a flat state dict, the common case: no walk
        values = list(tree.values())
        if (leaf_type is not None and set(map(type, values)) == {leaf_type}) or all(map(is_leaf, values)):
            keys = tuple(tree)
            return values, [str(k) for k in keys], TreeDef("dict", dict, keys, (LEAF,) * len(keys))
    leaves: list = []
    paths: list[str] = []

    def walk(node, path: tuple) -> TreeDef:
        if is_leaf(node):
            leaves.append(node)
            paths.append(str(path[0]) if len(path) == 1 else ".".join(str(p) for p in path))
            return LEAF
        if node is None:
            return NONE
        if isinstance(node, Mapping):
            keys = tuple(node)
            return TreeDef("dict", type(node), keys, tuple(walk(node[k], (*path, k)) for k in keys))
        if isinstance(node, tuple) and hasattr(node, "_fields"):
            fields = node._fields
            return TreeDef(
                "namedtuple", type(node), (), tuple(walk(v, (*path, f)) for f, v in zip(fields, node, strict=True))
            )
        if isinstance(node, list | tuple):
            kind = "list" if isinstance(node, list) else "tuple"
            return TreeDef(kind, type(node), (), tuple(walk(v, (*path, i)) for i, v in enumerate(node)))
        where = ".".join(str(p) for p in path) or "the root"
        raise TypeError(f"{type(node).__name__} at {where} is neither a leaf nor a dict, list or tuple of them")

    treedef = walk(tree, ())
    return leaves, paths, treedef


def unflatten(treedef: TreeDef, leaves) -> Any:
    """The tree of shape ``treedef`` holding ``leaves`` (in ``flatten``'s order)."""
    if treedef.type is dict and len(leaves) == len(treedef.children) and all(c is LEAF for c in treedef.children):
        return dict(zip(treedef.keys, leaves, strict=True))  # a flat state dict
    it = iter(leaves)

    def build(t: TreeDef):
        if t.kind == "leaf":
            return next(it)
        if t.kind == "none":
            return None
        values = [build(c) for c in t.children]
        if t.kind == "dict":
            pairs = zip(t.keys, values, strict=True)
            return dict(pairs) if t.type is dict else _make_mapping(t.type, pairs)
        if t.kind == "namedtuple":
            return t.type(*values)
        return t.type(values)

    out = build(treedef)
    if next(it, _END) is not _END:
        raise ValueError(f"unflatten: more leaves than the tree has ({treedef.num_leaves})")
    return out


def _make_mapping(cls, pairs):
    try:
        return cls(pairs)
    except TypeError:  # a mapping type that cannot be built from pairs (defaultdict): a plain dict
        return dict(pairs)


def same_structure(a: TreeDef, b: TreeDef) -> str | None:
    """None when ``a`` and ``b`` have the same keys and nesting (container types may differ), else
    the first difference, said in words."""

    def walk(x: TreeDef, y: TreeDef, path: tuple) -> str | None:
        where = ".".join(str(p) for p in path) or "the root"
        if (x.kind == "leaf") != (y.kind == "leaf") or (x.kind == "none") != (y.kind == "none"):
            return f"at {where}: {_said(x)} against {_said(y)}"
        if x.kind in ("leaf", "none"):
            return None
        if (x.kind == "dict") != (y.kind == "dict"):
            return f"at {where}: {_said(x)} against {_said(y)}"
        if x.kind == "dict" and set(x.keys) != set(y.keys):
            missing = [k for k in x.keys if k not in set(y.keys)]
            extra = [k for k in y.keys if k not in set(x.keys)]
            return f"at {where}: keys {missing} missing, {extra} not expected"
        if len(x.children) != len(y.children):
            return f"at {where}: {len(x.children)} entries against {len(y.children)}"
        if x.kind == "dict":
            ys = dict(zip(y.keys, y.children, strict=True))
            pairs = [(k, c, ys[k]) for k, c in zip(x.keys, x.children, strict=True)]
        else:
            pairs = [(i, c, d) for i, (c, d) in enumerate(zip(x.children, y.children, strict=True))]
        for k, c, d in pairs:
            diff = walk(c, d, (*path, k))
            if diff is not None:
                return diff
        return None

    return walk(a, b, ())


def leaves_in_order_of(a: TreeDef, b: TreeDef, leaves_b: list) -> list:
    """``leaves_b`` (of tree ``b``) reordered to the leaf order of ``a`` (same structure, dict keys
    possibly in another order)."""
    it = iter(leaves_b)

    def index(t: TreeDef):
        if t.kind == "leaf":
            return next(it)
        if t.kind == "none":
            return None
        return [index(c) for c in t.children]

    nested = index(b)
    out: list = []

    def pick(x: TreeDef, y: TreeDef, node) -> None:
        if x.kind == "leaf":
            out.append(node)
            return
        if x.kind == "none":
            return
        if x.kind == "dict":
            at = {k: i for i, k in enumerate(y.keys)}
            for k, c in zip(x.keys, x.children, strict=True):
                pick(c, y.children[at[k]], node[at[k]])
        else:
            for c, d, n in zip(x.children, y.children, node, strict=True):
                pick(c, d, n)

    pick(a, b, nested)
    return out


def per_leaf(spec, leaves: list, paths: list[str], treedef: TreeDef, is_one: Callable[[Any], bool], what: str) -> list:
    """One value per leaf of a tree (``leaves`` at ``paths``, shaped ``treedef``) from ``spec``:
    one value for all (``is_one(spec)``), a callable ``(path, leaf) -> value``, or the same tree of
    values (dict keys in any order; a difference raises ValueError naming it, ``what`` first)."""
    if is_one(spec):
        return [spec] * len(leaves)
    if callable(spec) and not isinstance(spec, Mapping | list | tuple):
        return [spec(path, leaf) for path, leaf in zip(paths, leaves, strict=True)]
    if (
        treedef.kind == "dict"
        and isinstance(spec, Mapping)
        and tuple(spec) == treedef.keys
        and all(c is LEAF for c in treedef.children)
    ):
        values = list(spec.values())
        kinds = set(map(type, values))  # a state dict's values are of a few types: checked once each
        if not any(issubclass(k, Mapping | list | tuple | type(None)) for k in kinds) or all(map(is_one, values)):
            return values  # a flat dict with the tree's keys in its order (a state dict's)
    got, _, spec_def = flatten(spec, lambda x: not isinstance(x, Mapping | list | tuple) and x is not None)
    diff = same_structure(treedef, spec_def)
    if diff is not None:
        raise ValueError(f"{what} ({diff})")
    return leaves_in_order_of(treedef, spec_def, got)


def _said(t: TreeDef) -> str:
    return {"leaf": "a tensor", "none": "None"}.get(t.kind, f"a {t.kind}")


_END = object()
