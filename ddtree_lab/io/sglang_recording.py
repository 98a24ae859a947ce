"""The SGLang recorder's two files as sources of :func:`ddtree_lab.io.load` (the formats live in :mod:`ddtree_lab.sglang`).

* ``"sglang recording"``: ``NAME.json`` + ``NAME.safetensors`` (:mod:`ddtree_lab.sglang.recording`),
  given as ``NAME``, ``NAME.json`` or ``NAME.safetensors``; converted step by step
  (:func:`ddtree_lab.sglang.recording_to_trace`).
* ``"sglang recording (append-only)"``: the segment file ``NAME.ddrec`` (given as ``NAME`` or
  the file itself) that :class:`ddtree_lab.sglang.append.AppendSink` writes; calls that did not
  return are steps without output (:func:`ddtree_lab.sglang.pending.load_append_recording_run`).

Telling them apart reads the JSON document's ``format`` or the first segment's header; no
tensor is read and nothing from the file runs.
"""

from __future__ import annotations

from pathlib import Path

from ..step import Run
from ..store.container import safetensors_metadata
from ..store.segments import first_doc
from .json_records import json_format

__all__ = ["looks_like_recording", "load_recording_run", "looks_like_append_recording", "load_append_recording_file"]


def _recording_format() -> str:
    from ..sglang.recording import FORMAT

    return FORMAT


def looks_like_recording(path: str | Path) -> bool:
    """Whether ``path`` names an SGLang recording: ``NAME.json`` whose ``format`` is the
    recorder's, ``NAME`` with such a ``NAME.json`` beside it, or a safetensors file without a
    ``"ddtree_lab"`` document beside such a JSON file."""
    path = Path(path)
    fmt = _recording_format()
    if not path.exists():
        beside = Path(str(path) + ".json")
        return beside.is_file() and json_format(beside) == fmt
    if not path.is_file():
        return False
    if path.suffix == ".json":
        return json_format(path) == fmt
    beside = path.with_suffix(".json")
    if not beside.is_file() or json_format(beside) != fmt:
        return False
    meta = safetensors_metadata(path)
    return meta is not None and "ddtree_lab" not in meta


def load_recording_run(path: str | Path) -> Run:
    """An SGLang recording as a lab :class:`~ddtree_lab.step.Run` (each step's ``source``
    ``"sglang recording"``).

    Raises:
        FileNotFoundError, ddtree_lab.sglang.RecordingFormatError: as
            :func:`ddtree_lab.sglang.load_recording`.
    """
    from ..sglang.recording import load_recording
    from ..sglang.replay import recording_to_trace

    run = recording_to_trace(load_recording(path))
    for s in run.steps:
        s.source = "sglang recording"
    return run


def _append_path(path: Path) -> Path:
    """The segment file itself, or ``NAME.ddrec`` for a ``NAME`` that does not exist."""
    return path if path.exists() else Path(str(path) + ".ddrec")


def looks_like_append_recording(path: str | Path) -> bool:
    """Whether ``path`` (or ``path.ddrec`` when ``path`` does not exist) is a segment file whose
    complete first segment has the recorder's append-only format."""
    from ..sglang.recording import APPEND_FORMAT

    doc = first_doc(_append_path(Path(path)))
    return doc is not None and doc.get("format") == APPEND_FORMAT


def load_append_recording_file(path: str | Path) -> Run:
    """:func:`ddtree_lab.sglang.pending.load_append_recording_run` of ``path`` (or of
    ``path.ddrec`` when ``path`` does not exist).

    Raises:
        as :func:`ddtree_lab.sglang.recording.load_append_recording`.
    """
    from ..sglang.pending import load_append_recording_run

    return load_append_recording_run(_append_path(Path(path)))
