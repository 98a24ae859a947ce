
import numpy as np
import pytest
import torch
from scipy import stats

import ddtree_lab as dl
from ddtree_lab import SamplingParams as SP
from oracles import exact_law, tree_paths


def _random_tree(seed, bs=1, vocab=12, depth=3, k=3, budget=8):
    g = torch.Generator().manual_seed(seed)
    ids, lp = dl.draft_topk_from_logits(torch.randn(bs, depth, vocab, generator=g) * 2, k=k)
    tree = dl.build_tree(ids, lp, torch.randint(0, vocab, (bs,), generator=g), budget)
    return tree, dl.compile_retrieve(tree, 4)


def _repeat(vi, times):
    """The same single-request verify input repeated ``times`` times (retrieve_index re-based)."""
    n = vi.num_rows
    rep = {f: getattr(vi, f).expand(times, *getattr(vi, f).shape[1:]).contiguous()
           for f in ("node_token_ids", "retrieve_next_token", "retrieve_next_sibling", "tree_mask",
                     "positions", "depths", "num_nodes")}
    ri = torch.arange(times)[:, None] * n + torch.arange(n)[None]
    rep["retrieve_index"] = torch.where(vi.retrieve_index.expand(times, n) >= 0, ri, -1)
    return dl.DDTreeVerifyInput(**rep)


# ---- greedy -------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(20))
def test_greedy_equals_naive_walk_of_every_root_to_leaf_path(seed):
    tree, vi = _random_tree(seed, bs=3, vocab=6, depth=4, k=3, budget=12)
    g = torch.Generator().manual_seed(1000 + seed)
    logits = torch.randn(3, vi.num_rows, 6, generator=g)
    # plant the drafted tokens as argmax sometimes so paths get accepted
    for b in range(3):
        for i in range(1, int(tree.num_nodes[b])):
            if torch.rand(1, generator=g) < 0.6:
                logits[b, int(tree.parents[b, i]), int(tree.node_token_ids[b, i])] += 5
    out = dl.verify_greedy(vi, logits)
    argmax = logits.argmax(-1)
    for b in range(3):
        n = int(tree.num_nodes[b])
        best = [0]
        for path in tree_paths(tree.parents[b].tolist(), n):
            matched = [0]
            for node in path[1:]:
                if int(tree.node_token_ids[b, node]) != int(argmax[b, matched[-1]]):
                    break
                matched.append(node)
            if len(matched) > len(best):
                best = matched
        emitted = [int(tree.node_token_ids[b, i]) for i in best[1:]] + [int(argmax[b, best[-1]])]
        got = out.emitted_tokens[b][out.emitted_tokens[b] >= 0].tolist()
        assert got == emitted
        assert out.accept_index[b, : len(best)].tolist() == best
        assert int(out.accept_length[b]) == len(best) - 1
        assert int(out.bonus_token[b]) == emitted[-1]


def test_sampled_with_one_hot_rows_equals_greedy():
    tree, vi = _random_tree(3, bs=4, vocab=8, depth=4, k=3, budget=10)
    logits = torch.randn(4, vi.num_rows, 8, generator=torch.Generator().manual_seed(5))
    for b in range(4):
        for i in range(1, int(tree.num_nodes[b])):
            logits[b, int(tree.parents[b, i]), int(tree.node_token_ids[b, i])] += 3 * (i % 2)
    greedy = dl.verify_greedy(vi, logits)
    probs = dl.target_probs(logits, SP(temperature=0.0))
    coins = torch.rand(4, vi.num_rows) * 0.999
    sampled = dl.verify_sampled(vi, probs, coins, torch.rand(4))
    assert torch.equal(greedy.emitted_tokens, sampled.emitted_tokens)
    assert torch.equal(greedy.accept_index, sampled.accept_index)


# ---- sampled: exact law by enumeration against 20,000 draws --------------------------------

