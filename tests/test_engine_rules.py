"""SGLang's sampled-verify rules end to end, draft sampling included (ddtree_lab.engines.end_to_end,
ddtree_lab.engines.sglang_rules), and the generated inventory of both engines' entry points.

The exact laws are checked first (lossless: the first emitted token's law is the target's; block
verification accepts at least as much as the token-wise rule), then each rule's audit and its
planted fault. The block-wise rejection rules are pure torch (fast loop); the DFlash 2 rules run
SGLang's chain kernel in Triton's interpreter (~65 ms a row here) and are marked slow.
"""

import re
import shutil
from pathlib import Path

import pytest

import ddtree_lab as dl
from ddtree_lab.engines import end_to_end as e2e
from ddtree_lab.engines import inventory as inv

ROOT = Path(__file__).resolve().parents[1]
SP = dl.SamplingParams


def _sglang_reason(rule):
    from ddtree_lab.engines import sglang_rules

    return sglang_rules.sglang_rules_unavailable_reason(rule)


# -- exact laws ---------------------------------------------------------------------------------

LAW_CASES = [
    e2e.random_selector_case(3, [SP(temperature=0.7), SP(temperature=0.0), SP(temperature=1.3, top_k=4, top_p=0.9)]),
    e2e.random_logits_case(4, [SP(temperature=0.6), SP(temperature=1.4)]),
    e2e.random_logits_case(5, [SP(temperature=0.9)], greedy_draft=True),
]


