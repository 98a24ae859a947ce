"""Runs the lab did not record (DDTree reference traces) know greedy from sampled only where the
file says so or the user states it (issues 25, 26), and a greedy one is checked token for token
against plain greedy decoding of the target."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import ddtree_lab as dl
from ddtree_lab.cli import main
from ddtree_lab.diagnosis import diagnose
from ddtree_lab.diagnosis.greedy import check_greedy_decoding
from ddtree_lab.diagnosis.mode import MODE_UNKNOWN
from ddtree_lab.io.decoding_mode import (FROM_ARGS, FROM_OPTION, FROM_RECORD, mode_text, request_temperatures,
                                         state_temperature)

ROOT = Path(__file__).resolve().parent.parent
REF = ROOT / "fixtures" / "ddtree_reference"
GREEDY = ROOT / "fixtures" / "traces" / "smollm2_greedy_b32.ddtrace.safetensors"


def _benchmark_layout(tmp_path: Path, temperature) -> Path:
    """The reference's benchmark layout with ``args.temperature`` (plain dicts, torch.save)."""
    doc = torch.load(REF / "generate_result.pt", weights_only=True)
    doc["args"]["temperature"] = temperature
    out = tmp_path / f"bench_t{temperature}.pt"
    torch.save(doc, out)
    return out


def test_the_temperature_comes_from_the_file_where_it_says_so(tmp_path):
    greedy = dl.load(REF / "generate_result.pt")  # args.temperature = 0.0
    assert [(t, w) for _, t, w in request_temperatures(greedy)] == [(0.0, FROM_ARGS)] * 2
    assert mode_text(greedy) == "temperature: 0 (greedy), from the file (args.temperature)"
    sampled = dl.load(_benchmark_layout(tmp_path, 1.0))  # T = 1 is sampled, not greedy
    assert mode_text(sampled) == "temperature: 1 (sampled), from the file (args.temperature)"
    for name in ("generate_result.jsonl", "fork_traces.json"):
        run = dl.load(REF / name)
        assert all(t is None for _, t, _ in request_temperatures(run)), name
        assert mode_text(run).startswith("temperature: not recorded: greedy or sampled is unknown")
    lines = (REF / "generate_result.jsonl").read_text().splitlines()
    first = json.loads(lines[0])
    own = tmp_path / "own.jsonl"
    own.write_text(json.dumps({**first, "temperature": 0.6}) + "\n" + lines[1] + "\n")
    run = dl.load(own)
    assert request_temperatures(run) == [(0, 0.6, FROM_RECORD), (1, None, "not recorded")]
    assert mode_text(run).startswith("temperature: request 0: 0.6 (sampled), from the file (the request's "
                                     "temperature field); request 1: not recorded")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({**first, "temperature": "hot"}) + "\n")
    run = dl.load(bad)
    assert request_temperatures(run) == [(0, None, "not recorded")]
    assert run.problems == ["request 0: field 'temperature' is 'hot', not a temperature (a number >= 0): greedy or "
                            "sampled is not known"]
    assert "args.temperature is -1" in dl.load(_benchmark_layout(tmp_path, -1)).problems[0]


def test_state_temperature_fills_in_only_what_the_file_lacks():
    run = dl.load(REF / "generate_result.jsonl")
    state_temperature(run, 1.0)
    assert request_temperatures(run) == [(0, 1.0, FROM_OPTION), (1, 1.0, FROM_OPTION)]
    assert mode_text(run) == "temperature: 1 (sampled), from --temperature"
    greedy = dl.load(REF / "generate_result.pt")
    state_temperature(greedy, 0.0)  # the same value: kept as the file's
    assert mode_text(greedy).endswith("from the file (args.temperature)")
    with pytest.raises(ValueError, match=r"request 0's temperature is 0 \(from the file \(args.temperature\)\)"):
        state_temperature(greedy, 1.0)
    with pytest.raises(ValueError, match="must be a finite number >= 0"):
        state_temperature(run, float("nan"))
    with pytest.raises(ValueError, match="records each request's sampling parameters"):
        state_temperature(dl.load(GREEDY), 0.0)


