"""Build stage: draft top-k -> the best-first draft tree (DDTreeBuildResult).

DDTree draft-tree construction (Ringel & Romano, arXiv 2604.12989, Algorithm 1).

A block drafter gives, for each of the next ``L-1`` positions, an independent distribution
over the vocabulary. The probability of a draft prefix is the product of its tokens'
marginals, so the ``B`` most probable prefixes form a tree. Algorithm 1 finds them with a
best-first heap over *rank tuples* ``(r_1..r_d)`` (the node takes the ``r_i``-th best token
at depth ``i``): pop the best tuple, add it, push its next sibling ``(r_1..r_d + 1)`` and its
first child ``(r_1..r_d, 0)``; stop after ``B`` pops.

Two implementations live here:

* :func:`build_tree_reference` -- that heap, one request at a time with :mod:`heapq`;
  the readable reference and the test oracle.
* :func:`build_tree` -- the same result for a whole batch, vectorised with numpy on the
  host. Every node of the tree has a log-weight at or above ``T``, the ``B``-th best one,
  and the nodes at or above any floor ``f <= T`` are closed under "parent" (log-probs are
  ``<= 0``). So, given such an ``f``, one pass from the root keeps, depth by depth, the
  children of kept nodes that reach ``f``; one sort puts them in tree order and the first
  ``B`` are the tree (with ``top1_spine``: the spine, always kept, and the first others).
  ``f`` is guessed from a Chernoff bound on how many prefixes lie above a log-weight, and
  is proven when the pass collected ``B`` nodes; otherwise the request is redone with a
  lower guess, and last with no floor and at most ``B`` nodes kept per depth (a node with
  ``B`` better nodes at its own depth is never in the tree).

**Order and ties.** Nodes are compared by the key ``(-node_logw, depth, rank tuple)``:
higher log-weight first; on equal log-weight the shallower node first; at equal depth the
lexicographically smaller rank tuple first. This total order puts every parent before its
children and every better sibling before the worse one, so the tree is exactly the first
``B`` prefixes in this order (brute-force enumeration sorted by the same key gives the same
set and order). Log-weights are summed root-to-node in float64, in depth order, and stored
as float32.

**Zero probability.** A prefix with drafter probability 0 (a ``-inf`` log-prob in the
top-k) is never added: a tree can hold fewer than ``B`` draft nodes.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, fields
from typing import Sequence

import numpy as np
import torch

from ._arguments import check_shape, check_tensor
from .draft import check_draft_topk

__all__ = [
    "DDTreeBuildResult",
    "build_tree",
    "build_tree_reference",
]


class TreeBatch:
    """What every per-request ``[bs, N]`` record of trees shares (its ``node_token_ids``):
    ``batch_size`` (``bs``) and ``num_rows`` (``N``, rows per request, padding included)."""

    node_token_ids: torch.Tensor

    @property
    def batch_size(self) -> int:
        return int(self.node_token_ids.shape[0])

    @property
    def num_rows(self) -> int:
        return int(self.node_token_ids.shape[1])


@dataclass(frozen=True)
class DDTreeBuildResult(TreeBatch):
    """The draft trees of a batch, nodes in tree order (see module docstring).

    ``N = 1 + max budget``. Row 0 is the root (the anchor token). Rows at or past
    ``num_nodes[b]`` are padding: token, parent, depth and rank ``-1``, log-weight ``-inf``.

    Attributes:
        node_token_ids: ``[bs, N]`` int64, token of each node (root: the anchor token).
        parents: ``[bs, N]`` int64, local index of the parent (root: -1).
        depths: ``[bs, N]`` int64, root 0, draft nodes 1..max_depth.
        ranks: ``[bs, N]`` int64, rank of the node's token among the drafter's top-k at its
            depth (0 = best; root: -1).
        node_logws: ``[bs, N]`` float32, sum of draft log-probs along the path (root: 0).
        num_nodes: ``[bs]`` int64, valid rows per request, root included (``1 + draft nodes``).
    """

    node_token_ids: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    ranks: torch.Tensor
    node_logws: torch.Tensor
    num_nodes: torch.Tensor

    def request(self, b: int) -> "DDTreeBuildResult":
        """The tree of request ``b`` as a batch of one (same ``N``)."""
        return DDTreeBuildResult(**{f.name: getattr(self, f.name)[b : b + 1] for f in fields(self)})

    def compact(self) -> "DDTreeBuildResult":
        """The same trees with the padding rows past the largest ``num_nodes`` dropped
        (``N = max(num_nodes)``; a batch of one: exactly its nodes), on the CPU, detached."""
        n = int(self.num_nodes.max()) if self.num_nodes.numel() else 0
        return DDTreeBuildResult(**{f.name: (getattr(self, f.name) if f.name == "num_nodes" else
                                             getattr(self, f.name)[:, :n]).detach().cpu().clone() for f in fields(self)})

    def equals(self, other: "DDTreeBuildResult") -> bool:
        """True when every field is identical (values and dtypes)."""
        return all(
            getattr(self, f.name).dtype == getattr(other, f.name).dtype
            and torch.equal(getattr(self, f.name), getattr(other, f.name))
            for f in fields(self)
        )


MAX_BUDGET = 1 << 16  # far above engine budgets (DDTree: 256-512); guards against runaway inputs


def request_budgets(budget: int | torch.Tensor | Sequence[int], bs: int) -> list[int]:
    """Per-request budgets B: one int for all ``bs`` requests, or one per request (list or
    ``[bs]`` int tensor), each in ``[1, MAX_BUDGET]``.

    Raises:
        ValueError / TypeError: a budget that is not an integer, out of range, or a list of
            the wrong length (the message names the request).
    """
    import operator

    def as_int(v, where: str) -> int:
        if isinstance(v, bool):
            raise TypeError(f"{where} must be an int, got bool")
        try:
            return operator.index(v)  # int, numpy integers; not float or str
        except TypeError:
            raise TypeError(f"{where} must be an int, got {type(v).__name__} {v!r}") from None

    if isinstance(budget, torch.Tensor):
        if budget.dtype not in (torch.int32, torch.int64) or budget.dim() != 1:
            raise TypeError(f"budget tensor must be 1-D int32/int64, got {budget.dtype} shape {tuple(budget.shape)}")
        values = [int(v) for v in budget.tolist()]
    elif isinstance(budget, (list, tuple)):
        values = [as_int(v, f"budget of request {b}") for b, v in enumerate(budget)]
    else:
        values = [as_int(budget, "budget")] * bs
    if len(values) != bs:
        raise ValueError(f"budget has {len(values)} entries for a batch of {bs} requests")
    for b, v in enumerate(values):
        if not 0 <= v <= MAX_BUDGET:
            raise ValueError(f"request {b}: budget must be in [0, {MAX_BUDGET}], got {v}")
    return values


def check_build_arguments(draft_token_ids, draft_logprobs, anchor_token_ids, budget, max_depth, min_prob,
                          *, validate: bool = True) -> tuple[list[int], int, float | None]:
    """The checked arguments of a tree builder: ``(budgets, max_depth, log(min_prob) or None)``.

    With ``validate`` the draft rows are checked too (:func:`ddtree_lab.check_draft_topk`, on
    the host); without it only dtypes and shapes (no tensor value is read).

    Raises:
        TypeError / ValueError: as :func:`build_tree` says.
    """
    if validate:
        check_draft_topk(draft_token_ids, draft_logprobs)
    else:
        check_tensor("draft_token_ids", draft_token_ids, dtype=torch.int64, ndim=3)
        check_tensor("draft_logprobs", draft_logprobs, dtype=torch.float32, ndim=3)
        check_shape("draft_logprobs", draft_logprobs, tuple(draft_token_ids.shape))
    bs, depth_all, _ = draft_token_ids.shape
    check_tensor("anchor_token_ids", anchor_token_ids, dtype=torch.int64, ndim=1)
    check_shape("anchor_token_ids", anchor_token_ids, (bs,))
    budgets = request_budgets(budget, bs)
    if max_depth is None:
        max_depth = depth_all
    if isinstance(max_depth, bool) or not isinstance(max_depth, int) or not 0 <= max_depth <= depth_all:
        raise ValueError(f"max_depth must be an int in [0, L-1={depth_all}], got {max_depth!r}")
    log_min = None
    if min_prob is not None:
        if not (isinstance(min_prob, (int, float)) and 0.0 < float(min_prob) <= 1.0):
            raise ValueError(f"min_prob must be in (0, 1], got {min_prob!r}")
        log_min = math.log(float(min_prob))
    return budgets, max_depth, log_min


def _empty_result(bs: int, n: int, anchor_token_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    out = {
        "node_token_ids": torch.full((bs, n), -1, dtype=torch.int64),
        "parents": torch.full((bs, n), -1, dtype=torch.int64),
        "depths": torch.full((bs, n), -1, dtype=torch.int64),
        "ranks": torch.full((bs, n), -1, dtype=torch.int64),
        "node_logws": torch.full((bs, n), -math.inf, dtype=torch.float32),
    }
    out["node_token_ids"][:, 0] = anchor_token_ids.cpu()
    out["depths"][:, 0] = 0
    out["node_logws"][:, 0] = 0.0
    return out


def build_tree_reference(
    draft_token_ids: torch.Tensor,
    draft_logprobs: torch.Tensor,
    anchor_token_ids: torch.Tensor,
    budget: int | list[int] | torch.Tensor,
    max_depth: int | None = None,
    *,
    top1_spine: bool = False,
    min_prob: float | None = None,
) -> DDTreeBuildResult:
    """DDTree Algorithm 1 with :mod:`heapq`, one request at a time (reference and oracle).

    Same arguments, result and errors as :func:`build_tree`; see there.
    """
    budgets, depth_limit, log_min = check_build_arguments(
        draft_token_ids, draft_logprobs, anchor_token_ids, budget, max_depth, min_prob
    )
    bs = draft_token_ids.shape[0]
    k = draft_token_ids.shape[2]
    n = 1 + max(budgets, default=0)
    out = _empty_result(bs, n, anchor_token_ids)
    token_rows = draft_token_ids.tolist()
    logprob_rows = draft_logprobs.double().tolist()
    num_nodes = []
    for b in range(bs):
        lp, tok, budget_b = logprob_rows[b], token_rows[b], budgets[b]
        spine_depth = min(depth_limit, budget_b) if top1_spine else 0
        # node: (logw, depth, ranks, parent index, token)
        nodes: list[tuple[float, int, tuple[int, ...], int, int]] = [(0.0, 0, (), -1, -1)]
        heap: list[tuple[float, int, tuple[int, ...], int, float]] = []  # (-logw, depth, ranks, parent, parent_logw)

        def push(parent_logw: float, depth: int, ranks: tuple[int, ...], parent: int) -> None:
            logw = parent_logw + lp[depth - 1][ranks[-1]]
            if logw == -math.inf:
                return
            heapq.heappush(heap, (-logw, depth, ranks, parent, parent_logw))

        if depth_limit >= 1 and budget_b >= 1:
            push(0.0, 1, (0,), 0)
        non_spine_quota = budget_b - spine_depth
        non_spine_taken = 0
        deepest_spine = 0  # index of the deepest spine node added (0 = root)
        while heap and non_spine_taken < non_spine_quota:
            neg_logw, depth, ranks, parent, parent_logw = heapq.heappop(heap)
            logw = -neg_logw
            is_spine = depth <= spine_depth and not any(ranks)
            if not is_spine and log_min is not None and logw < log_min:
                continue  # pruned; its successors have no larger log-weight
            index = len(nodes)
            nodes.append((logw, depth, ranks, parent, tok[depth - 1][ranks[-1]]))
            if is_spine:
                deepest_spine = index
            else:
                non_spine_taken += 1
            if ranks[-1] + 1 < k:
                push(parent_logw, depth, ranks[:-1] + (ranks[-1] + 1,), parent)
            if depth < depth_limit:
                push(logw, depth + 1, ranks + (0,), index)
        # Spine nodes not popped yet come after every popped node in tree order.
        last = deepest_spine
        for depth in range(nodes[last][1] + 1, spine_depth + 1):
            logw = nodes[last][0] + lp[depth - 1][0]
            nodes.append((logw, depth, (0,) * depth, last, tok[depth - 1][0]))
            last = len(nodes) - 1
        count = len(nodes)
        out["node_token_ids"][b, 1:count] = torch.tensor([t for *_, t in nodes[1:]], dtype=torch.int64)
        out["parents"][b, 1:count] = torch.tensor([p for _, _, _, p, _ in nodes[1:]], dtype=torch.int64)
        out["depths"][b, 1:count] = torch.tensor([d for _, d, *_ in nodes[1:]], dtype=torch.int64)
        out["ranks"][b, 1:count] = torch.tensor([r[-1] for _, _, r, *_ in nodes[1:]], dtype=torch.int64)
        out["node_logws"][b, 1:count] = torch.tensor([w for w, *_ in nodes[1:]], dtype=torch.float64).float()
        num_nodes.append(len(nodes))
    return DDTreeBuildResult(num_nodes=torch.tensor(num_nodes, dtype=torch.int64), **out)


# Batched builder (numpy on the host; see build_tree).

_KEEP_ALL = -np.finfo(np.float64).max  # a floor every finite log-weight passes, -inf fails
_TILTS = np.geomspace(1 / 16, 16, 9)  # Chernoff tilts tried first by _chernoff ...
_FINE_TILTS = 2.0 ** np.array([-0.5, -0.25, 0.0, 0.25, 0.5])  # ... then these multiples of the best
# Floors tried, in units of 1/tilt below the Chernoff threshold (see _chernoff). The first
# collects about 1.3-2x the nodes needed on the benchmark drafts and is rarely too high;
# inf means no floor but min_prob.
_MARGINS = (3.5, 5.0, math.inf)


def _chernoff_threshold(lp: np.ndarray, quota: np.ndarray, tilts: np.ndarray) -> np.ndarray:
    """``t(s) = (M(s) - log quota) / s`` for each request and tilt ``s`` (see :func:`_chernoff`).

    Args: ``lp`` ``[bs, D, K]`` float64; ``quota`` ``[bs]``; ``tilts`` ``[T, bs or 1]``.
    Returns ``[T, bs]``.
    """
    lp = np.ascontiguousarray(lp.transpose(1, 2, 0))  # [D, K, bs]: reductions run along long rows
    lead = lp[:, :1]  # finite: every depth has a best token
    gaps = (lp - lead).astype(np.float32)[:, :, None]  # <= 0; float32 is plenty for a guess
    tilted = np.exp(gaps * tilts.astype(np.float32)).sum(1)  # [D, T, bs]
    per_depth = np.log(tilted) + lead * tilts
    prefix_sum = np.tri(len(lp))  # a matmul is faster here than cumsum along axis 0
    cum = (prefix_sum @ per_depth.reshape(len(lp), -1)).reshape(per_depth.shape)  # log of the depth-d term
    top = cum.max(0)
    log_count = top + np.log(np.exp(cum - top).sum(0))  # M(s), [T, bs]
    return (log_count - np.log(quota)) / tilts


def _chernoff(lp: np.ndarray, quota: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per request, a log-weight at or above its ``quota``-th best node, and a tilt.

    For a tilt ``s > 0`` the number of nodes with log-weight ``>= t`` is at most
    ``exp(M(s) - s*t)`` with ``M(s) = log sum_d prod_{i<=d} sum_r exp(s*lp[i, r])``
    (Chernoff). Setting that to ``quota`` gives ``t(s)``; the smallest over a coarse then a
    finer set of tilts is kept. Lowering ``t`` by ``1/s`` multiplies the count by about ``e``,
    and the bound overcounts by about ``e^3`` on the drafts measured, so ``t - 3.5/s`` is a
    good guess for a floor (see ``_MARGINS``). Only a guess: :func:`_build` checks it.

    Args: ``lp`` ``[bs, D, K]`` float64; ``quota`` ``[bs]`` int64 (>= 1).
    Returns ``(t, s)``, each ``[bs]`` float64.
    """
    coarse = _chernoff_threshold(lp, quota, _TILTS[:, None])
    tilts = _FINE_TILTS[:, None] * _TILTS[coarse.argmin(0)]
    fine = _chernoff_threshold(lp, quota, tilts)
    best = fine.argmin(0)
    cols = np.arange(len(best))
    return fine[best, cols], tilts[best, cols]


