"""The bug-report bundle's file and its reduced bonus row: read a bundle back as a Step (the format; ddtree_lab.bundle makes and writes them).

The reduction (module :mod:`ddtree_lab.bundle` states why it is exact): the bonus draw reads the
residual row only through its float64 running sum up to the drawn token, so a bundle keeps that
sum at a chunk boundary ``c`` (``final_row_base``), ``c`` and the row at ``c .. t``
(``final_row_tail``); :meth:`Bundle.final_row_prefix` rebuilds a prefix the reference verifier
reads exactly as it read the original.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..step import Run, Step
from ..store.container import read_container
from .lab_trace import TraceFormatError, check_step_tensors, step_from_json

__all__ = ["Bundle", "FORMAT", "VERSION", "CHUNK", "FILES", "load_bundle", "bundle_step", "bundle_run",
           "reduce_bonus_row", "children_tokens", "residual_cumsum", "dense_prefix", "float32_pieces"]


FORMAT = "ddtree-lab-bundle"


VERSION = 1


CHUNK = 64  # tokens of the bonus row kept verbatim (at most)


FILES = ("bundle.safetensors", "tree.svg", "README.md")


@dataclass
class Bundle:
    """One verify step, reduced to what replays it exactly (module docstring).

    Attributes:
        step: the :class:`Step` (level ``"light"``; ``final_row_prefix`` is None, the
            bonus row is the three fields below).
        final_row_start: ``c``, the first token of the stored tail.
        final_row_base: float64, the residual's running sum over tokens ``[0, c)``.
        final_row_tail: ``[t + 1 - c]`` float32, the bonus row at tokens ``c .. t``.
        token_texts: texts of the tokens the step mentions.
        svg: the step's diagram.
        metadata: source trace, target / tokenizer / drafter names, ``vocab_size``.
    """

    step: Step
    final_row_start: int
    final_row_base: float
    final_row_tail: torch.Tensor
    token_texts: dict[int, str] = field(default_factory=dict)
    svg: str = ""
    metadata: dict = field(default_factory=dict)

    @property
    def vocab_size(self) -> int | None:
        v = self.metadata.get("vocab_size")
        return None if v is None else int(v)

    def rejected_tokens(self) -> list[int]:
        """Tokens of the children of the bonus node (all rejected: the walk ended there)."""
        return children_tokens(self.step, self.step.bonus.node)

    def final_row_prefix(self) -> torch.Tensor:
        """``[t + 1]`` float32: a bonus row prefix the reference draw reads exactly as the
        original (module docstring); empty when the support was exhausted."""
        tail, c = self.final_row_tail, self.final_row_start
        if self.step.bonus_token < 0:
            return torch.zeros(0)
        return dense_prefix(c, self.final_row_base, tail, self.rejected_tokens())


def children_tokens(step: Step, node: int) -> list[int]:
    nt, ns, tokens = step.retrieve_next_token.tolist(), step.retrieve_next_sibling.tolist(), step.node_token_ids.tolist()
    out, child, hops = [], nt[node], 0
    while child != -1 and hops <= len(tokens):
        out.append(tokens[child])
        child, hops = ns[child], hops + 1
    return out


def float32_pieces(base: float) -> list[np.float32]:
    """float32 values whose sequential float64 sum is exactly ``base`` (each the float32
    truncation toward zero of what is left), or [] for 0."""
    out, rest = [], float(base)
    while rest != 0.0 and len(out) < 6:
        p = np.float32(rest)
        if float(p) > rest:
            p = np.nextafter(p, np.float32(0))
        out.append(p)
        rest = rest - float(p)  # exact: p is a leading-digit truncation of rest
    return out


def dense_prefix(start: int, base: float, tail: torch.Tensor, rejected: list[int]) -> torch.Tensor:
    prefix = torch.zeros(start + tail.shape[0], dtype=torch.float32)
    prefix[start:] = tail
    pieces = float32_pieces(base)
    banned = set(rejected)
    free = [j for j in range(start) if j not in banned][: len(pieces)]
    if len(free) < len(pieces):
        raise TraceFormatError(f"bundle: no room below token {start} for the running sum {base!r}")
    for j, p in zip(free, pieces):
        prefix[j] = float(p)
    return prefix


def residual_cumsum(prefix: torch.Tensor, rejected: list[int]) -> torch.Tensor:
    residual = prefix.double().clone()  # as ddtree_lab.verify.residual_draw does
    idx = [t for t in rejected if t < residual.shape[0]]
    if idx:
        residual[torch.tensor(idx, dtype=torch.int64)] = 0.0
    return residual.cumsum(0)


def reduce_bonus_row(step: Step) -> tuple[int, float, torch.Tensor]:
    """``(c, base, tail)`` for the step's bonus row (module docstring)."""
    prefix = step.final_row_prefix
    t = prefix.shape[0] - 1
    if t < 0:
        return 0, 0.0, torch.zeros(0)
    rejected = children_tokens(step, step.bonus.node)
    cum = residual_cumsum(prefix, rejected)
    c = (t // CHUNK) * CHUNK
    if c > 0:
        base = float(cum[c - 1])
        tail = prefix[c:].clone()
        try:
            dense = dense_prefix(c, base, tail, rejected)
        except TraceFormatError:
            dense = None
        if dense is not None and torch.equal(residual_cumsum(dense, rejected)[c - 1:], cum[c - 1:]):
            return c, base, tail
    return 0, 0.0, prefix.clone()


def load_bundle(directory: str | Path) -> Bundle:
    """Read a bundle written by :func:`save_bundle` (checksums, shapes and ranges checked).

    Raises:
        FileNotFoundError: no bundle there.
        TraceFormatError: a corrupted or inconsistent bundle (one line naming file and field).
    """
    directory = Path(directory)
    path = directory / "bundle.safetensors" if directory.is_dir() else directory
    doc, tensors = read_container(path, FORMAT, (VERSION,), what="bundle")
    try:
        js = doc["steps"][0]
        row = doc["final_row"]
        start, base = int(row["start"]), float(row["base"])
        t = {k.partition(".")[2]: v for k, v in tensors.items()}
        tail = t.pop("final_row_tail")
        meta = doc.get("metadata") or {}
        vocab = meta.get("vocab_size")
        check_step_tensors(f"{path}: step 0", js, t, int(vocab) if isinstance(vocab, int) else None, 2,
                           exempt=("final_row_prefix",))
        step = step_from_json(js, t, f"{path}: step 0")
        step.rows.kind = "bundle"
        step.source = "bundle"
        texts = {int(k): str(v) for k, v in (doc.get("token_texts") or {}).items()}
    except TraceFormatError:
        raise
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
        raise TraceFormatError(f"{path}: bad field ({exc!r})") from exc
    bonus = int(js["bonus_token"])
    if tail.dim() != 1 or (bonus >= 0 and start + tail.shape[0] != bonus + 1) or start < 0 or not math.isfinite(base):
        raise TraceFormatError(f"{path}: field 'final_row_tail': tokens {start}..{start + tail.shape[0] - 1} do not "
                               f"end at the bonus token {bonus}")
    svg_path = directory / "tree.svg" if directory.is_dir() else path.with_name("tree.svg")
    svg = svg_path.read_text(encoding="utf-8") if svg_path.is_file() else ""
    return Bundle(step=step, final_row_start=start, final_row_base=base, final_row_tail=tail, token_texts=texts,
                  svg=svg, metadata=meta)


def bundle_step(bundle: Bundle) -> Step:
    """The bundle's step with its bonus row rebuilt from the reduction (rows kind ``"bundle"``):
    what :func:`ddtree_lab.replay` and the views read."""
    rows = dataclasses.replace(bundle.step.rows, final_row_prefix=bundle.final_row_prefix())
    return dataclasses.replace(bundle.step, rows=rows, source="bundle")


def bundle_run(bundle: Bundle) -> Run:
    """A bundle as a :class:`~ddtree_lab.step.Run` of its one step (:func:`ddtree_lab.io.load`)."""
    meta = {**bundle.metadata, "bundle_source": bundle.metadata.get("source"), "source": "bundle"}
    return Run(metadata=meta, steps=[bundle_step(bundle)], token_texts=dict(bundle.token_texts))