def test_diagnose_says_once_that_the_mode_is_unknown_and_how_to_state_it():
    text = diagnose(dl.load(REF / "generate_result.jsonl")).text()
    assert text.count(MODE_UNKNOWN) == 1 and "--temperature T" in MODE_UNKNOWN
    assert "could not run output-law, sampling, greedy: greedy or sampled is unknown" in text
    assert "no sampled step" not in text and "no greedy step" not in text
    greedy = diagnose(dl.load(REF / "generate_result.pt")).text()
    assert "could not run sampling: the run is greedy (temperature 0, from the file (args.temperature)): " \
           "no sampled step" in greedy
    assert "could not run greedy: the run is greedy (temperature 0, from the file (args.temperature)), but the " \
           "file records no target logits" in greedy and MODE_UNKNOWN not in greedy
    run = dl.load(REF / "generate_result.jsonl")
    state_temperature(run, 1.0)
    sampled = diagnose(run).text()
    assert "could not run greedy: the run is sampled (temperature 1, from --temperature): no greedy step" in sampled
    assert "could not run output-law: the run is sampled" in sampled and MODE_UNKNOWN not in sampled


def test_info_and_diagnose_take_temperature(capsys):
    assert main(["info", str(REF / "generate_result.pt")]) == 0
    assert "temperature: 0 (greedy), from the file (args.temperature)" in capsys.readouterr().out
    assert main(["info", str(REF / "generate_result.jsonl")]) == 0
    assert "temperature: not recorded: greedy or sampled is unknown" in capsys.readouterr().out
    assert main(["info", str(REF / "generate_result.jsonl"), "--temperature", "0"]) == 0
    assert "temperature: 0 (greedy), from --temperature" in capsys.readouterr().out
    assert main(["diagnose", str(REF / "fork_traces.json"), "--temperature", "0.7"]) == 0
    assert "the run is sampled (temperature 0.7, from --temperature)" in capsys.readouterr().out
    assert main(["diagnose", str(REF / "generate_result.pt"), "--temperature", "1"]) == 2
    assert "request 0's temperature is 0 (from the file (args.temperature))" in capsys.readouterr().err
    assert main(["info", str(GREEDY), "--temperature", "0"]) == 2
    assert "records each request's sampling parameters" in capsys.readouterr().err


def reference_layout(run: dl.Run, request: int, rounds: int) -> dict:
    """The first ``rounds`` steps of one request of a lab run, written as the DDTree reference's
    ``ddtree_generate`` result (``round_trees``, ``output_ids`` = prompt + committed tokens,
    ``num_input_tokens``, ``acceptance_lengths``): a reference trace of a real greedy run."""
    meta = next(r for r in run.metadata["requests"] if r["request"] == request)
    steps = sorted(run.for_request(request), key=lambda s: s.step)[:rounds]
    prompt = list(meta["prompt_token_ids"])
    committed = 1 + sum(len(s.emitted) for s in steps)  # the prefill's token, then each round's tau
    trees = []
    for s in steps:
        tree = s.tree
        assert tree is not None
        n = int(tree.num_nodes[0])
        trees.append({"accepted_indices": list(s.accepted_path),
                      "tree": {"node_token_ids": tree.node_token_ids[0, 1:n].tolist(),
                               "node_depths": tree.depths[0, 1:n].tolist(), "parents": tree.parents[0, :n].tolist()}})
    return {"output_ids": [prompt + list(meta["generated_token_ids"])[:committed]], "num_input_tokens": len(prompt),
            "acceptance_lengths": [len(s.accepted_path) for s in steps], "round_trees": trees}


def test_the_fixture_reference_runs_are_not_this_targets(target):
    """The fixtures' token ids are hand-made (a Qwen3-sized vocabulary): the greedy one is not
    compared, and the check says why instead of passing."""
    result = check_greedy_decoding(dl.load(REF / "generate_result.pt"), target)
    assert not result.ran and "outside the target's vocabulary (49152 ids): not a run of this target" in result.why
    unknown = check_greedy_decoding(dl.load(REF / "generate_result.jsonl"), target)
    assert not unknown.ran and "greedy or sampled is unknown" in unknown.why


