"""The pure layer imports neither ray, torch nor cupy (checked in a fresh interpreter).

Pure: every module of ``topology/``, ``reshard/`` (except ``reshard/runtime/``) and ``scheduler/``
(except the pipeline runtime: modules whose docstring says "Runtime layer", plus the known
pipeline runtime modules below).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("ray", "torch", "cupy")


def _is_runtime(path: Path, name: str) -> bool:
    if name.startswith(("reshard.runtime", "scheduler.runtime")):
        return True
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return "Runtime layer" in doc


def pure_modules() -> list[str]:
    out = []
    for package in ("topology", "reshard", "scheduler"):
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            name = ".".join(parts)
            if not _is_runtime(path, name):
                out.append(name)
    return out


_PROBE = """
import importlib, json, sys
heavy = {heavy!r}
out = {{"loaded": [], "culprit": None, "errors": {{}}}}
for name in {modules!r}:
    try:
        importlib.import_module(name)
    except Exception as e:
        out["errors"][name] = repr(e)
    leaked = [m for m in heavy if m in sys.modules]
    if leaked and out["culprit"] is None:
        out["culprit"] = [name, leaked]
    out["loaded"].append(name)
print(json.dumps(out))
"""


def test_pure_modules_do_not_import_ray_torch_cupy():
    modules = pure_modules()
    assert {"topology.mesh", "reshard.lowering", "reshard.serialize", "scheduler.ir"} <= set(modules)
    assert not any(m.startswith("reshard.runtime") for m in modules)
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE.format(heavy=HEAVY, modules=modules)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not out["errors"], out["errors"]
    assert out["culprit"] is None, f"importing {out['culprit'][0]} pulled in {out['culprit'][1]}"


def test_runtime_names_load_lazily():
    """``import reshard`` alone stays pure; the runtime names load on first use."""
    code = "import sys, reshard; print(any(m in sys.modules for m in ('ray', 'torch', 'cupy')))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"
