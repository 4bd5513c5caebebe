"""The NCCL backend's parts that run without a GPU: dtype and reduction tables, group naming,
id-host assignment, NCCL environment and settings agreement, GPU sharing, the status codes cupy
raises, the abort side channel (real UDP over loopback), the wedge guard, the polling and abort
logic of the backend, the GPU-stack diagnosis, the backend registry and the staging allocator.

Nothing here needs cupy, a GPU or Ray; the GPU behaviour is tested in tests/gpu/."""

import ast
import ctypes
import os
import pickle
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from reshard.dtypes import ITEMSIZE
from reshard.errors import ReshardTimeout
from reshard.runtime.backends import cuda_buffers as cb
from reshard.runtime.backends import registry as backends
from reshard.runtime.backends.communicator import Backend, PeerFailed
from reshard.runtime.backends.nccl import (
    BOOTSTRAP_ROOT_THREAD,
    NCCL_IN_PROGRESS,
    PAPER_BROADCAST_ENV,
    SHARED_SETTINGS,
    GpuSharing,
    NcclBackend,
    NcclCommunicator,
    PeerAborts,
    WedgeGuard,
    agreed_settings,
    assign_id_hosts,
    bootstrap_root_threads,
    effective_env,
    local_settings,
    nccl_status,
    normalize_group,
    peer_aborts,
    settings_mismatch,
    sharing_env,
    uid_digest,
)
from reshard.runtime.backends.nccl.status import _Deadline, _PeerAbort

pytestmark = pytest.mark.unit

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def _a_fresh_abort_channel(monkeypatch):
    """Each test gets this process's abort channel new, on loopback, whatever earlier tests and
    tiers of the session did with it."""
    from reshard.runtime.backends.nccl import aborts

    channel = aborts.PeerAborts("127.0.0.1")
    monkeypatch.setattr(aborts, "_PEER_ABORTS", channel)
    yield
    channel.close()


