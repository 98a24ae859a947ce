"""The SGLang recorder's append-only file: a call's inputs on disk before its kernel runs, outputs after.

Source ``"sglang recording (append-only)"`` of :func:`ddtree_lab.io.load`, written by
:class:`AppendSink` (what :func:`~ddtree_lab.sglang.environment.install_from_env` uses). A
segment file (:mod:`ddtree_lab.store.segments`) whose segments are:

* ``run``: ``{"format", "version", "metadata"}`` (the recorder's metadata; later ``run``
  segments update it: errors, calls seen, prompts);
* ``inputs``, written *before* the kernel is called: the recorded step's fields
  (:mod:`ddtree_lab.sglang.recording`) known then -- ``kind``, ``call``, ``rank``, ``kernel``,
  ``rows``, ``request_ids``, ``draft_token_num``, thresholds, sampling -- and its input tensors
  (``candidates``, the three ``retrive_*``, ``seq_lens``, greedy ``target_predict``, sampled
  coins, chain ``draft_probs``; with ``prob_rows="all"`` every target-probability row of the
  kept rows, ``target_prob_rows [r, N, V]``: all the kernel could read);
* ``outputs``, written after it returned: ``call``, ``num_speculative_tokens`` and the output
  tensors (``predicts``, ``accept_index``, ``accept_token_num``; with ``prob_rows="path"``
  the rows of the accepted path, read after the call as before).

A call with ``inputs`` and no ``outputs`` **did not return** (its kernel hung or crashed the
process). :func:`ddtree_lab.sglang.recording.load_append_recording` returns the completed calls as a
:class:`~ddtree_lab.sglang.recording.Recording` and the others apart;
:func:`ddtree_lab.sglang.pending.load_append_recording_run` the lab :class:`~ddtree_lab.step.Run` (completed calls
converted as :func:`~ddtree_lab.sglang.replay.recording_to_trace` does; each row of a call
that did not return a step with ``output=None`` that :func:`ddtree_lab.check` checks and
:func:`ddtree_lab.sglang.pending.replay_pending` verifies with any lab backend: greedy always, sampled when the rows were
stored, ``prob_rows="all"``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..store.segments import SegmentWriter
from .recording import APPEND_FORMAT as FORMAT
from .recording import APPEND_VERSION as VERSION

__all__ = ["FORMAT", "VERSION", "AppendSink"]

_OUTPUTS = ("predicts", "accept_index", "accept_token_num", "target_prob_rows", "target_prob_nodes")


class AppendSink:
    """Where an :class:`~ddtree_lab.sglang.recorder.SGLangRecorder` writes each call as it
    happens (module docstring). It never raises into SGLang: a failed write stops the
    recording and :attr:`stopped` says why (the recorder adds it to its ``errors``).

    Raises:
        FileNotFoundError: the directory of ``path`` does not exist (at construction only).
    """

    def __init__(self, path: str | Path, metadata: dict, *, fsync: bool = False, opener=open):
        self.path = Path(path)
        self._seg = SegmentWriter(self.path, fsync=fsync, opener=opener)
        self._write("run", {"format": FORMAT, "version": VERSION, "metadata": metadata})

    def _write(self, kind: str, doc: dict, tensors: dict | None = None, summary: dict | None = None) -> bool:
        return self._seg.try_append(kind, doc, tensors, summary)

    @property
    def stopped(self) -> str | None:
        """Why the recording stopped (a failed write), or None while it records."""
        return self._seg.stopped

    def inputs(self, step: dict) -> bool:
        """A call's fields and input tensors (``step["tensors"]``), before the kernel runs."""
        doc = {k: v for k, v in step.items() if k != "tensors"}
        return self._write("inputs", doc, dict(step["tensors"]), {"call": step["call"]})

    def outputs(self, call: int, num_speculative_tokens: int, tensors: dict[str, torch.Tensor]) -> bool:
        """A call's outputs after it returned (only :data:`_OUTPUTS` names are written)."""
        t = {k: v for k, v in tensors.items() if k in _OUTPUTS}
        return self._write("outputs", {"call": call, "num_speculative_tokens": num_speculative_tokens}, t,
                           {"call": call})

    def metadata(self, metadata: dict) -> bool:
        """Updated run metadata (errors, calls seen, prompts); the last one wins."""
        return self._write("run", {"format": FORMAT, "version": VERSION, "metadata": metadata})

    def close(self) -> None:
        self._seg.close()


