"""Triton tree verifiers against the reference, field for field.

On a machine without CUDA the kernels run under ``TRITON_INTERPRET=1`` (set here, before
anything imports the kernels); with a CUDA GPU the same tests run the compiled kernels on it.
"""


import torch


import math

import numpy as np

import pytest

pytest.importorskip("triton")

import ddtree_lab as dl
from ddtree_lab import SamplingParams as SP
from ddtree_lab.verify import PROB_ATOL, PROB_RTOL, select_backend, verify_tree, verify_tree_greedy

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BELOW_ONE = torch.tensor(1.0).nextafter(torch.tensor(0.0)).item()
PARAM_MIX = [
    SP(0.0), SP(1.0), SP(0.7, top_k=1), SP(0.8, top_k=8), SP(1.3, top_k=20), SP(1.0, top_p=0.9),
    SP(0.6, top_p=0.5), SP(1.1, top_k=30, top_p=0.8), SP(1.0, top_k=50, top_p=0.95, min_p=0.05),
    SP(2.0, min_p=0.2), SP(0.9, top_k=3, top_p=0.3),
]


# ---- helpers ------------------------------------------------------------------------------


def _close(a, b):
    return abs(a - b) <= PROB_ATOL + PROB_RTOL * abs(a)


def assert_same(ref, got):
    """Every field of two VerifyOutputs: exact for tokens / indices / verdicts, probabilities
    within the stated tolerance."""
    for f in ("accept_index", "accept_length", "emitted_tokens", "bonus_token", "support_exhausted"):
        assert torch.equal(getattr(ref, f), getattr(got, f).cpu()), f
    for b, (dr, dg) in enumerate(zip(ref.decisions, got.decisions)):
        assert len(dr) == len(dg), f"request {b}: {len(dr)} decisions vs {len(dg)}"
        for x, y in zip(dr, dg):
            assert (x.request, x.depth, x.parent, x.node, x.token, x.coin, x.verdict) == \
                   (y.request, y.depth, y.parent, y.node, y.token, y.coin, y.verdict), (b, x, y)
            assert _close(x.target_prob, y.target_prob) and _close(x.cumulative_mass, y.cumulative_mass), (b, x, y)
    for x, y in zip(ref.bonus, got.bonus):
        assert (x.request, x.node, x.token, x.kind, x.coin) == (y.request, y.node, y.token, y.kind, y.coin), (x, y)
        assert _close(x.residual_mass, y.residual_mass) and _close(x.token_prob, y.token_prob), (x, y)


def near_tie(ref, probs, margin=1e-5):
    """Whether the reference run had a coin within ``margin`` of a decision boundary."""
    for log in ref.decisions:
        if any(d.coin is not None and abs(d.coin - d.cumulative_mass) < margin for d in log):
            return True
    for draw in ref.bonus:
        if draw.kind in ("residual", "leaf"):
            row = probs[draw.request, draw.node].double().clone()
            for d in ref.decisions[draw.request]:
                if d.parent == draw.node:
                    row[d.token] = 0.0
            cum = row.cumsum(0)
            target = draw.coin * float(cum[-1])
            if (cum - target).abs().min() < margin:
                return True
    return False


def _random_case(seed, bs, vocab, depth, k, budget, dtype, boost=3.0):
    g = torch.Generator().manual_seed(seed)
    ids, lp = dl.draft_topk_from_logits(torch.randn(bs, depth, vocab, generator=g) * 2, k=k)
    tree = dl.build_tree(ids, lp, torch.randint(0, vocab, (bs,), generator=g), budget)
    vi = dl.compile_retrieve(tree, 7)
    logits = torch.randn(bs, vi.num_rows, vocab, generator=g) * 1.5
    for b in range(bs):  # the target likes the draft a little, so walks go deep
        for i in range(1, int(tree.num_nodes[b])):
            if torch.rand(1, generator=g) < 0.7:
                logits[b, int(tree.parents[b, i]), int(tree.node_token_ids[b, i])] += boost
    coins = torch.rand(bs, vi.num_rows, generator=g)
    final = torch.rand(bs, generator=g)
    edge = torch.rand(bs, vi.num_rows, generator=g)
    coins[edge < 0.05] = 0.0
    coins[edge > 0.95] = BELOW_ONE
    params = [PARAM_MIX[int(i)] for i in torch.randint(0, len(PARAM_MIX), (bs,), generator=g)]
    return vi, logits.to(dtype), params, coins, final


