"""The exact law a verify step emits under SGLang's lossy thresholds, and its distance from the target's law.

With thresholds other than lossless (:func:`ddtree_lab.verify.is_lossy`) every lab verifier
follows SGLang's rule (:mod:`ddtree_lab.verify`): at node ``c`` one coin ``u ~ U[0, 1)``
judges the children in sibling order and child ``k`` is taken with probability ``a_k``
(:func:`ddtree_lab.acceptance_probabilities`); with probability ``1 - sum a_k`` every child is
rejected and the bonus is drawn from ``p_c`` with the children's tokens zeroed, renormalised
(an empty residual emits no bonus). At a leaf the bonus is drawn from ``p_c``. This module
enumerates that law exactly (float64, continuous coins: the kernels' float32 sums are not
modelled) on the outcomes of :func:`ddtree_lab.audit.exact_law` and measures how far it moves
from the target's law:

* ``"sequence"``: outcome = the emitted token tuple (``-1`` appended when no bonus was drawn);
* ``"first-depth"``: outcome = ``(first emitted token, accepted depth)`` (``(-1, 0)``: the
  root's residual was empty).

:func:`threshold_distance` is the total-variation distance ``(1/2) sum |P - Q|`` between the
two; 0 up to the float32 rows' rounding (~1e-8) at lossless thresholds (on a tree without duplicate sibling tokens).
"""

from __future__ import annotations

import numpy as np

from ..verify import acceptance_probabilities
from .case import AuditCase
from .law import ExactLaw, exact_law

__all__ = ["threshold_law", "threshold_distance"]


def _node_laws(case: AuditCase, threshold_single: float, threshold_acc: float):
    """Per node: (children, their accept probabilities, the all-rejected residual row or None)."""
    probs = case.probs().double().cpu().numpy()
    vi = case.verify_input
    n = int(vi.num_nodes[0])
    tokens = vi.node_token_ids[0].tolist()
    kids = case.children()
    child_p = [0.0] * n
    for node, ks in kids.items():
        for c in ks:
            child_p[c] = float(probs[node, tokens[c]])
    accept = acceptance_probabilities(vi.retrieve_next_token[0, :n], vi.retrieve_next_sibling[0, :n], child_p,
                                      threshold_single=threshold_single, threshold_acc=threshold_acc).tolist()
    out = {}
    for node in range(n):
        ks = kids.get(node, [])
        row = probs[node].copy()
        for c in ks:
            row[tokens[c]] = 0.0
        mass = float(row.sum())
        out[node] = (ks, [accept[c] for c in ks], None if mass <= 0.0 else row / mass)
    return out, tokens


def threshold_law(case: AuditCase, threshold_single: float, threshold_acc: float, kind: str = "auto",
                  max_outcomes: int = 200_000) -> ExactLaw:
    """The exact law the thresholds' rule emits on ``case`` (module docstring).

    Args:
        case: a batch-of-one :class:`ddtree_lab.audit.AuditCase`.
        threshold_single, threshold_acc: SGLang's thresholds (finite, >= 0).
        kind: ``"sequence"``, ``"first-depth"`` or ``"auto"`` (as :func:`ddtree_lab.audit.exact_law`).
        max_outcomes: refuse a sequence enumeration larger than this.

    Returns:
        :class:`ddtree_lab.audit.ExactLaw` (outcome -> float64 probability, positive entries).

    Raises:
        ValueError: bad thresholds or kind, or an enumeration too large.
    """
    if kind == "auto":
        kind = "sequence" if case.verify_input.num_rows * case.vocab_size <= 4096 else "first-depth"
    if kind not in ("sequence", "first-depth"):
        raise ValueError(f"kind must be 'sequence', 'first-depth' or 'auto', got {kind!r}")
    nodes, tokens = _node_laws(case, threshold_single, threshold_acc)
    law: dict = {}

    def add(key, w):
        if w > 0.0:
            law[key] = law.get(key, 0.0) + w
            if len(law) > max_outcomes:
                raise ValueError(f"{case.name}: more than {max_outcomes} outcomes; use kind='first-depth'")

    if kind == "sequence":
        def walk(node: int, prefix: tuple, weight: float) -> None:
            ks, acc, residual = nodes[node]
            for c, a in zip(ks, acc):
                if a > 0.0:
                    walk(c, prefix + (tokens[c],), weight * a)
            stop = weight * max(0.0, 1.0 - sum(acc)) if ks else weight
            if residual is None:
                add(prefix + (-1,), stop)
            else:
                for v in np.nonzero(residual > 0)[0].tolist():
                    add(prefix + (v,), stop * float(residual[v]))

        walk(0, (), 1.0)
        return ExactLaw("sequence", law)

    depth_law: dict[int, np.ndarray] = {}  # law of the further accepted depth below a node

    def depths(node: int) -> np.ndarray:
        if node not in depth_law:
            ks, acc, _ = nodes[node]
            r = np.zeros(1)
            r[0] = max(0.0, 1.0 - sum(acc)) if ks else 1.0
            for c, a in zip(ks, acc):
                if a > 0.0:
                    sub = np.concatenate([[0.0], a * depths(c)])
                    if sub.shape[0] > r.shape[0]:
                        r = np.pad(r, (0, sub.shape[0] - r.shape[0]))
                    r[: sub.shape[0]] += sub
            depth_law[node] = r
        return depth_law[node]

    ks, acc, residual = nodes[0]
    for c, a in zip(ks, acc):
        for d, q in enumerate(depths(c).tolist()):
            add((tokens[c], d + 1), a * q)
    stop = max(0.0, 1.0 - sum(acc)) if ks else 1.0
    if residual is None:
        add((-1, 0), stop)
    else:
        for v in np.nonzero(residual > 0)[0].tolist():
            add((v, 0), stop * float(residual[v]))
    return ExactLaw("first-depth", law)


def threshold_distance(case: AuditCase, threshold_single: float, threshold_acc: float,
                       kind: str = "auto") -> float:
    """Total-variation distance between the thresholds' exact law and the target's
    (:func:`ddtree_lab.audit.exact_law`), in [0, 1]: how far the setting moves what is
    emitted. Same ``kind`` rule and errors as :func:`threshold_law`."""
    got = threshold_law(case, threshold_single, threshold_acc, kind)
    want = exact_law(case, got.kind)
    keys = set(got.probs) | set(want.probs)
    return 0.5 * sum(abs(got.probs.get(k, 0.0) - want.probs.get(k, 0.0)) for k in keys)
