"""Emulated multi-host Ray cluster on one machine: one network namespace per host, shaped NICs.

Each emulated host is a network namespace ``mr<token>h<k>`` with one veth pair into a bridge
``mr<token>br`` of the root namespace and a private address of an unused subnet, assigned inside
the namespace only (no default route: the hosts reach each other and nothing else). The host's
NIC is shaped full-duplex with ``tc`` htb on both ends of its veth: the namespace end limits what
the host sends, the bridge end what it receives, so two senders into one host share its rate.
``netem`` is not used (no added delay or loss). A Ray node runs in each namespace (``ray start``
with its own temp dir; the head in host 0), with ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1`` and
Ray's token authentication on, with a random token of the run (``RAY_AUTH_TOKEN``, in the
environment of the processes inside the namespaces only). Every node gets a
custom resource ``host_<k>: 1`` so work can be pinned by resource as well as by node affinity.

    with EmulatedCluster(hosts=4, nic_gbit=1.0, cpus_per_host=2) as c:
        c.addresses, c.head_address, c.node_ids
        c.run([sys.executable, "driver.py"], timeout_s=120)   # a driver in the head namespace
        c.round_trip_us(0, 1), c.stream_GBps([1, 2], 0)       # raw TCP figures between hosts
        c.actor_call_us(1)                                    # empty Ray actor call, head -> host 1

Teardown kills every process found in the run's namespaces by PID (TERM, bounded wait, KILL;
through pidfds, after checking the process is in one of our namespaces), then deletes veths,
bridge, namespaces and the run directory ``<tmp>/mr<token>`` (Ray's temp dirs live in it). It runs
on normal exit, on an exception, on SIGINT and SIGTERM, and raises if anything is left. It never
runs ``ray stop`` (which kills every Ray process of the machine). A run directory records its
owner process; ``leftovers()`` lists runs by their prefix and ``cleanup()`` removes those whose
owner died (a crashed or killed run).

Drivers: ``EmulatedCluster.run`` starts a process inside the head namespace with the environment
of the emulated cluster (``RAY_ADDRESS``, ``BENCH_EMULATE_NODE_IP``, ``BENCH_EMULATE_HOST`` (the
host index, which the Ray workers of each host also see), ``BENCH_EMULATE_ADDRESSES``); with
``host=k`` inside host ``k``'s namespace instead (a driver that is not on the head node). There
``connect()`` joins the cluster and ``host_addresses()`` lists the hosts. Scenarios are the way
tests send code to a driver: a script defines plain functions that take and return JSON-able
values and ends with ``sys.exit(scenario_main(SCENARIOS))``; ``cluster.scenario(script, "name",
**kwargs)`` runs ``python script name '<kwargs json>'`` in the head namespace (or ``host=k``'s)
and returns the function's result (the script prints it on one line after
``SCENARIO_RESULT_MARK``; a failing scenario raises ``EmulationError`` with its stderr).
``tests/multihost/scenarios.py`` is one.

CLI: ``python -m bench.emulate up|run|measure|check|cleanup|down`` (``--help`` on each).
Needs root, ``ip`` and ``tc``, and the ``ray`` CLI next to the interpreter; ``available()``
says why not, for callers to skip.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import ipaddress
import json
import os
import queue
import re
import secrets
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

PREFIX = "mr"
NODE_IP_ENV = "BENCH_EMULATE_NODE_IP"
HOST_ENV = "BENCH_EMULATE_HOST"
ADDRESSES_ENV = "BENCH_EMULATE_ADDRESSES"
SCENARIO_RESULT_MARK = "SCENARIO_RESULT "
_NAME = re.compile(rf"^{PREFIX}([0-9a-f]{{6}})(h\d+|v\d+|br|x)$")
_RUN_DIR = re.compile(rf"^{PREFIX}([0-9a-f]{{6}})$")
_REPO = Path(__file__).resolve().parents[1]
_RAY_ENV_DROP = (
    "RAY_ADDRESS",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER",
    "RAY_TMPDIR",
    "RAY_NAMESPACE",
    "RAY_JOB_ID",
    "RAY_AUTH_TOKEN_PATH",
)


class EmulationError(RuntimeError):
    """The emulated cluster could not be brought up, used or fully torn down."""


@dataclasses.dataclass(frozen=True, slots=True)
class Listener:
    """One listening TCP socket inside an emulated host (``ss -ltnp``)."""

    address: str
    port: int
    pid: int | None
    command: str

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"Listener port must be in 0..65535, got {self.port}")

    @property
    def wildcard(self) -> bool:
        """True when it listens on every interface (0.0.0.0, ::, *)."""
        return self.address in ("0.0.0.0", "::", "*")


@dataclasses.dataclass(frozen=True, slots=True)
class Run:
    """Resources of one emulation run found on the machine, by their ``mr<token>`` prefix."""

    token: str
    namespaces: tuple[str, ...]
    links: tuple[str, ...]
    run_dir: str | None
    pids: tuple[int, ...]
    owner_pid: int | None
    owner_alive: bool

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[0-9a-f]{6}", self.token):
            raise ValueError(f"Run token must be 6 hex digits, got {self.token!r}")

    @property
    def stale(self) -> bool:
        """Its owner process is gone: nobody will tear it down but ``cleanup``."""
        return not self.owner_alive


# ---------------------------------------------------------------------------------------------
# System helpers


def _sh(argv: Sequence[str], *, timeout_s: float = 30.0, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s)
    if check and done.returncode != 0:
        raise EmulationError(f"`{' '.join(argv)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done


def _ray_cli() -> Path:
    return Path(sys.executable).parent / "ray"


def _start_time(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _owner_record() -> str:
    return f"{os.getpid()} {_start_time(os.getpid())}\n"


def _owner(run_dir: Path) -> tuple[int | None, bool]:
    try:
        pid_s, start = (run_dir / "owner").read_text().split()
    except (OSError, ValueError):
        return None, False
    pid = int(pid_s)
    return pid, _start_time(pid) == start


def _netns_ids(names: Iterable[str]) -> dict[tuple[int, int], str]:
    """(st_dev, st_ino) of each named namespace, the identity a process's /proc/PID/ns/net has."""
    ids = {}
    for name in names:
        with contextlib.suppress(OSError):
            st = os.stat(f"/run/netns/{name}")
            ids[(st.st_dev, st.st_ino)] = name
    return ids


