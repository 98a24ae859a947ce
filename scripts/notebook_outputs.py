"""Execute a generated notebook for its saved outputs, without progress bars frozen at 0%.

A progress bar (transformers' "Loading weights", tqdm) is a live widget: saved in a notebook
it reopens as a stale "0%" line. :func:`execute` runs the notebook and drops those outputs;
every other output is kept.
"""

from __future__ import annotations

import re
from pathlib import Path

from nbclient import NotebookClient

__all__ = ["execute", "strip_progress_bars", "is_progress_bar", "write_notebook", "main_for"]

#: a tqdm bar's text: "Loading weights:   0%|          | 0/272 [00:00<?, ?it/s]"
_BAR = re.compile(r"\d+%\|.*\|\s*\d+/\d+")


def is_progress_bar(output) -> bool:
    """The output is a progress bar (tqdm text, or the widget of a notebook tqdm bar)."""
    if output.get("output_type") == "stream":
        return bool(_BAR.search(output.get("text", ""))) and not output.get("text", "").strip("\r\n ").count("\n")
    data = output.get("data", {})
    text = data.get("text/plain", "")
    text = "".join(text) if isinstance(text, list) else text
    return bool(_BAR.search(text)) and (("application/vnd.jupyter.widget-view+json" in data) or "\n" not in text.strip())


def strip_progress_bars(nb) -> int:
    """Remove progress-bar outputs from every code cell in place; returns how many."""
    count = 0
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        keep = [o for o in cell.get("outputs", []) if not is_progress_bar(o)]
        count += len(cell.get("outputs", [])) - len(keep)
        cell.outputs = keep
    return count


def execute(nb, labs: Path, timeout: int = 900):
    """Run ``nb`` with ``labs`` as its working directory, then strip its progress bars.

    Raises:
        nbclient.exceptions.CellExecutionError: a cell failed (naming it).
    """
    NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(labs)}}).execute()
    strip_progress_bars(nb)
    return nb


def write_notebook(cells, labs: Path, name: str, run: bool = True, timeout: int = 900) -> None:
    """Make a notebook of ``cells`` (``("md" | "code", source)`` pairs), execute it in ``labs``
    for its saved outputs unless ``run`` is false, and write it as ``labs / name``."""
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_markdown_cell(s) if k == "md" else nbformat.v4.new_code_cell(s) for k, s in cells]
    if run:
        execute(nb, labs, timeout=timeout)
    nbformat.write(nb, labs / name)
    print(f"wrote labs/{name}")


def main_for(doc: str, cells, labs: Path, name: str) -> None:
    """A generator script's command line: ``[--no-execute]``, then :func:`write_notebook`."""
    import argparse

    ap = argparse.ArgumentParser(description=doc)
    ap.add_argument("--no-execute", action="store_true")
    args = ap.parse_args()
    write_notebook(cells, labs, name, run=not args.no_execute)
