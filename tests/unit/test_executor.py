"""The executor without Ray: every device of a compiled reshard runs ``execute`` on a thread of
this process, over numpy shards, through in-process communicators that move the bytes and record
what each device issued. Checked: exact destination shards (plain and Partial sources, pulls,
windows, staging), that each device issues its messages exactly in its program's order (the
executor decides nothing), and failures: an op that raises, a peer that aborts, a deadline, and
buffers that do not match the program, each a ``ReshardError`` naming the cause, nobody hanging."""

from __future__ import annotations

import contextlib
import functools
import math
import re
import threading
import time
from collections import defaultdict, deque
from types import SimpleNamespace

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

from reshard import Layout, Replicate, Shard, validate_program
from reshard.errors import ReshardError, ReshardTimeout
from reshard.ir.placement import Partial
from reshard.ir.program import Broadcast, Publish, Recv, Send, group_of
from reshard.ir.serialize import decode_device_program, encode_device_program
from reshard.passes.compile import CompileOptions, compile_reshard
from reshard.runtime import arrays
from reshard.runtime.backends.communicator import Communicator, PeerFailed
from reshard.runtime.device import executor as executor_module
from reshard.runtime.device.executor import Run, StagingBuffer, execute, prepare
from reshard.runtime.device.shared_memory import PeerShards, RelayBoard, SharedShards
from topology import Cluster, Mesh

pytestmark = pytest.mark.unit
MESSAGES = (Send, Recv, Broadcast)
RUN = "run"  # the destination name every run_all run publishes relays under


class Fabric:
    """The wires between in-process communicators: per (group, from rank, to rank) a queue of
    messages; a log of what each device issued; aborted groups."""

    def __init__(self):
        self.cond = threading.Condition()
        self.mail: dict[tuple, deque] = defaultdict(deque)
        self.aborted: set[tuple] = set()
        self.issued: dict[int, list[tuple]] = defaultdict(list)

    def post(self, key, data: bytes) -> None:
        with self.cond:
            self.mail[key].append(data)
            self.cond.notify_all()

    def take(self, key, group, timeout_s: float) -> bytes:
        with self.cond:
            ok = self.cond.wait_for(lambda: self.mail[key] or group in self.aborted, timeout_s)
            if self.mail[key]:
                return self.mail[key].popleft()
            if ok:
                raise PeerFailed(f"group {group} was aborted")
            raise ReshardTimeout(f"nothing arrived on {key} in {timeout_s:.1f} s")


class Waiting:
    def __init__(self, fn):
        self.fn = fn

    def wait(self, timeout_s: float) -> None:
        self.fn(timeout_s)


class LocalComm(Communicator):
    """A group member whose messages are byte copies through the ``Fabric``."""

    def __init__(self, fabric: Fabric, group, device: int):
        super().__init__(group, group.index(device), 60.0)
        self.fabric, self.device = fabric, device

    def _issue(self, kind, peer, t):
        self.fabric.issued[self.device].append((kind, self.group, peer, int(t.numel())))

    def isend(self, t, peer):
        self._issue("send", peer, t)
        self.fabric.post((self.group, self.rank, peer), t.numpy().tobytes())
        return Waiting(lambda timeout_s: None)

    def irecv(self, t, peer):
        self._issue("recv", peer, t)
        return Waiting(lambda timeout_s: self._land(t, (self.group, peer, self.rank), timeout_s))

    def ibroadcast(self, t, root):
        self._issue("broadcast", root, t)
        if self.rank == root:
            data = t.numpy().tobytes()
            for r in range(self.size):
                if r != root:
                    self.fabric.post((self.group, root, r), data)
            return Waiting(lambda timeout_s: None)
        return Waiting(lambda timeout_s: self._land(t, (self.group, root, self.rank), timeout_s))

    def _land(self, t, key, timeout_s):
        data = self.fabric.take(key, self.group, timeout_s)
        assert len(data) == t.numel(), f"{key}: {len(data)} B sent, {t.numel()} B expected"
        t.numpy()[...] = np.frombuffer(data, np.uint8)

    def send(self, t, peer):
        self.isend(t, peer).wait(self.timeout_s)

    def recv(self, t, peer):
        self.irecv(t, peer).wait(self.timeout_s)

    def broadcast(self, t, root):
        self.ibroadcast(t, root).wait(self.timeout_s)

    def all_reduce(self, t, op="sum"):
        raise NotImplementedError("the executor never all-reduces")

    def abort(self):
        with self.fabric.cond:
            self.fabric.aborted.add(self.group)
            self.fabric.cond.notify_all()


