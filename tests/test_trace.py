"""Trace files: the shipped real traces load, replay bit for bit, stay small; bad files fail clearly."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import ddtree_lab as dl

TRACES = Path(__file__).resolve().parent.parent / "fixtures" / "traces"
GREEDY = TRACES / "smollm2_greedy_b32.ddtrace.safetensors"
SAMPLED = TRACES / "smollm2_t08_b32.ddtrace.safetensors"


@pytest.mark.parametrize("path", [GREEDY, SAMPLED], ids=["greedy", "t0.8"])
def test_shipped_traces_replay_bit_for_bit(path):
    run = dl.load_trace(path)
    assert run.metadata["target"]["name"] == "SmolLM2-135M-Instruct"
    assert len(run.metadata["requests"]) == 3
    for step in run.steps:
        dl.replay(step)
        dl.check_retrieve(step.verify_input(), step.node_logws[None])
    for b in range(3):
        generated = run.generated_tokens(b)
        assert len(generated) == 64 or generated[-1] == 2
        # the steps' emitted tokens rebuild the committed text (after the prefill's first token)
        emitted = [t for s in run.for_request(b) for t in s.emitted]
        assert emitted[: len(generated) - 1] == generated[1:]


def test_trace_size_goal_64_tokens_at_b32():
    # goal: <= 5 MB for 64 generated tokens at B = 32 (the files hold 3 prompts x 64 tokens)
    for path in (GREEDY, SAMPLED):
        per_64 = path.stat().st_size / 3
        print(f"{path.name}: {path.stat().st_size / 1e6:.2f} MB for 3 x 64 tokens, {per_64 / 1e6:.3f} MB per 64 tokens")
        assert per_64 <= 5e6


def test_replay_detects_a_tampered_step():
    run = dl.load_trace(SAMPLED)
    step = next(s for s in run.steps if s.decisions)
    step.coins[step.decisions[0].parent] = 0.9999 if step.decisions[0].verdict == "accept" else 0.0
    with pytest.raises(dl.ReplayMismatch, match=f"step {step.step}, request {step.request}"):
        dl.replay(step)


def test_truncation_bound_reported():
    run = dl.load_trace(SAMPLED)
    bound = run.steps[0].truncation_bound()
    assert bound.shape == (run.steps[0].num_nodes,)
    assert bool((bound >= 0).all()) and bool((bound <= 1).all())


def test_bad_files_fail_with_clear_errors(tmp_path):
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x00" * 64)
    with pytest.raises(dl.TraceFormatError, match="not a safetensors file"):
        dl.load_trace(junk)
    plain = tmp_path / "plain.safetensors"
    save_file({"x": torch.zeros(2)}, str(plain))
    with pytest.raises(dl.TraceFormatError, match="not a ddtree-lab trace"):
        dl.load_trace(plain)
    future = tmp_path / "future.safetensors"
    save_file({"x": torch.zeros(2)}, str(future),
              metadata={"ddtree_lab": json.dumps({"format": "ddtree-lab-trace", "version": 99, "steps": []})})
    with pytest.raises(dl.TraceFormatError, match="trace version 99"):
        dl.load_trace(future)
    run = dl.load_trace(GREEDY)
    broken = tmp_path / "broken.safetensors"
    from safetensors import safe_open

    with safe_open(str(GREEDY), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if k != "3.coins"}
        meta = f.metadata()
    save_file(tensors, str(broken), metadata=meta)
    with pytest.raises(dl.TraceFormatError, match="step 3: tensor field 'coins' is missing"):
        dl.load_trace(broken)
    assert len(run.steps) > 3


def test_a_trace_with_invalid_params_or_broken_buffers_is_refused(tmp_path):
    from safetensors import safe_open

    with safe_open(str(GREEDY), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        doc = json.loads(f.metadata()["ddtree_lab"])
    doc["steps"][2]["params"]["temperature"] = -1
    bad = tmp_path / "bad_params.safetensors"
    save_file(tensors, str(bad), metadata={"ddtree_lab": json.dumps(doc)})
    with pytest.raises(dl.TraceFormatError, match="step 2: params: temperature must be finite and >= 0"):
        dl.load_trace(bad)
    run = dl.load_trace(GREEDY)
    step = next(s for s in run.steps if s.num_nodes > 2)
    step.retrieve_next_token[1] = 0  # points back at the root
    with pytest.raises(dl.ReplayMismatch, match="recorded buffers are broken"):
        dl.replay(step)
