"""Reference traces and engine summaries as lab Runs: Steps hold only what the source holds."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from ddtree_lab.io import load
from ddtree_lab.step import Run, Step
from ddtree_lab.views import run_summary as rs

ROOT = Path(__file__).resolve().parents[1]
REF = ROOT / "fixtures" / "ddtree_reference"
ENG = ROOT / "fixtures" / "engine_summaries"


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_reference_run_steps_have_tree_and_output_only():
    want = _script("make_reference_fixture").make_requests()["generate_result.pt"]
    run = load(REF / "generate_result.pt")
    assert isinstance(run, Run) and run.source == "ddtree reference" and run.problems == []
    assert len(run.steps) == sum(len(w["round_trees"]) for w in want)
    for s in run.steps:
        assert isinstance(s, Step) and s.source == "ddtree reference"
        assert s.missing_stages() == ["draft", "buffers", "params", "coins", "rows"]
        w = want[s.request]
        tr = w["round_trees"][s.step]
        start = w["num_input_tokens"] + sum(w["acceptance_lengths"][:s.step])
        ids = w["output_ids"][0]
        assert s.prefix_len == start and s.anchor_token_id == ids[start]
        assert s.parents.tolist() == tr["tree"]["parents"]
        assert s.depths.tolist() == [0, *tr["tree"]["node_depths"]]
        assert s.node_token_ids.tolist()[1:] == tr["tree"]["node_token_ids"]
        assert s.accepted_path == tr["accepted_indices"] and s.accept_length == len(tr["accepted_indices"]) - 1
        assert int(s.output.tau()[0]) == w["acceptance_lengths"][s.step]
        n = len(tr["accepted_indices"])
        assert s.emitted == ids[start + 1:start + n + 1] and s.bonus_token == ids[start + n]
        assert all(math.isnan(v) for v in s.node_logws.tolist()) and "node_logws (NaN)" in s.extra["missing"]
        assert s.timings["round"] == pytest.approx(w["round_timestamps"][s.step] - (w["round_timestamps"][s.step - 1]
                                                                                     if s.step else 0.0))
    meta = run.metadata["requests"][1]
    assert meta["stage_times"] == pytest.approx(want[1]["stage_times"])
    assert meta["generated_token_ids"] == want[1]["output_ids"][0][want[1]["num_input_tokens"]:]


def test_reference_run_without_output_ids_says_so():
    run = load(REF / "fork_traces.json")
    s = run.steps[0]
    assert s.anchor_token_id == -1 and s.bonus_token == -1 and s.prefix_len is None
    assert {"root token (-1)", "bonus token (-1)", "prefix_len", "round time"} <= set(s.extra["missing"])
    assert run.metadata["requests"][0]["generated_token_ids"] is None


def test_damaged_round_named_in_problems(tmp_path):
    obj = _script("make_reference_fixture").make_requests()["generate_result.jsonl"][1]
    obj["round_trees"][3]["tree"]["parents"][2] = 7
    (tmp_path / "bad.json").write_text(json.dumps(obj))
    run = load(tmp_path / "bad.json")
    assert [s.step for s in run.steps] == [0, 1, 2, 4]
    assert len(run.problems) == 1 and "round 3" in run.problems[0] and "tree.parents" in run.problems[0]


def test_summary_run_steps_only_with_per_step_counts():
    steps = _script("make_engine_summary_fixture").make_steps()
    run = load(ENG / "vllm_offline_detailed.json")
    assert [s.accept_length for s in run.for_request(1)] == steps["vllm_offline_detailed.json"][1]
    assert all(s.output is None and s.tree is None and s.source == "engine summary" for s in run.steps)
    hist_only = load(ENG / "sglang_generate.jsonl")
    assert hist_only.steps == []
    assert hist_only.metadata["requests"][0]["accept_histogram"] == [
        steps["sglang_generate.jsonl"][0].count(j) for j in range(max(steps["sglang_generate.jsonl"][0]) + 1)]
    text = rs.run_summary_text(hist_only)
    assert "no step order" in text and "τ mean" in text
    # a reference run beside a serving summary: both from Runs
    data = rs.serving_vs_lab(run, load(REF / "generate_result.jsonl"))
    assert data["series"][1]["steps"] == 9


def test_reference_stats_agree_with_the_lab_analysis_on_a_lab_trace():
    from ddtree_lab import analysis

    run = load(ROOT / "fixtures" / "traces" / "smollm2_t08_b32.ddtrace.safetensors")
    st = rs.reference_stats(run)
    lab = analysis.acceptance_by_depth(run.steps)
    assert st["by_depth"]["offered"] == lab["offered"] and st["by_depth"]["accepted"] == lab["accepted"]
    assert st["tau"] == [analysis.tau(s) for s in run.steps]
