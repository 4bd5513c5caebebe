"""NCCL backend: broadcast groups over cupy's NCCL bindings (``cupy.cuda.nccl``).

Loaded lazily by the runtime's backend registry as ``reshard.runtime.backends.nccl:NcclBackend``; this
module imports neither cupy nor torch at import time, so it can be imported (and its pure parts
tested) on a machine without GPUs.

Non-blocking communicators, one thread
    NCCL supports ``ncclCommAbort`` only on communicators no thread is inside of; aborting a
    blocking communicator from a watchdog while the caller sits in ``ncclGroupEnd`` or a lazy
    connection setup frees it under the caller. cupy exposes no ``ncclConfig_t.blocking``, so the
    backend sets ``NCCL_COMM_BLOCKING=0`` in the actor's environment when the backend arrives there
    (before the actor's first NCCL call; NCCL reads it once per process): every communicator is
    then non-blocking, every NCCL call returns at once (``ncclInProgress``: cupy raises it as
    ``KeyError(7)`` or ``NcclError`` with status 7, see ``nccl_status``), and the calling thread
    polls ``ncclCommGetAsyncError`` and CUDA events until done, an error, a peer's abort notice or
    the deadline; on failure that same thread aborts. No other thread ever calls into NCCL for a
    backend (its calls are serialised by one lock). Last resort: if NCCL nevertheless stays inside
    one call past its deadline plus ``WEDGE_GRACE_S`` (NCCL_COMM_BLOCKING was read as 1 before the
    backend set it, or NCCL itself is wedged), a guard thread ends the process
    (``WEDGED_EXIT_CODE``) so that Ray reports the actor dead instead of the actor hanging; the
    guard never touches a communicator.

Peers fail fast
    ``ncclCommAbort`` is local: peers connected over NVLink/PCIe/shared memory learn nothing and
    would wait for their whole deadline. Every actor process keeps one UDP socket
    (``PeerAborts``); the rendezvous carries each member's address, and a member that aborts a
    communicator sends a datagram naming it (a digest of its unique id) to the other members.
    Their polling loops check for that notice between NCCL calls, abort their own communicator and
    raise ``PeerFailed``. A lost datagram only means the deadline applies.

Driver side
    ``rendezvous(groups, actors)`` asks every member of the new groups, in one batched round trip
    (``ActorHandle.__ray_call__``, so any Ray actor works), for its NCCL settings, NCCL version and
    abort address (cached per actor after the first time), and the member chosen by
    ``assign_id_hosts`` for its groups' unique ids (the NCCL bootstrap root of a group then runs in
    one of its own processes). Members of one group whose settings (``SHARED_SETTINGS`` and every
    key a member's backend ``env`` sets) or NCCL versions differ are refused at once with an error
    naming both; the agreed settings travel in the rendezvous and every member checks its own
    against them before creating the communicator. Which groups are live, and the LRU bound on
    live communicators per device, are the runtime's (``reshard.runtime.driver.group_table``,
    ``reshard.runtime.device.group_cache``).

Actor side
    ``connect_many`` creates every new communicator of this actor inside ONE
    ``nccl.groupStart()/groupEnd()`` (so the order in which different actors create overlapping
    groups cannot deadlock). Every transfer runs on one dedicated communication stream: an event
    recorded on the producer's current stream makes the comm stream wait for the computation that
    wrote the buffer, and the producer stream then waits on the comm stream's completion event.
    ``with backend.grouped(): ...`` issues several operations as one NCCL group and waits once.

Unique ids and bootstrap threads
    ``ncclGetUniqueId`` starts a detached thread ("NCCL BootstrapR") with a listening socket in the
    generating process; it ends only after every rank of the group has checked in. A group that
    is never fully created (a member died, a creation timed out) leaves that thread and socket
    until the process exits: NCCL offers no call to stop it. The backend generates ids only for
    groups about to be created, counts the live roots (``bootstrap_root_threads``, in ``stats``)
    and warns when they pile up. ``ncclCommSplit`` (cupy >= 14 exposes ``commSplit`` with
    ``NcclConfig(split_share=...)``; cupy 13 does not) would avoid new ids, but it is collective
    over the whole parent communicator, which does not fit groups that only their members create
    lazily; it is not used.
"""

from reshard.runtime.backends.nccl.aborts import PeerAborts, peer_aborts, uid_digest
from reshard.runtime.backends.nccl.backend import DEFAULT_TIMEOUT_S, NcclBackend
from reshard.runtime.backends.nccl.communicator import NcclCommunicator
from reshard.runtime.backends.nccl.ids import (
    BOOTSTRAP_ROOT_THREAD,
    RENDEZVOUS_INFO_VERSION,
    assign_id_hosts,
    bootstrap_root_threads,
    generate_unique_ids,
    member_info,
    nccl_available,
    normalize_group,
    visible_gpu_count,
)
from reshard.runtime.backends.nccl.operations import STREAM_DRAIN_S
from reshard.runtime.backends.nccl.settings import (
    MULTI_RANK_GPU_MIN_VERSION,
    MULTI_RANK_MIN_SHARE,
    NONBLOCKING_ENV,
    PAPER_BROADCAST_ENV,
    PER_PROCESS_SETTINGS,
    SHARED_SETTINGS,
    GpuSharing,
    agreed_settings,
    apply_env,
    effective_env,
    local_settings,
    settings_mismatch,
    sharing_env,
)
from reshard.runtime.backends.nccl.status import (
    CUDA_NOT_READY,
    NCCL_IN_PROGRESS,
    NCCL_TIMEOUT,
    event_fired,
    nccl_status,
)
from reshard.runtime.backends.nccl.wedge import WEDGE_GRACE_S, WEDGED_EXIT_CODE, WedgeGuard

__all__ = [
    "BOOTSTRAP_ROOT_THREAD",
    "CUDA_NOT_READY",
    "DEFAULT_TIMEOUT_S",
    "MULTI_RANK_GPU_MIN_VERSION",
    "MULTI_RANK_MIN_SHARE",
    "NCCL_IN_PROGRESS",
    "NCCL_TIMEOUT",
    "NONBLOCKING_ENV",
    "PAPER_BROADCAST_ENV",
    "PER_PROCESS_SETTINGS",
    "RENDEZVOUS_INFO_VERSION",
    "SHARED_SETTINGS",
    "STREAM_DRAIN_S",
    "WEDGED_EXIT_CODE",
    "WEDGE_GRACE_S",
    "GpuSharing",
    "NcclBackend",
    "NcclCommunicator",
    "PeerAborts",
    "WedgeGuard",
    "agreed_settings",
    "apply_env",
    "assign_id_hosts",
    "bootstrap_root_threads",
    "effective_env",
    "event_fired",
    "generate_unique_ids",
    "local_settings",
    "member_info",
    "nccl_available",
    "nccl_status",
    "normalize_group",
    "peer_aborts",
    "settings_mismatch",
    "sharing_env",
    "uid_digest",
    "visible_gpu_count",
]
