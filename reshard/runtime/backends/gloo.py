"""Gloo backend: CPU communicators from torch.distributed's ProcessGroupGloo, one per group.

Controller side: ONE ``TCPStore`` master per controlling process, opened only when a gloo group
is first needed, listening on the node address Ray uses for this process (never on every
interface: we bind the socket ourselves and hand it to the store). A rendezvous is ``(host, port,
prefix)`` with a prefix unique per group AND generation, so a group re-created after a failure
never reads the keys of its dead predecessor. ``rendezvous`` makes no remote call.

Actor side: a raw ``ProcessGroupGloo(prefix_store, rank, size, options)`` per group, over the
actor's one client ``TCPStore`` connection to that controller. ``connect_many`` sets the groups
of a program up one after the other, in the order the program lists (``DeviceProgram.connect``,
validated: one order all members share), with EAGER connection setup, within the run's deadline.
Before creating a group every member announces itself under the group's prefix and waits, in short
slices, until all members did, or until some member (or the controller) wrote the group's ``abort``
key: a device that cannot run its part aborts its groups' rendezvous, and peers waiting for it fail
within ``JOIN_POLL_S`` instead of at their deadline (``abort_rendezvous``). The slices poll with
``check`` and never let a store wait time out: torch logs a timed-out wait, and formatting that
warning looks the store's address up in reverse DNS, which stalls for seconds when the resolver
throttles (the waiting member would overrun its deadline, holding the connection aborts need).
Once created, a group's pairs are connected, so a peer that dies or aborts makes pending operations
fail at once ("Connection closed by peer").

Operations are issued asynchronously (``isend``/``irecv``/``ibroadcast``) and waited for with the
time left (``GlooWork.wait``). A timed-out or failed group is unusable; the caller drops it. Gloo
moves every dtype the runtime supports (bool and bfloat16 included) as is.
"""

from __future__ import annotations

import datetime
import itertools
import os
import socket
import threading
import time
import uuid
from typing import TYPE_CHECKING

from reshard.errors import ReshardError, ReshardTimeout
from reshard.runtime.backends.communicator import Backend, Communicator, Group, PeerFailed, Rendezvous

if TYPE_CHECKING:
    from torch.distributed import TCPStore

_MIN_WAIT_S = 1e-3
JOIN_POLL_S = 0.05  # how often a member waiting for its group's peers looks for an abort


def _td(seconds: float) -> datetime.timedelta:
    # timedelta(0) means "no timeout" to torch: never pass it.
    return datetime.timedelta(seconds=max(float(seconds), _MIN_WAIT_S))


