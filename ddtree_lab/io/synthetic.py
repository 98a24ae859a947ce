"""Synthetic serving-shape runs (no model): real trees, buffers and verify outputs on made-up rows.

For tests and benchmarks that need many steps fast: :func:`synthetic_steps` makes one decoding
step of a batch of requests the way a live session does -- the drafter's top-k (made up:
``K`` distinct ids per position with log-probabilities of a peaked distribution), the DDTree
build (:func:`ddtree_lab.build_tree`), the buffers (:func:`ddtree_lab.compile_retrieve`), the
lab's reference verifier (:func:`ddtree_lab.verify_sampled`) on target rows that put mass
``q * U(0.5, 1.5)`` on each child's token (``q`` its drafter probability) and the rest on a few
random tokens, then :func:`ddtree_lab.record.record_step` at the given level. The verifier
runs on the step's own small vocabulary (the ids the rows use, in ascending order, so every
draw is the same) and the ids are mapped back after; the bonus row prefix is the full
vocabulary's, zeros where the row has no mass. Everything is
a function of ``(seed, step)``, so a step can be made again bit for bit.
"""

from __future__ import annotations

import dataclasses

import torch

from ..build import build_tree
from ..buffers import compile_retrieve
from ..record import record_step
from ..sampling import SamplingParams
from ..step import DraftTopK, Step
from ..verify import draw_coins, verify_sampled

__all__ = ["synthetic_steps", "SyntheticShape"]


class SyntheticShape:
    """The shape of a synthetic run: ``requests``, ``budget`` (B), ``vocab`` (V),
    ``block_size`` (L), ``top_k`` (K of the draft), ``level``, ``temperature``."""

    def __init__(self, requests: int = 4, budget: int = 16, vocab: int = 1000, block_size: int = 16,
                 top_k: int | None = None, level: str = "light", temperature: float = 1.0):
        self.requests, self.budget, self.vocab, self.block_size = requests, budget, vocab, block_size
        self.top_k = min(top_k or budget, vocab)
        self.level, self.temperature = level, temperature


def _draft(g: torch.Generator, bs: int, depth: int, k: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    base = torch.randint(0, vocab, (bs, depth, 1), generator=g)
    stride = torch.randint(1, max(2, vocab // k), (bs, depth, 1), generator=g)
    ids = (base + stride * torch.arange(k)) % vocab  # k distinct ids per position (stride * k < vocab)
    raw = torch.randn(bs, depth, k, generator=g) * 2.0
    raw[..., 0] += 3.0
    lps = torch.log_softmax(torch.cat([raw, torch.zeros(bs, depth, 1)], -1), -1)[..., :k]  # mass left for the rest
    lps, order = lps.sort(-1, descending=True)
    return ids.gather(-1, order), lps.float()


def synthetic_steps(shape: SyntheticShape, seed: int, step: int, prefix_lens: list[int] | None = None,
                    timings: dict | None = None, faults=None) -> list[Step]:
    """One synthetic decoding step of every request (module docstring): a list of
    ``shape.requests`` :class:`~ddtree_lab.step.Step` at ``shape.level``, step number
    ``step``, request ``b`` at prefix length ``prefix_lens[b]`` (default ``64 + step * 4``);
    ``faults`` (:class:`ddtree_lab.faults.Faults` or names) plants a verifier fault the way a
    live session does (its other stages do not exist here).

    Raises:
        ValueError: a shape the builder refuses (e.g. a budget over its limit).
    """
    from ..faults import as_faults

    planted = as_faults(faults)
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    bs, vocab = shape.requests, shape.vocab
    ids, lps = _draft(g, bs, shape.block_size - 1, shape.top_k, vocab)
    anchors = torch.randint(0, vocab, (bs,), generator=g)
    tree = build_tree(ids, lps, anchors, shape.budget)
    prefix = torch.tensor(prefix_lens if prefix_lens is not None else [64 + step * 4] * bs, dtype=torch.int64)
    vi = compile_retrieve(tree, prefix)
    params = SamplingParams(temperature=shape.temperature)
    gens = [torch.Generator().manual_seed(seed * 7919 + step * 131 + b) for b in range(bs)]
    coins, final = draw_coins(gens, vi.num_rows)
    out = []
    for b in range(bs):
        n = int(tree.num_nodes[b])
        par, tok, lw = tree.parents[b, :n], tree.node_token_ids[b, :n], tree.node_logws[b, :n]
        others = torch.randint(0, vocab, (n, 4), generator=g)
        ids_used = torch.unique(torch.cat([tok, others.flatten()]))  # ascending: the compact vocabulary
        ctok, cothers = torch.searchsorted(ids_used, tok), torch.searchsorted(ids_used, others)
        rows = torch.zeros(1, n, ids_used.numel())
        q = (lw[1:] - lw[par[1:]]).exp()
        rows[0, par[1:], ctok[1:]] = q * (0.5 + torch.rand(n - 1, generator=g))
        rows[0] /= rows[0].sum(-1, keepdim=True).clamp(min=0.95) / 0.95
        rest = (1.0 - rows[0].sum(-1)).clamp(min=0.0)
        w = torch.rand(n, 4, generator=g) + 0.05
        rows[0].scatter_add_(-1, cothers, rest[:, None] * w / w.sum(-1, keepdim=True))
        vib = dataclasses.replace(vi.request(b), node_token_ids=ctok[None])
        fin = final[b : b + 1]
        if planted.verifier:
            # raw logits whose softmax at the request's temperature is the made-up rows
            raw = torch.where(rows > 0, rows.log(), torch.full_like(rows, -1e4)) * shape.temperature
            o, fin = planted.verify(vib, rows, coins[b : b + 1, :vib.num_rows], fin, lw[None], logits=raw,
                                    params=[params])
        else:
            o = verify_sampled(vib, rows, coins[b : b + 1, :vib.num_rows], fin)
        s = record_step(
            step=step, request=b, params=params, output=o, level=shape.level, prefix_len=int(prefix[b]),
            tree=dataclasses.replace(tree.request(b), node_token_ids=ctok[None]), buffers=vib,
            draft=DraftTopK(ids[b], lps[b]), coins=coins[b, :n], final_coin=float(fin[0]), probs=rows[0],
            timings=timings or {}, backend="reference")
        out.append(_to_vocab(s, ids_used))
    return out


def _to_vocab(s: Step, ids_used: torch.Tensor) -> Step:
    """A step verified on the compact vocabulary ``ids_used`` (ascending ids), with every token
    id and the bonus row prefix mapped back to the full vocabulary."""
    def ids(t):
        return torch.where(t >= 0, ids_used[t.clamp(min=0)], t)

    o, prefix = s.output, s.final_row_prefix
    assert o is not None and prefix is not None  # record_step at level full / light keeps both
    bonus = [dataclasses.replace(d, token=int(ids_used[d.token]) if d.token >= 0 else d.token) for d in o.bonus]
    decisions = [[dataclasses.replace(d, token=int(ids_used[d.token]) if d.token >= 0 else d.token) for d in row]
                 for row in o.decisions]
    output = dataclasses.replace(o, emitted_tokens=ids(o.emitted_tokens), bonus_token=ids(o.bonus_token),
                                 bonus=bonus, decisions=decisions)
    full = torch.zeros(int(ids_used[prefix.numel() - 1]) + 1 if prefix.numel() else 0)
    if prefix.numel():
        full[ids_used[: prefix.numel()]] = prefix
    return s.replace(output=output, node_token_ids=ids(s.node_token_ids), final_row_prefix=full)
