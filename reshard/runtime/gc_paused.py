"""Python's cyclic garbage collector paused while a call builds a large, acyclic structure.

Compiling a tree of tens of thousands of tensors (and decoding its programs on a device) makes
millions of small tuples and dataclasses at once; each allocation burst triggers collections of
the oldest generation, which walk every object the process holds. For a 20,000-tensor tree that
was half of the first call's compile. What such a call makes holds no reference cycles, so
nothing is lost by collecting after it instead of during it.
"""

from __future__ import annotations

import contextlib
import gc
import threading

_lock = threading.Lock()
_depth = 0  # calls inside a pause, over all threads: the collector resumes when the last ends


@contextlib.contextmanager
def gc_paused():
    """Pause the cyclic collector for the block; nested and concurrent pauses resume it once, when
    the last ends. A collector that was off when the first began stays off."""
    global _depth
    with _lock:
        counted = _depth > 0 or gc.isenabled()
        if counted:
            if _depth == 0:
                gc.disable()
            _depth += 1
    try:
        yield
    finally:
        if counted:
            with _lock:
                _depth -= 1
                if _depth == 0:
                    gc.enable()