@pytest.mark.parametrize("case", LAW_CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("rule", e2e.RULE_LAWS)
def test_exact_laws_are_lossless_on_the_first_token_and_sum_to_one(case, rule):
    for b in range(len(case.requests)):
        law = e2e.exact_rule_law(case, b, rule)
        assert abs(sum(law.values()) - 1.0) < 1e-6
        # float32 target rows: their float64 sums are 1 within ~1e-7
        assert e2e.law_self_check(case, b, rule) < 1e-6, (case.name, b, rule)


@pytest.mark.parametrize("case", LAW_CASES, ids=lambda c: c.name)
def test_block_verification_accepts_at_least_as_much_as_token_wise(case):
    for b in range(len(case.requests)):
        mean = {r: sum(p * (len(k) - 1) for k, p in e2e.exact_rule_law(case, b, r).items()) for r in e2e.RULE_LAWS}
        assert mean["block"] >= mean["token-wise"] - 1e-9, mean
    if isinstance(case.draft, e2e.LogitsDraft) and case.draft.greedy:
        return  # one-hot q: prefix weights are 0 or 1 and the two rules coincide
    sampled = [b for b, p in enumerate(case.requests) if not p.is_greedy]
    gaps = [sum(p * (len(k) - 1) for k, p in e2e.exact_rule_law(case, b, "block").items())
            - sum(p * (len(k) - 1) for k, p in e2e.exact_rule_law(case, b, "token-wise").items()) for b in sampled]
    assert max(gaps) > 1e-3  # the laws differ, so the block audit can tell a token-wise kernel from it


def test_the_draft_law_is_the_walk_the_selector_docstring_states():
    case = e2e.random_selector_case(7, [SP(temperature=0.5)], gamma=2, vocab=5, top_k=3)
    paths = e2e.draft_paths(case, case.requests[0])
    assert abs(sum(w for w, _, _ in paths) - 1.0) < 1e-12 and len(paths) == 9
    w, tokens, q = paths[0]
    d = case.draft
    import torch

    p0 = torch.softmax(d.scores[0, 0].double() / 0.5, -1)
    assert tokens[0] == int(d.candidate_ids[0, 0]) and abs(float(q[0, tokens[0]]) - float(p0[0])) < 1e-12
    greedy = e2e.draft_paths(case, SP(temperature=0.0))
    assert len(greedy) == 1 and greedy[0][0] == 1.0 and float(greedy[0][2].max(-1).values.min()) == 1.0


def test_cases_refuse_what_they_cannot_hold():
    import torch

    with pytest.raises(ValueError, match="repeats a candidate"):
        e2e.SelectorDraft(torch.tensor([[1, 1]]), torch.zeros(1, 2, 2))
    with pytest.raises(ValueError, match=r"target_logits must be \[gamma\+1=3"):
        e2e.RuleCase("x", 0, torch.zeros(2, 4, 4), [SP()], e2e.LogitsDraft(torch.zeros(2, 4), torch.zeros(2, 4, 4)))
    with pytest.raises(ValueError, match="rule must be one of"):
        e2e.exact_rule_law(LAW_CASES[1], 0, "lossy")


# -- SGLang's block-wise rejection (torch, fast) ------------------------------------------------

DSPARK = pytest.mark.skipif(_sglang_reason("blockwise-rejection") is not None,
                            reason=f"SGLang's DSpark kernels cannot be imported here: {_sglang_reason('blockwise-rejection')}")


def _audit(rule, case, fault=None, draws=2000, seed=0):
    from ddtree_lab.engines import sglang_rules

    report = e2e.audit_rule(rule, sglang_rules.run_rule(rule, fault), case, sglang_rules.RULES[rule].law,
                            draws=draws, seed=seed)
    print(f"\n[{rule}{' + ' + fault if fault else ''}] {case.name}: {report.draws} draws, p = {report.p_value:.3g}, "
          f"{report.seconds:.1f} s")
    return report


@DSPARK
def test_blockwise_rejection_with_draft_logits_is_lossless_in_a_mixed_temperature_batch():
    case = e2e.random_logits_case(1, [SP(temperature=0.7), SP(temperature=1.3)])
    report = _audit("blockwise-rejection", case)
    assert not report.rejected, report.text()
    assert all(r.law.dof >= 10 and r.depth.dof >= 2 for r in report.reports), report.text()


@DSPARK
@pytest.mark.parametrize("fault", ["draft-temperature-1", "one-hot-q"])
def test_blockwise_rejection_faults_are_caught(fault):
    case = e2e.random_logits_case(1, [SP(temperature=0.7), SP(temperature=1.3)])
    report = _audit("blockwise-rejection", case, fault)
    assert report.rejected and report.p_value < 1e-6, report.text()


@DSPARK
def test_blockwise_rejection_with_one_hot_drafts_is_lossless_and_its_fault_is_caught():
    case = e2e.random_logits_case(2, [SP(temperature=0.8)], greedy_draft=True)
    ok = _audit("blockwise-rejection-onehot", case)
    assert not ok.rejected and ok.reports[0].law.dof >= 5, ok.text()
    bad = _audit("blockwise-rejection-onehot", case, "draft-logits-q")
    assert bad.rejected, bad.text()


@DSPARK
def test_blockwise_rules_refuse_requests_the_engine_routes_elsewhere():
    from ddtree_lab.engines import sglang_rules

    run = sglang_rules.run_rule("blockwise-rejection")
    with pytest.raises(ValueError, match="AcceptGreedy"):
        run(e2e.random_logits_case(1, [SP(temperature=0.0), SP(temperature=1.0)]), 4, 0)
    with pytest.raises(ValueError, match="top-k / top-p"):
        run(e2e.random_logits_case(1, [SP(temperature=1.0, top_k=3)]), 4, 0)
    with pytest.raises(ValueError, match="takes the faults"):
        sglang_rules.run_rule("blockwise-rejection", "q-other-slot")


# -- SGLang's DFlash 2 selector + DSpark accept (chain kernel in the interpreter: slow) ---------

MIXED = [SP(temperature=0.7, top_k=4, top_p=0.9), SP(temperature=0.0)]


@pytest.fixture
def dflash2():
    """Skips when SGLang's DFlash 2 code cannot be loaded (checked at run time: loading it runs
    its installed files, ~20-30 s, which collection of the fast loop must not pay)."""
    why = _sglang_reason("dflash2-dspark")
    if why is not None:
        pytest.skip(f"SGLang's DFlash 2 code cannot be loaded here: {why}")


@pytest.mark.slow
def test_dflash2_selector_with_dspark_accept_is_lossless_in_a_mixed_greedy_batch_with_top_k_top_p(dflash2):
    report = _audit("dflash2-dspark", e2e.random_selector_case(1, MIXED), draws=500)
    assert not report.rejected, report.text()
    assert report.reports[0].law.dof >= 5 and report.reports[1].single_outcome, report.text()


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["q-temperature-1", "q-other-slot"])
def test_dflash2_faults_are_caught(dflash2, fault):
    report = _audit("dflash2-dspark", e2e.random_selector_case(1, [SP(temperature=0.5)]), fault, draws=400)
    assert report.rejected, report.text()


