"""GPU only (tests/GPU_ONLY.md, run by scripts/gpu_check.sh): the batched step on CUDA tensors
equals the CPU one, and levels light / off verify with the Triton kernels on the device."""

import pytest
import torch

import ddtree_lab as dl

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPTS = ["Name three rivers in Europe.", "Hi", "Write a short poem about the sea and the sky, please."]


@pytest.fixture(scope="module")
def models():
    from ddtree_lab import notebook

    return notebook.load_default(device="cpu"), notebook.load_default(device="cuda")


def test_draft_topk_on_cuda_equals_the_cpu_result():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 15, 49152, generator=g) * 3
    logits[0, 0, :100] = 1.0  # ties
    ids, lp = dl.draft_topk_from_logits(logits, k=256)
    ids_c, lp_c = dl.draft_topk_from_logits(logits.cuda(), k=256)
    assert ids_c.device.type == "cuda"
    assert torch.equal(ids_c.cpu(), ids)
    torch.testing.assert_close(lp_c.cpu(), lp)


def test_batched_tree_forward_on_cuda_equals_cpu(models):
    (cpu_t, _), (gpu_t, _) = models
    prompts = [cpu_t.encode_prompt(p) for p in PROMPTS]
    g = torch.Generator().manual_seed(1)
    ids, lp = dl.draft_topk_from_logits(torch.randn(3, 5, cpu_t.vocab_size, generator=g) * 4, k=4)
    tree = dl.build_tree(ids, lp, torch.tensor([5, 17, 99]), [12, 3, 6])
    vi = dl.compile_retrieve(tree, torch.tensor([len(p) for p in prompts]))
    outs = []
    for t in (cpu_t, gpu_t):
        state, _, _ = t.prefill_batch(prompts)
        outs.append(t.tree_forward_batch(state, vi).logits.cpu())
    worst = float((outs[0] - outs[1]).abs().max())
    print(f"max |cuda - cpu| batched tree logits: {worst:.2e}")
    assert worst < 2e-3


@pytest.mark.parametrize("level", ["light", "off", "full"])
def test_live_session_on_cuda_gives_the_cpu_tokens(models, level):
    (cpu_t, cpu_d), (gpu_t, gpu_d) = models
    params = [dl.SamplingParams(temperature=0.0), dl.SamplingParams(temperature=0.0), dl.SamplingParams(temperature=0.0)]
    ref = dl.LiveSession(cpu_t, cpu_d, budget=16, sampling=params).run(PROMPTS, max_new_tokens=16)
    session = dl.LiveSession(gpu_t, gpu_d, budget=16, sampling=params, record=level)
    run = session.run(PROMPTS, max_new_tokens=16)
    if level != "full":
        assert session.verify_backend == "triton"
        assert {s.backend for s in run.steps} <= {"triton"}
    for b in range(3):
        assert run.generated_tokens(b) == ref.generated_tokens(b)
    for s in run.steps:
        dl.replay(s)
    print(f"{level}: {session.num_steps} steps, stage seconds {session.stage_totals}")
