"""diagnose: each planted fault kind caught and named from a short live run; each clean configuration silent."""

import dataclasses

import pytest
import torch

import ddtree_lab as dl
from ddtree_lab.diagnosis.coins import coins_step
from ddtree_lab.diagnosis.sampling import prob_interval
from ddtree_lab.faults import (COMMIT_FAULTS, DRAFTER_FAULTS, FAULT_KINDS, FORWARD_FAULTS, NO_FAULTS,
                               SAMPLING_FAULTS, VERIFIER_FAULTS, Faults, forward_input)

PROMPTS = ["Tell me about lighthouses.", "What is two plus two?"]
SAMPLED = dl.SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=1)
#: A fault that drops a filter shows only where the request uses it.
KIND_SAMPLING = {"sampling-min-p-dropped": dl.SamplingParams(temperature=1.2, top_k=40, min_p=0.1, seed=1),
                 # ' a', ' of', ' that': frequent in the two prompts' answers
                 "sampling-banned-token-kept": dataclasses.replace(SAMPLED, banned_token_ids=(253, 282, 338))}


def live(target, drafter, faults=None, sampling=SAMPLED, tokens=16, record="full", prompts=PROMPTS, budget=12):
    run = dl.LiveSession(target, drafter, budget=budget, sampling=sampling, faults=faults, record=record).run(
        prompts, max_new_tokens=tokens)
    assert run.metadata.pop("planted_faults", None) == (list(Faults(faults).names) if faults else None)
    return run


# -- the switches -----------------------------------------------------------------------------


def test_faults_are_off_by_default_and_validated():
    assert not NO_FAULTS and Faults("mask-parent-only").names == ("mask-parent-only",)
    with pytest.raises(ValueError, match="unknown fault"):
        Faults("mask-typo")
    with pytest.raises(ValueError, match="same stage"):
        Faults("mask-parent-only", "positions-no-depth")
    import inspect

    assert inspect.signature(dl.LiveSession).parameters["faults"].default is None


def test_forward_faults_change_the_mask_or_positions_only():
    tree = dl.DDTreeBuildResult(node_token_ids=torch.tensor([[5, 6, 7, 8]]), parents=torch.tensor([[-1, 0, 0, 1]]),
                                depths=torch.tensor([[0, 1, 1, 2]]), ranks=torch.tensor([[-1, 0, 1, 0]]),
                                node_logws=torch.tensor([[0.0, -0.1, -0.5, -0.3]]), num_nodes=torch.tensor([4]))
    vi = dl.compile_retrieve(tree, 10)
    parent_only = forward_input(vi, tree.parents, "mask-parent-only").tree_mask[0]
    assert parent_only[3].tolist() == [False, True, False, True] and vi.tree_mask[0, 3].tolist() == [True, True, False, True]
    assert forward_input(vi, tree.parents, "mask-siblings-visible").tree_mask[0, 2].tolist() == [True, True, True, False]
    assert forward_input(vi, tree.parents, "mask-ancestors-hidden").tree_mask[0].equal(torch.eye(4, dtype=torch.bool))
    assert forward_input(vi, tree.parents, "positions-node-index").positions[0].tolist() == [10, 11, 12, 13]
    assert forward_input(vi, tree.parents, "positions-no-depth").positions[0].tolist() == [10] * 4
    assert vi.positions[0].tolist() == [10, 11, 11, 12]


# -- the checks on their own ---------------------------------------------------------------------


@pytest.mark.parametrize("params", [dl.SamplingParams(temperature=0.8), dl.SamplingParams(temperature=1.0, top_p=0.9),
                                    dl.SamplingParams(temperature=0.7, top_k=20, top_p=0.8),
                                    dl.SamplingParams(temperature=1.3, top_k=30, order="top_p_then_top_k", top_p=0.7),
                                    dl.SamplingParams(temperature=0.9, min_p=0.1)])
def test_prob_interval_holds_the_exact_probability(params):
    g = torch.Generator().manual_seed(3)
    vocab, m = 300, 64
    separated = 0
    for _ in range(20):
        logits = torch.randn(vocab, generator=g) * 3
        exact = dl.target_probs(logits[None, None], params)[0, 0]
        top = logits.topk(m)
        lse = float(torch.logsumexp(logits.double(), 0))
        for token in top.indices[:40].tolist():
            iv = prob_interval(top.indices, top.values, lse, token, params, vocab)
            if iv is not None:
                lo, hi = iv
                assert lo - 2e-6 <= float(exact[token]) <= hi + 2e-6, (token, iv, float(exact[token]))
        # tight enough to tell another temperature apart on some top token
        other = dataclasses.replace(params, temperature=params.temperature * 0.6)
        ivs = [(t, prob_interval(top.indices, top.values, lse, t, other, vocab)) for t in top.indices[:5].tolist()]
        separated += any(iv is not None and not iv[0] - 1e-4 <= float(exact[t]) <= iv[1] + 1e-4 for t, iv in ivs)
    assert separated >= 5


