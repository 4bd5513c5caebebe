"""The NCCL backend's pure parts: dtype tables, group naming, id-host assignment, NCCL env,
the communicator budget (LRU eviction bookkeeping) and the staging segment allocator.

Nothing here touches cupy, a GPU or Ray; the GPU behaviour is tested in tests/gpu/."""

import os
import subprocess
import sys
import time

import pytest

from reshard.dtypes import ITEMSIZE
from reshard.runtime import cuda_buffers as cb
from reshard.runtime.nccl import (
    PAPER_BROADCAST_ENV,
    NcclBackend,
    _call_with_deadline,
    _Watchdog,
    assign_id_hosts,
    effective_env,
    normalize_group,
)

pytestmark = pytest.mark.unit


def test_importing_the_backend_does_not_import_cupy():
    code = "import sys, reshard.runtime.nccl, reshard.runtime.cuda_buffers; print('cupy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# -- dtypes ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(ITEMSIZE))
def test_every_project_dtype_has_an_exact_nccl_carrier(name):
    code, count = cb.nccl_type_and_count(name, 10, ITEMSIZE[name])
    assert cb.NCCL_TYPE_SIZE[code] * count == 10 * ITEMSIZE[name]


@pytest.mark.parametrize(
    "name, code",
    [
        ("float64", cb.NCCL_FLOAT64), ("float32", cb.NCCL_FLOAT32), ("float16", cb.NCCL_FLOAT16),
        ("bfloat16", cb.NCCL_BFLOAT16), ("int64", cb.NCCL_INT64), ("int32", cb.NCCL_INT32),
        ("int8", cb.NCCL_INT8), ("uint8", cb.NCCL_UINT8),
    ],
)  # fmt: skip
def test_native_nccl_types(name, code):
    assert cb.nccl_type_and_count(name, 7, ITEMSIZE[name]) == (code, 7)


@pytest.mark.parametrize("name, itemsize", [("bool", 1), ("int16", 2), ("complex64", 8), ("float8_e4m3fn", 1)])
def test_types_without_nccl_type_travel_as_bytes(name, itemsize):
    assert cb.nccl_type_and_count(name, 5, itemsize) == (cb.NCCL_UINT8, 5 * itemsize)


def test_nccl_type_codes_follow_nccl_h():
    # ncclInt8=0 ... ncclBfloat16=9; checked against cupy's constants in tests/gpu where cupy exists
    assert sorted(cb.NCCL_TYPE_NAMES) == list(range(10))
    assert cb.NCCL_TYPE_NAMES[cb.NCCL_BFLOAT16] == "NCCL_BFLOAT16"


# -- groups and rendezvous bookkeeping ---------------------------------------------------------


def test_groups_are_sorted_duplicate_free_tuples():
    assert normalize_group([1, 4, 9]) == (1, 4, 9)
    for bad in ([], [2, 1], [1, 1]):
        with pytest.raises(ValueError):
            normalize_group(bad)


def test_id_hosts_are_members_and_spread_out():
    groups = [(0, 1), (0, 1, 2), (0, 2), (1, 2), (0, 1), (3,)]
    hosts = assign_id_hosts(groups)
    assert set(hosts) == set(groups)
    assert all(hosts[g] in g for g in hosts)
    load = {}
    for d in hosts.values():
        load[d] = load.get(d, 0) + 1
    assert max(load.values()) - min(load.values()) <= 1


def test_id_hosts_balance_over_many_groups_of_one_device_set():
    groups = [tuple(range(k, k + 4)) for k in range(8)]
    load = {}
    for d in assign_id_hosts(groups).values():
        load[d] = load.get(d, 0) + 1
    assert max(load.values()) == 1


def test_nccl_env_defaults_to_the_papers_broadcast_settings():
    assert effective_env(None, {}) == PAPER_BROADCAST_ENV
    assert effective_env(None, {"NCCL_PROTO": "LL128"}) == {"NCCL_ALGO": "Ring"}
    assert effective_env({}, {}) == {}
    assert effective_env({"NCCL_ALGO": "Tree", "NCCL_BUFFSIZE": 1 << 22}, {}) == {
        "NCCL_ALGO": "Tree",
        "NCCL_BUFFSIZE": str(1 << 22),
    }
    with pytest.raises(ValueError, match="NCCL_"):
        effective_env({"CUDA_VISIBLE_DEVICES": "0"})


def test_backend_ships_its_configuration_and_applies_env_on_arrival(monkeypatch):
    import pickle

    monkeypatch.delenv("NCCL_ALGO", raising=False)
    monkeypatch.setenv("NCCL_PROTO", "LL")
    b = NcclBackend(env={"NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple"}, timeout_s=5)
    assert os.environ["NCCL_PROTO"] == "LL"  # constructing on the driver changes nothing
    c = pickle.loads(pickle.dumps(b))  # what an actor receives
    assert (c.env, c.timeout_s, c.device_type, c.name) == (b.env, 5.0, "cuda", "nccl")
    assert c.live_groups() == []
    assert os.environ["NCCL_ALGO"] == "Ring" and os.environ["NCCL_PROTO"] == "Simple"


def test_the_runtime_registry_resolves_the_backend_lazily():
    backends = pytest.importorskip("reshard.runtime.backends")
    assert backends.backend_class("nccl") is NcclBackend
    name, inst = backends.make_backend(NcclBackend(env={}))
    assert name == "nccl" and inst.env == {}


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


# -- deadlines -------------------------------------------------------------------------------


class _AbortRecorder:
    """Records when the watchdog calls ``abort()`` (the watchdog's whole contract)."""

    def __init__(self):
        self.aborted_at = None

    def abort(self):
        self.aborted_at = time.monotonic()


def test_watchdog_aborts_what_is_still_armed_at_its_deadline():
    w = _Watchdog()
    late, early = _AbortRecorder(), _AbortRecorder()
    t0 = time.monotonic()
    token_late = w.arm(t0 + 0.2, [late], "blocked call")
    token_early = w.arm(t0 + 0.1, [early], "finished call")
    assert w.disarm(token_early) is False  # returned in time: never aborted
    deadline = time.monotonic() + 5
    while late.aborted_at is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert late.aborted_at is not None and late.aborted_at - t0 >= 0.2
    assert w.disarm(token_late) is True
    time.sleep(0.2)
    assert early.aborted_at is None
    w.stop()


def test_call_with_deadline_returns_instead_of_hanging():
    assert _call_with_deadline(lambda: None, 5, "t") == (True, None)
    finished, err = _call_with_deadline(lambda: 1 / 0, 5, "t")
    assert finished and isinstance(err, ZeroDivisionError)
    t0 = time.monotonic()
    finished, _ = _call_with_deadline(lambda: time.sleep(3), 0.1, "t")
    assert not finished and time.monotonic() - t0 < 1


# -- without cupy ----------------------------------------------------------------------------


def test_missing_cupy_is_a_clear_error_naming_the_gpu_extra():
    import importlib.util

    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("cupy is installed here")
    from reshard.runtime.communicator import Rendezvous
    from reshard.runtime.nccl import nccl_available, visible_gpu_count

    assert not nccl_available() and visible_gpu_count() == 0
    b = NcclBackend()
    with pytest.raises(ImportError, match=r"pip install '\.\[gpu\]'"):
        b.local_rendezvous([(0,)])
    with pytest.raises(ImportError, match=r"pip install '\.\[gpu\]'"):
        b.connect(Rendezvous((0,), {"v": 1, "uid": bytes(128), "host": 0}), 0, 1.0)