@pytest.mark.slow
def test_dflash2_block_mode_matches_the_block_law_and_not_the_token_wise_kernel(dflash2):
    case = e2e.random_selector_case(1, [SP(temperature=0.7), SP(temperature=0.0)])
    ok = _audit("dflash2-dspark-block", case, draws=500)
    assert not ok.rejected, ok.text()
    bad = _audit("dflash2-dspark-block", e2e.random_selector_case(1, [SP(temperature=1.0)]), "token-wise-verify",
                 draws=800)
    assert bad.rejected, bad.text()


# -- the inventory --------------------------------------------------------------------------------


def _doc_table(engine):
    text = (ROOT / "docs" / "ENGINES.md").read_text()
    m = re.search(rf"<!-- inventory {engine} begin -->\n(.*?)\n<!-- inventory {engine} end -->", text, re.S)
    assert m, f"docs/ENGINES.md has no generated {engine} inventory block"
    return m.group(1)


@pytest.mark.skipif(inv.package_dir("sglang") is None, reason="sglang is not installed")
def test_the_sglang_inventory_finds_every_known_entry_point_and_is_the_table_in_the_docs():
    found = inv.inventory(("sglang",))
    lines = [line for e, line in found["sglang"]["entries"] if line is None]
    assert not lines
    assert _doc_table("sglang") == inv.inventory_table(found)


@pytest.mark.skipif(inv.package_dir("vllm") is None, reason="no vLLM venv: the vLLM inventory could not be checked")
def test_the_vllm_inventory_is_the_table_in_the_docs():
    assert _doc_table("vllm") == inv.inventory_table(inv.inventory(("vllm",)))


