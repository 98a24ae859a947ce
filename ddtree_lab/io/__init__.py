"""One way in: ``load(path) -> Run`` for every source the lab reads, through one registry of sources.

The sources (:data:`.sources.REGISTRY`, each a name, ``detect(path)`` and ``load(path)``, told
apart by their content, never by running anything from them; :data:`SOURCES` lists their names):

* ``"bundle"`` -- a bug-report bundle directory or its ``bundle.safetensors``
  (:mod:`.bundle`): one step whose bonus row is the bundle's exact reduction;
* ``"lab trace"`` -- a ``.ddtrace.safetensors`` file (format v1 / v2, :mod:`.lab_trace`);
* ``"lab trace (append-only)"`` -- a live run written step by step (:mod:`.append_trace`, on
  :mod:`ddtree_lab.store.segments`); a cut tail is named in ``Run.problems``, large files open lazily;
* ``"sglang recording (append-only)"`` and ``"sglang recording"`` -- the SGLang recorder's
  files (:mod:`.sglang_recording`): calls that did not return are steps without output; a
  ``NAME.json`` + ``NAME.safetensors`` recording is converted step by step;
* ``"vllm recording"`` -- vLLM's real engine recorded from inside (:mod:`.vllm_recording`,
  :mod:`ddtree_lab.vllm`): one chain step per engine step and request;
* ``"ddtree reference"`` -- the DDTree reference's tree traces (:mod:`.ddtree_reference` reads them,
  :mod:`.ddtree_reference_run` makes the Run);
* ``"engine summary"`` -- an engine's per-request acceptance summary (:mod:`.acceptance`).

A new source is one module and one line in :data:`.sources.REGISTRY`. A damaged step of a lab
trace is named in ``Run.problems`` and left out; the other steps load.
"""

from __future__ import annotations

from pathlib import Path

from ..step import Run
from ..store.container import TraceFormatError
from . import sources
from .lab_trace import read_trace_file
from .lab_trace import save_trace

__all__ = ["load", "convert", "source_of", "SOURCES", "save_trace", "load_trace", "TraceFormatError"]

#: The names of the registered sources (:data:`.sources.REGISTRY` order).
SOURCES = sources.source_names()


def source_of(path: str | Path) -> str:
    """Which registered source (:data:`SOURCES`) ``path`` is, read from its content (headers
    only: :func:`.sources.find_source`).

    Raises:
        FileNotFoundError: nothing at ``path`` (nor ``path.json`` / ``path.ddrec``).
        TraceFormatError: a file none of the sources reads (the message says what it looks like
            and lists the registered sources).
    """
    return sources.find_source(path).name


def load(path: str | Path) -> Run:
    """Open any registered source (:data:`SOURCES`) as a :class:`~ddtree_lab.step.Run`.

    Args:
        path: a trace file, a bundle directory (or its ``bundle.safetensors``), an SGLang
            recording (``NAME``, ``NAME.json`` or ``NAME.safetensors``; ``NAME.ddrec``), DDTree
            reference tree traces, or an engine's acceptance summary.

    Returns:
        the Run; ``run.metadata["source"]`` names the source, each step's ``source`` too, and
        ``run.problems`` lists damaged steps that were left out.

    Raises:
        FileNotFoundError: nothing at ``path``.
        TraceFormatError: not a source the lab reads, or a file too damaged to name any step.
    """
    source = sources.find_source(path)
    run = source.load(Path(path))
    run.metadata.setdefault("source", source.name)
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
