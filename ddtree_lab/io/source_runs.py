"""Tell the two outside sources apart and open them as Runs (the adapters do the work).

``io.load`` calls these: :func:`sniff_source` picks the adapter from a file's name and first
record; :func:`load_reference_run` (:mod:`.ddtree_reference`) and :func:`load_summary_run`
(:mod:`.acceptance`) read and convert. Nothing here validates a file.
"""

from __future__ import annotations

from pathlib import Path

from .acceptance import load_summary_run, looks_like_summary
from .ddtree_reference import load_reference_run, looks_like_reference

__all__ = ["sniff_source", "load_reference_run", "load_summary_run"]


def sniff_source(path: str | Path) -> str | None:
    """``"ddtree reference"``, ``"engine summary"`` or None (neither) for ``path``: ``.pt`` /
    ``.pth`` are reference traces (the lab writes none), ``.prom`` vLLM ``/metrics`` text;
    JSON / JSONL by their first record (:func:`~.ddtree_reference.looks_like_reference`,
    :func:`~.acceptance.looks_like_summary`); a ``.txt`` holding ``vllm:spec_decode_`` counters
    is ``/metrics`` text."""
    path = Path(path)
    if looks_like_reference(path):
        return "ddtree reference"
    if looks_like_summary(path):
        return "engine summary"
    if path.suffix.lower() == ".txt" and path.is_file():
        try:
            if "vllm:spec_decode_" in path.read_text():
                return "engine summary"
        except (OSError, UnicodeDecodeError):
            return None
    return None
