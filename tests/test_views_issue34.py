"""Issue 34 (a new user's findings) in the notebooks' views, without a browser: sliders that
keep a track (34.2), readable chart fonts, the chain's node count said, the policy trees at their
own size and the sampling parameters as text (34.8). tests/test_browser.py checks the same in
Chromium: dragging each slider, bounding boxes, nothing clipped."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import ddtree_lab as dl
from ddtree_lab.analysis.counterfactual import step_counterfactuals
from ddtree_lab.views import layout

ROOT = Path(__file__).resolve().parent.parent
SAMPLED = ROOT / "fixtures" / "traces" / "smollm2_t08_b32.ddtrace.safetensors"


@pytest.fixture(scope="module")
def run():
    return dl.load_trace(SAMPLED)


def _sliders(widget):
    import ipywidgets as w

    out, stack = [], [widget]
    while stack:
        x = stack.pop()
        if isinstance(x, (w.IntSlider, w.FloatSlider, w.SelectionSlider)):
            out.append(x)
        stack.extend(getattr(x, "children", ()))
    return out


def _check_slider(s) -> None:
    """A slider's width is fixed in px and never shrinks in a flex row, and leaves a track."""
    lay = s.layout
    assert lay.width and lay.width.endswith("px") and lay.min_width == lay.width, (s.description, lay.width)
    assert lay.flex == "0 0 auto", (s.description, lay.flex)
    track = layout.track_px({"layout": {"width": lay.width}, "style": {"description_width": s.style.description_width}})
    assert track >= 100, (s.description, track)


def test_slider_kwargs_keep_a_track():
    kw = layout.slider_kwargs("360px", "70px")
    assert kw["layout"]["flex"] == "0 0 auto" and kw["layout"]["min_width"] == "360px"
    assert layout.track_px(kw) == 360 - 70 - layout.READOUT_PX
    with pytest.raises(ValueError, match="px track"):
        layout.slider_kwargs("176px", "80px")  # issue 34.2: a 176 px slider had no track left
    with pytest.raises(ValueError, match="in px"):
        layout.slider_kwargs("50%")


def test_stepper_sliders_never_shrink_to_no_track(run):
    """Issue 34.2: notebook 02's step slider sat in a row beside a long note and shrank to its
    description and readout (a 0 px track). Every slider of the stepper, the step slider made
    for another request too, has a fixed width with a track; the notes beside take what is left."""
    stepper = dl.views.VerifyStepper(run, request=1, step=2)
    sliders = _sliders(stepper.widget)
    assert {s.description.split(" #")[0] for s in sliders} == {"step", "decision", "what-if u"}
    for s in sliders:
        _check_slider(s)
    stepper._widgets["request"].value = 2  # a new step slider for request 2's range
    _check_slider(stepper._widgets["step"])
    assert stepper._widgets["more_note"].layout.flex == "1 1 260px" and stepper._widgets["more_note"].layout.min_width == "0"


def test_tuner_and_picker_sliders_keep_a_track(run):
    from ddtree_lab.views.policies import PolicyPicker
    from ddtree_lab.views.tuner import Tuner

    tuner = Tuner(run)
    names = {s.description for s in _sliders(tuner.widget)}
    assert names == {"temperature", "top-k", "top-p", "min-p", "budget B'", "step"}
    for s in _sliders(tuner.widget):
        _check_slider(s)
    res = [r for s in run.steps[:2] for r in step_counterfactuals(s, ["ddtree", "chain"], [4, 16])]
    picker = PolicyPicker(res, texts=run)
    assert len(_sliders(picker.widget)) == 2
    assert picker.widget.children[0].layout.flex_flow == "row wrap"  # its controls wrap in a narrow column
    for s in _sliders(picker.widget):
        _check_slider(s)


def test_tuner_charts_text_is_at_least_12px(run):
    """Issue 34.8: the tuner's bar charts drew 10 px text (read as ~8 px)."""
    from ddtree_lab.views.tuner import Tuner, bars_svg

    svg = bars_svg([1, 2], [1, 2], ["a", "b"], "title", groups=[(0, 1, "req 0"), (1, 2, "req 1")], x_title="steps")
    sizes = [int(x) for x in re.findall(r"font(?:-size)?:\s*(\d+)px", svg)]
    assert sizes and min(sizes) >= 12, sizes
    tuner = Tuner(run)
    for chart in (tuner.per_step, tuner.cover, tuner.step_cover):
        sizes = [int(x) for x in re.findall(r"font(?:-size)?:\s*(\d+)px", chart.value)]
        assert sizes and min(sizes) >= 12, sizes


def _font_sizes(fig) -> dict:
    """Every font size a plotly figure resolves (None: plotly's default, 12)."""
    lay = fig.layout
    base = lay.font.size
    out = {"layout": base, "legend": lay.legend.font.size or base, "title": lay.title.font.size or base}
    for name in [k for k in lay if k.startswith(("xaxis", "yaxis"))]:
        axis = lay[name]
        out[f"{name}.ticks"] = axis.tickfont.size or base
        out[f"{name}.title"] = axis.title.font.size or base
    for k, a in enumerate(lay.annotations):
        out[f"annotation{k}"] = a.font.size or base
    return out


