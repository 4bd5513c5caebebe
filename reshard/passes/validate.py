"""Validators: a plan covers every destination element exactly once from a holder; a program is
paired, cannot deadlock, and every device reads only data that is there when it reads it."""

from __future__ import annotations

from collections import defaultdict

from reshard.dtypes import itemsize
from reshard.errors import PlanError
from reshard.ir.batch import BatchProgram, Bucket
from reshard.ir.plan import ReshardPlan, TransferKind
from reshard.ir.program import (
    LOCAL_OPS,
    MESSAGE_OPS,
    Broadcast,
    Buffer,
    Copy,
    DeviceProgram,
    Program,
    Publish,
    Pull,
    Recv,
    Scale,
    Send,
    first_use_groups,
    group_of,
    op_box,
    op_numel,
    reads_output,
    writes,
)
from reshard.ir.regions import Box, box_volume, contains, device_regions, intersect, is_contiguous
from reshard.ir.tasks import zero_devices


def validate_plan(plan: ReshardPlan) -> None:
    """Raise PlanError unless every destination element arrives exactly once, from a device holding
    it, with every contribution combined (Partial sources), on the devices that want it.

    Replays the transfers over what each device holds: its source shard (one contribution of its
    region, or the value), and what earlier transfers wrote into its scratch and destination shards,
    each box with the set of contributions combined in it. A read must find the box whole in one
    place; a plain write must land on nothing; a combining write must land on a box holding
    contributions the incoming one does not; relays and the final shards need all contributions.
    """
    src = plan.src.for_shape(plan.shape)
    dst = plan.dst.for_shape(plan.shape)
    src_regions = device_regions(src, plan.shape)
    dst_regions = device_regions(dst, plan.shape)
    contribution = {d: src.contribution(i) for i, d in enumerate(src.mesh.device_ids)}
    every = frozenset(src.contribution(i) for i in range(src.mesh.size))
    wants = {d: r for d, r in dst_regions.items() if d not in set(zero_devices(dst))}
    held: dict[tuple[int, Buffer], dict] = defaultdict(dict)  # (device, buffer) -> {box: contributions}

    def read(step, t) -> frozenset:
        buffer = t.read
        region = src_regions.get(t.src)
        if buffer is None:
            buffer = Buffer.SRC if region is not None and contains(region, t.box) else Buffer.DST
        if buffer is Buffer.SRC:
            if region is None or not contains(region, t.box):
                raise PlanError(f"transfer {step} ({t}): device {t.src} does not hold {t.box} in its source shard")
            return frozenset({contribution[t.src]})
        got = _held(held[(t.src, buffer)], t.box)
        if got is None:
            raise PlanError(f"transfer {step} ({t}): device {t.src} does not hold {t.box} when it sends it")
        if buffer is Buffer.DST and got != every:
            raise PlanError(f"transfer {step} ({t}): device {t.src} relays {t.box} before all contributions arrived")
        return got

    for step, t in enumerate(plan.transfers):
        if t.kind is TransferKind.SCALE:
            if _held(held[(t.src, Buffer.DST)], t.box) != every:
                raise PlanError(f"transfer {step} ({t}): scales {t.box} before all contributions arrived")
            continue
        value = read(step, t)
        for r in t.dsts:
            if t.write is Buffer.DST:
                region = dst_regions.get(r)
                if region is None or not contains(region, t.box) or r not in wants:
                    raise PlanError(f"transfer {step} ({t}): {t.box} lies outside device {r}'s destination shard")
            else:
                region = src_regions.get(r)
                if region is None or not contains(region, t.box):
                    raise PlanError(f"transfer {step} ({t}): scratch {t.box} outside device {r}'s source shard shape")
            boxes = held[(r, t.write)]
            if t.reduce:
                there = boxes.get(t.box)
                if there is None or there & value:
                    raise PlanError(
                        f"transfer {step} ({t}): device {r} combines {t.box} with contributions it "
                        f"{'does not hold yet' if there is None else 'already holds'}"
                    )
                boxes[t.box] = there | value
                continue
            for earlier in boxes:
                if intersect(earlier, t.box) is not None:
                    raise PlanError(f"transfer {step} ({t}): device {r} receives elements of {t.box} twice")
            boxes[t.box] = value
    for device, region in wants.items():
        boxes = held[(device, Buffer.DST)]
        got = sum(box_volume(b) for b, v in boxes.items() if v == every)
        if got != box_volume(region):
            raise PlanError(
                f"device {device} receives {got} of the {box_volume(region)} elements of its shard {region}"
                + (" with every contribution combined" if src.partial_axes else "")
            )


