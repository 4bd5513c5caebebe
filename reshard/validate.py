"""Validators: a plan covers every destination element exactly once from a holder; a program is
paired and cannot deadlock."""

from __future__ import annotations

from collections import defaultdict

from reshard.errors import PlanError
from reshard.lowering import OpKind, Program
from reshard.plan import ReshardPlan
from reshard.regions import box_volume, contains, intersect, layout_regions


def validate_plan(plan: ReshardPlan) -> None:
    """Raise PlanError unless every destination element arrives exactly once from a device holding it."""
    src_regions = dict(zip(plan.src.mesh.device_ids, layout_regions(plan.src, plan.shape), strict=True))
    dst_regions = dict(zip(plan.dst.mesh.device_ids, layout_regions(plan.dst, plan.shape), strict=True))
    delivered: dict[int, list] = defaultdict(list)
    for step, t in enumerate(plan.transfers):
        src_region = src_regions.get(t.src)
        if src_region is None or not contains(src_region, t.box):
            have = sum(box_volume(b) for d in delivered[t.src] if (b := intersect(d, t.box)))
            if have != box_volume(t.box):
                raise PlanError(f"transfer {step} ({t}): device {t.src} does not hold {t.box} when it sends it")
        for r in t.dsts:
            region = dst_regions.get(r)
            if region is None or not contains(region, t.box):
                raise PlanError(f"transfer {step} ({t}): {t.box} lies outside device {r}'s destination shard")
            for earlier in delivered[r]:
                if intersect(earlier, t.box):
                    raise PlanError(f"transfer {step} ({t}): device {r} receives elements of {t.box} twice")
            delivered[r].append(t.box)
    for device, region in dst_regions.items():
        got = sum(box_volume(b) for b in delivered[device])
        if got != box_volume(region):
            raise PlanError(
                f"device {device} receives {got} of the {box_volume(region)} elements of its shard {region}"
            )


def validate_program(program: Program) -> None:
    """Raise PlanError unless every op is matched by its peers and blocking execution in program
    order completes (no two groups wait on each other)."""
    members: dict[int, dict[int, object]] = defaultdict(dict)
    for p in program.devices:
        steps = [op.step for op in p.ops]
        if steps != sorted(steps):
            raise PlanError(f"device {p.device} issues its ops out of the global order: steps {steps}")
        for op in p.ops:
            if p.device not in op.group:
                raise PlanError(f"device {p.device} runs step {op.step} of group {op.group} it is not in")
            members[op.step][p.device] = op
    src_shapes = {p.device: p.src_shape for p in program.devices}
    for step, ops in members.items():
        first = next(iter(ops.values()))
        if first.kind is OpKind.PULL:
            _check_pulls(step, ops, src_shapes)
            continue
        if set(ops) != set(first.group):
            raise PlanError(f"step {step}: group {first.group} but ops only on devices {sorted(ops)}")
        kinds = sorted(op.kind for op in ops.values())
        expected = {
            OpKind.COPY: [OpKind.COPY],
            OpKind.SEND: [OpKind.SEND, OpKind.RECV],
            OpKind.RECV: [OpKind.SEND, OpKind.RECV],
            OpKind.BROADCAST: [OpKind.BROADCAST] * len(first.group),
        }[first.kind]
        if kinds != expected or any(op.group != first.group or op.shape != first.shape for op in ops.values()):
            raise PlanError(f"step {step}: unpaired ops {[str(op) for op in ops.values()]}")
    _check_progress(program, members)


def _check_pulls(step: int, ops: dict, src_shapes: dict) -> None:
    """Every op of a pulled step is a PULL of one box of one holder's source shard, by a device
    other than the holder (which runs nothing at that step)."""
    first = next(iter(ops.values()))
    holder = first.group[0]
    for device, op in ops.items():
        if op.kind is not OpKind.PULL or op.group != (holder, device) or op.read != first.read:
            raise PlanError(f"step {step}: pulls and other ops mixed: {[str(o) for o in ops.values()]}")
    if holder in ops:
        raise PlanError(f"step {step}: device {holder} pulls from itself")
    shape = src_shapes.get(holder)
    if (
        shape is None
        or len(first.read) != len(shape)
        or any(not 0 <= lo <= hi <= n for (lo, hi), n in zip(first.read, shape, strict=True))
    ):
        raise PlanError(f"step {step}: pull of {first.read} lies outside device {holder}'s source shard {shape}")


def _check_progress(program: Program, members) -> None:
    heads = {p.device: 0 for p in program.devices}
    ops_of = {p.device: p.ops for p in program.devices}
    arrived: dict[int, set[int]] = defaultdict(set)
    ready = [d for d in heads if ops_of[d]]
    while ready:
        device = ready.pop()
        op = ops_of[device][heads[device]]
        if op.kind is OpKind.PULL:  # waits for nobody
            heads[device] += 1
            if heads[device] < len(ops_of[device]):
                ready.append(device)
            continue
        arrived[op.step].add(device)
        if len(arrived[op.step]) < len(members[op.step]):
            continue
        for d in arrived.pop(op.step):
            heads[d] += 1
            if heads[d] < len(ops_of[d]):
                ready.append(d)
    stuck = {d: ops_of[d][h] for d, h in heads.items() if h < len(ops_of[d])}
    if stuck:
        lines = "\n".join(
            f"  device {d} waits at step {op.step} ({op.kind.name} {op.group})" for d, op in sorted(stuck.items())
        )
        raise PlanError(f"program deadlocks:\n{lines}")
