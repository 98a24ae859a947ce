"""The torch-batched verify (no host read) against the reference walk, case by case (issue 36).

Every case: DDTree trees built from random drafts, random target logits made to agree with
the draft often (so paths go deep), a batch mixing greedy and sampled requests with top-k,
top-p, min-p, bans and both filter orders; the batched walk's paths, emitted tokens, bonus
and ``support_exhausted`` must equal ``verify_sampled(vi, target_probs(...))`` exactly. Then
the edges the rule names (the floating-point edge, an exhausted support, lossy thresholds),
the counted host reads (none), and the errors: named as the host verifiers name them.
"""

import pytest
import torch

import ddtree_lab as dl
from ddtree_lab import SamplingParams as SP
from ddtree_lab.hostsync import HostSyncCounter
from ddtree_lab.verify.batched import FLAG_NAMES, raise_batched_problems, verify_batched

PARAMS = [SP(temperature=0.0), SP(temperature=0.8), SP(temperature=1.0, top_k=3), SP(temperature=0.7, top_p=0.6),
          SP(temperature=1.3, top_k=5, top_p=0.9, min_p=0.05), SP(temperature=0.9, top_p=0.7, order="top_p_then_top_k",
                                                                    top_k=4),
          SP(temperature=0.0, banned_token_ids=(1, 2)), SP(temperature=1.0, banned_token_ids=(0,))]


