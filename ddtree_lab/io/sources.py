"""The registry of sources :func:`ddtree_lab.io.load` opens: one :class:`Source` per kind of file, in one ordered tuple.

Each source is a name (``run.source``), ``detect(path) -> bool`` (cheap: a safetensors header,
a segment file's first header, a JSON document's ``format`` or first record; never a tensor,
never code from the file) and ``load(path) -> Run``. :func:`find_source` asks the sources in
:data:`REGISTRY` order and takes the first that claims the path; two sources that can claim
the same file are ordered so that the lab's own formats come first (a lab trace saved under a
``.pt`` name is a lab trace, not DDTree reference traces).

A new source is one module with its ``detect`` and ``load`` functions and one line here::

    Source("my engine", my_engine.looks_like_my_engine, my_engine.load_my_engine_run),

Not sources: :mod:`.parquet` (export only: the tables do not hold a step), :mod:`.synthetic`
(runs generated in memory, no file), :mod:`.live_record` (the writer of ``"lab trace
(append-only)"`` files) and :mod:`.json_records` (JSON reading for the adapters).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable

from ..step import Run
from ..store.container import TraceFormatError, safetensors_damage, safetensors_metadata
from ..store.segments import first_doc, is_segment_file
from . import (acceptance, append_trace, bundle, ddtree_reference, ddtree_reference_run, lab_trace, sglang_recording,
               vllm_recording)

__all__ = ["Source", "REGISTRY", "find_source", "source_names"]


@dataclass(frozen=True)
class Source:
    """One kind of file the lab opens.

    Attributes:
        name: the source's name (``run.source``, ``run.metadata["source"]``).
        detect: ``detect(path) -> bool``, whether the file at ``path`` is this source; reads at
            most a header (or a JSON document's first record), never raises for a file that is
            not this source. ``path`` may not exist (an SGLang recording given as ``NAME``).
        load: ``load(path) -> Run``; raises the source's own format error for a damaged file.
    """

    name: str
    detect: Callable[[Path], bool]
    load: Callable[[Path], Run]


#: Every source, in the order :func:`find_source` asks them (first claim wins).
REGISTRY: tuple[Source, ...] = (
    Source("bundle", bundle.looks_like_bundle, bundle.load_bundle_run),
    Source("lab trace", lab_trace.looks_like_trace_file, partial(lab_trace.read_trace_file, keep_going=True)),
    Source(append_trace.SOURCE, append_trace.looks_like_append_trace, append_trace.load_append_trace),
    Source("sglang recording (append-only)", sglang_recording.looks_like_append_recording,
           sglang_recording.load_append_recording_file),
    Source("sglang recording", sglang_recording.looks_like_recording, sglang_recording.load_recording_run),
    Source("vllm recording", vllm_recording.looks_like_vllm_recording, vllm_recording.load_vllm_recording_run),
    Source("ddtree reference", ddtree_reference.looks_like_reference, ddtree_reference_run.load_reference_run),
    Source("engine summary", acceptance.looks_like_summary, acceptance.load_summary_run),
)


def source_names() -> tuple[str, ...]:
    """The names of the registered sources, in :data:`REGISTRY` order."""
    return tuple(s.name for s in REGISTRY)


def find_source(path: str | Path) -> Source:
    """The first source of :data:`REGISTRY` whose ``detect`` claims ``path``.

    Raises:
        FileNotFoundError: nothing at ``path`` and no source claims it (``NAME`` of a recording).
        TraceFormatError: a file no registered source claims; the message names the path, what
            the file looks like and every registered source.
    """
    p = Path(path)
    for source in REGISTRY:
        if source.detect(p):
            return source
    if not p.exists() and not Path(str(p) + ".ddrec").exists():
        raise FileNotFoundError(f"{p}: no such file")
    raise TraceFormatError(f"{p}: {_looks_like(p)}: not a trace, bundle or recording, nor any file the lab reads "
                           f"(registered sources: {', '.join(source_names())})")


def _json_problem(p: Path) -> str | None:
    """Why a ``.json`` / ``.jsonl`` file is not JSON at all (empty, cut, not text), or None."""
    import json

    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        return f"a .{p.suffix.lower()[1:]} file that cannot be read as text ({exc})"
    if not text.strip():
        return "an empty file"
    lines = [text] if p.suffix.lower() == ".json" else [ln for ln in text.splitlines() if ln.strip()]
    for k, line in enumerate(lines, 1):
        try:
            json.loads(line)
        except json.JSONDecodeError as exc:
            where = f"line {exc.lineno}" if p.suffix.lower() == ".json" else f"record {k}"
            return f"not valid JSON at {where} ({exc.msg}; a file cut short?)"
    return None


def _looks_like(p: Path) -> str:
    """What an unclaimed file looks like, in words (for the error; it decides nothing)."""
    if p.is_dir():
        recordings = sorted(p.glob("*.ddvllm"))
        if recordings:  # vllm recording files that do not open as one
            bad = next((f for f in recordings if not vllm_recording.looks_like_vllm_recording(f)), recordings[0])
            return f"a directory of vLLM recording files, but {bad.name} is not one (its first segment is damaged)"
        if any(p.glob("*.json")) or any(p.glob("*.jsonl")):
            return "a directory: give the file itself (a bundle directory holds bundle.safetensors)"
        return "is not a bundle (no bundle.safetensors in it)"
    seg = p if p.exists() else Path(str(p) + ".ddrec")
    if is_segment_file(seg):
        doc = first_doc(seg)
        return ("an append-only file whose first segment is "
                + ("damaged or cut" if doc is None else f"of format {doc.get('format')!r}"))
    if p.suffix.lower() in (".json", ".jsonl"):
        bad = _json_problem(p)
        if bad is not None:
            return bad
        return "JSON that is neither an SGLang recording, DDTree reference tree traces nor an engine acceptance summary"
    meta = safetensors_metadata(p)
    if meta is None:
        return safetensors_damage(p) or "not a safetensors file (nor JSON)"
    beside = p.with_suffix(".json")
    return ("safetensors without ddtree_lab metadata"
            + (f" and {beside.name} is not an SGLang recording" if beside.exists() else "") + " (drafter weights?)")
