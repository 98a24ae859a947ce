"""One way in: ``load(path) -> Run`` for every source the lab reads, one adapter per source.

Sources (:data:`SOURCES`, told apart by their content, never by running anything from them):

* ``"lab trace"`` -- a ``.ddtrace.safetensors`` file (format v1 / v2, :mod:`.lab_trace`);
* ``"lab trace (append-only)"`` -- a live run written step by step (:mod:`.append_trace`, on
  :mod:`.segments`); a cut tail is named in ``Run.problems``, large files open lazily;
* ``"sglang recording (append-only)"`` -- the SGLang recorder's append-only file
  (:mod:`ddtree_lab.sglang.append`): calls that did not return are steps without output;
* ``"bundle"`` -- a bug-report bundle directory or its ``bundle.safetensors``
  (:mod:`.bundle`): one step whose bonus row is the bundle's exact reduction;
* ``"sglang recording"`` -- ``NAME.json`` + ``NAME.safetensors`` written by the SGLang recorder,
  converted step by step (:func:`ddtree_lab.sglang.recording_to_trace`);
* ``"ddtree reference"`` -- the DDTree reference's tree traces (:mod:`.ddtree_reference`);
* ``"engine summary"`` -- an engine's per-request acceptance summary (:mod:`.acceptance`).

A damaged step of a lab trace is named in ``Run.problems`` and left out; the other steps load.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..step import Run
from ..store.container import TraceFormatError
from .lab_trace import read_trace_file
from .lab_trace import save_trace

__all__ = ["load", "convert", "source_of", "SOURCES", "save_trace", "load_trace", "TraceFormatError"]

SOURCES = ("lab trace", "lab trace (append-only)", "bundle", "sglang recording", "sglang recording (append-only)",
           "ddtree reference", "engine summary")


def _safetensors_meta(p: Path) -> dict | None:
    try:
        from safetensors import safe_open

        with safe_open(str(p), framework="pt") as f:
            return f.metadata() or {}
    except Exception:  # not a safetensors file (safetensors raises its own error types)
        return None


def _json_format(p: Path) -> str | None:
    try:
        doc = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return doc.get("format") if isinstance(doc, dict) else None


def source_of(path: str | Path) -> str:
    """Which of :data:`SOURCES` ``path`` is, read from its content (JSON headers and
    safetensors metadata only).

    Raises:
        FileNotFoundError: nothing at ``path`` (nor ``path.json``).
        TraceFormatError: a file none of the sources reads (the message says what it looks like).
    """
    from ..sglang.recording import FORMAT as RECORDING_FORMAT

    p = Path(path)
    if p.is_dir():
        if (p / "bundle.safetensors").is_file():
            return "bundle"
        if any(p.glob("*.json")) or any(p.glob("*.jsonl")):
            return _source_of_json_dir(p)
        raise TraceFormatError(f"{p}: is not a bundle (no bundle.safetensors in it)")
    if p.is_file():
        from ..store.segments import first_doc, is_segment_file

        if is_segment_file(p):
            return _source_of_segments(p, first_doc(p))
    if not p.exists() and Path(str(p) + ".ddrec").is_file():  # the SGLang recorder's NAME.ddrec, named NAME
        from ..store.segments import first_doc

        return _source_of_segments(p, first_doc(str(p) + ".ddrec"))
    if not p.exists():
        if Path(str(p) + ".json").is_file() and _json_format(Path(str(p) + ".json")) == RECORDING_FORMAT:
            return "sglang recording"
        raise FileNotFoundError(f"{p}: no such file")
    if p.suffix in (".json", ".jsonl", ".prom", ".txt"):
        fmt = _json_format(p) if p.suffix == ".json" else None
        if fmt == RECORDING_FORMAT:
            return "sglang recording"
        return _source_of_json(p)
    meta = _safetensors_meta(p)
    if meta is None:
        if p.suffix in (".pt", ".pth"):
            return "ddtree reference"
        raise TraceFormatError(f"{p}: not a safetensors file (nor JSON): not a trace, bundle, recording or summary")
    text = meta.get("ddtree_lab")
    if text is not None:
        try:
            fmt = json.loads(text).get("format")
        except (ValueError, AttributeError):
            fmt = None  # a damaged document: the lab trace reader names the problem
        return "bundle" if fmt == "ddtree-lab-bundle" else "lab trace"
    beside = p.with_suffix(".json")
    if beside.is_file() and _json_format(beside) == RECORDING_FORMAT:
        return "sglang recording"
    raise TraceFormatError(f"{p}: safetensors without ddtree_lab metadata"
                           f"{'' if not beside.exists() else f' and {beside.name} is not an SGLang recording'}: "
                           "not a trace, bundle or recording (drafter weights?)")


def _source_of_json(p: Path) -> str:
    from .source_runs import sniff_source

    kind = sniff_source(p)
    if kind is None:
        raise TraceFormatError(f"{p}: JSON that is neither an SGLang recording, DDTree reference tree traces nor an "
                               "engine acceptance summary")
    return kind


def _source_of_segments(p: Path, doc: dict | None) -> str:
    from ..sglang.append import FORMAT as SGLANG_SEGMENTS
    from .append_trace import FORMAT as TRACE_SEGMENTS

    fmt = None if doc is None else doc.get("format")
    if fmt == TRACE_SEGMENTS:
        return "lab trace (append-only)"
    if fmt == SGLANG_SEGMENTS:
        return "sglang recording (append-only)"
    raise TraceFormatError(f"{p}: an append-only file whose first segment is "
                           f"{'damaged or cut' if doc is None else f'of format {fmt!r}'}: not a lab trace or recording")


def _source_of_json_dir(p: Path) -> str:
    raise TraceFormatError(f"{p}: a directory: give the file itself (a bundle directory holds bundle.safetensors)")


def load(path: str | Path) -> Run:
    """Open any source (:data:`SOURCES`) as a :class:`~ddtree_lab.step.Run`.

    Args:
        path: a trace file, a bundle directory (or its ``bundle.safetensors``), an SGLang
            recording (``NAME``, ``NAME.json`` or ``NAME.safetensors``), DDTree reference tree
            traces, or an engine's acceptance summary.

    Returns:
        the Run; ``run.metadata["source"]`` names the source, each step's ``source`` too, and
        ``run.problems`` lists damaged steps that were left out.

    Raises:
        FileNotFoundError: nothing at ``path``.
        TraceFormatError: not a source the lab reads, or a file too damaged to name any step.
    """
    kind = source_of(path)
    if kind == "lab trace":
        run = load_trace(path, keep_going=True)
    elif kind == "lab trace (append-only)":
        from .append_trace import load_append_trace

        run = load_append_trace(path)
    elif kind == "sglang recording (append-only)":
        from ..sglang.pending import load_append_recording_run

        run = load_append_recording_run(path if Path(path).exists() else str(path) + ".ddrec")
    elif kind == "bundle":
        from .bundle import bundle_run, load_bundle

        run = bundle_run(load_bundle(Path(path).parent if Path(path).is_file() else path))
    elif kind == "sglang recording":
        from ..sglang.recording import load_recording
        from ..sglang.replay import recording_to_trace

        run = recording_to_trace(load_recording(path))
        for s in run.steps:
            s.source = "sglang recording"
    elif kind == "ddtree reference":
        from .source_runs import load_reference_run

        run = load_reference_run(path)
    else:
        from .source_runs import load_summary_run

        run = load_summary_run(path)
    run.metadata.setdefault("source", kind)
    run.metadata.setdefault("path", str(path))
    return run


def load_trace(path: str | Path, keep_going: bool = False) -> Run:
    """A lab trace in either layout: the one-document file (:func:`.lab_trace.read_trace_file`,
    strict unless ``keep_going``) or the append-only one written step by step
    (:func:`.append_trace.load_append_trace`: a cut tail is named in ``run.problems``). The one
    public ``load_trace`` (also ``ddtree_lab.load_trace``); :func:`load` opens every source.

    Raises:
        FileNotFoundError: no such file.
        IsADirectoryError: ``path`` is a directory.
        TraceFormatError: not a ddtree-lab trace, an unknown version, a checksum that fails, or a
            missing / badly typed / badly shaped field (one line: file, step, field).
    """
    from ..store.segments import is_segment_file

    if is_segment_file(path):  # ddtree-lab record, LiveSession(record_to=...)
        from .append_trace import load_append_trace

        return load_append_trace(path)
    return read_trace_file(path, keep_going=keep_going)


def convert(path: str | Path, out: str | Path) -> Path:
    """Write any source :func:`load` opens (an SGLang recording, say) as a lab trace file
    ``out`` (:func:`save_trace`; never creates directories); returns the written path.

    Raises:
        as :func:`load` and :func:`save_trace`; ``ValueError`` for a source whose steps the trace
        format cannot hold (no verify output).
    """
    run = load(path)
    lacking = [f"step {s.step}, request {s.request}" for s in run.steps if s.output is None]
    if lacking:
        raise ValueError(f"{path}: {run.source} steps without a verify output cannot be written as a trace "
                         f"({lacking[0]}{' and more' if len(lacking) > 1 else ''})")
    return save_trace(run, out)