@dataclass
class _Nodes:
    """Candidate nodes of a batch, flat, depth-major; within a depth in (request, rank tuple) order."""

    logw: np.ndarray  # float64
    req: np.ndarray  # request index
    depth: np.ndarray
    rank: np.ndarray
    spine: np.ndarray  # bool, part of the top-1 spine
    parent: np.ndarray  # flat index of the parent, -1 for the root
    capped: np.ndarray  # [bs] bool, some depth hit the per-depth cap


def _kth_best(logw: np.ndarray, req: np.ndarray, rows: np.ndarray, kth: np.ndarray) -> np.ndarray:
    """Per request, the ``kth[b]``-th largest of its values (``-inf`` where ``rows[b]`` is off).

    ``req`` must be grouped (each request's values contiguous).
    """
    take = rows[req]
    values, owner = logw[take], req[take]
    counts = np.bincount(owner, minlength=len(rows))[rows]
    row = np.cumsum(rows) - 1
    col = np.arange(len(values)) - np.repeat(np.cumsum(counts) - counts, counts)
    dense = np.full((len(counts), counts.max()), np.inf)
    dense[row[owner], col] = -values
    out = np.full(len(rows), -np.inf)
    out[rows] = -np.sort(dense, axis=1)[np.arange(len(counts)), kth[rows] - 1]
    return out


