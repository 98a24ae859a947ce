"""Every notebook in labs/ runs top to bottom on the embedded default; a failing cell fails."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

LABS = Path(__file__).resolve().parent.parent / "labs"
NOTEBOOKS = sorted(LABS.glob("*.ipynb"))


def _executed_elsewhere() -> set[str]:
    """Notebooks another test already runs top to bottom (each runs once per suite): 06 in
    tests/test_sglang_recorder.py, and the browser test's notebooks when Chromium can run."""
    import test_browser

    elsewhere = {"06_sglang.ipynb"}
    if test_browser.missing_browser() is None:
        elsewhere |= set(test_browser.NOTEBOOKS)
    return elsewhere


HERE = [p for p in NOTEBOOKS if p.name not in _executed_elsewhere()]

pytestmark = pytest.mark.slow


def test_there_are_notebooks():
    assert NOTEBOOKS, "labs/ has no notebooks"


@pytest.mark.parametrize("path", HERE, ids=[p.name for p in HERE])
def test_notebook_runs_top_to_bottom(path, tmp_path):
    nb = nbformat.read(path, as_version=4)
    # allow_errors: every cell runs and every failing one is named below (not only the first)
    client = NotebookClient(nb, timeout=900, kernel_name="python3", allow_errors=True,
                            resources={"metadata": {"path": str(LABS)}})
    client.execute()
    code = [c for c in nb.cells if c.cell_type == "code"]
    failed = [(k, o.get("ename"), o.get("evalue")) for k, c in enumerate(code) for o in c.get("outputs", [])
              if o.output_type == "error"]
    assert not failed, f"{path.name}: failing code cells (index, error, message): {failed}"
    assert all(c.get("execution_count") for c in code), f"{path.name}: a code cell did not run"


def test_every_notebook_is_executed_by_some_test():
    """Each notebook runs once per suite: here, in the browser test, or in the SGLang test."""
    import test_browser

    covered = {p.name for p in HERE} | {"06_sglang.ipynb"} | set(test_browser.NOTEBOOKS)
    assert {p.name for p in NOTEBOOKS} <= covered


def test_notebooks_are_documents_numbered_in_reading_order():
    """Each notebook opens with a markdown cell saying what it shows and how to use it."""
    for path in NOTEBOOKS:
        assert path.name[:2].isdigit() and path.name[2] == "_", path.name
        nb = nbformat.read(path, as_version=4)
        first = nb.cells[0]
        assert first.cell_type == "markdown" and first.source.startswith("# "), path.name
        assert len(first.source) > 200, f"{path.name}: the opening cell should say what it shows and how to use it"


def test_make_lab_is_ddtree_lab_lab_on_an_ignored_copy(tmp_path):
    """Issue 18.10: `make lab` (scripts/lab.sh) and `ddtree-lab lab` are one command, serving
    copies in .lab/ (ignored by git), so running and saving the notebooks leaves `git status`
    clean; a newer tracked notebook replaces its copy and the old copy is kept."""
    import os
    import subprocess

    from ddtree_lab.cli import labserver

    root = LABS.parent
    script = (root / "scripts" / "lab.sh").read_text()
    assert "-m ddtree_lab.cli lab" in script and "jupyter" not in script.split("set -euo")[1]
    inside = subprocess.run(["git", "rev-parse", "--is-inside-work-tree"], cwd=root, capture_output=True)
    if inside.returncode == 0:  # outside a git checkout (an unpacked sdist) there is nothing to ignore
        ignored = subprocess.run(["git", "check-ignore", "-q", ".lab/01_live_step.ipynb"], cwd=root)
        assert ignored.returncode == 0, ".lab/ is not ignored by git"
    labs, work = tmp_path / "labs", tmp_path / ".lab"
    labs.mkdir()
    (labs / "01_a.ipynb").write_text("v1")
    assert labserver.working_copies(labs, work) == [] and (work / "01_a.ipynb").read_text() == "v1"
    (work / "01_a.ipynb").write_text("my edits")
    assert labserver.working_copies(labs, work) == []  # the user's newer copy stays
    (labs / "01_a.ipynb").write_text("v2")
    later = (work / "01_a.ipynb").stat().st_mtime + 5
    os.utime(labs / "01_a.ipynb", (later, later))
    notes = labserver.working_copies(labs, work)
    assert notes and (work / "01_a.ipynb").read_text() == "v2" and (work / "01_a.ipynb.bak").read_text() == "my edits"


