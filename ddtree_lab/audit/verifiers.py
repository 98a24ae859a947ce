"""Running a verifier over many coin sets: the lab's backends, any callable, and the plain sampler beside them."""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import torch

from ..buffers import DDTreeVerifyInput
from ..sampling import SamplingParams, normalize_params, target_probs
from ..verify import VerifyOutput
from .rows import lab_rows, sampled_walk

__all__ = ["Verifier", "reference_verifier", "backend_verifier", "plain_sample", "target_probs_topp_first"]

Verifier = Callable[..., VerifyOutput]


def repeat_case(vi: DDTreeVerifyInput, count: int) -> DDTreeVerifyInput:
    n = vi.num_rows
    rep = {f.name: getattr(vi, f.name).expand(count, *getattr(vi, f.name).shape[1:]).clone()
           for f in dataclasses.fields(vi)}
    rep["retrieve_index"] = torch.arange(count)[:, None] * n + vi.retrieve_index
    return DDTreeVerifyInput(**rep)


def reference_verifier(threshold_single: float = 1.0, threshold_acc: float = 1.0, validate: bool = True) -> Verifier:
    def verify(vi, logits, params, coins, final_coins):
        return sampled_walk(vi, logits, params, coins, final_coins, lab_rows, threshold_single, threshold_acc, validate)

    verify.__name__ = "reference"
    return verify


def backend_verifier(name: str, threshold_single: float, threshold_acc: float, validate: bool = True) -> Verifier:
    import inspect

    from ..verify import verify_tree

    kw = {} if validate or "validate" not in inspect.signature(verify_tree).parameters else {"validate": False}

    def verify(vi, logits, params, coins, final_coins):
        return verify_tree(vi, logits.contiguous(), params, coins, final_coins, backend=name,
                           threshold_single=threshold_single, threshold_acc=threshold_acc, **kw)

    verify.__name__ = name
    return verify


def plain_sample(logits_row: torch.Tensor, params: SamplingParams, coins: torch.Tensor) -> torch.Tensor:
    """The lab's plain (non-speculative) sampler, vectorised over coins: ``[D]`` tokens drawn
    by inverse CDF (float64 running sum in token-id order, as :func:`ddtree_lab.verify.residual_draw`)
    from ``target_probs`` of one ``[V]`` logit row; greedy: the argmax."""
    p = target_probs(logits_row.cpu()[None, None].float(), params)[0, 0].double()
    cum = p.cumsum(0)
    idx = torch.searchsorted(cum, coins.double() * cum[-1], right=True).clamp(max=p.shape[0] - 1)
    positive = p.nonzero().flatten()
    bad = p[idx] <= 0
    if bad.any():
        idx[bad] = positive[-1]
    return idx


def target_probs_topp_first(logits: torch.Tensor, params: SamplingParams | Sequence[SamplingParams],
                            num_nodes: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`ddtree_lab.target_probs` with the *other* filtering order: top-p on the
    temperature-scaled softmax of the whole row first, then top-k among the survivors,
    renormalised (a named alternative to the lab's order, for audits; never used silently).
    Shapes as :func:`ddtree_lab.target_probs`."""
    bs = logits.shape[0]
    items = normalize_params(params, bs, logits.shape[-1])
    if "order" in {f.name for f in dataclasses.fields(SamplingParams)}:  # the lab names both orders
        return target_probs(logits, [dataclasses.replace(p, order="top_p_then_top_k") for p in items], num_nodes)
    out = torch.zeros(logits.shape, dtype=torch.float32)
    for b, p in enumerate(items):
        nn = None if num_nodes is None else num_nodes[b : b + 1]
        if p.is_greedy or (p.top_p >= 1.0 or p.top_k <= 0):
            out[b] = target_probs(logits[b : b + 1], p, nn)[0]
            continue
        probs = target_probs(logits[b : b + 1], dataclasses.replace(p, top_k=0, min_p=None), nn)[0]
        kth = torch.topk(probs, p.top_k, dim=-1).values[..., -1:]
        probs = probs * (probs >= kth)
        probs = probs / probs.sum(-1, keepdim=True).clamp(min=1e-30)
        if p.min_p:
            probs = probs * (probs >= p.min_p * probs.max(-1, keepdim=True).values)
            probs = probs / probs.sum(-1, keepdim=True).clamp(min=1e-30)
        out[b] = probs
    return out