def _segment_rank(flags: np.ndarray, start: np.ndarray) -> np.ndarray:
    """For each position, how many ``flags`` are set before it within its segment."""
    before = np.cumsum(flags) - flags
    return before - before[start]


def _best_per_request(logw: np.ndarray, req: np.ndarray, spine: np.ndarray, quota: np.ndarray):
    """Mask keeping the spine and, per request, the ``quota`` best other nodes of one depth.

    The nodes are grouped by request and in rank-tuple order, so of two equal log-weights
    the earlier is the better. Returns ``(mask, over)``, ``over[b]``: request ``b`` had more
    than ``quota[b]`` (the mask is ``None`` when no request had).
    """
    bs = len(quota)
    other = ~spine
    over = np.bincount(req[other], minlength=bs) > quota
    if not over.any():
        return None, over
    kth = _kth_best(np.where(spine, -np.inf, logw), req, over, quota)[req]  # -inf: not over
    better, tie = other & (logw > kth), other & (logw == kth)
    room = quota - np.bincount(req[better], minlength=bs)  # ties that still fit, in order
    start = np.searchsorted(req, np.arange(bs))[req]
    return spine | better | (tie & (_segment_rank(tie, start) < room[req])), over


def _expand(lp: np.ndarray, floor: np.ndarray, quota: np.ndarray, spine_depth: np.ndarray, cap: bool) -> _Nodes:
    """Every node the trees may take, depth by depth from the root.

    Keeps the spine nodes and each non-spine child ``>= floor[b]`` of a kept node; with
    ``cap``, then only the ``quota[b]`` best non-spine nodes of each depth (a node with
    ``quota`` better nodes at its own depth is never taken, nor is its subtree). Children are
    listed parent by parent, rank by rank, which keeps rank-tuple order.
    Rows are sorted, so a parent whose rank-0 child is below the floor has no child kept.

    Args: ``lp`` ``[bs, D, K]`` float64; ``floor`` ``[bs]`` float64; ``quota``,
    ``spine_depth`` ``[bs]`` int64.
    """
    bs, depth, k = lp.shape
    by_depth = np.ascontiguousarray(lp.transpose(1, 0, 2))  # [D, bs, K]
    best = np.ascontiguousarray(by_depth[:, :, 0])  # [D, bs]
    max_spine = int(spine_depth.max(initial=0))
    logw, req = np.zeros(bs), np.arange(bs)
    spine = np.ones(bs, dtype=bool)  # the root heads the spine
    capped = np.zeros(bs, dtype=bool)
    levels = []
    for d in range(depth):
        floor_req = floor[req]
        fertile = logw + best[d][req] >= floor_req
        if d < max_spine:
            spine_next = spine & (d < spine_depth[req])  # its rank-0 child is a spine node
            fertile |= spine_next
        fertile = np.flatnonzero(fertile)
        cand = np.take(by_depth[d], req[fertile], axis=0)
        cand += logw[fertile, None]  # parent + draft log-prob, summed as the heap does
        keep = cand >= floor_req[fertile, None]
        if d < max_spine:
            keep[:, 0] |= spine_next[fertile]
        flat = np.flatnonzero(keep)
        if flat.size == 0:
            break
        parent = flat // k
        parent, rank = fertile[parent], flat - parent * k
        logw, req = cand.ravel()[flat], req[parent]
        spine = spine_next[parent] & (rank == 0) if d < max_spine else np.zeros(len(flat), dtype=bool)
        if cap:
            kept, over = _best_per_request(logw, req, spine, quota)
            if over.any():
                logw, req, spine, parent, rank = logw[kept], req[kept], spine[kept], parent[kept], rank[kept]
                capped |= over
        levels.append((logw, req, spine, parent, rank))
    sizes = [len(level[0]) for level in levels]
    starts = np.cumsum([0] + sizes)
    return _Nodes(
        logw=np.concatenate([np.zeros(0)] + [lv[0] for lv in levels]),
        req=np.concatenate([np.zeros(0, dtype=np.int64)] + [lv[1] for lv in levels]),
        spine=np.concatenate([np.zeros(0, dtype=bool)] + [lv[2] for lv in levels]),
        parent=np.concatenate([np.full(sizes[0] if sizes else 0, -1)] + [lv[3] + s for lv, s in zip(levels[1:], starts)]),
        rank=np.concatenate([np.zeros(0, dtype=np.int64)] + [lv[4] for lv in levels]),
        depth=np.repeat(np.arange(1, len(levels) + 1), sizes),
        capped=capped,
    )


