"""Every notebook in labs/ runs top to bottom on the embedded default; a failing cell fails."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

LABS = Path(__file__).resolve().parent.parent / "labs"
NOTEBOOKS = sorted(LABS.glob("*.ipynb"))

pytestmark = pytest.mark.slow


def test_there_are_notebooks():
    assert NOTEBOOKS, "labs/ has no notebooks"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs_top_to_bottom(path, tmp_path):
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(LABS)}})
    client.execute()  # raises CellExecutionError naming the cell on the first failure
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors


def test_notebooks_are_documents_numbered_in_reading_order():
    """Each notebook opens with a markdown cell saying what it shows and how to use it."""
    for path in NOTEBOOKS:
        assert path.name[:2].isdigit() and path.name[2] == "_", path.name
        nb = nbformat.read(path, as_version=4)
        first = nb.cells[0]
        assert first.cell_type == "markdown" and first.source.startswith("# "), path.name
        assert len(first.source) > 200, f"{path.name}: the opening cell should say what it shows and how to use it"


def test_make_lab_works_on_an_ignored_copy():
    """`make lab` (scripts/lab.sh) opens copies in .lab/, which git ignores: running and saving
    the notebooks leaves `git status` clean."""
    import subprocess

    root = LABS.parent
    script = (root / "scripts" / "lab.sh").read_text()
    assert "--ServerApp.root_dir=.lab" in script and 'cp -p "$nb" "$copy"' in script
    ignored = subprocess.run(["git", "check-ignore", "-q", ".lab/01_live_step.ipynb"], cwd=root)
    assert ignored.returncode == 0, ".lab/ is not ignored by git"
