"""Every run under fixtures/ renders what it has (issue 26): `ddtree-lab render` in each format a
step with a tree supports, and the picture says what the step does not record.

The fixtures are found by walking fixtures/ (a new fixture is covered without editing this
file); drafters and prompt lists are not runs. A run without per-step records (engine
histograms) and an engine summary's step (an accept length, no tree) have nothing to draw:
render refuses them, naming what they do store.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ddtree_lab.cli import main
from ddtree_lab.io import load
from ddtree_lab.views import step_view, to_dot, to_text
from ddtree_lab.views.html import decisions_table_html
from ddtree_lab.views.model import ROWS_MISSING

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"
NOT_RUNS = ("drafters", "prompts")
FORMATS = {"text": ".txt", "decisions": ".txt", "dot": ".dot", "svg": ".svg", "png": ".png"}
ROWS_NOTE = "no target rows recorded"


def fixture_runs() -> list[Path]:
    """Every file under fixtures/ that is a run (an SGLang recording by its .json half)."""
    out = []
    for p in sorted(FIXTURES.rglob("*")):
        if not p.is_file() or p.name.startswith(".") or p.relative_to(FIXTURES).parts[0] in NOT_RUNS:
            continue
        if p.suffix == ".safetensors" and p.with_suffix(".json").exists():
            continue  # the tensors of an SGLang recording (NAME.json + NAME.safetensors)
        if p.relative_to(FIXTURES).parts[0] == "vllm" and p.suffix != ".ddvllm":
            continue  # a vLLM recording is its directory (below) or its .ddvllm file
        out.append(p)
    return out + sorted(d for d in (FIXTURES / "vllm").iterdir() if d.is_dir())


RUNS = fixture_runs()


def test_every_fixture_kind_is_covered():
    """The walk finds the kinds issue 26 names: the reference's three dumps, the SGLang
    recording, the lab traces and the engine summaries (a walk that found nothing would make
    the tests below vacuous)."""
    names = {p.relative_to(FIXTURES).as_posix() for p in RUNS}
    for want in ("ddtree_reference/generate_result.jsonl", "ddtree_reference/generate_result.pt",
                 "ddtree_reference/fork_traces.json", "sglang_cpu_recording.json",
                 "traces/smollm2_greedy_b32.ddtrace.safetensors", "engine_summaries/vllm_offline_detailed.json"):
        assert want in names, sorted(names)


def _drawable(run):
    return [s for s in run.steps if s.tree is not None and s.output is not None]


@pytest.mark.parametrize("path", RUNS, ids=lambda p: p.relative_to(FIXTURES).as_posix())
def test_fixture_renders_in_every_format(path, tmp_path, capsys):
    run = load(path)
    drawable = _drawable(run)
    if not drawable:
        where = ["--request", str(run.steps[0].request)] if run.steps else []
        code = main(["render", str(path), "--step", "0", *where, "--format", "text"])
        err = capsys.readouterr().err
        assert code == 2, err
        if not run.steps:
            assert "holds no per-step records" in err and "ddtree-lab info" in err, err
        else:
            assert "stores no tree" in err and "accept length" in err, err
        return
    step = drawable[0]
    rows_missing = step.rows is None
    for fmt, suffix in FORMATS.items():
        out = tmp_path / f"{fmt}{suffix}"
        code = main(["render", str(path), "--step", str(step.step), "--request", str(step.request),
                     "--format", fmt, "-o", str(out)])
        err = capsys.readouterr().err
        assert code == 0, (fmt, err)
        assert out.stat().st_size > 0, fmt
        if fmt == "png":
            assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
            continue
        text = out.read_text(encoding="utf-8")
        # graphviz splits a label into one <text> per line: join them before searching
        flat = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", text)) if fmt == "svg" else text
        if rows_missing:
            assert ROWS_NOTE in flat, (fmt, flat[:600])
        else:
            assert ROWS_NOTE not in flat, fmt
    if rows_missing:  # the tree itself is drawn: every node, the accepted path marked
        view = step_view(step, run)
        dot = to_dot(view)
        assert all(f"  n{i} [" in dot for i in range(step.num_nodes))
        assert view.accepted_path == step.accepted_path and len(view.accepted_path) == step.accept_length + 1
        assert all(view.nodes[i].status == "accepted" for i in view.accepted_path[1:])


@pytest.mark.parametrize("path", [p for p in RUNS if "ddtree_reference" in p.parts],
                         ids=lambda p: p.name)
def test_every_reference_round_draws_without_fabricated_numbers(path):
    """Each round of each request of the reference's dumps: the view has the round's tree
    (tokens, depths, sibling ranks), its accepted path and τ, the bonus token the run emitted,
    and no target p, accept p, path p, drafter q, coin or decision anywhere."""
    run = load(path)
    assert run.steps
    for s in run.steps:
        view = step_view(s, run)
        tree = s.tree
        assert tree is not None
        assert ROWS_MISSING in view.missing and ROWS_NOTE in view.missing_note
        assert "decision log" in view.missing_note and "sampling parameters" in view.missing_note
        assert view.events == [] and view.decisions == [] and view.expected_accept is None
        for i, node in view.nodes.items():
            assert (node.token, node.depth, node.rank) == (int(tree.node_token_ids[0, i]), int(tree.depths[0, i]),
                                                           int(tree.ranks[0, i]))
            assert node.target_p is None and node.accept_p is None and node.path_p is None
            assert node.drafter_q is None and node.coin is None and node.child_coin is None
        assert view.accepted_path == s.accepted_path and len(s.accepted_path) == s.extra["tau"]
        if s.bonus_token >= 0:
            assert view.bonus is not None and view.bonus.kind == "recorded" and view.bonus.token == s.bonus_token
            assert view.bonus.target_p is None and view.bonus.residual_p is None and view.bonus.coin is None
            assert view.bonus.node == s.accepted_path[-1]
        else:
            assert view.bonus is None and "the bonus token" in view.missing
        text = to_text(view)
        assert "p=" not in text and "q=" not in text and ROWS_NOTE in text
        table = decisions_table_html(view)
        assert "ddtree-missing" in table and "no decision log recorded" in table
        # nodes off the path whose parent is on it were not accepted there; the others never reached
        on_path = set(s.accepted_path)
        for i in range(1, s.num_nodes):
            parent = int(tree.parents[0, i])
            want = "accepted" if i in on_path else "rejected" if parent in on_path else "unvisited"
            assert view.nodes[i].status == want, (s.step, s.request, i)


def test_stepper_on_a_reference_run_shows_the_tree_and_the_note():
    """The verify stepper takes a reference run: no events to step, no coin to change, the
    picture and the details say what is missing."""
    from ddtree_lab.views import VerifyStepper, what_if

    run = load(FIXTURES / "ddtree_reference" / "generate_result.jsonl")
    st = VerifyStepper(run)
    assert st.num_events == 0 and st.coin_choices() == [] and st.what_if() is None
    assert "no decision log recorded" in st.verdict
    cur = st.view.cursor
    assert cur is not None and cur.path == st.trace.accepted_path and cur.current == st.trace.accepted_path[-1]
    assert cur.bonus_done and all(st.picture_view.status(i) == "accepted" for i in cur.path[1:])
    assert "bonus [label=" in to_dot(st.picture_view)  # the recorded bonus is drawn, not held back by a cursor
    svg = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", st.picture_svg()))
    assert ROWS_NOTE in svg
    assert "ddtree-missing" in st.details_html() and "no coins recorded" in st.what_if_html()
    with pytest.raises(ValueError, match="no sampling parameters"):
        what_if(st.trace, 0, 0.5)


def test_sglang_greedy_recording_names_its_unknown_target_p():
    run = load(FIXTURES / "sglang_cpu_recording.json")
    view = step_view(run.steps[0], run)
    assert view.rows_known and ROWS_MISSING not in view.missing
    assert any("argmax only" in m for m in view.missing)
    assert "target p (the recording stores the target's argmax only)" in to_text(view)
    assert all(node.target_p is None for i, node in view.nodes.items() if i)


@pytest.mark.parametrize("name", ["generate_result.pt", "smollm2_dflash_greedy.jsonl", "generate_result.jsonl"])
def test_a_reference_dump_is_drawn_in_the_mode_info_prints(name, capsys):
    """A run that records no sampling parameters: the picture's mode is the temperature its file
    states (the one `info` prints), and "greedy or sampled is not known" only where it states none."""
    from ddtree_lab.io.decoding_mode import request_temperatures

    path = FIXTURES / "ddtree_reference" / name
    run = load(path)
    view = step_view(run.steps[0], run)
    stated = {r: t for r, t, _ in request_temperatures(run)}.get(run.steps[0].request)
    assert main(["info", str(path)]) == 0
    info = capsys.readouterr().out
    if stated is None:
        assert view.mode == "sampling parameters not recorded" and "not recorded" in info
        assert "sampling parameters (greedy or sampled is not known)" in view.missing
    else:
        mode = "greedy" if stated == 0 else "sampled"
        assert view.mode.startswith(f"T={stated:g} ({mode}, from the file") and f"{stated:g} ({mode})" in info, info
        assert not any("greedy or sampled is not known" in m for m in view.missing)
        assert mode in to_text(view).splitlines()[0]
