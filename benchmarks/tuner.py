"""Tuner re-analysis speed: one slider move = TunerData.analyse over 1,000 recorded steps.

Goal (issue: "one slider move re-analyses 1,000 recorded steps in <= 200 ms"). The steps are
the fixture trace's steps repeated to 1,000; when the fixture is trace format v1 (no top-M
logits), its trees get synthetic v2 rows (random logits, M = 64, V = 49,152) -- the cost does
not depend on the values.

    OMP_NUM_THREADS=1 python benchmarks/tuner.py [--steps 1000] [--repeats 15]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

import torch

from ddtree_lab import load_trace
from ddtree_lab.analysis import TunerData
from ddtree_lab.sampling import SamplingParams

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "traces" / "smollm2_t08_b32.ddtrace.safetensors"


def synthetic_v2(step, m: int, vocab: int, g: torch.Generator):
    n = step.num_nodes
    logits = torch.sort(torch.randn(n, m, generator=g) * 3 + 5, -1, descending=True).values
    ids = torch.stack([torch.randperm(vocab, generator=g)[:m] for _ in range(n)])
    # place each child's token in its parent's row half the time
    node_logits = torch.full((n,), float("nan"))
    for i in range(1, n):
        p = int(step.parents[i])
        if i % 2:
            ids[p, i % m] = step.node_token_ids[i]
            node_logits[i] = logits[p, i % m]
        else:
            node_logits[i] = float(logits[p, -1]) - 1.0
    lse = torch.logsumexp(logits.double(), -1) + 0.05
    return SimpleStep(step, ids, logits, lse, node_logits)


class SimpleStep:
    def __init__(self, step, ids, logits, lse, node_logits):
        self.__dict__.update({f.name: getattr(step, f.name) for f in dataclasses.fields(step)})
        self.num_nodes = step.num_nodes
        self.accept_length = step.accept_length
        self.row_logit_ids, self.row_logits, self.row_logsumexp, self.node_logits = ids, logits, lse, node_logits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(1)
    run = load_trace(FIXTURE)
    vocab = int(run.metadata.get("vocab_size") or run.metadata["target"]["vocab_size"])
    base = run.steps
    v2 = getattr(base[0], "row_logits", None) is not None
    if not v2:
        g = torch.Generator().manual_seed(0)
        base = [synthetic_v2(s, 64, vocab, g) for s in base]
    steps = [base[k % len(base)] for k in range(args.steps)]
    t0 = time.perf_counter()
    data = TunerData.from_steps(steps, vocab)
    pack = time.perf_counter() - t0
    settings = [SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(temperature=1.0),
                SamplingParams(temperature=0.8, top_k=20), SamplingParams(temperature=1.3, top_k=200, min_p=0.02),
                SamplingParams(temperature=0.0)]
    print(f"{args.steps} steps, {data.num_nodes} nodes, M = {data.top_m}, V = {vocab}, "
          f"{'fixture v2 rows' if v2 else 'synthetic v2 rows on the fixture trees'}; pack once: {pack * 1e3:.0f} ms")
    for p in settings:
        for budget in (32, 16):
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                res = data.analyse(p, budget)
                times.append(time.perf_counter() - t0)
            lo, hi = res.mean_tau
            print(f"  {str(p.to_dict()):<78} B'={budget:<3} analyse median {statistics.median(times) * 1e3:6.1f} ms "
                  f"(min {min(times) * 1e3:.1f})  mean tau in [{lo:.3f}, {hi:.3f}]")
    print("goal: <= 200 ms per analyse over 1,000 steps")


if __name__ == "__main__":
    main()
