"""What-if analyses: re-walk one request from a trace's child probabilities and coins."""

from __future__ import annotations

import math
from typing import Callable

import torch

from .reference import check_thresholds
from .rules import SGLANG_MIN_THRESHOLD_ACC, SampledRule
from .types import UndrawnBonus, WalkEvent, is_lossy
from .walking import children_of, walk

__all__ = ["walk_request", "acceptance_probabilities", "CHILDREN_COVER_TOL"]


def _as_list(name, x, n=None):
    values = x.tolist() if isinstance(x, torch.Tensor) else list(x)
    if n is not None and len(values) != n:
        raise ValueError(f"{name} has {len(values)} entries, expected {n}")
    return values


#: :func:`walk_request` without rows counts a node's children as holding its whole row when
#: their float64 probability sum reaches ``1 - CHILDREN_COVER_TOL``.
CHILDREN_COVER_TOL = 2.0 ** -20


def walk_request(
    retrieve_next_token,
    retrieve_next_sibling,
    node_token_ids,
    child_probs,
    coins,
    final_coin: float | None = None,
    *,
    request: int = 0,
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
    row_of: Callable[[int], torch.Tensor] | None = None,
    final_mass: float | None = None,
) -> list[WalkEvent]:
    """Re-walk one request with the target-only rule from stored child probabilities (pure;
    for what-if analyses such as "what if this coin had been 0.3").

    Args:
        retrieve_next_token, retrieve_next_sibling, node_token_ids: ``[n]`` (tensors or lists)
            of the request (local indices).
        child_probs: ``[n]`` float, ``child_probs[i]`` = target p of node ``i``'s token in its
            parent's row (``Step.child_probs``; root entry ignored).
        coins: ``[n]`` coins in [0, 1) (``coins[i]`` decides among node ``i``'s children).
        final_coin: the bonus coin (``None``: the bonus is not drawn).
        request: the request index written into the events.
        threshold_single, threshold_acc: as :func:`verify_sampled`.
        row_of: optional ``row_of(node) -> [V]`` float32 full row; with it the bonus is drawn
            (and the children-cover-the-row test is exact), as :func:`verify_sampled` does.
        final_mass: passed to :func:`residual_draw` with ``row_of`` (a stored prefix row).

    Returns:
        the :class:`WalkEvent` s. Without ``row_of`` the final event's ``bonus`` is an
        :class:`UndrawnBonus` ("would draw from the residual at node X with mass M"), and a
        node's children count as holding its whole row when their probabilities sum to at
        least ``1 - CHILDREN_COVER_TOL``.

    Raises:
        ValueError: lengths differ, a coin outside [0, 1), a negative or NaN child probability
            of a reached child, bad thresholds, or a cycle.
    """
    nt = _as_list("retrieve_next_token", retrieve_next_token)
    n = len(nt)
    ns = _as_list("retrieve_next_sibling", retrieve_next_sibling, n)
    tokens = _as_list("node_token_ids", node_token_ids, n)
    cp = [float(v) for v in _as_list("child_probs", child_probs, n)]
    cs = [float(v) for v in _as_list("coins", coins, n)]
    check_thresholds(threshold_single, threshold_acc)
    for i, c in enumerate(cs):
        if not 0.0 <= c < 1.0:
            raise ValueError(f"coins, request {request}, node {i}: {c} is not in [0, 1)")
    if final_coin is not None and not 0.0 <= final_coin < 1.0:
        raise ValueError(f"final_coin, request {request}: {final_coin} is not in [0, 1)")

    class _WhatIf(SampledRule):
        def child_probs(self, node, children):
            out = []
            for c in children:
                if not cp[c] >= 0.0:
                    raise ValueError(f"child_probs, request {request}, node {c}: {cp[c]} is not a probability")
                out.append(cp[c])
            return out

        def _residual_empty(self, node, children):
            if row_of is not None:
                return super()._residual_empty(node, children)
            return math.fsum(cp[c] for c in children) >= 1.0 - CHILDREN_COVER_TOL

        def bonus(self, node, children, rejected):
            if row_of is not None and final_coin is not None:
                return super().bonus(node, children, rejected)
            mass = max(0.0, 1.0 - math.fsum(cp[c] for c in rejected))
            return UndrawnBonus(request, node, "residual" if rejected else "leaf", mass, final_coin)

    rule = _WhatIf(request, tokens, row_of, cs, final_coin, threshold_single, threshold_acc, final_mass)
    return list(walk(request, n, nt, ns, rule))


def acceptance_probabilities(
    retrieve_next_token,
    retrieve_next_sibling,
    child_probs,
    *,
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
) -> torch.Tensor:
    """Each node's exact probability of being accepted, given the walk reached its parent.

    For a coin ``u ~ U[0, 1)`` and children ``1..K`` in sibling order with target
    probabilities ``p_k`` and exact partial sums ``S_k``: child ``k`` is accepted iff it
    passes the accept test and no earlier sibling does. With lossless thresholds (the rule
    ``p_k > 0`` and ``u < S_k``) this is ``p_k``; with lossy ones (SGLang's rule,
    :mod:`ddtree_lab.verify.rules`: ``u <= S_k / max(threshold_acc, 1e-9)`` or
    ``p_k >= threshold_single``, no ``p > 0`` guard) it is ``min(1, S_k / max(threshold_acc, 1e-9)) - L``
    (or ``1 - L`` when ``p_k >= threshold_single``), ``L`` the coin range already taken by
    earlier siblings, and 0 after a sibling accepted outright. Exact arithmetic (float64), not
    the kernels' float32.

    Args:
        retrieve_next_token, retrieve_next_sibling: ``[n]`` of one request.
        child_probs: ``[n]``, target p of each node's token in its parent's row (root ignored).
        threshold_single, threshold_acc: as :func:`verify_sampled`.

    Returns:
        ``[n]`` float64 (root 0).

    Raises:
        ValueError: lengths differ, bad thresholds, a cycle in the sibling chains.
    """
    nt = _as_list("retrieve_next_token", retrieve_next_token)
    n = len(nt)
    ns = _as_list("retrieve_next_sibling", retrieve_next_sibling, n)
    cp = [float(v) for v in _as_list("child_probs", child_probs, n)]
    check_thresholds(threshold_single, threshold_acc)
    lossy = is_lossy(threshold_single, threshold_acc)
    divisor = max(threshold_acc, SGLANG_MIN_THRESHOLD_ACC) if lossy else 1.0
    out = [0.0] * n
    for parent in range(n):
        taken, certain, mass = 0.0, False, 0.0
        for child in children_of(0, nt, ns, parent, n):
            p = cp[child]
            mass += p
            if certain or not (p > 0.0 or lossy):
                continue
            reach = min(1.0, mass / divisor)
            if p >= threshold_single:
                out[child] = 1.0 - taken
                certain = True
            else:
                out[child] = max(0.0, reach - taken)
                taken = max(taken, reach)
    return torch.tensor(out, dtype=torch.float64)
