"""The append-only lab trace: a live run written step by step on segments, read back lazily.

Source ``"lab trace (append-only)"`` of :func:`ddtree_lab.io.load`. The file is a segment
file (:mod:`.segments`); its segments, in the order written:

* ``run``: ``{"format", "version", "metadata", "token_texts"}`` (the first one opens the
  file; later ones update metadata and add token texts; the last one read wins);
* ``inputs``: a step's verify inputs, written *before* the verifier is called
  (``doc["records"]``: per request ``step``, ``request``, ``request_id``, ``prefix_len``,
  ``params``, ``level``, ``final_coin``, ``backend``; tensors ``"{i}.{field}"``: the tree,
  the buffers, the coins, and with ``rows=True`` the target logits ``[n, V]`` of its nodes);
* ``steps``: the step's records after it returned (the lab trace's own step JSON and tensors,
  :func:`~ddtree_lab.io.lab_trace.step_json` / :func:`~ddtree_lab.io.lab_trace.step_tensors`);
* ``end``: written by :meth:`TraceWriter.close` (a file without one was not closed).

A step with ``inputs`` and no ``steps`` record **did not finish** (:data:`DID_NOT_FINISH`: the
process stopped, by an interrupt, a kill or a crash, before its verifier returned; the file
cannot tell a hang from these and does not claim one): it is a :class:`~ddtree_lab.step.Step` with ``output=None`` and
``extra["did_not_return"] = True``, that :func:`ddtree_lab.check` checks, and that
:func:`replay_inputs` verifies with any lab backend when its rows were stored.

Reading (:func:`load_append_trace`) builds an index of records from the segment index alone;
``Run.steps`` is a sequence that decodes a segment when one of its steps is asked for (a few
kept), so a run larger than memory opens in the time it takes to read its index.
"""

from __future__ import annotations

import collections.abc
import json
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from ..sampling import SamplingParams
from ..step import Run, Step
from ..store.container import TraceFormatError
from .lab_trace import check_step_tensors, step_from_json, step_json, step_tensors
from ..store.segments import SegmentEntry, SegmentWriter, first_doc, read_segment, scan

if TYPE_CHECKING:
    from ..verify.types import VerifyOutput

__all__ = ["FORMAT", "VERSION", "SOURCE", "TraceWriter", "load_append_trace", "looks_like_append_trace", "AppendRun", "replay_inputs",
           "INPUT_FIELDS"]

FORMAT = "ddtree-lab-trace-segments"
VERSION = 1
SOURCE = "lab trace (append-only)"
#: why a step whose inputs were written has no output (the file records nothing more)
DID_NOT_FINISH = "did not finish: the process stopped (interrupt, kill or crash) before its verifier returned"
#: tensors of an ``inputs`` record (``logits`` only when rows are stored)
INPUT_FIELDS = ("node_token_ids", "parents", "depths", "ranks", "node_logws", "retrieve_next_token",
                "retrieve_next_sibling", "positions", "coins", "logits")


def segment_name_problem(path: str | Path) -> str | None:
    """Why ``path`` is a wrong name for an append-only lab trace, or None.

    The append-only file is the lab's segment format (:mod:`ddtree_lab.store.segments`), not
    safetensors: under a ``.safetensors`` name ``safetensors.safe_open`` would refuse it. Its
    name ends in ``.ddtrace``; :func:`ddtree_lab.io.convert` writes a one-document safetensors
    trace from it afterwards."""
    name = Path(path).name
    if name.lower().endswith(".safetensors"):
        stem = name[: -len(".safetensors")]
        stem = stem if stem.lower().endswith(".ddtrace") else stem + ".ddtrace"
        return (f"{path}: a live recording is the lab's append-only segment file (crash-safe, one segment per step), "
                f"not safetensors, so it is not written under a .safetensors name: name it {stem} (then "
                f"ddtree_lab.io.convert({stem!r}, {name!r}) writes a real safetensors trace from it)")
    return None


