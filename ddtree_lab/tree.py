"""DDTree draft-tree construction (Ringel & Romano, arXiv 2604.12989, Algorithm 1).

A block drafter gives, for each of the next ``L-1`` positions, an independent distribution
over the vocabulary. The probability of a draft prefix is the product of its tokens'
marginals, so the ``B`` most probable prefixes form a tree. Algorithm 1 finds them with a
best-first heap over *rank tuples* ``(r_1..r_d)`` (the node takes the ``r_i``-th best token
at depth ``i``): pop the best tuple, add it, push its next sibling ``(r_1..r_d + 1)`` and its
first child ``(r_1..r_d, 0)``; stop after ``B`` pops.

Two implementations live here:

* :func:`build_tree_reference` -- that heap, one request at a time with :mod:`heapq`;
  the readable reference and the test oracle.
* :func:`build_tree` -- the same result for a whole batch with tensor operations. It uses
  the fact that the top-``B`` set is closed under "parent" and "better sibling": the nodes
  of depth ``d`` in the answer are among the ``B`` best depth-``d`` children of the ``B``
  best depth-``d-1`` nodes. One sort per depth keeps those, one final sort merges depths.

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

import torch

from ._checks import check_shape, check_tensor, first_true

__all__ = [
    "DDTreeBuildResult",
    "build_tree",
    "build_tree_reference",
    "draft_topk_from_logits",
    "check_draft_topk",
]

_NORMALISATION_SLACK = 1e-3  # top-k mass may exceed 1 by this much (float32 log-softmax)


@dataclass(frozen=True)
class DDTreeBuildResult:
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

    @property
    def batch_size(self) -> int:
        return int(self.node_token_ids.shape[0])

    @property
    def num_rows(self) -> int:
        """``N``: rows per request, padding included."""
        return int(self.node_token_ids.shape[1])

    def request(self, b: int) -> "DDTreeBuildResult":
        """The tree of request ``b`` as a batch of one (same ``N``)."""
        return DDTreeBuildResult(**{f.name: getattr(self, f.name)[b : b + 1] for f in fields(self)})

    def equals(self, other: "DDTreeBuildResult") -> bool:
        """True when every field is identical (values and dtypes)."""
        return all(
            getattr(self, f.name).dtype == getattr(other, f.name).dtype
            and torch.equal(getattr(self, f.name), getattr(other, f.name))
            for f in fields(self)
        )


def check_draft_topk(draft_token_ids: torch.Tensor, draft_logprobs: torch.Tensor) -> None:
    """Validate a batch of draft top-k rows; raise ValueError naming request and depth.

    Args:
        draft_token_ids: ``[bs, L-1, K]`` int64, token ids, distinct within a row, >= 0.
        draft_logprobs: ``[bs, L-1, K]`` float32, sorted descending along K, no NaN or
            ``+inf``, mass of each row at most ``1 + 1e-3`` (normalised over the vocabulary).
            The first column must be finite (every depth has a best token).
    """
    check_tensor("draft_token_ids", draft_token_ids, dtype=torch.int64, ndim=3)
    check_tensor("draft_logprobs", draft_logprobs, dtype=torch.float32, ndim=3)
    check_shape("draft_logprobs", draft_logprobs, tuple(draft_token_ids.shape))
    bs, depth, k = draft_token_ids.shape
    if depth < 1 or k < 1:
        raise ValueError(f"draft top-k must have at least one depth and one column, got shape {(bs, depth, k)}")

    def fail(what: str, where: tuple[int, ...] | None) -> None:
        if where is not None:
            raise ValueError(f"draft top-k, request {where[0]}, depth {where[1] + 1}: {what}")

    fail("draft_logprobs has NaN", first_true(torch.isnan(draft_logprobs).any(-1)))
    fail("draft_logprobs has +inf", first_true(torch.isposinf(draft_logprobs).any(-1)))
    fail("draft_logprobs > 0 (log-probabilities must be <= 0)", first_true((draft_logprobs > 0).any(-1)))
    fail("the best draft log-prob is -inf (the row has no token)", first_true(torch.isneginf(draft_logprobs[..., 0])))
    if k > 1:
        unsorted = draft_logprobs[..., 1:] > draft_logprobs[..., :-1]
        fail("draft_logprobs not sorted in descending order", first_true(unsorted.any(-1)))
    fail("negative token id", first_true((draft_token_ids < 0).any(-1)))
    if k > 1:
        srt = draft_token_ids.sort(dim=-1).values
        fail("a token id appears twice in the row", first_true((srt[..., 1:] == srt[..., :-1]).any(-1)))
    mass = draft_logprobs.double().exp().sum(-1)
    fail(
        f"top-k probability mass exceeds 1 (+{_NORMALISATION_SLACK}): log-probs must be normalised over the vocabulary",
        first_true(mass > 1.0 + _NORMALISATION_SLACK),
    )


def draft_topk_from_logits(
    draft_logits: torch.Tensor, k: int | None = None, budget: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn raw draft logits into the draft top-k form that :func:`build_tree` takes.

    Args:
        draft_logits: ``[bs, L-1, V]`` floating, the drafter's logits for positions 1..L-1.
        k: columns to keep; default ``min(budget, V)`` -- by DDTree's Lemma 1 a larger K
            cannot change a tree of budget ``budget`` (a node of rank >= B has B better
            siblings, so it is never among the B best prefixes).
        budget: used for the default ``k``; one of ``k`` or ``budget`` is required.

    Returns:
        ``(draft_token_ids [bs, L-1, K] int64, draft_logprobs [bs, L-1, K] float32)``, each
        row sorted by descending log-prob (log-softmax over the full vocabulary, float32);
        equal log-probs are ordered by ascending token id.

    Raises:
        ValueError: bad shape, NaN logits, or neither ``k`` nor ``budget`` given.
    """
    check_tensor("draft_logits", draft_logits, dtype=(torch.float32, torch.float16, torch.bfloat16, torch.float64), ndim=3)
    vocab = draft_logits.shape[-1]
    if k is None:
        if budget is None:
            raise ValueError("draft_topk_from_logits needs k or budget")
        k = min(int(budget), vocab)
    if not 1 <= k <= vocab:
        raise ValueError(f"k must be in [1, V={vocab}], got {k}")
    where = first_true(torch.isnan(draft_logits).any(-1))
    if where is not None:
        raise ValueError(f"draft_logits, request {where[0]}, depth {where[1] + 1}: NaN")
    logprobs = torch.log_softmax(draft_logits.float(), dim=-1)
    # Stable sort: equal log-probs keep ascending token id (torch.topk gives no such promise).
    values, indices = torch.sort(logprobs, dim=-1, descending=True, stable=True)
    return indices[..., :k].contiguous(), values[..., :k].contiguous()