class Groups:
    def __init__(self, fabric, device):
        self.fabric, self.device, self.comms = fabric, device, {}

    def get(self, group):
        if group not in self.comms:
            self.comms[group] = LocalComm(self.fabric, tuple(group), self.device)
        return self.comms[group]


def run_all(compiled, dtype: str, sources: dict, *, deadline_s=30.0, before_op=None, break_buffers=None, batch=None):
    """Run every participant's shipped program on its own thread; returns (destinations, errors,
    fabric). A failing device aborts its program's groups, as the device actor does. Relays go
    through the real shared-memory path: a publishing device's destination shard is a memfd block
    on its own ``RelayBoard``, and pullers find it through ``PeerShards.relay``."""
    fabric = Fabric()
    dst, errors = {}, {}
    deadline = time.monotonic() + deadline_s
    prepared = {d: prepare(decode_device_program(blob)[1], dtype) for d, blob in compiled.blobs.items()}
    memory = SharedShards()
    boards = {d: RelayBoard() for d, p in prepared.items() if p.program.publishes}
    storage = arrays.storage(dtype)

    def device(d):
        p = prepared[d]
        prog = p.program
        groups = Groups(fabric, d)
        out = None if prog.dst_shape is None else arrays.empty(prog.dst_shape, dtype)
        publish = relayed = slot = None
        if d in boards:
            out = memory.allocate(out.nbytes).view(storage).reshape(prog.dst_shape)
            memory.begin(out)
            slot = boards[d].open(RUN, memory.descriptor(out))
            publish = functools.partial(boards[d].post, slot)
        if prog.relays:
            pulls, shapes = PeerShards(d), dict(prog.relays)

            def relayed(holder, after):
                return pulls.relay(holder, boards[holder].descriptor, RUN, after, shapes[holder], storage, deadline)[0]

        tmp = arrays.empty(prog.src_shape, dtype) if prog.tmp else None
        peers = {h: sources[h] for h in prog.holders}
        staging = StagingBuffer("cpu", 1 << 20)
        staging.reserve(prog.staging_bytes)
        src = sources.get(d) if prog.src_shape is not None else None
        if break_buffers is not None:
            src, out = break_buffers(d, src, out)
        try:
            execute(
                Run(
                    p,
                    src=src,
                    dst=out,
                    groups=groups,
                    staging=staging,
                    deadline=deadline,
                    peers=peers,
                    tmp=tmp,
                    before_op=before_op,
                    batch=batch and batch(d, fabric),
                    relayed=relayed,
                    publish=publish,
                )
            )
            dst[d] = out
        except BaseException as e:
            errors[d] = e
            if slot is not None:
                boards[d].fail(slot)
            for g in prog.connect:
                groups.get(g).abort()

    threads = [threading.Thread(target=device, args=(d,)) for d in prepared]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for board in boards.values():
        board.close()
    return dst, errors, fabric


def source_shards(src: Layout, full, contributions=None):
    regions = regions_by_device(src.for_shape(full.shape), full.shape)
    out = {}
    for flat, (d, box) in enumerate(regions.items()):
        whole = full if contributions is None else contributions[src.for_shape(full.shape).contribution(flat)]
        out[d] = whole[(*(slice(lo, hi) for lo, hi in box), Ellipsis)].copy()
    return out


