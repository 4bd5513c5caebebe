"""Gloo backend: CPU communicators from torch.distributed's ProcessGroupGloo, one per group.

Driver side: ONE ``TCPStore`` master (port 0: the OS picks) lives in the driver process; a
rendezvous is just ``(host, port, prefix)`` with a prefix unique per group AND per generation
(a token of this backend instance plus a counter), so a group re-created after a failure never
reads the keys of its dead predecessor. Nothing blocks: ``rendezvous`` makes no remote call.

Actor side: a raw ``ProcessGroupGloo(prefix_store, rank, size, options)`` per group, over the
actor's one client ``TCPStore`` connection. ``connect_many`` creates all new groups of a run at its
start, with EAGER connection setup, one after the other in the order of their first use in the
program, bounded by the run's deadline. Why not the lazy device: its connection setup runs inside
the first ``send``/``broadcast`` call, waits on the store for the full store timeout whatever the
op's ``wait(timeout)`` says, and can hang against a peer that aborted in between. Why first-use
order: eager setup of overlapping groups in different orders on different actors deadlocks; in one
global order it cannot. (Creating groups concurrently in threads would also avoid that, but needs a
store connection per thread, and opening TCPStore connections here sometimes stalls for 5 s.)
Once created, a group's pairs are connected, so a peer that dies or aborts makes pending
operations fail at once ("Connection closed by peer").

Operations use the group object's own ``broadcast/send/recv``; before each one the group's timeout
is set to the time left (``Communicator.timeout_s``, which the executor sets) and the work is
waited on with it. A timed-out or failed group is unusable (gloo closes its pairs); the caller
drops it. Gloo moves every dtype the runtime supports (bool and bfloat16 included) as is.
"""

from __future__ import annotations

import datetime
import itertools
import os
import threading
import time
import uuid

from reshard.errors import ReshardError, ReshardTimeout
from reshard.runtime.communicator import Backend, Communicator, Group, PeerFailed, Rendezvous

_MIN_WAIT_S = 1e-3


class _ReduceOps(dict):
    def __missing__(self, op):
        import torch.distributed as dist

        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        if op not in ops:
            raise ValueError(f"unknown reduce op {op!r}; choose one of {', '.join(ops)}")
        self[op] = ops[op]
        return self[op]


_REDUCE_OPS = _ReduceOps()


def _td(seconds: float) -> datetime.timedelta:
    # timedelta(0) means "no timeout" to torch: never pass it.
    return datetime.timedelta(seconds=max(float(seconds), _MIN_WAIT_S))


def _node_ip() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # not in a Ray process: loopback
        pass
    return "127.0.0.1"


class GlooCommunicator(Communicator):
    """This device's ProcessGroupGloo for one group."""

    def __init__(self, group: Group, rank: int, timeout_s: float, pg, prefix: str, device: int):
        super().__init__(group, rank, timeout_s)
        self.pg = pg
        self.prefix = prefix
        self.device = device
        self.failed: str | None = None

    def __repr__(self) -> str:
        return f"GlooCommunicator(group={self.group}, rank={self.rank}, prefix={self.prefix!r})"

    def broadcast(self, tensor, root: int) -> None:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = root
        opts.rootTensor = 0
        self._run("broadcast", lambda: self.pg.broadcast([tensor], opts), tensor, root)

    def send(self, tensor, peer: int, tag: int = 0) -> None:
        self._run("send", lambda: self.pg.send([tensor], peer, tag), tensor, peer)

    def recv(self, tensor, peer: int, tag: int = 0) -> None:
        self._run("recv", lambda: self.pg.recv([tensor], peer, tag), tensor, peer)

    def all_reduce(self, tensor, op: str = "sum") -> None:
        import torch.distributed as dist

        opts = dist.AllreduceOptions()
        opts.reduceOp = _REDUCE_OPS[op]
        self._run("all_reduce", lambda: self.pg.allreduce([tensor], opts), tensor, -1)

    def _run(self, what: str, issue, tensor, peer: int) -> None:
        if self.pg is None or self.failed:
            raise ReshardError(
                f"device {self.device}: {what} on group {self.group} whose communicator is "
                f"{'closed' if self.pg is None else 'broken (' + self.failed + ')'}; it must be re-created"
            )
        if not tensor.is_contiguous():
            raise ValueError(
                f"gloo {what} needs a contiguous tensor, got shape {tuple(tensor.shape)} strides {tensor.stride()}"
            )
        timeout = _td(self.timeout_s)
        try:
            self.pg.set_timeout(timeout)
            issue().wait(timeout)
        except RuntimeError as e:
            msg = str(e).split("\n")[0]
            self.failed = msg
            where = (
                f"device {self.device}: gloo {what} (group {self.group}, rank {self.rank}, "
                f"peer/root {peer}, {tuple(tensor.shape)})"
            )
            low = msg.lower()
            if "timed out" in low or "timeout" in low:
                raise ReshardTimeout(f"{where} did not complete within {self.timeout_s:.2f}s: {msg}") from None
            if "closed by peer" in low or "connection reset" in low or "broken pipe" in low:
                raise PeerFailed(f"{where}: a peer went away: {msg}") from None
            raise ReshardError(f"{where} failed: {msg}") from None

    def close(self) -> None:
        pg, self.pg = self.pg, None
        if pg is not None:
            _release(pg, abort=bool(self.failed))

    def abort(self) -> None:
        pg, self.pg = self.pg, None
        if pg is not None:
            _release(pg, abort=True)


