"""CUDA IPC descriptors and GPU UUID remapping (no GPU, no cupy): the parts of
``reshard.runtime.cuda_ipc`` that decide what a peer opens and where. The opening itself is tested
in tests/gpu/test_cuda_ipc.py."""

import os
import pickle
import subprocess
import sys

import msgpack
import pytest

from reshard.runtime.cuda_ipc import CudaShard, PeerCudaShards, _alive, device_for_uuid, normalize_uuid

pytestmark = pytest.mark.unit

UUID = "GPU-1b2c3d4e-5f60-7182-93a4-b5c6d7e8f901"
HEX = "1b2c3d4e5f60718293a4b5c6d7e8f901"


def shard(**kw):
    base = dict(pid=4242, gpu_uuid=UUID, handle=bytes(range(64)), alloc_nbytes=2 << 20, offset_bytes=4096,
                shape=(3, 5), event=bytes(64))  # fmt: skip
    base.update(kw)
    return CudaShard(**base)


def test_uuids_normalize_from_bytes_and_every_text_spelling():
    assert normalize_uuid(bytes.fromhex(HEX)) == HEX
    assert normalize_uuid(UUID) == normalize_uuid(UUID.lower()[4:]) == normalize_uuid(HEX.upper()) == HEX
    assert normalize_uuid("MIG-" + HEX) == "mig-" + HEX != HEX  # a MIG instance is not its parent GPU
    for bad in ("GPU-123", "GPU-" + "g" * 32, b"short"):
        with pytest.raises(ValueError):
            normalize_uuid(bad)
    with pytest.raises(TypeError):
        normalize_uuid(7)


def test_the_holders_gpu_is_found_by_uuid_whatever_its_index_here():
    other = "GPU-00000000-0000-0000-0000-000000000001"
    assert device_for_uuid(UUID, [normalize_uuid(other), HEX]) == 1  # index 0 in the holder, 1 here
    assert device_for_uuid(HEX, [HEX]) == 0  # actors sharing one GPU
    assert device_for_uuid(UUID, [normalize_uuid(other)]) is None  # not visible: no pull possible
    assert device_for_uuid(UUID, []) is None


def test_descriptors_round_trip_through_msgpack_and_pickle():
    d = shard()
    assert d.gpu_uuid == HEX and d.shape == (3, 5)
    wire = msgpack.unpackb(msgpack.packb(d.encode()), raw=False)
    assert CudaShard.decode(wire) == d
    assert CudaShard.decode(d) is d
    assert pickle.loads(pickle.dumps(d)) == d
    no_event = shard(event=None)
    assert CudaShard.decode(msgpack.unpackb(msgpack.packb(no_event.encode()))) == no_event


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(pid=0), "pid"),
        (dict(handle=b"x" * 63), "handle"),
        (dict(event=b"e"), "event"),
        (dict(offset_bytes=2 << 20), "inside the allocation"),
        (dict(offset_bytes=-1), "inside the allocation"),
        (dict(shape=(2, -1)), "negative"),
        (dict(gpu_uuid="nope"), "GPU UUID"),
    ],
)
def test_descriptors_are_validated(bad, match):
    with pytest.raises(ValueError, match=match):
        shard(**bad)


def test_a_view_must_fit_its_allocation_and_be_aligned():
    d = shard(alloc_nbytes=4096 + 60, offset_bytes=4096)
    d.check_fits(4)  # 15 float32 end exactly at the allocation's end
    assert d.nbytes(4) == 60
    with pytest.raises(ValueError, match="past the"):
        d.check_fits(8)  # the same descriptor read as float64 would run past it
    with pytest.raises(ValueError, match="aligned"):
        shard(offset_bytes=4098).check_fits(4)


def test_a_process_never_opens_its_own_export():
    peers = PeerCudaShards(device=3)
    import torch

    with pytest.raises(ValueError, match="lives in this process"):
        peers.get(1, shard(pid=os.getpid()).encode(), torch.float32)
    assert peers.maps == {}


def test_mappings_of_exited_processes_are_recognised():
    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    assert _alive(os.getpid()) and not _alive(int(p.stdout))


def test_purge_and_clear_of_an_empty_importer_are_no_ops():
    peers = PeerCudaShards(device=0)
    peers.purge()
    peers.purge(keep=[shard().encode()])
    peers.clear()
    assert peers.maps == {} and peers.events == {}
