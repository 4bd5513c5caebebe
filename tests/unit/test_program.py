"""Property tests of lowered programs (no Ray, no torch): for random problems and every strategy,
lowering pairs every op and runs to completion under blocking in-order execution, slices are staged
exactly when they are strided, programs survive a msgpack round trip, and pulls (transfers inside a
shared-memory domain) keep programs valid and their result exact under a numpy interpreter."""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from problems import SETTINGS, problems, regions_by_device

from reshard import lower_plan, plan_reshard, validate_program
from reshard.lowering import Buffer, OpKind
from reshard.serialize import decode_device_program, decode_program, encode_device_program, encode_program

pytestmark = pytest.mark.unit


def _blocking_run_completes(program) -> bool:
    """Independent simulation: a step runs once every member's next op is that step."""
    heads = {p.device: 0 for p in program.devices}
    ops = {p.device: p.ops for p in program.devices}
    members = defaultdict(set)
    for p in program.devices:
        for op in p.ops:
            members[op.step].add(p.device)
    progress = True
    while progress:
        progress = False
        waiting = defaultdict(set)
        for d, h in heads.items():
            if h < len(ops[d]):
                waiting[ops[d][h].step].add(d)
        for step, ds in waiting.items():
            if ds == members[step]:
                for d in ds:
                    heads[d] += 1
                progress = True
    return all(h == len(ops[d]) for d, h in heads.items())


@SETTINGS
@given(problems())
def test_lowering_is_paired_cycle_free_and_staged_correctly(problem):
    shape, dtype, src, dst, strategy = problem
    plan = plan_reshard(shape, dtype, src, dst, strategy=strategy)
    program = lower_plan(plan)
    validate_program(program)
    assert _blocking_run_completes(program)
    by_step = defaultdict(dict)
    for p in program.devices:
        steps = [op.step for op in p.ops]
        assert steps == sorted(steps) and len(set(steps)) == len(steps)
        for op in p.ops:
            by_step[op.step][p.device] = op
            buffer_shape = p.dst_shape
            box = op.write
            if op.kind in (OpKind.SEND,) or (op.kind is OpKind.BROADCAST and op.group[0] == p.device):
                box = op.read
                buffer_shape = p.src_shape if op.read_buffer is Buffer.SRC else p.dst_shape
            if op.kind is not OpKind.COPY and box is not None:
                view = np.zeros(buffer_shape, dtype=np.uint8)[tuple(slice(lo, hi) for lo, hi in box)]
                if not op.stage:
                    assert view.flags.c_contiguous, f"{op} reads/writes a strided slice without staging"
                else:
                    assert p.staging_numel >= op.numel
    for step, ops in by_step.items():
        t = plan.transfers[step]
        assert set(ops) == set(t.group)
        kinds = sorted(op.kind.name for op in ops.values())
        expected = {"COPY": ["COPY"], "SEND": ["RECV", "SEND"], "BROADCAST": ["BROADCAST"] * len(t.group)}
        assert kinds == expected[t.kind.name]


@SETTINGS
@given(problems())
def test_program_msgpack_round_trip(problem):
    shape, dtype, src, dst, strategy = problem
    program = lower_plan(plan_reshard(shape, dtype, src, dst, strategy=strategy))
    assert decode_program(encode_program(program)) == program
    for p in program.devices:
        assert decode_device_program(encode_device_program(p, program.dtype)) == (program.dtype, p)


def interpret(program, src_layout, dst_layout, full: np.ndarray) -> dict[int, np.ndarray]:
    """Run every device's program in numpy, step by step in the global order: the destination
    shards it produces. Staged and unstaged slices behave alike here (numpy copies either)."""
    src = {d: full[tuple(slice(lo, hi) for lo, hi in box)].copy()
           for d, box in regions_by_device(src_layout, full.shape).items()}  # fmt: skip
    dst = {p.device: np.zeros(p.dst_shape, full.dtype) for p in program.devices if p.dst_shape is not None}
    by_step = defaultdict(dict)
    for p in program.devices:
        for op in p.ops:
            by_step[op.step][p.device] = op

    def sl(box):
        return tuple(slice(lo, hi) for lo, hi in box)

    for step in sorted(by_step):
        ops = by_step[step]
        root = next(iter(ops.values())).group[0]
        if root in ops:  # a message (or a local copy): the root reads, everybody else writes
            rop = ops[root]
            data = (src[root] if rop.read_buffer is Buffer.SRC else dst[root])[sl(rop.read)].copy()
            for d, op in ops.items():
                if op.write is not None:
                    dst[d][sl(op.write)] = data
        else:  # pulls: every op reads the holder's source shard itself
            for d, op in ops.items():
                assert op.kind is OpKind.PULL
                dst[d][sl(op.write)] = src[root][sl(op.read)]
    return dst


