import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import ddtree_lab as dl
import ddtree_lab.build
from oracles import brute_force_tree, tree_as_tuples


def _topk(logits, k):
    return dl.draft_topk_from_logits(logits, k=k)


def test_hand_case_three_depths():
    # Powers of two keep every sum exact, so the equal-probability ties below are real ties.
    # Depth 1: 10 (1/2), 11 (1/4); depth 2: 20 (1/2), 21 (1/4); depth 3: 30 (1/2), 31 (1/8).
    p = torch.tensor([[[0.5, 0.25], [0.5, 0.25], [0.5, 0.125]]])
    ids = torch.tensor([[[10, 11], [20, 21], [30, 31]]])
    for build in (dl.build_tree, dl.build_tree_reference):
        tree = build(ids, p.log(), torch.tensor([7]), budget=6)
        # 1/2: (0).  1/4: (1) depth 1 before (0,0) depth 2.  1/8: (0,1), (1,0) at depth 2 in
        # rank-tuple order, then (0,0,0) at depth 3.
        assert tree.node_token_ids[0].tolist() == [7, 10, 11, 20, 21, 20, 30]
        assert tree.parents[0].tolist() == [-1, 0, 0, 1, 1, 2, 3]
        assert tree.depths[0].tolist() == [0, 1, 1, 2, 2, 2, 3]
        assert tree.ranks[0].tolist() == [-1, 0, 1, 0, 1, 0, 0]
        assert int(tree.num_nodes[0]) == 7
        expected = torch.tensor([1.0, 0.5, 0.25, 0.25, 0.125, 0.125, 0.125]).log()
        torch.testing.assert_close(tree.node_logws[0], expected, rtol=0, atol=1e-6)


def test_ties_pinned_shallower_first_then_lexicographic_rank_tuple():
    # Every draft probability 0.5: all prefixes of one depth tie; depth decides, then ranks.
    lp = torch.full((1, 3, 2), math.log(0.5))
    ids = torch.tensor([[[1, 2], [3, 4], [5, 6]]])
    for build in (dl.build_tree, dl.build_tree_reference):
        tree = build(ids, lp, torch.tensor([0]), budget=7)
        assert tree.depths[0].tolist() == [0, 1, 1, 2, 2, 2, 2, 3]
        # depth 2 in rank-tuple order (0,0), (0,1), (1,0), (1,1); depth 3 starts with (0,0,0)
        assert tree.node_token_ids[0].tolist() == [0, 1, 2, 3, 4, 3, 4, 5]
        assert tree.parents[0].tolist() == [-1, 0, 0, 1, 1, 2, 2, 3]


def test_equal_logweights_still_put_parents_first():
    # Probability-1 tokens make child and parent log-weights equal.
    lp = torch.tensor([[[0.0, -math.inf], [0.0, -math.inf], [math.log(0.5), math.log(0.5)]]])
    ids = torch.tensor([[[1, 2], [3, 4], [5, 6]]])
    tree = dl.build_tree(ids, lp, torch.tensor([9]), budget=8)
    parents = tree.parents[0].tolist()
    assert all(parents[i] < i for i in range(1, int(tree.num_nodes[0])))
    # -inf (zero-probability) tokens never enter: 1 -> 3 -> {5, 6}
    assert int(tree.num_nodes[0]) == 5
    assert tree.node_token_ids[0, :5].tolist() == [9, 1, 3, 5, 6]


def _random_case(seed, tie):
    g = torch.Generator().manual_seed(seed)
    bs = 3
    depth = int(torch.randint(1, 5, (1,), generator=g))
    k = int(torch.randint(1, 5, (1,), generator=g))
    vocab = k + int(torch.randint(0, 6, (1,), generator=g))
    if tie:
        logits = torch.randint(0, 3, (bs, depth, vocab), generator=g).float()
    else:
        logits = torch.randn(bs, depth, vocab, generator=g) * float(torch.rand(1, generator=g) * 6)
    ids, lp = _topk(logits, k)
    budgets = [int(v) for v in torch.randint(0, 25, (bs,), generator=g)]
    max_depth = int(torch.randint(0, depth + 1, (1,), generator=g))
    return ids, lp, budgets, max_depth


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 10_000), tie=st.booleans(), spine=st.booleans(),
       min_prob=st.sampled_from([None, 0.02, 0.2]))
