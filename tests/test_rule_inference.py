"""Rule inference: each rule family named on a planted case at its parameter, clean runs silent, a rule outside every family stays unknown."""

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

import ddtree_lab as dl
from ddtree_lab.diagnosis.inference import MARGIN, engine_walk, families_for, infer_rule
from ddtree_lab.diagnosis.sampling import prob_interval, row_interval
from ddtree_lab.diagnosis.verifier import check_verifier
from ddtree_lab.faults import RuleVariant

sys.path.insert(0, str(Path(__file__).parent))
from rule_cases import planted_run

FILTERED = dl.SamplingParams(temperature=0.7, top_k=20, top_p=0.9)

#: (family, planted variant, request parameters): each family on a request where it shows.
CASES = [
    ("temperature", RuleVariant(rows="temperature", temperature=1.0), FILTERED),
    ("temperature", RuleVariant(rows="temperature", temperature=2.0), FILTERED),
    ("temperature", RuleVariant(rows="temperature", temperature=0.4), dl.SamplingParams(temperature=1.0, top_k=12)),
    ("greedy", RuleVariant(rows="greedy"), FILTERED),
    ("p-over-q", RuleVariant(accept="p-over-q"), FILTERED),
    ("p-over-q-own-coin", RuleVariant(accept="p-over-q", coin="child"), FILTERED),
    ("p-over-one-hot-q", RuleVariant(accept="p-over-one-hot"), FILTERED),
    ("p-over-one-hot-q-own-coin", RuleVariant(accept="p-over-one-hot", coin="child"), FILTERED),
    ("threshold", RuleVariant(accept="threshold", threshold_acc=0.5), FILTERED),
    ("other-order", RuleVariant(rows="other-order"), dl.SamplingParams(temperature=1.5, top_k=4, top_p=0.5)),
    ("top-k-dropped", RuleVariant(rows="top-k-dropped"), dl.SamplingParams(temperature=1.0, top_k=3)),
    ("top-p-dropped", RuleVariant(rows="top-p-dropped"), FILTERED),
    ("top-p-twice", RuleVariant(rows="top-p-twice"), FILTERED),
    ("min-p-dropped", RuleVariant(rows="min-p-dropped"), dl.SamplingParams(temperature=1.2, top_k=30, min_p=0.2)),
    ("root-coin", RuleVariant(coin="root"), FILTERED),
    ("bonus-walk-coin", RuleVariant(bonus="walk-coin"), FILTERED),
    ("bonus-parent-row", RuleVariant(bonus="parent-row"), FILTERED),
]


@pytest.mark.parametrize("family, variant, params", CASES,
                         ids=[f"{c[0]}-{c[1].temperature}" if c[1].temperature else c[0] for c in CASES])
def test_each_family_is_named_at_its_parameter(family, variant, params):
    run = planted_run(variant, params, steps=24, seed=3)
    got = infer_rule(run.steps, 48)
    assert got.baseline.slips > 0, "the planted rule never departs from the target-only rule here"
    assert got.best is not None and got.best.family.name == family, [(f.family.name, f.score) for f in got.fits[:4]]
    assert got.explains and got.llr >= MARGIN and not got.tied
    if family == "temperature":
        assert abs(got.best.parameter - variant.temperature) <= 0.1, got.best.parameter
        assert f"T ≈ {variant.temperature:.2f}" in got.best.describe(params)
    if family == "threshold":  # the middle of the interval the decisions admit holds the planted value
        lo = min(d.cumulative_mass / d.coin for s in run.steps for d in s.decisions if d.verdict == "accept" and d.coin)
        t = got.best.parameter
        assert t is not None and 0.2 < t <= lo


@pytest.mark.parametrize("params", [FILTERED, dl.SamplingParams(temperature=1.0), dl.SamplingParams(temperature=0.5,
                                                                                                      min_p=0.1)])
def test_clean_runs_are_silent(params):
    for seed in range(3):
        run = planted_run(None, params, steps=10, seed=seed)
        got = infer_rule(run.steps, 48)
        assert got.baseline.slips == 0 and got.best is None and got.llr < MARGIN
        for catalogue in (True, False):
            r = check_verifier(run, catalogue=catalogue)
            assert r.ran and not r.findings, r.line()