class TraceWriter:
    """Writes a lab run as it is made (module docstring); never raises once open.

    A write that fails (a full disk, ...) stops the recording: :attr:`stopped` then says why
    (one line) and later calls write nothing; the caller goes on.

    Args:
        path: the file (replaced if it exists); ``metadata``: the run's metadata so far.
        fsync, opener: as :class:`~ddtree_lab.store.segments.SegmentWriter`.

    Raises:
        ValueError: a ``.safetensors`` name (:func:`segment_name_problem`).
        FileNotFoundError, IsADirectoryError: as :class:`~ddtree_lab.store.segments.SegmentWriter`.
    """

    def __init__(self, path: str | Path, metadata: dict, *, fsync: bool = False, opener=open):
        why = segment_name_problem(path)
        if why is not None:
            raise ValueError(why)
        self.path = Path(path)
        self._seg = SegmentWriter(self.path, fsync=fsync, opener=opener)
        self.records = 0
        self.texts_written: set[int] = set()  # token ids whose text is in the file
        self._write("run", {"format": FORMAT, "version": VERSION, "metadata": metadata, "token_texts": {}})

    def _write(self, kind: str, doc: dict, tensors: dict | None = None, summary: dict | None = None) -> bool:
        return self._seg.try_append(kind, doc, tensors, summary)

    @property
    def stopped(self) -> str | None:
        """Why the recording stopped (a failed write), or None while it records."""
        return self._seg.stopped

    def write_inputs(self, records: list[dict], tensors: list[dict[str, torch.Tensor]]) -> bool:
        """One step's verify inputs, before the verifier runs (``records[i]`` JSON and
        ``tensors[i]`` of request ``i``, fields :data:`INPUT_FIELDS`); False once stopped."""
        flat = {f"{i}.{k}": v for i, t in enumerate(tensors) for k, v in t.items()}
        summary = {"pending": [[r["step"], r["request"]] for r in records]}
        return self._write("inputs", {"records": records}, flat, summary)

    def write_steps(self, steps: list[Step], token_texts: dict[int, str] | None = None) -> bool:
        """The records of one step (every request), with the texts of tokens not written
        before; False once stopped."""
        tensors = {}
        for i, s in enumerate(steps):
            tensors.update(step_tensors(s, f"{i}."))
        texts = {str(k): v for k, v in (token_texts or {}).items() if int(k) not in self.texts_written}
        for s in steps:
            if s.output is None:
                raise ValueError(f"step {s.step}, request {s.request}: no output to write (a step before its "
                                 "verifier returns goes to write_inputs)")
        summary = {"records": [[s.step, s.request, s.accept_length, bool(_output(s).support_exhausted[0]),
                                s.num_nodes if (s.tree is not None or s.stored_num_nodes is not None) else None]
                               for s in steps]}
        ok = self._write("steps", {"records": [step_json(s) for s in steps], "token_texts": texts}, tensors, summary)
        if ok:
            self.texts_written.update(int(k) for k in texts)
            self.records += len(steps)
        return ok

    def write_metadata(self, metadata: dict, token_texts: dict[int, str] | None = None) -> bool:
        """Updated run metadata (and token texts); the last one written is what a reader sees."""
        texts = {str(k): v for k, v in (token_texts or {}).items()}
        return self._write("run", {"format": FORMAT, "version": VERSION, "metadata": metadata, "token_texts": texts})

    def close(self, note: str = "closed") -> None:
        """Write the ``end`` segment (``note``: e.g. ``"interrupted"``) and close the file."""
        self._write("end", {"records": self.records, "note": note})
        self._seg.close()


def _output(s: Step) -> VerifyOutput:
    assert s.output is not None  # write_steps checked every step first
    return s.output


class _Steps(collections.abc.Sequence):
    """``Run.steps`` of an append-only file: decodes a segment when one of its steps is asked for."""

    def __init__(self, run: "AppendRun"):
        self._run = run

    def __len__(self) -> int:
        return len(self._run.records)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        seg, k = self._run.records[i][:2]
        return self._run.segment_steps(seg)[k]

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]


