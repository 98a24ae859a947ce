"""Differential tests: the lab's verifiers against SGLang's own kernels.

On a CPU, SGLang's Triton kernels run under ``TRITON_INTERPRET=1`` (``sglang_kernels()`` sets
it): ``spec_tree.verify_tree_greedy_triton`` (greedy tree verify),
``spec_tree.sgl_build_tree_kernel_triton`` (tree buffers and masks) and
``reject_sampling.chain_speculative_sampling_triton`` (chain rejection sampler; with one-hot
draft probabilities it is the target-only rule on a chain). SGLang's sampled *tree* verifier
``tree_speculative_sampling_target_only`` is CUDA only: its test needs a GPU
(tests/GPU_ONLY.md). Every lab backend in ``lab_verifiers()`` is tested: reference,
torch-lazy and Triton (under the interpreter on a CPU, natively on a GPU).

Differences by design are named by the tests that show them:
``test_by_design_empty_residual_*`` and ``test_by_design_sglang_stops_at_num_speculative_tokens``.
"""

from pathlib import Path

import torch


import pytest

import ddtree_lab as dl
from ddtree_lab.sglang import buffers as sb
from ddtree_lab.sglang import kernels as sk
from ddtree_lab.sglang.buffers import TreeMaskMode
from ddtree_lab.replaying import compare_outputs

REASON = sk.sglang_unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"sglang's kernels cannot be imported here: {REASON}")
BACKENDS = sorted(sk.lab_verifiers())


def test_every_lab_backend_is_compared():
    assert {"reference", "torch-lazy", "triton"} <= set(BACKENDS)


def _tree(seed, bs, vocab, depth, k, budget):
    g = torch.Generator().manual_seed(seed)
    ids, lp = dl.draft_topk_from_logits(torch.randn(bs, depth, vocab, generator=g) * 2, k=k)
    tree = dl.build_tree(ids, lp, torch.randint(0, vocab, (bs,), generator=g), budget)
    return tree, dl.compile_retrieve(tree, torch.randint(0, 20, (bs,), generator=g)), g


def _plant(logits, tree, g, rate, boost):
    """Raise the logit of drafted tokens under their parent so that paths get accepted."""
    for b in range(tree.batch_size):
        for i in range(1, int(tree.num_nodes[b])):
            if torch.rand(1, generator=g) < rate:
                logits[b, int(tree.parents[b, i]), int(tree.node_token_ids[b, i])] += boost
    return logits


def test_published_greedy_example_runs_on_sglangs_triton_kernel():
    kernel = sk.sglang_kernels()["verify_tree_greedy_triton"]
    predicts = torch.full((12,), -1, dtype=torch.int32)
    accept_index = torch.full((2, 4), -1, dtype=torch.int32)
    accept_num = torch.zeros(2, dtype=torch.int32)
    kernel(predicts, accept_index, accept_num, torch.tensor([[0, 1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12]]),
           torch.arange(12).view(2, 6), torch.tensor([[1, 2, -1, 4, 5, -1], [4, 2, 3, -1, 5, -1]]),
           torch.tensor([[-1, 3, -1, -1, -1, -1], [-1, -1, -1, -1, 1, -1]]),
           torch.tensor([3, 3, 3, 4, 5, 18, 11, 11, 11, 11, 12, 18]).view(2, 6))
    assert predicts.tolist() == [3, -1, -1, 4, 5, 18, 11, -1, -1, -1, 12, 18]
    assert accept_index.tolist() == [[0, 3, 4, 5], [6, 10, 11, -1]]
    assert accept_num.tolist() == [3, 2]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", range(60))
def test_lab_greedy_equals_sglang_greedy_tree_kernel_field_for_field(seed, backend):
    bs, vocab = 1 + seed % 4, 6 + seed % 7
    tree, vi, g = _tree(seed, bs, vocab, depth=2 + seed % 5, k=1 + seed % 4, budget=3 + 2 * seed % 17)
    logits = _plant(torch.randn(bs, vi.num_rows, vocab, generator=g), tree, g, 0.6, 5.0)
    lab = sk.lab_verifiers()[backend][0](vi, logits)
    sgl = sk.sglang_verify_greedy(vi, logits)
    assert compare_outputs(lab, sgl.output, decisions=False) == []
    # and the raw SGLang arrays: accept_index (global rows), accept_token_num, predicts on the path
    s = sgl.accept_index.shape[1]
    predicts, accept_index, accept_num = sb.verify_output_to_sglang(lab, vi.num_rows, s)
    assert torch.equal(accept_index, sgl.accept_index)
    assert torch.equal(accept_num, sgl.accept_token_num)
    rows = accept_index[accept_index >= 0].long()
    assert torch.equal(predicts[rows], sgl.predicts[rows])


