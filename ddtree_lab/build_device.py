"""Build stage on the device: the best-first DDTree trees of a batch in tensor ops, no host read.

The same trees as :func:`ddtree_lab.build_tree` (DDTree, Ringel & Romano, arXiv 2604.12989,
Algorithm 1; order, ties, ``top1_spine`` and ``min_prob`` as in :mod:`ddtree_lab.build`),
computed with fixed-shape torch ops on the device of the draft top-k: no per-node Python, no
value read on the host (the number of ops depends only on the depth ``L-1``, not on the
batch or the budget), so a GPU step does not wait for the build.

**Why a beam of width B is exact.** Nodes are ordered by the key ``(-node_logw, depth, rank
tuple)``; the tree is the first ``B`` prefixes in that order. Every node better than a tree
node is a tree node, so a tree node at depth ``d`` has fewer than ``B`` better nodes at depth
``d`` (with ``top1_spine``: fewer than ``quota = B - spine depth`` better non-spine nodes), and
its parent is in the tree. Hence, depth by depth, keeping the ``B`` best children (spine
forced, then the ``quota`` best others) of the nodes kept one depth up keeps every tree node;
the ``B`` best of all kept nodes are then the tree. A node with rank ``>= B`` has ``B`` better
siblings, so only the first ``min(K, B)`` columns are read.

**Order.** Each depth's kept nodes are held in rank-tuple (lexicographic) order, so the
candidates ``(parent slot, rank)`` of the next depth are in rank-tuple order too, and the
flat layout ``(depth, slot)`` is in ``(depth, rank tuple)`` order. One stable descending sort
on the float64 log-weight then gives the key order: equal log-weights keep the shallower, then
the lexicographically smaller node first, as the heap does.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from .build import DDTreeBuildResult, check_build_arguments
from .hostsync import to_device

__all__ = ["build_tree_device"]


def _stable_desc(key: torch.Tensor) -> torch.Tensor:
    """Indices sorting each row of ``key`` descending, equal keys in index order."""
    return torch.sort(key, dim=-1, descending=True, stable=True).indices


def _first(key: torch.Tensor, count: torch.Tensor, most: int) -> torch.Tensor:
    """Mask of the first ``count[b]`` entries of row ``b`` in (key descending, index ascending)
    order, ``count <= most``: the ``count``-th largest value by ``topk``, everything above it,
    and of the entries equal to it the first ones in index order (a stable sort's choice,
    without sorting the row)."""
    most = min(most, key.shape[1])
    values = key.topk(most, dim=1, sorted=True).values
    edge = values.gather(1, (count - 1).clamp(0, most - 1)[:, None])
    above = key > edge
    tie = key == edge
    room = count[:, None] - above.sum(1, keepdim=True)
    return (above | (tie & (tie.cumsum(1) <= room))) & (count > 0)[:, None]


def _compact(mask: torch.Tensor, width: int) -> torch.Tensor:
    """Per row, the indices where ``mask`` is set, ascending, in ``width`` slots (at most
    ``width`` are set); empty slots hold ``mask.shape[1]``."""
    bs, total = mask.shape
    slot = torch.where(mask, mask.cumsum(1) - 1, width)
    out = torch.full((bs, width + 1), total, dtype=torch.int64, device=mask.device)
    out.scatter_(1, slot, torch.arange(total, device=mask.device).expand(bs, total))
    return out[:, :width]


def build_tree_device(
    draft_token_ids: torch.Tensor,
    draft_logprobs: torch.Tensor,
    anchor_token_ids: torch.Tensor,
    budget: int | Sequence[int] | torch.Tensor,
    max_depth: int | None = None,
    *,
    top1_spine: bool = False,
    min_prob: float | None = None,
    validate: bool = True,
) -> DDTreeBuildResult:
    """Build the DDTree draft trees of a batch on the device of ``draft_token_ids``.

    The same result as :func:`ddtree_lab.build_tree` and :func:`ddtree_lab.build_tree_reference`
    (same nodes, order, parents, ranks and float32 log-weights), computed as in the module
    docstring: per depth one stable sort of ``[bs, B * min(K, B)]`` candidates, at the end one
    stable sort of ``[bs, (L-1) * B]`` kept nodes and one for tree order. Memory
    ``O(bs * B * min(K, B))`` per depth; float64 log-weights (as the heap sums them).

    Args:
        draft_token_ids: ``[bs, L-1, K]`` int64, drafter's top-K tokens per position.
        draft_logprobs: ``[bs, L-1, K]`` float32, their log-probs, rows sorted descending and
            normalised over the vocabulary (:func:`ddtree_lab.draft_topk_from_logits`).
        anchor_token_ids: ``[bs]`` int64, the root token of each tree.
        budget: ``B``, draft nodes per tree; an int or one per request (list or ``[bs]`` int
            tensor; a tensor is read on the host once). ``N = 1 + max(B)`` rows.
        max_depth: deepest draft depth allowed, default ``L-1``.
        top1_spine, min_prob: as in :func:`ddtree_lab.build_tree`.
        validate: check the draft top-k rows with :func:`ddtree_lab.check_draft_topk` (on the
            host: it reads them). ``False`` skips that read, for callers whose rows come from
            :func:`ddtree_lab.draft_topk_from_logits` (which checked the logits); the shapes,
            dtypes, budgets and options are checked either way.

    Returns:
        :class:`ddtree_lab.DDTreeBuildResult` on the device of ``draft_token_ids``.

    Raises:
        TypeError / ValueError: as :func:`ddtree_lab.build_tree` (bad dtype, shape, budget,
            max_depth, min_prob; with ``validate``, a bad draft row naming request and depth).
    """
    budgets, depth_limit, log_min = check_build_arguments(
        draft_token_ids, draft_logprobs, anchor_token_ids, budget, max_depth, min_prob, validate=validate)
    device = draft_token_ids.device
    bs, _, k_all = draft_token_ids.shape
    width = max(budgets, default=0)  # the beam: B_max slots per depth
    n = 1 + width
    budget_t = to_device(torch.tensor(budgets, dtype=torch.int64), device).reshape(bs)
    spine_depth = budget_t.clamp(max=depth_limit) if top1_spine else torch.zeros_like(budget_t)
    quota = budget_t - spine_depth  # non-spine draft nodes each tree takes
    out = {
        "node_token_ids": torch.full((bs, n), -1, dtype=torch.int64, device=device),
        "parents": torch.full((bs, n), -1, dtype=torch.int64, device=device),
        "depths": torch.full((bs, n), -1, dtype=torch.int64, device=device),
        "ranks": torch.full((bs, n), -1, dtype=torch.int64, device=device),
        "node_logws": torch.full((bs, n), -math.inf, dtype=torch.float32, device=device),
    }
    out["node_token_ids"][:, 0] = to_device(anchor_token_ids, device)
    out["depths"][:, 0] = 0
    out["node_logws"][:, 0] = 0.0
    if width == 0 or depth_limit == 0 or bs == 0:
        return DDTreeBuildResult(num_nodes=torch.ones(bs, dtype=torch.int64, device=device), **out)

    k = min(k_all, width)
    lp = draft_logprobs[:, :depth_limit, :k].to(torch.float64)
    tokens = draft_token_ids[:, :depth_limit, :k]
    ranks_k = torch.arange(k, device=device)
    slot = torch.arange(width, device=device)
    floor = -math.inf if log_min is None else log_min
    # depth 0: the root in slot 0, heading the spine
    logw = torch.zeros(bs, width, dtype=torch.float64, device=device)
    valid = (slot == 0).expand(bs, width)
    spine = valid & top1_spine
    levels = []  # per depth: logw, valid, spine, parent slot, rank, token; each [bs, width]
    for d in range(depth_limit):
        cand = (logw[:, :, None] + lp[:, d, None, :]).reshape(bs, width * k)  # (parent slot, rank) order
        parent = (slot[:, None].expand(width, k)).reshape(-1)
        rank = ranks_k.repeat(width)
        c_spine = (spine[:, :, None] & (ranks_k == 0)).reshape(bs, -1) & (d < spine_depth)[:, None]
        c_valid = valid[:, :, None].expand(bs, width, k).reshape(bs, -1) & (cand > -math.inf)
        c_valid &= (cand >= floor) | c_spine
        c_valid |= c_spine  # spine log-weights are finite (rank 0 of a row is)
        key = torch.where(c_spine, math.inf, torch.where(c_valid, cand, -math.inf))
        chosen = _first(key, quota + (d < spine_depth), width) & c_valid
        # the chosen candidates, still in (parent slot, rank) order, into the width slots
        pick = _compact(chosen, width)
        ok = pick < width * k
        idx = pick.clamp(max=width * k - 1)
        logw = torch.where(ok, cand.gather(1, idx), -math.inf)
        valid = ok
        spine = ok & c_spine.gather(1, idx)
        p_slot = parent[idx]
        r = rank[idx]
        tok = tokens[:, d].gather(1, r)
        levels.append((logw, valid, spine, p_slot, r, tok))
    depth_count = len(levels)
    all_logw = torch.stack([lv[0] for lv in levels], 1).reshape(bs, -1)  # [bs, D*W], (depth, slot) order
    all_valid = torch.stack([lv[1] for lv in levels], 1).reshape(bs, -1)
    all_spine = torch.stack([lv[2] for lv in levels], 1).reshape(bs, -1)
    all_parent = torch.stack([lv[3] for lv in levels], 1)  # [bs, D, W] parent slot at depth - 1
    all_rank = torch.stack([lv[4] for lv in levels], 1).reshape(bs, -1)
    all_tok = torch.stack([lv[5] for lv in levels], 1).reshape(bs, -1)
    total = depth_count * width
    key = torch.where(all_spine, math.inf, torch.where(all_valid, all_logw, -math.inf))
    kept = _first(key, all_spine.sum(1) + quota, width) & all_valid
    # tree order: the kept nodes, in (depth, rank tuple) order, stably sorted by log-weight
    flat = _compact(kept, width)
    count = kept.sum(1)
    row_ok = slot[None, :] < count[:, None]
    kept_logw = torch.where(row_ok, all_logw.gather(1, flat.clamp(max=total - 1)), -math.inf)
    tree = flat.gather(1, _stable_desc(kept_logw)).clamp(max=total - 1)  # flat index of rows 1..B
    row_of = torch.zeros(bs, total, dtype=torch.int64, device=device)  # flat node -> row (1..)
    row_of.scatter_(1, tree, torch.where(row_ok, slot + 1, 0).expand(bs, width))
    depth_of = torch.arange(depth_count, device=device).repeat_interleave(width)  # [D*W]
    node_depth = depth_of[tree]  # 0-based depth index of each row's node
    parent_slot = all_parent.reshape(bs, -1).gather(1, tree)
    parent_flat = ((node_depth - 1).clamp(min=0) * width + parent_slot).clamp(max=total - 1)
    parent_row = torch.where(node_depth == 0, 0, row_of.gather(1, parent_flat))
    rows = slice(1, n)
    out["node_token_ids"][:, rows] = torch.where(row_ok, all_tok.gather(1, tree), -1)
    out["parents"][:, rows] = torch.where(row_ok, parent_row, -1)
    out["depths"][:, rows] = torch.where(row_ok, node_depth + 1, -1)
    out["ranks"][:, rows] = torch.where(row_ok, all_rank.gather(1, tree), -1)
    out["node_logws"][:, rows] = torch.where(row_ok, all_logw.gather(1, tree), -math.inf).float()
    return DDTreeBuildResult(num_nodes=1 + count, **out)