def test_lab_trusts_the_shipped_copies_so_their_pictures_render(tmp_path):
    """An untrusted notebook shows its saved SVG trees and HTML tables as text in JupyterLab: the
    working copies that are still the tracked notebooks are signed; a copy the user edited, and a
    file that is no notebook, are not (the latter said)."""
    import shutil

    import nbformat
    from nbformat.sign import MemorySignatureStore, NotebookNotary

    from ddtree_lab.cli import labserver

    labs, work = tmp_path / "labs", tmp_path / ".lab"
    labs.mkdir()
    for name in ("07_drafters.ipynb", "09_vllm_engine.ipynb"):
        shutil.copy(LABS / name, labs / name)
    (labs / "00_broken.ipynb").write_text("not a notebook")
    labserver.working_copies(labs, work)
    edited = nbformat.read(work / "09_vllm_engine.ipynb", as_version=4)
    edited.cells[0].source += "\nmy note"
    nbformat.write(edited, work / "09_vllm_engine.ipynb")
    notary = NotebookNotary(store_factory=MemorySignatureStore, secret=b"test")  # not the user's database
    notes = labserver.trust_shipped(labs, work, notary=notary)
    assert notes == ["00_broken.ipynb: not read as a notebook (NotJSONError); its saved outputs show as text"], notes
    assert notary.check_signature(nbformat.read(work / "07_drafters.ipynb", as_version=4))
    assert not notary.check_signature(nbformat.read(work / "09_vllm_engine.ipynb", as_version=4))


def test_lab_prints_the_port_it_binds_when_the_asked_one_is_taken(capsys):
    """Issue 18.11: with the asked port in use, the link names the port Jupyter will bind (the
    next free one; Jupyter is told not to move off it)."""
    import socket

    from ddtree_lab.cli import main

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        assert main(["lab", "--dry-run", "--port", str(taken)]) == 0
    out = capsys.readouterr().out
    port = int(out.split("--port=")[1].split()[0])
    assert port != taken and f"port {taken} is in use" in out
    assert f"http://127.0.0.1:{port}/lab/tree/" in out and "--ServerApp.port_retries=0" in out
    assert "/.lab" in out


def test_saved_notebooks_hold_no_stale_progress_bar():
    """Issue 18.16: the generators strip progress bars (a saved bar reopens frozen at 0%)."""
    import sys

    sys.path.insert(0, str(LABS.parent / "scripts"))
    try:
        from notebook_outputs import is_progress_bar
    finally:
        sys.path.pop(0)
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        bars = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if is_progress_bar(o)]
        assert not bars, f"{path.name}: a saved progress bar: {bars[0]}"
        assert "Loading weights" not in path.read_text(), path.name


def _outputs(nb) -> str:
    return "".join(str(o.get("text", "")) + str(o.get("data", {}).get("text/html", ""))
                   for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))


def test_saved_notebooks_read_without_the_new_users_stumbles():
    """Issue 26.10 / 26.12, on the saved notebooks: 06 runs every lab backend (Triton
    interpreted on a CPU, set before triton is imported) or says why one did not run; 08's
    detection matrix is a table whose rows never wrap and its timings are not a raw dict; 02
    steps with a named argument, not `session.step(12)`."""
    sg = nbformat.read(LABS / "06_sglang.ipynb", as_version=4)
    first = next(c for c in sg.cells if c.cell_type == "code").source
    assert first.index('os.environ.setdefault("TRITON_INTERPRET", "1")') < first.index("from ddtree_lab import")
    backends = [c for c in sg.cells if c.cell_type == "code" and "lab_verifiers" in c.source][0]
    assert "not run:" in backends.source
    text = _outputs(sg)
    assert "triton: 12 rows" in text or "triton: not run: " in text
    zoo = nbformat.read(LABS / "08_bug_zoo.ipynb", as_version=4)
    text = _outputs(zoo)
    assert 'class="ddtree-table"' in text and "white-space:nowrap" in text and "overflow-x:auto" in text
    assert "{'step_records'" not in text and "with the model" in text
    stepper = nbformat.read(LABS / "02_verify_stepper.ipynb", as_version=4)
    code = "".join(c.source for c in stepper.cells if c.cell_type == "code")
    assert "session.step(12)" not in code and "session.step(max_new_tokens=12)" in code


def test_saved_vllm_notebook_reads_without_a_kernel():
    """09 on its saved outputs: both recordings' texts side by side, the applied-parameters figures
    (log y for the shipped engine's temperatures), the tree as SVG, the shipped run's findings and
    the fixed run's none, both replays; its cells call the library and define nothing."""
    nb = nbformat.read(LABS / "09_vllm_engine.ipynb", as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.get("execution_count") for c in code), "09 is saved unexecuted: run scripts/make_notebook_vllm.py"
    for c in code:
        assert not any(line.lstrip().startswith(("def ", "class ")) or "lambda" in line
                       for line in c.source.splitlines()), c.source
    text = _outputs(nb)
    assert 'class="ddtree-generated"' in text and "ddtree-side-by-side" in text
    assert 'class="ddtree-findings"' in text and "engine-parameters" in text and "no findings" in text
    assert "24 agree with the engine, 42 differ" in text and "55 agree with the engine, 0 differ" in text
    outputs = [o for c in code for o in c.get("outputs", [])]
    figures = [o["data"]["application/vnd.plotly.v1+json"] for o in outputs
               if "application/vnd.plotly.v1+json" in o.get("data", {})]
    assert len(figures) == 2 and all(f["layout"]["yaxis"]["type"] == "log" for f in figures)
    assert any("image/svg+xml" in o.get("data", {}) for o in outputs)
