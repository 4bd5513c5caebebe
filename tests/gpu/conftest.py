"""Skip (or fail) logic and shared fixtures of the GPU tests.

Every test here carries the ``gpu`` marker; ``@pytest.mark.gpu(n)`` says it needs ``n`` visible
GPUs (default 1; ``gpu(0)`` needs cupy with NCCL but no GPU), ``gpu(n, torch_cuda=True)`` that it
also needs torch CUDA tensors. Without cupy / NCCL or with fewer GPUs a test is SKIPPED, unless
whoever runs the GPU tier promised GPUs with ``RESHARD_REQUIRE_GPUS=N``: then a test needing at
most N GPUs FAILS when cupy/NCCL is missing or fewer than its GPUs are visible, and a GPU pool that
cannot get the GPUs it was promised fails too.

The CPU stand-in (tests/gpu/standin, activated by tests/conftest.py where no cupy exists) runs the
tests that need cupy only: tests needing torch CUDA tensors skip, saying so. Under it the Ray
cluster has no GPUs and pools reserve none; every rank process has its own stand-in GPU, so a test
of ``n`` ranks on ``n`` GPUs runs as ``n`` processes (up to ``STANDIN_GPUS``), and ranks meant to
share one GPU are distinct stand-in GPUs (sharing a GPU is not modelled).

GPUs come back to Ray asynchronously after ``ray.kill``: pools never read
``available_resources()`` once; ``wait_for_free_gpus`` waits (with a deadline) until the GPUs a
pool needs are free, and fails if they never come back.
"""

from __future__ import annotations

import os
import time

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "token")  # Ray's default for a new local cluster, without its warning

REQUIRED_GPUS = int(os.environ.get("RESHARD_REQUIRE_GPUS", "0") or 0)
GPU_RETURN_TIMEOUT_S = 120.0
#: Under the stand-in: the most rank processes (each with its own stand-in GPU) a test may ask for.
STANDIN_GPUS = 4
STANDIN_NO_TORCH = "needs torch CUDA tensors: the CPU stand-in models cupy only"

_PROBE: dict = {}


def _probe() -> tuple[str | None, int]:
    """(reason cupy/NCCL is unusable or None, visible GPU count), computed once per session."""
    if not _PROBE:
        reason, count, standin = None, 0, False
        try:
            from reshard.runtime.backends import cuda_buffers

            cupy, _ = cuda_buffers.import_nccl()
            standin = getattr(cupy, "_standin", False) is True
        except ImportError as e:
            reason = str(e)
        if reason is None:
            from reshard.runtime.backends.nccl import visible_gpu_count

            count = visible_gpu_count()
        _PROBE.update(reason=reason, count=count, standin=standin)
    return _PROBE["reason"], _PROBE["count"]


def standin() -> bool:
    """cupy is the CPU stand-in (tests/gpu/standin): no GPU result."""
    _probe()
    return _PROBE["standin"]


def torch_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def gpus_needed(item) -> tuple[int, bool] | None:
    """(GPUs, needs torch CUDA tensors) of a ``gpu`` test, None for other tests."""
    marker = item.get_closest_marker("gpu")
    if marker is None:
        return None
    return (int(marker.args[0]) if marker.args else 1), bool(marker.kwargs.get("torch_cuda", False))


def unavailable(need: int, torch_tensors: bool = False) -> str | None:
    """Why a test needing ``need`` GPUs (and torch CUDA tensors) cannot run here (None: it can)."""
    reason, count = _probe()
    if reason is not None:
        return f"cupy/NCCL unavailable ({reason})"
    if standin():
        if torch_tensors:
            return STANDIN_NO_TORCH
        if need > STANDIN_GPUS:
            return f"needs {need} GPU(s); the CPU stand-in runs at most {STANDIN_GPUS} rank processes"
        return None
    if count < need:
        return f"needs {need} GPU(s), {count} visible"
    if torch_tensors and not torch_cuda():
        return "needs torch CUDA tensors; torch here has no CUDA"
    return None


def pytest_runtest_setup(item):
    needed = gpus_needed(item)
    if needed is None:
        return
    need, torch_tensors = needed
    why = unavailable(need, torch_tensors)
    if why is None:
        return
    if REQUIRED_GPUS and need <= REQUIRED_GPUS:
        pytest.fail(f"RESHARD_REQUIRE_GPUS={REQUIRED_GPUS} promised GPUs, but {why}", pytrace=False)
    pytest.skip(why)