CASES = [
    # (tree seed, vocab, depth, k, budget, params)
    (0, 8, 3, 3, 8, SP(1.0)),
    (1, 10, 3, 2, 6, SP(0.7)),
    (2, 12, 2, 4, 8, SP(1.0, top_k=5)),
    (3, 12, 3, 3, 10, SP(1.3, top_p=0.8)),
    (4, 16, 3, 3, 11, SP(0.9, top_k=6, top_p=0.9)),
    (5, 6, 4, 2, 9, SP(1.0, min_p=0.1)),
    (6, 9, 3, 3, 7, SP(2.0, top_k=4)),
    (7, 16, 2, 5, 10, SP(0.5, top_p=0.95)),
    (8, 8, 4, 2, 11, SP(1.0, top_k=3, top_p=0.7)),
    (9, 5, 3, 3, 11, SP(1.0)),
]


def _law_vs_draws(case, draws=20_000, threshold_acc=1.0, seed=0):
    tree_seed, vocab, depth, k, budget, params = case
    tree, vi = _random_tree(tree_seed, vocab=vocab, depth=depth, k=k, budget=budget)
    g = torch.Generator().manual_seed(100 + tree_seed)
    # the target favours the drafted tokens a little, so deep paths have mass
    logits = torch.randn(1, vi.num_rows, vocab, generator=g)
    n = int(tree.num_nodes[0])
    for i in range(1, n):
        logits[0, int(tree.parents[0, i]), int(tree.node_token_ids[0, i])] += 1.0
    probs = dl.target_probs(logits, params)
    law = exact_law(tree.parents[0].tolist(), tree.node_token_ids[0].tolist(), probs[0].double().tolist(), n)
    assert sum(law.values()) == pytest.approx(1.0, abs=1e-6)
    rep = _repeat(vi, draws)
    cg = torch.Generator().manual_seed(seed)
    coins = torch.rand(draws, vi.num_rows, generator=cg)
    final = torch.rand(draws, generator=cg)
    out = dl.verify_sampled(rep, probs.expand(draws, -1, -1).contiguous(), coins, final, threshold_acc=threshold_acc)
    assert not bool(out.support_exhausted.any())
    counts = {}
    for row in out.emitted_tokens.tolist():
        key = tuple(t for t in row if t >= 0)
        counts[key] = counts.get(key, 0) + 1
    assert set(counts) <= set(law), "an outcome the target gives zero probability was emitted"
    keys = sorted(law, key=lambda x: -law[x])
    expected = np.array([law[x] * draws for x in keys])
    observed = np.array([counts.get(x, 0) for x in keys], dtype=float)
    # pool outcomes with expected count < 5 into one bin
    small = expected < 5
    if small.any():
        expected = np.append(expected[~small], expected[small].sum())
        observed = np.append(observed[~small], observed[small].sum())
    observed[-1] += draws - observed.sum()  # float rounding of the law
    return stats.chisquare(observed, expected * draws / expected.sum()).pvalue, out


@pytest.mark.parametrize("case", CASES, ids=[f"tree{c[0]}" for c in CASES])
def test_sampled_verify_emits_the_target_law(case):
    pvalue, out = _law_vs_draws(case)
    assert pvalue > 1e-3, f"chi-square p = {pvalue:.2e}"
    assert int(out.accept_length.max()) >= 1  # the test exercises accepted paths


def test_lossy_threshold_fails_the_same_test():
    rejected = 0
    for case in CASES[:6]:
        pvalue, _ = _law_vs_draws(case, threshold_acc=0.7)
        rejected += pvalue < 1e-3
    assert rejected >= 5, f"the chi-square test caught only {rejected} of 6 lossy variants"


def test_greedy_row_beside_sampled_rows_in_one_batch():
    tree, vi = _random_tree(11, bs=2, vocab=8, depth=3, k=3, budget=8)
    logits = torch.randn(2, vi.num_rows, 8, generator=torch.Generator().manual_seed(2))
    params = [SP(0.0), SP(1.0, seed=3)]
    probs = dl.target_probs(logits, params)
    coins, final = dl.draw_coins(dl.make_generators(params), vi.num_rows)
    out = dl.verify_sampled(vi, probs, coins, final)
    greedy = dl.verify_greedy(vi.request(0), logits[:1])
    assert out.emitted_tokens[0].tolist() == greedy.emitted_tokens[0].tolist()


