"""Seeded chaos between emulated hosts: the driver side of the multihost chaos tier.

``python net_harness.py chaos '<kwargs json>'`` runs inside the head namespace of an emulated
cluster (``EmulatedCluster.scenario``; ``test_netchaos.py`` starts it). It keeps two device
actors on each emulated host (one owning mesh per host) and runs seeded steps: a reshard of one
random tensor, or a whole-model sync (``reshard(tree, ..., out=tree)``), between meshes over one
or two hosts each, through shared-memory pulls where possible or through gloo only. Every other
step carries a fault, cycling through every (fault, phase) combination in a seeded order:

- ``LINK_CUT``: a host's veth set down at the bridge's end (its NIC loses carrier), up again
  after ``CUT_S``;
- ``SLOW_LINK``: the host's htb rate, both directions, dropped ``SLOW_FACTOR`` times until the
  step is over: it must complete, bit-exact, within its deadline;
- ``PARTITION``: ``ip route add blackhole <peer>/32`` in one host's namespace (it is cut from
  that peer only), removed after ``CUT_S``;
- ``DRIVER_CUT``: the driver's own host (the head: GCS, the gloo store) cut for ``CUT_S``;
- ``NODE_LOSS``: every process of one host other than the head SIGKILLed (raylet, workers, the
  devices); the host stays gone for the rest of the run (the test builds a fresh cluster for the
  next segment of a long run);
- ``LONG_CUT``: a host other than the head cut until Ray declares its node dead (its default
  health checks: tens of seconds), then its link up again: the host comes back to a cluster that
  has given it up (its raylet ends itself and its workers); gone for the rest of the run too.

Phases: ``BEFORE`` (in place when the step is submitted) and ``DURING`` (a device of the victim
host tells the driver, through a file, that it is at its first op of the run and holds there; the
fault lands, then it goes on). The durations of the faults are chosen; nothing waits on
wall-clock time to synchronise: the driver waits for events (the hook's file, the fault's
restoration, the call's return).

Invariants after every step (each breach is a violation in the result):
1. the call returned a bit-exact result, or raised a ``ReshardError`` subclass naming a device by its number,
   within ``timeout_s`` + 2 s; steps without a fault and slow-link steps succeed;
2. every live tensor on surviving hosts reads back bit-exact (sources intact);
3. after ``settle``, no device holds a shard that no live handle owns, each live shard is held by
   its handle only, and no call of this driver is running or waiting on any device;
4. the first reshard after the fault is lifted (the same step again when its hosts survived, else
   one over the survivors) succeeds; a failed first retry is recorded as an open finding (see
   RELIABILITY.md) and a second one must succeed (else a livelock, a violation);
5. a whole-model sync leaves the destination shards of every tensor, on every surviving device,
   all old or all new, never a mix (checksums before and after, per tensor and device); all old
   when it raised, all new when it returned;
6. after a node loss or a long cut, a mesh over a lost device raises ``WorkerDied``/``MeshClosed`` at once
   (within its timeout + 2 s), and the meshes over the other hosts keep working (4 and the
   following steps);
7. none of our sockets (the driver's, the device actors') listens on a wildcard address.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import numpy as np

from bench.emulate import _netns_ids, _pids_in, host_addresses, namespace_listeners, scenario_main

FAULTS = ("link cut", "slow link", "partition", "driver cut", "node loss", "long cut")
LOSSES = ("node loss", "long cut")  # the host is gone afterwards: once per run each, at a chosen step
PHASES = ("before", "during")
TIMEOUT_S = {
    "none": 30.0,
    "link cut": 2.0,
    "partition": 2.0,
    "driver cut": 2.0,
    "slow link": 60.0,
    "node loss": 20.0,
    "long cut": 2.0,
}
CUT_S = (1.0, 4.0)  # a cut lasts one of these (chosen per step): ends before or after the step's deadline
LONG_CUT_MAX_S = 120.0  # a long cut waits this long at most for Ray to declare the host's node dead
SLOW_FACTOR = 10
TARGET_S = 2.0  # a failed call raises within timeout_s + this
DEVICE_NAMED = r"devices?(\(s\))? \[?\d"  # an error names a device by its number ("device 3", "device(s) [2]")
#: What a failed ``out=`` sync says became of the outputs (``Batches.finish``), and what the
#: destination shards must then hold once the fault is lifted: all old, all new, or either.
CLAIMS = (
    ("Whether the outputs changed is not known yet", None),
    ("The outputs were left as they were", "old"),
    ("Every run succeeded, so the outputs change", "new"),
)
RETRY_TIMEOUT_S = 60.0
HOLD_S = 60.0  # how long a hooked device holds when nobody lets it go
DTYPES = ("float64", "float32", "float16", "int64", "int32", "int8", "uint8")
SLOW_MIN_BYTES = 8 << 20
WILDCARD = ("0.0.0.0", "::", "*")


# --------------------------------------------------------------------- functions run in the actors


def _arm(ctx, path: str) -> None:
    """Hold this device's next run at its first op: create ``path.arrived``, wait for ``path.go``."""

    def hook(run, op):
        ctx.before_op = None
        Path(path + ".arrived").touch()
        end = time.monotonic() + HOLD_S
        while not os.path.exists(path + ".go") and time.monotonic() < end:
            time.sleep(0.002)

    ctx.before_op = hook