def test_coin_invariant_names_a_reused_final_coin(target, drafter):
    run = live(target, drafter, tokens=8, prompts=PROMPTS[:1])
    s = run.steps[0]
    assert coins_step(s) == []
    bad = s.replace(final_coin=float(s.coins[0]))
    assert [k[1] for k in coins_step(bad)] == ["verifier-final-coin-reuse"]


# -- each kind caught and named; clean runs silent ---------------------------------------------------


@pytest.mark.parametrize("kind", list(SAMPLING_FAULTS) + list(VERIFIER_FAULTS))
def test_recorded_data_names_the_fault(target, drafter, kind):
    run = live(target, drafter, [kind], sampling=KIND_SAMPLING.get(kind, SAMPLED))
    d = dl.diagnose(run)
    assert kind in d.faults, d.text()
    assert d.faults == {kind}, d.text()


@pytest.mark.parametrize("kind", list(FORWARD_FAULTS) + list(COMMIT_FAULTS) + list(DRAFTER_FAULTS))
def test_the_model_names_the_fault(target, drafter, kind):
    run = live(target, drafter, [kind], tokens=12)
    d = dl.diagnose(run, model=(target, drafter), confirm=False)
    assert d.faults == {kind}, d.text()
    assert not dl.diagnose(run).faults & {kind}  # without a model it cannot be named


@pytest.mark.parametrize("sampling", [dl.SamplingParams(temperature=0.0), SAMPLED,
                                      [dl.SamplingParams(temperature=0.0), dl.SamplingParams(temperature=0.8, seed=4)],
                                      [dl.SamplingParams(temperature=0.0, banned_token_ids=(253, 282, 338)),
                                       KIND_SAMPLING["sampling-banned-token-kept"]]],
                         ids=["greedy", "T=0.8 filtered", "mixed batch", "bans"])
def test_clean_runs_are_silent(target, drafter, sampling):
    run = live(target, drafter, None, sampling=sampling)
    d = dl.diagnose(run, model=(target, drafter))
    assert not d.findings, d.text()
    ran = {r.check for r in d.results if r.ran}
    assert {"record", "verifier", "coins", "tree-forward", "drafter"} <= ran


def test_a_check_that_cannot_run_says_so(target, drafter):
    run = live(target, drafter, None, record="light", tokens=8)
    d = dl.diagnose(run)
    why = {r.check: r.why for r in d.results if not r.ran}
    assert "sampling" in why and "level full" in why["sampling"] and "tree-forward" in why
    assert "could not run sampling" in d.text()


def test_cli_exit_status(target, drafter, tmp_path, capsys):
    from ddtree_lab.cli import main

    clean, bad = tmp_path / "clean.ddtrace.safetensors", tmp_path / "bad.ddtrace.safetensors"
    dl.save_trace(live(target, drafter, None, tokens=8), clean)
    dl.save_trace(live(target, drafter, ["sampling-temperature-1"], tokens=12), bad)
    assert main(["diagnose", str(clean)]) == 0
    assert main(["diagnose", str(bad)]) == 1
    out = capsys.readouterr().out
    assert "FINDING sampling" in out and "temperature 1" in out and f"render {bad}" in out
    assert main(["diagnose", str(tmp_path / "missing")]) == 2
    assert main(["diagnose", str(clean), "--step", "999", "--request", "0"]) == 2
    assert sorted(FAULT_KINDS) == sorted({**FORWARD_FAULTS, **COMMIT_FAULTS, **DRAFTER_FAULTS, **SAMPLING_FAULTS,
                                          **VERIFIER_FAULTS})


# -- the output law (statistical, no coins read) and the spine --------------------------------------


def synthetic_run(faults=None, steps=25, seed=0):
    from ddtree_lab.io.synthetic import SyntheticShape, synthetic_steps

    shape = SyntheticShape(requests=4, budget=16, vocab=200, level="light", temperature=1.0)
    return dl.Run({"vocab_size": 200}, [s for k in range(steps) for s in synthetic_steps(shape, seed, k, faults=faults)])


def test_the_output_law_holds_on_clean_runs_and_fixtures():
    from ddtree_lab.diagnosis.law import check_law

    for seed in range(4):
        r = check_law(synthetic_run(seed=seed))
        assert r.ran and r.checked == 100 and not r.findings, r.note
        assert r.note.count("p = ") == 4  # all four tests ran
    r = check_law(dl.load("fixtures/traces/smollm2_t08_b32.ddtrace.safetensors"))
    assert r.ran and r.checked == 122 and not r.findings and r.note.count("p = ") >= 3
    r = check_law(dl.load("fixtures/sglang_cpu_recording.json"))  # 5 sampled steps (+1 by design): too few, and says so
    assert r.ran and r.checked == 5 and "not enough draws" in r.not_run and "not run: the walk" in r.line()
    assert "1 step(s) whose engine output differs by design" in r.note
    greedy = check_law(dl.load("fixtures/traces/smollm2_greedy_b32.ddtrace.safetensors"))
    assert not greedy.ran and "sampled" in greedy.why


