"""Live DDTree sessions on the embedded default target."""

import pytest

import ddtree_lab as dl

pytestmark = pytest.mark.slow

PROMPTS = [
    "Explain why the sky is blue.",
    "Write a short poem about the sea.",
    "What are three uses of copper?",
    "Give me a recipe for tomato soup.",
    "Describe how a bicycle works.",
]


def _explain_mismatch(target, prompt_ids, greedy, spec, run, request):
    k = next(i for i, (a, b) in enumerate(zip(greedy, spec)) if a != b)
    _, _, logits = target.prefill(prompt_ids + greedy[:k])
    row = logits[-1]
    a, b = greedy[k], spec[k]
    where = "prefill"
    count = 1
    for s in run.for_request(request):
        if count + len(s.emitted) > k:
            where = f"step {s.step}, node path {s.accepted_path}"
            break
        count += len(s.emitted)
    return (f"request {request}: token {k} differs at {where}: greedy {a} (logit {row[a]:.6f}) vs "
            f"DDTree {b} (logit {row[b]:.6f}); tie: {bool(row[a] == row[b])}")


def test_greedy_ddtree_equals_plain_greedy_decoding(target, drafter):
    session = dl.LiveSession(target, drafter, budget=16, sampling=dl.SamplingParams(temperature=0.0))
    run = session.run(PROMPTS, max_new_tokens=64)
    taus = []
    for b, prompt in enumerate(PROMPTS):
        ids = target.encode_prompt(prompt)
        greedy = target.greedy_decode(ids, 64)
        spec = run.generated_tokens(b)
        if greedy != spec:
            pytest.fail(_explain_mismatch(target, ids, greedy, spec, run, b))
        assert len(spec) == 64 or spec[-1] in target.eos_token_ids
        taus += [s.accept_length + 1 for s in run.for_request(b)]
    print(f"greedy equivalence: {len(PROMPTS)} prompts x {64} tokens identical; mean tau {sum(taus) / len(taus):.2f}")


def test_sampled_batch_with_mixed_params_records_replayable_steps(target, drafter, tmp_path):
    params = [dl.SamplingParams(temperature=0.8, seed=1), dl.SamplingParams(temperature=0.0),
              dl.SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=3)]
    session = dl.LiveSession(target, drafter, budget=[32, 8, 16], sampling=params)
    run = session.run(PROMPTS[:3], max_new_tokens=24)
    assert {s.request for s in run.steps} == {0, 1, 2}
    for s in run.steps:
        assert s.num_nodes <= 1 + [32, 8, 16][s.request]
        dl.check_retrieve(s.verify_input(), s.node_logws[None])
        dl.replay(s)
    path = dl.save_trace(run, tmp_path / "run.ddtrace.safetensors")
    loaded = dl.load_trace(path)
    assert len(loaded.steps) == len(run.steps)
    for s in loaded.steps:
        dl.replay(s)
    for b in range(3):
        assert loaded.generated_tokens(b) == run.generated_tokens(b)
        assert session.text(b) == target.decode(run.generated_tokens(b))


def test_session_rejects_bad_input(target, drafter):
    with pytest.raises(ValueError, match=r"SamplingParams: top_p must be in \(0, 1\], got 0.0"):
        dl.SamplingParams(top_p=0.0)  # refused when made, before any session sees it
    with pytest.raises(ValueError, match="request 1: top_k = 100000 exceeds the vocabulary size 49152"):
        dl.LiveSession(target, drafter, sampling=[dl.SamplingParams(), dl.SamplingParams(1.0, top_k=100000)]).run(
            ["a", "b"], max_new_tokens=4)
    with pytest.raises(ValueError, match="block_size 8 != the drafter's block size 16"):
        dl.LiveSession(target, drafter, block_size=8)
    with pytest.raises(ValueError, match="request 0: prompt must be a non-empty string"):
        dl.LiveSession(target, drafter).run([""], max_new_tokens=4)
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1"):
        dl.LiveSession(target, drafter).run("hi", max_new_tokens=0)
