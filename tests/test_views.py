"""Views: one view model (StepView) rendered as text, DOT/SVG and HTML.

Golden files (tests/golden/) hold the text tree, the decision table and the DOT source of a
shipped step and of hand-made cases (greedy, sampled with a residual bonus, leaf bonus,
exhausted support, collapsed subtrees, tokens that need escaping): a view change is a
reviewed diff. Regenerate with DDTREE_LAB_UPDATE_GOLDEN=1.
"""

import json
import math
import os
import re
from pathlib import Path

import pytest

import ddtree_lab as dl
from ddtree_lab import views
from step_examples import GOLDEN_TEXTS, golden_cases, random_step

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "golden"
TRACE = ROOT / "fixtures" / "traces" / "smollm2_t08_b32.ddtrace.safetensors"
GREEDY_TRACE = ROOT / "fixtures" / "traces" / "smollm2_greedy_b32.ddtrace.safetensors"
CASES = golden_cases()


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


@pytest.mark.parametrize("name", sorted(CASES))
def test_hand_made_cases_match_golden_files(name):
    step, texts = CASES[name]
    dl.replay(step)  # the hand-made steps are real verifier outputs
    opts = {"collapse_unvisited": True} if name == "collapsed" else {}
    view = views.step_view(step, texts, **opts)
    _golden(f"{name}.txt", views.to_text(view) + "\n" + views.decisions_text(view))
    _golden(f"{name}.dot", views.to_dot(view))


def test_hand_made_cases_cover_what_they_are_named_for():
    kinds = {name: step.bonus.kind for name, (step, _) in CASES.items()}
    assert CASES["greedy"][0].params.is_greedy
    assert kinds["sampled_residual"] == "residual" and CASES["sampled_residual"][0].accept_length == 0
    assert kinds["leaf_bonus"] == "leaf"
    assert kinds["exhausted"] == "exhausted" and CASES["exhausted"][0].bonus_token == -1
    assert views.step_view(*CASES["collapsed"], collapse_unvisited=True).hidden > 5
    esc_tokens = set(CASES["escaping"][0].node_token_ids.tolist())
    assert {10, 11, 12, 13, 14, 15, 16, 17} <= esc_tokens


def test_escaping_survives_dot_and_svg():
    step, texts = CASES["escaping"]
    view = views.step_view(step, texts)
    dot = views.to_dot(view)
    for line in dot.splitlines()[5:]:  # node and edge lines: every quote inside a label is escaped
        body = re.sub(r'\\.', "", line)
        assert body.count('"') % 2 == 0, line
    assert "\n" not in "".join(views.token_label(t) for t in GOLDEN_TEXTS.values())
    svg = views.step_svg(view)
    texts_in_svg = [re.sub(r"<[^>]+>", "", m) for m in re.findall(r"<text[^>]*>.*?</text>", svg)]
    import html as html_mod
    shown = [html_mod.unescape(t) for t in texts_in_svg]
    for tok in (10, 11, 12, 13, 14, 15, 16, 17):
        label = views.token_label(GOLDEN_TEXTS[tok])
        assert any(label in s for s in shown), (tok, label)
    table = views.decisions_table_html(view)
    assert "<b>&amp;</b>" not in table and "&lt;b&gt;&amp;amp;&lt;/b&gt;" in table


def test_view_marks_path_rejections_and_bonus():
    run = dl.load_trace(TRACE)
    step = _first_step_with_rejection(run)
    view = views.step_view(step, run)
    assert [i for i, n in view.nodes.items() if n.status == "accepted"] == step.accepted_path[1:]
    assert {i for i, n in view.nodes.items() if n.status == "rejected"} == {
        d.node for d in step.decisions if d.verdict == "reject"}
    assert view.bonus.token == step.bonus_token and view.bonus_parent == step.accepted_path[-1]
    for node in view.nodes.values():  # sibling order top to bottom = ascending index
        assert node.children == sorted(node.children)