class AppendRun(Run):
    """A :class:`~ddtree_lab.step.Run` read from an append-only file (module docstring).

    Attributes:
        records: one tuple per step record, in file order: ``(segment, index in segment, step,
            request, accept_length, support_exhausted, num_nodes, did_not_return)``.
        entries: the complete segments (:class:`~ddtree_lab.store.segments.SegmentEntry`).
        closed: whether the writer closed the file (an ``end`` segment).
    """

    CACHE = 4  # decoded segments kept

    # set by load_append_trace (not dataclass fields: the subclass is not a dataclass)
    path: Path
    entries: list[SegmentEntry]
    records: list[tuple]
    closed: bool
    end_note: str | None  # the end segment's note ("closed", "interrupted"), None without one
    tail_cut: str | None  # what follows the last complete segment when the file was cut mid-write
    stop_problems: list[str]  # the problems a recorder stopped early leaves (cut tail, no end)
    _cache: collections.OrderedDict[int, list[Step]]

    def segment_steps(self, seg: int) -> list[Step]:
        """The steps of segment ``seg`` (decoded, checked, cached).

        Raises:
            TraceFormatError: the segment is damaged (naming file, segment and field).
        """
        cache = self._cache
        if seg in cache:
            cache.move_to_end(seg)
            return cache[seg]
        steps = _decode(self.path, self.entries[seg], self.vocab_size)
        cache[seg] = steps
        while len(cache) > self.CACHE:
            cache.popitem(last=False)
        return steps

    def keys(self) -> list[tuple[int, int]]:
        """``(step, request)`` of every record, from the index (nothing decoded)."""
        return [(r[2], r[3]) for r in self.records]

    def for_request(self, request: int) -> list[Step]:
        return [self.steps[i] for i, r in enumerate(self.records) if r[3] == request]

    def find_step(self, step: int, request: int) -> Step:
        for i, r in enumerate(self.records):
            if r[2] == step and r[3] == request:
                return self.steps[i]
        return super().find_step(step, request)  # raises KeyError naming the steps there are

    def pending(self) -> list[tuple[int, int]]:
        """``(step, request)`` of the steps that did not finish (inputs written, no output)."""
        return [(int(r[2]), int(r[3])) for r in self.records if r[7]]

    def partial_line(self) -> str:
        """One line saying what a recording cut short lacks (``"partial: ..."``: the steps that
        did not finish, a segment cut mid-write, no end segment), or ``""`` for a whole file."""
        pending = self.pending()
        what = []
        if pending:
            shown = ", ".join(f"step {s}, request {q}" for s, q in pending[:3]) + (", ..." if len(pending) > 3 else "")
            who = shown if len(pending) == 1 else f"{len(pending)} steps ({shown})"
            what.append(f"{who} {DID_NOT_FINISH} (the inputs are on disk: `ddtree-lab doctor` checks them)")
        if self.tail_cut:
            cut = "is partial" in self.tail_cut  # store.segments.scan: a segment the writer did not finish
            what.append(f"{'the last segment was cut mid-write' if cut else 'the rest of the file is unreadable'} "
                        f"({self.tail_cut})")
        if not self.closed:
            what.append("no end segment (the recorder did not close the file)")
        elif self.end_note not in (None, "closed"):
            what.append(f"closed with note {self.end_note!r}")
        if not pending and not self.tail_cut and self.closed and self.end_note in (None, "closed"):
            return ""
        return "partial: " + "; ".join(what)

    def info_lines(self) -> list[str]:
        """What ``ddtree-lab info`` prints, from the index alone (no step is decoded)."""
        by_request: dict[int, list] = {}
        for r in self.records:
            by_request.setdefault(r[3], []).append(r)
        meta = self.metadata
        reqs = {int(q.get("request", i)): q for i, q in enumerate(meta.get("requests", []))}
        lines = [f"{SOURCE} {self.path}: {len(self.records)} records in {len(self.entries)} segments, "
                 f"{len(by_request)} requests"]
        for role in ("target", "drafter"):
            m = meta.get(role)
            if isinstance(m, dict) and m.get("name"):
                lines.append(f"{role}: {m['name']}")
        lines += [f"problem: {p}" for p in self.problems if p not in self.stop_problems]
        if self.partial_line():
            lines.append(self.partial_line())
        for req in sorted(by_request):
            rs = [r for r in by_request[req] if not r[7]]
            taus = [r[4] + (0 if r[5] else 1) for r in rs]
            rid = reqs.get(req, {}).get("request_id", str(req))
            mean = f"{sum(taus) / len(taus):.3f}" if taus else "-"
            prompt = reqs.get(req, {}).get("prompt")
            lines.append(f"request {req} (id {rid}): {len(rs)} steps, mean tau {mean}"
                         + (f", prompt {json.dumps(prompt)}" if prompt else ""))
        return lines


