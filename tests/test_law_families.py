"""The output-law side of rule inference: a planted rule's family named from the recorded outputs alone (no coin, no decision log read), clean runs silent."""

import sys
from pathlib import Path

import pytest

import ddtree_lab as dl
from ddtree_lab.diagnosis.inference import MARGIN
from ddtree_lab.diagnosis.law import check_law
from ddtree_lab.diagnosis.lawfit import fit_output_law
from ddtree_lab.faults import RuleVariant

sys.path.insert(0, str(Path(__file__).parent))
from rule_cases import VOCAB, planted_run

FILTERED = dl.SamplingParams(temperature=0.7, top_k=20, top_p=0.9)


def _blind(run: dl.Run) -> dl.Run:
    """The run without its decision logs and coins: the law side must not need them."""
    return dl.Run(run.metadata, [s.replace(coins=None, final_coin=None) for s in run.steps])


@pytest.mark.parametrize("family, variant, flagged", [
    ("temperature", RuleVariant(rows="temperature", temperature=1.0), True),
    ("p-over-q", RuleVariant(accept="p-over-q"), True),
    ("threshold", RuleVariant(accept="threshold", threshold_acc=0.5), True),
    ("greedy", RuleVariant(rows="greedy"), False),  # the four tests pass it at 60 steps; the fit still names it
])
def test_a_planted_family_is_named_from_the_outputs(family, variant, flagged):
    run = planted_run(variant, FILTERED, steps=60, seed=3)
    fit = fit_output_law(_blind(run).steps, VOCAB)
    assert fit.best is not None and fit.best.family.name == family, [(f.family.name, f.score) for f in fit.fits[:3]]
    assert fit.llr >= MARGIN and fit.fits_law, fit.sentence()
    if family == "temperature":
        assert fit.best.parameter is not None and abs(fit.best.parameter - 1.0) <= 0.1, fit.best.parameter
        assert "the outputs fit the walk at T = 1.0" in fit.sentence() or "T = 0.9" in fit.sentence()
    if family == "threshold":
        assert fit.best.parameter is not None and abs(fit.best.parameter - 0.5) <= 0.15, fit.best.parameter
    r = check_law(run)
    assert bool(r.findings) == flagged, r.note
    if flagged:
        assert all("rule families' laws: the outputs fit " + fit.best.describe() in f.evidence for f in r.findings)
        assert all(f.fault is None for f in r.findings)  # a statistical sentence, not a named fault


def test_clean_runs_are_silent():
    for seed in range(2):
        run = planted_run(None, FILTERED, steps=40, seed=seed)
        assert not check_law(run).findings
        fit = fit_output_law(run.steps, VOCAB)
        assert fit.best is None and fit.llr < MARGIN
        assert "no rule family's law fits the outputs better than the target-only rule" in fit.sentence()


def test_no_step_to_score_is_said():
    run = planted_run(None, dl.SamplingParams(temperature=0.0), steps=2)
    with pytest.raises(ValueError, match="no sampled, lossless step"):
        fit_output_law(run.steps, VOCAB)


def _smoothed(vi, logits, probs, coins, final, logws):
    """A rule outside every family: the walk on rows mixed half and half with the uniform row
    (the recorded rows stay the request's)."""
    return dl.verify_sampled(vi, 0.5 * probs + 0.5 / VOCAB, coins, final)


def test_a_rule_outside_every_family_fits_none():
    run = planted_run(None, FILTERED, steps=40, seed=3, verifier=_smoothed)
    fit = fit_output_law(run.steps, VOCAB)
    assert fit.best is not None and not fit.fits_law and fit.best.zeros > 0  # beats the target-only law, still wrong
    r = check_law(run)
    assert r.findings and all("rule families' laws: no rule family's law fits the outputs (closest: " in f.evidence
                              for f in r.findings), [f.evidence for f in r.findings]