def _held(boxes: dict, box) -> frozenset | None:
    """The contributions in ``box`` if earlier writes cover it whole with one set of them."""
    near = [b for b in boxes if intersect(b, box) is not None]
    sets = {boxes[b] for b in near}
    if len(sets) != 1 or _covered(box, near) != box_volume(box):
        return None
    return sets.pop()


def _covered(box, boxes) -> int:
    """Elements of ``box`` inside ``boxes`` (which do not overlap each other)."""
    return sum(box_volume(b) for other in boxes if (b := intersect(other, box)) is not None)


def validate_program(program: Program) -> None:
    """Raise ``PlanError`` unless the program is well formed (each device's ops can run in order
    without a deadlock and write every destination element once):

    - every device issues its message ops in the global step order, and every step's ops are
      matched by all members of its group (pulls: see ``_check_pulls``); a device's publications
      are counted 1, 2, ... in order;
    - every device connects exactly the groups its messages use, and connecting them in the listed
      orders, then issuing the ops window by window, completes (no two groups wait on each other,
      no pull of a relay waits for a publication that waits for it);
    - a device reads a box of its destination shard only after it was written (a relay), its
      background ops touch nothing its foreground ops read, and its staged slices are exactly the
      strided ones, inside its staging buffer, side by side within a window.
    """
    item = itemsize(program.dtype)
    members: dict[int, dict[int, object]] = defaultdict(dict)
    for p in program.devices:
        steps = [op.step for op in p.ops if isinstance(op, MESSAGE_OPS)]
        if steps != sorted(steps):
            raise PlanError(f"device {p.device} issues its messages out of the global order: steps {steps}")
        if any(isinstance(op, MESSAGE_OPS) for op in p.background):
            raise PlanError(f"device {p.device}: background ops must be local copies or pulls")
        for op in p.all_ops:
            if isinstance(op, MESSAGE_OPS) and p.device not in op.group:
                raise PlanError(f"device {p.device} runs step {op.step} of group {op.group} it is not in")
            if op.step in members and p.device in members[op.step]:
                raise PlanError(f"device {p.device} runs step {op.step} twice")
            members[op.step][p.device] = op
        counts = [op.count for op in p.all_ops if isinstance(op, Publish)]
        if counts != list(range(1, len(counts) + 1)):
            raise PlanError(f"device {p.device} publishes out of order: counts {counts}")
        if set(p.connect) != set(first_use_groups(p.ops)) or len(set(p.connect)) != len(p.connect):
            raise PlanError(
                f"device {p.device} connects {list(p.connect)} but its messages use {list(first_use_groups(p.ops))}"
            )
        _check_dataflow(p)
        _check_staging(p, item)
    shapes = {
        Buffer.SRC: {p.device: p.src_shape for p in program.devices},
        Buffer.DST: {p.device: p.dst_shape for p in program.devices},
    }
    for step, ops in members.items():
        first = next(iter(ops.values()))
        if isinstance(first, Pull | Publish):
            _check_pulls(step, ops, shapes)
            _check_relay_shapes(step, ops, program)
        elif isinstance(first, Copy | Scale):
            if len(ops) != 1:
                raise PlanError(f"step {step}: a local op on several devices {sorted(ops)}")
        else:
            _check_message(step, ops)
    _check_progress(program, members)


def _check_message(step: int, ops: dict) -> None:
    first = next(iter(ops.values()))
    group = first.group
    if set(ops) != set(group):
        raise PlanError(f"step {step}: group {group} but ops only on devices {sorted(ops)}")
    if any(op.group != group or op_numel(op) != op_numel(first) for op in ops.values()):
        raise PlanError(f"step {step}: ops disagree on group or size: {list(ops.values())}")
    kinds = {type(op) for op in ops.values()}
    if kinds == {Send, Recv}:
        ok = isinstance(ops[group[0]], Send) and len(group) == 2 and isinstance(ops[group[1]], Recv)
    else:
        root = ops[group[0]]
        ok = kinds == {Broadcast} and root.read is not None
        ok = ok and all(op.write is not None for d, op in ops.items() if d != group[0])
    if not ok:
        raise PlanError(f"step {step}: unpaired ops {list(ops.values())}")