def test_one_meaning_per_number():
    """target p, residual p and drafter q are what docs/DESIGN.md "Words" says, everywhere."""
    greedy = dl.load_trace(GREEDY_TRACE)
    for step in greedy.steps[:10]:
        view = views.step_view(step, greedy)
        for row in view.decisions:  # greedy: the softmax of the raw logits, never the one-hot verify row
            ids = step.top_token_ids[row.parent].tolist()
            if row.token in ids:
                assert row.target_p == pytest.approx(float(step.top_probs[row.parent, ids.index(row.token)]), rel=1e-4)
            if step.node_logits is not None:  # format v2: exact from the raw logit and the row's log-sum-exp
                assert row.target_p == math.exp(float(step.node_logits[row.node]) - float(step.row_logsumexp[row.parent]))
                assert not row.target_p_upper
            assert row.verify_p in (0.0, 1.0) and (row.verify_p == 1.0) == (row.verdict == "accept")
        assert view.bonus.residual_p is None  # greedy bonus: the argmax, no residual
    sampled = dl.load_trace(TRACE)
    for step in sampled.steps[:10]:
        view = views.step_view(step, sampled)
        for i, node in view.nodes.items():
            if i > 0:
                assert node.target_p == float(step.child_probs[i]) == node.accept_p
                d, r = int(step.depths[i]), int(step.ranks[i])
                assert node.drafter_q == pytest.approx(math.exp(float(step.draft_logprobs[d - 1, r])))
        if step.bonus_token >= 0:
            assert view.bonus.residual_p == step.bonus.token_prob
            assert view.bonus.target_p == float(step.final_row_prefix[step.bonus_token])  # under the request's params
    step, texts = CASES["sampled_residual"]
    b = views.step_view(step, texts).bonus  # the bonus: target p 0.4, renormalised in the residual 0.4/0.7
    assert b.target_p == pytest.approx(0.4) and b.residual_p == pytest.approx(0.4 / 0.7)
    dot = views.to_dot(views.step_view(step, texts))
    assert "p=0.4 residual p=0.57" in dot


def test_expected_accept_is_the_sum_of_path_probabilities():
    step, texts = CASES["collapsed"]
    view = views.step_view(step, texts)
    probs = step.child_probs.tolist()
    parents = step.parents.tolist()

    def path_p(i):
        return 1.0 if i == 0 else probs[i] * path_p(parents[i])
    assert view.expected_accept == pytest.approx(sum(path_p(i) for i in range(1, step.num_nodes)))


def test_svg_and_committed_html_render():
    run = dl.load_trace(TRACE)
    svg = views.step_svg(run.steps[0], run)
    assert svg.lstrip().startswith("<?xml") and "<svg" in svg
    w, h = views.svg_size(svg)
    assert w > 0 and h > 0
    html = views.committed_html(run, 0)
    assert "step 0" in html and run.metadata["requests"][0]["prompt"] in html


def test_token_labels_make_whitespace_visible():
    assert views.token_label(" a\n") == "'␣a⏎'"
    assert views.token_label("\x00\u200b") == "'\\x00\\u200b'"


def test_collapsed_view_keeps_every_visited_node_and_counts_the_rest():
    run = dl.load_trace(TRACE)
    for step in run.steps[:20]:
        full = views.step_view(step, run)
        small = views.step_view(step, run, collapse_unvisited=True)
        visited = {i for i, n in full.nodes.items() if n.status != "unvisited"}
        assert visited == {i for i in small.nodes if i >= 0}
        hidden = sum(n.hidden for i, n in small.nodes.items() if i < 0)
        assert hidden == len(full.nodes) - len(visited) == small.hidden
        assert all(int(n.text.split()[0][1:]) == n.hidden for i, n in small.nodes.items() if i < 0)
        assert "c2" not in views.to_dot(small) or "-> c2" in views.to_dot(small)