def _on(x):
    return x.to(DEVICE)


def _check_sampled(vi, logits, params, coins, final, ties=None):
    probs = dl.target_probs(logits, params, vi.num_nodes)
    ref = dl.verify_sampled(vi, probs, coins, final)
    got = verify_tree(vi, _on(logits), params, coins, final, backend="triton")
    assert got.backend in ("triton", "triton-interpret")
    try:
        assert_same(ref, got)
    except AssertionError:
        if ties is None or not near_tie(ref, probs):
            raise
        ties.append(1)
    return ref, got


# ---- differential tests over random trees -------------------------------------------------

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("seed", range(8))
def test_sampled_kernel_equals_reference_on_random_trees(dtype, seed):
    vocab = (64, 200, 512, 333)[seed % 4]
    vi, logits, params, coins, final = _random_case(seed, bs=4, vocab=vocab, depth=1 + seed % 5, k=3,
                                                    budget=4 + 2 * seed, dtype=dtype)
    ties = []
    ref, _ = _check_sampled(vi, logits, params, coins, final, ties)
    assert len(ties) == 0, "a near-tie (allowed, but should be vanishingly rare at these seeds)"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("seed", range(3))
def test_sampled_kernel_without_the_survivor_gather(dtype, seed, monkeypatch):
    # every step as a pass over the full row (the path of top-k rows with many survivors)
    from ddtree_lab.verify import triton as verify_backends

    monkeypatch.setattr(verify_backends, "COMPACT_CAP", 0)
    vi, logits, params, coins, final = _random_case(50 + seed, bs=4, vocab=(96, 256, 400)[seed], depth=3, k=3,
                                                    budget=9, dtype=dtype)
    _check_sampled(vi, logits, params, coins, final)


def test_top_k_ties_overflowing_the_gather_fall_back_to_full_rows():
    vi = _star([7, 300, 2], 512)
    logits = torch.randn(1, 4, 512, generator=torch.Generator().manual_seed(9))
    logits[0, 0, 10:310] = 6.0  # 300 tied survivors of top_k = 5 (> the 256 gathered)
    for coin in (0.0, 0.4, BELOW_ONE):
        for params in (SP(1.0, top_k=5), SP(1.0, top_k=5, top_p=0.5), SP(0.7, top_k=5, min_p=0.5)):
            _check_sampled(vi, logits, params, torch.full((1, 4), coin), torch.tensor([0.3]))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("seed", range(6))