@pytest.mark.parametrize("kind,test", [("verifier-p-over-q", "accepts"), ("verifier-threshold", "accepts"),
                                       ("verifier-bonus-row", "probability 0"),
                                       ("verifier-final-coin-reuse", "rejected every child")])
def test_the_output_law_flags_a_verifier_fault_without_its_coins(kind, test):
    from ddtree_lab.diagnosis.law import check_law

    run = synthetic_run([kind], steps=50)
    blind = dataclasses.replace(run, steps=[s.replace(coins=torch.rand(s.num_nodes), final_coin=0.5) for s in run.steps])
    r = check_law(blind)  # the coins are not the ones used: the law check never reads them
    assert any(test in f.kind or test in f.evidence for f in r.findings), r.note
    assert all(f.fault is None for f in r.findings)


def test_an_unknown_forward_fault_is_told_apart_by_the_spine(target, drafter):
    from ddtree_lab.diagnosis.forward import check_tree_forward, spine

    run = live(target, drafter, None, tokens=6, prompts=PROMPTS[:1], budget=16)
    s = run.steps[0]
    chain = spine(s)
    off = next(i for i in range(s.num_nodes) if i not in chain)
    assert len(chain) >= 3, chain
    for node, words in ((off, "leaks across siblings"), (chain[2], "positions or ancestor")):
        logits = s.row_logits.clone()
        logits[node] += 1.0
        bad = dataclasses.replace(run, steps=[s.replace(row_logits=logits)] + run.steps[1:])
        r = check_tree_forward(bad, target, steps=[bad.steps[0]], confirm=False)
        assert len(r.findings) == 1 and words in r.findings[0].kind and r.findings[0].fault is None, r.findings


def test_an_sglang_recording_is_diagnosed_on_sglang_s_own_output(capsys):
    """SGLang's own output is checked; its documented float32 edge (u ~ S) differs by design:
    said in the one wording, not a finding, exit 0 (docs/SGLANG.md)."""
    from ddtree_lab.cli import main

    d = dl.diagnose(dl.load("fixtures/sglang_cpu_recording.json"))
    assert d.findings == [], d.text()
    assert len(d.by_design) == 1 and d.by_design[0].startswith("step 2, request 4: differs by design (not a finding)")
    assert "coin 0.99999994 is not < S" in d.by_design[0] and "SGLang emitted [39]" in d.by_design[0]
    assert "0 findings (1 differs by design, not a finding)" in d.text()
    assert main(["diagnose", "fixtures/sglang_cpu_recording.json"]) == 0
    assert main(["diagnose", "fixtures/engine_summaries/sglang_generate.jsonl"]) == 2
    assert "acceptance summary" in capsys.readouterr().err


def test_an_sglang_step_that_differs_without_a_design_reason_is_a_finding():
    """Take the by-design step's explanation away: SGLang departing from the rule is a finding."""
    run = dl.load("fixtures/sglang_cpu_recording.json")
    steps = [s.replace(extra={**s.extra, "explanation": "", "by_design": False})
             if s.extra.get("verdict") == "differs" else s for s in run.steps]
    d = dl.diagnose(dataclasses.replace(run, steps=steps))
    bad = [f for f in d.findings if f.check == "verifier"]
    assert len(bad) == 1 and "SGLang" in bad[0].kind and (bad[0].step, bad[0].request) == (2, 4), d.text()
    assert "accept_index" in bad[0].evidence and not d.by_design
    # the law check reads SGLang's output too: it left the tree where the children hold all the mass
    assert any(f.check == "output-law" and f.step == 2 for f in d.findings), d.text()


def test_the_package_imports_without_scipy():
    """vLLM's own venv imports ddtree_lab (engines.vllm_worker) and has no scipy."""
    import subprocess
    import sys

    code = "import sys; sys.modules['scipy'] = None; import ddtree_lab, ddtree_lab.diagnosis.law"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(__import__("pathlib").Path(__file__).parents[1]))


@pytest.mark.parametrize("kind", [None, "mask-parent-only", "positions-node-index", "kv-commit-wrong-rows"])
def test_the_model_checks_run_at_level_light(target, drafter, kind):
    """Level light keeps only the child probabilities of the rows the walk read: a forward fault
    may show only in the cache it leaves behind, and is still named (not called a commit bug)."""
    run = live(target, drafter, [kind] if kind else None, record="light", budget=12)
    d = dl.diagnose(run, model=(target, drafter), confirm=False)
    ran = {r.check for r in d.results if r.ran}
    assert "tree-forward" in ran, d.text()
    assert d.faults == ({kind} if kind else set()), d.text()
    if kind is None:
        assert not d.findings, d.text()
