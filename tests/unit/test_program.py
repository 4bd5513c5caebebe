"""Property tests of programs (no Ray, no torch): for random problems and every strategy, lowering
pairs every op, stages exactly the strided slices and runs to completion; pulls (transfers inside a
shared-memory domain) and sequencing (local ops moved or overlapped, issue windows) keep programs
valid; programs survive a msgpack round trip; and an independent numpy interpreter that runs every
device's ops in program order, window by window, produces exactly the destination shards."""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from problems import (
    SETTINGS,
    contributions_of,
    partial_problems,
    problems,
    publish_in_window,
    reduced,
    regions_by_device,
)

from reshard import lower_plan, plan_reshard, validate_program
from reshard.errors import PlanError
from reshard.ir.placement import ReduceOp
from reshard.ir.program import Broadcast, Buffer, Copy, DeviceProgram, Program, Publish, Pull, Recv, Scale, Send
from reshard.ir.serialize import decode_device_program, decode_program, encode_device_program, encode_program
from reshard.passes.pulls import pulled_steps, to_pulls
from reshard.passes.sequencing import sequence_program

pytestmark = pytest.mark.unit
MESSAGES = (Send, Recv, Broadcast)


def sl(box):
    return tuple(slice(lo, hi) for lo, hi in box)


COMBINE = {ReduceOp.SUM: np.add, ReduceOp.AVG: np.add, ReduceOp.MAX: np.maximum, ReduceOp.MIN: np.minimum}


def interpret(program, src_layout, full: np.ndarray, contributions=None, dst_init=None) -> dict[int, np.ndarray]:
    """Run the program in numpy as the executor would: each device connects nothing (groups are
    free here), runs its background ops whenever they can (they touch nothing the others read),
    and its windows in order: local ops at once, message ops issued, a pull of a relay once its
    holder published it; a message completes (data moves) once every member issued its op; a
    publication runs once the window's messages before it completed; a window ends when its
    messages completed and its publications ran. Raises if it gets stuck.
    ``contributions[c]``: the full tensor contribution ``c`` of a Partial source holds;
    ``dst_init[d]``: what device ``d``'s destination shard holds before the program (else zeros)."""
    src_layout = src_layout.for_shape(full.shape)
    regions = regions_by_device(src_layout, full.shape)
    src = {}
    for flat, (d, box) in enumerate(regions.items()):
        whole = full if contributions is None else contributions[src_layout.contribution(flat)]
        src[d] = whole[sl(box)].copy()
    buffers = {(d, Buffer.SRC): a for d, a in src.items()}  # a holder pulled from may run nothing
    buffers.update({(p.device, Buffer.SRC): src.get(p.device) for p in program.devices})
    for p in program.devices:
        if p.dst_shape is not None:
            init = (dst_init or {}).get(p.device)
            buffers[(p.device, Buffer.DST)] = np.zeros(p.dst_shape, full.dtype) if init is None else init.copy()
        if p.tmp:
            buffers[(p.device, Buffer.TMP)] = np.zeros(p.src_shape, full.dtype)

    def read(device, op):
        return buffers[(device, op.buffer)][sl(op.read)].copy()

    def land(device, op, data):
        box = buffers[(device, getattr(op, "target", Buffer.DST))]
        reduce = getattr(op, "reduce", None)
        box[sl(op.write)] = data if reduce is None else COMBINE[reduce](box[sl(op.write)], data)

    published = defaultdict(int)  # device -> publications so far

    def ready(op) -> bool:
        return not isinstance(op, Pull) or op.buffer is Buffer.SRC or published[op.holder] >= op.after

    def run_local(device, op):
        if isinstance(op, Scale):
            buffers[(device, Buffer.DST)][sl(op.write)] /= op.divisor
        elif isinstance(op, Publish):
            assert op.count == published[device] + 1, (device, op)
            published[device] = op.count
        elif isinstance(op, Pull):
            land(device, op, buffers[(op.holder, op.buffer)][sl(op.read)])
        else:
            land(device, op, read(device, op))

    windows = {p.device: list(p.issue_windows) for p in program.devices}
    background = {p.device: list(p.background) for p in program.devices}  # run in order, each once ready
    issued: dict[int, dict[int, object]] = defaultdict(dict)
    members = {op.step: set(op.group) for p in program.devices for op in p.ops if isinstance(op, MESSAGES)}
    head = dict.fromkeys(windows, 0)
    at = dict.fromkeys(windows, 0)  # ops of the head window issued so far
    done_steps: set[int] = set()
    progress = True
    while progress:
        progress = False
        for d, queue in background.items():
            while queue and ready(queue[0]):
                run_local(d, queue.pop(0))
                progress = True
        for d, ws in windows.items():
            while head[d] < len(ws):
                window = ws[head[d]]
                while at[d] < len(window) and ready(op := window[at[d]]):
                    if isinstance(op, MESSAGES):
                        issued[op.step][d] = op
                    elif not isinstance(op, Publish):  # a publication runs once the ops before it landed
                        run_local(d, op)
                    at[d] += 1
                    progress = True
                for op in window[: at[d]]:
                    complete = isinstance(op, MESSAGES) and set(issued[op.step]) == members[op.step]
                    if complete and op.step not in done_steps:
                        ops = issued[op.step]
                        root = op.group[0]
                        data = read(root, ops[root])
                        for r, rop in ops.items():
                            if r != root:
                                land(r, rop, data)
                        done_steps.add(op.step)
                for k, op in enumerate(window[: at[d]]):
                    before = window[:k]
                    if isinstance(op, Publish) and published[d] < op.count:
                        if any(isinstance(b, MESSAGES) and b.step not in done_steps for b in before):
                            break
                        run_local(d, op)
                        progress = True
                unpublished = any(isinstance(op, Publish) and published[d] < op.count for op in window)
                if (
                    at[d] < len(window)
                    or unpublished
                    or any(isinstance(op, MESSAGES) and op.step not in done_steps for op in window)
                ):
                    break
                head[d] += 1
                at[d] = 0
                progress = True
    assert not any(background.values()), f"background ops never ran: {background}"
    stuck = {d: h for d, h in head.items() if h < len(windows[d])}
    assert not stuck, f"interpreter stuck at windows {stuck}"
    return {d: buffers[(d, Buffer.DST)] for d in (p.device for p in program.devices) if (d, Buffer.DST) in buffers}


