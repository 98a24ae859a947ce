"""Planted faults: known lossy verifiers the audit must catch (greedy rows, T=1, the other filtering order, coin reuse, thresholds)."""

from __future__ import annotations

import dataclasses

import torch

from ..sampling import SamplingParams, target_probs
from .rows import lab_rows, sampled_walk
from .verifiers import Verifier, target_probs_topp_first

__all__ = ["PLANTED_FAULTS", "planted_fault"]


def _fault_rows(make):
    def verify(vi, logits, params, coins, final_coins):
        return sampled_walk(vi, logits, params, coins, final_coins, make)

    return verify


def _greedy_rows(logits, p, num_nodes):
    return target_probs(logits, SamplingParams(temperature=0.0), num_nodes)


def _t1_rows(logits, p, num_nodes):
    return target_probs(logits, dataclasses.replace(p, temperature=1.0 if p.temperature > 0 else 0.0), num_nodes)


def _other_order_rows(logits, p, num_nodes):
    return target_probs_topp_first(logits, p, num_nodes)


def _coin_reuse(vi, logits, params, coins, final_coins):
    first = sampled_walk(vi, logits, params, coins, final_coins, lab_rows)
    last = [[i for i in row if i >= 0][-1] for row in first.accept_index.tolist()]
    reused = coins[torch.arange(vi.batch_size), torch.tensor(last)].contiguous()
    return sampled_walk(vi, logits, params, coins, reused, lab_rows)


def _lossy_threshold(vi, logits, params, coins, final_coins):
    return sampled_walk(vi, logits, params, coins, final_coins, lab_rows, threshold_acc=0.5)


#: Known lossy verifiers (the verify signature), each a fault seen in serving engines.
PLANTED_FAULTS: dict[str, tuple[Verifier, str]] = {
    "threshold": (_lossy_threshold, "acceptance threshold_acc = 0.5 (< 1): SGLang's rule accepts u <= S_k / 0.5"),
    "coin-reuse": (_coin_reuse, "the final draw reuses the last node's coin, already conditioned by the walk "
                                "(u >= S_K)"),
    "temperature-1": (_fault_rows(_t1_rows), "target rows at temperature 1 instead of the request's"),
    "greedy": (_fault_rows(_greedy_rows), "a sampled request verified greedily (one-hot argmax rows)"),
    "filter-order": (_fault_rows(_other_order_rows), "top-p applied before top-k (the other order)"),
}


def planted_fault(name: str) -> Verifier:
    """The planted lossy verifier ``name`` (one of :data:`PLANTED_FAULTS`)."""
    if name not in PLANTED_FAULTS:
        raise ValueError(f"unknown planted fault {name!r}; known: {', '.join(PLANTED_FAULTS)}")
    fn = PLANTED_FAULTS[name][0]

    def verify(vi, logits, params, coins, final_coins):
        return fn(vi, logits, params, coins, final_coins)

    verify.__name__ = f"fault:{name}"
    return verify