def _input_step(path: Path, js: dict, t: dict) -> Step:
    fields = {k: t[k] for k in INPUT_FIELDS if k in t and k != "logits"}
    return Step.from_fields(step=int(js["step"]), request=int(js["request"]), request_id=str(js["request_id"]),
                            prefix_len=js.get("prefix_len"), params=SamplingParams.from_dict(js["params"]),
                            output=None, final_coin=js.get("final_coin"), level=str(js.get("level", "light")),
                            backend=str(js.get("backend", "?")), source=SOURCE,
                            extra={"did_not_return": True, "rows_stored": "logits" in t, "why": DID_NOT_FINISH},
                            **fields)


def _decode(path: Path, entry: SegmentEntry, vocab: int | None) -> list[Step]:
    kind, doc, tensors = read_segment(path, entry)
    by = {}
    for key, value in tensors.items():
        i, _, name = key.partition(".")
        by.setdefault(int(i), {})[name] = value
    out = []
    for i, js in enumerate(doc["records"]):
        where = f"{path}: segment at byte {entry.offset}, record {i} (step {js.get('step')}, request {js.get('request')})"
        try:
            if kind == "inputs":
                step = _input_step(path, js, by.get(i, {}))
                # tensors, for replay_inputs (extra stays JSON); not a Step field, read back by getattr
                setattr(step, "stored_inputs", dict(by.get(i, {})))
            else:
                check_step_tensors(where, js, by.get(i, {}), vocab, 2)
                step = step_from_json(js, by.get(i, {}), where)
                step.source = SOURCE
        except TraceFormatError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise TraceFormatError(f"{where}: bad field ({exc!r})") from exc
        out.append(step)
    return out


def looks_like_append_trace(path: str | Path) -> bool:
    """Whether ``path`` is a lab trace written step by step: a segment file whose first segment
    is complete and of :data:`FORMAT` (reads that segment's header only). Source
    :data:`SOURCE` of :func:`ddtree_lab.io.load`."""
    doc = first_doc(path)
    return doc is not None and doc.get("format") == FORMAT


EAGER_BYTES = 64 << 20  # files up to this size are decoded (and every checksum checked) when opened


