"""ruff and pyright, configured in pyproject.toml, are clean: `make test` (and so CI) runs them.

A checker that is not installed fails here (it is part of the `dev` extra that scripts/setup.sh
installs); it is never skipped.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tool(name: str) -> str:
    exe = Path(sys.executable).with_name(name)
    found = str(exe) if exe.exists() else shutil.which(name)
    assert found, f"{name} is not installed: it is part of the dev extra (pip install -e '.[dev]')"
    return found


def test_ruff_is_clean():
    run = subprocess.run([_tool("ruff"), "check", "ddtree_lab", "tests", "scripts", "benchmarks"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]


@pytest.mark.slow  # ~35 s; `make lint` runs it in the edit loop
def test_pyright_is_clean():
    # the interpreter running the tests: pyright then resolves imports on its sys.path, a
    # --system-site-packages venv's base site-packages included (a `venv = ".venv"` setting does not)
    run = subprocess.run([_tool("pyright"), "--outputjson", "--pythonpath", sys.executable], cwd=ROOT, capture_output=True, text=True, timeout=900)
    try:
        report = json.loads(run.stdout)
    except ValueError:
        raise AssertionError(f"pyright did not run: {run.stdout[-3000:]} {run.stderr[-3000:]}") from None
    errors = [d for d in report["generalDiagnostics"] if d["severity"] == "error"]
    shown = "\n".join(f"{d['file']}:{d['range']['start']['line'] + 1}: {d['message']}" for d in errors[:40])
    assert report["summary"]["filesAnalyzed"] > 50, report["summary"]
    assert not errors, f"{len(errors)} pyright errors:\n{shown}"