@pytest.mark.parametrize("opts", [{"max_depth": 1}, {"min_target_p": 0.05}, {"min_drafter_q": 0.2}])
def test_collapse_by_depth_and_probability_keeps_root_and_path(opts):
    step, texts = CASES["collapsed"]
    full = views.step_view(step, texts)
    view = views.step_view(step, texts, **opts)
    kept = {i for i in view.nodes if i >= 0}
    assert set(step.accepted_path) <= kept and {d.node for d in step.decisions} <= kept
    assert len(kept) + view.hidden == step.num_nodes and view.hidden > 0
    for i in kept:
        n = full.nodes[i]
        if n.status == "unvisited":
            if "max_depth" in opts:
                assert n.depth <= opts["max_depth"]
            if "min_target_p" in opts:
                assert n.target_p >= opts["min_target_p"]
            if "min_drafter_q" in opts:
                assert n.drafter_q >= opts["min_drafter_q"]
    with pytest.raises(ValueError, match="max_depth"):
        views.step_view(step, texts, max_depth=-1)
    with pytest.raises(ValueError, match="min_target_p"):
        views.step_view(step, texts, min_target_p=2.0)


def test_cursor_walks_the_events_in_order():
    step, texts = CASES["collapsed"]  # accept, accept, reject, bonus
    view = views.step_view(step, texts)
    kinds = [e.kind for e in view.events]
    assert kinds == ["consider", "move", "consider", "move", "consider", "bonus"]
    start = view.at(0).cursor
    assert start.current == 0 and start.focus is None and not start.bonus_done
    assert all(s == "pending" for i, s in start.status.items() if i > 0)
    c = view.at(1).cursor
    assert c.current == 0 and c.focus == 1 and c.status[1] == "accepted" and "accept" in c.verdict
    c = view.at(2).cursor
    assert c.current == 1 and c.path == [0, 1] and "move to node 1" in c.verdict
    c = view.at(5).cursor
    assert c.current == 4 and c.considered == [8] and c.status[8] == "rejected" and "reject" in c.verdict
    end = view.at(6).cursor
    assert end.bonus_done and end.focus == -1 and "residual" in end.verdict
    assert views.to_text(view.at(6)) == views.to_text(view).replace("· [", "? [")  # unjudged nodes stay pending
    assert "bonus [" not in views.to_dot(view.at(5)) and "bonus [" in views.to_dot(view.at(6))
    assert 'n4 [label="#4' in views.to_dot(view.at(4)) and "#e65100" in views.to_dot(view.at(4))
    with pytest.raises(ValueError, match="outside 0..6"):
        view.at(7)


def test_to_dict_is_plain_json():
    step, texts = CASES["sampled_residual"]
    d = views.step_view(step, texts).at(2).to_dict()
    again = json.loads(json.dumps(d))
    assert again["cursor"]["k"] == 2 and len(again["decisions"]) == 3
    assert again["bonus"]["token"] == step.bonus_token
    assert {n["index"] for n in again["nodes"]} == set(range(step.num_nodes))


def test_html_pieces_show_segments_coin_and_struck_out_siblings():
    step, texts = CASES["sampled_residual"]
    view = views.step_view(step, texts).at(3)  # all three root children judged
    children = views.children_html(view)
    assert "[0.1, 0.25)" in children and "rejected" in children
    bar = views.mass_bar_svg(view)
    assert 'class="ddtree-coin"' in bar and "u=0.9" in bar and bar.count("<rect") == 4
    bonus = views.bonus_html(view)
    assert "<s>" in bonus and "◀ chosen" in bonus and "0.7" in bonus
    assert views.mass_bar_svg(views.step_view(*CASES["greedy"])) == ""
    greedy = views.children_html(views.step_view(*CASES["greedy"]).at(2))
    assert "= argmax?" in greedy and "yes" in greedy


def test_big_tree_fits_a_notebook_column_when_collapsed():
    step, texts = random_step(budget=256)
    assert step.num_nodes == 257
    w, h = views.svg_size(views.step_svg(step, texts, collapse_unvisited=True))
    assert w <= 1100, w


def test_children_table_sums_up_the_children_not_judged_past_the_limit():
    run = dl.load_trace(TRACE)
    step = next(s for s in run.steps if s.num_nodes > 20 and len([d for d in s.decisions if d.parent == 0]) < 5)
    view = views.step_view(step, run).at(0)
    table = views.children_html(view, limit=6)
    kids = view.nodes[0].children
    assert f"{len(kids) - 6} more children" in table and table.count("<tr") == 1 + 6 + 1
    assert f"#{kids[5]}<" in table and f"#{kids[6]}<" not in table


