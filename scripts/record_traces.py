"""Record the real traces shipped in fixtures/traces/ (used by tests and notebooks).

SmolLM2-135M-Instruct (fp32, CPU) with the shipped ridge drafter, block size 16, budget 32,
three prompts, 64 new tokens each: one greedy run and one temperature-0.8 run, recorded at
level "full" in trace format v2 (top-64 raw logits per row; see ddtree_lab.io.lab_trace). Each file is
replayed after writing, and its size per 64 generated tokens printed (goal: <= 5 MB).

    python scripts/record_traces.py [--out fixtures/traces]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import ddtree_lab as dl
from ddtree_lab import notebook

PROMPTS = [
    "Explain why the sky is blue.",
    "Write a haiku about a mountain lake.",
    "What is the difference between weather and climate?",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "fixtures" / "traces"))
    ap.add_argument("--budget", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()
    target, drafter = notebook.load_default(drafter="ridge")  # the drafter the shipped fixtures were recorded with
    runs = {
        "smollm2_greedy_b32.ddtrace.safetensors": dl.SamplingParams(temperature=0.0),
        "smollm2_t08_b32.ddtrace.safetensors": dl.SamplingParams(temperature=0.8, seed=8),
    }
    for name, params in runs.items():
        session = dl.LiveSession(target, drafter, budget=args.budget, sampling=params, seed=8)
        run = session.run(PROMPTS, max_new_tokens=args.new_tokens)
        path = dl.save_trace(run, Path(args.out) / name)
        for step in dl.load_trace(path).steps:
            dl.replay(step)
        tokens = sum(len(r["generated_token_ids"]) for r in run.metadata["requests"])
        size = path.stat().st_size
        print(f"{name}: {len(run.steps)} steps, {size / 1e6:.2f} MB, {size / tokens * 64 / 1e6:.2f} MB per 64 "
              f"generated tokens, summary {notebook.summary(run)}")


if __name__ == "__main__":
    main()