def wait_for_free_gpus(ray, need: float, timeout_s: float = GPU_RETURN_TIMEOUT_S) -> None:
    """Return once the Ray cluster has ``need`` GPUs free; fail (never skip) after ``timeout_s``:
    the cluster has them (the caller checked its total), so not getting them back is a bug."""
    deadline = time.monotonic() + timeout_s
    pause = 0.05
    while True:
        free = ray.available_resources().get("GPU", 0.0)
        if free + 1e-9 >= need:
            return
        if time.monotonic() >= deadline:
            pytest.fail(
                f"{need:g} GPU(s) still not free after {timeout_s:g}s ({free:g} free of "
                f"{ray.cluster_resources().get('GPU', 0.0):g}): an earlier pool did not give its GPUs back",
                pytrace=False,
            )
        time.sleep(pause)
        pause = min(2 * pause, 1.0)


def total_gpus(ray) -> int:
    return int(ray.cluster_resources().get("GPU", 0))


@pytest.fixture(scope="session")
def gpu_count() -> int:
    return _probe()[1]


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray session: reuses one that is already running (the dist suite's), else starts one
    with every visible GPU and shuts it down at the end."""
    ray = pytest.importorskip("ray")
    import gpu_bodies  # this folder is on sys.path (pytest's rootdir-relative import)

    ray.cloudpickle.register_pickle_by_value(gpu_bodies)
    started = False
    if not ray.is_initialized():
        gpus = 0 if standin() else _probe()[1]  # stand-in GPUs are per process, not Ray resources
        ray.init(num_cpus=max(2, os.cpu_count() or 2), num_gpus=gpus, include_dashboard=False, log_to_driver=False)
        started = True
    yield ray
    if started:
        ray.shutdown()


class GpuBook:
    """The Ray cluster's GPUs as pools see them: the total, a wait until enough are free, and what
    an actor reserves. Under the stand-in: ``STANDIN_GPUS`` rank processes, nothing reserved."""

    def __init__(self, ray, standin: bool = False):
        self.ray = ray
        self.standin = standin

    @property
    def total(self) -> int:
        return STANDIN_GPUS if self.standin else total_gpus(self.ray)

    def wait_free(self, need: float, timeout_s: float = GPU_RETURN_TIMEOUT_S) -> None:
        if not self.standin:
            wait_for_free_gpus(self.ray, need, timeout_s)

    def reserve(self, gpus_per_actor: float) -> float:
        """``num_gpus`` of an actor that wants ``gpus_per_actor`` GPUs."""
        return 0 if self.standin else gpus_per_actor


@pytest.fixture(scope="session")
def gpus(ray_cluster) -> GpuBook:
    return GpuBook(ray_cluster, standin())


def pool_shortfall(need: int, have: int) -> None:
    """Skip a pool that needs more GPUs than the cluster has, or fail if they were promised."""
    if have >= need:
        return
    why = f"needs {need} GPU(s) in the Ray cluster, it has {have}"
    if REQUIRED_GPUS >= need:
        pytest.fail(f"RESHARD_REQUIRE_GPUS={REQUIRED_GPUS} promised GPUs, but the pool {why}", pytrace=False)
    pytest.skip(why)


@pytest.fixture(scope="session")
def require_pool():
    return pool_shortfall


class RankSet:
    """Ray actors that each hold an ``NcclBackend`` directly (no runtime in between): the GPU tests
    of the backend itself. ``call(fn, *args)`` runs ``fn(actor, *args)`` in each actor, where
    ``actor.backend`` and ``actor.device`` are its backend and device id."""

    def __init__(self, ray, actors: dict, backends: dict):
        self.ray = ray
        self.actors = actors
        self.backends = backends  # device -> the driver's copy (rendezvous uses it)

    def call(self, fn, *args, devices=None, timeout_s: float = 180.0) -> list:
        devices = sorted(self.actors) if devices is None else list(devices)
        refs = [self.actors[d].__ray_call__.remote(fn, *args) for d in devices]
        return self.ray.get(refs, timeout=timeout_s)

    def submit(self, fn, *args, device: int):
        return self.actors[device].__ray_call__.remote(fn, *args)

    def pids(self) -> dict[int, int]:
        """Process id of every rank (a crashed or restarted actor fails here or shows a new pid)."""
        return dict(zip(self.actors, self.call(lambda a: os.getpid()), strict=True))

    def rendezvous(self, groups) -> list:
        return next(iter(self.backends.values())).rendezvous(list(groups), self.actors, timeout_s=120)

    def kill(self) -> None:
        for a in self.actors.values():
            self.ray.kill(a, no_restart=True)


@pytest.fixture(scope="module")
def nccl_ranks(ray_cluster, gpus):
    """``make(n, gpus_per_rank=1.0, **backend_options)``: ``n`` rank actors (devices 0..n-1), each
    reserving ``gpus_per_rank`` GPUs; fractional values put several ranks on one GPU. Killed at the
    end of the module (their GPUs come back asynchronously: the next pool waits for them)."""
    ray = ray_cluster
    made: list[RankSet] = []

    def make(n: int, gpus_per_rank: float = 1.0, **options) -> RankSet:
        from reshard.runtime.backends.nccl import NcclBackend

        need = n * gpus_per_rank
        pool_shortfall(-int(-need // 1), gpus.total)
        gpus.wait_free(need)

        @ray.remote(num_cpus=0, num_gpus=gpus.reserve(gpus_per_rank), max_restarts=0, max_task_retries=0)
        class Rank:
            def __init__(self, device, backend):
                self.device = device
                self.backend = backend  # unpickling applied its NCCL environment in this process

        backends = {d: NcclBackend(gpus_per_device=min(gpus_per_rank, 1.0), **options) for d in range(n)}
        actors = {d: Rank.remote(d, backends[d]) for d in range(n)}
        ranks = RankSet(ray, actors, backends)
        made.append(ranks)
        ranks.pids()  # every rank started
        return ranks

    yield make
    for ranks in made:
        ranks.kill()


def connect_all(ranks: RankSet, rdvs, timeout_s: float = 60.0, devices=None) -> list:
    """Every member of ``rdvs`` creates its communicators (one ``connect_many`` each, concurrently)."""

    def connect(actor, rdvs, timeout_s):
        mine = [r for r in rdvs if actor.device in r.group]
        if mine:
            actor.backend.connect_many(mine, actor.device, timeout_s)
        return sorted(actor.backend.live_groups())

    members = sorted({d for r in rdvs for d in r.group}) if devices is None else devices
    return ranks.call(connect, rdvs, timeout_s, devices=members)


@pytest.fixture(scope="session")
def connect_ranks():
    return connect_all


SHARED_GPU_POOL = 8  # device actors on a single GPU (and on the CPU stand-in)


@pytest.fixture(scope="module")
def pool(ray_cluster, gpus, require_pool):
    from reshard import DeviceMesh
    from reshard.runtime.backends.nccl import NcclBackend

    total = gpus.total
    require_pool(1, total)
    if gpus.standin:  # every actor process has a stand-in GPU of its own: nothing to reserve or share
        n, need, backend = SHARED_GPU_POOL, 0, NcclBackend(timeout_s=120, gpus_per_device=0)
    elif total >= 2:
        n, need, backend = min(total, 8), min(total, 8), NcclBackend(timeout_s=120)
    else:
        n, need = SHARED_GPU_POOL, 1
        backend = NcclBackend(timeout_s=120, gpus_per_device=1 / SHARED_GPU_POOL, gpu_sharing="hostid")
    gpus.wait_free(need)
    mesh = DeviceMesh.create((n,), backend=backend, startup_timeout_s=180)
    yield mesh
    mesh.shutdown()


@pytest.fixture
def view(pool):
    """``view(pool_indices, shape, devices_per_host=None)`` as in tests/dist, over the GPU pool."""
    from reshard import DeviceMesh

    slots: dict[int, int] = {}
    made = []

    def make(indices, shape, devices_per_host=None):
        indices = [int(i) for i in indices]
        for i in indices:
            slots.setdefault(i, len(slots))
        if len(slots) > pool.size:
            pytest.skip(f"the case needs {len(slots)} distinct devices, the NCCL pool has {pool.size}")
        devices = [pool.device_ids[slots[i]] for i in indices]
        m = DeviceMesh.from_devices(devices, shape, devices_per_host=devices_per_host)
        made.append(m)
        return m

    yield make
    for m in made:
        m.shutdown()