def _run(code: str) -> str:
    env = dict(os.environ, PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_importing_the_gpu_modules_does_not_import_cupy_or_torch():
    code = (
        "import sys, reshard.runtime.backends.nccl, reshard.runtime.backends.cuda_buffers; print('cupy' in sys.modules)"
    )
    assert _run(code) == "False"


# -- dtypes and reductions ----------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(ITEMSIZE))
def test_every_project_dtype_has_an_exact_nccl_carrier(name):
    code, count = cb.nccl_type_and_count(name, 10, ITEMSIZE[name])
    assert cb.NCCL_TYPE_SIZE[code] * count == 10 * ITEMSIZE[name]


@pytest.mark.parametrize(
    "name, code",
    [
        ("float64", cb.NCCL_FLOAT64),
        ("float32", cb.NCCL_FLOAT32),
        ("float16", cb.NCCL_FLOAT16),
        ("bfloat16", cb.NCCL_BFLOAT16),
        ("int64", cb.NCCL_INT64),
        ("int32", cb.NCCL_INT32),
        ("int8", cb.NCCL_INT8),
        ("uint8", cb.NCCL_UINT8),
    ],
)
def test_native_nccl_types(name, code):
    assert cb.nccl_type_and_count(name, 7, ITEMSIZE[name]) == (code, 7)


@pytest.mark.parametrize("name, itemsize", [("bool", 1), ("int16", 2), ("complex64", 8), ("float8_e4m3fn", 1)])
def test_types_without_nccl_type_travel_as_bytes(name, itemsize):
    assert cb.nccl_type_and_count(name, 5, itemsize) == (cb.NCCL_UINT8, 5 * itemsize)


def test_nccl_type_codes_follow_nccl_h():
    # ncclInt8=0 ... ncclBfloat16=9; checked against cupy's constants in tests/gpu where cupy exists
    assert sorted(cb.NCCL_TYPE_NAMES) == list(range(10))
    assert cb.NCCL_TYPE_NAMES[cb.NCCL_BFLOAT16] == "NCCL_BFLOAT16"


def test_reductions_take_native_types_and_bool_as_logical_or():
    assert cb.nccl_reduce_args("float32", 6, 4, "sum") == (6, cb.NCCL_FLOAT32, cb.NCCL_SUM)
    assert cb.nccl_reduce_args("bfloat16", 6, 2, "max") == (6, cb.NCCL_BFLOAT16, cb.NCCL_MAX)
    assert cb.nccl_reduce_args("int64", 1, 8, "min") == (1, cb.NCCL_INT64, cb.NCCL_MIN)
    assert cb.nccl_reduce_args("bool", 9, 1, "sum") == (9, cb.NCCL_UINT8, cb.NCCL_MAX)
    assert cb.nccl_reduce_args("bool", 9, 1, "min") == (9, cb.NCCL_UINT8, cb.NCCL_MIN)
    with pytest.raises(TypeError, match="cannot reduce int16"):
        cb.nccl_reduce_args("int16", 3, 2, "sum")
    with pytest.raises(ValueError, match="prod"):
        cb.nccl_reduce_args("float32", 3, 4, "prod")


# -- groups, ids, settings ----------------------------------------------------------------------


def test_groups_are_sorted_duplicate_free_tuples():
    assert normalize_group([1, 4, 9]) == (1, 4, 9)
    for bad in ([], [2, 1], [1, 1]):
        with pytest.raises(ValueError):
            normalize_group(bad)


def test_id_hosts_are_members_and_spread_out():
    groups = [(0, 1), (0, 1, 2), (0, 2), (1, 2), (0, 1), (3,)]
    hosts = assign_id_hosts(groups)
    assert len(hosts) == len(groups)  # one id per entry: (0, 1) twice is two communicators
    assert all(h in g for h, g in zip(hosts, groups, strict=True))
    load = {}
    for d in hosts:
        load[d] = load.get(d, 0) + 1
    assert load == {0: 2, 1: 2, 2: 1, 3: 1}


def test_nccl_env_changes_nothing_unless_given():
    """NCCL's variables are the process's: a framework's communicators read them too."""
    assert effective_env(None, {}) == {} and effective_env({}, {}) == {}
    assert effective_env(PAPER_BROADCAST_ENV, {}) == {"NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple"}
    assert effective_env({"NCCL_ALGO": "Tree", "NCCL_BUFFSIZE": 1 << 22}, {}) == {
        "NCCL_ALGO": "Tree",
        "NCCL_BUFFSIZE": str(1 << 22),
    }
    with pytest.raises(ValueError, match="NCCL_"):
        effective_env({"CUDA_VISIBLE_DEVICES": "0"})
    with pytest.raises(ValueError, match="non-blocking"):
        effective_env({"NCCL_COMM_BLOCKING": "1"})


def test_cupy_status_codes_are_read_from_its_exceptions():
    class NcclError(RuntimeError):  # the shape of cupy's error: a status attribute
        def __init__(self, status):
            self.status = status

    assert nccl_status(NcclError(6)) == 6
    assert nccl_status(KeyError(NCCL_IN_PROGRESS)) == NCCL_IN_PROGRESS  # cupy's table lacks ncclInProgress
    assert nccl_status(KeyError("x")) is None and nccl_status(RuntimeError("x")) is None
    assert nccl_status(KeyError(True)) is None  # bool is not a status code


def test_nccl_versions_decode_both_encodings():
    assert cb.nccl_version_tuple(23203) == (2, 32, 3)
    assert cb.nccl_version_tuple(22105) == (2, 21, 5)
    assert cb.nccl_version_tuple(2804) == (2, 8, 4)


def test_members_must_agree_on_shared_settings_and_on_what_any_mesh_sets():
    ring = {"NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple", "NCCL_DEBUG": "INFO", "NCCL_HOSTID": "a"}
    same = {"NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple", "NCCL_DEBUG": "WARN", "NCCL_HOSTID": "b"}
    agreed = agreed_settings((1, 2), {1: (ring, ["NCCL_ALGO"]), 2: (same, ["NCCL_DEBUG"])})
    assert agreed == {"NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple"}  # per-process keys never compared
    tree = dict(same, NCCL_ALGO="Tree")
    with pytest.raises(ValueError, match=r"device 1 has NCCL_ALGO=Ring, device 2 has NCCL_ALGO=Tree"):
        agreed_settings((1, 2), {1: (ring, []), 2: (tree, [])})
    custom = {"NCCL_IB_TIMEOUT": "22"}
    with pytest.raises(ValueError, match=r"NCCL_IB_TIMEOUT=22, device 5 has NCCL_IB_TIMEOUT=None"):
        agreed_settings((4, 5), {4: (custom, ["NCCL_IB_TIMEOUT"]), 5: ({}, [])})
    assert agreed_settings((4, 5), {4: (custom, []), 5: ({}, [])}) == {}  # a key nobody's mesh sets
    assert "NCCL_ALGO" in SHARED_SETTINGS


def test_a_process_checks_its_own_settings_against_the_agreed_ones():
    assert settings_mismatch({"NCCL_ALGO": "Ring"}, {"NCCL_ALGO": "Ring", "NCCL_DEBUG": "INFO"}) == {}
    assert settings_mismatch({"NCCL_ALGO": "Ring"}, {"NCCL_ALGO": "Tree"}) == {"NCCL_ALGO": ("Ring", "Tree")}
    assert settings_mismatch({}, {"NCCL_PROTO": "LL"}) == {"NCCL_PROTO": (None, "LL")}
    assert local_settings({"NCCL_ALGO": "Ring", "NCCL_HOSTID": "x", "PATH": "/"}) == {"NCCL_ALGO": "Ring"}


def test_gpu_sharing_picks_hostids_before_nccl_2_30_and_multi_rank_after():
    auto = GpuSharing.AUTO
    assert sharing_env(auto, 1.0, (2, 32, 3), 7, "h", {}) == {}
    assert sharing_env(auto, 0.5, (2, 32, 3), 7, "h", {}) == {"NCCL_MULTI_RANK_GPU_ENABLE": "1"}
    # below half a GPU per actor NCCL's multi-rank mode is experimental and can hang: hostids instead
    assert sharing_env(auto, 0.25, (2, 32, 3), 7, "h", {}) == {"NCCL_HOSTID": "reshard-h-7", "NCCL_SOCKET_IFNAME": "lo"}
    assert sharing_env(auto, 0.25, (2, 21, 5), 7, "h", {}) == {"NCCL_HOSTID": "reshard-h-7", "NCCL_SOCKET_IFNAME": "lo"}
    assert sharing_env(GpuSharing.HOSTID, 1.0, None, 8, "h", {"NCCL_SOCKET_IFNAME": "eth0"}) == {
        "NCCL_HOSTID": "reshard-h-8"
    }
    assert sharing_env(GpuSharing.OFF, 0.5, (2, 32, 3), 7, "h", {}) == {}


def test_backend_ships_its_configuration_and_applies_env_on_arrival():
    out = _run(
        """
        import os, pickle
        os.environ.pop("NCCL_ALGO", None); os.environ["NCCL_PROTO"] = "LL"; os.environ["NCCL_COMM_BLOCKING"] = "1"
        from reshard.runtime.backends.nccl import NcclBackend
        b = NcclBackend(env={"NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple"}, timeout_s=5, gpus_per_device=0.5,
                        gpu_sharing="hostid")
        before = (os.environ["NCCL_PROTO"], os.environ["NCCL_COMM_BLOCKING"], "NCCL_HOSTID" in os.environ)
        c = pickle.loads(pickle.dumps(b))  # what an actor receives
        print(before, (c.env == b.env, c.timeout_s, c.gpus_per_device, c.gpu_sharing.value, c.live_groups()))
        print([os.environ.get(k) for k in ("NCCL_ALGO", "NCCL_PROTO", "NCCL_COMM_BLOCKING", "NCCL_SOCKET_IFNAME")],
              os.environ["NCCL_HOSTID"] == f"reshard-{os.uname().nodename}-{os.getpid()}")
        """
    )
    first, second = out.splitlines()
    assert first == "('LL', '1', False) (True, 5.0, 0.5, 'hostid', [])"
    # NCCL_COMM_BLOCKING stays the process's: each communicator is made non-blocking by its configuration
    assert second == "['Ring', 'Simple', '1', 'lo'] True"


def test_backend_options_are_validated():
    with pytest.raises(ValueError, match="gpus_per_device"):
        NcclBackend(gpus_per_device=2)
    with pytest.raises(ValueError, match="gpus_per_device"):
        NcclBackend(gpus_per_device=-0.5)
    assert NcclBackend(gpus_per_device=0).gpus_per_device == 0  # none reserved through Ray
    with pytest.raises(ValueError, match="multi_rank"):
        NcclBackend(gpu_sharing="sometimes")
    with pytest.raises(ValueError, match="timeout_s"):
        NcclBackend(timeout_s=0)


# -- the backend registry -----------------------------------------------------------------------


def test_registry_resolves_nccl_lazily_and_a_mesh_reserves_what_its_instance_declares(monkeypatch):
    monkeypatch.setattr(backends, "BACKENDS", dict(backends.BACKENDS))
    assert backends.backend_class("nccl") is NcclBackend
    name, inst, gpus = backends.make_backend(NcclBackend(env={}))
    assert name == "nccl" and inst.env == {} and gpus == 1.0
    assert backends.make_backend(NcclBackend(gpus_per_device=0.25))[2] == 0.25  # four actors per GPU
    assert backends.backend_spec("nccl").gpus_per_device == 1.0  # the next mesh made by name: a GPU each
    assert backends.make_backend("nccl")[2] == 1.0


def test_a_registered_instance_keeps_the_gpus_its_class_declares(monkeypatch):
    monkeypatch.setattr(backends, "BACKENDS", dict(backends.BACKENDS))

    class TwoGpus(Backend):
        name = "two-gpus"
        device_type = "cuda"
        gpus_per_device = 2

        def rendezvous(self, groups, actors):
            return []

        def connect(self, rendezvous, device, timeout_s):
            raise NotImplementedError

    class Plain(TwoGpus):
        name = "plain"
        gpus_per_device = None

    assert backends.make_backend(TwoGpus())[2] == 2.0
    assert backends.backend_spec("two-gpus") == backends.BackendSpec(TwoGpus, "cuda", 2.0)
    assert backends.make_backend(Plain())[2] == 0.0
    assert backends.backend_spec("plain").gpus_per_device == 0.0


@pytest.mark.parametrize(
    "bad, err", [(1.5, ValueError), (-1, ValueError), (float("inf"), ValueError), ("x", TypeError)]
)
def test_gpus_per_device_must_be_reservable_by_ray(bad, err):
    with pytest.raises(err, match="gpus_per_device"):
        backends.BackendSpec("m:C", "cuda", bad)
    assert backends.check_gpus_per_device(0.5) == 0.5 and backends.check_gpus_per_device(3) == 3.0


# -- GPU stack diagnosis ------------------------------------------------------------------------


def test_gpu_stack_problems_name_both_sides_and_the_fix():
    assert cb.gpu_stack_problems([("cupy-cuda12x", "14.2.0")], ["/x/libnccl.so.2"], (2, 27, 3), (2, 27, 3)) == []
    two = cb.gpu_stack_problems(
        [("cupy-cuda12x", "14.2.0"), ("cupy-cuda13x", "14.2.0"), ("numpy", "2")], [], None, None
    )
    assert len(two) == 1 and "cupy-cuda12x 14.2.0, cupy-cuda13x 14.2.0" in two[0] and "gpu-cu13" in two[0]
    libs = cb.gpu_stack_problems([], ["/a/libnccl.so.2", "/b/libnccl.so.2"], None, None)
    assert len(libs) == 1 and "/a/libnccl.so.2, /b/libnccl.so.2" in libs[0]
    versions = cb.gpu_stack_problems([], [], (2, 27, 3), (2, 21, 5))
    assert len(versions) == 1 and "cupy uses NCCL 2.27.3 but torch uses NCCL 2.21.5" in versions[0]
    old = cb.gpu_stack_problems([("cupy-cuda12x", "13.6.0")], [], None, None)
    assert len(old) == 1 and "cupy-cuda12x 13.6.0 is older than cupy 14" in old[0]


def test_loaded_nccl_libraries_are_read_from_the_memory_map(tmp_path):
    lib = tmp_path / "libnccl.so.2"
    lib.write_bytes(b"")
    maps = tmp_path / "maps"
    maps.write_text(
        f"7f00-7f10 r--p 00000000 08:01 42  {lib}\n"
        f"7f10-7f20 r-xp 00010000 08:01 42  {lib}\n"
        "7f20-7f30 r--p 00000000 08:01 43  /usr/lib/libc.so.6\n"
        "7f30-7f40 rw-p 00000000 00:00 0 \n"
    )
    assert cb.loaded_nccl_libraries(str(maps)) == [str(lib)]
    assert cb.loaded_nccl_libraries(str(tmp_path / "missing")) == []


def test_missing_cupy_is_a_clear_error_naming_the_gpu_extras():
    # in a fresh interpreter: the test session may have put the CPU stand-in for cupy on the path
    out = _run(
        """
        import importlib.util
        if importlib.util.find_spec("cupy") is not None:
            print("installed")
            raise SystemExit
        from reshard.runtime.backends.communicator import Rendezvous
        from reshard.runtime.backends.nccl import NcclBackend, nccl_available, visible_gpu_count
        assert not nccl_available() and visible_gpu_count() == 0
        b = NcclBackend()
        errors = []
        rdv = Rendezvous((0,), {"v": 2, "uid": bytes(128), "host": 0})
        for call in (lambda: b.local_rendezvous([(0,)]), lambda: b.connect(rdv, 0, 1.0)):
            try:
                call()
            except ImportError as e:
                errors.append(str(e))
        print(repr(errors))
        """
    )
    if out == "installed":
        pytest.skip("cupy is installed here")
    errors = ast.literal_eval(out)
    assert len(errors) == 2 and "pip install '.[gpu-cu12]'" in errors[0] and "gpu-cu13" in errors[1]


# -- staging segments ------------------------------------------------------------------------


def test_segments_are_aligned_and_reused_after_reset():
    a = cb.SegmentAllocator()
    assert a.reserve(1000) is True and a.capacity_bytes == 1024
    s1, grew1 = a.take(10)
    s2, grew2 = a.take(300)
    assert not grew1 and not grew2
    assert (s1.offset, s2.offset) == (0, 256) and s2.offset % cb.STAGING_ALIGN_BYTES == 0
    a.reset()
    s3, _ = a.take(500)
    assert s3.offset == 0 and s3.generation == s1.generation == 1
    a.reset()
    assert a.reserve(512) is False  # already big enough: the same buffer stays


def test_segments_grow_into_a_new_buffer_only_when_a_batch_overflows():
    a = cb.SegmentAllocator(512)
    a.take(256)
    seg, grew = a.take(1000)
    assert grew and seg.generation == 1 and seg.offset == 0 and a.capacity_bytes >= 1024
    a.reset()
    for _ in range(3):
        _, grew = a.take(1000)
        assert not grew
        a.reset()
    assert a.generation == 1


def test_reserve_is_refused_while_segments_are_in_use():
    a = cb.SegmentAllocator(256)
    a.take(8)
    with pytest.raises(RuntimeError):
        a.reserve(4096)


# -- the abort side channel ---------------------------------------------------------------------


def test_abort_notices_reach_the_other_members_over_udp():
    a, b, c = PeerAborts(), PeerAborts(), PeerAborts()
    try:
        uid = bytes(range(128))
        digest = uid_digest(uid)
        assert len(digest) == 16 and digest != uid_digest(bytes(128))
        assert not b.aborted(uid)
        a.notify([b.address, c.address, ("127.0.0.1", 9), ("no-such-host.invalid", 1)], uid)
        assert b.wait(uid, 10) and c.wait(uid, 10)
        assert not a.aborted(uid)
        other = b"o" * 128
        b.sock.sendto(b"junk" + uid_digest(other), a.address)  # not a notice: ignored
        a.notify([a.address], other)  # ... and a real one after it, which arrives later
        assert a.wait(other, 10) and not a.aborted(b"junk")
    finally:
        for p in (a, b, c):
            p.close()


def test_a_forged_abort_notice_is_ignored():
    """A stranger who knows a communicator's digest (it travels in the clear) but not its unique
    id cannot abort it: the notice's tag is keyed by the unique id. Notices from one socket arrive
    in order, so a valid marker sent after the forgeries shows they were handled."""
    victim, stranger = PeerAborts(), PeerAborts()
    try:
        watched, early, marker = b"s" * 128, b"u" * 128, b"v" * 128
        victim.watch(watched)
        for uid in (watched, early):
            digest = uid_digest(uid)
            for tag in (bytes(16), uid_digest(b"guess"), PeerAborts.notice(b"t" * 128)[20:]):
                stranger.sock.sendto(PeerAborts.MAGIC + digest + tag, victim.address)
        stranger.notify([victim.address], marker)
        assert victim.wait(marker, 10)
        assert not victim.aborted(watched) and not victim.aborted(early)
        victim.watch(early)
        assert not victim.aborted(early)
        stranger.notify([victim.address], watched)  # the real one
        assert victim.wait(watched, 10)
    finally:
        victim.close()
        stranger.close()


def test_a_closed_channels_thread_is_gone_before_its_descriptor_is():
    """Closed, a channel's thread has stopped receiving before its socket's descriptor number is
    given back: a thread still in its receive loop could take the datagrams of the next socket
    that gets that number (two notices lost that way in full test runs)."""
    for _ in range(20):
        channel = PeerAborts()
        thread = channel._thread
        channel.close()
        assert not thread.is_alive() and channel.sock.fileno() == -1


def test_a_flood_of_notices_cannot_evict_a_watched_communicators_notice():
    victim, sender = PeerAborts(), PeerAborts()
    try:
        uid, early = b"w" * 128, b"e" * 128
        victim.watch(uid)
        sender.notify([victim.address], uid)
        sender.notify([victim.address], early)  # not watched yet: kept until it is
        assert victim.wait(uid, 10)
        assert victim.wait(early, 10)  # watching it finds the early notice
        lost = b"l" * 128
        sender.notify([victim.address], lost)  # an early notice the flood will push out
        for batch in range(2 * PeerAborts.KEEP // 64):  # paced by markers: UDP drops what overflows
            for i in range(64):
                forged = (batch * 64 + i).to_bytes(16, "little")
                sender.sock.sendto(PeerAborts.MAGIC + forged + bytes(16), victim.address)
            marker = batch.to_bytes(4, "little") * 32
            sender.notify([victim.address], marker)
            assert victim.wait(marker, 10)
            victim.unwatch(marker)
        assert not victim.aborted(lost)  # early notices are what a flood can cost
        assert victim.aborted(uid) and victim.aborted(early)
        victim.unwatch(uid)
        assert not victim.aborted(uid)
    finally:
        victim.close()
        sender.close()


# -- the wedge guard ----------------------------------------------------------------------------


def test_wedge_guard_reports_only_calls_still_inside_past_deadline_plus_grace():
    wedged = []
    fired = threading.Event()

    def on_wedged(what):
        wedged.append(what)
        fired.set()

    guard = WedgeGuard(grace_s=0.05, on_wedged=on_wedged)
    release = threading.Event()
    now = time.monotonic()
    with guard.inside(now, "returned in time"):
        pass

    def stuck():
        with guard.inside(now + 0.1, "stuck call"):
            release.wait(30)

    t = threading.Thread(target=stuck)
    t.start()
    try:
        assert fired.wait(30)
        assert wedged == ["stuck call"]  # the earlier deadline passed first and did not fire
    finally:
        release.set()
        t.join(30)


def test_the_real_wedge_guard_ends_the_process_with_its_exit_code():
    code = """
        import threading, time
        from reshard.runtime.backends import nccl
        guard = nccl.WedgeGuard(grace_s=0.05)
        with guard.inside(time.monotonic(), "ncclGroupEnd"):
            threading.Event().wait(60)
        """
    env = dict(os.environ, PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env)
    assert out.returncode == 86 and "NCCL is wedged" in out.stderr


# -- polling and aborting, with a stand-in for cupy's communicator ------------------------------


class ScriptedComm:
    """Plays cupy's NcclCommunicator contract as far as the backend's polling uses it: while a
    non-blocking call is in progress ``check_async_error`` raises ``KeyError(7)`` (what cupy 14
    raises for ncclInProgress), then returns or raises the scripted error; ``abort`` zeroes ``comm``."""

    def __init__(self, in_progress: int, error: Exception | None = None):
        self.left = in_progress
        self.error = error
        self.comm = 1
        self.aborts = 0
        self.destroyed = 0

    def check_async_error(self):
        if self.left > 0:
            self.left -= 1
            raise KeyError(NCCL_IN_PROGRESS)
        if self.error is not None:
            raise self.error

    def abort(self):
        self.aborts += 1
        self.comm = 0

    def destroy(self):
        self.destroyed += 1
        self.comm = 0


def _comm(b: NcclBackend, group, rank: int, raw, uid: bytes, abort_to=()) -> NcclCommunicator:
    """A communicator over ``raw`` registered in ``b`` as ``connect`` would."""
    comm = NcclCommunicator(b, group, rank, 5.0, raw, {"uid": uid, "abort_to": [list(a) for a in abort_to]})
    b._comms[comm.digest] = comm
    return comm


def _batch(*comms, deadline_s: float = 60.0):
    from reshard.runtime.backends.nccl.operations import _Batch

    batch = _Batch(grouped=True, wait=True, deadline=time.monotonic() + deadline_s)
    for c in comms:
        batch.comms[id(c)] = c
        batch.ops.append(f"send(group={c.group})")
    return batch


def test_polling_waits_out_in_progress_and_raises_errors():
    b = NcclBackend()
    done, fails = ScriptedComm(3), ScriptedComm(1, RuntimeError("NCCL_ERROR_REMOTE_ERROR"))
    b._await([done], [b"d" * 128], time.monotonic() + 30)
    assert done.left == 0
    with pytest.raises(RuntimeError, match="REMOTE_ERROR"):
        b._await([fails], [b"e" * 128], time.monotonic() + 30)
    with pytest.raises(_Deadline):
        b._await([ScriptedComm(10**9)], [b"f" * 128], time.monotonic() + 0.05)


def test_polling_stops_at_a_peers_abort_notice():
    b = NcclBackend()
    uid = b"group-uid"
    sender = PeerAborts()
    try:
        sender.notify([peer_aborts().address], uid)
        assert peer_aborts().wait(uid, 10)
        with pytest.raises(_PeerAbort):
            b._await([ScriptedComm(10**9)], [uid], time.monotonic() + 60)
    finally:
        sender.close()
    assert b.stats["peer_aborts"] == 1


def test_abort_is_local_once_and_tells_the_other_members():
    b = NcclBackend()
    other = PeerAborts()
    try:
        info = {"uid": b"u" * 128, "host": 0, "abort_to": [list(peer_aborts().address), list(other.address)]}
        raw = ScriptedComm(0)
        comm = NcclCommunicator(b, (3, 8), 0, 5.0, raw, info)
        b._comms[comm.digest] = comm
        comm.abort()
        comm.abort()
        assert raw.aborts == 1 and comm.aborted and b.live_groups() == [] and b.stats["aborted"] == 1
        assert other.wait(comm.uid, 10)  # rank 1 heard of it
        assert not peer_aborts().aborted(comm.uid)  # rank 0 (this process) did not tell itself
        peer = NcclCommunicator(b, (3, 8), 1, 5.0, ScriptedComm(0), info)
        assert not peer.peer_aborted()
    finally:
        other.close()


def test_a_failed_batch_aborts_its_communicators_and_names_the_cause():
    from reshard.runtime.backends.nccl.operations import _Batch

    b = NcclBackend()
    raw = ScriptedComm(0)
    comm = NcclCommunicator(b, (0, 1), 0, 5.0, raw, {"uid": b"v" * 128, "abort_to": []})
    batch = _Batch(grouped=False, wait=True, deadline=time.monotonic())
    batch.comms[id(comm)] = comm
    batch.ops.append("send(group=(0, 1))")
    with pytest.raises(ReshardTimeout, match="did not complete before their deadline"):
        b._fail(batch, None, timeout=True)
    assert raw.aborts == 1
    with pytest.raises(PeerFailed, match="a member of the group aborted"):
        b._fail(batch, None, timeout=False, peer=True)


def test_a_peers_notice_is_read_before_the_remote_error_its_abort_causes():
    b = NcclBackend()
    comm = _comm(b, (0, 1), 0, ScriptedComm(0, RuntimeError("NCCL_ERROR_REMOTE_ERROR")), b"n" * 128)
    sender = PeerAborts()
    try:
        sender.notify([peer_aborts().address], comm.uid)
        assert peer_aborts().wait(comm.uid, 10)
        with pytest.raises(_PeerAbort):
            b._await([comm.raw], [comm.uid], time.monotonic() + 60)
        with pytest.raises(PeerFailed, match="a member of the group aborted"):
            b._launched(_batch(comm))
    finally:
        sender.close()


def test_ncclTimeout_is_a_timeout():
    b = NcclBackend()
    comm = _comm(b, (0, 1), 0, ScriptedComm(0), b"t" * 128)
    with pytest.raises(ReshardTimeout):
        b._fail(_batch(comm), KeyError(8), timeout=False)  # NCCL 2.32's code 8, as cupy 14 raises it


def test_an_abort_from_another_thread_is_served_by_the_polling_thread():
    """A control thread's abort must not wait for the run thread to let go of the communicator: it
    is recorded, and the thread polling the batch aborts, tells the other members and fails."""
    b = NcclBackend()
    other = PeerAborts()
    raw = ScriptedComm(10**9)  # in progress until aborted
    comm = _comm(b, (0, 1), 0, raw, b"a" * 128, [peer_aborts().address, other.address])
    polling, outcome = threading.Event(), {}

    def run():
        batch = _batch(comm)
        b._lock_for(batch, comm)  # what a run's group block holds
        polling.set()
        try:
            b._launched(batch)
        except Exception as e:
            outcome["error"] = e
        finally:
            b._unlock(batch)

    t = threading.Thread(target=run)
    t.start()
    try:
        assert polling.wait(10)
        comm.abort()  # returns at once: the communicator is the run's
        t.join(30)
        assert not t.is_alive()
        assert isinstance(outcome.get("error"), PeerFailed) and "the controller aborted" in str(outcome["error"])
        assert raw.aborts == 1 and comm.aborted and b.live_groups() == []
        assert other.wait(comm.uid, 10)  # the other member heard of it
    finally:
        t.join(30)
        other.close()


def test_an_abort_asked_for_a_held_communicator_happens_when_the_holder_lets_go():
    b = NcclBackend()
    raw = ScriptedComm(0)
    comm = _comm(b, (0, 1), 0, raw, b"i" * 128)
    held, asked = threading.Event(), threading.Event()

    def hold():
        batch = _batch(comm)
        b._lock_for(batch, comm)
        held.set()
        assert asked.wait(10)
        b._unlock(batch)

    t = threading.Thread(target=hold)
    t.start()
    assert held.wait(10)
    comm.abort()
    assert raw.aborts == 0 and comm.abort_requested  # recorded while the lock was held
    asked.set()
    t.join(30)
    assert raw.aborts == 1 and comm.aborted


def test_two_threads_on_two_communicators_never_wait_on_each_other():
    """Each communicator has its own lock: a thread polling one (a lane's long transfer) leaves
    another free to issue on its own (two lanes, two controllers)."""
    b = NcclBackend()
    slow = _comm(b, (0, 1), 0, ScriptedComm(10**9), b"s" * 128)
    fast = _comm(b, (0, 2), 0, ScriptedComm(2), b"f" * 128)
    polling, stop = threading.Event(), threading.Event()

    def run():
        batch = _batch(slow)
        b._lock_for(batch, slow)
        polling.set()
        stop.wait(30)
        b._unlock(batch)

    t = threading.Thread(target=run)
    t.start()
    try:
        assert polling.wait(10)
        batch = _batch(fast, deadline_s=5.0)
        b._lock_for(batch, fast)
        b._launched(batch)  # does not wait for the other thread's communicator
        b._unlock(batch)
        assert fast.raw.left == 0
    finally:
        stop.set()
        t.join(30)


def test_an_aborted_rendezvous_tells_every_member():
    from reshard.runtime.backends.communicator import Rendezvous

    members = [PeerAborts(), PeerAborts()]
    try:
        uid = b"r" * 128
        rdv = Rendezvous((0, 1), {"uid": uid, "abort_to": [list(m.address) for m in members]})
        NcclBackend().abort_rendezvous([rdv], "the controller gave up")
        assert all(m.wait(uid, 10) for m in members)
    finally:
        for m in members:
            m.close()


def test_two_channels_on_the_same_devices_are_two_communicators():
    b = NcclBackend()
    first = _comm(b, (0, 1), 0, ScriptedComm(0), b"1" * 128)
    second = _comm(b, (0, 1), 0, ScriptedComm(0), b"2" * 128)
    assert b.live_groups() == [(0, 1), (0, 1)] and b.communicator((0, 1)) is second
    second.close()  # closes itself only
    assert second.raw.destroyed == 1 and first.raw.destroyed == 0 and not first.closed
    assert b.communicator((0, 1)) is first
    first.abort()
    assert first.raw.aborts == 1 and second.raw.aborts == 0 and b.live_groups() == []


# -- bootstrap roots ----------------------------------------------------------------------------


def test_bootstrap_roots_are_counted_by_thread_name():
    libc = ctypes.CDLL(None)
    before = bootstrap_root_threads()
    named, release, renamed = threading.Event(), threading.Event(), threading.Event()

    def root():
        libc.prctl(15, BOOTSTRAP_ROOT_THREAD.encode(), 0, 0, 0)  # PR_SET_NAME, as NCCL names its thread
        named.set()
        release.wait(30)
        # Thread.join returns before the OS thread is gone, so the thread drops the name itself.
        libc.prctl(15, b"finished", 0, 0, 0)
        renamed.set()

    t = threading.Thread(target=root)
    t.start()
    try:
        assert named.wait(30)
        assert bootstrap_root_threads() == before + 1
    finally:
        release.set()
        assert renamed.wait(30)
        t.join(30)
    assert bootstrap_root_threads() == before


def test_backend_pickles_without_its_driver_cache():
    b = NcclBackend()
    b._members[3] = ("actor", {"settings": {}})
    assert pickle.loads(pickle.dumps(b))._members == {}
