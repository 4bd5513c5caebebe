"""Ordered calls to device actors, waiting for them, and turning their failures into one exception.

``Dispatch`` gives every state-changing call to a device the device's next ``Ticket`` under one
lock, so each device runs this controller's calls in the order they were made, and the calls of one
operation are submitted to all its devices at once: no two operations of one controller interleave
differently on two devices. ``broadcast_call`` makes one such call on each of some devices, waits
for them and raises their failure as one error, root cause first. A call that Ray fails before it
reaches its device (``never_ran``) would leave a gap in that device's order: its later calls name
it (``gather_ordered``, ``Ticket.lost``) and the device gives up its turn.

``gather`` waits for a set of calls until all finished or the deadline passed (and, once one
failed, at most ``settle_s`` longer: a peer's failure reaches the others within milliseconds).
``classify_error`` sorts each failure (``FailureKind``), and ``failure_error`` names the root cause
first: a dead actor, else a device's own error, else a timeout, else errors that only echo a
peer's failure.
"""

from __future__ import annotations

import logging
import math
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from reshard.errors import ReshardError, ReshardTimeout, WorkerDied
from reshard.runtime.backends.communicator import PeerFailed
from reshard.runtime.deadlines import Deadline
from reshard.runtime.driver.device_registry import DeviceRecord, DeviceRegistry
from reshard.runtime.gc_paused import gc_paused
from reshard.runtime.messages import DeviceState, Failure, FailureKind, Ticket
from reshard.runtime.processes import process_of_this

log = logging.getLogger(__name__)

#: After the first failure, how long the controller still collects the other participants' outcomes.
SETTLE_S = 2.0
#: While waiting for all of a set of calls, how often the controller looks whether one failed.
FAILURE_POLL_S = 0.25
_LONGEST_GET_S = 86400.0  # ray.get needs a finite timeout
#: How long a failure message waits for the devices to say what they are doing.
DESCRIBE_S = 1.0
#: Ordered calls whose tickets are remembered (to name one Ray failed before it ran: ``Ticket.lost``).
SENT_KEPT = 4096
#: Lost calls named again with each later call to their device (the newest; a call that names them may be lost too).
LOST_KEPT = 8


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


def never_ran(err: BaseException) -> bool:
    """Ray failed the call itself, not the device's code, its actor or a wait (e.g. an actor that
    could not allocate the call's arguments): a finished call that may never have reached the device."""
    from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError

    return isinstance(err, RayError) and not isinstance(err, RayTaskError | RayActorError | GetTimeoutError)


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
            with gc_paused():  # every device's results decoded at once: many small objects
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
    details = "; ".join(_detail(k, outcome.failures[k]) for k in shown)
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


def _detail(device, f: Failure) -> str:
    """The first line of a device's error. The library's own errors name their device already; one
    raised around the call (Ray's own, e.g. a system error of an actor out of memory) is named here."""
    line = first_line(f.error)
    return line if re.search(rf"\bdevices? {device}\b", line) else f"device {device}: {line}"


