"""Every example in README.md runs, the README stays short, and its links lead somewhere.

* ``python`` blocks: each block is executed on its own, in a fresh namespace (its own globals
  dict, in this process), in a temporary directory where ``fixtures`` is a link to the
  repository's ``fixtures/`` (so the README's relative fixture paths work and whatever a block
  writes lands in the temporary directory). A block that loads the real model (it calls
  ``load_default`` or makes a ``LiveSession``) is marked slow.
* ``bash`` / ``sh`` / ``console`` blocks: every line whose command is ``ddtree-lab`` runs as
  ``sys.executable -m ddtree_lab.cli ...`` in a subprocess (PYTHONPATH inherited, the repository
  prepended), the lines of one block in order in one temporary directory laid out as above (a
  block may use what an earlier line of it wrote, e.g. ``bundle`` then ``replay``). A line must
  exit 0 unless its comment says ``exit N``. The temporary directory is a git repository with the
  repository's ``.gitignore``: what the examples write must leave ``git status --porcelain``
  unchanged there, as in a user's checkout where they run from the root (issue 34.13). A block is slow when one of its lines loads the real
  model (``record``, ``--model``). The only other lines allowed are in ``SKIPPED`` with the
  reason; anything else fails, so a new kind of example has to be taught here first.
* The Python blocks of the docs in ``DOCS_RUN`` (docs/SGLANG.md) run the same way.
* README.md has at most 200 lines; every relative link (``[text](path)``, images included)
  names a file that exists.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_LINES = 200

#: Lines the test does not run, with the reason.
SKIPPED = {
    ("make", "lab"): "opens JupyterLab and serves until stopped (ddtree-lab lab; tests/test_browser.py runs the notebooks)",
    ("make", "test"): "runs this very suite",
    ("make", "setup"): "installs packages (scripts/setup.sh; tests/test_setup_output.py covers it)",
}

#: Links to files another branch of the same issue adds; skipped (not failed) while missing.
PENDING_LINKS: dict[str, str] = {}  # a link to a file not written yet: target -> why (none today)

SHELL_LANGS = {"bash", "sh", "console", "shell"}
SLOW_PYTHON = re.compile(r"\bload_default\b|\bLiveSession\(")
FENCE = re.compile(r"^```([A-Za-z0-9_+-]*)[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)


def _blocks(path: Path = README) -> list[tuple[str, int, str]]:
    """(language, first line number, body) of every fenced block of ``path`` (README.md)."""
    text = path.read_text()
    return [(m.group(1).lower(), text.count("\n", 0, m.start()) + 2, m.group(2)) for m in FENCE.finditer(text)]


def _shell_lines(body: str, first_line: int) -> list[tuple[int, str]]:
    """(line number, logical line) with ``\\`` continuations joined and console prompts removed."""
    out, pending, start = [], "", None
    for k, raw in enumerate(body.splitlines()):
        line = raw[2:] if raw.startswith("$ ") else raw
        if start is None:
            start = first_line + k
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        out.append((start, pending + line))
        pending, start = "", None
    if pending:
        out.append((start, pending))
    return [(n, x) for n, x in out if x.strip() and not x.strip().startswith("#")]


def _expected_status(line: str) -> int:
    """0, or N when the line's comment says ``exit N``."""
    comment = line.split(" #", 1)[1] if " #" in line else ""
    m = re.search(r"\bexit (\d+)\b", comment)
    return int(m.group(1)) if m else 0


def _command(line: str) -> tuple[dict[str, str], list[str]]:
    """Environment assignments and the argument list of one shell line (no pipes, no ``&&``)."""
    words = shlex.split(line, comments=True)
    if any(w in ("|", "&&", "||", ";", ">", "<") for w in words):
        raise AssertionError(f"README shell line is more than one plain command: {line!r}")
    env = {}
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    return env, words


def _is_slow_cli(args: list[str]) -> bool:
    return (len(args) > 1 and args[1] in ("record", "vllm")) or "--model" in args


def _workdir(tmp_path: Path) -> Path:
    """A stand-in for the repository root a user runs the examples from: ``fixtures`` linked, and
    a git repository with the repository's ``.gitignore`` (:func:`_git_status`)."""
    (tmp_path / "fixtures").symlink_to(ROOT / "fixtures", target_is_directory=True)
    (tmp_path / ".gitignore").write_text((ROOT / ".gitignore").read_text())
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True, capture_output=True)
    return tmp_path


def _git_status(cwd: Path) -> list[str]:
    """``git status --porcelain`` of the stand-in root, untracked files one by one."""
    r = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=cwd, capture_output=True,
                       text=True, check=True)
    return sorted(r.stdout.splitlines())