@SETTINGS
@given(problems(), st.sampled_from([None, "half", "all"]), st.integers(1, 4), st.sampled_from([0, 1 << 30]))
def test_every_device_lands_exactly_its_destination_shard(problem, shared, window_ops, overlap):
    shape, dtype, src, dst, strategy = problem
    domains = {}
    if shared is not None:
        devices = sorted(set(src.mesh.device_ids) | set(dst.mesh.device_ids))
        domains = {d: 0 if shared == "all" else d % 2 for d in devices}
    options = CompileOptions(overlap_copy_bytes=overlap, window_ops=window_ops)
    compiled = compile_reshard(shape, dtype, src, dst, strategy=strategy, domains=domains, options=options)
    full = np.arange(math.prod(shape)).reshape(shape).astype(arrays.storage(dtype))
    got, errors, fabric = run_all(compiled, dtype, source_shards(src, full))
    assert not errors, errors
    for d, box in regions_by_device(dst.for_shape(shape), shape).items():
        np.testing.assert_array_equal(got[d], full[tuple(slice(lo, hi) for lo, hi in box)])
    kinds = {Send: "send", Recv: "recv", Broadcast: "broadcast"}
    for p in compiled.program.devices:  # issued as written: every message, in program order
        want = [(kinds[type(op)], group_of(op.group)) for w in p.issue_windows for op in w if isinstance(op, MESSAGES)]
        assert [i[:2] for i in fabric.issued[p.device]] == want, p.device


@SETTINGS
@given(partial_problems(), st.integers(0, 2**16))
def test_partial_sources_combine_exactly(problem, seed):
    shape, dtype, src, dst, strategy = problem
    compiled = compile_reshard(shape, dtype, src, dst, strategy=strategy)
    contributions = contributions_of(src, shape, dtype, seed)
    whole = reduced(contributions, src.reduce_op)
    got, errors, _ = run_all(compiled, dtype, source_shards(src, whole, contributions))
    assert not errors, errors
    dst_n = dst.for_shape(shape)
    for flat, (d, box) in enumerate(regions_by_device(dst_n, shape).items()):
        want = whole[tuple(slice(lo, hi) for lo, hi in box)]
        np.testing.assert_array_equal(got[d], np.zeros_like(want) if any(dst_n.contribution(flat)) else want)


def _case(dtype="float32", n=4):
    src = Layout(Mesh((n,), list(range(n)), list(range(n))), (Shard(0),))
    dst = Layout(Mesh((n,), list(range(n, 2 * n)), list(range(n, 2 * n))), (Replicate(),))
    compiled = compile_reshard((8 * n, 6), dtype, src, dst, strategy="broadcast")
    full = np.arange(8 * n * 6, dtype=arrays.storage(dtype)).reshape(8 * n, 6)
    return compiled, source_shards(src, full), full


@pytest.mark.parametrize("shape", [(), (1,), (3, 2)])
def test_numpy_into_torch_keeps_the_shape_zero_d_included(shape):
    import torch

    src = np.array(np.arange(np.prod(shape, dtype=int)).reshape(shape) + 2.5, dtype=np.float16)
    dst = torch.zeros(shape, dtype=torch.float16)
    arrays.copy(dst, src)  # a 0-d array once became 1-d on the way: "doesn't match the broadcast shape"
    assert tuple(dst.shape) == shape and np.array_equal(dst.numpy(), src)


def test_bfloat16_moves_as_bits_and_sums_in_bfloat16():
    """numpy has no bfloat16: shards hold its bit patterns and only combining goes through torch."""
    torch = pytest.importorskip("torch")
    full = torch.arange(24, dtype=torch.bfloat16).reshape(4, 6) / 3
    parts = [full, full * 2]
    src = Layout(Mesh((2,), [0, 1], [0, 1]), (Partial(),))
    dst = Layout(Mesh((2,), [2, 3], [2, 3]), (Shard(0),))
    compiled = compile_reshard((4, 6), "bfloat16", src, dst)
    shards = {d: arrays.as_numpy(parts[i]).copy() for i, d in enumerate([0, 1])}
    got, errors, _ = run_all(compiled, "bfloat16", shards)
    assert not errors, errors
    want = arrays.as_numpy(parts[0] + parts[1])
    assert np.array_equal(np.concatenate([got[2], got[3]]), want)  # the same bits torch computes