def test_light_and_off_steps():
    """A light step (rows of the visited nodes only) draws with unknown numbers shown as '?'; an
    off step (outputs only) is refused with a message naming its level."""

    step, texts = CASES["collapsed"]
    visited = {0} | {d.node for d in step.decisions}
    probs = step.child_probs.clone()
    for i in range(1, step.num_nodes):
        if int(step.parents[i]) not in visited:
            probs[i] = float("nan")
    light = step.replace(child_probs=probs, top_token_ids=None, top_probs=None, level="light")
    view = views.step_view(light, texts)
    hidden_parent = next(i for i in range(1, step.num_nodes) if int(step.parents[i]) not in visited)
    assert view.nodes[hidden_parent].target_p is None and view.expected_accept is None
    assert "p=?" in views.to_dot(view) and views.to_text(view)
    assert views.step_view(light, texts, collapse_unvisited=True).hidden > 0
    off = step.replace(node_token_ids=None, child_probs=None, level="off")
    with pytest.raises(ValueError, match="level 'off'"):
        views.step_view(off, texts)


def test_audit_verdict_names_how_its_p_value_combines_the_tests():
    """Issue 18.3: the verdict's p (Bonferroni over the three tests) is named where it is
    printed, so "p = 1" under per-test p-values of 0.3-0.8 reads as what it is."""
    from ddtree_lab import audit as au

    report = au.audit(au.random_case(0, 5, 6), "reference", draws=500, seed=0)
    line = next(x for x in report.text().splitlines() if "verdict:" in x)
    smallest = min(report.law.p_value, report.first_token.p_value, report.depth.p_value)
    assert "Bonferroni" in line and f"min(1, 3 x {smallest:.3g})" in line and f"p = {report.p_value:.3g}" in line
    assert "Bonferroni" in report.figure().layout.title.text


def test_audit_plot_embeds_plotly_js(tmp_path, capsys):
    """Issue 18.12: ``audit --plot`` writes a page that needs no network (plotly.js inline);
    several cases write one file each. The browser test draws it offline."""
    from ddtree_lab.cli import main

    plot = tmp_path / "audit.html"
    main(["audit", "--random", "2", "--draws", "300", "--plot", str(plot)])
    capsys.readouterr()
    pages = sorted(tmp_path.glob("audit-*.html"))
    assert [p.name for p in pages] == ["audit-0.html", "audit-1.html"]
    text = pages[0].read_text()
    assert re.search(r"<script[^>]+src=", text) is None  # no script fetched from a CDN
    assert "Plotly.newPlot" in text and len(text) > 1_000_000  # the library itself is in the page


def test_greedy_vs_sampling_figures_are_readable():
    """Issue 18.7: histograms side by side (no translucent overlay), every sibling group drawn
    with "no data" where it is empty, hover boxes with whole names, trees at their own size in
    a box that scrolls."""
    from ddtree_lab.views import compare

    run = dl.load_trace(TRACE)
    steps = run.steps[:12]  # few steps: some sibling groups are empty
    tau = compare.tau_distribution_figure(steps)
    assert tau.layout.barmode == "group" and all(t.opacity is None for t in tau.data)
    assert tau.layout.hoverlabel.namelength == -1
    q = compare.sibling_quality_figure(steps)
    rows = [r for r in dl.analysis.sibling_conditioned_quality(steps) if r["depth"] == "all" and r["total"]]
    have = {r["after"] for r in rows}
    for t in q.data:
        assert list(t.x) == ["after root", "after rank 0", "after rank > 0"]
        for x, text in zip(t.x, t.text):
            assert (text == "no data") == (x.removeprefix("after ") not in have), (x, text)
    if len(have) < 3:
        assert "no data" in q.layout.annotations[0].text
    html = compare.trees_html(run, step=2)
    assert html.count('<svg style="max-width:none"') == html.count("<svg") > 1
    assert "overflow-x:scroll" in html and "max-width:48%" not in html


