"""The cyclic collector paused for a block: resumed once, by the last of nested or concurrent
pauses; left off when it was off."""

from __future__ import annotations

import gc
import threading

from reshard.runtime.gc_paused import gc_paused


def test_nested_pauses_resume_the_collector_once_the_outer_ends():
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_pause_in_another_thread_keeps_it_paused_until_both_end():
    inside, leave = threading.Event(), threading.Event()

    def other():
        with gc_paused():
            inside.set()
            leave.wait(timeout=30)

    t = threading.Thread(target=other)
    t.start()
    assert inside.wait(timeout=30)
    with gc_paused():
        pass
    assert not gc.isenabled()  # the other thread's pause still runs
    leave.set()
    t.join(timeout=30)
    assert gc.isenabled()


def test_a_collector_turned_off_stays_off():
    gc.disable()
    try:
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_an_error_inside_still_resumes_it():
    try:
        with gc_paused():
            raise KeyError("x")
    except KeyError:
        pass
    assert gc.isenabled()