# ---- boundaries ----------------------------------------------------------------------------


def _single_chain(tokens=(1, 2)):
    n = len(tokens) + 1
    tree = dl.DDTreeBuildResult(
        node_token_ids=torch.tensor([[0, *tokens]]), parents=torch.tensor([list(range(-1, n - 1))]),
        depths=torch.arange(n)[None], ranks=torch.tensor([[-1] + [0] * (n - 1)]),
        node_logws=-torch.arange(n, dtype=torch.float32)[None], num_nodes=torch.tensor([n]))
    return dl.compile_retrieve(tree, 0)


def test_coin_zero_and_just_below_one():
    vi = _single_chain((1, 2))
    probs = torch.zeros(1, 3, 4)
    probs[0, :, :] = torch.tensor([0.1, 0.6, 0.2, 0.1])
    below_one = torch.tensor(1.0).nextafter(torch.tensor(0.0)).item()
    # u = 0 < S = p > 0 accepts every child with mass; the leaf's bonus is the first token
    out = dl.verify_sampled(vi, probs, torch.zeros(1, 3), torch.zeros(1))
    assert out.emitted_tokens[0].tolist() == [1, 2, 0]
    assert [d.verdict for d in out.decisions[0]] == ["accept", "accept"]
    out = dl.verify_sampled(vi, probs, torch.full((1, 3), below_one), torch.full((1,), below_one))
    assert all(d.verdict == "reject" for d in out.decisions[0])
    assert out.bonus_token.item() == 3  # last token with positive residual mass


def test_zero_probability_child_is_never_accepted_and_never_emitted():
    vi = _single_chain((1,))
    probs = torch.tensor([[[0.5, 0.0, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25]]])
    for u in (0.0, 0.3, 0.99):
        out = dl.verify_sampled(vi, probs, torch.full((1, 2), u), torch.full((1,), u))
        assert out.accept_length.item() == 0
        assert out.bonus_token.item() in (0, 2)


def test_exhausted_support_is_explicit():
    vi = _single_chain((1,))
    probs = torch.tensor([[[0.0, 1.0, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]]])
    # a root row with no mass at all (as a truncated trace row can be): nothing to emit
    empty = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]]])
    out = dl.verify_sampled(vi, empty, torch.zeros(1, 2), torch.zeros(1))
    assert bool(out.support_exhausted[0]) and out.bonus_token.item() == -1
    assert out.bonus[0].kind == "exhausted"
    assert out.emitted_tokens[0].tolist() == [-1, -1]
    assert out.tau().item() == 0
    out = dl.verify_sampled(vi, probs, torch.zeros(1, 2), torch.zeros(1))
    assert out.accept_length.item() == 1 and out.bonus[0].kind == "leaf"


def test_seeded_generators_replay_bit_for_bit():
    tree, vi = _random_tree(12, bs=3, vocab=10, depth=3, k=3, budget=9)
    logits = torch.randn(3, vi.num_rows, 10)
    params = [SP(1.0, seed=1), SP(0.8, top_k=4, seed=2), SP(1.2, top_p=0.9, seed=3)]
    probs = dl.target_probs(logits, params)
    a = dl.verify_sampled(vi, probs, *dl.draw_coins(dl.make_generators(params), vi.num_rows))
    b = dl.verify_sampled(vi, probs, *dl.draw_coins(dl.make_generators(params), vi.num_rows))
    assert torch.equal(a.emitted_tokens, b.emitted_tokens)
    assert [d.to_dict() for d in a.decisions[1]] == [d.to_dict() for d in b.decisions[1]]