def _case(seed, bs=6, vocab=12, depth=4, budget=9, agree=1.5, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    draft = torch.randn(bs, depth, vocab, generator=g) * 2
    ids, lps = dl.draft_topk_from_logits(draft, k=min(budget, vocab))
    anchors = torch.randint(0, vocab, (bs,), generator=g)
    tree = dl.build_tree(ids, lps, anchors, budget)
    vi = dl.compile_retrieve(tree, 3)
    n = vi.num_rows
    logits = torch.randn(bs, n, vocab, generator=g)
    # the target agrees with the draft at the node's depth + 1 often: deep paths
    d = tree.depths.clamp(min=0, max=depth - 1)
    logits = 0.5 * logits + agree * draft[torch.arange(bs)[:, None], d]
    if seed % 3 == 0:  # ties
        logits = logits.round()
    coins = torch.rand(bs, n, generator=g)
    final = torch.rand(bs, generator=g)
    params = [PARAMS[(seed + b) % len(PARAMS)] for b in range(bs)]
    return tree, vi, logits.to(dtype), params, coins, final


def _same(out, ref):
    paths = [[i for i in row if i >= 0] for row in out.accept_index.tolist()]
    ref_paths = [[i for i in row if i >= 0] for row in ref.accept_index.tolist()]
    assert paths == ref_paths
    assert out.bonus_token.tolist() == ref.bonus_token.tolist()
    assert out.support_exhausted.tolist() == ref.support_exhausted.tolist()
    assert out.accept_length.tolist() == ref.accept_length.tolist()
    emitted = [[t for t in row if t >= 0] for row in out.emitted_tokens.tolist()]
    assert emitted == [[t for t in row if t >= 0] for row in ref.emitted_tokens.tolist()]


@pytest.mark.parametrize("seed", range(40))
def test_equals_the_reference_walk(seed):
    tree, vi, logits, params, coins, final = _case(seed, dtype=torch.bfloat16 if seed % 7 == 0 else torch.float32)
    ref = dl.verify_sampled(vi, dl.target_probs(logits, params, vi.num_nodes), coins, final)
    depth = int(tree.depths.max())
    out = verify_batched(vi, logits, params, coins, final, max_depth=depth, max_children=9)
    _same(out, ref)
    assert out.flags.tolist() == [False] * len(FLAG_NAMES)
    # the default bounds (N - 1) give the same walk
    _same(verify_batched(vi, logits, params, coins, final), ref)


def test_paths_go_deep_in_these_cases():
    lengths = []
    for seed in range(40):
        tree, vi, logits, params, coins, final = _case(seed)
        lengths += verify_batched(vi, logits, params, coins, final).accept_length.tolist()
    assert max(lengths) >= 3 and sum(lengths) / len(lengths) > 1.0, lengths


@pytest.mark.parametrize("thresholds", [(0.0, 1.0), (0.3, 0.5), (1.0, 2.0), (0.9, 0.0)])
def test_lossy_thresholds_follow_sglang_like_the_reference(thresholds):
    for seed in range(10):
        tree, vi, logits, params, coins, final = _case(seed)
        ref = dl.verify_sampled(vi, dl.target_probs(logits, params, vi.num_nodes), coins, final,
                                threshold_single=thresholds[0], threshold_acc=thresholds[1])
        out = verify_batched(vi, logits, params, coins, final, threshold_single=thresholds[0],
                             threshold_acc=thresholds[1])
        _same(out, ref)
        assert out.lossy and ref.lossy


def _chain_tree(tokens):
    n = len(tokens)
    return dl.DDTreeBuildResult(node_token_ids=torch.tensor([tokens]), parents=torch.tensor([[-1] + [0] * (n - 1)]),
                                depths=torch.tensor([[0] + [1] * (n - 1)]), ranks=torch.tensor([[-1] + list(range(n - 1))]),
                                node_logws=torch.tensor([[0.0] + [-0.1 * i for i in range(1, n)]]),
                                num_nodes=torch.tensor([n]))


def test_the_floating_point_edge_and_an_exhausted_support():
    # the root's two children hold the whole row (top_k = 2): a coin past float32 S_2 takes the last one
    vi = dl.compile_retrieve(_chain_tree([0, 3, 5]), 0)
    logits = torch.full((1, 3, 8), -5.0)
    logits[0, 0, 3], logits[0, 0, 5] = 1.0, 0.7
    p = SP(temperature=1.0, top_k=2)
    for u in (0.0, 0.5, 0.99999994):
        coins, final = torch.tensor([[u, 0.5, 0.5]]), torch.tensor([0.5])
        ref = dl.verify_sampled(vi, dl.target_probs(logits, p, vi.num_nodes), coins, final)
        _same(verify_batched(vi, logits, p, coins, final), ref)
    # lossy threshold_acc > 1 rejects S = 1 and the residual is empty: support exhausted
    coins, final = torch.tensor([[0.9, 0.5, 0.5]]), torch.tensor([0.5])
    ref = dl.verify_sampled(vi, dl.target_probs(logits, p, vi.num_nodes), coins, final, threshold_single=1.0,
                            threshold_acc=2.0)
    out = verify_batched(vi, logits, p, coins, final, threshold_single=1.0, threshold_acc=2.0)
    _same(out, ref)
    assert out.support_exhausted.tolist() == [True] and out.bonus_token.tolist() == [-1]


def test_no_host_read_without_check():
    tree, vi, logits, params, coins, final = _case(1)
    with HostSyncCounter() as syncs:
        out = verify_batched(vi, logits, params, coins, final, max_depth=4, max_children=9, check=False)
    assert syncs.total == 0, syncs.table()
    with HostSyncCounter() as syncs:
        verify_batched(vi, logits, params, coins, final, max_depth=4, max_children=9)
    assert syncs.total == 1, syncs.table()  # the flags, read once
    assert out.flags.any().item() is False


def test_errors_are_named_as_the_host_verifiers_name_them():
    tree, vi, logits, params, coins, final = _case(2)
    bad = logits.clone()
    bad[0, 0, 4] = float("nan")  # the root row: every walk reads it
    with pytest.raises(ValueError, match=r"target logits, request 0, node 0: row has NaN"):
        verify_batched(vi, bad, params, coins, final)
    out = verify_batched(vi, bad, params, coins, final, check=False)
    row_flag = FLAG_NAMES.index("a walked target row has NaN, +inf or every entry -inf, or no mass left after its bans")
    assert out.flags.tolist()[row_flag]
    with pytest.raises(ValueError, match="request 0, node 0: row has NaN"):
        raise_batched_problems(out.flags.tolist(), vi, bad, params, coins, final)
    c = coins.clone()
    c[1, 2] = 1.0
    with pytest.raises(ValueError, match=r"coins, request 1, node 2: 1.0 is not in \[0, 1\)"):
        verify_batched(vi, logits, params, c, final)
    # bounds too small for the tree: named, never a silent short walk
    with pytest.raises(ValueError, match="more than max_children children"):
        verify_batched(vi, logits, params, coins, final, max_children=1)
    deep = verify_batched(vi, logits, params, coins, final).accept_length.max().item()
    if deep >= 2:
        with pytest.raises(ValueError, match="deeper than max_depth"):
            verify_batched(vi, logits, params, coins, final, max_depth=deep - 1)
    with pytest.raises(ValueError, match="max_depth must be an int >= 0"):
        verify_batched(vi, logits, params, coins, final, max_depth=-1)


@pytest.mark.parametrize("thresholds", [(1.0, 1.0), (0.3, 0.5)])
def test_the_log_gives_the_reference_decisions_and_bonus_records(thresholds):
    from ddtree_lab.verify.batched import decisions_from_log

    for seed in range(25):
        tree, vi, logits, params, coins, final = _case(seed)
        ref = dl.verify_sampled(vi, dl.target_probs(logits, params, vi.num_nodes), coins, final,
                                threshold_single=thresholds[0], threshold_acc=thresholds[1])
        out = verify_batched(vi, logits, params, coins, final, max_depth=4, max_children=9, log=True,
                             threshold_single=thresholds[0], threshold_acc=thresholds[1])
        assert out.log is not None
        for b in range(vi.batch_size):
            decisions, bonus = decisions_from_log(out.log, b, b, vi.node_token_ids[b].tolist(),
                                                  int(out.bonus_token[b]), float(final[b]))
            assert decisions == ref.decisions[b], (seed, b)
            assert bonus == ref.bonus[b], (seed, b)


def test_the_log_of_the_floating_point_edge():
    from ddtree_lab.verify.batched import decisions_from_log

    vi = dl.compile_retrieve(_chain_tree([0, 3, 5]), 0)
    logits = torch.full((1, 3, 8), -5.0)
    logits[0, 0, 3], logits[0, 0, 5] = 1.0, 0.7
    p = SP(temperature=1.0, top_k=2)
    coins, final = torch.tensor([[0.99999994, 0.5, 0.5]]), torch.tensor([0.5])
    ref = dl.verify_sampled(vi, dl.target_probs(logits, p, vi.num_nodes), coins, final)
    out = verify_batched(vi, logits, p, coins, final, log=True)
    decisions, bonus = decisions_from_log(out.log, 0, 0, [0, 3, 5], int(out.bonus_token[0]), 0.5)
    assert decisions == ref.decisions[0] and bonus == ref.bonus[0]
    assert decisions[-1].cumulative_mass == 1.0 and decisions[-1].verdict == "accept"


def test_a_row_whose_every_finite_logit_is_banned_is_named_by_both_walks():
    vi = dl.compile_retrieve(_chain_tree([0, 3, 5]), 0)
    logits = torch.full((1, 3, 8), -float("inf"))
    logits[0, :, 3], logits[0, :, 5] = 1.0, 0.5  # finite only at the banned tokens
    p = SP(temperature=1.0, banned_token_ids=(3, 5))
    coins, final = torch.rand(1, 3), torch.rand(1)
    with pytest.raises(ValueError, match="request 0, node 0: no probability left: every token with a finite logit"):
        dl.verify_tree(vi, logits, p, coins, final, backend="torch-lazy")
    with pytest.raises(ValueError, match="request 0, node 0: no probability left: every token with a finite logit"):
        verify_batched(vi, logits, p, coins, final)


@pytest.mark.parametrize("seed", range(12))
def test_draft_topk_device_is_draft_topk_from_logits_bit_for_bit(seed):
    from ddtree_lab.draft import draft_topk_device

    g = torch.Generator().manual_seed(seed)
    vocab = [7, 50, 333, 4096][seed % 4]
    x = torch.randn(3, 4, vocab, generator=g) * 3
    if seed % 3 == 0:
        x = x.round()  # ties everywhere
    x[0, 1] = 2.0  # a degenerate row: every logit equal
    x[1, 2, : vocab // 2] = x[1, 2].max()  # half the row tied at the top
    x[2, 0, 1:] = -float("inf")  # one finite logit
    k = min(vocab, [1, 3, 8, 64][seed % 4])
    for dtype in (torch.float32, torch.bfloat16):
        ids, lps = dl.draft_topk_from_logits(x.to(dtype), k=k)
        ids2, lps2, bad = draft_topk_device(x.to(dtype), k)
        assert torch.equal(ids, ids2)
        assert torch.equal(lps.view(torch.int32), lps2.view(torch.int32))  # bit for bit, -0.0 included
        assert not bad.any()
    y = x.clone()
    y[0, 3, 2], y[1, 0, 0], y[2, 1] = float("nan"), float("inf"), -float("inf")
    assert draft_topk_device(y, k)[2].tolist() == [[False, False, False, True], [True, False, False, False],
                                                   [False, True, False, False]]


def test_draft_topk_device_at_2_pow_18_tokens_takes_the_stable_sort():
    from ddtree_lab.draft import draft_topk_device

    x = torch.randn(1, 2, 1 << 18, generator=torch.Generator().manual_seed(0)).round()
    ids, lps = dl.draft_topk_from_logits(x, k=16)
    ids2, lps2, _ = draft_topk_device(x, 16)
    assert torch.equal(ids, ids2) and torch.equal(lps, lps2)