@pytest.mark.parametrize("mode", [TreeMaskMode.FULL_MASK, TreeMaskMode.QLEN_ONLY])
@pytest.mark.parametrize("seed", range(6))
def test_lab_buffers_equal_what_sglangs_tree_builder_writes(seed, mode):
    bs = 1 + seed % 3
    _, vi, _ = _tree(seed, bs, 30, depth=3 + seed % 3, k=3, budget=4 + 3 * seed)
    assert (vi.num_nodes == vi.num_rows).all()  # SGLang's builder has no padding rows
    got = sk.sglang_build_tree(vi, mode)
    want = sb.to_sglang_buffers(vi, mode)
    for name in ("retrive_index", "retrive_next_token", "retrive_next_sibling", "positions", "tree_mask"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name


def _chain(seed, bs, vocab, length, params, plant_rate=0.7):
    g = torch.Generator().manual_seed(seed)
    ids, lp = dl.draft_topk_from_logits(torch.randn(bs, length - 1, vocab, generator=g) * 2, k=1)
    tree = dl.build_tree(ids, lp, torch.randint(0, vocab, (bs,), generator=g), length - 1)
    vi = dl.compile_retrieve(tree, 3)
    logits = _plant(torch.randn(bs, length, vocab, generator=g), tree, g, plant_rate, 3.0)
    probs = dl.target_probs(logits, params)
    coins, final = torch.rand(bs, length, generator=g), torch.rand(bs, generator=g)
    return vi, probs, coins, final


PARAMS = [dl.SamplingParams(1.0), dl.SamplingParams(0.7, top_k=5), dl.SamplingParams(1.3, top_p=0.8),
          dl.SamplingParams(0.9, top_k=8, top_p=0.9), dl.SamplingParams(0.0)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", range(40))
def test_lab_sampled_equals_sglang_chain_sampler_with_one_hot_draft_probs(seed, backend):
    params = PARAMS[seed % len(PARAMS)]
    vi, probs, coins, final = _chain(seed, bs=1 + seed % 4, vocab=24 + seed, length=3 + seed % 6, params=params)
    lab = sk.lab_verifiers()[backend][1](vi, probs, coins, final)
    sgl = sk.sglang_verify_chain(vi, probs, coins, final)
    assert not lab.support_exhausted.any()
    assert compare_outputs(lab, sgl.output, decisions=False) == []


def test_chain_comparison_accepts_and_rejects_at_every_depth():
    """The random chains above are not all-reject or all-accept: both verdicts occur at several depths."""
    lengths = []
    for seed in range(25):
        params = PARAMS[seed % len(PARAMS)]
        vi, probs, coins, final = _chain(seed, bs=1 + seed % 4, vocab=24 + seed, length=3 + seed % 6, params=params)
        lengths += dl.verify_sampled(vi, probs, coins, final).accept_length.tolist()
    assert min(lengths) == 0 and max(lengths) >= 4 and len(set(lengths)) >= 4


def _fixed_chain(p_first, coin, vocab=8):
    """Chain root -> node 1 (token 2) -> node 2 (token 5); row 0 gives token 2 mass ``p_first``."""
    vi = sb.verify_input_from_retrieve(torch.tensor([[1, 2, 5]]), torch.tensor([[1, 2, -1]]), torch.tensor([[-1, -1, -1]]))
    probs = torch.full((1, 3, vocab), 1.0 / vocab)
    probs[0, 0] = torch.tensor([(1.0 - p_first) / (vocab - 1)] * vocab)
    probs[0, 0, 2] = p_first
    coins = torch.tensor([[coin, 0.5, 0.5]], dtype=torch.float32)
    return vi, probs.float(), coins, torch.tensor([0.3])


def test_coin_equal_to_target_mass_rejects_in_both_strict_less_than():
    vi, probs, coins, final = _fixed_chain(0.5, 0.5)  # exactly representable: u == S_1
    lab, sgl = dl.verify_sampled(vi, probs, coins, final), sk.sglang_verify_chain(vi, probs, coins, final)
    assert lab.accept_length.tolist() == sgl.output.accept_length.tolist() == [0]
    below = float(torch.nextafter(torch.tensor(0.5), torch.tensor(0.0)))  # float32 just below 0.5
    vi, probs, coins, final = _fixed_chain(0.5, below)
    lab, sgl = dl.verify_sampled(vi, probs, coins, final), sk.sglang_verify_chain(vi, probs, coins, final)
    assert lab.accept_length.tolist() == sgl.output.accept_length.tolist() == [1]


def test_zero_target_probability_is_never_accepted_in_both_even_with_coin_zero():
    vi, probs, coins, final = _fixed_chain(0.0, 0.0)
    lab, sgl = dl.verify_sampled(vi, probs, coins, final), sk.sglang_verify_chain(vi, probs, coins, final)
    assert lab.accept_length.tolist() == sgl.output.accept_length.tolist() == [0]
    assert compare_outputs(lab, sgl.output, decisions=False) == []


def test_by_design_full_row_sglang_chain_rejects_and_emits_v_minus_1_lab_follows_exact_arithmetic():
    """Row 0 puts all its (float32) mass on the drafted token, 1 - 2**-24 < 1; the coin equals it.
    SGLang's float comparison rejects the token and draws from an empty residual; in exact
    arithmetic the token holds the whole row (S = 1 > u), so the lab accepts it (ddtree_lab.verify,
    "Floating-point edge") and never emits a zero-probability token."""
    vocab = 8
    p = 1.0 - 2.0 ** -24
    vi, probs, coins, final = _fixed_chain(p, p, vocab)
    probs[0, 0] = 0.0
    probs[0, 0, 2] = p
    lab, sgl = dl.verify_sampled(vi, probs, coins, final), sk.sglang_verify_chain(vi, probs, coins, final)
    assert sgl.output.accept_length.tolist() == [0] and lab.accept_length.tolist() == [1]
    assert lab.decisions[0][0].verdict == "accept" and lab.decisions[0][0].cumulative_mass == 1.0
    assert sgl.output.bonus_token.tolist() == [vocab - 1]  # a token the target gives probability 0
    assert float(probs[0, 0, vocab - 1]) == 0.0
    assert not bool(lab.support_exhausted[0])


def test_by_design_sglang_stops_at_num_speculative_tokens():
    """SGLang walks at most S-1 accepted tokens (``accept_index`` width S); the lab walks to the leaf."""
    tree, vi, g = _tree(3, 1, 10, depth=5, k=1, budget=5)
    logits = _plant(torch.randn(1, vi.num_rows, 10, generator=g), tree, g, 1.0, 50.0)  # accept everything
    lab = dl.verify_greedy(vi, logits)
    assert int(lab.accept_length[0]) == 5
    sgl = sk.sglang_verify_greedy(vi, logits, num_speculative_tokens=3)
    assert int(sgl.output.accept_length[0]) == 2
    assert int(sgl.output.bonus_token[0]) == int(vi.node_token_ids[0, 3])  # the target's argmax after node 2


def test_sglang_cuda_target_only_rule_is_strict_and_guards_zero_mass():
    """The sglang 0.5.23 wheel's JIT CUDA kernel uses the lab's lossless rule: ``coin < S_k /
    threshold_acc`` and ``p > 0``. (sgl-kernel's CUDA kernel and its ports compare ``<=``
    without the guard; the lab follows that rule at lossy thresholds, ddtree_lab.verify.) Runs
    the kernel on a GPU: see test_sglang_gpu.py."""
    import sglang

    src = Path(sglang.__file__).parent / "kernels/jit/include/sgl_kernel/speculative/sampling.cuh"
    if not src.exists():
        pytest.skip(f"{src} not in this sglang wheel")
    text = src.read_text()
    assert "coin < prob_acc / threshold_acc" in text
    assert "target_prob_single > DType(0)" in text
