"""NCCL settings: the defaults, which settings ranks must agree on, their agreement at rendezvous, and
the environment that lets several ranks share one GPU."""

from __future__ import annotations

import enum
import logging
import os
from collections.abc import Iterable, Mapping

from reshard.runtime.backends.communicator import Group

log = logging.getLogger(__name__)


#: Broadcast settings the paper's authors forced (NCCL issue 674: broadcast of small messages and
#: two-rank groups is pathologically slow with the default algorithm/protocol choice).
PAPER_BROADCAST_ENV = {"NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple"}


#: What the backend sets in every actor: named NCCL threads (``bootstrap_root_threads`` finds the
#: roots by name); nothing NCCL decides by.
THREAD_NAMES_ENV = {"NCCL_SET_THREAD_NAME": "1"}
#: Non-blocking communicators through the environment: only where NCCL's C API is out of reach
#: (``NcclBackend`` otherwise configures each communicator).
NONBLOCKING_ENV = {"NCCL_COMM_BLOCKING": "0", **THREAD_NAMES_ENV}


#: Settings every rank of one communicator must agree on: NCCL picks algorithm, protocol, buffer
#: sizes, channels and transports per rank, and ranks that pick differently hang or corrupt data.
SHARED_SETTINGS = (
    "NCCL_ALGO",
    "NCCL_PROTO",
    "NCCL_BUFFSIZE",
    "NCCL_LL_BUFFSIZE",
    "NCCL_LL128_BUFFSIZE",
    "NCCL_NTHREADS",
    "NCCL_LL128_NTHREADS",
    "NCCL_MIN_NCHANNELS",
    "NCCL_MAX_NCHANNELS",
    "NCCL_MIN_CTAS",
    "NCCL_MAX_CTAS",
    "NCCL_NCHANNELS_PER_NET_PEER",
    "NCCL_P2P_NET_CHUNKSIZE",
    "NCCL_P2P_PCI_CHUNKSIZE",
    "NCCL_P2P_NVL_CHUNKSIZE",
    "NCCL_P2P_DISABLE",
    "NCCL_P2P_LEVEL",
    "NCCL_SHM_DISABLE",
    "NCCL_CROSS_NIC",
    "NCCL_NVLS_ENABLE",
    "NCCL_COLLNET_ENABLE",
    "NCCL_RUNTIME_CONNECT",
    "NCCL_MULTI_RANK_GPU_ENABLE",
    "NCCL_PXN_DISABLE",
)


#: Settings that are per process or per host by nature: never compared between ranks.
PER_PROCESS_SETTINGS = frozenset(
    {
        "NCCL_HOSTID",
        "NCCL_DEBUG",
        "NCCL_DEBUG_SUBSYS",
        "NCCL_DEBUG_FILE",
        "NCCL_COMM_BLOCKING",
        "NCCL_SOCKET_IFNAME",
        "NCCL_IB_HCA",
        "NCCL_COMM_ID",
        "NCCL_TOPO_FILE",
        "NCCL_TOPO_DUMP_FILE",
        "NCCL_GRAPH_DUMP_FILE",
        "NCCL_CONF_FILE",
        "NCCL_SET_THREAD_NAME",
    }
)


#: NCCL >= 2.30 lets several ranks share one GPU with NCCL_MULTI_RANK_GPU_ENABLE=1.
MULTI_RANK_GPU_MIN_VERSION = (2, 30, 0)


#: NCCL documents its multi-rank mode as experimental, for about two ranks per GPU, and as hanging
#: with more unless NCCL_MAX_CTAS is lowered: "auto" picks it only from half a GPU per actor up.
MULTI_RANK_MIN_SHARE = 0.5


class GpuSharing(enum.Enum):
    """How several device actors share one GPU (``NcclBackend(gpus_per_device < 1)``).

    NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU detected") unless each
    process names its own host (``NCCL_HOSTID``: NCCL then connects them like separate machines,
    sockets over loopback) or, from NCCL 2.30, ``NCCL_MULTI_RANK_GPU_ENABLE=1``."""

    AUTO = "auto"  # MULTI_RANK on NCCL >= 2.30 at >= 1/2 GPU per actor, else HOSTID; OFF with whole GPUs
    OFF = "off"
    HOSTID = "hostid"
    MULTI_RANK = "multi_rank"


