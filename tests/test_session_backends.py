"""A live session runs with any verify backend, records which one ran, and its steps replay.

Without CUDA the Triton kernels run under TRITON_INTERPRET=1 (set in conftest.py before they are imported)."""

import pytest

import ddtree_lab as dl

pytestmark = pytest.mark.slow
PROMPTS = ["Why is the sky blue?", "Name a red fruit."]


@pytest.mark.parametrize("backend", ["torch-lazy", "triton"])
def test_session_backend_gives_the_reference_decisions(target, drafter, backend):
    pytest.importorskip("triton")
    params = [dl.SamplingParams(temperature=0.0), dl.SamplingParams(temperature=0.8, seed=5)]
    ref = dl.LiveSession(target, drafter, budget=8, sampling=params).run(PROMPTS, max_new_tokens=10)
    got = dl.LiveSession(target, drafter, budget=8, sampling=params, verify_backend=backend).run(PROMPTS, max_new_tokens=10)
    for b in range(2):
        assert got.generated_tokens(b) == ref.generated_tokens(b)
    want = {"torch-lazy": {"torch-lazy"}, "triton": {"triton", "triton-interpret"}}[backend]
    assert {s.backend for s in got.steps} <= want
    for a, r in zip(got.steps, ref.steps):
        assert [(d.node, d.verdict) for d in a.decisions] == [(d.node, d.verdict) for d in r.decisions]
        dl.replay(a)


def test_unknown_backend_is_named(target, drafter):
    with pytest.raises(ValueError, match="verify_backend must be one of"):
        dl.LiveSession(target, drafter, verify_backend="cuda-magic")
