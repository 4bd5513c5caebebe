"""Groups, unique ids and members: what the rendezvous asks each member for, and the bootstrap roots
that unique ids leave behind."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterable, Mapping
from typing import TypedDict

from reshard.runtime.backends import cuda_buffers as cb
from reshard.runtime.backends.communicator import Group
from reshard.runtime.backends.nccl.aborts import peer_aborts
from reshard.runtime.backends.nccl.settings import _APPLIED_KEYS, apply_env, local_settings

log = logging.getLogger(__name__)


RENDEZVOUS_INFO_VERSION = 2


class RendezvousInfo(TypedDict):
    """A ``Rendezvous.info`` of the NCCL backend: what every member of a group is told."""

    v: int  # RENDEZVOUS_INFO_VERSION
    uid: bytes
    host: int  # the device whose process made the unique id (-1: this process)
    settings: dict[str, str]  # the NCCL settings the members agreed on
    abort_to: list[list]  # per rank: where its abort notices go
    nccl: int  # the NCCL version code every member loads


BOOTSTRAP_ROOT_THREAD = "NCCL BootstrapR"


BOOTSTRAP_ROOTS_WARN = 64


def normalize_group(group: Iterable[int]) -> Group:
    """A group is its sorted tuple of distinct global device ids; a device's rank is its index."""
    g = tuple(int(d) for d in group)
    if not g:
        raise ValueError("a communicator group needs at least one device")
    if tuple(sorted(set(g))) != g:
        raise ValueError(f"group {g} must be sorted and duplicate-free (a group is a sorted device tuple)")
    return g


def assign_id_hosts(groups: Iterable[Group]) -> list[int]:
    """For each entry of ``groups``, the member device that generates its unique id: the member
    given the fewest ids so far (ties: lowest device id), so id generation and bootstrap roots are
    spread out. One id per entry: the same devices named twice (two channels) are two
    communicators."""
    load: dict[int, int] = {}
    out: list[int] = []
    for g in groups:
        host = min(g, key=lambda d: (load.get(d, 0), d))
        load[host] = load.get(host, 0) + 1
        out.append(host)
    return out


def bootstrap_root_threads() -> int:
    """Threads of this process that are NCCL bootstrap roots still waiting for ranks (Linux; NCCL
    names its threads only with NCCL_SET_THREAD_NAME=1, which the backend sets on arrival)."""
    n = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                n += f.read().strip() == BOOTSTRAP_ROOT_THREAD
        except OSError:
            continue
    return n


def nccl_available() -> bool:
    """True when cupy with NCCL imports and at least one CUDA device is visible."""
    try:
        cupy, _ = cb.import_nccl()
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def visible_gpu_count() -> int:
    """CUDA devices visible to this process (0 without cupy or without GPUs)."""
    try:
        cupy = cb.import_cupy()
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


@functools.cache
def _cupy_takes_bytes() -> bool:
    import cupy

    return int(cupy.__version__.split(".")[0]) >= 14


def _uid_arg(uid: bytes):
    """cupy >= 14 takes the 128-byte id as bytes; older cupy as a tuple of signed chars."""
    if _cupy_takes_bytes():
        return bytes(uid)
    return tuple(b - 256 if b > 127 else b for b in bytes(uid))


def _uid_bytes(uid) -> bytes:
    if isinstance(uid, bytes | bytearray):
        return bytes(uid)
    return bytes(b & 0xFF for b in uid)


def generate_unique_ids(n: int, env: Mapping[str, str] | None = None) -> list[bytes]:
    """``n`` fresh NCCL unique ids from this process (each starts an NCCL bootstrap root here)."""
    if env:
        apply_env(env)
    _, nccl = cb.import_nccl()
    ids = [_uid_bytes(nccl.get_unique_id()) for _ in range(n)]
    if n:
        roots = bootstrap_root_threads()
        if roots >= BOOTSTRAP_ROOTS_WARN and roots & (roots - 1) == 0:
            log.warning(
                "%d NCCL bootstrap roots are waiting in this process for groups that were never fully "
                "created (each a thread and a socket, kept until the process exits)",
                roots,
            )
    return ids


def member_info(n_ids: int) -> dict:
    """What the rendezvous needs from one member: ``n_ids`` unique ids, its NCCL settings, the keys
    its backend set, its NCCL version and its abort address."""
    _, nccl = cb.import_nccl()
    ids = generate_unique_ids(n_ids)
    return {
        "uids": ids,
        "settings": local_settings(),
        "applied": sorted(_APPLIED_KEYS),
        "nccl": int(nccl.get_version()),
        "abort_to": list(peer_aborts().address),
    }


def _member_info_on_actor(actor_self, n_ids: int) -> dict:
    """Runs inside a member actor through ``ActorHandle.__ray_call__`` (its backend already applied
    its mesh's NCCL environment when it was unpickled there)."""
    return member_info(n_ids)
