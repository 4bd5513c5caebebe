"""The CPU stand-in for cupy itself (tests/gpu/standin): how it is activated, that it reports
itself, and the behaviour the NCCL backend's tests rely on: stream and event order, faults on
freed memory, ``ncclInProgress`` and the refusal of calls before it clears, matching of
collectives and send/recv, local aborts, destroy refusals, and the injected faults. Ranks here are
threads of this process (each NCCL call keeps its own per-thread group state) talking over real
sockets; the cross-process paths run through Ray actors at the end. Skipped with a real cupy.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from reshard.errors import ReshardTimeout

pytestmark = pytest.mark.gpu(1)

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(TESTS)


@pytest.fixture(autouse=True)
def standin_control():
    import importlib.util

    spec = importlib.util.find_spec("cupy")
    if spec is None or not (spec.origin or "").startswith(os.path.join(os.path.dirname(__file__), "standin")):
        pytest.skip("tests of the CPU stand-in; cupy here is the real one")
    from cupy import _control

    os.environ.setdefault("NCCL_COMM_BLOCKING", "0")  # as the backend sets it, before the first creation
    yield _control
    _control.clear_faults()


def _python(code: str, env: dict | None = None, timeout_s: float = 120) -> subprocess.CompletedProcess:
    """A fresh interpreter with the stand-in on its path (as Ray workers have it), unless ``env`` says
    otherwise; no RESHARD_* or NCCL_* variables of this process."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("RESHARD_", "NCCL_"))}
    base["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH", "")) if p)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**base, **(env or {})},
    )


def _status(error: BaseException) -> int | None:
    from reshard.runtime.backends.nccl import nccl_status

    return nccl_status(error)


