"""The first checks on a GPU machine (``make gpu-check``), in order, each a subprocess with a deadline.

Stops at the first failure and says what to look at, unless ``--keep-going``. Each step's output goes
to ``<out>/<nn>-<name>.log`` and, shortened, to stdout; ``<out>/summary.txt`` lists the outcomes.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY = sys.executable
MAXFAIL = 5  # failures a pytest step reports before it stops
SMI_FIELDS = "name,uuid,driver_version,compute_mode,memory.total,mig.mode.current"

IDENTITY = r"""
import torch
assert torch.cuda.is_available(), "torch sees no GPU: check the driver (nvidia-smi) and CUDA_VISIBLE_DEVICES"
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"gpu {i}: {p.name}, {p.total_memory >> 20} MiB, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs,"
          f" uuid {p.uuid}")
print("torch", torch.__version__, "cuda", torch.version.cuda)
"""

STACK = r"""
import torch, cupy
from cupy.cuda import nccl
from reshard.runtime.backends import cuda_buffers
print("torch", torch.__version__, "NCCL", torch.cuda.nccl.version())
print("cupy", cupy.__version__, "NCCL", nccl.get_version(), "CUDA runtime", cupy.cuda.runtime.runtimeGetVersion())
print("cupy distributions", cuda_buffers.installed_cupy_distributions())
print("libnccl loaded", cuda_buffers.loaded_nccl_libraries())
cuda_buffers.check_gpu_stack()
print("check_gpu_stack: ok")
"""

UUIDS = r"""
import cupy, torch
n = torch.cuda.device_count()
for i in range(n):
    raw = cupy.cuda.runtime.getDeviceProperties(i)["uuid"]
    t = torch.cuda.get_device_properties(i).uuid
    print(f"gpu {i}: cupy's uuid {raw!r} ({len(raw)} bytes), torch's {t} ({len(t.bytes)} bytes)")
    assert len(t.bytes) == 16, f"gpu {i}: torch's UUID has {len(t.bytes)} bytes, not 16"
