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