def _settle(raw, timeout_s: float = 30.0) -> int:
    """Poll ``check_async_error`` until it leaves ncclInProgress; 0 or the error's status."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            raw.check_async_error()
            return 0
        except Exception as e:
            status = _status(e)
            if status != 7:
                return status
        assert time.monotonic() < deadline, "still in progress"
        time.sleep(0.005)


def _call(fn, *args) -> int:
    """An NCCL call: 0, or the status it raised (7 for ncclInProgress, as cupy raises it)."""
    try:
        fn(*args)
        return 0
    except Exception as e:
        return _status(e)


def _create(n: int, ranks=None, uid: bytes | None = None) -> list:
    """Communicators of ``ranks`` (default all ``n``), each made in its own thread inside a group."""
    from cupy.cuda import nccl

    uid = nccl.get_unique_id() if uid is None else uid
    ranks = list(range(n)) if ranks is None else ranks
    comms, ended = {}, {}

    def create(r):
        nccl.groupStart()
        comms[r] = nccl.NcclCommunicator(n, uid, r)
        ended[r] = _call(nccl.groupEnd)

    threads = [threading.Thread(target=create, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert ended == dict.fromkeys(ranks, 7)  # non-blocking: each group ends at once, in progress
    return [comms[r] for r in ranks]


def _on_stream(fn):
    """Run ``fn(stream)`` with a fresh non-blocking stream current; returns (result, stream)."""
    import cupy

    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        return fn(s), s


# ------------------------------------------------------------------------------------------------
# what it is, and when it is active


def test_the_standin_reports_itself_and_passes_the_unweakened_gpu_stack_check():
    import cupy
    from cupy.cuda import nccl

    from reshard.runtime.backends import cuda_buffers as cb

    assert cupy._standin is True and cupy.__version__.endswith("+standin")
    # no distribution of its own (a real cupy it shadows on a machine without a GPU is listed)
    assert all(name.startswith("cupy-cuda") for name, _ in cb.installed_cupy_distributions())
    assert cb.loaded_nccl_libraries() == []
    cb.check_gpu_stack()
    assert cb.nccl_version_tuple(nccl.get_version()) == (2, 30, 7)
    assert len(cupy.cuda.runtime.getDeviceProperties(0)["uuid"]) <= 16


@pytest.mark.parametrize(
    ("env", "active"),
    [({}, True), ({"RESHARD_GPU_STANDIN": "0"}, False), ({"RESHARD_REQUIRE_GPUS": "1"}, False), ("fake", None)],
)
def test_activation_needs_no_gpu_no_promise_and_no_opt_out(env, active, tmp_path):
    if env == "fake":  # an installed cupy is shadowed only where no NVIDIA GPU exists
        active = not glob.glob("/dev/nvidia[0-9]*")
        (tmp_path / "cupy").mkdir()
        (tmp_path / "cupy" / "__init__.py").write_text("")
        env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), REPO])}
    else:
        env = {**env, "PYTHONPATH": REPO}  # a machine without cupy, before activation
    out = _python(
        f"""
        import importlib.util, os, sys
        spec = importlib.util.spec_from_file_location("top_conftest", {os.path.join(TESTS, "conftest.py")!r})
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        print(module.GPU_STANDIN, module.STANDIN in sys.path, module.STANDIN in os.environ.get("PYTHONPATH", ""))
        """,
        env,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(active)] * 3


def test_importing_the_backend_imports_no_cupy():
    out = _python(
        "import sys, reshard, reshard.runtime.backends.nccl, reshard.runtime.backends.cuda_buffers, "
        "reshard.runtime.backends.registry; print('cupy' in sys.modules)"
    )
    assert out.returncode == 0 and out.stdout.split() == ["False"], out.stderr


# ------------------------------------------------------------------------------------------------
# streams and memory


def test_streams_run_in_order_and_only_events_order_one_after_another(standin_control):
    import cupy

    a = cupy.zeros(1000, dtype=cupy.int32)
    a.get()  # written

    def produce(s):
        standin_control.sleep(0.5)
        a.fill(7)
        return s.record()

    written, producer = _on_stream(produce)
    assert not written.done
    stale, _ = _on_stream(lambda s: a.copy())  # no wait: runs while the producer still sleeps

    def ordered(s):
        s.wait_event(written)
        return a.copy()

    fresh, consumer = _on_stream(ordered)
    consumer.synchronize()
    assert written.done and set(fresh.get().tolist()) == {7}
    assert set(stale.get().tolist()) == {0}
    # the legacy default stream waits for blocking streams (not for non-blocking ones)
    blocking = cupy.cuda.Stream()
    with blocking:
        standin_control.sleep(0.2)
        a.fill(9)
    assert set(cupy.asnumpy(a).tolist()) == {9}


def test_a_kernel_on_freed_memory_faults_the_whole_context():
    """A buffer freed while an NCCL kernel queued on a stream still has to read it (a staging
    lifetime bug): the kernel faults, and every later query of the context reports it."""
    out = _python(
        """
        import time
        import cupy
        from cupy import _control
        from cupy.cuda import nccl
        nccl.groupStart()
        c = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
        nccl.groupEnd()  # NCCL_COMM_BLOCKING unset: a blocking communicator, ready here
        x = cupy.arange(256, dtype=cupy.float32)
        s = cupy.cuda.Stream(non_blocking=True)
        with s:
            _control.sleep(0.3)  # the broadcast below waits behind this
        c.bcast(x.data.ptr, x.size, nccl.NCCL_FLOAT32, 0, s.ptr)
        del x  # freed while the stream still has to read it
        done = s.record()
        try:
            s.synchronize()
        except cupy.cuda.runtime.CUDARuntimeError as e:
            print("raised", e.status)
        print(done.done, _control.sticky_error())
        """
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["raised", "700", "False", "700"], out.stdout + out.stderr
    assert "illegal memory access" in out.stderr


# ------------------------------------------------------------------------------------------------
# NCCL: non-blocking creation, matching, abort, destroy


def test_creation_is_in_progress_until_every_rank_joined_and_use_is_refused_meanwhile():
    import cupy
    from cupy.cuda import nccl

    uid = nccl.get_unique_id()
    (first,) = _create(2, [0], uid)
    x = cupy.zeros(8, dtype=cupy.float32)
    time.sleep(0.2)
    assert _call(first.check_async_error) == 7  # cupy 14 raises ncclInProgress as KeyError(7)
    assert _call(first.bcast, x.data.ptr, 8, nccl.NCCL_FLOAT32, 0, 0) == 4  # ncclInvalidArgument
    (second,) = _create(2, [1], uid)
    assert _settle(first) == 0 and _settle(second) == 0
    assert (first.rank_id(), second.rank_id(), first.size()) == (0, 1, 2)
    first.destroy()
    second.destroy()
    assert first.comm == second.comm == 0


def test_collectives_match_by_sequence_and_a_mismatch_hangs_until_abort(standin_control):
    import cupy
    from cupy.cuda import nccl

    comms = _create(2)
    for c in comms:
        assert _settle(c) == 0
    bufs = [cupy.full(64, r + 1, dtype=cupy.int64) for r in range(2)]
    for b in bufs:
        b.get()  # filled on the null stream, which the non-blocking streams below do not wait for
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(2)]

    def run(roots):
        done = []
        for r, (c, b, s) in enumerate(zip(comms, bufs, streams, strict=True)):
            assert _call(c.bcast, b.data.ptr, 64, nccl.NCCL_INT64, roots[r], s.ptr) == 7
            assert _settle(c) == 0  # launched
            done.append(s.record())
        return done

    first = run([0, 0])
    deadline = time.monotonic() + 30
    while not all(e.done for e in first):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert [set(b.get(streams[0]).tolist()) for b in bufs] == [{1}, {1}]
    second = run([0, 1])  # rank 1 thinks rank 1 is the root of the same broadcast
    deadline = time.monotonic() + 30
    while not any("hangs or corrupts data" in d for d in standin_control.diagnostics()):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.3)
    assert not any(e.done for e in second)
    for c in comms:
        c.abort()
    for s in streams:
        s.synchronize()  # the hung kernels exit on abort and the streams go on


def test_send_and_recv_match_by_peer_and_order_within_one_group():
    import cupy
    from cupy.cuda import nccl

    comms = _create(3)
    for c in comms:
        assert _settle(c) == 0
    out = {}

    def rank(r):
        c = comms[r]
        s = cupy.cuda.Stream(non_blocking=True)
        nccl.groupStart()
        if r == 1:
            got = [cupy.zeros(n, dtype=cupy.int32) for n in (30, 10, 20)]
            for g in got:
                g.get()  # zeroed (null stream) before the receives on the non-blocking stream land
            for (peer, _), g in zip(((2, 0), (0, 0), (0, 1)), got, strict=True):
                c.recv(g.data.ptr, g.size, nccl.NCCL_INT32, peer, s.ptr)
        else:
            sizes = (10, 20) if r == 0 else (30,)
            got = [cupy.arange(n, dtype=cupy.int32) + 100 * r + n for n in sizes]
            for g in got:
                g.get()  # computed (null stream) before the non-blocking stream sends it
                c.send(g.data.ptr, g.size, nccl.NCCL_INT32, 1, s.ptr)
        assert _call(nccl.groupEnd) == 7
        assert _settle(c) == 0
        s.synchronize()
        out[r] = [g.get().tolist() for g in got]

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert out[1] == [out[2][0], out[0][0], out[0][1]]


def test_a_first_receive_launches_only_once_its_peer_sends():
    """NCCL connects a pair at its first send/receive: until the sender's first send, the
    receiver's launch stays in progress (and its communicator takes no other call)."""
    import cupy
    from cupy.cuda import nccl

    comms = _create(2)
    for c in comms:
        assert _settle(c) == 0
    s0, s1 = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    x, y = cupy.arange(128, dtype=cupy.float32), cupy.zeros(128, dtype=cupy.float32)
    assert _call(comms[1].recv, y.data.ptr, 128, nccl.NCCL_FLOAT32, 0, s1.ptr) == 7
    assert _call(comms[1].check_async_error) == 7  # connecting
    assert _call(comms[0].send, x.data.ptr, 128, nccl.NCCL_FLOAT32, 1, s0.ptr) == 7
    assert _settle(comms[0]) == 0 and _settle(comms[1]) == 0
    s0.synchronize()
    s1.synchronize()
    assert (y == x).all()
    for c in comms:
        c.destroy()


