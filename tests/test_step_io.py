"""One recorded step, one loader, one replay, one check (issue 15): the contract on every source."""

from pathlib import Path

import pytest
import torch

import ddtree_lab as dl
from ddtree_lab.io import bundle as bd

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "fixtures"
TRACES = sorted((FIX / "traces").glob("*.ddtrace.safetensors"))

SOURCES = {
    FIX / "traces" / "smollm2_t08_b32.ddtrace.safetensors": "lab trace",
    FIX / "sglang_cpu_recording.json": "sglang recording",
    FIX / "ddtree_reference" / "generate_result.jsonl": "ddtree reference",
    FIX / "ddtree_reference" / "generate_result.pt": "ddtree reference",
    FIX / "ddtree_reference" / "fork_traces.json": "ddtree reference",
    FIX / "engine_summaries" / "vllm_offline_detailed.json": "engine summary",
    FIX / "engine_summaries" / "sglang_generate.jsonl": "engine summary",
}


@pytest.mark.parametrize("path", list(SOURCES), ids=[p.name for p in SOURCES])
def test_load_opens_every_source_and_names_it(path):
    run = dl.load(path)
    assert dl.source_of(path) == SOURCES[path] == run.source
    assert not run.problems
    for s in run.steps:
        assert isinstance(s, dl.Step)
        assert s.output is None or s.accept_length == int(s.output.accept_length[0])


def test_a_bundle_opens_through_load_and_replays(tmp_path):
    run = dl.load(TRACES[0])
    step = run.steps[5]
    path = bd.save_bundle(bd.make_bundle(run, step), tmp_path / "b")
    for where in (path, path / "bundle.safetensors"):
        got = dl.load(where)
        assert got.source == "bundle" and len(got.steps) == 1
        (s,) = got.steps
        assert s.rows.kind == "bundle" and s.rows.cannot("display") and s.rows.cannot("replay") is None
        assert dl.replay_differences(s, got.vocab_size)[1] == []
        assert dl.compare_outputs(dl.replay(step), dl.replay(s)) == []


def test_the_stage_objects_are_the_record():
    run = dl.load(TRACES[0])
    s = run.steps[3]
    assert isinstance(s.tree, dl.DDTreeBuildResult) and isinstance(s.buffers, dl.DDTreeVerifyInput)
    assert isinstance(s.draft, dl.DraftTopK) and isinstance(s.rows, dl.TargetRows)
    assert s.verify_input() is s.buffers  # nothing is rebuilt from flat fields
    assert torch.equal(s.parents, s.tree.parents[0]) and torch.equal(s.positions, s.buffers.positions[0])
    assert s.missing_stages() == []
    ref = dl.load(FIX / "ddtree_reference" / "generate_result.jsonl").steps[0]
    assert set(ref.missing_stages()) == {"draft", "buffers", "params", "coins", "rows"}
    with pytest.raises(ValueError, match="nothing to replay"):
        dl.replay(ref)


def test_replay_with_another_backend_says_what_the_rows_lack():
    s = dl.load(TRACES[0]).steps[0]
    with pytest.raises(ValueError, match="needs the whole target rows.*backend 'reference'"):
        dl.replay(s, backend="triton")


def test_check_reports_every_broken_invariant_at_once():
    s = dl.load(TRACES[0]).steps[7]
    assert dl.check(s) == []
    nt = s.retrieve_next_sibling.clone()
    first = int(s.retrieve_next_token[0])
    nt[first] = first  # a node that is its own next sibling: a cycle
    cp = s.child_probs.clone()
    cp[1] = 1.5
    coins = s.coins.clone()
    coins[2] = 1.0
    out = s.output
    bad_out = dl.VerifyOutput(**{**out.__dict__, "emitted_tokens": out.emitted_tokens.clone()})
    bad_out.emitted_tokens[0, 0] = (int(bad_out.emitted_tokens[0, 0]) + 1) % 1000
    broken = s.replace(retrieve_next_sibling=nt, child_probs=cp, coins=coins, output=bad_out)
    parts = {p.part for p in dl.check(broken)}
    assert {"buffers", "rows", "coins", "output"} <= parts, dl.check(broken)
    assert all(str(p).startswith(f"step {s.step}, request {s.request}") for p in dl.check(broken))
    assert dl.check(s) == []  # replace() copied: the original is untouched


def test_a_damaged_step_costs_that_step_only(tmp_path):
    data = bytearray(TRACES[0].read_bytes())
    header = int.from_bytes(data[:8], "little")
    data[8 + header + 10] ^= 0xFF  # inside the first tensor of step record 0
    bad = tmp_path / "bad.ddtrace.safetensors"
    bad.write_bytes(bytes(data))
    whole, run = dl.load(TRACES[0]), dl.load(bad)
    assert len(run.problems) == 1 and "checksum" in run.problems[0]
    assert len(run.steps) == len(whole.steps) - 1
    for a, b in zip(whole.steps[1:], run.steps):
        assert (a.step, a.request) == (b.step, b.request) and dl.compare_outputs(a.output, dl.replay(b)) == []


@pytest.mark.slow
@pytest.mark.parametrize("path", TRACES, ids=[p.name for p in TRACES])
def test_every_bundle_of_the_fixture_traces_replays_exactly(path, tmp_path):
    run = dl.load(path)
    for k, step in enumerate(run.steps):
        b = bd.make_bundle(run, step)
        b.svg = ""  # the diagram is not what is replayed
        saved = bd.save_bundle(b, tmp_path / f"b{k}")
        (s,) = dl.load(saved).steps
        assert dl.compare_outputs(dl.replay(step), dl.replay(s)) == [], (step.step, step.request)