def effective_env(env: Mapping[str, str] | None, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """NCCL environment to apply before creating communicators.

    ``env=None`` (the default) and ``{}`` apply nothing: NCCL's variables are the process's, and a
    framework's own communicators in the same process read them too. An explicit dict is applied
    as is (e.g. ``PAPER_BROADCAST_ENV``, the broadcast settings the paper's authors forced).
    ``NCCL_COMM_BLOCKING`` is the backend's own (a setting of each communicator) and refused here.
    """
    if env is None:
        return {}
    bad = [k for k in env if not isinstance(k, str) or not k.startswith("NCCL_")]
    if bad:
        raise ValueError(f"NCCL environment keys must start with NCCL_: {bad}")
    if "NCCL_COMM_BLOCKING" in env:
        raise ValueError(
            "NcclBackend(env=...) must not set NCCL_COMM_BLOCKING: the backend needs non-blocking communicators "
            "(it sets NCCL_COMM_BLOCKING=0 itself) so that it can abort them safely"
        )
    return {k: str(v) for k, v in env.items()}


def local_settings(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """This process's NCCL settings that ranks may have to agree on (per-process ones left out)."""
    return {k: v for k, v in environ.items() if k.startswith("NCCL_") and k not in PER_PROCESS_SETTINGS}


def agreed_settings(group: Group, reports: Mapping[int, tuple[Mapping[str, str], Iterable[str]]]) -> dict:
    """The settings all members of ``group`` share: ``reports[device] = (its local_settings, keys
    its backend env sets)``. Compared keys: ``SHARED_SETTINGS`` and every key some member's backend
    sets (per-process keys excepted); unset is a value (None). ValueError naming both devices."""
    keys = set(SHARED_SETTINGS)
    for _, applied in reports.values():
        keys.update(k for k in applied if k not in PER_PROCESS_SETTINGS)
    ordered = sorted(keys)
    first = group[0]
    want = {k: reports[first][0].get(k) for k in ordered}
    for d in group[1:]:
        got = {k: reports[d][0].get(k) for k in ordered}
        diff = {k: (want[k], got[k]) for k in ordered if want[k] != got[k]}
        if diff:
            a = ", ".join(f"{k}={v[0]}" for k, v in diff.items())
            b = ", ".join(f"{k}={v[1]}" for k, v in diff.items())
            raise ValueError(
                f"NCCL settings differ inside group {group}: device {first} has {a}, device {d} has {b}. Every rank "
                "of a communicator must use the same NCCL settings (ranks that choose different algorithms, protocols "
                "or buffers hang or corrupt data): give both meshes the same NcclBackend(env=...), and set no "
                "different NCCL_* variables in their processes"
            )
    return {k: v for k, v in want.items() if v is not None}


def settings_mismatch(expected: Mapping[str, str], environ: Mapping[str, str] = os.environ) -> dict:
    """``{key: (expected, here)}`` for the agreed settings this process does not have (SHARED_SETTINGS
    absent from ``expected`` must be unset here too)."""
    keys = set(expected) | {k for k in SHARED_SETTINGS if k in environ}
    return {k: (expected.get(k), environ.get(k)) for k in sorted(keys) if expected.get(k) != environ.get(k)}


def sharing_env(
    mode: GpuSharing,
    gpus_per_device: float,
    nccl_version: tuple[int, int, int] | None,
    pid: int,
    hostname: str,
    environ: Mapping[str, str] = os.environ,
) -> dict[str, str]:
    """Per-process environment that lets several ranks share one GPU (empty when they do not)."""
    if mode is GpuSharing.AUTO:
        if gpus_per_device >= 1 or gpus_per_device == 0:  # a GPU each, or none reserved through Ray
            return {}
        multi = nccl_version is not None and nccl_version >= MULTI_RANK_GPU_MIN_VERSION
        multi = multi and gpus_per_device >= MULTI_RANK_MIN_SHARE
        mode = GpuSharing.MULTI_RANK if multi else GpuSharing.HOSTID
    if mode is GpuSharing.OFF:
        return {}
    if mode is GpuSharing.MULTI_RANK:
        return {"NCCL_MULTI_RANK_GPU_ENABLE": "1"}
    out = {"NCCL_HOSTID": f"reshard-{hostname}-{pid}"}
    if "NCCL_SOCKET_IFNAME" not in environ:
        out["NCCL_SOCKET_IFNAME"] = "lo"  # the "hosts" share a machine: loopback
    return out


_APPLIED_KEYS: set[str] = set()  # keys some backend's env set in this process (reported to peers)


def apply_env(env: Mapping[str, str], *, record: bool = True) -> None:
    """Set NCCL_* variables in this process (some are read per communicator, some once per process)."""
    for k, v in env.items():
        if os.environ.get(k) != v:
            if k == "NCCL_COMM_BLOCKING" and k in os.environ:
                log.warning(
                    "overriding NCCL_COMM_BLOCKING=%s with %s: the NCCL backend aborts safely only "
                    "non-blocking communicators",
                    os.environ[k],
                    v,
                )
            os.environ[k] = v
        if record:
            _APPLIED_KEYS.add(k)
