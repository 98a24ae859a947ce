"""Bug-report bundles: one verify step, reduced, self-contained, checksummed, replayed exactly."""

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ddtree_lab as dl
from ddtree_lab.io import bundle as bd

ROOT = Path(__file__).resolve().parent.parent
GREEDY = ROOT / "fixtures" / "traces" / "smollm2_greedy_b32.ddtrace.safetensors"
SAMPLED = ROOT / "fixtures" / "traces" / "smollm2_t08_b32.ddtrace.safetensors"
RECORDING = ROOT / "fixtures" / "sglang_cpu_recording"


@pytest.fixture(scope="module")
def sampled():
    return dl.load_trace(SAMPLED)


def _picks(run):
    """A few telling steps: the biggest bonus token, a leaf bonus, a residual draw after
    rejected siblings, the largest tree."""
    steps = run.steps
    picks = [max(steps, key=lambda s: s.bonus_token),
             next(s for s in steps if s.bonus.kind == "leaf"),
             max((s for s in steps if s.bonus.kind == "residual"), key=lambda s: len(s.decisions)),
             max(steps, key=lambda s: s.num_nodes)]
    return list({(s.step, s.request): s for s in picks}.values())


@pytest.mark.parametrize("path", [GREEDY, SAMPLED], ids=["greedy", "t0.8"])
def test_the_bonus_row_reduction_is_exact_on_every_fixture_step(path):
    # the float64 running sum the inverse-CDF draw reads is the same from the chunk on
    run = dl.load_trace(path)
    reduced = 0
    for s in run.steps:
        c, base, tail = bd.reduce_bonus_row(s)
        assert tail.numel() <= max(bd.CHUNK, s.final_row_prefix.numel() if c == 0 else 0)
        if s.bonus_token < 0:
            continue
        rejected = bd.children_tokens(s, s.bonus.node)
        dense = bd.dense_prefix(c, base, tail, rejected)
        full_cum = bd.residual_cumsum(s.final_row_prefix, rejected)
        got_cum = bd.residual_cumsum(dense, rejected)
        assert torch.equal(got_cum[max(c - 1, 0):], full_cum[max(c - 1, 0):])
        reduced += c > 0
    assert reduced > len(run.steps) // 2  # most bonus tokens lie past the first chunk


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0, 1, width=32, allow_subnormal=True), min_size=1, max_size=300))
def test_float32_pieces_sum_exactly_to_a_float64_running_sum(values):
    base = float(torch.tensor(values, dtype=torch.float32).double().cumsum(0)[-1])
    pieces = bd.float32_pieces(base)
    assert len(pieces) <= 3
    total = 0.0
    for p in pieces:
        assert p >= 0 and p.dtype == np.float32
        total = total + float(p)
    assert total == base


def test_bundles_replay_like_the_trace_and_stay_small(sampled, tmp_path):
    for s in _picks(sampled) + _picks(dl.load_trace(GREEDY)):
        b = bd.make_bundle(sampled if s in sampled.steps else dl.load_trace(GREEDY), s.step, s.request)
        out = bd.save_bundle(b, tmp_path / f"b{s.step}_{s.request}_{s.params.temperature}")
        size = sum(p.stat().st_size for p in out.iterdir())
        print(f"step {s.step} request {s.request} T={s.params.temperature}: {s.num_nodes} nodes, bonus token "
              f"{s.bonus_token}, tail {b.final_row_tail.numel()} floats from {b.final_row_start}: {size / 1e3:.1f} kB")
        assert size <= 200e3
        assert sorted(p.name for p in out.iterdir()) == ["README.md", "bundle.safetensors", "tree.svg"]
        back = bd.load_bundle(out)
        assert back.step.decisions == s.decisions and back.step.emitted == s.emitted
        assert back.svg.startswith("<?xml") and "<svg" in back.svg
        readme = (out / "README.md").read_text()
        assert "ddtree-lab replay ." in readme and "## Request" in readme and "Prompt: " in readme
        assert {t for t in s.node_token_ids.tolist()} <= set(back.token_texts)
        result = bd.replay_bundle(out)
        assert result.ok, result.lines()
        assert torch.equal(result.output.emitted_tokens, dl.replay(s).emitted_tokens)
        assert result.output.bonus[0] == dl.replay(s).bonus[0]


def test_a_bundle_reports_where_it_differs_from_its_recorded_output(sampled, tmp_path):
    s = next(x for x in sampled.steps if x.decisions and x.decisions[0].verdict == "accept")
    b = bd.make_bundle(sampled, s.step, s.request)
    d = s.decisions[0]
    b.step.coins[d.parent] = 0.99999  # the engine's coin disagrees with its own verdict
    out = bd.save_bundle(b, tmp_path / "bad")
    result = bd.replay_bundle(out)
    assert not result.ok
    fields = [x.field for x in result.differences]
    assert fields[:2] == ["decision 0 coin", "decision 0 verdict"] and result.differences[1].node == d.node
    assert "accept_index" in fields


def test_a_corrupted_bundle_is_refused_naming_the_field(sampled, tmp_path):
    s = _picks(sampled)[0]
    out = bd.save_bundle(bd.make_bundle(sampled, s.step, s.request), tmp_path / "b")
    path = out / "bundle.safetensors"
    raw = bytearray(path.read_bytes())
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + size])
    raw[8 + size + header["0.final_row_tail"]["data_offsets"][0] + 2] ^= 0x40
    path.write_bytes(bytes(raw))
    with pytest.raises(dl.TraceFormatError, match=r"bundle.safetensors: step 0: field 'final_row_tail': checksum mismatch"):
        bd.replay_bundle(out)


def test_save_bundle_refuses_what_it_was_not_asked_for(sampled, tmp_path):
    s = sampled.steps[0]
    b = bd.make_bundle(sampled, s.step, s.request)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        bd.save_bundle(b, tmp_path / "no" / "dir")
    assert not (tmp_path / "no").exists()
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="notes.txt"):
        bd.save_bundle(b, busy)
    again = bd.save_bundle(b, bd.save_bundle(b, tmp_path / "twice"))  # a previous bundle is replaced
    assert bd.replay_bundle(again).ok
    with pytest.raises(KeyError, match="request 0 has no step 999"):
        bd.make_bundle(sampled, 999, 0)


def test_bundles_of_an_sglang_recording_replay(tmp_path):
    from ddtree_lab.sglang import load_recording, recording_to_trace

    run = recording_to_trace(load_recording(RECORDING))
    assert run.steps
    for s in run.steps:
        out = bd.save_bundle(bd.make_bundle(run, s.step, s.request), tmp_path / f"s{s.step}_{s.request}")
        result = bd.replay_bundle(out)
        assert result.ok, result.lines()
        assert result.output.emitted_tokens[0].tolist()[: len(s.emitted)] == s.emitted


def test_make_bundle_takes_a_step_trace_and_replays_with_the_reference_only(sampled):
    s = sampled.steps[5]
    b = bd.make_bundle(sampled, s)
    assert (b.step.step, b.step.request) == (s.step, s.request)
    assert bd.replay_bundle(b, backend="reference").ok
    with pytest.raises(ValueError, match="reference verifier only, not 'triton'"):
        bd.replay_bundle(b, backend="triton")