def test_abort_is_local_so_the_peer_keeps_waiting_until_it_aborts_too():
    import cupy
    from cupy.cuda import nccl

    comms = _create(2)
    for c in comms:
        assert _settle(c) == 0
    s, s0 = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    x = cupy.zeros(128, dtype=cupy.float32)
    # one exchange connects the pair (runtime connection), so the next receive launches
    assert _call(comms[0].send, x.data.ptr, 128, nccl.NCCL_FLOAT32, 1, s0.ptr) == 7
    assert _call(comms[1].recv, x.data.ptr, 128, nccl.NCCL_FLOAT32, 0, s.ptr) == 7
    assert _settle(comms[0]) == 0 and _settle(comms[1]) == 0
    s0.synchronize()
    s.synchronize()
    assert _call(comms[1].recv, x.data.ptr, 128, nccl.NCCL_FLOAT32, 0, s.ptr) == 7
    assert _settle(comms[1]) == 0
    waiting = s.record()
    comms[0].abort()
    time.sleep(0.5)
    assert comms[0].comm == 0 and not waiting.done
    assert _call(comms[1].check_async_error) == 0  # NCCL tells the peer nothing
    comms[1].abort()
    s.synchronize()


def test_destroy_refuses_a_communicator_in_progress_and_it_leaks(standin_control):
    from cupy.cuda import nccl

    uid = nccl.get_unique_id()
    live = standin_control.live_communicators()
    (first,) = _create(2, [0], uid)
    first.destroy()  # void in cupy: the refusal is invisible to the caller
    assert first.comm == 0 and standin_control.live_communicators() == live + 1
    assert any("ncclCommDestroy" in d and "refused" in d for d in standin_control.diagnostics())
    (second,) = _create(2, [1], uid)  # the leaked rank still completes the group
    assert _settle(second) == 0
    second.destroy()
    assert standin_control.live_communicators() == live + 1