def test_policy_figures_fonts_are_at_least_12px(run):
    """Issue 34.8: notebook 04's figures (the picker's P(accepted >= d), tokens/s) set their
    fonts: every tick, axis title, legend and subplot title at 12 px or more."""
    from ddtree_lab.views.policies import tau_by_depth_figure, tokens_per_second_figure

    res = [r for s in run.steps[:2] for r in step_counterfactuals(s, ["ddtree", "chain"], [4])]
    rows = [{"temperature": t, "policy": p, "budget": b, "expected_tok_s": v}
            for t in (0.0, 0.8) for p, b, v in [("ddtree", 4, 8.0), ("ddtree", 8, 9.0), ("chain", 4, 7.0)]]
    for fig in (tau_by_depth_figure(res, 4), tokens_per_second_figure(rows, 18.0)):
        sizes = _font_sizes(fig)
        assert all(v is not None and v >= 12 for v in sizes.values()), sizes


def test_chain_node_count_is_explained(run):
    """Issue 34.8: at B = 16 the chain has 15 nodes: one per position the drafter's block of
    L = 16 predicts (L-1 = 15, chain_policy builds min(B, L-1)); the picker says so."""
    from ddtree_lab.views.policies import PolicyPicker, draft_positions, nodes_note, policy_tree_dot

    assert run.steps[0].draft.token_ids.shape[0] == 15
    res = [r for s in run.steps[:2] for r in step_counterfactuals(s, ["ddtree", "chain"], [4, 16])]
    assert {r.num_nodes for r in res if r.policy == "chain" and r.budget == 16} == {15}
    assert draft_positions(res, run) == 15 and draft_positions(res) == 15
    picker = PolicyPicker(res, texts=run)
    picker.policy.value, picker.budget.value = "chain", 16
    assert "L-1 = 15" in picker.summary.value and "at most 15 nodes" in picker.summary.value
    picker.policy.value = "ddtree"
    assert "ddtree-nodes-note" not in picker.summary.value  # DDTree places all 16
    assert nodes_note("chain", 4, 4.0, 15) == ""
    chain16 = next(r for r in res if r.policy == "chain" and r.budget == 16)
    assert "15 nodes (one per drafted position" in policy_tree_dot(chain16, run)


def test_policy_trees_sit_at_their_own_size_and_wrap(run):
    """Issue 34.8: the trees side by side were squeezed into equal thirds (the chain clipped at
    the right, the DDTree tree's height empty below it): each is drawn at its own size, the
    row wraps, a tree wider than the page scrolls in its own cell."""
    from ddtree_lab.views.policies import policy_trees_html

    res = [r for r in step_counterfactuals(run.steps[0], ["ddtree", "chain"], [16])]
    page = policy_trees_html(res, run)
    assert "flex-wrap:wrap" in page and "align-items:flex-start" in page
    assert page.count('class="ddtree-policy-tree"') == 2 and "flex:1 1 0" not in page
    assert page.count('<svg style="max-width:none"') == 2


def test_params_text_is_the_labs_label_not_a_dict(run):
    """Issue 34.8: notebooks 01 and 02 showed a request's parameters as a raw Python dict."""
    from ddtree_lab import notebook
    from ddtree_lab.sampling import SamplingParams

    assert notebook.params_text(SamplingParams(temperature=0.8, seed=7).to_dict()) == "T=0.8 · seed 7"
    assert notebook.params_text(SamplingParams(temperature=0.0).to_dict()) == "greedy"
    assert notebook.params_text(SamplingParams(temperature=1.0, top_p=0.9, top_k=20)) == "T=1 top-k=20 top-p=0.9"
    assert notebook.params_text(None) == "not recorded"
    page = notebook.summary_html(run)
    assert "{" not in page and "&#x27;" not in page and "T=0.8 · seed 8" in page
    assert notebook.summary(run)[0]["params"]["temperature"] == 0.8  # the rows keep the dict


def test_saved_notebooks_show_params_as_text_and_say_why_the_chain_has_15_nodes():
    """Issue 34.8 on the saved notebooks (they read without a kernel): 01's and 02's summary
    tables give the parameters as the lab's label; 04 says why the chain has 15 nodes at B = 16."""
    import nbformat

    def outputs(name: str) -> str:
        nb = nbformat.read(ROOT / "labs" / name, as_version=4)
        return "".join(str(o.get("data", {}).get("text/html", "")) + str(o.get("text", ""))
                       for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))

    for name, label in (("01_live_step.ipynb", "T=0.8 · seed 7"), ("02_verify_stepper.ipynb", "T=0.8 · seed 8")):
        text = outputs(name)
        assert "<th>params</th>" in text and f"<td>{label}</td>" in text, name
        assert "&#x27;temperature&#x27;" not in text and "'temperature'" not in text, name
    tuner = nbformat.read(ROOT / "labs" / "04_topk_topp_tuner.ipynb", as_version=4)
    md = "".join(c.source for c in tuner.cells if c.cell_type == "markdown")
    assert "L-1 = 15" in md and "min(B, L-1)" in md
    assert "'temperature'" not in outputs("04_topk_topp_tuner.ipynb")