def test_batched_and_heap_equal_brute_force(seed, tie, spine, min_prob):
    ids, lp, budgets, max_depth = _random_case(seed, tie)
    anchor = torch.tensor([5, 6, 7])
    batched = dl.build_tree(ids, lp, anchor, budgets, max_depth, top1_spine=spine, min_prob=min_prob)
    heap = dl.build_tree_reference(ids, lp, anchor, budgets, max_depth, top1_spine=spine, min_prob=min_prob)
    assert batched.equals(heap)
    lp64 = lp.double().tolist()
    for b in range(3):
        want = brute_force_tree(lp64[b], ids[b].tolist(), 0, budgets[b], max_depth, spine, min_prob)
        got = tree_as_tuples(batched, b)
        assert [(r, t) for r, t, _ in got] == [(r, t) for r, t, _ in want]
        assert [w for *_, w in got] == pytest.approx([w for *_, w in want], abs=1e-5)


@pytest.mark.parametrize("seed", range(5))
def test_tree_order_invariants_at_engine_shapes(seed):
    g = torch.Generator().manual_seed(seed)
    ids, lp = _topk(torch.randn(4, 15, 500, generator=g) * 5, 8)
    tree = dl.build_tree(ids, lp, torch.zeros(4, dtype=torch.int64), budget=64)
    assert tree.equals(dl.build_tree_reference(ids, lp, torch.zeros(4, dtype=torch.int64), budget=64))
    for b in range(4):
        n = int(tree.num_nodes[b])
        assert n == 65
        w = tree.node_logws[b, :n]
        assert bool((w[1:] <= w[:-1]).all()), "log-weights must not increase in tree order"
        par = tree.parents[b, 1:n]
        assert bool((par < torch.arange(1, n)).all())
        assert bool((tree.depths[b, 1:n] == tree.depths[b].gather(0, par) + 1).all())
        # node_logw = parent logw + draft log-prob of its token at its depth
        d, r = tree.depths[b, 1:n] - 1, tree.ranks[b, 1:n]
        torch.testing.assert_close(w[1:], tree.node_logws[b].gather(0, par) + lp[b, d, r], rtol=0, atol=1e-5)
        assert bool((tree.parents[b, n:] == -1).all()) and bool((tree.node_token_ids[b, n:] == -1).all())


def test_lemma1_larger_k_does_not_change_the_tree():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 6, 64, generator=g) * 3
    budget = 12
    small = dl.build_tree(*_topk(logits, budget), torch.tensor([1, 2]), budget)
    large = dl.build_tree(*_topk(logits, 64), torch.tensor([1, 2]), budget)
    assert small.equals(large)


def test_top1_spine_keeps_the_chain_and_min_prob_prunes():
    g = torch.Generator().manual_seed(4)
    ids, lp = _topk(torch.randn(2, 8, 50, generator=g) * 0.5, 4)  # flat: best-first stays shallow
    plain = dl.build_tree(ids, lp, torch.tensor([0, 0]), budget=10)
    spine = dl.build_tree(ids, lp, torch.tensor([0, 0]), budget=10, top1_spine=True)
    assert int(plain.depths.max()) < 8
    for b in range(2):
        chain = [i for i in range(int(spine.num_nodes[b])) if (spine.ranks[b, i] <= 0) and
                 all(spine.ranks[b, j] <= 0 for j in _ancestors(spine, b, i))]
        assert len(chain) == 9  # root + 8 depths
    pruned = dl.build_tree(ids, lp, torch.tensor([0, 0]), budget=10, min_prob=0.05)
    n = int(pruned.num_nodes[0])
    assert n < 11 and bool((pruned.node_logws[0, 1:n].exp() >= 0.05).all())


def _ancestors(tree, b, i):
    out = []
    while i > 0:
        i = int(tree.parents[b, i])
        out.append(i)
    return out