def _complement_coin(vi, logits, probs, coins, final, logws):
    """A rule outside every family: decisions taken with 1 - u, the recorded coin u."""
    out = dl.verify_sampled(vi, probs, (1.0 - coins).clamp(max=0.9999999), final)
    decisions = [[dataclasses.replace(d, coin=float(coins[0, d.parent])) for d in row] for row in out.decisions]
    return dataclasses.replace(out, decisions=decisions)


def test_a_rule_outside_every_family_stays_unknown_with_its_decisions_listed():
    run = planted_run(None, FILTERED, steps=12, seed=5, verifier=_complement_coin)
    got = infer_rule(run.steps, 48)
    assert got.baseline.slips > 0 and not got.explains
    assert got.unexplained and {p.kind for p in got.unexplained} == {"rule_unexplained"}
    assert {p.field for p in got.unexplained} <= {"verdict", "cumulative_mass", "target_prob", "bonus_token",
                                                  "final_mass", "coin", "bonus_prob"}
    p = got.unexplained[0]
    assert p.step is not None and p.request == 0 and p.node is not None and p.value is not None
    for catalogue in (True, False):
        r = check_verifier(run, catalogue=catalogue)
        assert r.findings and all(f.fault is None for f in r.findings), r.findings[0].line()
        assert set(r.per_step.values()) == {"unknown"}
        f = r.findings[0]
        assert "no rule family explains" in f.kind or "closest rule family" in f.kind, f.kind
        assert f.problems and all(q.kind == "rule_unexplained" for q in f.problems)
        assert "unexplained: node" in f.evidence


def test_catalogue_on_and_off():
    run = planted_run(RuleVariant(accept="p-over-q"), FILTERED, steps=24, seed=3)
    on, off = check_verifier(run, catalogue=True), check_verifier(run, catalogue=False)
    assert {f.fault for f in on.findings} == {f.fault for f in off.findings} == {"verifier-p-over-q"}
    assert "the catalogue: the p/q rule reproduces" in on.findings[0].evidence
    assert "catalogue" not in off.findings[0].evidence and "catalogue off" in off.note
    assert "rule inference: per-child acceptance min(1, p/q)" in off.findings[0].evidence
    # a family outside the catalogue: named by inference either way, with no catalogue confirmation
    run = planted_run(RuleVariant(rows="temperature", temperature=1.0), FILTERED, steps=12, seed=3)
    for catalogue in (True, False):
        d = dl.diagnose(run, catalogue=catalogue)
        assert d.faults == {"verifier-temperature-1"}, d.text()
        assert "the verifier used T ≈ 1.00, the request asked 0.7" in d.text()


def test_cli_no_catalogue(tmp_path, capsys):
    from ddtree_lab.cli import main

    run = planted_run(RuleVariant(rows="greedy"), FILTERED, steps=8, seed=3)
    path = tmp_path / "run.ddtree"
    dl.save_trace(run, path)
    assert main(["diagnose", str(path), "--no-catalogue"]) == 1
    out = capsys.readouterr().out
    assert "[verifier-greedy]" in out and "catalogue off" in out


def test_row_interval_holds_every_exact_probability_and_prob_interval_reads_it():
    """The whole-row bounds hold the exact rows (every filter, both orders); prob_interval is the
    row read at one token, and a token outside the stored entries is bounded only when the
    transform keeps none of them."""
    g = torch.Generator().manual_seed(1)
    vocab, m = 300, 64
    params = [dl.SamplingParams(temperature=0.8), dl.SamplingParams(temperature=1.3, top_p=0.8),
              dl.SamplingParams(temperature=0.7, top_k=20, top_p=0.9),
              dl.SamplingParams(temperature=1.1, top_k=30, top_p=0.7, order="top_p_then_top_k"),
              dl.SamplingParams(temperature=0.9, min_p=0.1)]
    decided = 0
    for _ in range(8):
        logits = torch.randn(vocab, generator=g) * 3
        top = logits.topk(m)
        lse = float(torch.logsumexp(logits.double(), 0))
        outside = next(t for t in range(vocab) if t not in set(top.indices.tolist()))
        for p in params:
            row = row_interval(top.indices, top.values, lse, p, vocab)
            exact = dl.target_probs(logits[None, None], p)[0, 0]
            if row is None:
                assert prob_interval(top.indices, top.values, lse, int(top.indices[0]), p, vocab) is None
                continue
            decided += 1
            for token in top.indices.tolist():
                lo, hi = row.prob(token)
                assert lo - 2e-6 <= float(exact[token]) <= hi + 2e-6
                assert prob_interval(top.indices, top.values, lse, token, p, vocab) == (lo, hi)
            got = prob_interval(top.indices, top.values, lse, outside, p, vocab)
            assert got == ((0.0, 0.0) if row.other == 0.0 else None)
            assert float(exact[outside]) <= row.other + 2e-6
    assert decided >= 20  # of 40 (None: a top-p cut the stored entries do not decide)