def test_blocking_communicators_block_in_creation():
    out = _python(
        """
        import threading, time
        from cupy.cuda import nccl
        uid = nccl.get_unique_id()
        made = []
        t = threading.Thread(target=lambda: made.append(nccl.NcclCommunicator(2, uid, 1)))
        t0 = time.monotonic()
        t.start()
        time.sleep(0.5)
        alone = not made
        c = nccl.NcclCommunicator(2, uid, 0)  # NCCL_COMM_BLOCKING unset: returns once both joined
        t.join()
        c.check_async_error()
        print(alone, bool(made), time.monotonic() - t0 >= 0.5)
        """
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True", "True"]


# ------------------------------------------------------------------------------------------------
# injected faults


def test_a_rank_that_never_joins_keeps_the_others_in_progress(standin_control):
    standin_control.inject("never_join", rank=1)
    comms = _create(2)
    time.sleep(0.5)
    assert [_call(c.check_async_error) for c in comms] == [7, 7]
    for c in comms:
        c.abort()
    assert standin_control.armed_faults() == []


@pytest.mark.parametrize(("code", "raised"), [(6, "NcclError"), (8, "KeyError")])
def test_an_injected_async_error_fails_the_communicator_and_its_kernel_never_completes(standin_control, code, raised):
    import cupy
    from cupy.cuda import nccl

    (c,) = _create(1)
    assert _settle(c) == 0
    standin_control.inject("async_error", code=code)
    s = cupy.cuda.Stream(non_blocking=True)
    x = cupy.ones(16, dtype=cupy.float32)
    assert _call(c.bcast, x.data.ptr, 16, nccl.NCCL_FLOAT32, 0, s.ptr) == 7
    deadline = time.monotonic() + 10
    while True:
        try:
            c.check_async_error()
        except Exception as e:
            if _status(e) != 7:
                error = e
                break
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert type(error).__name__ == raised and _status(error) == code  # ncclTimeout: KeyError(8) in cupy 14
    stuck = s.record()
    time.sleep(0.3)
    assert not stuck.done
    c.abort()
    s.synchronize()


def test_a_wedged_call_returns_only_when_another_thread_aborts(standin_control):
    (c,) = _create(1)
    assert _settle(c) == 0
    standin_control.inject("hang", call="check_async_error")
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("status", _call(c.check_async_error)))
    t.start()
    time.sleep(0.3)
    assert t.is_alive()
    c.abort()
    t.join(10)
    assert result == {"status": 3}  # ncclInternalError


# ------------------------------------------------------------------------------------------------
# through the backend


@pytest.fixture
def one_rank():
    from reshard.runtime.backends.nccl import NcclBackend

    backend = NcclBackend(timeout_s=10)
    (rdv,) = backend.local_rendezvous([(0,)])
    yield backend, backend.connect(rdv, 0, 30)
    backend.close()


EARLY_WORK = "while an NCCL launch for it is ncclInProgress"


def test_work_issued_on_a_stream_before_its_nccl_launch_finished_is_reported(standin_control):
    import cupy
    from cupy.cuda import nccl

    (c,) = _create(1)
    assert _settle(c) == 0
    s = cupy.cuda.Stream(non_blocking=True)
    x = cupy.ones(16, dtype=cupy.float32)
    x.get()  # filled (on the null stream, which a non-blocking stream does not wait for) before s reads it
    seen = len(standin_control.diagnostics())
    with standin_control.launches_held():  # the launch stays ncclInProgress until the block ends
        assert _call(c.bcast, x.data.ptr, 16, nccl.NCCL_FLOAT32, 0, s.ptr) == 7
        with s:
            y = x * 2  # the backend never does this: it polls until the launch left ncclInProgress
    assert any(EARLY_WORK in d for d in standin_control.diagnostics()[seen:])
    assert _settle(c) == 0
    s.synchronize()
    assert set(y.get().tolist()) == {2.0}
    c.destroy()