def test_per_request_budgets_and_padding():
    ids, lp = _topk(torch.randn(3, 4, 20), 4)
    tree = dl.build_tree(ids, lp, torch.tensor([1, 2, 3]), [0, 3, 9])
    assert tree.num_nodes.tolist() == [1, 4, 10]
    assert tree.node_token_ids.shape == (3, 10)
    assert tree.node_token_ids[:, 0].tolist() == [1, 2, 3]
    assert bool(torch.isneginf(tree.node_logws[0, 1:]).all())


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda ids, lp: (ids, lp.flip(-1)), "request 0, depth 1: draft_logprobs not sorted"),
        (lambda ids, lp: (ids, lp.index_put_((torch.tensor(1), torch.tensor(2), torch.tensor(0)), torch.tensor(float("nan")))),
         "request 1, depth 3: draft_logprobs has NaN"),
        (lambda ids, lp: (ids.index_put_((torch.tensor(0), torch.tensor(1), torch.tensor(1)), ids[0, 1, 0].clone()), lp),
         "request 0, depth 2: a token id appears twice"),
        (lambda ids, lp: (ids, lp + 2.0), "log-probabilities must be <= 0"),
        (lambda ids, lp: (ids, lp.clamp(min=-0.01)), "mass exceeds 1"),
        (lambda ids, lp: (ids.int(), lp), "draft_token_ids must have dtype torch.int64"),
        (lambda ids, lp: (ids, lp.double()), "draft_logprobs must have dtype torch.float32"),
    ],
)
def test_bad_draft_topk_is_named(mutate, message):
    ids, lp = _topk(torch.randn(2, 3, 10), 3)
    ids, lp = mutate(ids.clone(), lp.clone())
    with pytest.raises((ValueError, TypeError), match=message):
        dl.build_tree(ids, lp, torch.tensor([0, 0]), 4)


def test_bad_budget_depth_and_anchor():
    ids, lp = _topk(torch.randn(2, 3, 10), 3)
    anchor = torch.tensor([0, 0])
    with pytest.raises(ValueError, match=r"request 1: budget must be in \[0, 65536\]"):
        dl.build_tree(ids, lp, anchor, [3, -1])
    with pytest.raises(ValueError, match="budget has 3 entries"):
        dl.build_tree(ids, lp, anchor, [3, 3, 3])
    with pytest.raises(ValueError, match="max_depth"):
        dl.build_tree(ids, lp, anchor, 3, max_depth=4)
    with pytest.raises(ValueError, match="min_prob"):
        dl.build_tree(ids, lp, anchor, 3, min_prob=0.0)
    with pytest.raises(ValueError, match="anchor_token_ids must have shape"):
        dl.build_tree(ids, lp, torch.tensor([0]), 3)


def test_draft_topk_from_logits_defaults_and_ties():
    logits = torch.tensor([[[1.0, 3.0, 3.0, 0.0]]])
    ids, lp = dl.draft_topk_from_logits(logits, budget=2)
    assert ids.tolist() == [[[1, 2]]]  # equal logits: ascending token id
    torch.testing.assert_close(lp, torch.log_softmax(logits, -1)[..., [1, 2]])
    with pytest.raises(ValueError, match="needs k or budget"):
        dl.draft_topk_from_logits(logits)


def _engine_case(seed, bs=6, k=8, depth=15):
    """Draft top-k at engine-like shapes: sharpness, ties and zero-probability tokens vary."""
    g = torch.Generator().manual_seed(seed)
    kind = seed % 4
    if kind == 0:  # integer logits: many exact ties between prefixes
        logits = torch.randint(0, 4, (bs, depth, 200), generator=g).float()
    else:
        scale = (0.5, 3.0, 12.0)[kind - 1]
        logits = torch.randn(bs, depth, 200, generator=g) * scale
    if seed % 3 == 0:  # some tokens impossible (-inf log-prob) in the top-k
        logits[:, :, 3:] = -math.inf
    ids, lp = _topk(logits, k)
    budgets = [int(v) for v in torch.randint(0, 300, (bs,), generator=g)]
    return ids, lp, budgets


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("spine, min_prob", [(False, None), (True, None), (False, 1e-4), (True, 1e-3)])
def test_batched_equals_heap_at_engine_shapes(seed, spine, min_prob):
    ids, lp, budgets = _engine_case(seed)
    anchor = torch.arange(len(budgets))
    max_depth = (None, 15, 7)[seed % 3]
    fast = dl.build_tree(ids, lp, anchor, budgets, max_depth, top1_spine=spine, min_prob=min_prob)
    heap = dl.build_tree_reference(ids, lp, anchor, budgets, max_depth, top1_spine=spine, min_prob=min_prob)
    assert fast.equals(heap)