def _disarm(ctx) -> None:
    ctx.before_op = None


def _pid(ctx) -> int:
    return os.getpid()


def _digests(ctx, names: list[str]) -> dict:
    """sha256 of this device's shard of each tensor (None where it holds none)."""
    out = {}
    for name in names:
        t = ctx.buffers.get(name)
        if t is None:
            out[name] = None
            continue
        a = t.contiguous().numpy()
        out[name] = hashlib.sha256(memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8))).hexdigest()
    return out


def _threads(ctx) -> dict:
    """Native threads of this process, and Python threads still releasing gloo groups."""
    return {
        "native": len(os.listdir("/proc/self/task")),
        "releasing": sum(t.name == "reshard-gloo-release" for t in threading.enumerate()),
    }


def digest(a: np.ndarray) -> str:
    return hashlib.sha256(memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8))).hexdigest()


# ------------------------------------------------------------------------------------------ faults


class Net:
    """Faults on the emulated network, applied from the driver (root, inside the head namespace):
    the namespaces by name, the root namespace's ends of the veths through ``nsenter``."""

    def __init__(self, namespaces, veths, root_pid: int, rate_kbit: int):
        self.namespaces, self.veths, self.root_pid, self.rate_kbit = namespaces, veths, root_pid, rate_kbit
        self.addresses = host_addresses()

    @staticmethod
    def _sh(argv) -> None:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise RuntimeError(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")

    def link(self, host: int, up: bool) -> None:
        """The bridge's end of the host's veth down (the host's NIC loses its carrier, as when its
        cable is pulled: its addresses and routes stay) or up again."""
        self._root(["ip", "link", "set", self.veths[host], "up" if up else "down"])

    def _root(self, argv) -> None:
        self._sh(["nsenter", "-t", str(self.root_pid), "-n", *argv])

    def route(self, host: int, peer: int, add: bool) -> None:
        self._sh(
            [
                "ip",
                "-n",
                self.namespaces[host],
                "route",
                "add" if add else "del",
                "blackhole",
                f"{self.addresses[peer]}/32",
            ]
        )

    def rate(self, host: int, kbit: int) -> None:
        burst = max(1600, kbit * 1000 // 8 // 1000)
        spec = [
            "parent",
            "1:",
            "classid",
            "1:1",
            "htb",
            "rate",
            f"{kbit}kbit",
            "ceil",
            f"{kbit}kbit",
            "quantum",
            str(min(200_000, burst)),
            "burst",
            str(burst),
            "cburst",
            str(burst),
        ]
        self._sh(["tc", "-n", self.namespaces[host], "class", "change", "dev", "eth0", *spec])
        self._root(["tc", "class", "change", "dev", self.veths[host], *spec])

    def kill_host(self, host: int) -> int:
        """SIGKILL every process inside ``host`` (through pidfds, after checking its namespace)."""
        ids = _netns_ids([self.namespaces[host]])
        killed = 0
        for _ in range(20):
            pids = _pids_in(ids)
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(OSError):
                    fd = os.pidfd_open(pid)
                    try:
                        st = os.stat(f"/proc/{pid}/ns/net")
                        if (st.st_dev, st.st_ino) in ids:
                            signal.pidfd_send_signal(fd, signal.SIGKILL)
                            killed += 1
                    finally:
                        os.close(fd)
            time.sleep(0.05)  # a dying raylet may still spawn; look again
        return killed


class Injection:
    """One fault in place: ``lifted`` is set once the network is whole again (or at once for a
    node loss and for a slow link, whose rate goes back in ``lift``)."""

    def __init__(self, net: Net, fault: str, host: int, peer: int | None, cut_s: float):
        self.net, self.fault, self.host, self.peer, self.cut_s = net, fault, host, peer, cut_s
        self.lifted = threading.Event()
        self.at: float | None = None
        self.error: str | None = None
        self.dead_after_s: float | None = None  # a long cut: when Ray declared the node dead
        self._timer: threading.Timer | None = None

    def apply(self) -> None:
        self.at = time.monotonic()
        f, net = self.fault, self.net
        if f in ("link cut", "driver cut"):
            net.link(self.host, False)
            self._later(lambda: net.link(self.host, True))
        elif f == "long cut":
            net.link(self.host, False)
            self._after_node_death(lambda: net.link(self.host, True))
        elif f == "partition":
            net.route(self.host, self.peer, True)
            self._later(lambda: net.route(self.host, self.peer, False))
        elif f == "slow link":
            net.rate(self.host, max(8, net.rate_kbit // SLOW_FACTOR))
        elif f == "node loss":
            net.kill_host(self.host)
            self.lifted.set()
        else:
            raise AssertionError(f)

    def _later(self, undo) -> None:
        def run():
            try:
                undo()
            except Exception as e:  # reported as a harness failure
                self.error = str(e)
            self.lifted.set()

        self._timer = threading.Timer(self.cut_s, run)
        self._timer.start()

    def _after_node_death(self, undo) -> None:
        """``undo`` once Ray has declared the host's node dead (``dead_after_s``: how long after
        the cut), or after ``LONG_CUT_MAX_S`` (an error: the cut was never taken for a death)."""
        import ray

        address = self.net.addresses[self.host]

        def dead() -> bool:
            return any(n["NodeManagerAddress"] == address and not n["Alive"] for n in ray.nodes())

        def run():
            try:
                while not dead():
                    if time.monotonic() - self.at > LONG_CUT_MAX_S:
                        self.error = f"Ray did not declare host {self.host} dead within {LONG_CUT_MAX_S:g} s"
                        break
                    time.sleep(0.2)
                else:
                    self.dead_after_s = round(time.monotonic() - self.at, 2)
                undo()
            except Exception as e:  # reported as a harness failure
                self.error = str(e)
            self.lifted.set()

        self.cut_s = LONG_CUT_MAX_S
        threading.Thread(target=run, daemon=True).start()

    def lift(self) -> None:
        """After the call: put the rate back; wait for a timed fault to end (an event)."""
        if self.at is None:
            self.lifted.set()
            return
        if self.fault == "slow link":
            self.net.rate(self.host, self.net.rate_kbit)
            self.lifted.set()
        if not self.lifted.wait(self.cut_s + 60):
            self.error = "the fault was not lifted"


# ------------------------------------------------------------------------------------------ the run


class NetChaos:
    def __init__(self, seed: int, net: Net, *, max_bytes: int = 2 << 20):
        import ray

        from reshard import DeviceMesh

        self.ray = ray
        self.seed, self.net, self.max_bytes = seed, net, max_bytes
        self.rng = random.Random(seed)
        self.data_rng = np.random.default_rng(seed)
        self.events = Path(tempfile.mkdtemp(prefix="netchaos-"))  # private (0700), unpredictable
        hosts = len(net.addresses)
        self.owners = [
            DeviceMesh.create((1, 2), nodes=[net.addresses[k]], backend="gloo", startup_timeout_s=300)
            for k in range(hosts)
        ]
        self.devices = {k: tuple(m.device_ids) for k, m in enumerate(self.owners)}
        self.alive_hosts = set(range(hosts))
        self.views: dict = {}
        self.retired: list = []
        self.held: list[dict] = []  # {"tensor", "expected", "hosts"}
        self.records: list[dict] = []
        self.violations: list[dict] = []
        self.listener_checks: list[dict] = []
        self.threads: dict[int, list] = {}
        self.dead_mesh_checks: list[dict] = []
        self.first_retry_failures: list[dict] = []
        self.not_known: list[dict] = []  # out= syncs whose error said the outcome was not known: what it became
        self.warm_up()

    def warm_up(self) -> None:
        """One reshard over every host on each transport before the steps: each device opens its
        connection to the driver's store (the first can take seconds on this machine), so that the
        short timeouts of the fault steps are not spent on it."""
        from reshard import Layout, Shard, distribute, reshard

        a = self.everyone()
        b = self.view(sorted(self.alive_hosts, reverse=True), flat=True)
        data = self.data_rng.standard_normal((64, 8), dtype=np.float32)
        x = distribute(data, Layout(a, (Shard(0),)), timeout_s=RETRY_TIMEOUT_S)
        for shared in (False, True):
            y = reshard(x, a, Layout(b, (Shard(1),)), timeout_s=RETRY_TIMEOUT_S, shared_memory=shared)
            y.free()
        x.free()

    # ------------------------------------------------------------------ meshes and data

    def view(self, hosts, flat: bool = False):
        from reshard import DeviceMesh

        hosts = tuple(hosts)
        devices = tuple(d for h in hosts for d in self.devices[h])
        shape = (len(devices),) if flat else (len(hosts), 2)
        key = (devices, shape)
        if key not in self.views:
            self.views[key] = DeviceMesh.from_devices(devices, shape)
        return self.views[key]

    def everyone(self):
        return self.view(sorted(self.alive_hosts), flat=True)

    def random_hosts(self, must: int | None = None) -> tuple[int, ...]:
        alive = sorted(self.alive_hosts)
        n = 1 if len(alive) < 2 or self.rng.random() < 0.5 else 2
        hosts = self.rng.sample(alive, n)
        if must is not None and must not in hosts:
            hosts[0] = must
        return tuple(sorted(set(hosts)))

    def random_layout(self, mesh, ndim: int):
        from reshard import Layout, Replicate, Shard

        return Layout(
            mesh,
            tuple(Replicate() if self.rng.random() < 0.35 else Shard(self.rng.randrange(ndim)) for _ in mesh.shape),
        )

    def random_array(self, min_bytes: int, dtype: str | None = None, max_bytes: int | None = None):
        rng = self.rng
        dtype = dtype or rng.choice(DTYPES)
        item = np.dtype(dtype).itemsize
        hi = max(max_bytes or self.max_bytes, 2 * min_bytes) // item
        lo = max(1, min_bytes // item)
        total = int(2 ** rng.uniform(np.log2(lo), np.log2(max(lo + 1, hi))))
        cols = rng.choice((1, 3, 8, 64))
        shape = (max(1, total // cols), cols) if rng.random() < 0.7 else (total,)
        n = int(np.prod(shape))
        return np.frombuffer(self.data_rng.bytes(n * item), dtype=np.uint8).view(dtype).reshape(shape).copy()

    # ------------------------------------------------------------------ schedule

    def schedule(self, steps: int, losses: dict[int, str]):
        combos = [(f, p) for f in FAULTS if f not in LOSSES for p in PHASES]
        bag: list = []
        out = []
        for i in range(steps):
            if i in losses:
                out.append((losses[i], self.rng.choice(PHASES)))
            elif i % 2 == 0:
                out.append(("none", None))
            else:
                if not bag:
                    bag = list(combos)
                    self.rng.shuffle(bag)
                out.append(bag.pop())
        return out

    def run(self, steps: int, losses: dict[int, str], progress: bool = False) -> None:
        for i, (fault, phase) in enumerate(self.schedule(steps, losses)):
            began = time.monotonic()
            try:
                self.step(i, fault, phase)
            except Exception as e:
                self.violate(i, "harness", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}")
                raise
            self.records[-1]["step_s"] = round(time.monotonic() - began, 3)
            if progress:
                r = self.records[-1]
                print(
                    f"step {i}: {r['fault']} {r['phase']} {r['kind']} host {r['host']} -> {r['outcome']} "
                    f"in {r['seconds']:.2f}s (retry {r['retry_s']}) {r['message'][:150]}",
                    file=sys.stderr,
                    flush=True,
                )
            if i % 8 == 3:
                self.check_listeners(i)

    # ------------------------------------------------------------------ one step

    def step(self, i: int, fault: str, phase: str | None) -> None:
        from reshard import distribute, reshard

        rng = self.rng
        alive = sorted(self.alive_hosts)
        victim_host = peer = None
        if fault in LOSSES:
            candidates = [h for h in alive if h != 0]
            victim_host = rng.choice(candidates) if candidates else None
        elif fault == "driver cut":
            victim_host = 0
        elif fault != "none":
            victim_host = rng.choice(alive)
        if fault != "none" and victim_host is None:
            fault, phase = "none", None
        src_hosts = self.random_hosts(victim_host if fault not in ("none", "driver cut") else None)
        dst_hosts = self.random_hosts()
        if fault == "partition":
            others = [h for h in alive if h != victim_host]
            peer = rng.choice([h for h in others if h in dst_hosts] or others)
            if peer not in dst_hosts:
                dst_hosts = tuple(sorted({*dst_hosts[:1], peer}))
        if fault not in ("none", "driver cut") and set(src_hosts) | set(dst_hosts) == {victim_host} and len(alive) > 1:
            dst_hosts = (rng.choice([h for h in alive if h != victim_host]),)
        shared = rng.random() < 0.5
        tree = rng.random() < 0.4
        src_mesh = self.view(src_hosts)
        dst_mesh = self.view(dst_hosts, flat=rng.random() < 0.3)
        timeout_s = TIMEOUT_S[fault]
        step_hosts = sorted(set(src_hosts) | set(dst_hosts))

        min_bytes = SLOW_MIN_BYTES if fault == "slow link" else 1
        if tree:
            n = rng.randint(3, 6)
            arrays = {
                f"t{k}": self.random_array(min_bytes // n, "float32", max(min_bytes // n * 2, 256 << 10))
                for k in range(n)
            }
            src_layouts = {k: self.random_layout(src_mesh, a.ndim) for k, a in arrays.items()}
            dst_layouts = {k: self.random_layout(dst_mesh, a.ndim) for k, a in arrays.items()}
            src = distribute(arrays, src_layouts, timeout_s=RETRY_TIMEOUT_S)
            old = {
                k: np.frombuffer(self.data_rng.bytes(a.nbytes), np.float32).reshape(a.shape) for k, a in arrays.items()
            }
            out = distribute(old, dst_layouts, timeout_s=RETRY_TIMEOUT_S)
            before = self.dst_digests(out)
            expected_new = self.expected_digests(arrays, dst_layouts)
            nbytes = sum(a.nbytes for a in arrays.values())
        else:
            array = self.random_array(min_bytes)
            fresh = not self.held or rng.random() < 0.5 or fault == "slow link"
            candidates = [h for h in self.held if set(h["hosts"]) == set(src_hosts)]
            if not fresh and candidates:
                held = rng.choice(candidates)
            else:
                layout = self.random_layout(src_mesh, array.ndim)
                held = {
                    "tensor": distribute(array, layout, timeout_s=RETRY_TIMEOUT_S),
                    "expected": array,
                    "hosts": src_hosts,
                }
                self.held.append(held)
            src, arrays = held["tensor"], held["expected"]
            del held, candidates  # only ``self.held`` keeps handles alive past the step (invariant 3)
            dst_layouts = self.random_layout(dst_mesh, arrays.ndim)
            nbytes = arrays.nbytes

        injection = None
        hook = None
        injector = None
        if fault != "none":
            cut_s = rng.choice(CUT_S)
            injection = Injection(self.net, fault, victim_host, peer, cut_s)
            if phase == "before":
                injection.apply()
            else:
                victim = rng.choice(
                    [
                        d
                        for h in (victim_host,)
                        for d in self.devices[h]
                        if d in (*src_mesh.device_ids, *dst_mesh.device_ids)
                    ]
                    or list((*src_mesh.device_ids, *dst_mesh.device_ids))
                )
                hook = str(self.events / f"step{i}")
                self.view_of_device(victim).call(_arm, hook, timeout_s=RETRY_TIMEOUT_S)
                done = threading.Event()
                injector = threading.Thread(target=self._inject_on_arrival, args=(injection, hook, done), daemon=True)
                injector.start()

        result = error = None
        t0 = time.monotonic()
        try:
            if tree:
                result = reshard(src, src_mesh, dst_layouts, out=out, timeout_s=timeout_s, shared_memory=shared)
            else:
                result = reshard(src, src_mesh, dst_layouts, timeout_s=timeout_s, shared_memory=shared)
        except Exception as e:
            error = e
        seconds = time.monotonic() - t0
        if injector is not None:
            done.set()
            injector.join(HOLD_S + 60)
            Path(hook + ".go").touch()
        if injection is not None:
            injection.lift()
            if injection.error:
                self.violate(i, "harness", f"{fault}: {injection.error}")
        if fault in LOSSES and injection is not None and injection.at is not None:
            self.bury(victim_host)
        if hook is not None and victim_host in self.alive_hosts:
            with contextlib.suppress(Exception):
                self.view_of_device(victim).call(_disarm, timeout_s=RETRY_TIMEOUT_S)

        landed = injection is not None and injection.at is not None
        outcome = "ok" if error is None else type(error).__name__
        message = "" if error is None else _first_line(error)
        self.check_call(i, fault, landed, result, error, arrays, seconds, timeout_s, tree)
        if tree:
            self.check_all_or_nothing(i, out, before, expected_new, error)
        if result is not None and not tree:
            result.free()
        del result, error
        retry_s = None
        dead_s = None
        if landed:
            if fault in LOSSES:
                dead_s = self.check_dead_mesh(i, victim_host)
            retry_s = self.retry(i, src, src_mesh, dst_layouts, arrays, step_hosts, tree, shared)
        if tree:
            for t in (*src.values(), *out.values()):
                with contextlib.suppress(Exception):
                    t.free()
            del out
        del src  # only ``self.held`` keeps handles alive past the step (invariant 3)
        self.check_sources(i)
        self.check_leaks(i)
        self.records.append(
            {
                "step": i,
                "fault": fault,
                "phase": phase,
                "kind": "tree" if tree else "tensor",
                "host": victim_host,
                "peer": peer,
                "landed": landed,
                "cut_s": injection.cut_s if injection else None,
                "shared_memory": shared,
                "hosts": step_hosts,
                "outcome": outcome,
                "message": message,
                "seconds": round(seconds, 4),
                "timeout_s": timeout_s,
                "retry_s": retry_s,
                "dead_mesh_s": dead_s,
                "first_retry_failed": any(f["step"] == i for f in self.first_retry_failures),
                "node_dead_after_s": injection.dead_after_s if injection else None,
                "nbytes": int(nbytes),
            }
        )

    def _inject_on_arrival(self, injection: Injection, hook: str, done: threading.Event) -> None:
        arrived = Path(hook + ".arrived")
        end = time.monotonic() + HOLD_S
        while not arrived.exists() and not done.is_set() and time.monotonic() < end:
            time.sleep(0.002)
        if arrived.exists():
            try:
                injection.apply()
            finally:
                Path(hook + ".go").touch()

    def view_of_device(self, device: int):
        from reshard import DeviceMesh

        key = ((device,), (1,))
        if key not in self.views:
            self.views[key] = DeviceMesh.from_devices([device], (1,))
        return self.views[key]

    def bury(self, host: int) -> None:
        self.alive_hosts.discard(host)
        dead = set(self.devices[host])
        for key in [k for k in self.views if dead & set(k[0])]:
            self.retired.append(self.views.pop(key))
        self.held = [h for h in self.held if host not in h["hosts"]]

    # ------------------------------------------------------------------ invariants

    def violate(self, i: int, invariant: str, detail: str) -> None:
        self.violations.append({"step": i, "invariant": invariant, "detail": detail[:4000]})

    def check_call(self, i, fault, landed, result, error, expected, seconds, timeout_s, tree) -> None:
        from reshard import ReshardError

        if error is not None:
            if not isinstance(error, ReshardError):
                self.violate(
                    i,
                    "1: ReshardError",
                    f"{fault}: {_first_line(error)}\n" + "".join(traceback.format_exception(error)[-6:]),
                )
            elif not re.search(DEVICE_NAMED, str(error)):
                self.violate(i, "1: names the device", _first_line(error))
            bound = timeout_s + TARGET_S
            if seconds > bound:
                self.violate(
                    i,
                    "1: within timeout_s + 2 s",
                    f"{fault}: raised after {seconds:.2f}s, timeout_s={timeout_s:g}: {_first_line(error)}",
                )
            if fault in ("none", "slow link"):  # a fault that never landed left a short timeout: may expire
                self.violate(i, "1: clean and slow steps succeed", f"{fault}: {_first_line(error)}")
            return
        if tree:
            return  # checked shard by shard in check_all_or_nothing
        try:
            got = result.to_numpy(timeout_s=RETRY_TIMEOUT_S)
        except Exception as e:
            self.violate(i, "1: complete result", f"reading the result failed: {_first_line(e)}")
            return
        if not _same(got, expected):
            self.violate(i, "1: bit-exact", f"{fault}: the result differs from the source")

    def dst_digests(self, out: dict) -> dict:
        """{(tensor key, device): digest} of the destination shards on surviving devices."""
        names = {k: t.name for k, t in out.items()}
        mesh = next(iter(out.values())).mesh
        alive = [d for d in mesh.device_ids if any(d in self.devices[h] for h in self.alive_hosts)]
        got = {}
        for d in alive:
            per = self.view_of_device(d).call(_digests, list(names.values()), timeout_s=RETRY_TIMEOUT_S)[0]
            for k, name in names.items():
                got[(k, d)] = per[name]
        return got

    @staticmethod
    def expected_digests(arrays: dict, layouts: dict) -> dict:
        from reshard.ir.regions import device_regions

        out = {}
        for k, a in arrays.items():
            for d, box in device_regions(layouts[k], a.shape).items():
                out[(k, d)] = digest(a[tuple(slice(lo, hi) for lo, hi in box)])
        return out

    def check_all_or_nothing(self, i: int, out: dict, before: dict, new: dict, error) -> None:
        """Invariant 5."""
        try:
            after = self.dst_digests(out)
        except Exception as e:
            self.violate(i, "5: all or nothing", f"reading the destination shards failed: {_first_line(e)}")
            return
        states = {}
        for key, got in after.items():
            if before.get(key) == new[key]:
                continue  # an empty shard (uneven split), or the same bytes: it cannot tell
            states[key] = "old" if got == before.get(key) else "new" if got == new[key] else "other"
        seen = set(states.values())
        if "other" in seen or len(seen) > 1:
            self.violate(i, "5: all or nothing", f"destination shards {sorted(states.items())}")
            return
        if error is None:
            claim, want = "returned", "new"
        else:
            claim, want = next(((c, w) for c, w in CLAIMS if c in str(error)), ("raised", None))
        if want is not None and seen and seen != {want}:
            self.violate(i, "5: what the caller was told", f"{claim}, but every destination shard is {seen.pop()}")
        if claim == CLAIMS[0][0]:
            self.not_known.append({"step": i, "became": seen.pop() if seen else "-"})

    def check_dead_mesh(self, i: int, host: int):
        """Invariant 6: a mesh over the lost host raises WorkerDied/MeshClosed at once."""
        from reshard import MeshClosed, WorkerDied

        mesh = self.owners[host]
        t0 = time.monotonic()
        try:
            mesh.stats(timeout_s=5.0)
            err = None
        except Exception as e:
            err = e
        s = time.monotonic() - t0
        self.dead_mesh_checks.append({"step": i, "seconds": round(s, 4), "outcome": type(err).__name__})
        if not isinstance(err, WorkerDied | MeshClosed):
            self.violate(i, "6: lost meshes raise WorkerDied", f"stats() of {mesh!r}: {err!r}")
        elif s > 5.0 + TARGET_S:
            self.violate(i, "6: lost meshes raise at once", f"after {s:.2f}s")
        return round(s, 4)

    def retry(self, i, src, src_mesh, dst_layouts, arrays, step_hosts, tree, shared):
        """Invariant 4: the first reshard after the fault is lifted succeeds. A failed first retry
        is recorded (``first_retry_failures``, reported on every run; none since aborts name their
        generation, see RELIABILITY.md) and a second one made; that one failing too is a violation
        (a livelock)."""
        seconds, error = self._retry_once(i, src, src_mesh, dst_layouts, arrays, step_hosts, tree, shared)
        if error is None:
            return seconds
        self.first_retry_failures.append({"step": i, "error": error})
        again, error = self._retry_once(i, src, src_mesh, dst_layouts, arrays, step_hosts, tree, shared)
        if error is not None:
            self.violate(
                i,
                "4: the retries succeed (livelock)",
                f"first: {self.first_retry_failures[-1]['error']}; second: {error}",
            )
        return None

    def _retry_once(self, i, src, src_mesh, dst_layouts, arrays, step_hosts, tree, shared):
        from reshard import Layout, Shard, distribute, reshard

        t0 = time.monotonic()
        made = []
        try:
            if all(h in self.alive_hosts for h in step_hosts):
                y = reshard(src, src_mesh, dst_layouts, timeout_s=RETRY_TIMEOUT_S, shared_memory=shared)
                made += list(y.values()) if tree else [y]
                pairs = [(y[k], arrays[k]) for k in arrays] if tree else [(y, arrays)]
            else:
                survivors = [h for h in step_hosts if h in self.alive_hosts] or sorted(self.alive_hosts)
                a, b = self.view(survivors), self.view(survivors[::-1], flat=True)
                data = self.data_rng.standard_normal((len(survivors) * 8, 5), dtype=np.float32)
                x = distribute(data, Layout(a, (Shard(0), Shard(1))), timeout_s=RETRY_TIMEOUT_S)
                made.append(x)
                y = reshard(x, a, Layout(b, (Shard(1),)), timeout_s=RETRY_TIMEOUT_S, shared_memory=shared)
                made.append(y)
                pairs = [(y, data)]
            seconds = time.monotonic() - t0
            for t, want in pairs:
                if not _same(t.to_numpy(timeout_s=RETRY_TIMEOUT_S), want):
                    self.violate(i, "4: retries are bit-exact", "the retry's result differs from its source")
            return round(seconds, 4), None
        except Exception as e:
            return None, _first_line(e)
        finally:
            for t in made:
                with contextlib.suppress(Exception):
                    t.free()

    def check_sources(self, i: int) -> None:
        """Invariant 2 (single tensors kept across steps)."""
        keep = []
        for h in self.held:
            try:
                got = h["tensor"].to_numpy(timeout_s=RETRY_TIMEOUT_S)
            except Exception as e:
                self.violate(i, "2: sources intact", f"{h['tensor']!r}: {_first_line(e)}")
                continue
            if not _same(got, h["expected"]):
                self.violate(i, "2: sources intact", f"{h['tensor']!r} reads back different bits")
            keep.append(h)
        while len(keep) > 3:
            keep.pop(0)["tensor"].free()
        self.held = keep

    def check_leaks(self, i: int) -> None:
        """Invariant 3."""
        from reshard.runtime import settle

        gc.collect()
        everyone = self.everyone()
        try:
            settle(everyone, timeout_s=RETRY_TIMEOUT_S)
            stats = everyone.stats(timeout_s=RETRY_TIMEOUT_S)
            threads = everyone.call(_threads, timeout_s=RETRY_TIMEOUT_S)
        except Exception as e:
            self.violate(i, "3: nothing left behind", f"settle/stats failed: {_first_line(e)}")
            return
        expected = {d: set() for d in everyone.device_ids}
        for h in self.held:
            for d in h["tensor"].mesh.device_ids:
                expected[d].add(h["tensor"].name)
        for d, s, th in zip(everyone.device_ids, stats, threads, strict=True):
            have = set(s["buffers"])
            if have - expected[d]:
                self.violate(i, "3: nothing left behind", f"device {d} holds {sorted(have - expected[d])} unowned")
            if expected[d] - have:
                self.violate(i, "2: sources intact", f"device {d} lost the shards of {sorted(expected[d] - have)}")
            for name, holders in s["holders"].items():
                if name in expected[d] and holders != [name]:
                    self.violate(i, "3: nothing left behind", f"device {d}: {name} is held by {holders}")
            busy = {k: v for k, v in s["calls"]["running"].items()}
            if busy or s["calls"]["waiting"]:
                self.violate(
                    i,
                    "3: nothing left behind",
                    f"device {d}: calls running {busy} waiting {s['calls']['waiting']} after settle",
                )
            self.threads.setdefault(d, []).append((i, th["native"], th["releasing"]))

    def check_listeners(self, i: int) -> None:
        """Invariant 7: our sockets listen on the node's address only. Two views: each process's
        own TCP listeners (``/proc``, Ray's core-worker server told apart by its port), and ``ss``
        in every live host's namespace (TCP and UDP, every process: Ray's daemons are recorded
        for the report; a wildcard socket of the driver or a device actor is a violation unless it
        is Ray's core-worker port)."""
        from bench.sockets import listeners

        everyone = self.everyone()
        found = {"driver": listeners()}
        for d, got in zip(everyone.device_ids, everyone.call(listeners, timeout_s=RETRY_TIMEOUT_S), strict=True):
            found[f"device {d}"] = got
        ray_ports = {got["ray_core_worker_port"] for got in found.values()}
        ours = {
            who: [tuple(x) for x in got["listening"] if x[2] != got["ray_core_worker_port"]]
            for who, got in found.items()
        }
        wild = {who: [x for x in socks if x[1] in WILDCARD] for who, socks in ours.items()}
        wild = {k: v for k, v in wild.items() if v}
        pids = {
            os.getpid(): "driver",
            **dict(zip(everyone.call(_pid), (f"device {d}" for d in everyone.device_ids), strict=True)),
        }
        seen = []
        for host in sorted(self.alive_hosts):
            for udp in (False, True):
                for lst in namespace_listeners(self.net.namespaces[host], udp=udp):
                    who = pids.get(lst.pid, lst.command)
                    seen.append([host, "udp" if udp else "tcp", lst.address, lst.port, who, lst.wildcard])
                    if lst.wildcard and lst.pid in pids and lst.port not in ray_ports:
                        wild.setdefault(who, []).append((lst.address, lst.port, "udp" if udp else "tcp"))
        self.listener_checks.append({"step": i, "ours": {k: sorted(v) for k, v in ours.items()}, "ss": seen})
        if wild:
            self.violate(i, "7: no wildcard listener", f"{wild}")

    def final_checks(self) -> None:
        """Threads still releasing gloo groups once everything settled (a release stuck in gloo)."""
        i = len(self.records)
        everyone = self.everyone()
        from reshard.runtime import settle

        settle(everyone, timeout_s=RETRY_TIMEOUT_S)
        for d, th in zip(everyone.device_ids, everyone.call(_threads, timeout_s=RETRY_TIMEOUT_S), strict=True):
            self.threads.setdefault(d, []).append((i, th["native"], th["releasing"]))

    def close(self) -> None:
        for h in self.held:
            with contextlib.suppress(Exception):
                h["tensor"].free()
        for v in [*self.views.values(), *self.retired]:
            with contextlib.suppress(Exception):
                v.shutdown()
        for m in self.owners:
            with contextlib.suppress(Exception):
                m.shutdown()
        shutil.rmtree(self.events, ignore_errors=True)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:600]


def _same(got, want) -> bool:
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    return np.array_equal(np.ascontiguousarray(got).view(np.uint8), np.ascontiguousarray(want).view(np.uint8))


def chaos(
    steps: int,
    seed: int,
    namespaces: list,
    veths: list,
    root_pid: int,
    rate_kbit: int,
    losses: dict | None = None,
    progress: bool = False,
) -> dict:
    from ray import cloudpickle

    import tests.multihost.runtime_scenarios as rs

    cloudpickle.register_pickle_by_value(rs)
    net = Net(namespaces, veths, root_pid, rate_kbit)
    t0 = time.monotonic()
    run = NetChaos(seed, net)
    started_s = time.monotonic() - t0
    try:
        run.run(steps, {int(i): f for i, f in (losses or {}).items()}, progress)
        run.final_checks()
    except Exception:
        pass  # recorded as a violation
    finally:
        run.close()
    return {
        "seed": seed,
        "devices_started_s": round(started_s, 2),
        "records": run.records,
        "violations": run.violations,
        "listener_checks": run.listener_checks,
        "threads": {str(d): v for d, v in run.threads.items()},
        "dead_mesh_checks": run.dead_mesh_checks,
        "first_retry_failures": run.first_retry_failures,
        "not_known": run.not_known,
        "alive_hosts": sorted(run.alive_hosts),
    }


SCENARIOS = {"chaos": chaos}

if __name__ == "__main__":
    sys.exit(scenario_main(SCENARIOS))