def test_the_backend_orders_its_stream_after_a_long_cupy_kernel(standin_control, one_rank):
    import cupy

    backend, comm = one_rank
    seen = len(standin_control.diagnostics())
    a = cupy.zeros(1 << 16, dtype=cupy.int32)
    b = cupy.full(1 << 16, -1, dtype=cupy.int32)
    a.get()
    side = cupy.cuda.Stream(non_blocking=True)
    with side:
        standin_control.sleep(0.5)
        a.fill(7)
        written = side.record()
        assert not written.done  # the write is still queued when NCCL is asked to read
        with backend.grouped():
            comm.send(a[::2], 0)  # strided: packed into staging on the comm stream
            comm.recv(b[1::2], 0)
        got = b.copy()  # on the producer's stream, after the arrival
    side.synchronize()
    host = got.get()
    assert set(host[1::2].tolist()) == {7} and set(host[::2].tolist()) == {-1}
    assert standin_control.diagnostics()[seen:] == []  # nothing issued early, no mismatch, no fault


def test_nccl_timeout_is_a_reshard_timeout_and_aborts_at_once(standin_control, one_rank):
    import cupy

    backend, comm = one_rank
    standin_control.inject("async_error", code=8)
    t0 = time.monotonic()
    with pytest.raises(ReshardTimeout):
        comm.broadcast(cupy.ones(64, dtype=cupy.float32), 0)
    assert comm.aborted and time.monotonic() - t0 < 8  # at NCCL's error, not at the 10 s deadline


@pytest.fixture(scope="module")
def pair(nccl_ranks):
    return nccl_ranks(2, 0.5, timeout_s=60, gpu_sharing="hostid")


def test_across_processes_the_comm_stream_waits_for_a_long_cupy_kernel(pair, connect_ranks):
    # bodies shipped to the actors are defined here: cloudpickle sends them by value
    def send_after_long_kernel(actor, group, peer, n):
        import cupy
        from cupy import _control

        comm = actor.backend.communicator(group)
        a = cupy.zeros(n, dtype=cupy.int32)
        a.get()
        side = cupy.cuda.Stream(non_blocking=True)
        with side:
            _control.sleep(0.5)
            a.fill(7)
            pending = not side.record().done
            comm.send(a, peer)
        return pending

    def recv_values(actor, group, peer, n):
        import cupy

        comm = actor.backend.communicator(group)
        b = cupy.full(n, -1, dtype=cupy.int32)
        comm.recv(b, peer)
        return sorted(set(b.get().tolist()))

    def diagnostics(actor):
        from cupy import _control

        return _control.diagnostics()

    group = (0, 1)
    connect_ranks(pair, pair.rendezvous([group]))
    sender = pair.submit(send_after_long_kernel, group, 1, 1 << 18, device=0)
    receiver = pair.submit(recv_values, group, 0, 1 << 18, device=1)
    assert pair.ray.get([sender, receiver], timeout=120) == [True, [7]]
    assert pair.call(diagnostics) == [[], []]  # the backend issued nothing early on its stream


def test_across_processes_members_issuing_different_broadcasts_time_out(pair, connect_ranks):
    def broadcast(actor, group, root, seconds):
        import cupy

        comm = actor.backend.communicator(group)
        comm.timeout_s = seconds
        try:
            comm.broadcast(cupy.zeros(16, dtype=cupy.float32), root)
        except Exception as e:
            return type(e).__name__
        return "completed"

    group = (0, 1)
    pids = pair.pids()
    connect_ranks(pair, pair.rendezvous([group]))
    refs = [pair.submit(broadcast, group, root, 2.0, device=d) for d, root in ((0, 0), (1, 1))]
    kinds = sorted(pair.ray.get(refs, timeout=120))
    # the first to reach its deadline aborts and tells the other, which may stop on that notice
    assert kinds in (["ReshardTimeout", "ReshardTimeout"], ["PeerFailed", "ReshardTimeout"]), kinds
    assert pair.pids() == pids  # no actor died