def test_decision_log_records_mass_and_coins():
    vi = _single_chain((1, 2))
    probs = torch.tensor([[[0.2, 0.5, 0.3, 0.0], [0.1, 0.1, 0.7, 0.1], [0.25, 0.25, 0.25, 0.25]]])
    coins = torch.tensor([[0.4, 0.95, 0.0]])
    out = dl.verify_sampled(vi, probs, coins, torch.tensor([0.5]))
    d0, d1 = out.decisions[0]
    assert (d0.node, d0.token, d0.verdict) == (1, 1, "accept")
    assert d0.target_prob == pytest.approx(0.5) and d0.cumulative_mass == pytest.approx(0.5) and d0.coin == pytest.approx(0.4)
    assert (d1.node, d1.token, d1.verdict) == (2, 2, "reject") and d1.coin == pytest.approx(0.95)
    # bonus from row 1 with token 2 zeroed: [0.1, 0.1, 0, 0.1] / 0.3, coin 0.5 -> token 1
    assert out.bonus[0].residual_mass == pytest.approx(0.3) and out.bonus_token.item() == 1
    assert out.emitted_tokens[0].tolist() == [1, 1, -1]


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda vi, p, c, f: (vi, p, c.fill_(1.0), f), "coins, request 0, node 0: 1.0 is not in"),
        (lambda vi, p, c, f: (vi, p, c, f.fill_(-0.1)), "final_coins, request 0"),
        (lambda vi, p, c, f: (vi, p.double(), c, f), "target_probs must have dtype torch.float32"),
        (lambda vi, p, c, f: (vi, p.index_fill_(2, torch.tensor([0]), float("nan")), c, f),
         "target_probs, request 0, node 0: row has NaN"),
        (lambda vi, p, c, f: (vi, p[:, :, :2].contiguous(), c, f), "token 2 not in"),
    ],
)
def test_bad_verify_input_is_named(edit, message):
    vi = _single_chain((1, 2))
    probs = torch.full((1, 3, 4), 0.25)
    args = edit(vi, probs.clone(), torch.zeros(1, 3), torch.zeros(1))
    with pytest.raises((ValueError, TypeError), match=message):
        dl.verify_sampled(*args)


def test_a_cycle_through_retrieve_next_token_is_an_error_not_a_hang():
    vi = _single_chain((1, 2))
    nt = vi.retrieve_next_token.clone()
    nt[0, 2] = 2  # node 2's first child is itself
    import dataclasses

    bad = dataclasses.replace(vi, retrieve_next_token=nt)
    probs = torch.zeros(1, 3, 4)
    probs[0, :, 2] = 1.0
    probs[0, 0, 1] = 1.0
    probs[0, 0, 2] = 0.0
    logits = probs.log().clamp(min=-50)
    with pytest.raises(ValueError, match="a cycle in retrieve_next_token"):
        dl.verify_sampled(bad, probs, torch.zeros(1, 3), torch.zeros(1))
    with pytest.raises(ValueError, match="a cycle in retrieve_next_token"):
        dl.verify_greedy(bad, logits)
    with pytest.raises(ValueError, match="num_nodes, request 0: 4 is outside"):
        dl.verify_sampled(dataclasses.replace(vi, num_nodes=torch.tensor([4])), probs, torch.zeros(1, 3), torch.zeros(1))


# ---- the one walk: events, replay of the log, what-if ------------------------------------


def _walk_case(seed, bs=3, vocab=12):
    tree, vi = _random_tree(seed, bs=bs, vocab=vocab, depth=3, k=3, budget=9)
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(bs, vi.num_rows, vocab, generator=g)
    for b in range(bs):  # the target likes the drafts a little, so walks go deep
        for i in range(1, int(tree.num_nodes[b])):
            logits[b, int(tree.parents[b, i]), int(tree.node_token_ids[b, i])] += 1.5
    params = [SP(1.0), SP(0.8, top_k=4), SP(1.2, top_p=0.8)][:bs]
    probs = dl.target_probs(logits, params, vi.num_nodes)
    coins, final = torch.rand(bs, vi.num_rows, generator=g), torch.rand(bs, generator=g)
    return tree, vi, logits, probs, coins, final