def expected(dst_layout, full):
    return {d: full[sl(box)] for d, box in regions_by_device(dst_layout, full.shape).items()}


def assert_exact(program, src, dst, shape):
    full = np.arange(math.prod(shape), dtype=np.int64).reshape(shape)
    got = interpret(program, src, full)
    for d, want in expected(dst, full).items():
        np.testing.assert_array_equal(got[d], want)


@SETTINGS
@given(problems())
def test_lowering_is_paired_staged_exactly_and_exact(problem):
    shape, dtype, src, dst, strategy = problem
    plan = plan_reshard(shape, dtype, src, dst, strategy=strategy)
    program = lower_plan(plan)
    validate_program(program)
    by_step = defaultdict(dict)
    for p in program.devices:
        steps = [op.step for op in p.ops]
        assert steps == sorted(steps) and len(set(steps)) == len(steps)
        for op in p.ops:
            by_step[op.step][p.device] = op
            if isinstance(op, MESSAGES):
                box = op.read if getattr(op, "read", None) is not None else op.write
                reading = getattr(op, "read", None) is not None
                shape_of = p.src_shape if reading and op.buffer is Buffer.SRC else p.dst_shape
                view = np.zeros(shape_of, dtype=np.uint8)[sl(box)]
                assert (op.staging is None) == view.flags.c_contiguous, op
    for step, ops in by_step.items():
        t = plan.transfers[step]
        assert set(ops) == set(t.group)
        kinds = sorted(type(op).__name__ for op in ops.values())
        want = {"COPY": ["Copy"], "SEND": ["Recv", "Send"], "BROADCAST": ["Broadcast"] * len(t.group)}
        assert kinds == want[t.kind.name]
    assert_exact(program, src, dst, shape)


@SETTINGS
@given(problems())
def test_program_msgpack_round_trip(problem):
    shape, dtype, src, dst, strategy = problem
    program = sequence_program(lower_plan(plan_reshard(shape, dtype, src, dst, strategy=strategy)), window_ops=3)
    assert decode_program(encode_program(program)) == program
    for p in program.devices:
        assert decode_device_program(encode_device_program(p, program.dtype)) == (program.dtype, p)