def test_wide_fans_are_capped_and_views_open_on_an_informative_step():
    """Issue 18.6: a first step's 32-child root draws 12 children and one note saying how many
    rejected ones it holds; the step browser opens on the step that accepted most, not step 0."""
    from ddtree_lab import notebook

    run = dl.load_trace(TRACE)
    first = run.steps[0]
    view = views.step_view(first, run, True, max_children=12)
    root = view.nodes[0].children
    assert len(root) == 13 and root[-1] < 0  # 12 children + the summary
    summary = view.nodes[root[-1]]
    rejected = sum(1 for d in first.decisions if d.parent == 0 and d.verdict == "reject")
    shown = sum(1 for c in root[:-1] if view.nodes[c].status == "rejected")
    assert f"({rejected - shown} rejected)" in summary.text
    accepted = next(s for s in run.steps if s.accept_length >= 1)
    capped = views.step_view(accepted, run, True, max_children=1)
    assert all(i in capped.nodes for i in accepted.accepted_path)  # the accepted path always stays
    with pytest.raises(ValueError, match="max_children"):
        views.step_view(first, run, max_children=0)
    best = views.informative_step(run)
    assert best.accept_length == max(s.accept_length for s in run.steps) and best is not run.steps[0]
    request = best.request
    box = notebook.step_browser(run, request)
    assert run.for_request(request)[box.children[0].value] is views.informative_step(run, request)
    assert "12 rejected" in notebook.step_browser(run, 0, position=0).children[1].value


def test_children_summary_row_sums_target_p_under_its_own_column():
    """Issue 26.5: the greedy stepper's "N more children" row printed "total target p 0" (the
    sum of the one-hot accept p) under "= argmax?". It gives the sum of the children's target
    p under "target p" (their share of the row: not 0), nothing under "= argmax?", and the
    sums of accept p and path p under theirs."""
    from ddtree_lab.views.labels import number_label

    greedy = dl.load_trace(GREEDY_TRACE)
    step = next(s for s in greedy.steps if sum(1 for p in s.parents.tolist()[1:] if p == 0) > 12)
    view = views.step_view(step, greedy).at(0)
    rest = [c for c in view.nodes[0].children[12:] if view.status(c) == "pending"]
    assert rest
    row = re.findall(r"<tr[^>]*>(.*?)</tr>", views.children_html(view))[-1]
    cells = [html_unescape(c) for c in re.findall(r"<td[^>]*>(.*?)</td>", row)]
    head = re.findall(r"<th[^>]*>(.*?)</th>", views.children_html(view))
    assert head[2:6] == ["target p", "= argmax?", "accept p", "path p"]
    mass = sum(view.nodes[c].target_p for c in rest)
    upper = any(view.nodes[c].target_p_upper for c in rest)
    assert mass > 0 and cells[1] == f"{len(rest)} more children"
    assert cells[2] == f"sum {'<' if upper else ''}{number_label(mass)}" and cells[3] == "-"
    assert cells[4] == f"sum {number_label(sum(view.nodes[c].accept_p for c in rest))}"
    assert "total target p" not in views.children_html(view)
    sampled, texts = CASES["sampled_residual"]  # sampled: target p and accept p are the same numbers
    cells = re.findall(r"<td[^>]*>(.*?)</td>", re.findall(r"<tr[^>]*>(.*?)</tr>",
                       views.children_html(views.step_view(sampled, texts).at(0), limit=1))[-1])
    assert cells[1] == "2 more children" and cells[2] == cells[4] == "sum 0.2" and cells[3] == "-"


def html_unescape(text: str) -> str:
    import html as html_mod

    return html_mod.unescape(text)


def test_table_html_rows_never_wrap_and_scroll_sideways():
    from ddtree_lab import notebook

    table = notebook.table_html(["kind", "tau"], [["mask-<siblings>", "1.35"], ["x", 2]])
    assert "white-space:nowrap" in table and "overflow-x:auto" in table and "width:max-content" in table
    assert "mask-&lt;siblings&gt;" in table and table.count("<tr>") == 3
    with pytest.raises(ValueError, match="row 1 has 1 cells for 2 columns"):
        notebook.table_html(["kind", "tau"], [["a", "b"], ["c"]])
