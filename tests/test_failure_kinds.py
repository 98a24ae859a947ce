"""Known failure kinds of tree verification, each a regression test on a small hand-made input.

Each test also runs (or computes) the faulty variant and asserts that it differs, so the test
would fail on an implementation with that fault. Backends: reference, torch-lazy and Triton
(under ``TRITON_INTERPRET=1`` on a machine without CUDA).
"""


import torch


import dataclasses
import itertools
import json
import math

import pytest

import ddtree_lab as dl
from ddtree_lab import SamplingParams as SP
from ddtree_lab.verify import verify_tree, verify_tree_greedy

try:
    import triton  # noqa: F401

    BACKENDS = ("reference", "torch-lazy", "triton")
except ImportError:  # pragma: no cover - triton is in the dev extras
    BACKENDS = ("reference", "torch-lazy")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BELOW_ONE = torch.tensor(1.0).nextafter(torch.tensor(0.0)).item()


def _tree(parents, tokens, prefix=0):
    n = len(parents)
    depths = [0] * n
    for i in range(1, n):
        depths[i] = depths[parents[i]] + 1
    return dl.compile_retrieve(dl.DDTreeBuildResult(
        node_token_ids=torch.tensor([tokens]), parents=torch.tensor([parents]), depths=torch.tensor([depths]),
        ranks=torch.zeros(1, n, dtype=torch.int64), node_logws=-torch.arange(n, dtype=torch.float32)[None],
        num_nodes=torch.tensor([n])), prefix)


def _batch(vis):
    """Single-request verify inputs (same N) stacked into one batch, retrieve_index re-based."""
    n = vis[0].num_rows
    parts = {f.name: torch.cat([getattr(v, f.name) for v in vis]) for f in dataclasses.fields(vis[0])}
    ri = parts["retrieve_index"]
    parts["retrieve_index"] = torch.where(ri >= 0, ri % n + torch.arange(len(vis))[:, None] * n, -1)
    return dl.DDTreeVerifyInput(**parts)


def _run(backend, vi, logits, params, coins, final):
    return verify_tree(vi, logits.to(DEVICE) if backend == "triton" else logits, params, coins, final,
                       backend=backend)


# ---- filtering order ----------------------------------------------------------------------


def test_filtering_order_top_k_then_top_p_keeps_one_token_top_p_first_keeps_two():
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    ours = SP(1.0, top_k=2, top_p=0.5)
    other = dataclasses.replace(ours, order="top_p_then_top_k")
    rows = dl.target_probs(logits[None, None], [ours])[0, 0]
    other_rows = dl.target_probs(logits[None, None], [other])[0, 0]
    assert (rows > 0).tolist() == [True, False, False, False]  # [4/7, 3/7] after top-k; 4/7 >= 0.5
    assert (other_rows > 0).tolist() == [True, True, False, False]  # 0.4 < 0.5 on the original row
    # verify reads the same rows as plain sampling: token 1 (node 1) is never accepted, never
    # the bonus, on every backend; under the other order it is, for coins below 3/7
    vi = _tree([-1, 0], [3, 1])
    lg = torch.stack([logits, logits])[None]
    for backend in BACKENDS:
        for u in (0.0, 0.2, 0.5, BELOW_ONE):
            out = _run(backend, vi, lg, [ours], torch.full((1, 2), u), torch.tensor([u]))
            assert out.emitted_tokens[0, 0].item() == 0 and out.accept_length.item() == 0
    first, _, _ = dl.verify.residual_draw(rows, [], BELOW_ONE)  # plain sampling of a first token
    assert first == 0
    faulty = dl.verify_sampled(vi, dl.target_probs(lg, [other]), torch.full((1, 2), 0.2), torch.tensor([0.2]))
    assert faulty.emitted_tokens[0, 0].item() == 1


# ---- banned tokens ------------------------------------------------------------------------


BANNED = 0  # token id 0: where an inverse-CDF draw with ">=" or an accept with "<=" lands at coin 0


def _banned_case():
    """A depth-2 tree whose first child at each level is the banned token 0, and target rows
    where token 0 has logit bias -100 (root and node 2 rows) or falls under min_p."""
    vocab = 12
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(1, 5, vocab, generator=g)
    logits[..., 1:4] += 5.0  # the row's maximum is >= 5 above token 0's raw logit
    logits[..., BANNED] = torch.randn(1, 5, generator=g).clamp(-1, 0) - 100.0
    # nodes: 1 = banned at depth 1, 2 = token 1 at depth 1; 3 = banned under node 2, 4 = token 2
    vi = _tree([-1, 0, 0, 2, 2], [7, BANNED, 1, BANNED, 2])
    return vi, logits


@pytest.mark.parametrize("params", [SP(1.0), SP(0.7, top_k=8, top_p=0.95), SP(1.0, min_p=0.05)],
                         ids=["bias", "bias-top_k-top_p", "min_p"])