def _pids_in(ns_ids: dict[tuple[int, int], str]) -> dict[int, str]:
    """Live processes whose network namespace is one of ``ns_ids`` (what ``ip netns pids`` lists)."""
    found = {}
    if not ns_ids:
        return found
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            st = os.stat(f"/proc/{entry.name}/ns/net")
            name = ns_ids.get((st.st_dev, st.st_ino))
            if (
                name is not None
                and Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
            ):
                found[int(entry.name)] = name
        except OSError:
            continue
    return found


def _kill_in(ns_ids: dict[tuple[int, int], str], *, grace_s: float = 1.0, timeout_s: float = 30.0) -> None:
    """Kill every process in the namespaces: TERM, wait up to ``grace_s``, KILL; again until none
    is left (a dying raylet may still spawn). The grace is short: with the whole cluster going,
    Ray's daemons wait seconds for each other on TERM and have nothing worth saving. Signals go
    through pidfds opened after checking the process is in one of the namespaces, so a recycled
    PID is never hit."""
    deadline = time.monotonic() + timeout_s
    sig = signal.SIGTERM
    while True:
        pids = _pids_in(ns_ids)
        if not pids:
            return
        if time.monotonic() > deadline:
            raise EmulationError(f"processes survive in the emulated hosts: {sorted(pids.items())}")
        fds = []
        for pid in pids:
            try:
                fd = os.pidfd_open(pid)
            except OSError:
                continue
            try:
                st = os.stat(f"/proc/{pid}/ns/net")
                if (st.st_dev, st.st_ino) in ns_ids:
                    signal.pidfd_send_signal(fd, sig)
                    fds.append(fd)
                    continue
            except OSError:
                pass
            os.close(fd)
        _wait_pidfds(fds, min(grace_s, max(0.0, deadline - time.monotonic())))
        sig = signal.SIGKILL