@st.composite
def problems_with_domains(draw):
    problem = draw(problems())
    _, _, src, dst, _ = problem
    devices = sorted(set(src.mesh.device_ids) | set(dst.mesh.device_ids))
    domain_of = {d: draw(st.sampled_from([None, 0, 1])) for d in devices}
    return problem, domain_of


@SETTINGS
@given(problems_with_domains())
def test_pulls_keep_the_program_valid_and_its_result_exact(case):
    from reshard.pulls import pull_sources, pulled_steps, to_pulls

    (shape, dtype, src, dst, strategy), domain_of = case
    plan = plan_reshard(shape, dtype, src, dst, strategy=strategy)
    program = lower_plan(plan)
    pulled = to_pulls(program, domain_of)
    validate_program(pulled)
    assert _blocking_run_completes(pulled)
    full = np.arange(math.prod(shape), dtype=np.int64).reshape(shape)
    want = {d: full[tuple(slice(lo, hi) for lo, hi in box)] for d, box in regions_by_device(dst, shape).items()}
    for got in (interpret(program, src, dst, full), interpret(pulled, src, dst, full)):
        for d, w in want.items():
            np.testing.assert_array_equal(got[d], w)
    steps = pulled_steps(program, domain_of)
    for p in pulled.devices:
        for op in p.ops:
            if op.kind is OpKind.PULL:
                holder = op.group[0]
                assert op.step in steps and domain_of[holder] is not None
                assert domain_of[holder] == domain_of[p.device]
            elif op.kind is not OpKind.COPY:
                assert op.step not in steps
        assert p.staging_numel == max((op.numel for op in p.ops if op.stage), default=0)
    if all(v is None for v in domain_of.values()):
        assert pulled == program and not pull_sources(pulled)
    assert decode_program(encode_program(pulled)) == pulled


def test_pulls_need_the_holders_source_shard():
    """A relay (the sender forwards from its destination shard) keeps its message; a group that
    leaves the domain keeps its broadcast; the holder of a pulled step runs nothing."""
    from reshard.lowering import DeviceProgram, Op, Program
    from reshard.pulls import to_pulls

    box = ((0, 2),)
    progs = (
        DeviceProgram(0, (2,), None, (Op(OpKind.SEND, 0, (0, 1), (2,), Buffer.SRC, box),), 0),
        DeviceProgram(1, None, (2,), (Op(OpKind.RECV, 0, (0, 1), (2,), None, None, box),
                                      Op(OpKind.BROADCAST, 1, (1, 2, 3), (2,), Buffer.DST, box)), 0),
        DeviceProgram(2, None, (2,), (Op(OpKind.BROADCAST, 1, (1, 2, 3), (2,), None, None, box),), 0),
        DeviceProgram(3, None, (2,), (Op(OpKind.BROADCAST, 1, (1, 2, 3), (2,), None, None, box),), 0),
    )  # fmt: skip
    program = Program("float32", (2,), progs)
    validate_program(program)
    out = to_pulls(program, {0: "a", 1: "a", 2: "a", 3: "b"})
    validate_program(out)
    assert out.devices[0].ops == ()
    assert out.devices[1].ops[0] == Op(OpKind.PULL, 0, (0, 1), (2,), Buffer.SRC, box, box)
    assert [op.kind for op in out.devices[1].ops[1:]] == [OpKind.BROADCAST]  # relay: kept
    assert to_pulls(program, {0: "a", 1: "b"}) == program


def test_validate_rejects_bad_pulls():
    from reshard.errors import PlanError
    from reshard.lowering import DeviceProgram, Op, Program

    def program(read, src_shape=(2,)):
        return Program("float32", (2,), (
            DeviceProgram(0, src_shape, None, (), 0),
            DeviceProgram(1, None, (2,), (Op(OpKind.PULL, 0, (0, 1), (2,), Buffer.SRC, read, ((0, 2),)),), 0),
        ))  # fmt: skip

    validate_program(program(((0, 2),)))
    with pytest.raises(PlanError, match="outside device 0's source shard"):
        validate_program(program(((1, 3),)))
    with pytest.raises(PlanError, match="outside device 0's source shard"):
        validate_program(program(((0, 2),), src_shape=None))