def node_ip() -> str:
    """The address Ray uses for this process's node (loopback outside Ray)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # not in a Ray process
        pass
    return "127.0.0.1"


def _reduce_op(op: str):
    import torch.distributed as dist

    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    if op not in ops:
        raise ValueError(f"unknown reduce op {op!r}; choose one of {', '.join(ops)}")
    return ops[op]


def listening_store(host: str, *, timeout_s: float):
    """A master ``TCPStore`` listening on ``host`` only, on a port the OS picks (torch's own
    master listens on every interface, whatever host it is given)."""
    import torch.distributed as dist

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind((host, 0))
        listener.listen(1024)
        store = dist.TCPStore(
            host,
            listener.getsockname()[1],
            None,
            True,
            _td(seconds=timeout_s),
            wait_for_workers=False,
            master_listen_fd=listener.fileno(),
        )
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store owns the descriptor now: it closes it when it goes
    return store


class GlooWork:
    """An issued gloo operation; ``wait`` raises ``ReshardTimeout`` / ``PeerFailed`` / ``ReshardError``."""

    def __init__(self, comm: GlooCommunicator, work, what: str, tensor, peer: int):
        self.comm, self.work, self.what, self.tensor, self.peer = comm, work, what, tensor, peer

    def wait(self, timeout_s: float) -> None:
        try:
            self.work.wait(_td(timeout_s))
        except RuntimeError as e:
            raise self.comm.failed_with(self.what, e, self.tensor, self.peer, timeout_s) from None


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

    def isend(self, tensor, peer: int) -> GlooWork:
        return self._issue("send", lambda pg: pg.send([tensor], peer, 0), tensor, peer)

    def irecv(self, tensor, peer: int) -> GlooWork:
        return self._issue("recv", lambda pg: pg.recv([tensor], peer, 0), tensor, peer)

    def ibroadcast(self, tensor, root: int) -> GlooWork:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = root
        opts.rootTensor = 0
        return self._issue("broadcast", lambda pg: pg.broadcast([tensor], opts), tensor, root)

    def send(self, tensor, peer: int) -> None:
        self.isend(tensor, peer).wait(self.timeout_s)

    def recv(self, tensor, peer: int) -> None:
        self.irecv(tensor, peer).wait(self.timeout_s)

    def broadcast(self, tensor, root: int) -> None:
        self.ibroadcast(tensor, root).wait(self.timeout_s)

    def all_reduce(self, tensor, op: str = "sum") -> None:
        import torch.distributed as dist

        opts = dist.AllreduceOptions()
        opts.reduceOp = _reduce_op(op)
        self._issue("all_reduce", lambda pg: pg.allreduce([tensor], opts), tensor, -1).wait(self.timeout_s)

    def _issue(self, what: str, issue, tensor, peer: int) -> GlooWork:
        pg = self.pg
        if pg is None or self.failed:
            state = "closed" if pg is None else f"broken ({self.failed})"
            raise ReshardError(
                f"device {self.device}: {what} on group {self.group} whose communicator is {state}; "
                "it must be re-created"
            )
        if not tensor.is_contiguous():
            raise ValueError(
                f"gloo {what} needs a contiguous tensor, got shape {tuple(tensor.shape)} strides {tensor.stride()}"
            )
        try:
            pg.set_timeout(_td(self.timeout_s))
            return GlooWork(self, issue(pg), what, tensor, peer)
        except RuntimeError as e:
            raise self.failed_with(what, e, tensor, peer, self.timeout_s) from None

    def failed_with(self, what: str, e: Exception, tensor, peer: int, timeout_s: float) -> ReshardError:
        msg = str(e).split("\n")[0]
        self.failed = msg
        where = (
            f"device {self.device}: gloo {what} (group {self.group}, rank {self.rank}, peer/root {peer}, "
            f"{tuple(tensor.shape)})"
        )
        low = msg.lower()
        if "timed out" in low or "timeout" in low:
            return ReshardTimeout(f"{where} did not complete within {timeout_s:.2f}s: {msg}")
        if "closed by peer" in low or "connection reset" in low or "broken pipe" in low or self.pg is None:
            return PeerFailed(f"{where}: a peer went away or the group was aborted: {msg}")
        return ReshardError(f"{where} failed: {msg}")

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
        self.host = host  # the store's address; None: this process's node IP (loopback outside Ray)
        self._master: TCPStore | None = None
        self._master_host = ""  # the store's address, once it is open
        self._token = uuid.uuid4().hex[:8]
        self._counter = itertools.count(1)
        self._clients: dict[tuple[str, int], TCPStore] = {}
        self._lock = threading.Lock()

    def __getstate__(self):
        return {"host": self.host}

    def __setstate__(self, state):
        type(self).__init__(self, host=state["host"])

    # ---------------------------------------------------------------- controller side

    def _master_address(self) -> tuple[str, int]:
        """The store, opened on first use, listening on this node's address only."""
        with self._lock:
            if self._master is None:
                host = self.host or node_ip()
                self._master = listening_store(host, timeout_s=60)
                self._master_host = host
            return self._master_host, self._master.port

    @property
    def store_address(self) -> tuple[str, int] | None:
        """Where this controller's store listens, once it was opened (None before)."""
        return None if self._master is None else (self._master_host, self._master.port)

    def rendezvous(self, groups: list[Group], actors: dict[int, object]) -> list[Rendezvous]:
        """A fresh ``(host, port, prefix)`` per group: each call opens a new generation."""
        host, port = self._master_address()
        out = []
        for g in groups:
            g = tuple(g)
            prefix = f"reshard/{self._token}/{next(self._counter)}/{'-'.join(map(str, g))}/"
            out.append(Rendezvous(g, {"host": host, "port": port, "prefix": prefix}))
        return out

    def abort_rendezvous(self, rendezvous: list[Rendezvous], reason: str = "aborted") -> None:
        """Make every member still waiting to join these groups fail now (controller or member side)."""
        for r in rendezvous:
            info = r.info
            try:
                store = (
                    self._master
                    if self._master is not None
                    and self._master_host == info["host"]
                    and (self._master.port == int(info["port"]))
                    else self._client(info["host"], int(info["port"]), 5.0)
                )
                store.set(info["prefix"] + "abort", reason)
            except Exception:  # the store is gone with its controller: nobody is waiting on it
                pass

    def close(self) -> None:
        with self._lock:
            self._master = None

    # ---------------------------------------------------------------- actor side

    def _client(self, host: str, port: int, timeout_s: float):
        """This process's one connection to a controller's store (reused: opening TCPStore
        connections on this kind of machine sometimes stalls for 5 s)."""
        import torch.distributed as dist

        key = (host, port)
        with self._lock:
            store = self._clients.get(key)
            if store is None:
                store = dist.TCPStore(host, port, is_master=False, timeout=_td(timeout_s))
                self._clients[key] = store
        return store

    def controller_ended(self, rendezvous: list[Rendezvous]) -> None:
        """Close this process's connections to the ended controller's store."""
        with self._lock:
            for r in rendezvous:
                self._clients.pop((r.info["host"], int(r.info["port"])), None)

    def connect(self, rendezvous: Rendezvous, device: int, timeout_s: float) -> GlooCommunicator:
        return self.connect_many([rendezvous], device, timeout_s)[0]

    def connect_many(self, rendezvous: list[Rendezvous], device: int, timeout_s: float) -> list[GlooCommunicator]:
        """This device's communicators for ``rendezvous``, created one after the other IN THE GIVEN
        ORDER (module docstring), all within ``timeout_s``. Raises ``ReshardTimeout`` if a peer does
        not join in time, ``PeerFailed`` if a group was aborted (nothing of the batch is kept)."""
        for r in rendezvous:
            if device not in r.group:
                raise ValueError(f"device {device} is not a member of group {tuple(r.group)}")
        deadline = time.monotonic() + timeout_s
        out: list[GlooCommunicator] = []
        try:
            for r in rendezvous:
                out.append(self._create(r, device, deadline))
        except BaseException:
            for c in out:
                c.abort()
            raise
        return out

    def _create(self, rendezvous: Rendezvous, device: int, deadline: float) -> GlooCommunicator:
        import torch.distributed as dist
        from torch.distributed import ProcessGroupGloo

        group = tuple(rendezvous.group)
        info = rendezvous.info
        rank = group.index(device)
        left = deadline - time.monotonic()
        if left <= 0:
            raise ReshardTimeout(f"device {device}: no time left to connect gloo group {group}")
        try:
            client = self._client(info["host"], int(info["port"]), left)
            prefix = info["prefix"]
            client.set(f"{prefix}join/{rank}", "1")
            self._wait_for_members(client, prefix, group, device, deadline)
            left = deadline - time.monotonic()
            client.set_timeout(_td(left))
            store = dist.PrefixStore(prefix, client)
            opts = ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # torch's stubs know only Options
            hostname = os.environ.get("RESHARD_GLOO_HOSTNAME") or node_ip()
            opts._devices = [ProcessGroupGloo.create_device(hostname=hostname, lazy_init=False)]
            opts._timeout = _td(left)
            pg = ProcessGroupGloo(store, rank, len(group), opts)
        except ReshardError:
            raise
        except Exception as e:
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            if "timeout" in msg.lower() or "timed out" in msg.lower():
                raise ReshardTimeout(
                    f"device {device}: gloo group {group} not connected in time (a peer did not join): {msg}"
                ) from None
            raise ReshardError(f"device {device}: creating gloo group {group} failed: {msg}") from None
        return GlooCommunicator(group, rank, left, pg, prefix, device)

    @staticmethod
    def _wait_for_members(client, prefix: str, group: Group, device: int, deadline: float) -> None:
        keys = [f"{prefix}join/{r}" for r in range(len(group))]
        abort = f"{prefix}abort"
        while True:
            if client.check([abort]):
                reason = client.get(abort).decode(errors="replace")
                raise PeerFailed(f"device {device}: gloo group {group} was aborted before it connected ({reason})")
            if client.check(keys):
                return
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [group[r] for r, k in enumerate(keys) if not client.check([k])]
                raise ReshardTimeout(f"device {device}: gloo group {group}: devices {missing} never joined")
            time.sleep(min(JOIN_POLL_S, left))