def test_families_follow_the_request_and_bad_input_is_named():
    names = {f.name for f in families_for(dl.SamplingParams(temperature=1.0))}
    assert "temperature" in names and "top-p-dropped" not in names and "other-order" not in names
    names = {f.name for f in families_for(FILTERED)}
    assert {"other-order", "top-k-dropped", "top-p-dropped", "top-p-twice"} <= names
    with pytest.raises(ValueError, match="no step"):
        infer_rule([], 48)
    run = planted_run(None, FILTERED, steps=2)
    with pytest.raises(ValueError, match="step 0, request 0: no coins"):
        infer_rule([run.steps[0].replace(coins=None)], 48)
    with pytest.raises(ValueError, match="temperature > 0"):
        RuleVariant(rows="temperature")
    with pytest.raises(ValueError, match="'child' goes with the per-child tests"):
        RuleVariant(coin="child")


def _as_sglang(clean: dl.Run, engine: dl.Run) -> dl.Run:
    """Steps as an SGLang recording converts them: the output is the lab's target-only walk on
    the recorded rows and coins, SGLang's own emitted tokens are in ``extra`` (here: those of
    ``engine``, the same steps verified by a planted rule)."""
    steps = []
    for c, e in zip(clean.steps, engine.steps):
        agrees = c.emitted == e.emitted
        steps.append(c.replace(extra={"source": "sglang", "sglang_emitted": list(e.emitted),
                                      "sglang_accept_length": e.accept_length,
                                      "verdict": "agrees" if agrees else "differs", "call": c.step, "row": 0}))
    return dl.Run(metadata=dict(clean.metadata), steps=steps, token_texts={})


@pytest.mark.parametrize("family, variant", [("threshold", RuleVariant(accept="threshold", threshold_acc=0.5)),
                                             ("root-coin", RuleVariant(coin="root"))])
def test_rule_inference_runs_on_an_engines_own_verdicts(family, variant):
    """An SGLang recording records SGLang's emitted tokens only: inference fits the families to
    the verdicts and bonus tokens they imply (not to the lab's walk), and names the planted rule."""
    clean, planted = planted_run(None, FILTERED, steps=24, seed=3), planted_run(variant, FILTERED, steps=24, seed=3)
    run = _as_sglang(clean, planted)
    assert any(s.extra["verdict"] == "differs" for s in run.steps)
    got = infer_rule(run.steps, 48, engine=True)
    assert got.best is not None and got.best.family.name == family and got.explains, \
        [(f.family.name, f.score) for f in got.fits[:4]]
    # only the engine's verdicts and bonus tokens are scored, not the lab's numbers
    walks = [engine_walk(s) for s in run.steps]
    assert all(w is not None for w in walks)
    assert got.baseline.observations == sum(len(w[0]) + (w[1] is not None) for w in walks if w is not None)
    (finding,) = check_verifier(run).findings
    assert "rule inference on SGLang's own verdicts: " in finding.evidence
    assert got.best.describe(FILTERED) in finding.evidence
    # the lab's own (clean) walk is not what was fitted: on it, no family beats the target-only rule
    assert infer_rule(clean.steps, 48).best is None


def test_an_engine_walk_that_leaves_the_tree_is_named():
    clean = planted_run(None, FILTERED, steps=2, seed=3)
    s = clean.steps[0]
    bad = s.replace(extra={"source": "sglang", "sglang_emitted": [47, 47, 47], "sglang_accept_length": 2,
                           "verdict": "differs"})
    with pytest.raises(ValueError, match="step 0, request 0: the engine's emitted tokens .* do not follow the recorded tree"):
        infer_rule([bad], 48, engine=True)