def _check_pulls(step: int, ops: dict, shapes: dict) -> None:
    """Every op of a pulled step is a pull of one box of one holder's buffer, by a device other
    than the holder, which runs nothing at that step (a source shard) or publishes that box with
    the count the pulls wait for (a relay out of its destination shard)."""
    pulls = {d: op for d, op in ops.items() if isinstance(op, Pull)}
    if not pulls:
        raise PlanError(f"step {step}: a publication nobody pulls: {list(ops.values())}")
    first = next(iter(pulls.values()))
    holder = first.holder
    for op in pulls.values():
        if (op.holder, op.read, op.buffer, op.after) != (holder, first.read, first.buffer, first.after):
            raise PlanError(f"step {step}: pulls of different slices: {list(pulls.values())}")
    if holder in pulls:
        raise PlanError(f"step {step}: device {holder} pulls from itself")
    if first.buffer is Buffer.DST:
        publication = ops.get(holder)
        if publication != Publish(step, first.read, first.after):
            raise PlanError(
                f"step {step}: device {holder} must publish {first.read} as its publication {first.after} "
                f"for the pulls of its destination shard, got {publication}"
            )
    if set(ops) - set(pulls) - ({holder} if first.buffer is Buffer.DST else set()):
        raise PlanError(f"step {step}: pulls and other ops mixed: {list(ops.values())}")
    shape = shapes[first.buffer].get(holder)
    if (
        shape is None
        or len(first.read) != len(shape)
        or any(not 0 <= lo <= hi <= n for (lo, hi), n in zip(first.read, shape, strict=True))
    ):
        raise PlanError(
            f"step {step}: pull of {first.read} lies outside device {holder}'s "
            f"{'source' if first.buffer is Buffer.SRC else 'destination'} shard {shape}"
        )


def _check_relay_shapes(step: int, ops: dict, program: Program) -> None:
    """A device that pulls relays names each holder's destination shape as the holder has it."""
    for d, op in ops.items():
        if isinstance(op, Pull) and op.buffer is Buffer.DST:
            relays = dict(program.for_device(d).relays)
            if relays.get(op.holder) != program.for_device(op.holder).dst_shape:
                raise PlanError(
                    f"device {d} step {step}: pulls device {op.holder}'s destination shard but names its shape "
                    f"{relays.get(op.holder)}"
                )


def _check_dataflow(p: DeviceProgram) -> None:
    """A device reads (relays, combines into, scales) a box of its destination or scratch buffer
    only once it was written in an earlier window (or by an earlier local op of the same window; a
    publication: by any earlier op of its window, it runs once they landed); background ops read
    neither buffer and write nothing its other ops read."""
    if p.tmp and p.src_shape is None:
        raise PlanError(f"device {p.device} uses a scratch buffer but holds no source shard to shape it")
    done: dict = defaultdict(list)  # buffer -> boxes written by completed windows and local ops so far
    reads: dict = defaultdict(list)
    for window in p.issue_windows:
        pending: list[tuple[Buffer, Box]] = []  # written by the window's messages so far
        for op in window:
            buffer = reads_output(op)
            if buffer is not None:
                box = (
                    op.write
                    if isinstance(op, Scale) or (isinstance(op, Copy | Pull | Recv) and op.reduce is not None)
                    else op_box(op)
                )
                if buffer is Buffer.TMP and not p.tmp:
                    raise PlanError(f"device {p.device} step {op.step} reads a scratch buffer it does not have")
                landed = done[buffer] + [b for buf, b in pending if buf is buffer and isinstance(op, Publish)]
                if _covered(box, landed) != box_volume(box):
                    raise PlanError(
                        f"device {p.device} step {op.step} reads {box} of its {buffer.name.lower()} buffer "
                        "before it arrived"
                    )
                reads[buffer].append(box)
            written = writes(op)
            if written is not None and not isinstance(op, Scale) and getattr(op, "reduce", None) is None:
                if isinstance(op, LOCAL_OPS):
                    done[written[0]].append(written[1])
                else:
                    pending.append(written)
        for buffer, box in pending:
            done[buffer].append(box)
    for op in p.background:
        written = writes(op)
        if reads_output(op) is not None or (
            written and any(intersect(written[1], r) is not None for r in reads[written[0]])
        ):
            raise PlanError(f"device {p.device}: background op of step {op.step} touches what its other ops read")


