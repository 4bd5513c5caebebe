"""Work: a reshard in flight (``reshard(..., async_op=True)``), as torch.distributed's ``Work``.

The call returns once its runs are submitted; a thread of the controller (``WORKERS`` of them)
waits for the devices, commits, builds the result and records its error, so a work finishes
whether or not anybody waits for it, and a dropped one leaves nothing behind. ``wait()`` returns
the result (the same tree ``reshard`` returns) or raises the error the blocking call would have
raised; ``done()`` says whether it finished; ``await work`` waits in asyncio. A work pickled into a Ray
task or actor of the job carries its outcome there (pickling waits for it).

Ordering: every device runs one controller's calls in the order they were made, so works queue
behind each other on the devices they share. A work that reads or writes tensors that a pending
work writes (its ``out=``), or writes tensors a pending work reads, is not submitted before that
work finished (``WorkQueue.after``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import threading
from collections.abc import Callable

from reshard.errors import ReshardTimeout
from reshard.runtime.deadlines import Deadline

WORKERS = 4  # works finished at once per controller (each thread mostly waits for Ray)


class Work:
    """A reshard in flight, what ``reshard(..., async_op=True)`` returns (as torch.distributed's
    ``Work``): it finishes whether or not anybody waits for it, and a dropped one leaves nothing
    behind. ``wait()`` returns the result or raises what the blocking call would have raised;
    ``done()`` says whether it finished; ``await work`` waits in asyncio. Reads of the tensors it
    writes, and later works that touch them, wait for it.

        work = reshard(sources, trainer_mesh, layouts, out=weights, async_op=True)
        loss = train_step()                     # overlaps the sync
        work.wait()                             # before the optimizer writes the weights
    """

    def __init__(self, future: concurrent.futures.Future, what: str):
        self._future = future
        self.what = what

    def __repr__(self) -> str:
        state = "done" if self._future.done() else "pending"
        return f"Work({self.what}, {state})"

    def done(self) -> bool:
        """Whether it finished (successfully or not)."""
        return self._future.done()

    def wait(self, timeout_s: float | None = None):
        """The result, once the work finished; its error if it failed. ``timeout_s``: how long to
        wait here (None: until the work's own deadline passes, which bounds it); past it,
        ``ReshardTimeout`` is raised and the work goes on."""
        try:
            return self._future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            raise ReshardTimeout(f"{self.what}: still running after waiting {timeout_s:g}s; it goes on") from None

    def exception(self, timeout_s: float | None = None) -> BaseException | None:
        return self._future.exception(timeout=timeout_s)

    def __await__(self):
        return asyncio.wrap_future(self._future).__await__()

    def __reduce__(self):
        """A copy for a Ray task or actor of the job: pickling waits for the work (bounded by its
        own deadline) and the copy carries its result or its error, so ``wait()`` there returns
        the same tree (handles that hold the shards as any pickled handle does) or raises."""
        error = self._future.exception()
        return _finished, (None if error is not None else self._future.result(), error, self.what)


def _finished(result, error: BaseException | None, what: str) -> Work:
    future: concurrent.futures.Future = concurrent.futures.Future()
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
    return Work(future, what)


class WorkQueue:
    """The works of one controller: a few threads finish them, and a new one waits for the pending
    works it conflicts with (module docstring)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._pending: dict[Work, tuple[frozenset, frozenset]] = {}  # work -> (names it reads, names it writes)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def after(self, reads: frozenset, writes: frozenset, deadline: Deadline) -> None:
        """Wait, until ``deadline``, for the pending works that write what this one reads or writes,
        or read what it writes (their errors are theirs, not this one's)."""
        with self._lock:
            ahead = [w for w, (r, wr) in self._pending.items() if wr & (reads | writes) or r & writes]
        for w in ahead:
            left = deadline.left()
            concurrent.futures.wait([w._future], timeout=None if left == math.inf else left)

    def start(self, finish: Callable, reads: frozenset, writes: frozenset, what: str) -> Work:
        """A work that ``finish()`` completes on one of the threads."""
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(WORKERS, thread_name_prefix="reshard-work")
            future = self._pool.submit(finish)
            work = Work(future, what)
            if reads or writes:
                self._pending[work] = (reads, writes)
        future.add_done_callback(lambda _: self._done(work))
        return work

    def _done(self, work: Work) -> None:
        with self._lock:
            self._pending.pop(work, None)

    def pending(self) -> int:
        with self._lock:
            return len(self._pending)
