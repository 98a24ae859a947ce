"""The DDTree authors' loop beside the lab's on the same prompts (issue 26).

``fixtures/ddtree_reference/smollm2_dflash_greedy.jsonl`` was written by the authors' own
``ddtree_generate`` (``scripts/run_reference_ddtree.py``) with the lab's target and DFlash
drafter, greedy. The lab's live run of the same prompts builds the same tree and accepts the
same path in every round both loops ran; the only difference is where they stop
(``compare.STOPPING_RULE``): the reference runs one more round exactly when the lab's rounds end
at ``max_new_tokens - 1`` committed tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import cast

import pytest

from ddtree_lab.io import load
from ddtree_lab.step import Run
from ddtree_lab.views.compare import STOPPING_RULE, reference_vs_lab, reference_vs_lab_text
from ddtree_lab.views.run_summary import run_summary_text, serving_vs_lab

ROOT = Path(__file__).resolve().parent.parent
DUMP = ROOT / "fixtures" / "ddtree_reference" / "smollm2_dflash_greedy.jsonl"


def _settings(ref) -> tuple[list[str], int, int]:
    reqs = ref.metadata["requests"]
    m = {q["max_new_tokens"] for q in reqs}
    b = {q["tree_budget"] for q in reqs}
    assert len(m) == 1 and len(b) == 1 and all(q["temperature"] == 0.0 for q in reqs)
    return [q["prompt"] for q in reqs], m.pop(), b.pop()


def _taus(steps) -> list[int]:
    return [s.accept_length + 1 for s in steps]


def test_the_dump_stops_on_committed_tokens():
    """The reference's own rule, read from its data: each request's rounds commit at least
    max_new_tokens tokens (Σ τ), and all but the last commit fewer (else it would have stopped
    a round earlier), unless a stop token ended it."""
    ref = load(DUMP)
    _, m, _ = _settings(ref)
    for q in sorted({s.request for s in ref.steps}):
        taus = _taus(ref.for_request(q))
        assert sum(taus[:-1]) < m <= sum(taus), (q, taus)


def _lab_like(ref, drop_last_of: set[int]) -> Run:
    """A lab-side Run made of the reference's own rounds, the last round of some requests
    dropped (what the lab's rule does when those requests end at max_new_tokens - 1)."""
    steps = []
    for q in sorted({s.request for s in ref.steps}):
        mine = ref.for_request(q)
        steps += mine[:-1] if q in drop_last_of else mine
    return Run(metadata={"source": "lab trace", "requests": []}, steps=steps, token_texts={})


def test_reference_vs_lab_pairs_rounds_and_checks_the_rule():
    ref = load(DUMP)
    _, m, _ = _settings(ref)
    requests = sorted({s.request for s in ref.steps})
    # the requests whose reference rounds, less the last, commit exactly m - 1 tokens: the lab stops there
    at_m1 = {q for q in requests if sum(_taus(ref.for_request(q))[:-1]) == m - 1}
    data = reference_vs_lab(ref, _lab_like(ref, at_m1), m)
    assert data["identical"] and data["rule"] == STOPPING_RULE
    for q in data["requests"]:
        assert q["identical"] == q["common"] and q["first_difference"] is None
        assert q["extra"] == (1 if q["request"] in at_m1 else 0) and q["explained"] is True
        assert q["tau_common"][0] == q["tau_common"][1]
    # every request's last round dropped: where the lab side then ends below m - 1 its own rule would not
    # have stopped it, so one reference round more is not what the rule predicts
    wrong = reference_vs_lab(ref, _lab_like(ref, set(requests)), m)
    assert [q["explained"] for q in wrong["requests"]] == [q in at_m1 for q in requests]
    assert at_m1 != set(requests)  # so the line above checks both verdicts
    text = reference_vs_lab_text(data)
    assert "mean τ over the" in text and ("because it stops on committed tokens" in text) == bool(at_m1)


def test_a_different_round_is_named():
    ref = load(DUMP)
    lab = _lab_like(ref, set())
    first = lab.for_request(0)[2]
    assert first.tree is not None
    tokens = first.tree.node_token_ids.clone()
    tokens[0, 1] += 1
    lab.steps[lab.steps.index(first)] = first.replace(node_token_ids=tokens)
    data = reference_vs_lab(ref, lab)
    q0 = data["requests"][0]
    assert not data["identical"] and q0["first_difference"] == 2 and q0["identical"] == q0["common"] - 1
    with pytest.raises(ValueError, match="DDTree reference run"):
        reference_vs_lab(lab, ref)


def test_info_and_serving_view_state_the_rule():
    ref = load(DUMP)
    assert STOPPING_RULE in run_summary_text(ref)
    data = serving_vs_lab(ref, _lab_like(ref, set()))
    assert data["note"].startswith(STOPPING_RULE) and "rounds both loops ran" in data["note"]
    assert serving_vs_lab(ref, [1, 2])["note"].startswith(STOPPING_RULE)


@pytest.fixture(scope="module")
def live(target):
    from ddtree_lab import LiveSession
    from ddtree_lab.models import DFlashDrafter, Drafter
    from ddtree_lab.models.dflash import default_dflash_path

    ref = load(DUMP)
    prompts, m, budget = _settings(ref)
    # cast: DFlashDrafter's target_layer_ids is a tuple, the Drafter protocol's attribute a Sequence
    drafter = cast(Drafter, DFlashDrafter.load(target, default_dflash_path()))
    session = LiveSession(target, drafter, budget=budget)
    return ref, session.run(prompts, max_new_tokens=m), m


def test_lab_and_reference_agree_on_every_round_both_ran(live):
    """The lab's live run and the authors' loop: every common round identical (tree, parents,
    depths, accepted path, bonus), so mean τ over the common rounds is equal; the reference's
    extra rounds are exactly those the stopping rule predicts."""
    ref, lab, m = live
    data = reference_vs_lab(ref, lab, m)
    print(reference_vs_lab_text(data))
    assert data["identical"], [(q["request"], q["first_difference"]) for q in data["requests"]]
    for q in data["requests"]:
        assert q["identical"] == q["common"] == q["lab_rounds"]
        assert q["tau_common"][0] == q["tau_common"][1]
        assert q["explained"] is True and q["extra"] in (0, 1)
    assert any(q["extra"] == 1 for q in data["requests"])  # the fixture shows the difference at least once


def _with_swapped_leaves(step, gap: float):
    """``step`` (a reference round) as a lab step would hold it: log-weights filled in
    (non-increasing in node order), then two leaves off the accepted path swapped in node
    order with log-weights ``gap`` nats apart, as another machine's float sums might order them."""
    import torch

    n = step.num_nodes
    parents = step.parents.tolist()
    leaves = [i for i in range(1, n) if i not in parents and i not in step.accepted_path]
    i, j = leaves[-2], leaves[-1]
    logws = -torch.arange(n, dtype=torch.float32) * 0.25
    logws[j] = logws[i] - gap
    order = list(range(n))
    order[i], order[j] = j, i
    perm = torch.tensor(order)
    swapped = {k: getattr(step, k)[perm] for k in ("node_token_ids", "parents", "depths", "ranks")}
    return step.replace(node_logws=logws[perm], **swapped), (i, j)


@pytest.mark.parametrize("gap, agree", [(3e-7, True), (0.5, False)])
def test_a_tie_between_two_nodes_is_named_and_only_a_tie_agrees(gap, agree):
    """Another machine may pop two nodes of near-equal log-weight in the other order (issue 34:
    tokens 253 / 6110 at nodes 14 / 15): within TIE_TOLERANCE the round still agrees and the tie is
    named with its nodes and gap; a gap past it is a difference."""
    from ddtree_lab.views.compare import TIE_TOLERANCE, round_agreement

    ref = load(DUMP)
    step = ref.for_request(0)[2]
    lab_step, (i, j) = _with_swapped_leaves(step, gap)
    ok, ties = round_agreement(step, lab_step)
    assert ok is agree and (gap <= TIE_TOLERANCE) is agree
    assert [t["node"] for t in ties] == [i, j]
    assert all(t["gap"] == pytest.approx(gap, abs=1e-6) for t in ties)  # float32 spacing at -7.75: 4.8e-7
    lab = _lab_like(ref, set())
    lab.steps[lab.steps.index(step)] = lab_step
    data = reference_vs_lab(ref, lab)
    q0 = data["requests"][0]
    assert data["identical"] is agree and q0["first_difference"] == (None if agree else 2)
    if agree:
        assert [(t["round"], t["node"]) for t in q0["ties"]] == [(2, i), (2, j)]
        assert f"round 2 node {i}" in reference_vs_lab_text(data)


def test_a_smollm2_reference_dump_shows_text_not_ids(target):
    """Issue 34.15a: the dump names no tokenizer, but its prompts encode to its prompt ids through
    the embedded default's chat template, so its tokens read as text (the tokenizer of the lab's
    own target); a dump whose prompt ids do not match gets none."""
    from ddtree_lab.models.target import default_token_texts

    ref = load(DUMP)
    q = ref.metadata["requests"][0]
    first = q["generated_token_ids"][0]
    assert ref.token_texts and ref.token_texts[first] == target.token_text(first)
    assert default_token_texts([(q["prompt"], q["prompt_token_ids"][:-1])], {first}) == {}