def _check_staging(p: DeviceProgram, item: int) -> None:
    """Staged slices are exactly the strided ones (and every received contribution that is
    combined), inside the staging buffer, side by side within a window."""
    shapes = {Buffer.SRC: p.src_shape, Buffer.TMP: p.src_shape, Buffer.DST: p.dst_shape}
    for window in p.issue_windows:
        spans: list[tuple[int, int]] = []
        for op in window:
            if not isinstance(op, MESSAGE_OPS):
                continue
            box = op_box(op)
            buffer = getattr(op, "buffer", None)
            shape = shapes[buffer if buffer is not None else getattr(op, "target", Buffer.DST)]
            strided = shape is not None and not is_contiguous(box, shape)
            need = strided or getattr(op, "reduce", None) is not None
            if need != (op.staging is not None):
                why = "passes through staging" if need else "is contiguous"
                raise PlanError(f"device {p.device} step {op.step}: its slice {box} {why}; staging={op.staging}")
            if op.staging is not None:
                span = (op.staging, op.staging + op_numel(op) * item)
                if span[0] < 0 or span[1] > p.staging_bytes:
                    raise PlanError(f"device {p.device} step {op.step}: staging {span} outside {p.staging_bytes} B")
                if any(a < span[1] and span[0] < b for a, b in spans):
                    raise PlanError(f"device {p.device} step {op.step}: staging {span} overlaps another op's")
                spans.append(span)


def _phases(p: DeviceProgram) -> list[tuple[tuple, tuple]]:
    """``p`` as the replay sees it: (keys it issues, keys it then waits for) per phase. A window
    is a phase, except that a pull of a relay (it blocks until the holder's publication ran)
    starts a phase of its own, after the window's earlier ops completed (stricter than the
    executor, which only issued them: a replay that completes so, completes as executed), and
    that a publication is issued in a phase of its own once the window's messages before it
    completed (the window's later messages are already issued)."""
    out: list[tuple[tuple, tuple]] = [((("connect", g),), (("connect", g),)) for g in p.connect]
    for window in p.issue_windows:
        issue: list = []
        wait: list = []
        published: list[tuple[tuple, list]] = []  # (publication, the window's waits before it)
        for op in window:
            if isinstance(op, Pull) and op.buffer is Buffer.DST:
                if issue or wait or published:
                    _close(out, issue, wait, published)
                    issue, wait, published = [], [], []
                wait.append(("published", op.holder, op.after))
            elif isinstance(op, Publish):
                published.append((("published", p.device, op.count), list(wait)))
            elif isinstance(op, MESSAGE_OPS):
                issue.append(("step", op.step))
                wait.append(("step", op.step))
        _close(out, issue, wait, published)
    return out


def _close(out: list, issue: list, wait: list, published: list) -> None:
    """Append one window's phases: its messages issued, then each publication once the waits
    before it completed, then the rest of the waits."""
    for key, before in published:
        out.append((tuple(issue), tuple(before)))
        issue = [key]
    out.append((tuple(issue), tuple(wait)))


def _check_progress(program: Program, members) -> None:
    """Replay: each device connects its groups in order (a connect completes once every member
    reached it), then issues its windows (``_phases``); an op completes once every member of its
    step issued theirs, a window once all its ops completed. A publication completes when its
    device issues it; pulls of a relay wait for it; other pulls and copies wait for nobody."""
    issued: dict[object, set[int]] = defaultdict(set)
    need: dict[object, set[int]] = {("step", s): set(ops) for s, ops in members.items()}
    for p in program.devices:
        for g in p.connect:
            need[("connect", g)] = set(g)
        for op in p.ops:
            if isinstance(op, Publish):
                need[("published", p.device, op.count)] = {p.device}
    plans = {p.device: _phases(p) for p in program.devices}
    for d, seq in plans.items():
        for _, wait in seq:
            for k in wait:
                if k not in need:
                    raise PlanError(f"device {d} waits for {k}, which no device issues")
    heads = dict.fromkeys(plans, 0)
    waiting = dict.fromkeys(plans, False)
    progress = True
    while progress:
        progress = False
        for d, seq in plans.items():
            while heads[d] < len(seq):
                keys, wait = seq[heads[d]]
                if not waiting[d]:
                    for k in keys:
                        issued[k].add(d)
                    waiting[d] = True
                    progress = True
                if any(issued[k] != need[k] for k in wait):
                    break
                heads[d] += 1
                waiting[d] = False
                progress = True
    stuck = {d: plans[d][h] for d, h in heads.items() if h < len(plans[d])}
    if stuck:
        lines = "\n".join(f"  device {d} waits at {list(keys[1])}" for d, keys in sorted(stuck.items()))
        raise PlanError(f"program deadlocks:\n{lines}")