def _assert_git_status_unchanged(cwd: Path, before: list[str], what: str) -> None:
    """Issue 34.13: a user who runs the README's examples from the repository root must not find
    their outputs as untracked files (the root's ``.gitignore`` names them)."""
    new = sorted(set(_git_status(cwd)) - set(before))
    assert not new, (f"{what} leaves untracked files in the repository root: {new} "
                     "(add them to .gitignore, anchored at the root)")


def _python_cases():
    cases = []
    for lang, line, body in _blocks():
        if lang in ("python", "py"):
            marks = [pytest.mark.slow] if SLOW_PYTHON.search(body) else []
            cases.append(pytest.param(body, id=f"python-line{line}", marks=marks))
    return cases


def _shell_cases():
    cases = []
    for lang, line, body in _blocks():
        if lang not in SHELL_LANGS:
            continue
        lines = _shell_lines(body, line)
        slow = any(_is_slow_cli(_command(x)[1]) for _, x in lines)
        cases.append(pytest.param(lines, id=f"{lang}-line{line}", marks=[pytest.mark.slow] if slow else []))
    return cases


def _links() -> list[str]:
    text = README.read_text()
    targets = re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text)
    return sorted({t.split("#", 1)[0] for t in targets
                   if not re.match(r"[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")})


def test_readme_has_at_most_200_lines():
    n = len(README.read_text().splitlines())
    assert n <= MAX_LINES, f"README.md has {n} lines (at most {MAX_LINES}): move detail into docs/"


def test_readme_has_examples_to_run():
    langs = [lang for lang, _, _ in _blocks()]
    assert "python" in langs and any(x in SHELL_LANGS for x in langs)
    unknown = sorted(set(langs) - SHELL_LANGS - {"python", "py", "text", ""})
    assert not unknown, f"README blocks in languages this test does not run: {unknown}"


@pytest.mark.parametrize("link", _links())  # not "target": conftest reads that name as the real-model fixture
def test_readme_relative_link_exists(link):
    if not (ROOT / link).exists() and link in PENDING_LINKS:
        pytest.skip(f"{link} missing on this branch: {PENDING_LINKS[link]}")
    assert (ROOT / link).exists(), f"README.md links to {link}, which does not exist"


@pytest.mark.parametrize("source", _python_cases())
def test_readme_python_block_runs(source, tmp_path, monkeypatch):
    monkeypatch.chdir(_workdir(tmp_path))
    before = _git_status(tmp_path)
    namespace = {"__name__": "__readme__"}
    exec(compile(source, str(README), "exec"), namespace)  # a fresh namespace per block
    _assert_git_status_unchanged(tmp_path, before, "a README Python block")


#: docs whose Python blocks run too (the README sends SGLang users there; issue 26.3's snippet lives there)
DOCS_RUN = ("docs/SGLANG.md",)


@pytest.mark.parametrize("source", [pytest.param(body, id=f"{doc}-line{line}") for doc in DOCS_RUN
                                    for lang, line, body in _blocks(ROOT / doc) if lang in ("python", "py")])
def test_docs_python_block_runs(source, tmp_path, monkeypatch):
    assert "load_default" not in source and "LiveSession(" not in source  # (they would need the slow mark)
    monkeypatch.chdir(_workdir(tmp_path))
    exec(compile(source, "docs", "exec"), {"__name__": "__docs__"})


@pytest.mark.parametrize("lines", _shell_cases())
def test_readme_shell_block_runs(lines, tmp_path):
    cwd = _workdir(tmp_path)
    before = _git_status(cwd)
    base_env = dict(os.environ)
    base_env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
    ran = 0
    for number, line in lines:
        env, args = _command(line)
        if tuple(args[:2]) in SKIPPED:
            continue  # reason in SKIPPED
        assert args and args[0] == "ddtree-lab", (
            f"README.md line {number}: {line!r} is not a ddtree-lab command; run it here or add it to SKIPPED with a reason")
        assert not (len(args) > 1 and args[1] == "lab" and "--dry-run" not in args), (
            f"README.md line {number}: `ddtree-lab lab` serves until stopped; add --dry-run or leave it out")
        r = subprocess.run([sys.executable, "-m", "ddtree_lab.cli", *args[1:]], cwd=cwd, env={**base_env, **env},
                           capture_output=True, text=True, timeout=900)
        want = _expected_status(line)
        assert r.returncode == want, (
            f"README.md line {number}: {line!r} exited {r.returncode} (expected {want})\n"
            f"stdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}")
        ran += 1
    assert ran or all(tuple(_command(x)[1][:2]) in SKIPPED for _, x in lines)
    _assert_git_status_unchanged(cwd, before, f"README.md lines {lines[0][0]}..{lines[-1][0]}")
