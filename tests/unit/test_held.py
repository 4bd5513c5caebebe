"""``Held`` (a replay's tensors by weak reference) and ``Signed`` (a key hashed once): what a
replay's identity checks rest on."""

import gc

from reshard.runtime.driver.resharding import Held
from reshard.runtime.driver.signed import Signed
from reshard.runtime.driver.tensor import Frees


class Handle:
    _freed = False


def test_held_holds_the_same_objects_only():
    objs = [Handle() for _ in range(5)]
    held = Held(objs)
    assert held.holds(list(objs))
    assert not held.holds(objs[:4])
    assert not held.holds([*objs[:4], Handle()])
    assert not held.holds(objs[::-1])


def test_held_never_takes_a_new_object_at_a_dead_ones_id_for_it():
    objs = [Handle() for _ in range(3)]
    held = Held(objs)
    dead = id(objs[1])
    del objs[1]
    gc.collect()
    made = []  # kept, so that each new object takes fresh memory until one takes the dead one's
    for _ in range(100_000):  # CPython hands a freed object's memory to a later one of its size
        new = Handle()
        made.append(new)
        if id(new) == dead:
            break
    assert id(new) == dead, "no new object took the dead one's id: the case this test is about did not arise"
    assert not held.holds([objs[0], new, objs[1]])


def test_held_keeps_nothing_alive():
    objs = [Handle() for _ in range(2)]
    held = Held(objs)
    del objs
    gc.collect()
    assert all(r() is None for r in held.refs)


def test_held_looks_whether_a_handle_is_freed_again_only_after_a_free():
    objs = [Handle() for _ in range(3)]
    held = Held(objs)
    assert held.live(objs)
    objs[1]._freed = True  # as ShardedTensor.free marks it, before it counts the free
    assert held.live(objs), "no free counted since the last look: not looked at again"
    Frees.count += 1
    assert not held.live(objs)
    assert not held.live(objs), "a freed handle is seen at every look"


def test_equal_signed_values_compare_by_identity_after_their_first_comparison():
    a, b = Signed(tuple(range(1000))), Signed(tuple(range(1000)))
    assert a.value is not b.value
    assert a == b and hash(a) == hash(b)
    assert a.value is b.value
    assert a != Signed(tuple(range(999))) and a != tuple(range(1000))