@pytest.mark.parametrize("margins", [(-4.0, 0.0, math.inf), (math.inf,), (9.0, math.inf)])
def test_every_floor_pass_gives_the_same_tree(monkeypatch, margins):
    # Guesses far too high (retried), the capped exhaustive pass alone, and a loose guess.
    monkeypatch.setattr(dl.build, "_MARGINS", margins)
    for seed in range(4):
        ids, lp, budgets = _engine_case(seed, bs=4)
        anchor = torch.zeros(4, dtype=torch.int64)
        for spine in (False, True):
            fast = dl.build_tree(ids, lp, anchor, budgets, top1_spine=spine)
            assert fast.equals(dl.build_tree_reference(ids, lp, anchor, budgets, top1_spine=spine))


def test_tree_order_is_exact_for_near_ties():
    # Values an ulp apart share a quantised key (the -1e6 makes the quantum coarse); the
    # order must still be exact: descending value, equal values by index.
    logw = np.array([-3.0, np.nextafter(-3.0, 0), -3.0, np.nextafter(-3.0, -np.inf), -0.5, -1e6, np.nextafter(-0.5, -1)])
    req = np.array([0, 0, 0, 0, 1, 1, 1])
    order, _ = dl.build._tree_order(logw, req, 2)
    assert order.tolist() == np.lexsort((np.arange(7), -logw, req)).tolist() == [1, 0, 2, 3, 4, 6, 5]


@pytest.mark.parametrize("margins", [(math.inf,), (3.5, 5.0, math.inf)])
def test_all_equal_drafts_stay_small_and_exact(monkeypatch, margins):
    # Every prefix of a depth ties (uniform top-8 at 15 depths: 8^15 prefixes); the per-depth
    # cap must break ties in rank-tuple order instead of keeping them all.
    monkeypatch.setattr(dl.build, "_MARGINS", margins)
    lp = torch.full((2, 15, 8), math.log(1 / 8))
    ids = torch.arange(8).expand(2, 15, 8).contiguous()
    anchor = torch.zeros(2, dtype=torch.int64)
    for budget, spine in ((256, False), (100, True)):
        fast = dl.build_tree(ids, lp, anchor, budget, top1_spine=spine)
        assert fast.equals(dl.build_tree_reference(ids, lp, anchor, budget, top1_spine=spine))


def test_budget_types_and_bad_draft_logits_are_named():
    import numpy as np

    ids, lp = _topk(torch.randn(2, 3, 10), 3)
    anchor = torch.tensor([0, 0])
    assert dl.build_tree(ids, lp, anchor, np.int64(4)).equals(dl.build_tree(ids, lp, anchor, 4))
    with pytest.raises(TypeError, match="budget must be an int, got float"):
        dl.build_tree(ids, lp, anchor, 8.0)
    with pytest.raises(ValueError, match=r"request 0: budget must be in \[0, 65536\]"):
        dl.build_tree(ids, lp, anchor, 10**7)
    logits = torch.randn(2, 3, 10)
    logits[1, 2, 4] = float("inf")
    with pytest.raises(ValueError, match=r"draft_logits, request 1, depth 3: \+inf"):
        dl.draft_topk_from_logits(logits, k=3)
    logits[1, 2] = -float("inf")
    with pytest.raises(ValueError, match="draft_logits, request 1, depth 3: every entry -inf"):
        dl.draft_topk_from_logits(logits, k=3)