def _release(pg, *, abort: bool) -> None:
    """Drop a process group off the caller's thread: its destructor joins gloo's worker threads,
    which may still sit in an operation whose peer is gone. ``abort`` closes its sockets first, so
    that peers blocked on it fail at once ("Connection closed by peer")."""
    if abort:
        try:
            pg.abort()
        except Exception:
            pass

    def drop(pg):  # the last reference dies in this thread
        del pg

    threading.Thread(target=drop, args=(pg,), name="reshard-gloo-release", daemon=True).start()


class GlooBackend(Backend):
    """CPU communicators over gloo. Construct without arguments; pickling ships only the config."""

    name = "gloo"
    device_type = "cpu"

    def __init__(self, *, host: str | None = None):
        self.host = host  # master address; None: this driver's node IP (127.0.0.1 on loopback)
        self._master = None
        self._token = uuid.uuid4().hex[:8]
        self._counter = itertools.count(1)
        self._clients: dict[tuple[str, int], object] = {}
        self._lock = threading.Lock()

    def __getstate__(self):
        # the configuration, plus the master's address once the driver opened it (actors connect
        # to it while they start, see ``setup_actor``)
        return {"host": self.host, "master": getattr(self, "_master_host", None) and self._master_address()}

    def __setstate__(self, state):
        self.__init__(host=state["host"])
        self._warm = state.get("master")

    def setup_driver(self) -> None:
        """Driver side, before actors start: open the master store."""
        self._master_address()

    def setup_actor(self, timeout_s: float = 60.0) -> None:
        """Actor side, at start: connect to the master store now rather than in the first run."""
        warm = getattr(self, "_warm", None)
        if warm:
            self._client(warm[0], int(warm[1]), timeout_s)

    # ---------------------------------------------------------------- driver side

    def _master_address(self) -> tuple[str, int]:
        with self._lock:
            if self._master is None:
                import torch.distributed as dist

                host = self.host or _node_ip()
                self._master = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=_td(60))
                self._master_host = host
            return self._master_host, self._master.port

    def rendezvous(self, groups: list[Group], actors: dict[int, object]) -> list[Rendezvous]:
        """A fresh ``(host, port, prefix)`` per group: each call opens a new generation."""
        host, port = self._master_address()
        out = []
        for g in groups:
            g = tuple(g)
            prefix = f"reshard/{self._token}/{next(self._counter)}/{'-'.join(map(str, g))}/"
            out.append(Rendezvous(g, {"host": host, "port": port, "prefix": prefix}))
        return out

    # ---------------------------------------------------------------- actor side

    def _client(self, host: str, port: int, timeout_s: float):
        """This actor's one connection to the master store (reused: opening TCPStore connections
        on this kind of machine sometimes stalls for 5 s)."""
        import torch.distributed as dist

        key = (host, port)
        with self._lock:
            store = self._clients.get(key)
            if store is None:
                store = dist.TCPStore(host, port, is_master=False, timeout=_td(timeout_s))
                self._clients[key] = store
        return store

    def connect(self, rendezvous: Rendezvous, device: int, timeout_s: float) -> GlooCommunicator:
        return self.connect_many([rendezvous], device, timeout_s)[0]

    def connect_many(self, rendezvous: list[Rendezvous], device: int, timeout_s: float) -> list[GlooCommunicator]:
        """This device's communicators for ``rendezvous``, created one after the other IN THE GIVEN
        ORDER with eager connection setup, all within ``timeout_s``. The caller passes a run's groups
        in the order of their first use in the program: every member of a group then reaches its
        creation in the same global order, so sequential blocking creation cannot deadlock (it has
        the dependency structure of the program's first ops, which ``validate_program`` checks).
        Raises ``ReshardTimeout`` if a peer does not join in time (nothing of the batch is kept)."""
        for r in rendezvous:
            if device not in r.group:
                raise ValueError(f"device {device} is not a member of group {tuple(r.group)}")
        deadline = time.monotonic() + timeout_s
        out: list[GlooCommunicator] = []
        try:
            for r in rendezvous:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ReshardTimeout(f"device {device}: no time left to connect gloo group {tuple(r.group)}")
                try:
                    out.append(self._create(r, device, left))
                except ReshardError:
                    raise
                except Exception as e:
                    msg = str(e).splitlines()[0] if str(e) else type(e).__name__
                    if "timeout" in msg.lower() or "timed out" in msg.lower():
                        raise ReshardTimeout(
                            f"device {device}: gloo group {tuple(r.group)} not connected within {left:.2f}s "
                            f"(a peer did not join: dead, failed earlier or stuck): {msg}"
                        ) from None
                    raise ReshardError(f"device {device}: creating gloo group {tuple(r.group)} failed: {msg}") from None
        except BaseException:
            for c in out:
                c.abort()
            raise
        return out

    def _create(self, rendezvous: Rendezvous, device: int, timeout_s: float) -> GlooCommunicator:
        import torch.distributed as dist
        from torch.distributed import ProcessGroupGloo

        group = tuple(rendezvous.group)
        info = rendezvous.info
        client = self._client(info["host"], int(info["port"]), timeout_s)
        client.set_timeout(_td(timeout_s))
        store = dist.PrefixStore(info["prefix"], client)
        opts = ProcessGroupGloo._Options()
        hostname = os.environ.get("RESHARD_GLOO_HOSTNAME") or _node_ip()
        opts._devices = [ProcessGroupGloo.create_device(hostname=hostname, lazy_init=False)]
        opts._timeout = _td(timeout_s)
        rank = group.index(device)
        pg = ProcessGroupGloo(store, rank, len(group), opts)
        return GlooCommunicator(group, rank, timeout_s, pg, info["prefix"], device)
