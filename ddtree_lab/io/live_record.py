"""A live session's append-only recording: what :class:`~ddtree_lab.session.LiveSession` writes per step.

:class:`SessionRecorder` is what ``LiveSession(..., record_to=PATH)`` holds: at ``start`` it
opens an append-only trace (:class:`~ddtree_lab.io.append_trace.TraceWriter`) with the run's
metadata; each step it writes the verify inputs *before* the verifier is called
(``inputs_first``: ``"buffers"`` the tree, buffers, coins and parameters; ``"rows"`` also the
target logits of every node, ``[n, V]`` float32 per request, so a step that never returns can
be replayed; ``"off"`` nothing), then the step's records after it returned, with the texts of
the new tokens; when the run ends, the final metadata and an ``end`` segment. Each write costs
O(that step). A write that fails stops the recording (the session goes on): :attr:`stopped`
says why, and a warning is printed once.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from .append_trace import TraceWriter, segment_name_problem

__all__ = ["SessionRecorder", "INPUTS_FIRST"]

INPUTS_FIRST = ("buffers", "rows", "off")


class SessionRecorder:
    """Writes one live session to ``path`` step by step (module docstring).

    Raises:
        ValueError: ``inputs_first`` is not one of :data:`INPUTS_FIRST`, or ``path`` has a
            ``.safetensors`` name (the file is the append-only segment format: NAME.ddtrace).
        FileNotFoundError, IsADirectoryError: from :meth:`open` (the directory is never created).
    """

    def __init__(self, path: str | Path, inputs_first: str = "buffers", *, fsync: bool = False, opener=open):
        if inputs_first not in INPUTS_FIRST:
            raise ValueError(f"inputs_first must be one of {INPUTS_FIRST}, got {inputs_first!r}")
        why = segment_name_problem(path)
        if why is not None:
            raise ValueError(f"record_to={why}")
        self.path, self.inputs_first, self.fsync, self.opener = Path(path), inputs_first, fsync, opener
        self.writer: TraceWriter | None = None
        self.closed = False
        self._warned = False

    @property
    def stopped(self) -> str | None:
        """Why the recording stopped (a failed write), or None while it records."""
        return None if self.writer is None else self.writer.stopped

    def _check(self) -> None:
        if self.stopped is not None and not self._warned:
            self._warned = True
            print(f"ddtree-lab: warning: {self.stopped}; the session goes on without recording", file=sys.stderr)

    def open(self, metadata: dict) -> None:
        """Start the file with the run's metadata (replaces an existing file)."""
        if self.writer is not None and not self.closed:
            self.writer.close("restarted")
        self.writer = TraceWriter(self.path, metadata, fsync=self.fsync, opener=self.opener)
        self.closed = False

    def inputs(self, step_no: int, active, tree, vi, coins: torch.Tensor, final: torch.Tensor, logits, level: str,
               backend: str) -> None:
        """Write the step's verify inputs before the verifier runs (``active``: the requests'
        states, batch order; tree / vi the batch's tree and buffers; coins ``[bs, N]``, final
        ``[bs]``; logits ``[bs, N, V]`` (read only with ``inputs_first="rows"``))."""
        if self.writer is None or self.closed or self.inputs_first == "off":
            return
        records, tensors = [], []
        for b, r in enumerate(active):
            n = int(tree.num_nodes[b])
            local = vi.request(b)
            records.append({"step": step_no, "request": r.request, "request_id": r.request_id,
                            "prefix_len": r.prefix_len, "params": r.params.to_dict(), "level": level,
                            "final_coin": float(final[b]), "backend": backend})
            t = {"node_token_ids": tree.node_token_ids[b, :n], "parents": tree.parents[b, :n],
                 "depths": tree.depths[b, :n], "ranks": tree.ranks[b, :n], "node_logws": tree.node_logws[b, :n].float(),
                 "retrieve_next_token": local.retrieve_next_token[0, :n],
                 "retrieve_next_sibling": local.retrieve_next_sibling[0, :n], "positions": vi.positions[b, :n],
                 "coins": coins[b, :n].float()}
            if self.inputs_first == "rows":
                t["logits"] = logits[b, :n].float()
            tensors.append(t)
        self.writer.write_inputs(records, tensors)
        self._check()

    def steps(self, steps: list, token_text) -> None:
        """Write the step's records (``token_text``: id -> text, for tokens not written yet)."""
        if self.writer is None or self.closed or not steps:
            return
        seen = set()
        for s in steps:
            seen.update(s.token_ids())
        self.writer.write_steps(steps, {t: token_text(t) for t in seen if t not in self.writer.texts_written})
        self._check()

    def close(self, metadata: dict, token_texts: dict[int, str], note: str = "closed") -> None:
        """The final metadata and token texts, then the ``end`` segment."""
        if self.writer is None or self.closed:
            return
        self.writer.write_metadata(metadata, token_texts)
        self.writer.close(note)
        self._check()
        self.closed = True