def _budgets(budget: int | torch.Tensor | list[int], bs: int) -> list[int]:
    if isinstance(budget, bool):
        raise TypeError("budget must be an int or one int per request, got bool")
    if isinstance(budget, int):
        values = [budget] * bs
    elif isinstance(budget, torch.Tensor):
        if budget.dtype not in (torch.int32, torch.int64) or budget.dim() != 1:
            raise TypeError(f"budget tensor must be 1-D int32/int64, got {budget.dtype} shape {tuple(budget.shape)}")
        values = [int(v) for v in budget.tolist()]
    else:
        values = list(budget)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise TypeError(f"budget must be an int or a sequence of ints, got {budget!r}")
    if len(values) != bs:
        raise ValueError(f"budget has {len(values)} entries for a batch of {bs} requests")
    for b, v in enumerate(values):
        if v < 0:
            raise ValueError(f"request {b}: budget must be >= 0, got {v}")
    return values


def _prepare(draft_token_ids, draft_logprobs, anchor_token_ids, budget, max_depth, min_prob):
    check_draft_topk(draft_token_ids, draft_logprobs)
    bs, depth_all, _ = draft_token_ids.shape
    check_tensor("anchor_token_ids", anchor_token_ids, dtype=torch.int64, ndim=1)
    check_shape("anchor_token_ids", anchor_token_ids, (bs,))
    budgets = _budgets(budget, bs)
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
    budgets, depth_limit, log_min = _prepare(
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


def _quota_lower_bound(lp: torch.Tensor, quota: torch.Tensor, spine_depth: torch.Tensor) -> torch.Tensor:
    """A lower bound on each request's ``quota``-th best non-spine node log-weight.

    A narrow beam (the ``W`` best nodes of each depth among the children of the previous
    depth's ``W``) finds real, distinct prefixes with sums formed exactly as the tree forms
    them. At most ``spine_depth`` of them are spine nodes, so their
    ``(quota + spine_depth)``-th best value is <= the ``quota``-th best non-spine value of
    the whole tree: a node strictly below it has ``quota`` better non-spine nodes and is
    never chosen. ``-inf`` when the beam found too few nodes, ``+inf`` where ``quota == 0``.

    Args: ``lp`` ``[bs, D, K]`` float64; ``quota``, ``spine_depth`` ``[bs]`` int64.
    Returns ``[bs]`` float64.
    """
    bs, depth, k = lp.shape
    need = quota + spine_depth
    top = int(need.max())
    width = max(1, -(-2 * top // max(depth, 1)))  # ceil(2 * top / depth)
    found = []
    beam = lp.new_zeros(bs, 1)
    for d in range(depth):
        cand = (beam[:, :, None] + lp[:, d, None, :]).reshape(bs, -1)
        beam = torch.topk(cand, min(width, cand.shape[1]), dim=1, sorted=False).values
        found.append(beam)
    values = torch.cat(found, dim=1)
    inf = torch.full((bs,), math.inf, dtype=torch.float64, device=lp.device)
    top = min(top, values.shape[1])
    if top == 0:
        return torch.where(quota > 0, -inf, inf)
    best = torch.topk(values, top, dim=1).values
    kth = best.gather(1, (need - 1).clamp(0, top - 1)[:, None])[:, 0]
    kth = torch.where(need <= top, kth, -inf)
    return torch.where(quota > 0, kth, inf)


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
        :class:`DDTreeBuildResult`, nodes in tree order (module docstring: order and ties).

    Raises:
        TypeError: wrong dtype (nothing is converted implicitly).
        ValueError: bad shape, budget < 0, max_depth out of range, min_prob outside (0, 1],
            or a draft row that is NaN, unsorted, unnormalised or has a repeated token
            (the message names request and depth).
    """
    budgets, depth_limit, log_min = _prepare(
        draft_token_ids, draft_logprobs, anchor_token_ids, budget, max_depth, min_prob
    )
    bs, _, k = draft_token_ids.shape
    device = draft_token_ids.device
    b_max = max(budgets, default=0)
    n = 1 + b_max
    budget_t = torch.tensor(budgets, dtype=torch.int64, device=device)
    spine_depth = budget_t.clamp(max=depth_limit) if top1_spine else torch.zeros_like(budget_t)
    if b_max == 0 or depth_limit == 0:
        out = _empty_result(bs, n, anchor_token_ids)
        return DDTreeBuildResult(num_nodes=torch.ones(bs, dtype=torch.int64), **out)

    lp = draft_logprobs.to(torch.float64)
    quota = budget_t - spine_depth  # non-spine draft nodes each tree takes
    bound = _quota_lower_bound(lp[:, :depth_limit], quota, spine_depth)
    level_logw, level_cand, level_spine = [], [], []
    parent_logw = torch.zeros(bs, 1, dtype=torch.float64, device=device)
    parent_spine = torch.ones(bs, 1, dtype=torch.bool, device=device)  # the root heads the spine
    for d in range(depth_limit):
        width = parent_logw.shape[1]
        # Candidate c = parent * K + rank, parents in lexicographic order: ascending c is
        # lexicographic rank-tuple order at this depth.
        cand = (parent_logw[:, :, None] + lp[:, d, None, :]).reshape(bs, width * k)
        cand_spine = torch.zeros_like(cand, dtype=torch.bool)
        cand_spine[:, 0] = parent_spine[:, 0] & (d + 1 <= spine_depth)
        floor = bound[:, None] if log_min is None else bound[:, None].clamp(min=log_min)
        keep = ((cand >= floor) & (cand > -math.inf)) | cand_spine
        if int(keep.sum(1).max()) > b_max:
            # At most one spine node per depth and quota <= b_max - (1 if spine), so a node
            # below this depth's b_max-th best value is never among the quota best.
            kth = torch.topk(cand, b_max, dim=1, sorted=False).values.min(dim=1, keepdim=True).values
            keep &= (cand >= kth) | cand_spine
        width_new = int(keep.sum(1).max())
        if width_new == 0:
            break
        slot = torch.where(keep, keep.long().cumsum(1) - 1, width_new)  # compact, lex order kept
        parent_logw = torch.full((bs, width_new + 1), -math.inf, dtype=torch.float64, device=device)
        parent_logw = parent_logw.scatter_(1, slot, cand)[:, :width_new]
        cand_index = torch.full((bs, width_new + 1), -1, dtype=torch.int64, device=device)
        cand_index = cand_index.scatter_(1, slot, torch.arange(width * k, device=device).expand(bs, -1))[:, :width_new]
        parent_spine = torch.zeros((bs, width_new + 1), dtype=torch.bool, device=device)
        parent_spine = parent_spine.scatter_(1, slot, cand_spine)[:, :width_new]
        level_logw.append(parent_logw)
        level_cand.append(cand_index)
        level_spine.append(parent_spine)

    depth_count = len(level_logw)
    if depth_count == 0:  # every depth-1 node pruned
        out = _empty_result(bs, n, anchor_token_ids)
        return DDTreeBuildResult(num_nodes=torch.ones(bs, dtype=torch.int64), **out)
    widths = [t.shape[1] for t in level_logw]
    offsets = [0]
    for w in widths[:-1]:
        offsets.append(offsets[-1] + w)
    all_logw = torch.cat(level_logw, dim=1)  # [bs, T], entries in (depth, lex) order
    all_depth = torch.cat([torch.full((w,), d + 1, device=device) for d, w in enumerate(widths)])
    all_spine = torch.cat(level_spine, dim=1)
    all_rank = torch.cat([c.clamp(min=0) % k for c in level_cand], dim=1)
    # Entry index of each entry's parent (-1 for depth 1: the root).
    all_parent_entry = torch.cat(
        [torch.full_like(level_cand[0], -1)]
        + [level_cand[d].clamp(min=0) // k + offsets[d - 1] for d in range(1, depth_count)],
        dim=1,
    )
    all_token = torch.cat(
        [draft_token_ids[:, d, :].gather(1, level_cand[d].clamp(min=0) % k) for d in range(depth_count)], dim=1
    )

    order = torch.sort(all_logw, dim=1, descending=True, stable=True).indices  # tree order
    s_logw = all_logw.gather(1, order)
    s_depth = all_depth[order]
    valid = s_logw > -math.inf
    spine = all_spine.gather(1, order)
    non_spine = valid & ~spine
    non_spine_rank = non_spine.long().cumsum(1) - 1
    selected = spine | (non_spine & (non_spine_rank < quota[:, None]))

    node_index = selected.long().cumsum(1)  # 1-based node index of each selected entry
    target = torch.where(selected, node_index, torch.full_like(node_index, n))  # n: discard column
    node_of_entry = torch.full_like(all_logw, -1, dtype=torch.int64)
    node_of_entry.scatter_(1, order, torch.where(selected, node_index, -1))
    s_parent_entry = all_parent_entry.gather(1, order)
    s_parent = torch.where(
        s_parent_entry < 0,
        torch.zeros_like(s_parent_entry),
        node_of_entry.gather(1, s_parent_entry.clamp(min=0)),
    )

    out = _empty_result(bs, n + 1, anchor_token_ids)
    out = {key: v.to(device) for key, v in out.items()}
    out["node_token_ids"].scatter_(1, target, all_token.gather(1, order))
    out["parents"].scatter_(1, target, s_parent)
    out["depths"].scatter_(1, target, s_depth)
    out["ranks"].scatter_(1, target, all_rank.gather(1, order))
    out["node_logws"].scatter_(1, target, s_logw.float())
    out = {key: v[:, :n].contiguous() for key, v in out.items()}
    num_nodes = 1 + selected.sum(1)
    return DDTreeBuildResult(num_nodes=num_nodes, **out)
