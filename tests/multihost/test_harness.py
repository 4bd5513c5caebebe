"""The harness leaves nothing behind: after an exception, SIGINT or SIGTERM in the process that
owns a cluster, and, through ``cleanup``, after that process was killed outright. These tests run
their own small clusters (the tier's shared one is not up yet: this module sorts first)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from bench import emulate

pytestmark = pytest.mark.multihost
REPO = emulate._REPO


@pytest.fixture(autouse=True)
def _need_namespaces():
    ok, why = emulate.available()
    if not ok:
        pytest.skip(f"multihost: {why}")


@pytest.fixture
def up():
    """``up(*ARGS, until="up")``: ``python -m bench.emulate up ARGS`` in a subprocess, returned with
    its run token once it prints ``<until> <token>`` (progress: "network", "head", then "up").
    Whatever a failing test leaves is killed and removed afterwards."""
    started: list[tuple[subprocess.Popen, list[str]]] = []

    def start(*args: str, until: str = "up") -> tuple[subprocess.Popen, str]:
        # a test run started in the background ignores SIGINT, and a child inherits an ignored
        # signal: let it be born with the default (no preexec_fn: this process has threads)
        ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "bench.emulate", "up", *args],
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        finally:
            if ignored:
                signal.signal(signal.SIGINT, signal.SIG_IGN)
        tokens: list[str] = []
        started.append((proc, tokens))
        while True:
            word, token = emulate.read_line(proc, 180, f"`up {' '.join(args)}`").split()[:2]
            tokens.append(token)
            if word == until:
                return proc, token

    yield start
    for proc, tokens in started:
        proc.kill()
        _finish(proc, 30)
        for token in set(tokens):
            emulate.cleanup(token)


def _finish(proc: subprocess.Popen, timeout_s: float) -> str:
    """Wait for ``proc`` (its stdout belongs to ``read_line``'s reader); its stderr."""
    proc.wait(timeout=timeout_s)
    return proc.stderr.read()


def _netns_ids(token: str) -> dict:
    """Identities of the run's namespaces: processes still in them are found even once unnamed."""
    (run,) = emulate.leftovers(token)
    return emulate._netns_ids(run.namespaces)


def _process_gone(pid: int, start: str | None) -> bool:
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return True
    fields = stat.rsplit(")", 1)[1].split()
    return fields[19] != start or fields[0] in "ZX"


def _in_namespace(ns: str) -> subprocess.Popen:
    """A process inside namespace ``ns``, returned once it runs there."""
    proc = subprocess.Popen(
        ["ip", "netns", "exec", ns, "sh", "-c", "echo in; exec sleep 600"], stdout=subprocess.PIPE, text=True
    )
    assert emulate.read_line(proc, 30, "sleeper") == "in"
    return proc


def test_exception_inside_with_tears_everything_down():
    with pytest.raises(RuntimeError, match="boom"):
        with emulate.EmulatedCluster(hosts=2, ray=False) as c:
            sleeper = c.popen(1, ["sh", "-c", "echo in; exec sleep 600"], stdout=subprocess.PIPE, text=True)
            assert emulate.read_line(sleeper, 30, "sleeper") == "in"
            (run,) = emulate.leftovers(c.token)
            assert len(run.namespaces) == 2 and sleeper.pid in run.pids and not run.stale
            assert set(run.links) == {c.bridge, f"mr{c.token}v0", f"mr{c.token}v1"}
            raise RuntimeError("boom")
    assert emulate.leftovers(c.token) == ()
    assert c.pids() == ()
    assert sleeper.returncode is not None
    assert not c.run_dir.exists()


def test_sigint_tears_down_a_running_ray_cluster(up):
    proc, token = up("--hosts", "2", "--cpus-per-host", "1")
    (run,) = emulate.leftovers(token)
    assert not run.stale and run.owner_pid == proc.pid
    assert len(run.namespaces) == 2 and len(run.pids) >= 4, run
    ns_ids = _netns_ids(token)
    starts = {pid: emulate._start_time(pid) for pid in run.pids}
    proc.send_signal(signal.SIGINT)
    err = _finish(proc, 120)
    assert proc.returncode == 130, err[-3000:]
    assert emulate.leftovers(token) == ()
    assert emulate._pids_in(ns_ids) == {}
    assert [pid for pid, start in starts.items() if not _process_gone(pid, start)] == []


def test_sigint_during_ray_start_tears_down(up):
    proc, token = up("--hosts", "3", "--cpus-per-host", "1", until="head")
    ns_ids = _netns_ids(token)
    assert len(ns_ids) == 3
    proc.send_signal(signal.SIGINT)
    err = _finish(proc, 120)
    assert proc.returncode == 130, err[-3000:]
    assert emulate.leftovers(token) == ()
    assert emulate._pids_in(ns_ids) == {}


def test_sigterm_tears_down(up):
    proc, token = up("--hosts", "2", "--no-ray")
    sleeper = _in_namespace(f"mr{token}h1")
    proc.send_signal(signal.SIGTERM)
    err = _finish(proc, 60)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert emulate.leftovers(token) == ()
    assert sleeper.wait(timeout=30) == -signal.SIGTERM


def test_cleanup_removes_what_a_killed_run_left_and_spares_live_runs(up):
    proc, token = up("--hosts", "2", "--no-ray")
    sleeper = _in_namespace(f"mr{token}h0")
    assert emulate.cleanup(token) == (), "cleanup removed a run whose owner is alive"
    (live,) = emulate.leftovers(token)
    assert not live.stale and sleeper.pid in live.pids
    proc.kill()
    _finish(proc, 30)
    (stale,) = emulate.leftovers(token)
    assert stale.stale and stale.namespaces == (f"mr{token}h0", f"mr{token}h1") and sleeper.pid in stale.pids
    assert stale.run_dir is not None and os.path.isdir(stale.run_dir)
    (removed,) = emulate.cleanup(token)
    assert removed.token == token
    assert emulate.leftovers(token) == ()
    assert sleeper.wait(timeout=30) == -signal.SIGTERM
