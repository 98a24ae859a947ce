"""vLLM's own RejectionSampler under the lab's audit (ddtree_lab.engines.vllm).

Needs the vLLM venv made by ``bash scripts/setup_vllm.sh`` (``.ci/run`` makes it first). Without
it the module is skipped outside CI and FAILS in CI (``CI`` set). Each audit: ~2,000 draws of a
small chain case through vLLM's sampler kernels in Triton's interpreter (~14 s each).

The second half audits vLLM's new model runner end to end (ddtree_lab.engines.vllm_rules): DFlash
2's CandidateSampler walk and rejection_sample, block verification off and on, one-hot drafts;
each rule lossless on its standard case, planted faults caught (~4-25 s each).
"""

import os
import time

import pytest
import torch

import ddtree_lab as dl
from ddtree_lab.engines import audit_engine, chain_case, random_chain_case
from ddtree_lab.engines import vllm as ev

REASON = ev.vllm_unavailable_reason()
if REASON is not None and os.environ.get("CI"):
    pytest.fail(f"the vLLM engine tests cannot run in CI: {REASON}", pytrace=False)
pytestmark = [pytest.mark.slow, pytest.mark.skipif(REASON is not None, reason=f"vLLM venv missing: {REASON}")]

DRAWS = 2000
ALPHA = 1e-3  # the audit's default level
TOPKP = dl.SamplingParams(temperature=0.8, top_k=5, top_p=0.9)


@pytest.fixture(scope="module")
def worker():
    w = ev.VLLMWorker()
    print(f"\n[vllm] worker up: vllm {w.version}, route {w.route}, import {w.import_seconds} s")
    yield w
    w.close()


def _audit(worker, case, draft="target-only", fault=None):
    t0 = time.time()
    report = audit_engine(ev.verifier(worker, fault), case, draft=draft, draws=DRAWS, seed=0, alpha=ALPHA)
    print(f"\n[vllm] {report.verifier} on {report.case_name}: {DRAWS} draws, p = {report.p_value:.3g}, "
          f"{time.time() - t0:.1f} s")
    return report


def test_target_only_rule_at_t08_with_top_k_top_p_is_lossless(worker):
    report = _audit(worker, random_chain_case(2, 3, 8, TOPKP))
    assert report.kind == "sequence" and report.draws == DRAWS
    assert not report.rejected, report.text()
    assert report.law.dof >= 5  # enough cells for the test to mean something


def test_real_draft_probabilities_at_t08_with_top_k_top_p_follow_the_exact_rule(worker):
    report = _audit(worker, random_chain_case(2, 3, 8, TOPKP), draft="real")
    assert "real draft" in report.verifier and not report.rejected and report.law.dof >= 5, report.text()


def test_target_only_rule_at_t13_is_lossless(worker):
    report = _audit(worker, random_chain_case(3, 3, 8, dl.SamplingParams(temperature=1.3)))
    assert not report.rejected and report.law.dof >= 5, report.text()


def test_greedy_path_is_lossless(worker):
    report = _audit(worker, random_chain_case(3, 3, 8, dl.SamplingParams(temperature=0.0)))
    assert not report.rejected, report.text()
    assert len(report.law.cells) == 1  # greedy: one outcome, every draw


def test_planted_fault_temperature_forced_to_one_is_flagged(worker):
    report = _audit(worker, random_chain_case(2, 3, 8, TOPKP), fault="temperature-1")
    assert report.rejected and report.p_value < 1e-6, report.text()


def test_seeds_from_the_lab_coins_make_vllm_reproducible_and_distinct(worker):
    case = random_chain_case(3, 3, 8, dl.SamplingParams(temperature=1.0))
    vi, logits = case.verify_input, case.logits[None]
    p = [case.params] * 64
    seeds = torch.arange(64) * 7919
    a = worker.sample(logits, vi.node_token_ids[:, 1:], p, seeds, broadcast=True)
    b = worker.sample(logits, vi.node_token_ids[:, 1:], p, seeds, broadcast=True)
    assert torch.equal(a, b)
    assert len({tuple(r) for r in a.tolist()}) > 1  # different seeds, different draws


def test_adapter_refuses_what_vllm_does_not_do(worker):
    v = ev.VLLMVerifier(worker)
    tree = dl.audit.random_case(0, 5, 8)  # a branching tree
    coins, final = torch.rand(1, 5), torch.rand(1)
    with pytest.raises(ValueError, match="not a full chain"):
        v(tree.verify_input, tree.logits[None], [tree.params], coins, final)
    chain = chain_case(torch.tensor([1, 2, 3]), torch.randn(3, 8), dl.SamplingParams(temperature=1.0, min_p=0.1))
    with pytest.raises(ValueError, match="min-p"):
        v(chain.verify_input, chain.logits[None], [chain.params], torch.rand(1, 3), final)
    with pytest.raises(ValueError, match="unknown engine fault"):
        ev.VLLMVerifier(worker, fault="nope")
    with pytest.raises(RuntimeError, match=r"vLLM's sampler failed: .*logits must be \[R, K\+1=3, V\]"):
        worker.sample(torch.randn(1, 4, 8), torch.tensor([[1, 2]]), [dl.SamplingParams()] * 2, torch.arange(2),
                      broadcast=True)
    assert worker.sample(chain.logits[None], chain.verify_input.node_token_ids[:, 1:], [dl.SamplingParams()],
                         torch.tensor([5]), broadcast=True).shape == (1, 3)  # the worker still answers