print("every UUID has 16 bytes")
"""


@dataclass
class Step:
    name: str
    argv: list[str]
    look_at: str
    timeout_s: float = 300.0
    env: dict = field(default_factory=dict)


def pytest_step(name: str, path: str, look_at: str, timeout_s: float, env: dict | None = None) -> Step:
    argv = [PY, "-m", "pytest", f"--maxfail={MAXFAIL}", "-q", "-p", "no:cacheprovider", "--timeout=240", path]
    return Step(name, argv, look_at, timeout_s, env or {})


def steps(bench: bool) -> list[Step]:
    nccl_debug = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET"}
    out = [
        Step(
            "identity",
            ["nvidia-smi", f"--query-gpu={SMI_FIELDS}", "--format=csv"],
            "nvidia-smi: is the driver loaded and the GPU visible?",
            30,
        ),
        Step("torch", [PY, "-c", IDENTITY], "torch's CUDA build against the driver's CUDA version", 60),
        Step(
            "stack",
            [PY, "-c", STACK],
            "reshard/runtime/backends/nccl/NCCL.md, 'Versions': cupy's NCCL must be torch's",
            60,
        ),
        Step("uuids", [PY, "-c", UUIDS], "GPU UUIDs as torch and cupy read them (cupy cuts at a 0x00 byte)", 60),
        pytest_step("backend", "tests/gpu/test_nccl.py", "the NcclBackend API on one rank", 300),
        pytest_step("box-copies", "tests/gpu/test_box_copies.py", "the copy kernel (NVRTC compiles it)", 180),
        pytest_step("gpu-blocks", "tests/gpu/test_gpu_blocks.py", "shard memory in blocks: pooled, reused", 120),
        pytest_step("cuda-ipc", "tests/gpu/test_cuda_ipc.py", "CUDA IPC pulls between actors on one GPU", 240),
        pytest_step(
            "one-gpu-hostid",
            "tests/gpu/test_one_gpu_tier.py",
            "NCCL INIT/NET lines in the log: socket transport over loopback between NCCL_HOSTIDs",
            300,
            nccl_debug,
        ),
        pytest_step(
            "one-gpu-multi-rank",
            "tests/gpu/test_one_gpu_multi_rank.py",
            "NCCL_MULTI_RANK_GPU_ENABLE on NCCL >= 2.30",
            180,
            nccl_debug,
        ),
        pytest_step("ranks", "tests/gpu/test_nccl_ranks.py", "several ranks: pairing, aborts", 300),
        pytest_step("dist", "tests/gpu/test_nccl_dist.py", "the dist bodies on NCCL device actors", 420),
        pytest_step("pipeline", "tests/gpu/test_nccl_pipeline.py", "a pipeline on NCCL device actors", 240),
    ]
    if bench:
        argv = [PY, "-m", "bench", "gpu", "--out", "gpu-check/gpu.json"]
        out.append(Step("bench", argv, "bench/gpu.py: the GPU data plane measured", 420))
    return out


def nccl_summary(folder: str) -> str:
    """How many processes logged, and the transports NCCL chose ("via NET/Socket/0", "via P2P/IPC")."""
    transports: dict[str, int] = {}
    files = [os.path.join(folder, f) for f in os.listdir(folder)]
    for path in files:
        with open(path, errors="replace") as f:
            for line in f:
                if " via " in line:
                    kind = line.split(" via ", 1)[1].split()[0]
                    transports[kind] = transports.get(kind, 0) + 1
    shown = ", ".join(f"{k} x{n}" for k, n in sorted(transports.items())) or "no connections logged"
    return f"{len(files)} process(es); {shown}"


def run(step: Step, index: int, out_dir: str) -> tuple[str, float]:
    log = os.path.join(out_dir, f"{index:02d}-{step.name}.log")
    env = {**os.environ, **step.env}
    debug_dir = None
    if "NCCL_DEBUG" in step.env:  # the ranks are Ray workers: NCCL writes its lines to files, one per process
        debug_dir = os.path.join(out_dir, f"{index:02d}-{step.name}-nccl")
        os.makedirs(debug_dir, exist_ok=True)
        env["NCCL_DEBUG_FILE"] = os.path.join(debug_dir, "%h.%p.log")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p)
    start = time.monotonic()
    with open(log, "w") as f:
        f.write(f"$ {' '.join(step.argv)}\n")
        f.flush()
        try:
            rc = subprocess.run(
                step.argv, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=step.timeout_s
            ).returncode
            outcome = "ok" if rc == 0 else f"failed (exit {rc})"
        except subprocess.TimeoutExpired:
            outcome = f"timed out after {step.timeout_s:g} s"
        except FileNotFoundError as e:
            outcome = f"failed ({e})"
    elapsed = time.monotonic() - start
    with open(log) as f:
        tail = f.read().splitlines()[-25:]
    if debug_dir is not None:
        tail.append(f"NCCL debug lines: {nccl_summary(debug_dir)}")
    print(f"== {index:02d} {step.name}: {outcome} in {elapsed:.1f} s ({log})")
    if outcome != "ok" or step.name in ("identity", "torch", "stack", "uuids") or debug_dir is not None:
        print("\n".join("   " + line for line in tail))
    return outcome, elapsed


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(ROOT, "gpu-check"), help="folder for the logs (default gpu-check/)")
    p.add_argument("--keep-going", action="store_true", help="run every step even after a failure")
    p.add_argument("--no-bench", action="store_true", help="skip python -m bench --backend nccl")
    p.add_argument("--only", help="comma-separated step names to run")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    chosen = [s for s in steps(not args.no_bench) if not args.only or s.name in args.only.split(",")]
    failed = []
    with open(os.path.join(args.out, "summary.txt"), "w") as summary:
        for i, step in enumerate(chosen, 1):
            outcome, elapsed = run(step, i, args.out)
            summary.write(f"{i:02d} {step.name}: {outcome} in {elapsed:.1f} s\n")
            summary.flush()
            if outcome != "ok":
                failed.append(step)
                print(f"   look at: {step.look_at}")
                if not args.keep_going:
                    break
    print("gpu-check:", "every step passed" if not failed else f"failed: {', '.join(s.name for s in failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
