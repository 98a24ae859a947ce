"""The device tree builder (``build_tree_device``: fixed-shape tensor ops, no host read) equals
the heap reference and the numpy builder exactly: nodes, order, parents, depths, ranks and
float32 log-weights, under ties, zero-probability tokens, per-request budgets, ``max_depth``,
``top1_spine`` and ``min_prob``."""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

import ddtree_lab as dl
from ddtree_lab.build_device import build_tree_device
from ddtree_lab.hostsync import HostSyncCounter


def _case(seed, bs, tie, zeros):
    g = torch.Generator().manual_seed(seed)
    depth = int(torch.randint(1, 7, (1,), generator=g))
    k = int(torch.randint(1, 7, (1,), generator=g))
    vocab = k + int(torch.randint(0, 6, (1,), generator=g))
    if tie:  # few distinct values: many equal log-weights, across depths and siblings
        logits = torch.randint(0, 3, (bs, depth, vocab), generator=g).float()
    else:
        logits = torch.randn(bs, depth, vocab, generator=g) * float(torch.rand(1, generator=g) * 6)
    if zeros:  # zero-probability tokens: -inf log-probs inside the top-k
        logits[..., 1:] = torch.where(torch.rand(bs, depth, vocab - 1, generator=g) < 0.4, -math.inf, logits[..., 1:])
    ids, lp = dl.draft_topk_from_logits(logits, k=k)
    budgets = [int(v) for v in torch.randint(0, 40, (bs,), generator=g)]
    max_depth = int(torch.randint(0, depth + 1, (1,), generator=g))
    return ids, lp, budgets, max_depth


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 100_000), bs=st.integers(1, 4), tie=st.booleans(), zeros=st.booleans(),
       spine=st.booleans(), min_prob=st.sampled_from([None, 0.01, 0.2]), per_request=st.booleans())
def test_device_builder_equals_the_heap_reference(seed, bs, tie, zeros, spine, min_prob, per_request):
    ids, lp, budgets, max_depth = _case(seed, bs, tie, zeros)
    budget = budgets if per_request else budgets[0]
    anchor = torch.arange(bs, dtype=torch.int64) + 5
    want = dl.build_tree_reference(ids, lp, anchor, budget, max_depth, top1_spine=spine, min_prob=min_prob)
    got = build_tree_device(ids, lp, anchor, budget, max_depth, top1_spine=spine, min_prob=min_prob)
    assert got.equals(want), (got, want)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("budget", [8, 64, 256])
def test_device_builder_equals_the_numpy_builder_at_engine_shapes(seed, budget):
    g = torch.Generator().manual_seed(seed)
    ids, lp = dl.draft_topk_from_logits(torch.randn(6, 15, 2000, generator=g) * (1 + seed), k=min(budget, 2000))
    anchor = torch.zeros(6, dtype=torch.int64)
    want = dl.build_tree(ids, lp, anchor, budget)
    assert build_tree_device(ids, lp, anchor, budget).equals(want)
    assert build_tree_device(ids, lp, anchor, budget, validate=False).equals(want)


def test_device_builder_reads_nothing_on_the_host_without_validation():
    g = torch.Generator().manual_seed(0)
    for bs, budget in ((1, 8), (32, 64)):
        ids, lp = dl.draft_topk_from_logits(torch.randn(bs, 15, 500, generator=g), k=budget)
        with HostSyncCounter() as syncs:
            build_tree_device(ids, lp, torch.zeros(bs, dtype=torch.int64), budget, validate=False, top1_spine=True)
        assert syncs.total == 0, syncs.table()


def test_device_builder_names_bad_input():
    ids, lp = dl.draft_topk_from_logits(torch.randn(2, 3, 20), k=4)
    anchor = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="request 1, depth 2: draft_logprobs not sorted"):
        bad = lp.clone()
        bad[1, 1] = bad[1, 1].flip(0)
        build_tree_device(ids, bad, anchor, 4)
    with pytest.raises(TypeError, match="draft_logprobs"):
        build_tree_device(ids, lp.double(), anchor, 4, validate=False)
    with pytest.raises(ValueError, match="budget has 3 entries for a batch of 2"):
        build_tree_device(ids, lp, anchor, [1, 2, 3], validate=False)
    with pytest.raises(ValueError, match="max_depth"):
        build_tree_device(ids, lp, anchor, 4, max_depth=4)