@pytest.mark.skipif(inv.package_dir("sglang") is None, reason="sglang is not installed")
def test_the_inventory_fails_on_a_new_verifier_and_on_a_lost_entry_point(tmp_path, monkeypatch):
    root = inv.package_dir("sglang")
    copy = tmp_path / "sglang"
    for rel in inv.SCAN["sglang"]:
        src = root / rel
        if src.is_dir():
            shutil.copytree(src, copy / rel, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            (copy / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src, copy / rel)
    monkeypatch.setattr(inv, "package_dir", lambda engine: copy)
    inv.inventory(("sglang",))  # the copy passes
    (copy / "kernels/ops/speculative/new_rule.py").write_text("def tree_speculative_sampling_v2(x):\n    return x\n")
    with pytest.raises(inv.InventoryError, match=r"new_rule.py:tree_speculative_sampling_v2 \(line 1\)"):
        inv.inventory(("sglang",))
    (copy / "kernels/ops/speculative/new_rule.py").unlink()
    (copy / "kernels/ops/speculative/lilicorr.py").unlink()
    with pytest.raises(inv.InventoryError, match="lilicorr.py:lilicorr_sample_path is gone"):
        inv.inventory(("sglang",))


def test_cuda_only_entry_points_are_listed_not_audited_and_named_in_the_gpu_check():
    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    gpu_doc = (ROOT / "tests" / "GPU_ONLY.md").read_text()
    cuda = [e for e in inv.ENTRY_POINTS if e.runs == "CUDA only"]
    assert cuda
    for e in cuda:
        assert e.audit.startswith("not audited here"), e
        function = e.name.split(":")[1].split(".")[0]
        assert function in gpu_doc, f"{e.name} is not in tests/GPU_ONLY.md"
    assert "test_engine_rules_gpu" in script or "tests/test_sglang_gpu.py" in script


# -- the CLI --------------------------------------------------------------------------------------


@DSPARK
def test_cli_audits_an_sglang_rule_and_exits_1_on_its_planted_fault(capsys):
    from ddtree_lab.cli import main

    assert main(["audit", "--engine", "sglang:blockwise-rejection-onehot", "--draws", "800"]) == 0
    out = capsys.readouterr().out
    assert "sglang:blockwise-rejection-onehot on logits case (seed 0, greedy draft): judged against the token-wise law" in out
    assert "consistent with lossless" in out
    assert main(["audit", "--engine", "sglang:blockwise-rejection-onehot", "--engine-fault", "draft-logits-q",
                 "--draws", "800"]) == 1
    assert "LOSSY" in capsys.readouterr().out
    assert main(["audit", "--engine", "sglang:blockwise-rejection", "--engine-fault", "q-other-slot"]) == 2
    assert "--engine sglang:blockwise-rejection takes draft-temperature-1, one-hot-q" in capsys.readouterr().err


@pytest.mark.skipif(inv.package_dir("sglang") is None, reason="sglang is not installed")
def test_cli_engine_list_prints_the_inventory_with_the_last_verdicts(capsys):
    from ddtree_lab.cli import main

    assert main(["audit", "--engine", "list", "--format", "markdown"]) == 0
    out = capsys.readouterr().out
    assert "`kernels/ops/speculative/dspark/blockwise_rejection.py:blockwise_rejection_torch`" in out
    assert "| last verdict |" in out
    verdicts = inv.last_verdicts()
    if verdicts:
        assert f"sglang:blockwise-rejection: {verdicts['sglang:blockwise-rejection']['verdict']}" in out
    else:
        assert "no verdicts yet" in out


@pytest.mark.skipif(inv.package_dir("sglang") is None, reason="sglang is not installed")
def test_cli_engine_list_is_laid_out_for_a_terminal(capsys, monkeypatch, tmp_path):
    """One block per entry point wrapped to the terminal, not a Markdown table of 300-character
    rows; without the vLLM venv, one line saying how its rules come in (issue 34.12)."""
    from ddtree_lab.cli import main

    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.setenv("DDTREE_LAB_VLLM_VENV", str(tmp_path / "no-venv"))
    assert main(["audit", "--engine", "list"]) == 0
    out = capsys.readouterr().out
    assert "| --- |" not in out, out
    assert all(len(line) <= 80 or len(line.split()) <= 2 for line in out.splitlines()), out  # a long file:function
    block = next(b for b in out.split("\n\n") if "blockwise_rejection.py:blockwise_rejection_torch" in b)
    assert block.split()[:3] == ["sglang", "kernels/ops/speculative/dspark/blockwise_rejection.py:blockwise_rejection_torch",
                                 "(line"], block
    assert "\n  role: verify; runs: CPU (torch)" in block and "\n  audit: sglang:blockwise-rejection" in block
    if inv.last_verdicts():
        assert "\n  verdict: sglang:blockwise-rejection: consistent with lossless (p = " in block
        assert "planted faults: draft-temperature-1 p = 0" in " ".join(block.split())
    vllm = [b for b in out.split("\n\n") if b.startswith("vllm")]
    said = " ".join(vllm[0].split()) if len(vllm) == 1 else vllm
    assert said.startswith(f"vllm: no rules listed (not inventoried: no vLLM venv at {tmp_path}"), said
    assert said.endswith(inv.VLLM_RULES_COME_IN)
    assert vllm[0].count("setup_vllm.sh") == 1


def test_the_docs_say_how_vllm_rules_come_in():
    """docs/ENGINES.md "How to run it" says what `audit --engine list` says without the venv."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "ENGINES.md").read_text()
    how = text[text.index("## How to run it"):text.index("## What runs")]
    assert inv.VLLM_RULES_COME_IN in " ".join(how.split())
