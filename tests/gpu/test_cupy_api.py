"""The API-level GPU tests against the real cupy, on a machine without a GPU.

There the CPU stand-in shadows an installed cupy in this process and its Ray workers
(tests/conftest.py), so these tests run in a process of their own with the stand-in off. They
catch drift in cupy's NCCL bindings (names, constants, error codes, unique ids) before a GPU does.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

STANDIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "standin")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
API_TESTS = "type_codes or in_progress or unique_id or every_call"


def _real_cupy_installed() -> bool:
    code = "import importlib.util as u, sys; s = u.find_spec('cupy'); sys.exit(0 if s else 1)"
    env = _env()
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT).returncode == 0


def _env() -> dict:
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != STANDIN]
    return {**os.environ, "RESHARD_GPU_STANDIN": "0", "PYTHONPATH": os.pathsep.join(paths)}


def test_the_api_level_tests_pass_against_the_real_cupy():
    if not _real_cupy_installed():
        pytest.skip("no real cupy installed here (CI installs it: make setup-cupy)")
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "-k", API_TESTS, "-rs"]
    out = subprocess.run(argv + ["tests/gpu/test_nccl.py"], env=_env(), cwd=ROOT, capture_output=True, text=True)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    passed = re.search(r"(\d+) passed", text)
    assert passed and int(passed.group(1)) >= 5 and "skipped" not in text, text[-4000:]
    assert "stand-in" not in text  # the real cupy ran, not the stand-in