def load_append_trace(path: str | Path, lazy: bool | None = None) -> AppendRun:
    """Open an append-only trace (module docstring). Never raises for a cut or damaged tail:
    it is named in ``run.problems`` (one line) and every complete segment before it loads.

    ``lazy``: decode steps when asked for (default: for files over :data:`EAGER_BYTES`); when
    not lazy, every step is decoded now and a damaged segment's records are left out and named
    in ``problems``. A lazy run raises :class:`TraceFormatError` when a damaged step is read.

    Raises:
        FileNotFoundError: no such file.
        TraceFormatError: not an append-only trace, or its first (``run``) segment is damaged.
    """
    path = Path(path)
    entries, tail = scan(path)
    problems = [] if tail.why is None else [tail.why]
    if not entries or entries[0].kind != "run":
        raise TraceFormatError(f"{path}: no complete run segment at the start"
                               + (f" ({tail.why})" if tail.why else ""))
    meta, texts = {}, {}
    for e in entries:
        if e.kind == "run":
            _, doc, _ = read_segment(path, e)
            if doc.get("format") != FORMAT or doc.get("version") != VERSION:
                raise TraceFormatError(f"{path}: format {doc.get('format')!r} version {doc.get('version')!r} is not "
                                       f"{FORMAT!r} version {VERSION}")
            meta = doc.get("metadata") or {}
            texts.update({int(k): str(v) for k, v in (doc.get("token_texts") or {}).items()})
    done = {(s, q) for e in entries if e.kind == "steps" for s, q, *_ in e.summary.get("records", [])}
    records = []
    for seg, e in enumerate(entries):
        if e.kind == "steps":
            records += [(seg, k, s, q, a, x, n, False) for k, (s, q, a, x, n) in enumerate(e.summary["records"])]
        elif e.kind == "inputs":
            records += [(seg, k, s, q, 0, False, None, True) for k, (s, q) in enumerate(e.summary["pending"])
                        if (s, q) not in done]
    run = AppendRun(metadata=meta, steps=[], token_texts=texts, problems=problems)
    run.path, run.entries, run.records = path, entries, records
    run.closed = any(e.kind == "end" for e in entries)
    run.end_note = None
    if run.closed:
        try:
            run.end_note = read_segment(path, [e for e in entries if e.kind == "end"][-1])[1].get("note")
        except TraceFormatError:
            run.end_note = None
    # a cut tail: only the cut itself (the path and the segment are named in problems)
    run.tail_cut = None if tail.why is None else tail.why.removeprefix(f"{path}: ")
    run.stop_problems = list(problems)  # what stopping the recorder left: named once, as info's "partial:" line
    run._cache = collections.OrderedDict()
    run.metadata.setdefault("top_m_logits", None)
    if lazy is None:
        lazy = path.stat().st_size > EAGER_BYTES
    if lazy:
        run.steps = cast("list[Step]", _Steps(run))  # a lazy read-only Sequence stands in for the list
        run.metadata["lazy"] = True
    else:
        steps, keep = [], []
        for r in records:
            try:
                steps.append(run.segment_steps(r[0])[r[1]])
                keep.append(r)
            except TraceFormatError as exc:
                msg = f"{exc} (step {r[2]}, request {r[3]} left out)"
                if msg not in run.problems:
                    run.problems.append(msg)
                run.left_out[(int(r[2]), int(r[3]))] = str(exc)
        run.records, run.steps = keep, steps
    run.token_texts.update(_step_texts(path, entries) if not lazy else {})
    if not run.closed and tail.why is None:
        note = (f"{path}: not closed: the recorder stopped after segment {len(entries) - 1} without writing its end "
                f"(the process was interrupted, killed or crashed); the {len(run.records)} records written before it "
                "stopped are read")
        run.problems.append(note)
        run.stop_problems.append(note)
    return run


def _step_texts(path: Path, entries: list[SegmentEntry]) -> dict[int, str]:
    texts = {}
    for e in entries:
        if e.kind == "steps":
            try:
                _, doc, _ = read_segment(path, e)
            except TraceFormatError:
                continue
            texts.update({int(k): str(v) for k, v in (doc.get("token_texts") or {}).items()})
    return texts


def replay_inputs(step: Step, backend: str = "reference"):
    """Verify a step that did not return from its stored inputs with a lab backend
    (:func:`ddtree_lab.verify.verify_tree` on the stored logits, coins and parameters).

    Returns:
        the :class:`~ddtree_lab.verify.VerifyOutput` (a batch of one).

    Raises:
        ValueError: the step is not one that did not return, or its rows were not stored
            (record with ``inputs_first="rows"``).
    """
    from ..verify import verify_tree

    inputs = getattr(step, "stored_inputs", None)
    where = f"step {step.step}, request {step.request}"
    if not step.extra.get("did_not_return") or inputs is None:
        raise ValueError(f"{where}: not a step that did not return (it has an output: use ddtree_lab.replay)")
    if "logits" not in inputs:
        raise ValueError(f"{where}: its target rows were not stored before the call (record with "
                         "inputs_first='rows'): check() runs on its buffers, replay cannot")
    if step.params is None:
        raise ValueError(f"{where}: its sampling parameters were not stored: replay cannot verify it")
    if step.coins is None:
        raise ValueError(f"{where}: its coins were not stored: replay cannot verify it")
    final = torch.tensor([0.0 if step.final_coin is None else float(step.final_coin)], dtype=torch.float32)
    return verify_tree(step.verify_input(), inputs["logits"][None].float(), [step.params], step.coins[None], final,
                       backend=backend)
