"""A hashable value whose hash is worked out once.

A tuple works its hash out at every dict lookup, from every element's: a replay of a tree of
thousands of tensors looks its compiled call and its binding up by keys of thousands of elements,
several times a call. Wrapped, each key is hashed once, and a hit compares element by element,
each the same object as before; two equal values found so share one, and compare by identity
from then on (a replay's key against the one its first call cached).
"""

from __future__ import annotations


class Signed:
    """A hashable value with its hash computed once (tuples compute theirs at every lookup)."""

    __slots__ = ("_hash", "value")

    def __init__(self, value):
        self.value = value
        self._hash = hash(value)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        if self is other:
            return True
        if not isinstance(other, Signed) or self._hash != other._hash:
            return False
        if self.value is other.value:
            return True
        if self.value != other.value:
            return False
        other.value = self.value  # equal: shared, so that the next comparison of the two is by identity
        return True


__all__ = ["Signed"]