def _tree_order(logw: np.ndarray, req: np.ndarray, bs: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices of the nodes, request by request, each request in tree order; and their requests.

    Tree order is descending ``logw``, then ascending index (``_Nodes`` lists a request's
    nodes by depth, then rank tuple). One vectorised sort of int64 keys
    ``(request, quantised -logw, index)``, much faster than an argsort; quantising never swaps
    two values, so the order is exact unless two different values of a request share a key,
    and then a stable lexsort is used instead.
    """
    count = len(logw)
    index_bits = max(count - 1, 1).bit_length()
    value_bits = min(62 - index_bits - max(bs - 1, 1).bit_length(), 52)
    if value_bits > 8:
        top = 2**value_bits - 1
        gap = -logw  # >= 0
        span = float(gap.max(initial=0.0))
        scale = top / span if span > 0 else 0.0
        value = np.minimum(np.floor(gap * scale), top).astype(np.int64)
        key = np.sort((((req << value_bits) | value) << index_bits) | np.arange(count))
        order = key & ((1 << index_bits) - 1)
        shared = np.flatnonzero((key[1:] >> index_bits) == (key[:-1] >> index_bits))
        if (logw[order[shared]] == logw[order[shared + 1]]).all():  # shared keys: true ties only
            return order, key >> (value_bits + index_bits)
    order = np.lexsort((np.arange(count), -logw, req))
    return order, req[order]


def _assemble(nodes: _Nodes, quota: np.ndarray, tokens: np.ndarray, n: int) -> dict[str, np.ndarray]:
    """Sort each request's candidates into tree order; keep the spine and the ``quota`` best others.

    Returns the :class:`DDTreeBuildResult` fields (root column included) as numpy arrays.
    """
    bs, depth, k = tokens.shape
    order, req = _tree_order(nodes.logw, nodes.req, bs)  # req ascending
    start = np.searchsorted(req, np.arange(bs))[req]  # where each node's request begins
    spine = nodes.spine[order]
    if spine.any():
        chosen = spine | (_segment_rank(~spine, start) < quota[req])
    else:
        chosen = np.arange(len(order)) - start < quota[req]
    e, b = order[chosen], req[chosen]
    first = np.searchsorted(b, np.arange(bs + 1))
    taken = np.diff(first)
    row = 1 + np.arange(len(e)) - first[b]  # row 0 is the root
    row_of = np.zeros(len(order) + 1, dtype=np.int64)  # the last slot, parent -1, is the root
    row_of[e] = row
    parent, d, rank = nodes.parent[e], nodes.depth[e], nodes.rank[e]

    out: dict[str, np.ndarray] = {name: np.full((bs, n), -1, dtype=np.int64)
                                  for name in ("node_token_ids", "parents", "depths", "ranks")}
    out["node_logws"] = np.full((bs, n), -np.inf, dtype=np.float32)
    out["depths"][:, 0] = 0
    out["node_logws"][:, 0] = 0.0
    full = bool((taken == n - 1).all())  # then the rows are a plain [bs, n-1] block
    cell = None if full else b * n + row
    for name, values in (
        ("node_token_ids", tokens.ravel()[(b * depth + d - 1) * k + rank]),
        ("parents", row_of[parent]),
        ("depths", d),
        ("ranks", rank),
        ("node_logws", nodes.logw[e]),
    ):
        if full:
            out[name][:, 1:] = values.reshape(bs, n - 1)
        else:
            out[name].ravel()[cell] = values
    out["num_nodes"] = 1 + taken
    return out


def _build(lp, quota, spine_depth, floor, tokens, n):
    """Guess floors, expand, keep the requests whose guess is proven, retry the others lower.

    A floor is proven when it collected ``quota`` non-spine nodes (so the ``quota``-th best
    is at or above it), when a depth hit the cap (same reason), or when it is ``floor``. A
    guess ``t(s) - m/s`` collects at most about ``quota * e^m`` nodes (the Chernoff bound at
    ``s``, computed in float32), so only the last pass, from ``floor``, needs the per-depth cap.
    """
    bs = len(quota)
    threshold, tilt = np.full(bs, np.inf), np.ones(bs)
    live = quota > 0
    if live.any():
        threshold[live], tilt[live] = _chernoff(lp[live], quota[live])
    out = None
    todo = np.arange(bs)
    for margin in _MARGINS:
        first = floor[todo] if margin == math.inf else np.maximum(threshold[todo] - margin / tilt[todo], floor[todo])
        first = np.where(quota[todo] > 0, first, np.inf)  # quota 0: spine nodes only
        nodes = _expand(lp[todo], first, quota[todo], spine_depth[todo], cap=margin == math.inf)
        trees = _assemble(nodes, quota[todo], tokens[todo], n)
        found = trees["num_nodes"] - 1 - spine_depth[todo]  # non-spine nodes taken (all spine nodes are)
        proven = (found >= quota[todo]) | nodes.capped | (first <= floor[todo])
        if out is None:
            out = trees
        else:
            for name, value in trees.items():
                out[name][todo[proven]] = value[proven]
        todo = todo[~proven]
        if not todo.size:
            return out
    raise AssertionError("the last floor is always proven")


def build_tree(
    draft_token_ids: torch.Tensor,
    draft_logprobs: torch.Tensor,
    anchor_token_ids: torch.Tensor,
    budget: int | list[int] | torch.Tensor,
    max_depth: int | None = None,
    *,
    top1_spine: bool = False,
    min_prob: float | None = None,
) -> DDTreeBuildResult:
    """Build the DDTree draft trees of a whole batch (arXiv 2604.12989, Algorithm 1).

    The same trees as :func:`build_tree_reference`, computed for all requests at once (the
    module docstring says how).

    Args:
        draft_token_ids: ``[bs, L-1, K]`` int64, drafter's top-K tokens per position.
        draft_logprobs: ``[bs, L-1, K]`` float32, their log-probs, each row sorted
            descending and normalised over the full vocabulary (see
            :func:`draft_topk_from_logits`).
        anchor_token_ids: ``[bs]`` int64, the root token of each tree (last committed token).
        budget: ``B``, draft nodes per tree (root not counted); an int or one per request.
            The result has ``N = 1 + max(B)`` rows.
        max_depth: deepest draft depth allowed, default ``L-1``.
        top1_spine: off by default. When on, the chain of best tokens (rank 0 at every
            depth, down to ``min(max_depth, B)``) is always in the tree, so verification never
            accepts less than the drafter's greedy chain would; the other ``B - depth`` nodes
            are chosen best-first as usual.
        min_prob: off by default. Nodes whose drafter probability ``exp(node_logw)`` is
            below it are pruned (spine nodes excepted), so a tree may hold fewer than B nodes.

    Returns:
        :class:`DDTreeBuildResult`, nodes in tree order (module docstring: order and ties),
        on the device of ``draft_token_ids``; the work is done on the host with numpy.

    Raises:
        TypeError: wrong dtype (nothing is converted implicitly).
        ValueError: bad shape, budget outside [0, 65536], max_depth out of range, min_prob outside (0, 1],
            or a draft row that is NaN, unsorted, unnormalised or has a repeated token
            (the message names request and depth).
    """
    budgets, depth_limit, log_min = check_build_arguments(
        draft_token_ids, draft_logprobs, anchor_token_ids, budget, max_depth, min_prob
    )
    device = draft_token_ids.device
    n = 1 + max(budgets, default=0)
    budget_np = np.array(budgets, dtype=np.int64).reshape(-1)
    spine_depth = np.minimum(budget_np, depth_limit) if top1_spine else np.zeros_like(budget_np)
    quota = budget_np - spine_depth  # non-spine draft nodes each tree takes
    floor = np.full(len(budgets), _KEEP_ALL if log_min is None else log_min)
    lp = draft_logprobs[:, :depth_limit].detach().cpu().numpy().astype(np.float64)
    tokens = np.ascontiguousarray(draft_token_ids[:, :depth_limit].detach().cpu().numpy())
    if depth_limit == 0:
        quota[:] = 0  # the root alone
    out = _build(lp, quota, spine_depth, floor, tokens, n)
    out["node_token_ids"][:, 0] = anchor_token_ids.detach().cpu().numpy()
    return DDTreeBuildResult(**{name: torch.from_numpy(v).to(device) for name, v in out.items()})