@st.composite
def problems_with_domains(draw):
    problem = draw(problems())
    _, _, src, dst, _ = problem
    devices = sorted(set(src.mesh.device_ids) | set(dst.mesh.device_ids))
    domain_of = {d: draw(st.sampled_from([None, 0, 1])) for d in devices}
    return problem, domain_of


@SETTINGS
@given(problems_with_domains(), st.sampled_from([0, 1 << 30, None]), st.integers(1, 4))
def test_pulls_and_sequencing_keep_programs_valid_and_exact(case, overlap_bytes, window_ops):
    (shape, dtype, src, dst, strategy), domain_of = case
    program = lower_plan(plan_reshard(shape, dtype, src, dst, strategy=strategy))
    pulled = to_pulls(program, domain_of)
    validate_program(pulled)
    steps = pulled_steps(program, domain_of)
    for p in pulled.devices:
        for op in p.ops:
            if isinstance(op, Pull):
                assert op.step in steps and domain_of[op.holder] is not None
                assert domain_of[op.holder] == domain_of[p.device]
            elif isinstance(op, MESSAGES):
                assert op.step not in steps
    if all(v is None for v in domain_of.values()):
        assert pulled == program and not pulled.pull_sources
    sequenced = sequence_program(pulled, overlap_copy_bytes=overlap_bytes, window_ops=window_ops)
    validate_program(sequenced)
    for before, after in zip(pulled.devices, sequenced.devices, strict=True):
        assert sorted(op.step for op in after.all_ops) == sorted(op.step for op in before.ops)
        assert [op.step for op in after.ops if isinstance(op, MESSAGES)] == [
            op.step for op in before.ops if isinstance(op, MESSAGES)
        ]
        if window_ops == 1:
            assert not after.windows
    assert_exact(sequenced, src, dst, shape)
    assert decode_program(encode_program(sequenced)) == sequenced


def _relaying_program(box=((0, 2),)):
    """Device 0 sends ``box`` to 1 (another machine); 1 relays it to 2 and 3 on its own."""
    return Program(
        "float32",
        (2,),
        (
            DeviceProgram(0, (2,), None, (Send(0, (0, 1), Buffer.SRC, box),), 0, ((0, 1),)),
            DeviceProgram(
                1, None, (2,), (Recv(0, (0, 1), box), Broadcast(1, (1, 2, 3), Buffer.DST, box)), 0, ((0, 1), (1, 2, 3))
            ),
            DeviceProgram(2, None, (2,), (Broadcast(1, (1, 2, 3), write=box),), 0, ((1, 2, 3),)),
            DeviceProgram(3, None, (2,), (Broadcast(1, (1, 2, 3), write=box),), 0, ((1, 2, 3),)),
        ),
    )


def test_pulls_stay_inside_one_domain():
    """A relay to a group that leaves the domain keeps its broadcast; the holder of a pulled step
    runs nothing."""
    box = ((0, 2),)
    program = _relaying_program(box)
    validate_program(program)
    out = to_pulls(program, {0: "a", 1: "a", 2: "a", 3: "b"})
    validate_program(out)
    assert out.devices[0].ops == () and out.devices[0].connect == ()
    assert out.devices[1].ops[0] == Pull(0, 0, box, box)
    assert [type(op) for op in out.devices[1].ops[1:]] == [Broadcast]  # relay: kept
    assert out.devices[1].connect == ((1, 2, 3),)
    assert to_pulls(program, {0: "a", 1: "b"}) == program


def _pair(ops0, ops1, *, connect=((0, 1),), src1=None, background1=()):
    return Program(
        "float32",
        (4,),
        (
            DeviceProgram(0, (4,), None, ops0, 0, connect),
            DeviceProgram(1, src1, (4,), ops1, 0, connect, (), background1),
        ),
    )


