"""Waiting for device actors and turning their failures into one exception.

``gather`` waits for a set of calls until all finished or the deadline passed (and, once one
failed, at most ``settle_s`` longer: a peer's failure reaches the others within milliseconds).
``classify_error`` sorts each failure (``FailureKind``), and ``failure_error`` names the root cause
first: a dead actor, else a device's own error, else a timeout, else errors that only echo a
peer's failure.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from reshard.errors import ReshardError, ReshardTimeout, WorkerDied
from reshard.runtime.backends.communicator import PeerFailed
from reshard.runtime.deadlines import Deadline
from reshard.runtime.messages import Failure, FailureKind

#: After the first failure, how long the controller still collects the other participants' outcomes.
SETTLE_S = 2.0
#: While waiting for all of a set of calls, how often the controller looks whether one failed.
FAILURE_POLL_S = 0.25
_LONGEST_GET_S = 86400.0  # ray.get needs a finite timeout


@dataclass
class Outcome:
    """Results by key, failures by key, and the keys still pending at the deadline."""

    results: dict = field(default_factory=dict)
    failures: dict = field(default_factory=dict)
    pending: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures and not self.pending

    @property
    def died(self) -> list:
        return sorted(k for k, f in self.failures.items() if f.kind is FailureKind.DIED)


def classify_error(err: BaseException) -> Failure:
    from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

    if isinstance(err, RayTaskError):
        cause = getattr(err, "cause", None) or err
        if isinstance(cause, RayActorError):
            return Failure(FailureKind.DIED, cause)
        err = cause
    if isinstance(err, RayActorError):
        return Failure(FailureKind.DIED, err)
    if isinstance(err, PeerFailed):
        return Failure(FailureKind.PEER, err)
    if isinstance(err, ReshardTimeout | GetTimeoutError):
        return Failure(FailureKind.TIMEOUT, err)
    return Failure(FailureKind.ERROR, err)


def _wait(refs: list, **kwargs):
    """``ray.wait``, asked again once when it fails inside Ray with a ``SystemError`` (seen once in
    the chaos tier, while an actor of the call was being killed; waiting is idempotent). A
    KeyboardInterrupt that Ray's wait wrapped so goes on as itself."""
    import ray

    try:
        return ray.wait(refs, **kwargs)
    except SystemError as e:
        if isinstance(e.__cause__, KeyboardInterrupt):
            raise e.__cause__ from None
        return ray.wait(refs, **kwargs)


def gather(refs: dict, until: Deadline, *, settle_s: float | None = SETTLE_S) -> Outcome:
    """Wait for ``refs`` (key -> ObjectRef) until all are done or ``until`` passed."""
    import ray

    deadline = until.at
    by_ref = {r: k for k, r in refs.items()}
    out = Outcome()
    # Fast path: wait for all at once (in slices, so that a failure is noticed within
    # FAILURE_POLL_S), then fetch every result with one ray.get.
    done: list = []
    waiting = list(by_ref)
    failed = False
    while waiting:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        ready, waiting = _wait(waiting, num_returns=len(waiting), timeout=min(left, FAILURE_POLL_S))
        done.extend(ready)
        if waiting and ready:
            try:
                ray.get(ready, timeout=_get_timeout(left))
            except Exception:
                failed = True
                break
    if not waiting and not failed:
        try:
            values = ray.get(done, timeout=_get_timeout(deadline - time.monotonic()))
        except Exception:
            values = None
        if values is not None:
            out.results = {by_ref[r]: v for r, v in zip(done, values, strict=True)}
            return out
    while by_ref:
        left = deadline - time.monotonic()
        # past the deadline: still collect what has finished, without waiting
        ready, _ = _wait(
            list(by_ref), num_returns=1 if left > 0 else len(by_ref), timeout=min(max(left, 0.0), _LONGEST_GET_S)
        )
        if not ready:
            break
        for r in ready:
            key = by_ref.pop(r)
            try:
                out.results[key] = ray.get(r, timeout=_get_timeout(left))
            except Exception as e:
                out.failures[key] = classify_error(e)
        if out.failures and settle_s is not None:
            deadline = min(deadline, time.monotonic() + settle_s)
    out.pending = sorted(by_ref.values())
    return out


def _get_timeout(left: float) -> float:
    """A ``ray.get`` of finished calls: at least a second (deserializing), never infinite."""
    return min(max(1.0, left), _LONGEST_GET_S)


def first_line(err) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def failure_error(outcome: Outcome, what: str, deadline: Deadline, *, tail: str = "") -> ReshardError:
    """One exception for a failed set of calls (keys are device ids), root cause first; a timeout
    quotes the one ``deadline`` was made from."""
    by_kind: dict[FailureKind, list] = {k: [] for k in FailureKind}
    for key, f in sorted(outcome.failures.items()):
        by_kind[f.kind].append(key)
    shown = (by_kind[FailureKind.ERROR] + by_kind[FailureKind.TIMEOUT] + by_kind[FailureKind.PEER])[:4]
    details = "; ".join(_detail(outcome.failures[k]) for k in shown)
    tail = f" {tail}" if tail else ""
    if by_kind[FailureKind.DIED]:
        others = f" Others: {details}." if details else ""
        return WorkerDied(f"{what}: the actor(s) of device(s) {by_kind[FailureKind.DIED]} died.{others}{tail}")
    if by_kind[FailureKind.ERROR]:
        return ReshardError(f"{what}: {details}.{tail}")
    if outcome.pending or by_kind[FailureKind.TIMEOUT]:
        limit = deadline_words(deadline)
        stuck = f" devices {outcome.pending} had not finished." if outcome.pending else ""
        more = f" {details}." if details else ""
        return ReshardTimeout(f"{what}: did not complete within {limit}.{stuck}{more}{tail}")
    return ReshardError(f"{what}: {details}.{tail}")


def deadline_words(deadline: Deadline) -> str:
    """What a timeout error quotes: the caller's ``timeout_s``, else "no limit" or "its deadline"."""
    if deadline.timeout_s is not None:
        return f"timeout_s={deadline.timeout_s:g}s"
    return "no limit" if deadline.at == math.inf else "its deadline"


def _detail(f: Failure) -> str:
    """A device's error says which device it is already; don't say it twice."""
    return first_line(f.error)
