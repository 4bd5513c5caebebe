"""The pure layer imports neither ray, torch nor cupy.

Pure, by package path: every module of ``topology/``, ``reshard/`` and ``scheduler/`` outside the
runtime packages ``topology.runtime``, ``reshard.runtime`` and ``scheduler.runtime``. Checked
statically by the import-linter contracts in pyproject.toml (``lint-imports``, which a copy of the
tree with a heavy import or a cycle planted in it must fail), and in a fresh interpreter that imports
every pure module.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("topology", "reshard", "scheduler")
RUNTIME = ("topology.runtime", "reshard.runtime", "scheduler.runtime")
HEAVY = ("ray", "torch", "cupy")
ROOT_PACKAGES = (*PACKAGES, "bench")  # what the contracts analyse
ENTRY_POINTS = {"reshard", "scheduler", "topology.cluster"}  # load their runtime package on first use
LINK = re.compile(r"^-\s+(\S+) -> (\S+) \(l\.", re.MULTILINE)


def module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


def is_runtime(name: str) -> bool:
    return any(name == r or name.startswith(r + ".") for r in RUNTIME)


def pure_modules(root: Path = ROOT) -> dict[str, Path]:
    """Every pure module's name and file under ``root``."""
    out = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            name = module_name(path, root)
            if not is_runtime(name):
                out[name] = path
    return out


def test_the_pure_set_follows_the_package_paths():
    modules = pure_modules()
    assert {
        "topology",
        "topology.mesh",
        "reshard",
        "reshard.passes.lowering",
        "reshard.planner.auto",
        "scheduler.ir",
    } <= set(modules)
    assert not [m for m in modules if "runtime" in m.split(".")]
    for package in RUNTIME:
        path = ROOT / package.replace(".", "/")
        assert path.is_dir() or path.with_suffix(".py").is_file(), f"no runtime package {package}"


_PROBE = """
import importlib, json, sys
heavy = {heavy!r}
out = {{"culprit": None, "errors": {{}}}}
for name in {modules!r}:
    try:
        importlib.import_module(name)
    except Exception as e:
        out["errors"][name] = repr(e)
    leaked = [m for m in heavy if m in sys.modules]
    if leaked and out["culprit"] is None:
        out["culprit"] = [name, leaked]
print(json.dumps(out))
"""


def test_pure_modules_do_not_import_ray_torch_cupy():
    """Importing every pure module, in a fresh interpreter, loads none of ray, torch, cupy."""
    modules = sorted(pure_modules())
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


def test_the_device_side_loads_no_driver_module():
    """A device actor's process imports the device side (its actor class, the executor, the
    backends) and none of the driver's modules; the driver's names still load on first use."""
    code = (
        "import sys, reshard.runtime.device.actor\n"
        "print(sorted(m for m in sys.modules if m.startswith('reshard.runtime.driver')))\n"
        "from reshard.runtime import DeviceMesh, reshard\n"
        "print(DeviceMesh.__module__, reshard.__module__)"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    loaded, names = proc.stdout.strip().splitlines()[-2:]
    assert loaded == "[]"
    assert names == "reshard.runtime.driver.mesh reshard.runtime.driver.resharding"


def test_the_driver_side_loads_no_device_module():
    """A driver's process (a reshard and its handles) imports none of the device side's modules
    (the executor, its box copies, its cross-memory reads): only ``current_device``, which
    ``reshard.runtime`` exports, and what both sides share (checksums, where a process runs)."""
    code = (
        "import sys, reshard.runtime.driver.resharding, reshard.runtime.driver.controller\n"
        "import reshard.runtime.driver.mesh\n"
        "print(sorted(m for m in sys.modules if m.startswith('reshard.runtime.device.')))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "['reshard.runtime.device.current']"


# ------------------------------------------------------------------------------- import-linter


def lint_imports(root: Path, *contracts: str) -> subprocess.CompletedProcess:
    """``lint-imports`` on the tree at ``root`` (its pyproject.toml), limited to ``contracts``."""
    pytest.importorskip("importlinter", reason="lint-imports comes with the dev extra: pip install -e '.[dev]'")
    command = [sys.executable, "-c", "from importlinter.cli import lint_imports_command; lint_imports_command()"]
    command += ["--no-cache", "--no-logo", *(f"--contract={c}" for c in contracts)]
    return subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=120)


def test_import_contracts_hold():
    proc = lint_imports(ROOT, "layers", "heavy", "entry", "acyclic")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Contracts: 4 kept, 0 broken." in proc.stdout, proc.stdout


def _copy_tree(dst: Path) -> dict[str, Path]:
    """The Python files of the analysed packages and pyproject.toml, copied under ``dst``."""
    for package in ROOT_PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            target = dst / path.relative_to(ROOT)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
    shutil.copyfile(ROOT / "pyproject.toml", dst / "pyproject.toml")
    return pure_modules(dst)


def test_every_pure_module_is_covered_by_the_contracts(tmp_path):
    """A heavy import, or a runtime package imported at module level, planted in any pure module
    breaks a contract; only the lazy entry points may import their runtime package."""
    modules = _copy_tree(tmp_path)
    for i, (name, path) in enumerate(sorted(modules.items())):
        runtime = f"{name.split('.')[0]}.runtime"
        path.write_text(path.read_text() + f"\nimport {HEAVY[i % len(HEAVY)]}\nimport {runtime}\n")
    proc = lint_imports(tmp_path, "heavy")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    heavy = {importer for importer, imported in LINK.findall(proc.stdout) if imported in HEAVY}
    assert heavy == set(modules), sorted(set(modules) ^ heavy)

    proc = lint_imports(tmp_path, "entry")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    entry = {importer for importer, imported in LINK.findall(proc.stdout) if is_runtime(imported)}
    assert entry == set(modules) - ENTRY_POINTS, sorted((set(modules) - ENTRY_POINTS) ^ entry)


def test_a_cycle_in_a_pure_package_breaks_the_contracts(tmp_path):
    _copy_tree(tmp_path)
    packages = ("topology", "reshard", "reshard.planner", "scheduler")
    for package in packages:
        folder = tmp_path / package.replace(".", "/")
        (folder / "cycle_a.py").write_text(f"import {package}.cycle_b\n")
        (folder / "cycle_b.py").write_text(f"import {package}.cycle_a\n")
    proc = lint_imports(tmp_path, "acyclic")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    broken = set(re.findall(r"No cycles are allowed in (\S+)\.", proc.stdout))
    assert broken == set(packages), proc.stdout
