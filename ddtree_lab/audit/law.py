"""The exact law a lossless verifier emits on one audit case (whole sequences, or first token x accepted depth)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .case import AuditCase

__all__ = ["ExactLaw", "exact_law"]


@dataclass
class ExactLaw:
    """The exact law of a lossless verifier's outcome on one case.

    ``kind`` is ``"sequence"`` (outcome: the emitted token tuple) or ``"first-depth"``
    (outcome: ``(first emitted token, accepted depth)``); ``probs`` maps outcome -> probability
    (float64, only positive entries).
    """

    kind: str
    probs: dict

    def first_token(self) -> dict:
        out: dict = {}
        for k, p in self.probs.items():
            t = k[0] if k else -1
            out[t] = out.get(t, 0.0) + p
        return out

    def depth(self) -> dict:
        out: dict = {}
        for k, p in self.probs.items():
            d = len(k) - 1 if self.kind == "sequence" else k[1]
            out[d] = out.get(d, 0.0) + p
        return out


def _dedup(kids: list[int], tokens: list[int]) -> list[int]:
    seen, out = set(), []
    for c in kids:
        if tokens[c] not in seen:
            seen.add(tokens[c])
            out.append(c)
    return out


def exact_law(case: AuditCase, kind: str = "auto", max_outcomes: int = 200_000) -> ExactLaw:
    """The exact law of what a lossless verifier emits on ``case`` (module docstring).

    Args:
        kind: ``"sequence"``, ``"first-depth"`` or ``"auto"`` (sequence when ``N * V`` is at
            most 4096).
        max_outcomes: refuse a sequence enumeration larger than this.

    Returns:
        :class:`ExactLaw` (probabilities in float64 from the float32 target rows).

    Raises:
        ValueError: unknown kind, or an enumeration too large.
    """
    if kind == "auto":
        kind = "sequence" if case.verify_input.num_rows * case.vocab_size <= 4096 else "first-depth"
    if kind not in ("sequence", "first-depth"):
        raise ValueError(f"kind must be 'sequence', 'first-depth' or 'auto', got {kind!r}")
    probs = case.probs().double().cpu().numpy()
    tokens = case.verify_input.node_token_ids[0].tolist()
    kids = {i: _dedup(k, tokens) for i, k in case.children().items()}
    if kind == "sequence":
        law: dict = {}

        def walk(node: int, prefix: tuple, weight: float) -> None:
            child_of = {tokens[c]: c for c in kids[node]}
            row = probs[node]
            for v in np.nonzero(row > 0)[0].tolist():
                w = weight * row[v]
                if v in child_of:
                    walk(child_of[v], prefix + (v,), w)
                else:
                    law[prefix + (v,)] = law.get(prefix + (v,), 0.0) + w
                    if len(law) > max_outcomes:
                        raise ValueError(f"{case.name}: more than {max_outcomes} sequences; use kind='first-depth'")

        walk(0, (), 1.0)
        return ExactLaw("sequence", law)
    # first-depth: R[c] = law of the further accepted depth below c
    order = []
    stack = [0]
    while stack:
        c = stack.pop()
        order.append(c)
        stack.extend(kids[c])
    rest: dict[int, np.ndarray] = {}
    for c in reversed(order):
        r = np.zeros(1)
        stop = 1.0
        for k in kids[c]:
            p = float(probs[c, tokens[k]])
            if p <= 0:
                continue
            stop -= p
            sub = np.concatenate([[0.0], p * rest[k]])
            if sub.shape[0] > r.shape[0]:
                r = np.pad(r, (0, sub.shape[0] - r.shape[0]))
            r[: sub.shape[0]] += sub
        r[0] += max(stop, 0.0)
        rest[c] = r
    law = {}
    root = probs[0]
    child_tok = {tokens[k]: k for k in kids[0]}
    for v in np.nonzero(root > 0)[0].tolist():
        if v in child_tok:
            for d, q in enumerate(rest[child_tok[v]].tolist()):
                if q > 0:
                    law[(v, d + 1)] = float(root[v]) * q
        else:
            law[(v, 0)] = float(root[v])
    return ExactLaw("first-depth", law)
