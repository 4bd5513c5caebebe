"""torch.chunk's split of an interval: ``k`` pieces of ``n`` elements take ``ceil(n / k)`` each, so
trailing pieces may be short or empty (the region math of every layout)."""

from __future__ import annotations


def chunk(start: int, stop: int, parts: int, index: int) -> tuple[int, int]:
    """The ``index``-th of ``parts`` torch.chunk pieces of ``[start, stop)``."""
    step = -(-(stop - start) // parts)
    lo = min(start + index * step, stop)
    return lo, min(lo + step, stop)
