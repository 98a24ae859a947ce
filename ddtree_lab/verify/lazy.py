"""The torch-lazy backend: the reference walk, computing each row's distribution only where the walk reads it."""

from __future__ import annotations

import torch

from ..sampling import SamplingParams, apply_min_p, filtered_probs
from .reference import walk_sampled_batch
from .triton import KERNEL_ORDER
from .types import VerifyOutput

__all__ = ["verify_lazy", "lazy_row_probs", "row_problem"]


def verify_lazy(vi, logits, items, coins, final_coins, threshold_single, threshold_acc) -> VerifyOutput:
    """The reference walk; each row's distribution computed only when the walk reaches it."""

    def row_of(b: int, i: int) -> torch.Tensor:
        row = logits[b, i].float()
        what = row_problem(row)
        if what is not None:
            raise ValueError(f"target logits, request {b}, node {i}: row has {what}")
        probs = lazy_row_probs(row, items[b])
        if items[b].banned_token_ids and bool(torch.isnan(probs).any()):
            raise ValueError(f"target logits, request {b}, node {i}: no probability left: every token with a "
                             f"finite logit is banned (banned_token_ids)")
        return probs

    return walk_sampled_batch(vi, row_of, coins, final_coins, threshold_single, threshold_acc, None, "torch-lazy")


def lazy_row_probs(row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One row of :func:`ddtree_lab.target_probs`, bit for bit, with less work.

    ``row``: ``[V]`` float32 logits (already checked). The same torch ops as the reference,
    except that with top-k on, top-p sorts only the top-k survivors: the reference's sorted
    row is those survivors followed by zeros, its float32 running sum is the survivors'
    running sum followed by a constant, so the first position reaching ``top_p`` (or none,
    meaning keep all) is the same.
    """
    vocab = row.shape[-1]
    if params.order != KERNEL_ORDER or params.banned_token_ids:  # the reference's own row function
        return filtered_probs(row, params)
    if params.is_greedy:
        return torch.zeros_like(row).scatter_(-1, row.argmax(-1, keepdim=True), 1.0)
    scaled = row / torch.full_like(row[..., :1], params.temperature)
    survivors = None
    if 0 < params.top_k < vocab:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[..., -1:]
        survivors = scaled >= kth
        scaled = scaled.masked_fill(~survivors, -float("inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        candidates = probs if survivors is None else probs[survivors]
        sorted_p = torch.sort(candidates, dim=-1, descending=True).values
        cum = sorted_p.cumsum(-1)
        pos = int(torch.searchsorted(cum, torch.full_like(cum[..., :1], params.top_p)))
        if pos < sorted_p.shape[-1]:
            keep = probs >= sorted_p[pos]
        elif survivors is None or survivors.all():
            keep = probs >= sorted_p[-1]  # the reference clamps to the last sorted value
        else:
            keep = probs >= 0.0  # the reference's cut lands on a zero: keep all
        probs = probs * keep
        probs = probs / probs.sum(-1, keepdim=True)
    return apply_min_p(probs, params.min_p)


def row_problem(row: torch.Tensor) -> str | None:
    if torch.isnan(row).any():
        return "NaN"
    if torch.isneginf(row).all():
        return "every entry -inf"
    if torch.isposinf(row).any():
        return "+inf"
    return None