def test_a_banned_token_is_never_emitted_as_draft_or_bonus(params):
    vi, logits = _banned_case()
    if params.min_p:  # not biased this time: min_p alone removes it
        logits = logits.clone()
        logits[..., BANNED] = logits[..., 1:4].max(-1).values - 4.0  # p / max p = e^-4 < 0.05
    probs = dl.target_probs(logits, [params])
    assert (probs[0, :, BANNED] == 0).all()  # the precondition: p is exactly 0 in float32
    draws = 400
    g = torch.Generator().manual_seed(0)
    coins = torch.rand(draws, 5, generator=g)
    final = torch.rand(draws, generator=g)
    coins[:8], final[:8] = 0.0, 0.0  # the edges where faulty comparisons pick token 0
    coins[8:16], final[8:16] = BELOW_ONE, BELOW_ONE
    coins[16:24, 0], final[16:24] = 0.0, BELOW_ONE
    for backend in BACKENDS:
        m = 40 if backend == "triton" else draws  # the interpreter is slow: the edges and a few more
        out = _run(backend, _batch([vi] * m), logits.expand(m, -1, -1).contiguous(), [params] * m, coins[:m],
                   final[:m])
        emitted = out.emitted_tokens[out.emitted_tokens >= 0]
        assert not bool((emitted == BANNED).any()), backend
        assert bool((out.accept_length >= 1).any())  # the walks do get past the first level
    # faulty variants: SGLang's older "u <= S" without the p > 0 guard accepts the banned first
    # child at coin 0; an inverse-CDF draw with ">=" returns token 0 at coin 0
    p0 = float(probs[0, 0, BANNED])
    assert 0.0 <= 0.0 + p0  # u = 0 <= S_1 = 0: accepted by the faulty rule
    cum = probs[0, 0].double().cumsum(0)
    assert int(torch.searchsorted(cum, torch.tensor([0.0], dtype=torch.float64), right=False)) == BANNED
    assert int(torch.searchsorted(cum, torch.tensor([0.0], dtype=torch.float64), right=True)) != BANNED


# ---- a permuted mixed batch ---------------------------------------------------------------


def test_a_greedy_request_in_a_permuted_mixed_batch_emits_its_argmax_path():
    vocab = 10
    g = torch.Generator().manual_seed(3)
    trees = [_tree([-1, 0, 0, 1, 1, 3], [4, 1, 2, 3, 5, 6]), _tree([-1, 0, 0, 1, 2, 3], [9, 2, 3, 4, 5, 7]),
             _tree([-1, 0, 1, 1, 0, 4], [1, 6, 7, 8, 2, 3])]
    logits = torch.randn(3, 6, vocab, generator=g) * 0.5
    # request 1 (greedy): the argmax path is 0 -> 1 -> 3 -> 5, each argmax only just ahead
    logits[1, 0, 2], logits[1, 1, 4], logits[1, 3, 7] = 2.0, 2.0, 2.0
    logits[1, 0, 3], logits[1, 1, 8], logits[1, 3, 1] = 1.9, 1.9, 1.9
    params = [SP(0.7), SP(0.0), SP(1.2)]
    want = dl.verify_greedy(trees[1], logits[1:2])
    path = want.emitted_tokens[0].tolist()
    assert [t for t in path if t >= 0][:3] == [2, 4, 7]
    faulty_differs = False
    for perm in itertools.permutations(range(3)):
        vi = _batch([trees[b] for b in perm])
        rows = logits[list(perm)]
        j = perm.index(1)
        for _draw in range(6):
            coins = torch.rand(3, 6, generator=g)
            final = torch.rand(3, generator=g)
            for backend in BACKENDS:
                out = _run(backend, vi, rows, [params[b] for b in perm], coins, final)
                assert out.emitted_tokens[j].tolist()[: len(path)] == path, (perm, backend)
            # faulty variant: rows permuted, parameters left in the original order
            bad = dl.verify_tree(vi, rows, params, coins, final, backend="reference")
            faulty_differs |= bad.emitted_tokens[j].tolist()[: len(path)] != path
        greedy = verify_tree_greedy(vi, rows, backend="reference")
        assert greedy.emitted_tokens[j].tolist()[: len(path)] == path
    assert faulty_differs


# ---- reproducible coins -------------------------------------------------------------------


