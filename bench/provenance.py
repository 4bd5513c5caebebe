"""Where a result file came from: the revision measured (with ``+dirty`` when the tree differed from
it), the exact command, when, and the versions. Every result file carries this header, and it names
no path of the machine it ran on."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: What a tree may differ in and still be the revision measured: the results and figures themselves.
_NOT_MEASURED = (":!bench/results", ":!bench/figures")


def revision() -> str:
    """The revision measured (``git rev-parse``, ``+dirty`` if a tracked or new file outside the
    results differs; ``RESHARD_REVISION`` where the copy has no git, e.g. a lent GPU machine)."""
    if os.environ.get("RESHARD_REVISION"):
        return os.environ["RESHARD_REVISION"]
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=5
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", ".", *_NOT_MEASURED],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
        return (rev.stdout.strip() or "unknown") + ("+dirty" if dirty else "")
    except Exception:
        return "unknown"


def command_line(program: str, argv) -> str:
    """``program`` and ``argv`` as one line, any absolute path shown relative to the repository (or by
    its name)."""

    def shown(arg: str) -> str:
        if not os.path.isabs(arg):
            return arg
        path = Path(arg)
        return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name

    return " ".join([program, *(shown(str(a)) for a in argv)])


def header(program: str, argv) -> dict:
    """The fields every result file starts with."""
    return {
        "command": command_line(program, argv),
        "revision": revision(),
        "when": _dt.datetime.now().isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }


def tier_command() -> str:
    """The command that runs this pytest session, with the ``RESHARD_`` settings it was given (for
    the reports of the fault tiers, which run as tests)."""
    settings = [f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("RESHARD_")]
    return command_line(" ".join([*settings, "python -m pytest"]), sys.argv[1:])


def revision_of(result: dict) -> str:
    """The revision a result file names (files written before the header had it as ``git``)."""
    return result.get("revision") or result.get("git") or "unknown"