@pytest.mark.parametrize("seed", range(6))
def test_events_of_the_log_are_the_walk_and_the_walk_is_the_output(seed):
    from ddtree_lab.verify import SampledRule, walk

    tree, vi, logits, probs, coins, final = _walk_case(seed)
    out = dl.verify_sampled(vi, probs, coins, final)
    greedy = dl.verify_greedy(vi, logits)
    for b in range(vi.batch_size):
        n = int(vi.num_nodes[b])
        rule = SampledRule(b, vi.node_token_ids[b].tolist(), lambda i, b=b: probs[b, i], coins[b].tolist(),
                            float(final[b]), 1.0, 1.0)
        live = list(walk(b, n, vi.retrieve_next_token[b].tolist(), vi.retrieve_next_sibling[b].tolist(), rule))
        assert live == out.events(b) == dl.events_of(out.decisions[b], out.bonus[b])
        assert [e.kind for e in live].count("move") == int(out.accept_length[b])
        assert live[-1].kind == "bonus" and live[-1].bonus.token == int(out.bonus_token[b])
        moves = [e.node for e in live if e.kind == "move"]
        assert [0] + moves == [i for i in out.accept_index[b].tolist() if i >= 0]
        # a stepper's cursor: the first k events are a prefix of the walk
        for k in range(len(live) + 1):
            assert dl.events_of(out.decisions[b], out.bonus[b])[:k] == live[:k]
        g_events = greedy.events(b)
        assert all(e.decision.coin is None for e in g_events if e.kind == "consider")
        assert g_events[-1].bonus.kind == "argmax"
        assert [e.to_dict()["kind"] for e in g_events] == [e.kind for e in g_events]


@pytest.mark.parametrize("seed", range(6))
def test_walk_request_from_child_probs_is_the_verifier(seed):
    tree, vi, logits, probs, coins, final = _walk_case(seed)
    out = dl.verify_sampled(vi, probs, coins, final)
    for b in range(vi.batch_size):
        n = int(vi.num_nodes[b])
        parents, tokens = tree.parents[b, :n], tree.node_token_ids[b, :n]
        child_probs = torch.zeros(n)
        child_probs[1:] = probs[b, parents[1:], tokens[1:]]
        args = (vi.retrieve_next_token[b, :n], vi.retrieve_next_sibling[b, :n], tokens, child_probs, coins[b, :n])
        events = dl.walk_request(*args, float(final[b]), request=b)
        want = out.events(b)
        assert events[:-1] == want[:-1]
        pending = events[-1].bonus
        assert isinstance(pending, dl.UndrawnBonus) and pending.node == out.bonus[b].node
        assert pending.residual_mass == pytest.approx(out.bonus[b].residual_mass, abs=1e-5)
        assert f"at node {pending.node} with mass" in pending.describe()
        # with the rows the bonus is drawn exactly as the verifier did
        full = dl.walk_request(*args, float(final[b]), request=b, row_of=lambda i, b=b: probs[b, i])
        assert full == want
        # what-if: another coin at the root changes the walk as the verifier would
        for u in (0.0, 0.5, 0.999):
            c2 = coins.clone()
            c2[b, 0] = u
            again = dl.verify_sampled(vi, probs, c2, final)
            assert dl.walk_request(*args[:4], c2[b, :n], float(final[b]), request=b)[:-1] == again.events(b)[:-1]


