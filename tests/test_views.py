"""Views: the text and DOT renderings of a shipped step are golden files (a view change is a
reviewed diff); SVG rendering works through graphviz."""

import os
from pathlib import Path

import pytest

import ddtree_lab as dl
from ddtree_lab import views

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "golden"
TRACE = ROOT / "fixtures" / "traces" / "smollm2_t08_b32.ddtrace.safetensors"


def _first_step_with_rejection(run):
    return next(s for s in run.steps if any(d.verdict == "reject" for d in s.decisions) and s.accept_length >= 1)


def _golden(name, text):
    path = GOLDEN / name
    if os.environ.get("DDTREE_LAB_UPDATE_GOLDEN"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"missing golden file {path}: run with DDTREE_LAB_UPDATE_GOLDEN=1 once"
    assert text == path.read_text()


def test_text_and_dot_views_match_golden_files():
    run = dl.load_trace(TRACE)
    step = _first_step_with_rejection(run)
    view = views.step_view(step, run)
    _golden("step_view.txt", views.to_text(view))
    _golden("step_view.dot", views.to_dot(view))


def test_view_marks_path_rejections_and_bonus():
    run = dl.load_trace(TRACE)
    step = _first_step_with_rejection(run)
    view = views.step_view(step, run)
    assert [i for i, n in view.nodes.items() if n.status == "accepted"] == step.accepted_path[1:]
    assert {i for i, n in view.nodes.items() if n.status == "rejected"} == {
        d.node for d in step.decisions if d.verdict == "reject"}
    assert view.bonus.token == step.bonus_token and view.bonus_parent == step.accepted_path[-1]
    for node in view.nodes.values():  # sibling order left to right = ascending index
        assert node.children == sorted(node.children)


def test_svg_and_committed_html_render():
    run = dl.load_trace(TRACE)
    svg = views.step_svg(run.steps[0], run)
    assert svg.lstrip().startswith("<?xml") and "<svg" in svg
    html = views.committed_html(run, 0)
    assert "step 0" in html and run.metadata["requests"][0]["prompt"] in html


def test_token_labels_make_whitespace_visible():
    assert views.token_label(" a\n") == "'␣a⏎'"


def test_collapsed_view_keeps_every_visited_node_and_counts_the_rest():
    run = dl.load_trace(TRACE)
    for step in run.steps[:20]:
        full = views.step_view(step, run)
        small = views.step_view(step, run, collapse_unvisited=True)
        visited = {i for i, n in full.nodes.items() if n.status != "unvisited"}
        assert visited == {i for i in small.nodes if i >= 0}
        hidden = sum(int(n.text.split()[0][1:]) for i, n in small.nodes.items() if i < 0)
        assert hidden == len(full.nodes) - len(visited)
        assert "c2" not in views.to_dot(small) or "-> c2" in views.to_dot(small)