def validate_batch(batch: BatchProgram) -> None:
    """Raise PlanError unless a batch is well formed: every bucket is matched by all members of its
    group with the same size and the same pieces (tensor, step, offset, bytes) in the same order,
    each piece a box of the member's shard of that tensor (the sender's source shard, a receiver's
    destination shard) of exactly its bytes; every device issues its buckets in the global order,
    within its staging buffer (a window's side by side), and connects exactly the groups its
    buckets and parts use. Each part was validated as its tensor's program before packing."""
    members: dict[int, dict[int, Bucket]] = defaultdict(dict)
    fits: set = set()  # (shape, box, nbytes, dtype) of pieces found to fit: a tree's tensors alike repeat them
    uses: dict[int, tuple] = {}  # id(part program) -> the groups its ops use first
    for p in batch.devices:
        steps = [b.step for b in p.buckets]
        if steps != sorted(set(steps)):
            raise PlanError(f"device {p.device} issues its buckets out of the global order: {steps}")
        parts = {part.tensor: part.program for part in p.parts}
        for b in p.buckets:
            if p.device not in b.group:
                raise PlanError(f"device {p.device} runs bucket {b.step} of group {b.group} it is not in")
            members[b.step][p.device] = b
            sender = b.group[0] == p.device
            for piece in b.pieces:
                prog = parts.get(piece.tensor)
                shape = None if prog is None else prog.src_shape if sender else prog.dst_shape
                key = (shape, piece.box, piece.nbytes, batch.dtypes[piece.tensor])
                if key in fits:
                    continue
                if (
                    shape is None
                    or len(piece.box) != len(shape)
                    or any(not 0 <= lo <= hi <= n for (lo, hi), n in zip(piece.box, shape, strict=True))
                ):
                    raise PlanError(
                        f"device {p.device} bucket {b.step}: piece {piece.box} of tensor {piece.tensor} lies outside "
                        f"its {'source' if sender else 'destination'} shard {shape}"
                    )
                if box_volume(piece.box) * itemsize(batch.dtypes[piece.tensor]) != piece.nbytes:
                    raise PlanError(f"device {p.device} bucket {b.step}: piece {piece} is not its box's bytes")
                fits.add(key)
        spans: list[tuple[int, int]] = []
        for window in p.issue_windows:
            spans = []
            for b in window:
                span = (b.staging, b.staging + b.nbytes)
                if span[0] < 0 or span[1] > p.staging_bytes or any(a < span[1] and span[0] < e for a, e in spans):
                    raise PlanError(f"device {p.device} bucket {b.step}: staging {span} overlaps or exceeds its buffer")
                spans.append(span)
        used = [group_of(b.group) for b in p.buckets]
        for part in p.parts:
            groups = uses.get(id(part.program))
            if groups is None:
                groups = uses[id(part.program)] = first_use_groups(part.program.ops)
            used += groups
        if set(p.connect) != set(used) or len(set(p.connect)) != len(p.connect):
            raise PlanError(f"device {p.device} connects {list(p.connect)} but uses {list(dict.fromkeys(used))}")
    for step, buckets in members.items():
        first = next(iter(buckets.values()))
        if set(buckets) != set(first.group):
            raise PlanError(f"bucket {step}: group {first.group} but buckets only on devices {sorted(buckets)}")
        layout = [(q.tensor, q.step, q.offset, q.nbytes) for q in first.pieces]
        for b in buckets.values():
            if b.group != first.group or b.nbytes != first.nbytes:
                raise PlanError(f"bucket {step}: members disagree on group or size: {list(buckets.values())}")
            if [(q.tensor, q.step, q.offset, q.nbytes) for q in b.pieces] != layout:
                raise PlanError(f"bucket {step}: members lay out different pieces")