def test_same_seed_and_params_give_identical_coins_and_outputs_and_coins_never_reach_one():
    vi, logits = _banned_case()
    vi3 = _batch([vi] * 3)
    lg = logits.expand(3, -1, -1).contiguous()
    params = [SP(1.0, seed=11), SP(0.8, top_k=5, seed=12), SP(1.2, top_p=0.9, seed=13)]
    runs = []
    for _ in range(2):
        coins, final = dl.draw_coins(dl.make_generators(params), vi3.num_rows)
        runs.append((coins, final, {b: _run(b, vi3, lg, params, coins, final) for b in BACKENDS}))
    (c1, f1, o1), (c2, f2, o2) = runs
    assert torch.equal(c1, c2) and torch.equal(f1, f2)
    for b in BACKENDS:
        assert torch.equal(o1[b].emitted_tokens, o2[b].emitted_tokens)
        assert [[d.to_dict() for d in log] for log in o1[b].decisions] == \
               [[d.to_dict() for d in log] for log in o2[b].decisions]
    # faulty variant: an unseeded generator does not reproduce
    unseeded = [dataclasses.replace(p, seed=None) for p in params]
    c3, _ = dl.draw_coins(dl.make_generators(unseeded), vi3.num_rows)
    c4, _ = dl.draw_coins(dl.make_generators(unseeded), vi3.num_rows)
    assert not torch.equal(c3, c4)
    # coins are float32 uniforms below one, and stay so through every conversion the lab makes
    many, many_final = dl.draw_coins(dl.make_generators([SP(seed=s) for s in range(4)]), 50_000)
    for c in (many, many_final):
        assert float(c.max()) < 1.0 and float(c.min()) >= 0.0
        values = c.flatten().tolist()  # Python floats (decision log, JSON)
        assert max(values) < 1.0
        assert max(json.loads(json.dumps(values))) < 1.0
        assert float(torch.tensor(values, dtype=torch.float32).max()) < 1.0
        assert float(torch.tensor(values, dtype=torch.float64).float().max()) < 1.0
    # faulty conversions: a float64 uniform close to one rounds to 1.0 in float32, and the
    # largest float32 coin rounds to 1.0 in bfloat16; the verifiers refuse such a coin
    assert torch.tensor(1.0 - 2.0 ** -30, dtype=torch.float64).float().item() == 1.0
    assert torch.tensor(BELOW_ONE).bfloat16().float().item() == 1.0
    for backend in BACKENDS:
        with pytest.raises(ValueError, match=r"coins, request 0, node 0: 1.0 is not in \[0, 1\)"):
            _run(backend, vi, logits, [SP(1.0)], torch.tensor([[1.0 - 2.0 ** -30] * 5], dtype=torch.float64).float(),
                 torch.zeros(1))
        with pytest.raises(ValueError, match=r"final_coins, request 0: 1.0 is not in \[0, 1\)"):
            _run(backend, vi, logits, [SP(1.0)], torch.zeros(1, 5), torch.tensor([BELOW_ONE]).bfloat16().float())


# ---- NaN rows -----------------------------------------------------------------------------


def test_nan_in_a_drafter_row_or_a_reached_target_row_is_an_error_naming_request_node_and_row():
    draft = torch.randn(2, 3, 12)
    draft[1, 1, 4] = float("nan")
    with pytest.raises(ValueError, match="draft_logits, request 1, depth 2: NaN"):
        dl.draft_topk_from_logits(draft, k=3)
    vi, logits = _banned_case()
    vi2 = _batch([vi, vi])
    lg = logits.expand(2, -1, -1).contiguous().clone()
    lg[1, 0, 1:4] += 50.0  # request 1 surely goes past the root ...
    lg[1, 2, 5] = float("nan")  # ... and reaches node 2's row, which has a NaN
    coins, final = torch.zeros(2, 5), torch.zeros(2)
    message = "target logits, request 1, node 2: row has NaN"
    for backend in BACKENDS:
        with pytest.raises(ValueError, match=message):
            _run(backend, vi2, lg, [SP(1.0), SP(1.0)], coins, final)
        with pytest.raises(ValueError, match=message):
            verify_tree_greedy(vi2, lg.to(DEVICE) if backend == "triton" else lg, backend=backend)
    with pytest.raises(ValueError, match=message):
        dl.target_probs(lg, SP(1.0))
    probs = dl.target_probs(logits, SP(1.0)).expand(2, -1, -1).clone()
    probs[1, 0, 3] = float("nan")
    with pytest.raises(ValueError, match="target_probs, request 1, node 0: row has NaN"):
        dl.verify_sampled(vi2, probs, coins, final)
    # the good request alone verifies, and emits tokens inside [0, V)
    for backend in BACKENDS:
        out = _run(backend, vi, lg[:1].contiguous(), [SP(1.0)], coins[:1], final[:1])
        emitted = out.emitted_tokens[out.emitted_tokens >= 0]
        assert emitted.numel() >= 1 and bool(((emitted >= 0) & (emitted < lg.shape[-1])).all())
    # faulty variants: argmax of a NaN row silently returns the NaN's index as a token, and a
    # NaN probability turns every accept test false, so a walk would go on to a fallback draw
    row = torch.tensor([0.0, float("nan"), 3.0])
    assert int(row.argmax()) == 1
    assert not (0.5 < float("nan")) and not math.isnan(0.5)
