"""Accept length τ and speed of live DDTree decoding on the embedded default target.

For each configuration -- the chain (B = L-1, one node per depth: the drafter's greedy
chain, as DFlash verifies it) and DDTree at B in {8, 16, 32, 64} -- and for T = 0 and
T = 0.8, decode the prompts and report τ (accepted draft tokens + 1 per step, mean over
steps) and tokens/s, against plain decoding (one target forward per token). SmolLM2-135M
fp32 on this CPU with the ridge drafter (L = 16).

    python benchmarks/live_tau.py [--new-tokens 64] [--prompts 4]
"""

from __future__ import annotations

import argparse
import time

import torch

import ddtree_lab as dl
from ddtree_lab import lab

PROMPTS = [
    "Explain why the sky is blue.",
    "Write a short poem about the sea.",
    "What are three uses of copper?",
    "Give me a recipe for tomato soup.",
    "Describe how a bicycle works.",
    "What is the capital of Japan and what is it known for?",
]


class ChainDrafter:
    """The drafter's greedy chain: top-1 only, so the tree is one node per depth."""

    def __init__(self, drafter):
        self.inner, self.name, self.block_size = drafter, drafter.name + "-chain", drafter.block_size

    def draft_logits(self, context):
        logits = self.inner.draft_logits(context)
        top = logits.argmax(-1, keepdim=True)
        return torch.full_like(logits, float("-inf")).scatter(-1, top, 0.0)

    def metadata(self):
        return {"kind": "chain", "inner": self.inner.metadata()}


def plain_decode(target, prompts, new_tokens, temperature, seed):
    tokens = 0
    t0 = time.perf_counter()
    for b, prompt in enumerate(prompts):
        ids = target.encode_prompt(prompt)
        if temperature == 0:
            tokens += len(target.greedy_decode(ids, new_tokens))
        else:
            out = target.model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=True,
                                        temperature=temperature, top_k=0, top_p=1.0,
                                        pad_token_id=target.tokenizer.eos_token_id)
            tokens += out.shape[1] - len(ids)
    return tokens / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=4)
    args = ap.parse_args()
    torch.manual_seed(0)
    target, drafter = lab.load_default()
    prompts = PROMPTS[: args.prompts]
    print(f"live DDTree on {target.name} (fp32, CPU, {torch.get_num_threads()} threads), drafter "
          f"{drafter.name} (L={drafter.block_size}), {len(prompts)} prompts x {args.new_tokens} tokens")
    print(f"{'T':>4} {'config':>12} {'B':>4} {'tau':>6} {'steps':>6} {'tok/s':>7} {'vs plain':>8}")
    for temperature in (0.0, 0.8):
        params = dl.SamplingParams(temperature=temperature, seed=1)
        base = plain_decode(target, prompts, args.new_tokens, temperature, 1)
        print(f"{temperature:>4} {'plain':>12} {'-':>4} {'1.00':>6} {'-':>6} {base:>7.1f} {'1.00x':>8}")
        configs = [("chain", ChainDrafter(drafter), drafter.block_size - 1)] + [
            ("ddtree", drafter, b) for b in (8, 16, 32, 64)]
        for name, d, budget in configs:
            session = dl.LiveSession(target, d, budget=budget, sampling=params, seed=1)
            t0 = time.perf_counter()
            run = session.run(prompts, max_new_tokens=args.new_tokens)
            elapsed = time.perf_counter() - t0
            taus = [s.accept_length + 1 for s in run.steps]
            generated = sum(len(run.generated_tokens(b)) for b in range(len(prompts)))
            speed = generated / elapsed
            print(f"{temperature:>4} {name:>12} {budget:>4} {sum(taus) / len(taus):>6.2f} {len(run.steps):>6} "
                  f"{speed:>7.1f} {speed / base:>7.2f}x")


if __name__ == "__main__":
    main()
