"""The verify stepper's state, driven without a browser: simulated clicks and slider moves."""

import re
from pathlib import Path

import pytest

import ddtree_lab as dl
from ddtree_lab import views
from step_examples import golden_cases

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT / "fixtures" / "traces" / "smollm2_t08_b32.ddtrace.safetensors"
CASES = golden_cases()


def _run_of(*names):
    steps = []
    for k, name in enumerate(names):
        s, texts = CASES[name]
        s.step = k
        steps.append(s)
    return dl.Run(metadata={"requests": []}, steps=steps, token_texts=texts.token_texts)


def test_buttons_and_sliders_move_the_cursor():
    stepper = views.VerifyStepper(_run_of("collapsed"))
    box = stepper.widget
    b = stepper._widgets
    assert stepper.k == 0 and stepper.focus is None and "start at the root" in b["verdict"].value
    b["next"].click()
    assert stepper.k == 1 and stepper.focus == 1 and "accept" in stepper.verdict
    first_picture = b["picture"].value
    b["next"].click()
    b["next"].click()
    assert stepper.k == 3 and stepper.current_node == 1 and stepper.focus == 4
    assert b["picture"].value != first_picture and b["decision"].value == 3
    b["last"].click()
    assert stepper.k == stepper.num_events == 6 and "◀ chosen" in b["details"].value
    b["prev"].click()
    assert stepper.k == 5 and "reject" in stepper.verdict and "◀ chosen" not in b["details"].value
    b["decision"].value = 2  # the slider drives the same cursor
    assert stepper.k == 2 and stepper.current_node == 1
    b["first"].click()
    assert stepper.k == 0
    b["last"].click()
    b["next"].click()  # clamps at the end
    assert stepper.k == 6
    assert box is stepper.widget


def test_step_slider_and_request_selector():
    run = dl.load_trace(TRACE)
    stepper = views.VerifyStepper(run)
    b = stepper.widget and stepper._widgets
    assert b["request"].options and len(b["request"].options) == len(stepper.requests) > 1
    b["next"].click()
    b["step"].value = 3
    assert stepper.position == 3 and stepper.k == 0 and stepper.trace is run.for_request(stepper.request)[3]
    other = stepper.requests[1]
    b["request"].value = other
    assert stepper.request == other and stepper.position == 0 and b["step"].value == 0
    assert stepper.trace.request == other
    b["last"].click()
    assert stepper.view.cursor.bonus_done


def test_greedy_steps_compare_with_the_argmax_and_have_no_coin():
    stepper = views.VerifyStepper(_run_of("greedy"))
    b = stepper.widget and stepper._widgets
    assert b["coin"].disabled
    b["next"].click()
    assert "argmax" in stepper.verdict and "= argmax?" in b["details"].value and "ddtree-massbar" not in b["details"].value
    with pytest.raises(ValueError, match="greedy"):
        views.what_if(stepper.trace, 0, 0.5)


def test_what_if_coin_reruns_the_verifier():
    step, texts = CASES["sampled_residual"]  # u = 0.9 rejects all three root children (S = 0.1, 0.25, 0.3)
    stepper = views.VerifyStepper(_run_of("sampled_residual"))
    b = stepper.widget and stepper._widgets
    assert b["coin"].value == "recorded"
    stepper.set_coin(0.2)  # in ' a''s segment [0.1, 0.25)
    w = stepper.what_if()
    assert w.path[:2] == [0, 2] and not w.same_path and "what-if u=0.2" in b["whatif"].value
    assert "u=0.2" in b["details"].value  # the bar draws the what-if coin
    assert views.what_if(step, 0, 0.05).path[:2] == [0, 1]
    assert views.what_if(step, 0, 0.95).same_path
    b["reset"].click()
    assert stepper.what_if() is None and b["coin"].value == "recorded"
    with pytest.raises(ValueError, match="not in"):
        views.what_if(step, 0, 1.0)


def test_what_if_slider_snaps_to_segments_and_answers_beside_it_and_on_the_tree():
    """Issue 18.5: every child's segment is one slider stop (also a 0.0004-wide one), the
    answer is in the widget beside the slider, and the tree draws the what-if walk."""
    stepper = views.VerifyStepper(_run_of("sampled_residual"))
    b = stepper.widget and stepper._widgets
    choices = stepper.coin_choices()
    labels = [lab for lab, _ in choices]
    assert labels == ["#1", "#2", "#5", "reject all", "recorded"]
    assert [round(u, 6) for _, u in choices] == [0.05, 0.175, 0.275, 0.65, 0.9]
    assert list(b["coin"].options) == labels
    assert b["whatif"] in stepper._widgets["box"].children[0].children[2].children  # beside the slider
    before = b["picture"].value
    b["coin"].index = 1  # drag to the second stop: inside #2's segment
    assert stepper.coin == pytest.approx(0.175) and stepper.what_if().path[:2] == [0, 2]
    assert "0 → 2" in b["whatif"].value and "purple" in b["whatif"].value
    assert b["picture"].value != before and "#6a1b9a" in b["picture"].value  # the what-if walk on the tree
    run = dl.load_trace(TRACE)  # a recorded root: most of its 32 children have segments far below 0.001
    st = views.VerifyStepper(run)
    segs = views.html.segments(st.view, 0)
    narrow = [(c, lo, hi) for c, lo, hi in segs if 0 < hi - lo < 5e-4]
    assert narrow, "the fixture's first step has no narrow segment"
    c, lo, hi = narrow[0]
    stops = [u for _, u in st.coin_choices()]
    assert any(lo <= u < hi for u in stops)
    u = next(u for u in stops if lo <= u < hi)
    assert views.what_if(st.trace, 0, u).path[1] == c