class Dispatch:
    """One controller's ordered calls (module docstring). ``lock`` orders them; the controller's
    other parts take it too where a decision and its submission must be one step (admitting a
    group and telling its members). ``on_died(device, reason)`` hears of every actor a wait found
    dead."""

    def __init__(self, controller_id: str, registry: DeviceRegistry, on_died: Callable[[int, str], None]):
        self.id = controller_id
        self.lock = threading.RLock()
        self.registry = registry
        self._on_died = on_died
        self._submitting = False
        self._process: tuple | None = None  # told each device with its first call (``Ticket.caller``)
        self._sent: dict[bytes, tuple[DeviceRecord, int]] = {}  # an ordered call's ref -> its device and number
        self._fired: list = []  # refs of fired calls not yet seen to finish (``sweep_fired``)

    def submit(self, rec, call):
        """``call(ticket)`` submits one ordered call to ``rec``'s actor; the ticket's number is
        used up only when the submission succeeded (a gap would stall the device's later calls).
        Submissions never nest (a second one from inside the first would take the same number):
        garbage collection and pickling change holds through a queue (``HoldQueue``)."""
        with self.lock:
            if self._submitting:
                raise RuntimeError("ordered calls must not be submitted from inside a submission")
            self._submitting = True
            try:
                if self._process is None:
                    self._process = process_of_this()
                ref = call(Ticket(self.id, rec.seq, self._process, rec.lost))
            finally:
                self._submitting = False
            self._sent[ref.binary()] = (rec, rec.seq)
            if len(self._sent) > SENT_KEPT:
                del self._sent[next(iter(self._sent))]
            rec.seq += 1
            return ref

    def note_lost(self, refs: dict, outcome: Outcome) -> None:
        """Remember the ordered calls of ``refs`` that Ray failed before they ran (``never_ran``):
        each device's later calls name them, so that it gives up their turns instead of waiting."""
        for key, f in outcome.failures.items():
            if f.kind is FailureKind.ERROR and never_ran(f.error):
                with self.lock:
                    sent = self._sent.get(refs[key].binary())
                    if sent is not None:
                        rec, seq = sent
                        rec.lost = (*rec.lost, seq)[-LOST_KEPT:]

    def submit_each(self, devices, make, what: str) -> dict:
        """One ordered call to each of ``devices`` (``make(rec)`` is the ``call(ticket)`` for
        ``submit``), all under the lock: every device sees this controller's calls in one order.
        Returns the calls' refs by device; ``MeshClosed``/``WorkerDied`` for an unusable device."""
        with self.lock:
            return {rec.id: self.submit(rec, make(rec)) for rec in self.registry.check(list(devices), what)}

    def fire(self, devices, make) -> list:
        """``submit_each`` without waiting or raising, to the devices still alive (releases, frees);
        the next operation looks at those that finished (``sweep_fired``). Returns their refs."""
        fired = []
        with self.lock:
            for d in devices:
                rec = self.registry.devices.get(d)
                if rec is not None and rec.state is DeviceState.ALIVE:
                    try:
                        fired.append(self.submit(rec, make(rec)))
                    except Exception as e:  # Ray is going away: nothing left to free
                        log.debug("device %d: %s", d, e)
            self._fired.extend(fired)
            del self._fired[:-SENT_KEPT]
        return fired

    def sweep_fired(self) -> None:
        """The fired calls that finished since (``fire`` waits for none): those Ray failed before
        they ran are noted as a waited call's are (``note_lost``). Called where an operation starts,
        never under ``lock``: reading a result takes Ray's deserialization lock, which a thread
        deserializing holds while it may wait for ``lock``."""
        import ray

        with self.lock:
            fired, self._fired = self._fired, []
        if not fired:
            return
        failures = {}
        try:
            done, left = ray.wait(fired, num_returns=len(fired), timeout=0)
            try:
                ray.get(done, timeout=0)  # all at once: one read for thousands (a tree adopted)
            except Exception:  # one of them failed: which
                for ref in done:
                    try:
                        ray.get(ref, timeout=0)
                    except Exception as e:
                        failures[ref] = classify_error(e)
        except Exception as e:  # Ray is going away: nothing left to order
            log.debug("fired calls: %s", e)
            return
        with self.lock:
            self._fired[:0] = left
        self.note_lost({ref: ref for ref in failures}, Outcome(failures=failures))

    def gather_ordered(self, refs: dict, until: Deadline, *, settle_s: float | None = SETTLE_S) -> Outcome:
        """``gather`` of ordered calls, noting those Ray failed before they ran (``note_lost``)."""
        outcome = gather(refs, until, settle_s=settle_s)
        self.note_lost(refs, outcome)
        return outcome

    def wait(self, refs: dict, deadline: Deadline, what: str) -> Outcome:
        """``gather_ordered`` that reports the devices whose actors died."""
        outcome = self.gather_ordered(refs, deadline)
        for d in outcome.died:
            self._on_died(d, f"actor died in {what}: {first_line(outcome.failures[d].error)}")
        return outcome

    def wait_acks(self, acks: dict, until: Deadline) -> None:
        """Wait for cleanup acknowledgements until ``until``; failures other than deaths do not matter."""
        if not acks:
            return
        done = gather(acks, until, settle_s=None)
        for d, f in done.failures.items():
            if f.kind is FailureKind.DIED:
                self._on_died(d, f"actor died: {first_line(f.error)}")

    def broadcast_call(
        self,
        devices,
        make,
        deadline: Deadline,
        what: str,
        *,
        tail: str = "",
        on_failure: Callable[[Outcome], None] | None = None,
    ) -> dict:
        """One ordered call to each of ``devices`` (``make(rec)`` is the ``call(ticket)`` for
        ``submit``; all submitted under the lock), waited for until ``deadline``: ``{device: result}``.
        On failure, ``on_failure(outcome)`` runs first (to clean up, or to raise a more precise
        error), then the failure is raised as one error, root cause first (``failure_error``)."""
        self.sweep_fired()
        return self.results_of(self.submit_each(devices, make, what), deadline, what, tail=tail, on_failure=on_failure)

    def results_of(
        self,
        refs: dict,
        deadline: Deadline,
        what: str,
        *,
        tail: str = "",
        on_failure: Callable[[Outcome], None] | None = None,
    ) -> dict:
        """The second half of ``broadcast_call``, for calls submitted under a lock held longer."""
        try:
            outcome = self.wait(refs, deadline, what)
        except BaseException:  # KeyboardInterrupt, or Ray failing under us
            if on_failure is not None:
                on_failure(Outcome(pending=sorted(refs)))
            raise
        if not outcome.ok:
            if on_failure is not None:
                on_failure(outcome)
            raise failure_error(outcome, what, deadline, tail=tail)
        return outcome.results

    def call(self, calls: dict, timeout_s: float, what: str) -> dict:
        """Ordered ``fn(ctx, *args, **kwargs)`` on each device: ``calls[device] = (fn, args, kwargs)``.
        Returns ``{device: result}``; a device's own exception is raised as is, other failures as
        a ``ReshardError``."""
        deadline = Deadline.after(timeout_s)

        def make(rec):
            fn, args, kwargs = calls[rec.id]
            return lambda t: rec.actor.reshard_call.remote(t, fn, args, kwargs, deadline.budget)

        return self.broadcast_call(calls, make, deadline, what, on_failure=_raise_own_error)

    def ask(self, devices) -> tuple[dict, float]:
        """Ask ``devices`` what they are doing (on their control threads); ``describe`` reads the
        answers. Returns the calls and when they were made."""
        refs = {}
        for d in devices:
            rec = self.registry.devices.get(d)
            if rec is not None and rec.state is DeviceState.ALIVE:
                refs[d] = rec.actor.reshard_stats.remote()
        return refs, time.monotonic()

    def describe(self, devices, asked: tuple[dict, float] | None = None) -> str:
        """What ``devices`` are doing (bounded: at most ``DESCRIBE_S`` after they were ``ask``ed):
        for messages about calls that did not finish."""
        refs, since = self.ask(devices) if asked is None else asked
        if not refs:
            return ""
        outcome = gather(refs, Deadline(since + DESCRIBE_S), settle_s=None)
        parts = []
        for d in sorted(refs):
            calls = outcome.results.get(d, {}).get("calls")
            if calls is None:
                parts.append(f"device {d} did not answer")
                continue
            mine = calls["running"].get(self.id)
            waiting = [w for k, w in calls["waiting"].items() if k.startswith(f"{self.id}#")]
            recent = [f"#{n} {w}: {o}" for c, n, w, o, _ in calls["recent"] if c == self.id][-3:]
            if mine:
                parts.append(f"device {d} is still running {mine[0]} ({mine[1]:.1f}s)")
            elif waiting:
                parts.append(f"device {d} waits for call #{calls['next'].get(self.id)} before {waiting[0]}")
            else:
                parts.append(f"device {d} runs nothing of ours now (recent: {'; '.join(recent) or 'none'})")
        return "; ".join(parts) + ". "


def _raise_own_error(outcome: Outcome) -> None:
    """A device's own exception (``fn`` raised it), raised as is where no actor died."""
    own = [
        f.error for _, f in sorted(outcome.failures.items()) if f.kind is FailureKind.ERROR and not never_ran(f.error)
    ]
    if own and not outcome.died:
        raise own[0]
