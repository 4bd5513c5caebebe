"""How a failed set of device calls reads (``reshard.runtime.driver.dispatch.failure_error``): each
failed device's first line, in device order, every one naming its device once."""

from __future__ import annotations

import pytest

from reshard.errors import ReshardError
from reshard.runtime.deadlines import Deadline
from reshard.runtime.driver.dispatch import Outcome, failure_error
from reshard.runtime.messages import Failure, FailureKind

pytestmark = pytest.mark.unit


def _failed(error: BaseException) -> Failure:
    return Failure(FailureKind.ERROR, error)


def test_an_error_raised_around_a_devices_call_is_named_by_its_device_and_the_librarys_own_once():
    """Ray's own error of an actor out of memory says no device: the driver names it. The
    library's errors already name theirs (also as one of several devices), and are not named twice;
    another device's id that starts with the same digits (61 for 6) does not count as naming it."""
    outcome = Outcome(
        failures={
            31: _failed(RuntimeError("System error: Unable to allocate internal buffer.")),
            3: _failed(ReshardError("device 3: could not allocate 2 MiB\nthe traceback")),
            4: _failed(ReshardError("devices 4 and 5 hold different syncs")),
            6: _failed(ReshardError("its peer device 61 did not answer")),
        }
    )
    err = failure_error(outcome, "reshard x", Deadline.after(1.0))
    assert type(err) is ReshardError
    assert str(err) == (
        "reshard x: device 3: could not allocate 2 MiB; devices 4 and 5 hold different syncs; "
        "device 6: its peer device 61 did not answer; device 31: System error: Unable to allocate internal buffer.."
    )