def _relay_case():
    """Shard -> replicate between two 2-host meshes, each host one memory domain: every slice
    crosses the network to one device of a host, which publishes it to the other."""
    src = Layout(Mesh((2, 2), [0, 1, 2, 3], [0, 0, 1, 1]), (Shard(0), Shard(1)))
    dst = Layout(Mesh((2, 2), [4, 5, 6, 7], [2, 2, 3, 3]), (Replicate(), Replicate()))
    cluster = Cluster(
        4, 2, nic_GBps=0.12, intra_host_GBps=2.8, latency_us=900, intra_host_latency_us=100, backend="gloo"
    )
    # big enough that relaying beats every destination receiving from every source in windows
    compiled = compile_reshard((1024, 512), "float32", src, dst, cluster=cluster, domains={d: d // 2 for d in range(8)})
    full = np.arange(1024 * 512, dtype=np.float32).reshape(1024, 512)
    return compiled, source_shards(src, full), full


def test_relays_are_pulled_through_the_relaying_devices_board():
    compiled, shards, full = _relay_case()
    assert compiled.relay_sources, "the case relays nothing"
    got, errors, _ = run_all(compiled, "float32", shards)
    assert not errors, errors
    for d in range(4, 8):
        np.testing.assert_array_equal(got[d], full)


def test_a_publication_runs_once_the_receive_before_it_landed_while_the_next_is_in_flight():
    """Device 1 receives ``a`` and ``b`` in one window and publishes ``a`` between them; device 2
    pulls ``a`` from it before it sends ``b``: the run completes, ``a`` had landed when it was
    published, and 2 pulled those bytes."""
    program = publish_in_window()
    validate_program(program)
    compiled = SimpleNamespace(blobs={p.device: encode_device_program(p, "float32") for p in program.devices})
    sources = {0: np.arange(4, dtype=np.float32) + 1, 2: np.arange(4, dtype=np.float32) + 10}
    published = []

    def before_op(run, op):
        if isinstance(op, Publish):
            published.append(run.dst[:2].copy())

    got, errors, _ = run_all(compiled, "float32", sources, before_op=before_op)
    assert not errors, errors
    np.testing.assert_array_equal(published, [[1, 2]])
    np.testing.assert_array_equal(got[1], [1, 2, 12, 13])
    np.testing.assert_array_equal(got[2], [1, 2])


def test_a_relaying_device_that_fails_fails_its_pullers_as_peers():
    """The publisher marks its board failed; a device waiting for its publication raises
    PeerFailed at once, not at the deadline."""
    compiled, shards, _ = _relay_case()
    publisher = next(iter(compiled.relay_sources.values()))[0]

    def before_op(run, op):
        if run.device == publisher and isinstance(op, Publish):
            raise RuntimeError("injected: the relaying device broke")

    _, errors, _ = run_all(compiled, "float32", shards, deadline_s=600, before_op=before_op)
    assert isinstance(errors.pop(publisher), RuntimeError)
    pullers = [d for d, hs in compiled.relay_sources.items() if publisher in hs]
    assert pullers and all(isinstance(errors[d], PeerFailed) for d in pullers), errors


def test_an_op_that_fails_aborts_its_groups_and_peers_fail_as_peers():
    """The failing device raises its own error; the peers waiting on it raise PeerFailed (the
    groups were aborted), not a timeout, long before the deadline."""
    compiled, shards, _ = _case()
    root = compiled.plan.transfers[0].group[0]

    def before_op(run, op):
        if run.device == root:
            raise RuntimeError("injected: the copy engine broke")

    _, errors, _ = run_all(compiled, "float32", shards, deadline_s=600, before_op=before_op)
    assert isinstance(errors.pop(root), RuntimeError)
    assert errors and all(isinstance(e, PeerFailed) for e in errors.values()), errors


def test_a_peer_that_never_comes_is_a_timeout():
    compiled, shards, _ = _case()
    sender = compiled.plan.transfers[0].group[0]

    def before_op(run, op):
        if run.device == sender:  # holds its first op until a receiver gave up and aborted
            fabric = run.groups.fabric
            with fabric.cond:
                fabric.cond.wait_for(lambda: fabric.aborted, 60)

    _, errors, _ = run_all(compiled, "float32", shards, deadline_s=0.5, before_op=before_op)
    receivers = [d for d in errors if d != sender]
    kinds = {type(errors[d]) for d in receivers}
    assert ReshardTimeout in kinds and kinds <= {ReshardTimeout, PeerFailed}, errors  # the rest: its abort


@pytest.mark.parametrize(
    "broken, message",
    [
        (lambda src, dst: (src.astype(np.float64), dst), "source shard is float64"),
        (lambda src, dst: (src[:1], dst), r"source shard is float32\[1, 6\]"),
        (lambda src, dst: (None, dst), "needs a source shard"),
    ],
    ids=["dtype", "shape", "missing"],
)
def test_buffers_that_do_not_match_the_program_are_refused(broken, message):
    compiled, shards, _ = _case()
    bad = compiled.plan.transfers[0].group[0]

    def break_buffers(d, src, dst):
        return broken(src, dst) if d == bad else (src, dst)

    _, errors, _ = run_all(compiled, "float32", shards, break_buffers=break_buffers)
    assert isinstance(errors[bad], ReshardError) and not isinstance(errors[bad], PeerFailed)
    assert re.search(message, str(errors[bad])), errors[bad]


def test_a_batching_backend_gets_one_block_per_window():
    """Where the backend batches (NCCL's ``grouped``), each window of messages is issued inside
    one block (a single message too: one group call per window), in program order, and waited for
    after it closes."""
    compiled, shards, full = _case(n=4)
    compiled = compile_reshard(
        (32, 6),
        "float32",
        compiled.plan.src,
        compiled.plan.dst,
        strategy="broadcast",
        options=CompileOptions(window_ops=3),
    )
    blocks: dict[int, list] = defaultdict(list)

    def batch(device, fabric):
        @contextlib.contextmanager
        def grouped(timeout_s):
            assert timeout_s > 0
            blocks[device].append(len(fabric.issued[device]))  # ops issued before the block opened
            yield
            blocks[device].append(len(fabric.issued[device]))

        return grouped

    got, errors, _ = run_all(compiled, "float32", shards, batch=batch)
    assert not errors, errors
    for d in range(4, 8):
        np.testing.assert_array_equal(got[d], full)
    for p in compiled.program.devices:
        windows = prepare(p, "float32").windows
        sizes = [n for w in windows if (n := sum(isinstance(s.op, Send | Recv | Broadcast) for s in w))]
        spans = [b - a for a, b in zip(blocks[p.device][::2], blocks[p.device][1::2], strict=True)]
        assert spans == sizes, (p.device, spans, p.windows)
    assert any(n > 1 for p in compiled.program.devices for n in p.windows)  # windows were there to batch


def run_batch(compiled, sources: dict, *, as_torch: bool = False, deadline_s: float = 30.0):
    """Every participant of a compiled batch runs ``execute_batch`` on its own thread over
    in-process communicators (as ``run_all``; no pulls: compiled without domains). ``sources[t][d]``:
    device ``d``'s source shard of tensor ``t``; ``as_torch``: buffers as torch tensors (what a GPU
    device hands the executor). Returns (destinations by (tensor, device), errors, fabric)."""
    from reshard.ir.serialize import decode_batch_device_program
    from reshard.runtime.device.batches import BatchRun, execute_batch, prepare_batch

    fabric = Fabric()
    dst, errors = {}, {}
    deadline = time.monotonic() + deadline_s
    prepared = {d: prepare_batch(*decode_batch_device_program(blob)) for d, blob in compiled.blobs.items()}

    def device(d):
        p = prepared[d]
        groups = Groups(fabric, d)
        staging = StagingBuffer("cpu", 1 << 20)
        if as_torch:
            import torch

            staging.device = "torch-cpu"  # a torch byte buffer, as on a GPU
            staging.buf = torch.empty(p.staging_bytes, dtype=torch.uint8)
        else:
            staging.reserve(p.staging_bytes)
        runs = {}
        for part, pp in zip(p.program.parts, p.parts, strict=True):
            prog = pp.program
            src = sources[part.tensor].get(d) if prog.src_shape is not None else None
            out = None if prog.dst_shape is None else arrays.empty(prog.dst_shape, pp.dtype)
            if as_torch:
                src = None if src is None else arrays.as_torch(src, pp.dtype)
                out = None if out is None else arrays.as_torch(out, pp.dtype)
            runs[part.tensor] = Run(pp, src=src, dst=out, groups=groups, staging=staging, deadline=deadline)
        try:
            stats = execute_batch(BatchRun(p, runs, groups, staging, deadline), verify=True)
            dst.update({(t, d): r.dst for t, r in runs.items() if r.dst is not None})
            dst[("checks", d)] = stats["checks"]
        except BaseException as e:
            errors[d] = e
            for g in p.groups:
                groups.get(g).abort()

    threads = [threading.Thread(target=device, args=(d,)) for d in prepared]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return dst, errors, fabric


@pytest.mark.parametrize("as_torch", [False, True], ids=["numpy", "torch"])
@pytest.mark.parametrize("window_ops", [1, 4])
def test_a_batch_runs_its_buckets_then_its_parts_exactly(as_torch, window_ops):
    """Twelve small tensors of three dtypes and a big one, 2 -> 2 devices without shared memory:
    the small ones' slices in one bucket per pair (one message each way; one group call per bucket
    on a backend that batches), the big one streamed; every destination bit-exact, every device's
    messages in its program's order, and the checksums of what was read and received agree."""
    from reshard.passes.compile import BatchItem, compile_batch
    from reshard.runtime.checksums import first_mismatch

    src_mesh, dst_mesh = Mesh((2,), (0, 1), (0, 1)), Mesh((2,), (2, 3), (2, 3))
    items, fulls = [], []
    for t in range(12):
        dtype = ("float32", "int64", "bfloat16")[t % 3]
        storage = "int16" if dtype == "bfloat16" else dtype
        fulls.append((np.arange(6 * 5) * (t + 1)).astype(storage).reshape(6, 5))
        items.append(BatchItem((6, 5), dtype, Layout(src_mesh, (Shard(t % 2),)), Layout(dst_mesh, (Shard(1 - t % 2),))))
    fulls.append(np.arange(256 * 64, dtype=np.float32).reshape(256, 64))
    items.append(BatchItem((256, 64), "float32", Layout(src_mesh, (Shard(0),)), Layout(dst_mesh, (Replicate(),))))
    compiled = compile_batch(
        items, strategy="send_recv", options=CompileOptions(window_ops=window_ops), bucket_bytes=4096
    )
    pieces = sum(len(b.pieces) for p in compiled.program.devices for b in p.buckets if b.group[0] == p.device)
    assert compiled.program.buckets == 4 and pieces == 12 * 4  # one bucket per pair carries every small slice
    sources = {t: source_shards(item.src, fulls[t]) for t, item in enumerate(items)}
    dst, errors, fabric = run_batch(compiled, sources, as_torch=as_torch)
    assert not errors, errors
    for t, item in enumerate(items):
        for d, box in regions_by_device(item.dst, item.shape).items():
            got = dst[(t, d)]
            got = arrays.as_numpy(got) if as_torch else got
            np.testing.assert_array_equal(got, fulls[t][tuple(slice(lo, hi) for lo, hi in box)])
    for d, issued in fabric.issued.items():
        want = [b.group for b in compiled.program.for_device(d).buckets]
        assert [g for _, g, _, _ in issued[: len(want)]] == [tuple(g) for g in map(group_of, want)]
    assert first_mismatch({d: dst[("checks", d)] for d in (0, 1, 2, 3)}) is None


def test_staging_views_are_made_once_per_buffer_and_never_outlive_it(monkeypatch):
    """A bucket's piece views are made once while the buffer stays, made anew (of the new buffer)
    when a run reserves another size or the buffer is trimmed, and all dropped past the bound."""
    staging = StagingBuffer("cpu", 1 << 10)
    staging.reserve(64)
    made = []

    def make(buf):
        made.append(buf.buf)
        return [buf.view(0, "float32", (4,)), buf.view(16, "float32", (4,))]

    bucket, other = object(), object()
    first = staging.views(bucket, make)
    assert staging.views(bucket, make) is first and len(made) == 1
    staging.view(0, "float32", (4,))[:] = 7
    assert (first[0] == 7).all(), "the views are of the buffer the run writes"
    staging.reserve(128)
    again = staging.views(bucket, make)
    assert again is not first and len(made) == 2 and again[0].base is not first[0].base
    staging.reserve(1 << 11)
    staging.views(bucket, make)
    staging.trim()  # bigger than it keeps: freed, its views with it
    assert staging.buf is None and not staging._views
    staging.reserve(64)
    monkeypatch.setattr(executor_module, "VIEWS_KEPT", 3)
    staging.views(bucket, make)
    staging.views(other, make)  # four views: past the bound, the first bucket's are dropped
    assert list(staging._views) == [id(other)]
