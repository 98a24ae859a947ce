"""GPU-only: the lab against SGLang's CUDA kernels (tests/GPU_ONLY.md). Skipped without CUDA."""

import pytest
import torch

import ddtree_lab as dl
from ddtree_lab.sglang import buffers as sb
from ddtree_lab.sglang import kernels as sk
from ddtree_lab.sglang.buffers import TreeMaskMode
from ddtree_lab.replaying import compare_outputs


def _cuda_reason():
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    reason = sk.sglang_unavailable_reason()
    if reason is not None:
        return f"sglang's kernels cannot be imported: {reason}"
    if sk.sglang_kernels()["tree_speculative_sampling_target_only"] is None:
        return "sglang's CUDA tree_speculative_sampling_target_only is not importable"
    return None


REASON = _cuda_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"GPU only: {REASON}")


@pytest.mark.parametrize("backend", sorted(sk.lab_verifiers()))
@pytest.mark.parametrize("seed", range(40))
def test_lab_sampled_equals_sglang_cuda_target_only_on_full_trees(seed, backend):
    bs, vocab, depth = 4, 512, 6
    g = torch.Generator().manual_seed(seed)
    ids, lp = dl.draft_topk_from_logits(torch.randn(bs, depth, vocab, generator=g) * 3, k=8)
    tree = dl.build_tree(ids, lp, torch.randint(0, vocab, (bs,), generator=g), 16 + seed % 48)
    vi = dl.compile_retrieve(tree, 10)
    logits = torch.randn(bs, vi.num_rows, vocab, generator=g)
    for b in range(bs):
        for i in range(1, int(tree.num_nodes[b])):
            logits[b, int(tree.parents[b, i]), int(tree.node_token_ids[b, i])] += 4.0 * float(torch.rand(1, generator=g))
    params = [dl.SamplingParams(1.0), dl.SamplingParams(0.7, top_k=20), dl.SamplingParams(1.2, top_p=0.9),
              dl.SamplingParams(0.0)][seed % 4]
    probs = dl.target_probs(logits, params, vi.num_nodes)
    coins, final = torch.rand(bs, vi.num_rows, generator=g), torch.rand(bs, generator=g)
    lab = sk.lab_verifiers()[backend][1](vi, probs, coins, final)
    sgl = sk.sglang_verify_target_only(vi, probs, coins, final)
    assert not lab.support_exhausted.any()
    assert compare_outputs(lab, sgl.output, decisions=False) == []


@pytest.mark.parametrize("seed", range(4))
def test_lab_bitpacked_mask_equals_sglangs_cuda_tree_builder(seed):
    from sglang.kernels.ops.speculative.tree import build_tree_kernel_efficient

    g = torch.Generator().manual_seed(seed)
    bs = 2
    ids, lp = dl.draft_topk_from_logits(torch.randn(bs, 4, 50, generator=g), k=3)
    tree = dl.build_tree(ids, lp, torch.randint(0, 50, (bs,), generator=g), 7 + 6 * seed)
    vi = dl.compile_retrieve(tree, torch.tensor([5, 9]))
    want = sb.to_sglang_buffers(vi, TreeMaskMode.QLEN_ONLY_BITPACKING)
    parent_list, selected, topk, depth = sb.eagle_tree_inputs(vi)
    n = vi.num_rows
    mask = torch.zeros_like(want.tree_mask, device="cuda")
    ri, nt, ns = (torch.full((bs, n), -1, dtype=torch.int64, device="cuda") for _ in range(3))
    positions = torch.empty(bs * n, dtype=torch.int64, device="cuda")
    build_tree_kernel_efficient(parent_list.cuda(), selected.cuda(), want.seq_lens.cuda(), mask, positions, ri, nt, ns,
                                topk, depth, n, int(TreeMaskMode.QLEN_ONLY_BITPACKING))
    assert torch.equal(mask.cpu(), want.tree_mask)
    assert torch.equal(positions.cpu(), want.positions)
    assert torch.equal(nt.cpu(), want.retrive_next_token) and torch.equal(ns.cpu(), want.retrive_next_sibling)


# -- SGLang's sampled-verify rules end to end on their CUDA paths (ddtree_lab.engines.sglang_rules) --
# On CUDA tensors SGLang dispatches to selector_walk_triton, accept_sampling_triton,
# MarkovSampleStep.triton and blockwise_rejection_triton: the CPU audits (tests/test_engine_rules.py)
# cover only their torch / interpreted twins, so these are listed "not audited here" until run.

RULE_CASES = [("dflash2-dspark", None), ("dflash2-dspark", "q-temperature-1"), ("dflash2-dspark-block", None),
              ("dflash2-dspark-block", "token-wise-verify"), ("blockwise-rejection", None),
              ("blockwise-rejection", "one-hot-q"), ("blockwise-rejection-onehot", None),
              ("blockwise-rejection-onehot", "draft-logits-q")]


@pytest.mark.parametrize("rule,fault", RULE_CASES)
def test_sglang_rules_on_their_cuda_kernels_are_lossless_and_catch_their_faults(rule, fault):
    from ddtree_lab.engines import end_to_end as e2e
    from ddtree_lab.engines import sglang_rules as sr

    why = sr.sglang_rules_unavailable_reason(rule)
    if why is not None:
        pytest.skip(f"SGLang's rule {rule} cannot be loaded: {why}")
    report = e2e.audit_rule(rule, sr.run_rule(rule, fault, device="cuda"), sr.standard_case(rule, 0, fault),
                            sr.RULES[rule].law, draws=4000, seed=0)
    print(report.text())
    assert report.rejected == (fault is not None), report.text()
