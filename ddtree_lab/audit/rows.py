"""The reference walk under a chosen row transform: the lab's own rows, or a planted fault's."""

from __future__ import annotations

from typing import Callable

import torch

from ..buffers import DDTreeVerifyInput
from ..sampling import SamplingParams, normalize_params, target_probs
from ..verify import VerifyOutput, verify_sampled, walk_sampled_batch

__all__ = ["sampled_walk", "lab_rows"]


def sampled_walk(vi: DDTreeVerifyInput, logits: torch.Tensor, params, coins: torch.Tensor, final_coins: torch.Tensor,
             make: Callable[[torch.Tensor, SamplingParams, torch.Tensor], torch.Tensor],
             threshold_single: float = 1.0, threshold_acc: float = 1.0, validate: bool = True) -> VerifyOutput:
    """:func:`ddtree_lab.verify_sampled` on the rows ``make(logits[b:b+1], params[b], num_nodes)``.

    When the batch repeats one step (the audit passes ``logits.expand``: stride 0 on the batch,
    equal params) the rows are made and checked once, on the first copy, and every copy is
    walked by the reference's own walk (:func:`ddtree_lab.verify.walk_sampled_batch`, which
    ``verify_sampled`` runs after its checks) over those rows. ``validate=False`` skips those
    checks (the buffer validation every backend runs by default)."""
    items = normalize_params(params, vi.batch_size, logits.shape[-1])
    if logits.stride(0) == 0 and all(p == items[0] for p in items):
        rows = make(logits[:1], items[0], vi.num_nodes[:1])
        if validate:
            verify_sampled(vi.request(0), rows, coins[:1], final_coins[:1], threshold_single=threshold_single,
                           threshold_acc=threshold_acc)  # the reference's checks, once
        return walk_sampled_batch(vi, lambda b, i: rows[0, i], coins, final_coins, threshold_single, threshold_acc,
                                  None, "reference")
    rows = torch.cat([make(logits[b : b + 1], items[b], vi.num_nodes[b : b + 1]) for b in range(logits.shape[0])])
    return verify_sampled(vi, rows, coins, final_coins, threshold_single=threshold_single,
                          threshold_acc=threshold_acc)


def lab_rows(logits, p, num_nodes):
    return target_probs(logits, p, num_nodes)