def test_greedy_kernel_equals_reference_on_random_trees(dtype, seed):
    vocab = (64, 256, 500)[seed % 3]
    vi, logits, _, _, _ = _random_case(100 + seed, bs=4, vocab=vocab, depth=2 + seed % 4, k=3,
                                       budget=6 + 3 * seed, dtype=dtype, boost=6.0)
    if seed % 2:  # ties on the argmax: the lowest id wins
        logits[:, :, 5] = logits.max()
        logits[:, :, 9] = logits.max()
    ref = dl.verify_greedy(vi, logits)
    got = verify_tree_greedy(vi, _on(logits), backend="triton")
    assert_same(ref, got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_many_small_trees_in_one_launch(dtype):
    # 40 requests per launch, both kernels; V = 64 keeps the interpreter quick
    vi, logits, params, coins, final = _random_case(900, bs=40, vocab=64, depth=4, k=3, budget=10, dtype=dtype)
    ties = []
    _check_sampled(vi, logits, params, coins, final, ties)
    assert not ties
    assert_same(dl.verify_greedy(vi, logits), verify_tree_greedy(vi, _on(logits), backend="triton"))


def test_deep_accepting_walks_in_one_mixed_batch():
    # a strongly drafted target: long accepted paths, every parameter kind in one launch
    vi, logits, _, coins, final = _random_case(7, bs=len(PARAM_MIX), vocab=128, depth=7, k=2, budget=40,
                                               dtype=torch.bfloat16, boost=9.0)
    ref, got = _check_sampled(vi, logits, PARAM_MIX, coins, final)
    assert int(ref.accept_length.max()) >= 4


# ---- boundary cases -----------------------------------------------------------------------


def _chain(tokens, vocab):
    n = len(tokens) + 1
    tree = dl.DDTreeBuildResult(
        node_token_ids=torch.tensor([[0, *tokens]]), parents=torch.tensor([list(range(-1, n - 1))]),
        depths=torch.arange(n)[None], ranks=torch.tensor([[-1] + [0] * (n - 1)]),
        node_logws=-torch.arange(n, dtype=torch.float32)[None], num_nodes=torch.tensor([n]))
    return dl.compile_retrieve(tree, 0)


def _star(children, vocab, pad_to=None):
    """A root whose children carry ``children`` (sibling order = list order)."""
    n = len(children) + 1
    rows = pad_to or n
    tok = torch.full((1, rows), -1)
    tok[0, :n] = torch.tensor([0, *children])
    par = torch.full((1, rows), -1)
    par[0, 1:n] = 0
    dep = torch.full((1, rows), -1)
    dep[0, 0], dep[0, 1:n] = 0, 1
    tree = dl.DDTreeBuildResult(node_token_ids=tok, parents=par, depths=dep, ranks=dep.clone(),
                                node_logws=-torch.arange(rows, dtype=torch.float32)[None], num_nodes=torch.tensor([n]))
    return dl.compile_retrieve(tree, 0)


@pytest.mark.parametrize("coin", [0.0, 0.5, BELOW_ONE])
@pytest.mark.parametrize("final", [0.0, 0.5, BELOW_ONE])
def test_coin_zero_and_just_below_one(coin, final):
    vi = _chain((1, 2, 3), 16)
    logits = torch.zeros(1, 4, 16)  # uniform rows: exact probabilities (1/16, or 1/4 with top_k)
    for params in (SP(1.0), SP(1.0, top_k=4), SP(0.5, top_p=0.5)):
        _check_sampled(vi, logits, params, torch.full((1, 4), coin), torch.full((1,), final))


@pytest.mark.parametrize("coin", [0.0, 0.3, 0.75, BELOW_ONE])
def test_children_holding_all_of_the_top_k_mass(coin):
    # four tied survivors, all children: S_4 = 1 exactly, so u < 1 always accepts one of them
    vi = _star([3, 5, 7, 9], 32)
    logits = torch.randn(1, 5, 32, generator=torch.Generator().manual_seed(0))
    logits[0, 0, [3, 5, 7, 9]] = 10.0
    ref, got = _check_sampled(vi, logits, SP(1.0, top_k=4), torch.full((1, 5), coin), torch.tensor([0.5]))
    assert got.accept_length.item() == 1


@pytest.mark.parametrize("coin", [0.5, BELOW_ONE])
def test_children_holding_the_whole_row_take_the_last_child_at_the_float_edge(coin):
    # twelve tied survivors p = fl(1/12), all children: their float32 sum S_12 = 0.9999999 < 1,
    # so a coin just below one rejects every child on float sums; exact arithmetic has
    # S_12 = 1 > u and takes the last child. Every backend follows exact arithmetic.
    children = list(range(2, 14))
    vi = _star(children, 40)
    logits = torch.zeros(1, 13, 40)
    logits[0, 0, children] = 8.0
    coins = torch.full((1, 13), coin)
    ref, got = _check_sampled(vi, logits, SP(1.0, top_k=12), coins, torch.tensor([0.5]))
    lazy = verify_tree(vi, logits, SP(1.0, top_k=12), coins, torch.tensor([0.5]), backend="torch-lazy")
    assert_same(ref, lazy)
    for out in (ref, got, lazy):
        assert not bool(out.support_exhausted[0]) and out.accept_length.item() == 1
    if coin == BELOW_ONE:
        log = ref.decisions[0]
        assert len(log) == 12 and log[-2].cumulative_mass < coin  # the float sums do reject
        for out in (ref, got, lazy):
            assert out.accept_index[0, 1].item() == 12 and out.emitted_tokens[0, 0].item() == 13
            assert out.decisions[0][-1].cumulative_mass == 1.0 and out.decisions[0][-1].verdict == "accept"
    # the float32 running sum in sibling order (what a kernel adds) ends below the coin just
    # below one: the old rule rejected all twelve and reported an empty residual
    s = 0.0
    for d in ref.decisions[0][:12]:
        s = float(np.float32(s + d.target_prob))
    assert (coin < s) == (coin == 0.5)


def test_top_k_one_rows_beside_sampled_rows():
    vi, logits, _, coins, final = _random_case(3, bs=4, vocab=96, depth=3, k=3, budget=9, dtype=torch.float32)
    params = [SP(1.0, top_k=1), SP(1.0), SP(0.0), SP(0.8, top_k=1, top_p=0.5)]
    ref, got = _check_sampled(vi, logits, params, coins, final)
    for b in (0, 3):  # a top_k = 1 row is its argmax: the bonus is certain
        assert got.bonus[b].token_prob == 1.0


def test_zero_probability_children_are_never_accepted():
    vi = _star([1, 2, 3], 40)
    logits = torch.zeros(1, 4, 40)
    logits[0, 0, 20:25] = 5.0  # top_k = 5 keeps 20..24; the children 1, 2, 3 have p = 0
    for coin in (0.0, 0.5, BELOW_ONE):
        ref, got = _check_sampled(vi, logits, SP(1.0, top_k=5), torch.full((1, 4), coin), torch.tensor([coin]))
        assert got.accept_length.item() == 0
        assert [d.target_prob for d in got.decisions[0]] == [0.0, 0.0, 0.0]
        assert 20 <= got.bonus_token.item() < 25


def test_leaf_shallower_than_the_block_and_padding_rows():
    # depth limit 6, but request 0's walk ends on a depth-1 leaf; request 1 is a single node
    vi_a = _star([4, 6], 24, pad_to=8)
    tok = torch.full((1, 8), -1)
    tok[0, 0] = 2
    single = dl.DDTreeBuildResult(node_token_ids=tok, parents=torch.full((1, 8), -1), depths=torch.tensor([[0] + [-1] * 7]),
                                  ranks=torch.full((1, 8), -1), node_logws=torch.zeros(1, 8), num_nodes=torch.tensor([1]))
    vi_b = dl.compile_retrieve(single, 0)
    logits = torch.randn(2, 8, 24, generator=torch.Generator().manual_seed(4))
    logits[0, 0, 4] = 20.0  # node 1 (token 4) is certain, and it is a leaf
    for i, vi in enumerate((vi_a, vi_b)):
        for params in (SP(1.0), SP(0.0), SP(1.0, top_k=3, top_p=0.7)):
            ref, got = _check_sampled(vi, logits[i : i + 1], params, torch.rand(1, 8), torch.rand(1))
            # request 0 accepts its certain depth-1 leaf; the single node is a leaf itself
            assert got.bonus[0].kind == "leaf" and got.accept_length.item() == 1 - i
        ref = dl.verify_greedy(vi, logits[i : i + 1])
        assert_same(ref, verify_tree_greedy(vi, _on(logits[i : i + 1]), backend="triton"))


def test_lossy_thresholds_match_the_reference():
    vi, logits, params, coins, final = _random_case(5, bs=4, vocab=128, depth=3, k=3, budget=10, dtype=torch.float32)
    probs = dl.target_probs(logits, params, vi.num_nodes)
    for ts, ta in ((0.3, 1.0), (1.0, 0.6), (0.5, 0.5)):
        ref = dl.verify_sampled(vi, probs, coins, final, threshold_single=ts, threshold_acc=ta)
        got = verify_tree(vi, _on(logits), params, coins, final, backend="triton", threshold_single=ts, threshold_acc=ta)
        assert_same(ref, got)


# ---- backends -----------------------------------------------------------------------------


def test_torch_lazy_backend_is_bit_identical_to_the_reference():
    vi, logits, params, coins, final = _random_case(2, bs=6, vocab=300, depth=4, k=3, budget=12, dtype=torch.bfloat16)
    ref = verify_tree(vi, logits, params, coins, final, backend="reference")
    lazy = verify_tree(vi, logits, params, coins, final, backend="torch-lazy")
    assert (ref.backend, lazy.backend) == ("reference", "torch-lazy")
    assert [[d.to_dict() for d in log] for log in ref.decisions] == [[d.to_dict() for d in log] for log in lazy.decisions]
    assert [d.to_dict() for d in ref.bonus] == [d.to_dict() for d in lazy.bonus]
    assert torch.equal(ref.emitted_tokens, lazy.emitted_tokens)


@pytest.mark.parametrize("seed", range(4))
def test_lazy_row_probs_is_bit_identical_to_target_probs(seed):
    from ddtree_lab.verify import lazy_row_probs

    g = torch.Generator().manual_seed(seed)
    for dtype in DTYPES:
        logits = (torch.randn(6, 300, generator=g) * (1 + seed)).to(dtype)
        logits[0, :40] = logits[0].max()  # a tie block at the top
        logits[1, :] = 0.0  # a uniform row
        for params in PARAM_MIX + [SP(1.0, top_k=5, top_p=0.999999), SP(0.5, top_k=299, top_p=0.7)]:
            want = dl.target_probs(logits[:, None], params)[:, 0]
            for r in range(6):
                got = lazy_row_probs(logits[r].float(), params)
                assert torch.equal(got, want[r]), (params, r)


def test_auto_selects_triton_here_and_records_it():
    name, why = select_backend("auto", DEVICE)
    assert name == ("triton" if DEVICE == "cuda" else "triton-interpret"), why
    vi = _chain((1,), 8)
    out = verify_tree(vi, _on(torch.zeros(1, 2, 8)), SP(1.0), torch.zeros(1, 2), torch.zeros(1))
    assert out.backend == name
    with pytest.raises(ValueError, match="backend must be one of"):
        select_backend("cuda-magic", "cpu")


# ---- invalid input ------------------------------------------------------------------------


@pytest.mark.parametrize("value, what", [(float("nan"), "NaN"), (float("inf"), r"\+inf")])
def test_bad_logits_in_a_walked_row_are_named(value, what):
    vi = _chain((1, 2), 8)
    logits = torch.zeros(1, 3, 8)
    logits[0, 0, 1] = 9.0  # the walk reaches node 1
    logits[0, 1, 4] = value
    for backend in ("reference", "triton"):
        with pytest.raises(ValueError, match=f"target logits, request 0, node 1: row has {what}"):
            verify_tree(vi, _on(logits), SP(1.0), torch.zeros(1, 3), torch.zeros(1), backend=backend)
    with pytest.raises(ValueError, match=f"request 0, node 1: row has {what}"):
        verify_tree_greedy(vi, _on(logits), backend="triton")
    logits[0, 1] = -math.inf
    with pytest.raises(ValueError, match="node 1: row has every entry -inf"):
        verify_tree(vi, _on(logits), SP(0.7, top_k=2), torch.zeros(1, 3), torch.zeros(1), backend="triton")


def test_unwalked_bad_rows_are_not_read_by_the_lazy_backends():
    vi = _chain((1, 2), 8)
    logits = torch.zeros(1, 3, 8)
    logits[0, 0, 5] = 9.0  # the walk stops at the root
    logits[0, 2, 0] = float("nan")
    out = verify_tree(vi, _on(logits), SP(1.0), torch.full((1, 3), BELOW_ONE), torch.zeros(1), backend="triton")
    assert out.accept_length.item() == 0
    with pytest.raises(ValueError, match="node 2: row has NaN"):  # the reference reads every row
        verify_tree(vi, logits, SP(1.0), torch.full((1, 3), BELOW_ONE), torch.zeros(1), backend="reference")


def test_bad_coins_buffers_and_cycles_are_named_as_in_the_reference():
    vi = _chain((1, 2), 8)
    logits = torch.zeros(1, 3, 8)
    with pytest.raises(ValueError, match=r"coins, request 0, node 2: 1.0 is not in \[0, 1\)"):
        verify_tree(vi, _on(logits), SP(1.0), torch.tensor([[0.0, 0.0, 1.0]]), torch.zeros(1), backend="triton")
    with pytest.raises(ValueError, match="final_coins, request 0"):
        verify_tree(vi, _on(logits), SP(1.0), torch.zeros(1, 3), torch.tensor([-0.5]), backend="triton")
    broken = dl.DDTreeVerifyInput(**{**vi.__dict__, "retrieve_next_token": torch.tensor([[1, 7, -1]])})
    with pytest.raises(ValueError, match="retrieve_next_token, request 0, node 1: 7 is out of range"):
        verify_tree(broken, _on(logits), SP(1.0), torch.zeros(1, 3), torch.zeros(1), backend="triton")
    star = _star([1, 2], 8)
    cyclic = dl.DDTreeVerifyInput(**{**star.__dict__, "retrieve_next_sibling": torch.tensor([[-1, 2, 1]])})
    for backend in ("reference", "triton"):
        with pytest.raises(ValueError, match="node 0: sibling chain longer than the tree"):
            verify_tree(cyclic, _on(torch.zeros(1, 3, 8)), SP(1.0), torch.full((1, 3), BELOW_ONE), torch.zeros(1),
                        backend=backend)
    with pytest.raises(ValueError, match="node 0: sibling chain longer than the tree"):
        verify_tree_greedy(cyclic, _on(torch.full((1, 3, 8), 0.0)), backend="triton")
    with pytest.raises(TypeError, match="target_logits must have dtype"):
        verify_tree(vi, _on(logits.double()), SP(1.0), torch.zeros(1, 3), torch.zeros(1), backend="triton")


# ---- native compilation -------------------------------------------------------------------

def test_every_kernel_configuration_compiles_for_sm80_sm90_sm100_without_spills():
    """The interpreter is lenient about types: this compiles the real kernels, every launcher
    configuration (bf16 / fp16 / fp32 logits; sampled with and without the survivor gather,
    greedy; BLOCK 4096, 8 warps, fusion off) for sm_80, sm_90 and, where this triton ships a
    Blackwell ptxas, sm_100, and reads each cubin's resource usage. A compile error or any
    local memory / stack use (a spill) fails. The table it prints is the one
    benchmarks/kernel_resources.py writes into docs/BENCHMARKS.md."""
    from ddtree_lab.kernels import resources

    if resources.cuobjdump_path() is None or not resources.supported_archs():
        pytest.skip("no ptxas / cuobjdump in this triton install")
    archs = resources.supported_archs()
    assert {80, 90} <= set(archs), archs
    rows = resources.measure(resources.CONFIGS, archs, workers=2)
    assert len(rows) == len(resources.CONFIGS) * len(archs)
    print()
    for r in rows:
        print(r)
    failed = [f"{r['config']} sm_{r['arch']}: {r['error']}" for r in rows if "error" in r]
    assert not failed, "\n".join(failed)
    spilled = [f"{r['config']} sm_{r['arch']}: LOCAL {r['local']} STACK {r['stack']}" for r in rows if r["spills"]]
    assert not spilled, spilled
    for r in rows:
        assert 0 < r["registers"] <= 255 and r["cubin_bytes"] > 0 and r["fp_fusion"] is False, r


def test_launchers_pin_fusion_off_in_compiled_and_interpreted_launches(monkeypatch):
    """Both launchers pass ``enable_fp_fusion=False`` (tree_verify.FP_FUSION), here under the
    interpreter as on a GPU; the compile test above compiles with the same options."""
    from ddtree_lab.kernels import tree_verify as tv

    assert tv.FP_FUSION is False and tv.LAUNCH_OPTIONS == {"num_warps": 8, "enable_fp_fusion": False}
    seen = []
    kernel_type = type(tv.sampled_verify_kernel)  # InterpretedFunction here, JITFunction on a GPU
    assert type(tv.greedy_verify_kernel) is kernel_type
    original = kernel_type.__getitem__

    def spy(self, grid):
        launch = original(self, grid)

        def run(*args, **kwargs):
            seen.append(kwargs.get("enable_fp_fusion", "unset"))
            return launch(*args, **kwargs)
        return run

    monkeypatch.setattr(kernel_type, "__getitem__", spy)
    vi = _star([1, 2], 8)
    logits = torch.randn(1, 3, 8, generator=torch.Generator().manual_seed(1))
    verify_tree(vi, _on(logits), SP(1.0), torch.rand(1, 3), torch.rand(1), backend="triton")
    verify_tree_greedy(vi, _on(logits), backend="triton")
    assert seen == [False, False]


# ---- buffers validated by default; thresholds SGLang accepts --------------------------------


def test_a_node_listed_as_its_own_next_sibling_is_refused_by_every_backend():
    star = _star([1, 2], 8)
    ns = star.retrieve_next_sibling.clone()
    ns[0, 1] = 1  # node 1 is its own next sibling
    bad = dl.DDTreeVerifyInput(**{**star.__dict__, "retrieve_next_sibling": ns})
    logits = torch.zeros(1, 3, 8)
    logits[0, 0, 1] = 1.0
    for backend in ("reference", "torch-lazy", "triton"):
        with pytest.raises(dl.RetrieveError, match=r"request 0, node 0: sibling chain longer than the tree "
                                                   r"\(a cycle in retrieve_next_sibling: 1 -> 1\)"):
            verify_tree(bad, _on(logits), SP(1.0), torch.full((1, 3), 0.9), torch.zeros(1), backend=backend)
    with pytest.raises(dl.RetrieveError, match="a cycle in retrieve_next_sibling: 1 -> 1"):
        verify_tree_greedy(bad, _on(logits), backend="triton")
    # unvalidated, the kernel re-reads node 1 and its mass piles up until the coin falls under it:
    # a wrong accept that validation now stops before launch
    raw = {}
    launch, raw = dl.verify.sampled_launcher(bad, _on(logits), [SP(1.0)], torch.full((1, 3), 0.5),
                                                      torch.zeros(1))
    launch()
    p1 = torch.softmax(logits[0, 0], -1)[1].item()  # node 1's p; 2 * p1 > 0.5 > p1
    assert p1 < 0.5 < 2 * p1
    assert int(raw["err"][0]) == 0 and raw["path"][0, :2].tolist() == [0, 1]  # accepted on its second visit
    assert raw["dnode"][0, :2].tolist() == [1, 1]


def test_a_node_both_child_and_sibling_is_refused_by_the_kernels():
    star = _star([1, 2, 3], 8)
    nt = star.retrieve_next_token.clone()
    nt[0, 1] = 2  # node 2 is node 1's sibling and its child
    bad = dl.DDTreeVerifyInput(**{**star.__dict__, "retrieve_next_token": nt})
    for call in (lambda v: verify_tree(bad, _on(torch.zeros(1, 4, 8)), SP(1.0), torch.zeros(1, 4), torch.zeros(1),
                                       backend="triton", validate=v),
                 lambda v: verify_tree_greedy(bad, _on(torch.zeros(1, 4, 8)), backend="triton", validate=v)):
        with pytest.raises(dl.RetrieveError, match="request 0, node 2: reached twice"):
            call(True)
        call(False)  # switched off for timing: the kernel runs


@pytest.mark.parametrize("ts, ta", [(0.0, 0.0), (1.0, 0.0), (0.0, 1.0), (0.4, 0.0), (1.0, 1.5), (1.2, 1.5)])
def test_thresholds_sglang_accepts_run_on_every_backend_and_are_marked_lossy(ts, ta):
    vi, logits, params, coins, final = _random_case(6, bs=4, vocab=64, depth=3, k=3, budget=10, dtype=torch.float32)
    probs = dl.target_probs(logits, params, vi.num_nodes)
    ref = dl.verify_sampled(vi, probs, coins, final, threshold_single=ts, threshold_acc=ta)
    for backend in ("torch-lazy", "triton"):
        got = verify_tree(vi, _on(logits), params, coins, final, backend=backend, threshold_single=ts,
                          threshold_acc=ta)
        assert_same(ref, got)
        assert got.lossy and got.thresholds == (ts, ta)
    exact = verify_tree(vi, _on(logits), params, coins, final, backend="triton")
    assert not exact.lossy and exact.thresholds == (1.0, 1.0)
    # SGLang's rule, decision by decision: u <= S / max(threshold_acc, 1e-9) or p >= threshold_single
    for log in ref.decisions:
        for d in log:
            want = dl.verify.sglang_accepts(d.target_prob, d.cumulative_mass, d.coin, ts, ta)
            assert d.verdict == ("accept" if want else "reject"), d
            if ts == 0.0:  # p >= 0: the first child at every visited node, whatever its p
                assert d.verdict == "accept"


def test_the_other_filtering_order_is_refused_by_the_kernel_and_runs_elsewhere():
    vi, logits, _, coins, final = _random_case(7, bs=2, vocab=64, depth=3, k=3, budget=8, dtype=torch.float32)
    params = [SP(0.9, top_k=5, top_p=0.6, order="top_p_then_top_k"), SP(1.0)]
    with pytest.raises(ValueError, match="request 0: order 'top_p_then_top_k': the Triton kernel fuses"):
        verify_tree(vi, _on(logits), params, coins, final, backend="triton")
    ref = verify_tree(vi, logits, params, coins, final, backend="reference")
    lazy = verify_tree(vi, logits, params, coins, final, backend="torch-lazy")
    auto = verify_tree(vi, logits, params, coins, final, backend="auto")
    assert auto.backend == "reference"  # recorded, never silent
    assert [[d.to_dict() for d in log] for log in ref.decisions] == [[d.to_dict() for d in log] for log in lazy.decisions]


# ---- SGLang's own test cases of tree_speculative_sampling_target_only ----------------------

# The buffers, logits and expected outputs of sgl-kernel's test of the target-only kernel
# (tests/speculative/test_speculative_sampling.py): two requests of six nodes, V = 20,
# temperature 0.01 (each row is one-hot in float32), accept_index width 4.
SGL_CANDIDATES = [[0, 1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12]]
SGL_NEXT_TOKEN = [[1, 2, -1, 4, 5, -1], [4, 2, 3, -1, 5, -1]]
SGL_NEXT_SIBLING = [[-1, 3, -1, -1, -1, -1], [-1, -1, -1, -1, 1, -1]]
SGL_PEAKS = {(0, 0): 3, (0, 3): 4, (0, 4): 5, (1, 0): 11, (1, 4): 12}  # logit 10 there, else 1 (18 elsewhere)
SGL_CASES = [  # threshold_single, threshold_acc, predicts, accept_index, accept_token_num
    (1.0, 1.0, [3, -1, -1, 4, 5, 18, 11, -1, -1, -1, 12, 18], [[0, 3, 4, 5], [6, 10, 11, -1]], [3, 2]),
    (0.0, 0.0, [1, 2, 18, -1, -1, -1, 11, -1, -1, -1, 12, 18], [[0, 1, 2, -1], [6, 10, 11, -1]], [2, 2]),
]


def _sglang_test_case():
    from ddtree_lab.sglang.buffers import verify_input_from_retrieve

    vi = verify_input_from_retrieve(torch.tensor(SGL_CANDIDATES), torch.tensor(SGL_NEXT_TOKEN),
                                    torch.tensor(SGL_NEXT_SIBLING))
    logits = torch.ones(2, 6, 20)
    for (b, i), t in SGL_PEAKS.items():
        logits[b, i, t] = 10.0
    for b in range(2):
        for i in range(6):
            if logits[b, i].max() < 10:
                logits[b, i, 18] = 10.0
    return vi, logits


@pytest.mark.parametrize("backend", ["reference", "torch-lazy", "triton"])
@pytest.mark.parametrize("ts, ta, predicts, accept_index, accept_num", SGL_CASES)
def test_sglang_target_only_kernel_test_cases_on_every_backend(backend, ts, ta, predicts, accept_index, accept_num):
    from ddtree_lab.sglang.buffers import verify_output_to_sglang

    vi, logits = _sglang_test_case()
    g = torch.Generator().manual_seed(0)
    coin_sets = [torch.rand(2, 6, generator=g) for _ in range(4)] + [torch.full((2, 6), BELOW_ONE)]
    for coins in coin_sets:
        out = verify_tree(vi, _on(logits), SP(0.01), coins, torch.rand(2, generator=g), backend=backend,
                          threshold_single=ts, threshold_acc=ta)
        got = verify_output_to_sglang(out, 6, 4, fill=-1)
        assert [t.tolist() for t in got] == [predicts, accept_index, accept_num], (backend, coins)
        assert out.lossy == ((ts, ta) != (1.0, 1.0))
    if (ts, ta) == (1.0, 1.0):
        # a coin of exactly 0: SGLang's u <= S takes node 1 (p = 0, S = 0); the lab's lossless
        # rule (u < S and p > 0) does not -- the one place the two differ at (1, 1) besides
        # the float edge (ddtree_lab.verify module docstring)
        out = verify_tree(vi, _on(logits), SP(0.01), torch.zeros(2, 6), torch.zeros(2), backend=backend)
        assert out.accept_index[0, :4].tolist() == [0, 3, 4, 5]