def _wait_pidfds(fds: list[int], timeout_s: float) -> None:
    """Wait until every pidfd reports its process exited, or ``timeout_s``; closes them."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    pending = set(fds)
    end = time.monotonic() + timeout_s
    try:
        while pending:
            left = end - time.monotonic()
            if left <= 0:
                break
            for fd, _ in poller.poll(left * 1000):
                poller.unregister(fd)
                pending.discard(fd)
    finally:
        for fd in fds:
            os.close(fd)


def _list_netns() -> list[str]:
    with contextlib.suppress(FileNotFoundError):
        return sorted(os.listdir("/run/netns"))
    return []


def _list_links() -> list[str]:
    out = _sh(["ip", "-o", "link", "show"], check=False).stdout
    return [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line]


def _run_dir(token: str) -> Path:
    return Path(tempfile.gettempdir()) / f"{PREFIX}{token}"


def leftovers(token: str | None = None) -> tuple[Run, ...]:
    """Every run (or the one of ``token``) with anything left on the machine: namespaces, links,
    run directory, processes in its namespaces; whether its owner process still lives."""
    by_token: dict[str, dict[str, list]] = {}

    def slot(t: str) -> dict[str, list]:
        return by_token.setdefault(t, {"ns": [], "links": []})

    for name in _list_netns():
        m = _NAME.match(name)
        if m:
            slot(m.group(1))["ns"].append(name)
    for name in _list_links():
        m = _NAME.match(name)
        if m:
            slot(m.group(1))["links"].append(name)
    for entry in Path(tempfile.gettempdir()).iterdir():
        m = _RUN_DIR.match(entry.name)
        if m and entry.is_dir():
            slot(m.group(1))
    runs = []
    for t, found in sorted(by_token.items()):
        if token is not None and t != token:
            continue
        d = _run_dir(t)
        owner_pid, alive = _owner(d)
        pids = _pids_in(_netns_ids(found["ns"]))
        runs.append(
            Run(
                token=t,
                namespaces=tuple(found["ns"]),
                links=tuple(found["links"]),
                run_dir=str(d) if d.is_dir() else None,
                pids=tuple(sorted(pids)),
                owner_pid=owner_pid,
                owner_alive=alive,
            )
        )
    return tuple(runs)


def _remove(token: str, extra_ns_ids: dict[tuple[int, int], str] | None = None) -> None:
    """Remove everything of run ``token``: processes, veths, bridge, namespaces, run directory.

    ``extra_ns_ids``: identities of the run's namespaces recorded when they were made, so that
    processes in one that lost its name are found too. A namespace's identity is recycled once it
    is gone, so a recorded identity that now belongs to a namespace of another name is skipped."""
    namespaces = [n for n in _list_netns() if (m := _NAME.match(n)) and m.group(1) == token]
    others = _netns_ids(n for n in _list_netns() if not ((m := _NAME.match(n)) and m.group(1) == token))
    recorded = {k: v for k, v in (extra_ns_ids or {}).items() if k not in others}
    ns_ids = {**recorded, **_netns_ids(namespaces)}
    _kill_in(ns_ids)
    links = [n for n in _list_links() if (m := _NAME.match(n)) and m.group(1) == token]
    for link in sorted(links, key=lambda n: n.endswith("br")):
        _sh(["ip", "link", "del", link], check=False)
    for ns in namespaces:
        _sh(["ip", "netns", "del", ns], check=False)
    shutil.rmtree(_run_dir(token), ignore_errors=True)
    survivors = _pids_in(ns_ids)
    left = leftovers(token)
    if survivors or left:
        raise EmulationError(f"teardown of run {token} left {left} and processes {sorted(survivors)}")


def cleanup(token: str | None = None, *, stale_only: bool = True) -> tuple[Run, ...]:
    """Remove leftovers of earlier runs (only those whose owner died unless ``stale_only=False``);
    returns the runs removed."""
    removed = []
    for run in leftovers(token):
        if stale_only and not run.stale:
            continue
        _remove(run.token)
        removed.append(run)
    return tuple(removed)


_AVAILABLE: tuple[bool, str] | None = None


def available() -> tuple[bool, str]:
    """(True, "") when this machine can emulate hosts: root, ``ip``, ``tc``, namespaces, veth and
    htb work, and the ``ray`` CLI sits next to the interpreter; else (False, why)."""
    global _AVAILABLE
    if _AVAILABLE is None:
        _AVAILABLE = _check_available()
    return _AVAILABLE


def _check_available() -> tuple[bool, str]:
    if not sys.platform.startswith("linux"):
        return False, "emulated hosts need Linux network namespaces"
    if os.geteuid() != 0:
        return False, "emulated hosts need root (network namespaces, veth, tc)"
    for tool in ("ip", "tc", "ss"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` (iproute2) is not installed"
    if not _ray_cli().exists():
        return False, f"no `ray` CLI next to {sys.executable}"
    token = secrets.token_hex(3)
    d = _run_dir(token)
    ns = f"{PREFIX}{token}x"
    try:
        d.mkdir()
        (d / "owner").write_text(_owner_record())
        for argv in (
            ["ip", "netns", "add", ns],
            ["ip", "-n", ns, "link", "add", "name", "pa", "type", "veth", "peer", "name", "pb"],
            ["tc", "-n", ns, "qdisc", "add", "dev", "pa", "root", "handle", "1:", "htb", "default", "1"],
        ):
            done = _sh(argv, check=False)
            if done.returncode != 0:
                return False, f"`{' '.join(argv)}` failed: {done.stderr.strip()}"
        return True, ""
    finally:
        _sh(["ip", "netns", "del", ns], check=False)
        shutil.rmtree(d, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Raw TCP probes, run as small subprocesses inside the namespaces

_PROBE = r"""
import json, selectors, socket, sys, time
mode = sys.argv[1]
if mode == "serve":
    addr, kind, n = sys.argv[2], sys.argv[3], int(sys.argv[4])
    s = socket.socket()
    s.bind((addr, 0))
    s.listen(n)
    print(s.getsockname()[1], flush=True)
    conns = [s.accept()[0] for _ in range(n)]
    if kind == "echo":
        c = conns[0]
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while (b := c.recv(1)):
            c.sendall(b)
    else:
        sel = selectors.DefaultSelector()
        for c in conns:
            sel.register(c, selectors.EVENT_READ)
        buf, total, first, last, live = bytearray(1 << 20), 0, None, None, n
        while live:
            for key, _ in sel.select():
                got = key.fileobj.recv_into(buf)
                if got:
                    total += got
                    last = time.perf_counter()
                    first = first or last
                else:
                    sel.unregister(key.fileobj)
                    live -= 1
        print(json.dumps({"bytes": total, "seconds": (last - first) if total else 0.0}), flush=True)
elif mode == "ping":
    addr, port, rounds = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    c = socket.create_connection((addr, port))
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    samples = []
    for i in range(rounds + 20):
        t0 = time.perf_counter()
        c.sendall(b"x")
        c.recv(1)
        if i >= 20:
            samples.append((time.perf_counter() - t0) * 1e6)
    print(json.dumps(samples), flush=True)
elif mode == "send":
    addr, port, seconds = sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    c = socket.create_connection((addr, port))
    data = bytes(1 << 20)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        c.sendall(data)
    c.close()