def test_relays_inside_a_domain_are_published_and_pulled():
    """The relaying device publishes the slice right after the receive that brought it; its peers
    pull it from its destination shard after that publication; the relay's group is gone."""
    box = ((0, 2),)
    program = _relaying_program(box)
    out = to_pulls(program, {0: "a", 1: "b", 2: "b", 3: "b"})
    validate_program(out)
    assert out.devices[1].ops == (Recv(0, (0, 1), box), Publish(1, box, 1))
    assert out.devices[1].connect == ((0, 1),)
    for d in (2, 3):
        assert out.devices[d].ops == (Pull(1, 1, box, box, buffer=Buffer.DST, after=1),)
        assert out.devices[d].relays == ((1, (2,)),) and out.devices[d].connect == ()
    assert out.relay_sources == {2: (1,), 3: (1,)} and out.pull_sources == {}
    assert to_pulls(program, {0: "a", 1: "b", 2: "b", 3: "b"}, publishers=()) == program  # 1's shard is private
    assert decode_program(encode_program(out)) == out


def test_publications_follow_the_last_write_of_their_slice():
    """With two receives into the relayed box, the publication waits for both; a relay of another
    box publishes right after its own receive, before them (publications count in program order)."""
    lo, hi, whole = ((0, 2),), ((2, 4),), ((0, 4),)
    program = Program(
        "float32",
        (4,),
        (
            DeviceProgram(
                0, (4,), None, (Send(0, (0, 1), Buffer.SRC, lo), Send(1, (0, 1), Buffer.SRC, hi)), 0, ((0, 1),)
            ),
            DeviceProgram(
                1,
                None,
                (4,),
                (
                    Recv(0, (0, 1), lo),
                    Recv(1, (0, 1), hi),
                    Send(2, (1, 2), Buffer.DST, whole),
                    Send(3, (1, 2), Buffer.DST, lo),
                ),
                0,
                ((0, 1), (1, 2)),
            ),
            DeviceProgram(2, None, (4,), (Recv(2, (1, 2), whole), Recv(3, (1, 2), lo)), 0, ((1, 2),)),
        ),
    )
    validate_program(program)
    out = to_pulls(program, {1: "b", 2: "b"})
    validate_program(out)
    assert out.devices[1].ops == (Recv(0, (0, 1), lo), Publish(3, lo, 1), Recv(1, (0, 1), hi), Publish(2, whole, 2))
    assert [(op.step, op.after) for op in out.devices[2].ops] == [(2, 2), (3, 1)]
    sequenced = sequence_program(out)
    assert [(op.step, op.after) for op in sequenced.devices[2].ops] == [(3, 1), (2, 2)]  # the ready one first
    validate_program(sequenced)
    # in windows, the publisher still receives one slice per window, each published in its window
    # (the executor runs a publication once the ops before it have landed); its source sends both
    # slices in one window
    windowed = sequence_program(out, window_ops=4)
    validate_program(windowed)
    assert windowed.devices[1].issue_windows == (
        (Recv(0, (0, 1), lo), Publish(3, lo, 1)),
        (Recv(1, (0, 1), hi), Publish(2, whole, 2)),
    )
    assert windowed.devices[0].windows == (2,)
    assert sequence_program(out, window_ops=4, window_bytes=8).devices[0].windows == (1, 1)  # 8 bytes each


def test_a_relay_forwards_a_slice_while_the_next_comes_in():
    """A window holds one big message, except that a forward (out) and a receive (in) go together:
    device 1 forwards slice ``a`` in the window that receives ``b``, never in the one that brings
    ``a``. A send of its own source takes both directions: it waits for the big receive."""
    a, b, whole = ((0, 2),), ((2, 4),), ((0, 4),)
    relay = Program(
        "float32",
        (4,),
        (
            DeviceProgram(
                0, (4,), None, (Send(0, (0, 1), Buffer.SRC, a), Send(2, (0, 1), Buffer.SRC, b)), 0, ((0, 1),)
            ),
            DeviceProgram(
                1,
                None,
                (4,),
                (
                    Recv(0, (0, 1), a),
                    Send(1, (1, 2), Buffer.DST, a),
                    Recv(2, (0, 1), b),
                    Send(3, (1, 2), Buffer.DST, b),
                ),
                0,
                ((0, 1), (1, 2)),
            ),
            DeviceProgram(2, None, (4,), (Recv(1, (1, 2), a), Recv(3, (1, 2), b)), 0, ((1, 2),)),
        ),
    )
    validate_program(relay)
    windowed = sequence_program(relay, window_ops=4, window_bytes=4)  # each message is 8 bytes: big
    validate_program(windowed)
    assert windowed.devices[1].windows == (1, 2, 1)
    assert windowed.devices[0].windows == (1, 1) and windowed.devices[2].windows == (1, 1)
    own = Program(
        "float32",
        (4,),
        (
            DeviceProgram(0, (4,), None, (Send(0, (0, 1), Buffer.SRC, a),), 0, ((0, 1),)),
            DeviceProgram(
                1,
                (4,),
                (4,),
                (Recv(0, (0, 1), a), Send(1, (1, 2), Buffer.SRC, whole), Recv(2, (2, 1), b)),
                0,
                ((0, 1), (1, 2)),
            ),
            DeviceProgram(2, (4,), (4,), (Recv(1, (1, 2), whole), Send(2, (2, 1), Buffer.SRC, b)), 0, ((1, 2),)),
        ),
    )
    windowed = sequence_program(own, window_ops=4, window_bytes=4)
    validate_program(windowed)
    assert windowed.devices[1].windows == (1, 1, 1)
    assert sequence_program(own, window_ops=4, window_bytes=64).devices[1].windows == (3,)


