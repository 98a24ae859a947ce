"""Planted rule variants on made-up steps (no model): test support for tests/test_rule_inference.py.

Each step is the real pipeline on random target logits over a small vocabulary: the drafter's
top-k (the target's row with noise), :func:`ddtree_lab.build_tree`, the buffers, coins from a
seeded generator, the verifier :func:`ddtree_lab.faults.verify_variant` (or the target-only
rule), and :func:`ddtree_lab.record.record_step` at level ``full`` keeping every logit (top-M =
V), with the request's own rows recorded. A function of ``(seed, step)``.
"""

from __future__ import annotations

import torch

import ddtree_lab as dl
from ddtree_lab.faults import RuleVariant, verify_variant
from ddtree_lab.record import record_step
from ddtree_lab.step import DraftTopK
from ddtree_lab.verify import draw_coins

VOCAB = 48


def planted_run(variant: RuleVariant | None, params: dl.SamplingParams, steps: int = 12, seed: int = 0,
                budget: int = 10, sharp: float = 2.5, verifier=None) -> dl.Run:
    """A one-request run of ``steps`` steps verified by ``variant`` (None: the target-only rule;
    ``verifier(vi, logits, probs, coins, final, logws) -> VerifyOutput`` overrides both)."""
    out = []
    for k in range(steps):
        g = torch.Generator().manual_seed(seed * 10_007 + k)
        depth = 4
        # the target's logits for every possible node are drawn after the tree: one row per node
        draft_logits = torch.randn(1, depth, VOCAB, generator=g) * sharp
        ids, lps = dl.draft_topk_from_logits(draft_logits, k=4)
        tree = dl.build_tree(ids, lps, torch.tensor([1]), budget)
        vi = dl.compile_retrieve(tree, torch.tensor([20 + k]))
        n = int(tree.num_nodes[0])
        logits = torch.randn(1, n, VOCAB, generator=g) * sharp
        # the target agrees with the drafter on its top token at each node's depth, often
        depths = tree.depths[0, :n]
        for i in range(n):
            d = int(depths[i])
            if d < depth:
                logits[0, i] += 0.8 * draft_logits[0, d]
        probs = dl.target_probs(logits, [params])
        coins, final = draw_coins([torch.Generator().manual_seed(seed * 7919 + k)], vi.num_rows)
        if verifier is not None:
            o = verifier(vi, logits, probs, coins, final, tree.node_logws)
        elif variant is None:
            o = dl.verify_sampled(vi, probs, coins, final)
        else:
            o = verify_variant(vi, logits, [params], coins, final, tree.node_logws, variant)
        out.append(record_step(step=k, request=0, params=params, tree=tree.request(0), buffers=vi.request(0),
                               output=o, coins=coins[0], final_coin=float(final[0]),
                               draft=DraftTopK(ids[0], lps[0]), logits=logits[0], probs=probs[0], level="full",
                               prefix_len=20 + k, top_m_logits=VOCAB, backend="reference"))
    return dl.Run({"vocab_size": VOCAB}, out)
