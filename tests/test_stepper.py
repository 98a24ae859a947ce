"""The verify stepper's state, driven without a browser: simulated clicks and slider moves."""

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
    return dl.RunTrace(metadata={"requests": []}, steps=steps, token_texts=texts.token_texts)


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
    assert abs(b["coin"].value - 0.9) < 1e-6
    b["coin"].value = 0.2  # in ' a''s segment [0.1, 0.25)
    w = stepper.what_if()
    assert w.path[:2] == [0, 2] and not w.same_path and "what-if u=0.2" in b["details"].value
    assert 'x2="' in b["details"].value and "u=0.2" in b["details"].value  # the bar draws the what-if coin
    assert views.what_if(step, 0, 0.05).path[:2] == [0, 1]
    assert views.what_if(step, 0, 0.95).same_path
    b["reset"].click()
    assert stepper.what_if() is None and abs(b["coin"].value - 0.9) < 1e-6
    with pytest.raises(ValueError, match="not in"):
        views.what_if(step, 0, 1.0)


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

    stepper = views.VerifyStepper(dl.RunTrace(full.metadata, full.steps[:1], full.token_texts), more=more)
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