def test_a_publication_in_a_window_runs_once_the_ops_before_it_landed():
    """The window's later receive is in flight while the publication waits only for the ones before
    it, so device 2 can pull, then send; a publication before the receive of its box reads it
    before it arrived; one after a receive that waits on its own puller deadlocks."""
    validate_program(publish_in_window())
    with pytest.raises(PlanError, match="before it arrived"):
        validate_program(publish_in_window(("publish", "recv_a", "recv_b")))
    with pytest.raises(PlanError, match="deadlocks"):
        validate_program(publish_in_window(("recv_a", "recv_b", "publish")))


def test_validate_rejects_broken_programs():
    a, b = ((0, 2),), ((2, 4),)
    strided = ((0, 4), (0, 1))
    validate_program(_pair((Send(0, (0, 1), Buffer.SRC, a),), (Recv(0, (0, 1), a), Copy(1, Buffer.DST, a, b))))
    cases = {
        "outside device 0's source shard": Program(
            "float32",
            (2,),
            (
                DeviceProgram(0, (2,), None, (), 0),
                DeviceProgram(1, None, (2,), (Pull(0, 0, ((1, 3),), ((0, 2),)),), 0),
            ),
        ),
        "before it arrived": _pair((Send(0, (0, 1), Buffer.SRC, a),), (Copy(1, Buffer.DST, a, b), Recv(0, (0, 1), a))),
        "but its messages use": _pair((Send(0, (0, 1), Buffer.SRC, a),), (Recv(0, (0, 1), a),), connect=()),
        "out of the global order": _pair(
            (Send(0, (0, 1), Buffer.SRC, a), Send(1, (0, 1), Buffer.SRC, b)),
            (Recv(1, (0, 1), b), Recv(0, (0, 1), a)),
        ),
        "unpaired": _pair((Send(0, (0, 1), Buffer.SRC, a),), (Broadcast(0, (0, 1), write=a),)),
        "passes through staging": Program(
            "float32",
            (4, 2),
            (
                DeviceProgram(0, (4, 2), None, (Send(0, (0, 1), Buffer.SRC, strided, 0),), 16, ((0, 1),)),
                DeviceProgram(1, None, (4, 2), (Recv(0, (0, 1), strided),), 0, ((0, 1),)),
            ),
        ),
        "touches what its other ops read": _pair(
            (Send(0, (0, 1), Buffer.SRC, a),),
            (Recv(0, (0, 1), a), Copy(2, Buffer.DST, a, b)),
            src1=(4,),
            background1=(Copy(1, Buffer.SRC, a, a),),
        ),
    }
    for message, program in cases.items():
        with pytest.raises(PlanError, match=message):
            validate_program(program)