# -- the new model runner's rules end to end (ddtree_lab.engines.vllm_rules) -----------------------
# DFlash 2's CandidateSampler walk and rejection_sample run in Triton's interpreter in the worker
# (~0.05-0.1 s a row here), so these audits use a few hundred draws per request.

RULE_DRAWS = 200
FAULT_DRAWS = 100


def _rule_audit(worker, rule, fault=None, draws=RULE_DRAWS):
    from ddtree_lab.engines import end_to_end as e2e
    from ddtree_lab.engines import vllm_rules as vr

    case = vr.standard_case(rule, 0, fault)
    report = e2e.audit_rule(f"vllm:{rule}", vr.run_rule(rule, worker, fault), case, vr.RULES[rule].law,
                            draws=draws, seed=0, alpha=ALPHA)
    print(f"\n[vllm:{rule}{' + ' + fault if fault else ''}] {case.name}: {report.draws} draws, "
          f"p = {report.p_value:.3g}, {report.seconds:.1f} s")
    return report


@pytest.mark.parametrize("rule", ["dflash2", "dflash2-block", "onehot", "onehot-block"])
def test_new_runner_rule_end_to_end_is_lossless(worker, rule):
    report = _rule_audit(worker, rule)
    assert not report.rejected, report.text()
    from ddtree_lab.engines import vllm_rules as vr

    sampled = [r for r, p in zip(report.reports, vr.standard_case(rule, 0).requests) if not p.is_greedy]
    # enough cells to mean something; the accept length has >= 2 cells (deeper ones pool as rare at these draws)
    assert sampled and all(r.law.dof >= 5 and r.depth.dof >= 1 for r in sampled), report.text()


@pytest.mark.parametrize("rule, fault", [("dflash2", "q-temperature-1"), ("dflash2", "q-other-slot"),
                                         ("dflash2-block", "token-wise-verify"), ("onehot", "draft-logits-q")])
def test_new_runner_planted_fault_is_caught(worker, rule, fault):
    # token-wise vs block: the same first-token law, so the gap is in the accept length and rarer tails
    report = _rule_audit(worker, rule, fault, 300 if fault == "token-wise-verify" else FAULT_DRAWS)
    assert report.rejected and report.p_value < 1e-6, report.text()


def test_new_runner_worker_names_what_it_ran_and_refuses_what_the_rule_does_not_take(worker):
    from ddtree_lab.engines import vllm_rules as vr
    from ddtree_lab.engines.end_to_end import SelectorDraft

    case = vr.standard_case("dflash2", 0)
    assert isinstance(case.draft, SelectorDraft)
    t = {"target_logits": case.target_logits, "root": torch.tensor([case.root_token]),
         "candidate_ids": case.draft.candidate_ids, "scores": case.draft.scores}
    out = worker.rule("dflash2", False, t, [dl.SamplingParams(temperature=0.7)] * 4, seed=3)
    n, drafts = out["num_sampled"], out["draft_tokens"]
    assert out["sampled"].shape == (4, 4) and bool(((n >= 1) & (n <= 4)).all())
    ids = case.draft.candidate_ids
    assert all(int(drafts[r, e]) in ids[e].tolist() for r in range(4) for e in range(3))  # the walk picks candidates
    for r in range(4):  # the accepted prefix is the drafted one
        assert out["sampled"][r, : int(n[r]) - 1].tolist() == drafts[r, : int(n[r]) - 1].tolist()
    about = out["about"]
    assert about["skipped"] and all("DFlash" in s for s in about["skipped"]), about  # only the speculator classes
    assert any("log1p" in s for s in about["shims"]), about
    greedy = vr.standard_case("dflash2", 0)
    greedy.requests = [dl.SamplingParams(temperature=0.0)]
    with pytest.raises(ValueError, match="every request is greedy"):
        vr.run_rule("dflash2", worker)(greedy, 2, 0)
    with pytest.raises(ValueError, match="takes the faults"):
        vr.run_rule("onehot", worker, "q-other-slot")
    with pytest.raises(RuntimeError, match="unknown fault"):
        worker.rule("dflash2", False, t, [dl.SamplingParams(temperature=0.7)], seed=0, fault="nope")


def test_cli_audits_a_vllm_rule_and_exits_1_on_its_planted_fault(capsys):
    from ddtree_lab.cli import main

    assert main(["audit", "--engine", "vllm:onehot", "--engine-fault", "draft-logits-q", "--draws", "100"]) == 1
    out = capsys.readouterr().out
    assert "vllm:onehot + draft-logits-q" in out and "LOSSY" in out
    assert main(["audit", "--engine", "vllm:onehot", "--engine-fault", "q-other-slot"]) == 2  # not this rule's fault