def test_leaf_bonus_shows_the_final_coin_only_and_masses_never_above_1():
    """Issue 18.2: at a leaf the bar and the what-if slider do not show the leaf's unused coin,
    the verdict names the final coin, and a float32 row sum above 1 is not printed as a mass."""
    stepper = views.VerifyStepper(_run_of("leaf_bonus"))
    b = stepper.widget and stepper._widgets
    stepper.last()
    assert stepper.is_leaf and b["coin"].disabled and stepper.coin_choices() == []
    step = stepper.trace
    leaf_coin = float(step.coins[stepper.current_node])
    final = float(step.final_coin)
    assert leaf_coin != final
    assert f"u={views.model.number_label(final)}" in stepper.verdict and "final coin" in stepper.verdict
    assert "ddtree-massbar-leaf" in b["details"].value and "ddtree-coin" not in b["details"].value
    shown = re.escape(f"u={views.model.number_label(leaf_coin)}") + r"(?![0-9])"
    assert re.search(shown, b["details"].value + b["whatif"].value) is None
    with pytest.raises(ValueError, match="leaf"):
        stepper.set_coin(0.5)
    mass = step.bonus.residual_mass
    assert mass > 1.0  # the hand-made leaf row sums to 1 + 1.5e-08 in float32, as real rows do
    everything = b["details"].value + b["table"].value + views.decisions_text(stepper.view) + stepper.verdict
    for text in re.findall(r"mass ([0-9.]+)", everything):
        assert float(text) <= 1.0, text
    assert "float32 rounding" in views.decisions_text(stepper.view)
    assert views.model.mass_label(0.25) == "0.25" and views.model.mass_label(1.0) == "1"


def test_step_slider_is_rebuilt_for_a_new_request():
    """Issue 18.9: after switching request the step slider's range is the new request's (a new
    slider, so the browser's End key goes to its last step); the live button label fits."""
    run = dl.load_trace(TRACE)
    stepper = views.VerifyStepper(run)
    b = stepper.widget and stepper._widgets
    old = b["step"]
    other = stepper.requests[1]
    b["request"].value = other
    assert b["step"] is not old and b["step"].max == len(run.for_request(other)) - 1
    assert b["step"] in b["step_row"].children and old not in b["step_row"].children
    b["step"].value = 2
    assert stepper.position == 2 and stepper.request == other
    assert b["more"].layout.width == "210px"


def test_what_if_matches_the_verifier_on_recorded_steps():
    run = dl.load_trace(TRACE)
    for step in run.steps[:15]:  # the recorded coin reproduces the recorded path
        assert views.what_if(step, 0, float(step.coins[0])).path == step.accepted_path


def test_live_button_calls_more_and_shows_the_new_step():
    full = _run_of("collapsed", "leaf_bonus")
    calls = []

    def more():
        calls.append(1)
        return full

    stepper = views.VerifyStepper(dl.Run(full.metadata, full.steps[:1], full.token_texts), more=more)
    b = stepper.widget and stepper._widgets
    assert not b["more"].disabled and b["step"].max == 0
    b["more"].click()
    assert calls == [1] and stepper.position == 1 and b["step"].max == 1 and stepper.trace is full.steps[1]
    assert "one more step" in b["status"].value
    with pytest.raises(ValueError, match="no live session"):
        views.VerifyStepper(full).run_more()


def test_bad_arguments_are_named():
    run = _run_of("greedy")
    with pytest.raises(ValueError, match="request 5"):
        views.VerifyStepper(run, request=5)
    with pytest.raises(ValueError, match="step position 3"):
        views.VerifyStepper(run, step=3)


def test_a_stepper_without_a_live_session_says_why_its_live_button_is_off():
    """Issue 26.12: the disabled "run one more live step" button shows its reason beside it
    (and as its tooltip); with a live session there is no note and the tooltip says what it does."""
    recorded = views.VerifyStepper(_run_of("collapsed"))
    b = recorded.widget and recorded._widgets
    assert b["more"].disabled and "no live session" in b["more"].tooltip
    assert "ddtree-more-note" in b["more_note"].value and "no live session" in b["more_note"].value
    assert "live_more" in b["more_note"].value
    assert b["more_note"] in b["step_row"].children  # beside the button
    live = views.VerifyStepper(_run_of("collapsed"), more=lambda: _run_of("collapsed"))
    b = live.widget and live._widgets
    assert not b["more"].disabled and b["more_note"].value == "" and "one more step" in b["more"].tooltip