def test_acceptance_probabilities_are_the_target_p_and_differ_under_thresholds():
    vi = _single_chain((1,))
    star = dl.DDTreeBuildResult(node_token_ids=torch.tensor([[0, 1, 2, 3, 4]]), parents=torch.tensor([[-1, 0, 0, 0, 0]]),
                                depths=torch.tensor([[0, 1, 1, 1, 1]]), ranks=torch.tensor([[-1, 0, 1, 2, 3]]),
                                node_logws=-torch.arange(5, dtype=torch.float32)[None], num_nodes=torch.tensor([5]))
    vi = dl.compile_retrieve(star, 0)
    p = torch.tensor([0.0, 0.3, 0.0, 0.25, 0.15])  # node 2 has p = 0
    nt, ns = vi.retrieve_next_token[0], vi.retrieve_next_sibling[0]
    assert dl.acceptance_probabilities(nt, ns, p).tolist() == pytest.approx([0, 0.3, 0, 0.25, 0.15])
    # the measure of each child's accept region, on a fine grid of coins, through the verifier
    row = torch.zeros(1, 5, 6)
    row[0, 0, :5] = p
    row[0, 0, 5] = 1 - p.sum()
    grid = 4000
    coins = ((torch.arange(grid) + 0.5) / grid).float()
    rep = _repeat(vi, grid)
    for ts, ta in ((1.0, 1.0), (1.0, 0.7), (0.28, 1.0), (0.2, 0.5), (0.0, 0.0), (1.0, 1.6)):
        want = dl.acceptance_probabilities(nt, ns, p, threshold_single=ts, threshold_acc=ta)
        c = torch.zeros(grid, 5)
        c[:, 0] = coins
        out = dl.verify_sampled(rep, row.expand(grid, -1, -1).contiguous(), c, torch.full((grid,), 0.5),
                                threshold_single=ts, threshold_acc=ta)
        got = torch.bincount(out.accept_index[:, 1].clamp(min=0), minlength=5).double() / grid
        got[0] = 0.0
        assert got.tolist() == pytest.approx(want.tolist(), abs=2.0 / grid), (ts, ta)
        assert out.lossy == dl.is_lossy(ts, ta) == ((ts, ta) != (1.0, 1.0))
        assert out.thresholds == (ts, ta)
        if (ts, ta) != (1.0, 1.0):
            assert want.tolist() != pytest.approx(p.tolist())


def test_thresholds_zero_are_accepted_as_sglang_does_and_marked_lossy():
    vi = _single_chain((1, 2))
    probs = torch.tensor([[[0.2, 0.1, 0.7, 0.0], [0.1, 0.1, 0.7, 0.1], [0.25, 0.25, 0.25, 0.25]]])
    below_one = torch.tensor(1.0).nextafter(torch.tensor(0.0)).item()
    coins = torch.full((1, 3), below_one)
    exact = dl.verify_sampled(vi, probs, coins, torch.zeros(1))
    assert exact.accept_length.item() == 0 and not exact.lossy
    for ts, ta in ((0.0, 0.0), (1.0, 0.0), (0.0, 1.0)):
        # S / 1e-9 (SGLang floors threshold_acc) and p >= 0 always: the first child is accepted
        out = dl.verify_sampled(vi, probs, coins, torch.zeros(1), threshold_single=ts, threshold_acc=ta)
        assert out.accept_length.item() == 2 and out.lossy and out.thresholds == (ts, ta)
    zero_child = torch.tensor([[[0.5, 0.0, 0.5, 0.0], [0.1, 0.1, 0.7, 0.1], [0.25] * 4]])
    # SGLang's rule has no p > 0 guard: threshold_single = 0 takes a zero-probability child
    out = dl.verify_sampled(vi, zero_child, coins, torch.zeros(1), threshold_single=0.0, threshold_acc=0.0)
    assert out.accept_length.item() == 2 and out.decisions[0][0].target_prob == 0.0
    # threshold_acc = 0 alone: S = 0 / 1e-9 = 0 < u, the zero child is rejected, the walk stops
    out = dl.verify_sampled(vi, zero_child, coins, torch.zeros(1), threshold_single=1.0, threshold_acc=0.0)
    assert out.accept_length.item() == 0
    # ... unless the coin is 0: u <= 0 holds (SGLang's <=); the lossless rule never takes p = 0
    zero_coins = torch.zeros(1, 3)
    assert dl.verify_sampled(vi, zero_child, zero_coins, torch.zeros(1), threshold_single=0.5,
                             threshold_acc=0.5).accept_length.item() == 2
    assert dl.verify_sampled(vi, zero_child, zero_coins, torch.zeros(1)).accept_length.item() == 0
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="threshold_acc must be a finite number >= 0"):
            dl.verify_sampled(vi, probs, coins, torch.zeros(1), threshold_acc=bad)


