"""SGLang's own kernels through the engine adapter (ddtree_lab.engines.sglang), judged by the audit.

On a CPU the kernels run in Triton's interpreter (chain sampler ~10 ms a draw): the audits
here are kept to two chain cases. ``tree_speculative_sampling_target_only`` is CUDA only
(tests/GPU_ONLY.md); without CUDA the adapter refuses it with a clear error.
"""

import time

import torch


import pytest

import ddtree_lab as dl
from ddtree_lab.engines import audit_engine, random_chain_case
from ddtree_lab.engines import sglang as es

REASON = es.sglang_unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"sglang's kernels cannot be imported here: {REASON}")
TOPKP = dl.SamplingParams(temperature=0.8, top_k=5, top_p=0.9)


def _audit(make, case, **kw):
    t0 = time.time()
    report = audit_engine(make, case, seed=0, **kw)
    print(f"\n[sglang] {report.verifier} on {report.case_name}: {report.draws} draws, p = {report.p_value:.3g}, "
          f"{time.time() - t0:.1f} s")
    return report


@pytest.mark.slow
def test_chain_sampler_at_t08_with_top_k_top_p_is_lossless_and_the_fault_is_flagged():
    case = random_chain_case(2, 3, 8, TOPKP)
    ok = _audit(es.verifier("chain"), case, draws=1500)
    assert not ok.rejected and ok.law.dof >= 5, ok.text()
    bad = _audit(es.verifier("chain", fault="temperature-1"), case, draws=1500)
    assert bad.rejected and bad.p_value < 1e-6, bad.text()


@pytest.mark.slow
def test_chain_sampler_with_real_draft_probabilities_at_t13_follows_the_exact_rule():
    report = _audit(es.verifier("chain"), random_chain_case(3, 3, 8, dl.SamplingParams(temperature=1.3)),
                    draft="real", draws=1500)
    assert "real draft" in report.verifier and not report.rejected and report.law.dof >= 5, report.text()


def test_greedy_tree_kernel_on_a_branching_tree_is_lossless():
    case = dl.audit.random_case(4, 7, 6, dl.SamplingParams(temperature=0.0))
    assert any(len(k) > 1 for k in case.children().values())  # a real tree, not a chain
    report = _audit(es.verifier("auto"), case, draws=300)
    assert report.verifier == "sglang:auto" and not report.rejected, report.text()


def test_adapter_uses_the_lab_coins_coin_for_coin():
    case = random_chain_case(2, 3, 8, TOPKP)
    vi, coins, final = case.verify_input, torch.rand(1, 4), torch.rand(1)
    out = es.SGLangVerifier("chain")(vi, case.logits[None], [case.params], coins, final)
    ref = dl.verify_sampled(vi, dl.target_probs(case.logits[None], case.params), coins, final)
    assert out.emitted_tokens.tolist() == ref.emitted_tokens.tolist()


def test_adapter_refusals_name_the_problem():
    tree = dl.audit.random_case(0, 5, 8)
    with pytest.raises(ValueError, match="not a full chain"):
        es.SGLangVerifier("chain")(tree.verify_input, tree.logits[None], [tree.params], torch.rand(1, 5), torch.rand(1))
    with pytest.raises(ValueError, match="greedy requests only"):
        es.SGLangVerifier("greedy")(tree.verify_input, tree.logits[None], [tree.params], torch.rand(1, 5), torch.rand(1))
    with pytest.raises(ValueError, match="SGLang kernel must be one of"):
        es.SGLangVerifier("cuda")
    if not torch.cuda.is_available():
        assert "CUDA only" in es.sglang_unavailable_reason("target-only")
        with pytest.raises(RuntimeError, match="CUDA only"):
            es.SGLangVerifier("target-only")(tree.verify_input, tree.logits[None], [tree.params], torch.rand(1, 5),
                                             torch.rand(1))


def test_cli_audit_engine_sglang_and_its_refusals(capsys):
    from ddtree_lab.cli import EXIT_ERROR, main

    assert main(["audit", "--engine", "sglang", "--random", "1", "--nodes", "3", "--vocab", "6",
                 "--temperature", "0", "--draws", "200"]) == 0
    out = capsys.readouterr().out
    assert "engine: sglang kernel auto" in out and "sglang:auto on random chain" in out
    assert main(["audit", "--random", "1", "--draft", "real"]) == EXIT_ERROR
    assert "--draft and --engine-fault go with --engine" in capsys.readouterr().err
    assert main(["audit", "--engine", "sglang", "--random", "1", "--verifier", "triton"]) == EXIT_ERROR
    assert "leave out --verifier" in capsys.readouterr().err