def test_a_greedy_reference_run_against_plain_greedy_decoding(target, tmp_path):
    doc = reference_layout(dl.load(GREEDY), request=0, rounds=6)
    clean = tmp_path / "clean.json"
    clean.write_text(json.dumps({"responses": [{"ddtree_tb32": doc}], "args": {"temperature": 0.0}}))
    run = dl.load(clean)
    assert run.source == "ddtree reference" and not run.problems and len(run.steps) == 6
    result = diagnose(run, model=(target, None))
    (decoding,) = [r for r in result.results if r.check == "greedy-decoding"]
    assert decoding.ran and decoding.checked == 1 and decoding.findings == [], decoding.line()
    # plant a divergence: the bonus token of round 3 (the reader checks accepted nodes against the tree, not bonuses)
    prompt_len = doc["num_input_tokens"]
    pos = prompt_len + sum(doc["acceptance_lengths"][:4])  # round 3's bonus = round 4's root
    ids = doc["output_ids"][0]
    recorded = (ids[pos] + 1) % target.vocab_size
    ids[pos] = recorded
    planted = tmp_path / "planted.json"
    planted.write_text(json.dumps({"responses": [{"ddtree_tb32": doc}], "args": {"temperature": 0.0}}))
    run = dl.load(planted)
    assert not run.problems
    (finding,) = check_greedy_decoding(run, target).findings
    want = target.greedy_decode(ids[:pos], 1, stop_at_eos=False)[0]
    assert finding.request == 0 and finding.step == 3
    assert finding.evidence.startswith(f"generated token {pos - prompt_len} (position {pos}, prompt included) is "
                                       f"{recorded} ({target.token_text(recorded)!r}), the target's argmax there is "
                                       f"{want} ({target.token_text(want)!r}; margin ")


SAMPLED = ROOT / "fixtures" / "traces" / "smollm2_t08_b32.ddtrace.safetensors"


def test_a_sampled_reference_run_gets_its_rows_from_the_model_and_the_output_law(target, tmp_path):
    """A sampled reference trace records no rows: with the model, each step's rows are recomputed
    (one tree forward at its prefix), they equal what the lab recorded live for the same steps,
    the output-law check runs on them, and a bonus token the target gives probability ~0 is named."""
    from ddtree_lab.diagnosis.law import check_law_with_model, steps_with_model_rows

    live = dl.load(SAMPLED)
    request = live.steps[0].request
    doc = reference_layout(live, request=request, rounds=8)
    path = tmp_path / "sampled.json"
    path.write_text(json.dumps({"responses": [{"ddtree_tb32": doc}], "args": {"temperature": 0.8}}))
    run = dl.load(path)
    assert run.source == "ddtree reference" and not run.problems and len(run.steps) == 8
    rebuilt, notes = steps_with_model_rows(run, target, run.steps)
    assert len(rebuilt) == 8 and notes == []
    recorded = sorted(live.for_request(request), key=lambda s: s.step)[:8]
    for got, want in zip(rebuilt, recorded):
        assert got.params.temperature == 0.8 and got.bonus is not None and got.bonus.node == want.bonus.node
        assert torch.allclose(got.child_probs, want.child_probs, atol=2e-4), (got.step, got.child_probs, want.child_probs)
    result = diagnose(run, model=(target, None))
    (law,) = [r for r in result.results if r.check == "output-law"]
    assert law.ran and law.checked == 8 and law.findings == [], law.line()
    assert "rows recomputed by the target for 8 sampled step(s)" in law.note
    # plant round 3's bonus: the token the target gives the least probability at that node
    node = rebuilt[3].bonus.node
    cache, _, _ = target.prefill(list(doc["output_ids"][0][: rebuilt[3].prefix_len]))
    row = target.tree_forward(cache, rebuilt[3].verify_input()).logits[node].float()
    pos = doc["num_input_tokens"] + sum(doc["acceptance_lengths"][:4])  # round 3's bonus = round 4's root
    doc["output_ids"][0][pos] = int(row.argmin())
    path.write_text(json.dumps({"responses": [{"ddtree_tb32": doc}], "args": {"temperature": 0.8}}))
    planted = check_law_with_model(dl.load(path), target, dl.load(path).steps)
    assert planted is not None and planted.ran
    (finding,) = planted.findings
    assert finding.step == 3 and "has target p" in finding.evidence, finding.evidence
    assert "not enough draws" in planted.not_run  # 8 rounds: the statistical tests say they could not run