def test_fp_edge_children_holding_the_whole_row_take_the_last_positive_child():
    # twelve children hold the whole row at p = fl(1/12); a 13th child has p = 0 and comes last.
    # Their float32 sum in sibling order is 0.9999999 < 1, below a coin just under one.
    vi = _star_vi(tuple(range(1, 14)), vocab=16)
    row = torch.full((1, 14, 16), 1 / 16)
    row[0, 0] = 0.0
    row[0, 0, 1:13] = torch.full((12,), 1 / 12)
    below_one = torch.tensor(1.0).nextafter(torch.tensor(0.0)).item()
    s = 0.0
    for v in row[0, 0, 1:13].tolist():
        s = float(np.float32(s + v))
    assert s < below_one  # the edge is real: the float sums reject every child
    out = dl.verify_sampled(vi, row, torch.full((1, 14), below_one), torch.zeros(1))
    assert out.accept_index[0, 1].item() == 12 and not bool(out.support_exhausted[0])
    assert [d.verdict for d in out.decisions[0]] == ["reject"] * 11 + ["accept"]  # node 13 never judged
    assert out.decisions[0][-1].cumulative_mass == 1.0
    # the what-if walk from child probabilities agrees (the children sum to ~1)
    cp = torch.zeros(14)
    cp[1:13] = row[0, 0, 1:13]
    events = dl.walk_request(vi.retrieve_next_token[0], vi.retrieve_next_sibling[0], vi.node_token_ids[0], cp,
                             torch.full((14,), below_one))
    assert [e.node for e in events if e.kind == "move"] == [12]
    # a row with no positive mass at all is the only exhausted support
    out = dl.verify_sampled(vi, torch.zeros(1, 14, 16), torch.full((1, 14), 0.5), torch.zeros(1))
    assert bool(out.support_exhausted[0]) and out.bonus[0].kind == "exhausted"


# ---- buffers are validated by every verifier ----------------------------------------------


def _star_vi(children=(1, 2, 3), vocab=8):
    n = len(children) + 1
    return dl.compile_retrieve(dl.DDTreeBuildResult(
        node_token_ids=torch.tensor([[0, *children]]), parents=torch.tensor([[-1] + [0] * (n - 1)]),
        depths=torch.tensor([[0] + [1] * (n - 1)]), ranks=torch.tensor([[-1, *range(n - 1)]]),
        node_logws=-torch.arange(n, dtype=torch.float32)[None], num_nodes=torch.tensor([n])), 0)


def test_a_node_both_child_and_sibling_is_refused_unless_validation_is_off():
    import dataclasses

    vi = _star_vi()
    nt = vi.retrieve_next_token.clone()
    nt[0, 1] = 2  # node 2 is a sibling of node 1 and its child
    bad = dataclasses.replace(vi, retrieve_next_token=nt)
    probs = torch.full((1, 4, 8), 1 / 8)
    probs[0, 0] = torch.tensor([0.0, 0.9, 0.1, 0, 0, 0, 0, 0])
    probs[0, 1] = torch.tensor([0.0, 0.0, 1.0, 0, 0, 0, 0, 0])
    with pytest.raises(dl.RetrieveError, match="request 0, node 2: reached twice"):
        dl.verify_sampled(bad, probs, torch.zeros(1, 4), torch.zeros(1))
    with pytest.raises(dl.RetrieveError, match="request 0, node 2: reached twice"):
        dl.verify_greedy(bad, probs.log().clamp(min=-50))
    for backend in ("reference", "torch-lazy"):
        with pytest.raises(dl.RetrieveError, match="request 0, node 2: reached twice"):
            dl.verify_tree(bad, probs.log().clamp(min=-50), SP(1.0), torch.zeros(1, 4), torch.zeros(1), backend=backend)
    # with validation off (timing only) the walk verifies node 2 as node 1's child: what a kernel did
    out = dl.verify_sampled(bad, probs, torch.zeros(1, 4), torch.zeros(1), validate=False)
    assert out.accept_index[0, :3].tolist() == [0, 1, 2]