"""


def read_line(proc: subprocess.Popen, timeout_s: float, what: str = "process") -> str:
    """Next line of ``proc``'s text stdout within ``timeout_s`` (a reader thread feeds a queue, so
    lines that arrived together are never stuck in a buffer that ``select`` cannot see); raises
    ``EmulationError`` naming ``what`` on timeout or end of output."""
    lines = getattr(proc, "_emulate_lines", None)
    if lines is None:
        lines = proc._emulate_lines = queue.Queue()

        def pump() -> None:
            for line in proc.stdout:
                lines.put(line)
            lines.put("")

        threading.Thread(target=pump, daemon=True, name=f"read-line-{proc.pid}").start()
    try:
        line = lines.get(timeout=timeout_s)
    except queue.Empty:
        line = None
    if not line:
        proc.kill()
        proc.wait(timeout=10)
        err = proc.stderr.read()[-2000:] if proc.stderr else ""
        state = "no line" if line is None else "end of output"
        raise EmulationError(f"{what}: {state} within {timeout_s} s (exit {proc.returncode}): {err.strip()}")
    return line.rstrip("\n")


def namespace_listeners(namespace: str, *, udp: bool = False) -> tuple[Listener, ...]:
    """Every listening TCP socket (bound UDP socket with ``udp``) inside network namespace
    ``namespace`` with its process (``ss``; root). Also usable from a driver inside an emulated host."""
    done = _sh(["ip", "netns", "exec", namespace, "ss", "-lunpH" if udp else "-ltnpH"])
    found = []
    for line in done.stdout.splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        addr, _, port = fields[3].rpartition(":")
        addr = addr.strip("[]").split("%")[0]
        users = re.findall(r'\("([^"]*)",pid=(\d+),', line)
        for command, pid in dict.fromkeys(users) or [("", None)]:
            found.append(Listener(addr, int(port), int(pid) if pid else None, command))
    return tuple(found)


def _pick_subnet(token: str) -> ipaddress.IPv4Network:
    """A /24 in 10.213.0.0/16 that overlaps no address or route of the root namespace."""
    used = []
    for argv in (["ip", "-o", "-4", "addr", "show"], ["ip", "-4", "route", "show", "table", "all"]):
        for word in _sh(argv, check=False).stdout.split():
            with contextlib.suppress(ValueError):
                if "/" in word or word.count(".") == 3:
                    used.append(ipaddress.ip_network(word, strict=False))
    start = int(token, 16) % 256
    for i in range(256):
        net = ipaddress.ip_network(f"10.213.{(start + i) % 256}.0/24")
        if not any(net.overlaps(u) for u in used if u.prefixlen > 0):
            return net
    raise EmulationError("no free /24 in 10.213.0.0/16; pass subnet=")


# ---------------------------------------------------------------------------------------------
# The cluster


class EmulatedCluster:
    """N emulated hosts (network namespaces with shaped NICs), a Ray node in each unless
    ``ray=False``. Use as a context manager; ``up()``/``down()`` for explicit control."""

    def __init__(
        self,
        hosts: int = 4,
        *,
        nic_gbit: float = 1.0,
        cpus_per_host: int = 2,
        ray: bool = True,
        host_resources: bool = True,
        object_store_mib: int = 512,
        subnet: str | None = None,
        head_port: int = 6379,
        startup_timeout_s: float = 120.0,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        if not isinstance(hosts, int) or not 1 <= hosts <= 64:
            raise ValueError(f"hosts must be an int in 1..64, got {hosts!r}")
        if not nic_gbit > 0:
            raise ValueError(f"nic_gbit must be > 0 (Gbit/s per NIC), got {nic_gbit!r}")
        if not isinstance(cpus_per_host, int) or cpus_per_host < 0:
            raise ValueError(f"cpus_per_host must be an int >= 0, got {cpus_per_host!r}")
        if object_store_mib < 80:
            raise ValueError(f"object_store_mib must be >= 80 (Ray's minimum), got {object_store_mib}")
        self.hosts = hosts
        self.nic_gbit = float(nic_gbit)
        self.cpus_per_host = cpus_per_host
        self.with_ray = ray
        self.host_resources = host_resources
        self.object_store_mib = object_store_mib
        self.head_port = head_port
        self.startup_timeout_s = startup_timeout_s
        self._progress = progress or (lambda _msg: None)
        self.token = secrets.token_hex(3)
        self._auth_token = secrets.token_hex(32)  # Ray's token auth for this cluster only
        self.run_dir = _run_dir(self.token)
        self.namespaces = tuple(f"{PREFIX}{self.token}h{k}" for k in range(hosts))
        self.bridge = f"{PREFIX}{self.token}br"
        self._subnet = ipaddress.ip_network(subnet) if subnet else None
        if self._subnet is not None and self._subnet.num_addresses < hosts + 2:
            raise ValueError(f"subnet {subnet} has room for fewer than {hosts} hosts")
        self.addresses: tuple[str, ...] = ()
        self.node_ids: tuple[str, ...] = ()
        self.timings: dict[str, float] = {}
        self._ns_ids: dict[tuple[int, int], str] = {}
        self._procs: list[subprocess.Popen] = []
        self._state = "new"
        self._old_handlers: dict[int, Any] = {}

    # -- lifecycle -------------------------------------------------------------------------

    def __enter__(self) -> EmulatedCluster:
        self.up()
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def up(self) -> EmulatedCluster:
        """Create the hosts and start Ray; on any failure or interrupt, tear down and re-raise."""
        if self._state != "new":
            raise EmulationError(f"cluster {self.token} was already brought up (state {self._state})")
        ok, why = available()
        if not ok:
            raise EmulationError(f"cannot emulate hosts here: {why}")
        self._state = "up"
        self._install_signal_handlers()
        atexit.register(self.down)
        t0 = time.perf_counter()
        try:
            self.run_dir.mkdir(mode=0o700)
            (self.run_dir / "owner").write_text(_owner_record())
            (self.run_dir / "tmp").mkdir()
            self._make_network()
            self.timings["network_s"] = time.perf_counter() - t0
            self._progress(f"network {self.token}")
            if self.with_ray:
                self._start_ray()
        except BaseException:
            self.down()
            raise
        self.timings["up_s"] = time.perf_counter() - t0
        return self

    def down(self) -> None:
        """Kill every process in the namespaces, delete links, namespaces and the run directory.
        Idempotent; SIGINT/SIGTERM arriving meanwhile are deferred until it is done."""
        if self._state in ("new", "down"):
            return
        self._state = "down"
        deferred: list[int] = []
        previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                previous[sig] = signal.signal(sig, lambda s, _f: deferred.append(s))
        t0 = time.perf_counter()
        try:
            for proc in self._procs:
                with contextlib.suppress(OSError):
                    proc.kill()
            _remove(self.token, self._ns_ids)
            for proc in self._procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=10)
        finally:
            self.timings["down_s"] = time.perf_counter() - t0
            atexit.unregister(self.down)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self._restore_signal_handlers()
            if deferred:
                _raise_for_signal(deferred[0])

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
            self._old_handlers[signal.SIGTERM] = signal.signal(signal.SIGTERM, lambda s, _f: _raise_for_signal(s))
        if signal.getsignal(signal.SIGINT) in (signal.SIG_DFL, None):
            self._old_handlers[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)

    def _restore_signal_handlers(self) -> None:
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers.clear()

    # -- network ---------------------------------------------------------------------------

    def _make_network(self) -> None:
        net = self._subnet or _pick_subnet(self.token)
        hosts = list(net.hosts())
        self.subnet = str(net)
        self.addresses = tuple(str(hosts[k]) for k in range(self.hosts))
        _sh(["ip", "link", "add", self.bridge, "type", "bridge"])
        _sh(["ip", "link", "set", self.bridge, "up"])
        for k, ns in enumerate(self.namespaces):
            veth = f"{PREFIX}{self.token}v{k}"
            _sh(["ip", "netns", "add", ns])
            self._ns_ids.update(_netns_ids([ns]))
            _sh(["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns])
            _sh(["ip", "link", "set", veth, "master", self.bridge, "up"])
            _sh(["ip", "-n", ns, "addr", "add", f"{self.addresses[k]}/{net.prefixlen}", "dev", "eth0"])
            _sh(["ip", "-n", ns, "link", "set", "lo", "up"])
            _sh(["ip", "-n", ns, "link", "set", "eth0", "up"])
            self._shape(["tc"], veth)
            self._shape(["tc", "-n", ns], "eth0")

    def _shape(self, tc: list[str], dev: str) -> None:
        """htb at the NIC rate on ``dev``'s egress; a burst of 1 ms of traffic (htb's default
        burst, a few packets, holds a single stream well under 10 Gbit/s)."""
        rate_kbit = max(8, round(self.nic_gbit * 1e6))
        burst_bytes = max(1600, rate_kbit * 1000 // 8 // 1000)
        quantum = min(200_000, burst_bytes)
        _sh([*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "1"])
        _sh(
            [*tc, "class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb"]
            + ["rate", f"{rate_kbit}kbit", "ceil", f"{rate_kbit}kbit", "quantum", str(quantum)]
            + ["burst", str(burst_bytes), "cburst", str(burst_bytes)]
        )

    # -- processes inside hosts ------------------------------------------------------------

    @property
    def head_address(self) -> str:
        """``ip:port`` of the head node's GCS (what ``ray.init(address=...)`` takes)."""
        return f"{self.addresses[0]}:{self.head_port}"

    @property
    def nic_GBps(self) -> float:
        return self.nic_gbit / 8

    def env(self, host: int) -> dict[str, str]:
        """Environment of processes started inside ``host``'s namespace."""
        self._check_host(host)
        env = {k: v for k, v in os.environ.items() if k not in _RAY_ENV_DROP}
        tmp = str(self.run_dir / "tmp")
        env.update(
            RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="1",
            RAY_AUTH_MODE="token",
            RAY_AUTH_TOKEN=self._auth_token,
            RAY_USAGE_STATS_ENABLED="0",
            RAY_TMPDIR=tmp,
            TMPDIR=tmp,
            PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
            PYTHONPATH=os.pathsep.join(p for p in (str(_REPO), env.get("PYTHONPATH")) if p),
            **{NODE_IP_ENV: self.addresses[host], HOST_ENV: str(host), ADDRESSES_ENV: ",".join(self.addresses)},
        )
        if self.with_ray:
            env["RAY_ADDRESS"] = self.head_address
        return env

    def command(self, host: int, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run inside ``host``'s namespace."""
        self._check_host(host)
        return ["ip", "netns", "exec", self.namespaces[host], *argv]

    def popen(self, host: int, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` inside ``host`` (killed at teardown at the latest)."""
        self._check_up()
        kwargs.setdefault("env", self.env(host))
        kwargs.setdefault("cwd", str(_REPO))
        proc = subprocess.Popen(self.command(host, argv), **kwargs)
        self._procs.append(proc)
        return proc

    def exec_in(
        self, host: int, argv: Sequence[str], *, timeout_s: float = 60.0, input: str | None = None
    ) -> subprocess.CompletedProcess:
        """Run ``argv`` inside ``host`` to completion; stdout and stderr captured as text."""
        self._check_up()
        return subprocess.run(
            self.command(host, argv),
            env=self.env(host),
            cwd=str(_REPO),
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )

    def run(
        self, argv: Sequence[str], *, timeout_s: float = 300.0, host: int = 0, **kwargs
    ) -> subprocess.CompletedProcess:
        """Run a driver ``argv`` inside the head namespace, or inside ``host``'s (a driver that is not
        on the head node); output captured unless ``capture_output`` is overridden."""
        self._check_up()
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        kwargs.setdefault("env", self.env(host))
        kwargs.setdefault("cwd", str(_REPO))
        return subprocess.run(self.command(host, argv), timeout=timeout_s, **kwargs)

    def python(self, code: str, *, timeout_s: float = 300.0) -> subprocess.CompletedProcess:
        """Run Python ``code`` as a driver inside the head namespace."""
        return self.run([sys.executable, "-c", code], timeout_s=timeout_s)

    def scenario(
        self, script: str | os.PathLike, name: str, *, timeout_s: float = 300.0, host: int = 0, **kwargs
    ) -> Any:
        """Run scenario ``name`` of ``script`` as a driver in the head namespace (or ``host``'s);
        its result."""
        done = self.run([sys.executable, str(script), name, json.dumps(kwargs)], timeout_s=timeout_s, host=host)
        results = [
            ln[len(SCENARIO_RESULT_MARK) :] for ln in done.stdout.splitlines() if ln.startswith(SCENARIO_RESULT_MARK)
        ]
        if done.returncode != 0 or len(results) != 1:
            raise EmulationError(
                f"scenario {name} of {script} exited {done.returncode} with {len(results)} results:\n"
                f"{done.stderr.strip()[-4000:]}"
            )
        return json.loads(results[0])

    def listening_sockets(self, host: int, *, udp: bool = False) -> tuple[Listener, ...]:
        """Every listening TCP socket (bound UDP socket with ``udp``) inside ``host`` with its
        process: (address, port, pid, command)."""
        self._check_up()
        return namespace_listeners(self.namespaces[host], udp=udp)

    def pids(self, host: int | None = None) -> tuple[int, ...]:
        """PIDs of the processes inside ``host`` (every host when None)."""
        ids = self._ns_ids if host is None else _netns_ids([self.namespaces[host]])
        return tuple(sorted(_pids_in(ids)))

    # -- raw TCP measurements --------------------------------------------------------------

    def round_trip_us(self, src: int, dst: int, *, rounds: int = 200, timeout_s: float = 30.0) -> float:
        """Median TCP round trip (1 byte each way, TCP_NODELAY) from ``src`` to ``dst``, in us."""
        if src == dst:
            raise ValueError("round_trip_us needs two different hosts")
        server = self._probe(dst, ["serve", self.addresses[dst], "echo", "1"])
        try:
            port = read_line(server, timeout_s, "round-trip server")
            client = self._probe(src, ["ping", self.addresses[dst], port, str(rounds)])
            samples = json.loads(read_line(client, timeout_s, "round-trip client"))
            client.wait(timeout=timeout_s)
            server.wait(timeout=timeout_s)
        finally:
            server.kill()
        return statistics.median(samples)

    def stream_GBps(
        self, srcs: int | Sequence[int], dst: int, *, seconds: float = 1.0, timeout_s: float = 30.0
    ) -> float:
        """TCP throughput into ``dst`` from one stream per host in ``srcs`` sending at once for
        ``seconds``: bytes received over the time from first to last byte, in GB/s (1e9 B/s)."""
        srcs = [srcs] if isinstance(srcs, int) else list(srcs)
        if not srcs or dst in srcs:
            raise ValueError(f"stream_GBps needs senders other than the receiver {dst}, got {srcs}")
        server = self._probe(dst, ["serve", self.addresses[dst], "sink", str(len(srcs))])
        try:
            port = read_line(server, timeout_s, "stream server")
            clients = [self._probe(s, ["send", self.addresses[dst], port, str(seconds)]) for s in srcs]
            for c in clients:
                c.wait(timeout=timeout_s)
            got = json.loads(read_line(server, timeout_s, "stream server"))
        finally:
            server.kill()
        return got["bytes"] / got["seconds"] / 1e9

    def actor_call_us(self, host: int, *, calls: int = 200, timeout_s: float = 180.0) -> float:
        """Median round trip of an empty Ray actor call from a driver in the head namespace to an
        actor pinned (node affinity) to ``host``'s node, in us (20 warm-up calls first)."""
        self._check_host(host)
        if not self.with_ray:
            raise EmulationError("actor_call_us needs Ray: build the cluster with ray=True")
        done = self.run([sys.executable, "-c", _ACTOR_CALL, self.node_ids[host], str(calls)], timeout_s=timeout_s)
        if done.returncode != 0:
            raise EmulationError(f"actor call probe failed ({done.returncode}): {done.stderr.strip()[-3000:]}")
        return statistics.median(json.loads(done.stdout.strip().splitlines()[-1]))

    def _probe(self, host: int, args: list[str]) -> subprocess.Popen:
        return self.popen(
            host, [sys.executable, "-c", _PROBE, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )

    # -- Ray -------------------------------------------------------------------------------

    def _ray_start_argv(self, host: int) -> list[str]:
        argv = [str(_ray_cli()), "start", f"--node-ip-address={self.addresses[host]}"]
        if host == 0:
            argv += ["--head", f"--port={self.head_port}", "--include-dashboard=false", "--disable-usage-stats"]
        else:
            argv += [f"--address={self.head_address}"]
        argv += [
            f"--temp-dir={self.run_dir / f'h{host}'}",
            f"--num-cpus={self.cpus_per_host}",
            f"--object-store-memory={self.object_store_mib * 2**20}",
        ]
        if self.host_resources:
            argv.append(f"--resources={json.dumps({f'host_{host}': 1})}")
        return argv

    def _start_ray(self) -> None:
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.startup_timeout_s
        self._ray_start(0, deadline)
        self._progress(f"head {self.token}")
        starters = [(k, self._ray_start_popen(k)) for k in range(1, self.hosts)]
        waiter = self.popen(
            0,
            [sys.executable, "-c", _WAIT_NODES, ",".join(self.addresses), str(self.startup_timeout_s)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for k, proc in starters:
            self._ray_start_wait(k, proc, deadline)
        try:
            out, err = waiter.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            waiter.kill()
            raise EmulationError(f"Ray nodes not all alive within {self.startup_timeout_s} s") from None
        if waiter.returncode != 0:
            raise EmulationError(f"Ray nodes not all alive: {out.strip()} {err.strip()[-2000:]}")
        alive = json.loads(out.strip().splitlines()[-1])
        self.node_ids = tuple(alive[a] for a in self.addresses)
        self.timings["ray_s"] = time.perf_counter() - t0

    def _ray_start_popen(self, host: int) -> subprocess.Popen:
        log = open(self.run_dir / f"ray-start-h{host}.log", "w")  # noqa: SIM115
        with log:
            return self.popen(host, self._ray_start_argv(host), stdout=log, stderr=subprocess.STDOUT)

    def _ray_start_wait(self, host: int, proc: subprocess.Popen, deadline: float) -> None:
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise EmulationError(
                f"`ray start` in host {host} did not finish within {self.startup_timeout_s} s"
            ) from None
        if proc.returncode != 0:
            log = (self.run_dir / f"ray-start-h{host}.log").read_text(errors="replace")
            raise EmulationError(f"`ray start` in host {host} failed ({proc.returncode}):\n{log[-3000:]}")

    def _ray_start(self, host: int, deadline: float) -> None:
        self._ray_start_wait(host, self._ray_start_popen(host), deadline)

    def _check_host(self, host: int) -> None:
        if not isinstance(host, int) or not 0 <= host < self.hosts:
            raise ValueError(f"host must be an int in 0..{self.hosts - 1}, got {host!r}")

    def _check_up(self) -> None:
        if self._state != "up":
            raise EmulationError(f"cluster {self.token} is not up (state {self._state}); use it inside `with`")

    def __repr__(self) -> str:
        return (
            f"EmulatedCluster(token={self.token!r}, hosts={self.hosts}, nic_gbit={self.nic_gbit}, "
            f"addresses={self.addresses}, state={self._state!r})"
        )


_WAIT_NODES = r"""
import json, sys, time
from bench.emulate import connect
ray = connect()
want, timeout_s = sys.argv[1].split(","), float(sys.argv[2])
deadline = time.monotonic() + timeout_s
while True:
    alive = {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n["Alive"]}
    if set(want) <= set(alive) or time.monotonic() > deadline:
        break
    time.sleep(0.2)
print(json.dumps(alive), flush=True)
sys.exit(0 if set(want) <= set(alive) else 3)
"""


_ACTOR_CALL = r"""
import json, sys, time
from bench.emulate import connect
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
ray = connect()
node, calls = sys.argv[1], int(sys.argv[2])

@ray.remote(num_cpus=0)
class Echo:
    def ping(self):
        return None

    def node(self):
        return ray.get_runtime_context().get_node_id()

actor = Echo.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
assert ray.get(actor.node.remote(), timeout=120) == node
for _ in range(20):
    ray.get(actor.ping.remote(), timeout=60)
samples = []
for _ in range(calls):
    t0 = time.perf_counter()
    ray.get(actor.ping.remote(), timeout=60)
    samples.append((time.perf_counter() - t0) * 1e6)
print(json.dumps(samples), flush=True)
"""


def _raise_for_signal(sig: int) -> None:
    if sig == signal.SIGINT:
        raise KeyboardInterrupt
    raise SystemExit(128 + sig)


# ---------------------------------------------------------------------------------------------
# Driver side (inside the head namespace)


def connect(**init_kwargs):
    """``ray.init`` for a driver started by ``EmulatedCluster.run``: joins the emulated cluster
    from its host's address. Returns the ``ray`` module."""
    if NODE_IP_ENV not in os.environ or "RAY_ADDRESS" not in os.environ:
        raise EmulationError(
            f"not inside an emulated host ({NODE_IP_ENV} / RAY_ADDRESS unset); start it with cluster.run"
        )
    import ray

    init_kwargs.setdefault("log_to_driver", False)
    ray.init(address=os.environ["RAY_ADDRESS"], _node_ip_address=os.environ[NODE_IP_ENV], **init_kwargs)
    return ray


def host_addresses() -> tuple[str, ...]:
    """Addresses of the emulated hosts in host order, as seen by a driver inside one."""
    return tuple(os.environ[ADDRESSES_ENV].split(","))


def scenario_main(scenarios: dict[str, Callable[..., Any]], argv: Sequence[str] | None = None) -> int:
    """Entry point of a scenario script: ``script NAME ['<kwargs json>']`` joins the cluster, runs
    ``scenarios[NAME](**kwargs)`` and prints its JSON result after ``SCENARIO_RESULT_MARK``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in scenarios:
        print(f"usage: NAME ['<kwargs json>'] with NAME one of {sorted(scenarios)}", file=sys.stderr)
        return 2
    kwargs = json.loads(argv[1]) if len(argv) > 1 else {}
    ray = connect()
    try:
        result = scenarios[argv[0]](**kwargs)
    finally:
        ray.shutdown()
    print(SCENARIO_RESULT_MARK + json.dumps(result), flush=True)
    return 0


# ---------------------------------------------------------------------------------------------
# CLI


def _cluster_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--nic-gbit", type=float, default=1.0, help="NIC rate per host, Gbit/s, full duplex")
    p.add_argument("--cpus-per-host", type=int, default=2)
    p.add_argument("--no-ray", action="store_true", help="network only, no Ray nodes")
    p.add_argument("--object-store-mib", type=int, default=512)


def _make(args) -> EmulatedCluster:
    return EmulatedCluster(
        args.hosts,
        progress=lambda msg: print(msg, flush=True),
        nic_gbit=args.nic_gbit,
        cpus_per_host=args.cpus_per_host,
        ray=not args.no_ray,
        object_store_mib=args.object_store_mib,
    )


def _describe(c: EmulatedCluster) -> dict:
    return {
        "token": c.token,
        "namespaces": c.namespaces,
        "addresses": c.addresses,
        "head_address": c.head_address if c.with_ray else None,
        "node_ids": c.node_ids,
        "nic_gbit": c.nic_gbit,
        "timings": {k: round(v, 3) for k, v in c.timings.items()},
    }


def _measure(c: EmulatedCluster, rounds: int) -> dict:
    rtt = [c.round_trip_us(0, 1) for _ in range(rounds)]
    one = [c.stream_GBps(1, 0) for _ in range(rounds)]
    two = [c.stream_GBps([1, 2], 0) for _ in range(rounds)] if c.hosts >= 3 else []
    line = c.nic_GBps
    ray_call = {"actor_call_us": [round(c.actor_call_us(1), 1) for _ in range(rounds)]} if c.with_ray else {}
    return {
        **ray_call,
        "round_trip_us": [round(x, 1) for x in rtt],
        "one_stream_GBps": [round(x, 4) for x in one],
        "one_stream_of_line": [round(x / line, 3) for x in one],
        "two_senders_GBps": [round(x, 4) for x in two],
        "two_senders_of_line": [round(x / line, 3) for x in two],
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.emulate", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_up = sub.add_parser("up", help="bring a cluster up, print 'up <token>' and its JSON, hold until Ctrl-C")
    _cluster_args(p_up)
    p_run = sub.add_parser("run", help="bring a cluster up, run COMMAND in the head namespace, tear down")
    _cluster_args(p_run)
    p_run.add_argument("--timeout-s", type=float, default=3600.0)
    p_run.add_argument("argv", nargs=argparse.REMAINDER, help="-- COMMAND ...")
    p_measure = sub.add_parser("measure", help="bring up, time bring-up, measure TCP round trip and stream rates")
    _cluster_args(p_measure)
    p_measure.add_argument("--rounds", type=int, default=3)
    sub.add_parser("check", help="list leftovers of emulation runs (exit 1 when any)")
    p_clean = sub.add_parser("cleanup", help="remove leftovers of runs whose owner died")
    p_clean.add_argument("--all", action="store_true", help="also runs whose owner still lives")
    p_down = sub.add_parser("down", help="remove the runs of the given tokens, owner alive or not")
    p_down.add_argument("tokens", nargs="+")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))

    if args.cmd in ("check", "cleanup", "down"):
        if args.cmd == "check":
            runs = leftovers()
        elif args.cmd == "cleanup":
            runs = cleanup(stale_only=not args.all)
        else:
            runs = tuple(r for t in args.tokens for r in cleanup(t, stale_only=False))
        for r in runs:
            print(json.dumps({**dataclasses.asdict(r), "stale": r.stale}))
        return int(args.cmd == "check" and bool(runs))

    ok, why = available()
    if not ok:
        print(f"cannot emulate hosts here: {why}", file=sys.stderr)
        return 2
    try:
        with _make(args) as c:
            if args.cmd == "up":
                print(f"up {c.token}", flush=True)
                print(json.dumps(_describe(c)), flush=True)
                while True:
                    signal.pause()
            if args.cmd == "measure":
                print(json.dumps({**_describe(c), **_measure(c, args.rounds)}), flush=True)
            if args.cmd == "run":
                cmd = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
                if not cmd:
                    parser.error("run needs a command after --")
                return c.run(cmd, timeout_s=args.timeout_s, capture_output=False).returncode
        if args.cmd == "measure":
            print(json.dumps({"down_s": round(c.timings["down_s"], 3)}), flush=True)
        return 0
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