def test_validate_replays_connects_and_windows():
    """Groups connected in a cycle of orders deadlock; in first-use order they do not; a window may
    issue a device's receives from two senders together."""
    a, b = ((0, 2),), ((2, 4),)
    g01, g02, g12 = (0, 1), (0, 2), (1, 2)

    def prog(connect1, connect2):
        return Program(
            "float32",
            (4,),
            (
                DeviceProgram(0, (4,), None, (Send(0, g01, Buffer.SRC, a), Send(1, g02, Buffer.SRC, a)), 0, (g01, g02)),
                DeviceProgram(1, (4,), (4,), (Recv(0, g01, a), Send(2, g12, Buffer.SRC, b)), 0, connect1),
                DeviceProgram(2, None, (4,), (Recv(1, g02, a), Recv(2, g12, b)), 0, connect2),
            ),
        )

    validate_program(prog((g01, g12), (g02, g12)))
    with pytest.raises(PlanError, match="deadlocks"):
        validate_program(prog((g12, g01), (g02, g12)))
    together = Program(
        "float32",
        (4,),
        (
            DeviceProgram(0, (4,), None, (Send(0, g02, Buffer.SRC, a),), 0, (g02,)),
            DeviceProgram(1, (4,), None, (Send(1, g12, Buffer.SRC, b),), 0, (g12,)),
            DeviceProgram(2, None, (4,), (Recv(0, g02, a), Recv(1, g12, b)), 0, (g02, g12), (2,)),
        ),
    )
    validate_program(together)


@SETTINGS
@given(partial_problems(), st.integers(0, 2**16), st.sampled_from([None, 0, 1]), st.integers(1, 3))
def test_partial_sources_are_combined_exactly(case, seed, domain, window_ops):
    """A Partial source arrives reduced (sum, max, min exactly; avg of quarter-integers exactly in
    float64) on every destination device that wants the value; a Partial destination's other
    devices hold zeros. Through lowering, pulls and sequencing, validated at every stage."""
    shape, dtype, src, dst, strategy = case
    plan = plan_reshard(shape, dtype, src, dst, strategy=strategy)
    program = lower_plan(plan)
    validate_program(program)
    devices = {*src.mesh.device_ids, *dst.mesh.device_ids}
    program = to_pulls(program, dict.fromkeys(devices, domain))
    program = sequence_program(program, window_ops=window_ops)
    validate_program(program)
    assert decode_program(encode_program(program)) == program
    contributions = contributions_of(src, shape, dtype, seed)
    want = reduced(contributions, src.reduce_op)
    got = interpret(program, src, want, contributions)
    dst_n = dst.for_shape(shape)
    for flat, (d, box) in enumerate(regions_by_device(dst_n, shape).items()):
        expect = np.zeros_like(want[sl(box)]) if any(dst_n.contribution(flat)) else want[sl(box)]
        np.testing.assert_array_equal(got[d], expect)


def test_partial_combines_inside_a_host_before_crossing():
    """Four contributions on two hosts (two each) reduced onto a third host: each source host sends
    the box once (a partial sum), not once per contribution."""
    from reshard import Layout, Replicate
    from reshard.ir.placement import Partial
    from reshard.ir.plan import TransferKind
    from topology import Mesh

    src = Layout(Mesh((2, 2), [0, 1, 2, 3], [0, 0, 1, 1]), (Partial(), Partial()))
    dst = Layout(Mesh((1, 2), [4, 5], [2, 2]), (Replicate(), Replicate()))
    plan = plan_reshard((64, 64), "int32", src, dst)
    hosts = plan.host_map
    crossing = [t for t in plan.transfers if t.kind is not TransferKind.COPY and hosts[t.src] != hosts[t.dsts[0]]]
    assert sorted(hosts[t.src] for t in crossing) == [0, 1]  # one message out of each source host
    assert all(plan.transfer_bytes(t) == 64 * 64 * 4 for t in crossing)
    contributions = contributions_of(src, (64, 64), "int32", 3)
    want = reduced(contributions, ReduceOp.SUM)
    got = interpret(lower_plan(plan), src, want, contributions)
    for d in (4, 5):
        np.testing.assert_array_equal(got[d], want)


@pytest.mark.parametrize(
    "dtype, op, message",
    [("bool", ReduceOp.SUM, "cannot be reduced"), ("int32", ReduceOp.AVG, "floating-point")],
)
def test_partial_refuses_what_it_cannot_reduce(dtype, op, message):
    from reshard import Layout, Replicate
    from reshard.ir.placement import Partial
    from topology import Mesh

    src = Layout(Mesh((2,), [0, 1]), (Partial(op),))
    with pytest.raises(ValueError, match=message):
        plan_reshard((4,), dtype, src, Layout(Mesh((1,), [2]), (Replicate(),)))
