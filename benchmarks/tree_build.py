"""Batched tree builder against the per-request heapq reference.

Shape from the core issue: bs=64, B=256, L=16 (15 draft depths), K=8. The draft top-k comes
from random logits over V=32,000 at three sharpness levels (mean top-1 draft probability
printed), since the best-first search does more work on flat drafts than on sharp ones.
Prints the median of several runs of each builder and the ratio (goal: >= 20x). The two
builders run alternately, so both see the same load on a shared machine; the wall-clock
medians come first, then the medians of CPU time of this process (less sensitive to other
programs on the machine).

    python benchmarks/tree_build.py [--repeat 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import ddtree_lab as dl


def _time_both(ref, fast, repeat):
    """Median wall and CPU seconds of ``ref`` and ``fast``, run alternately after a warm-up."""
    ref(), fast()
    runs = {"ref": ([], []), "fast": ([], [])}
    for _ in range(repeat):
        for name, fn in (("ref", ref), ("fast", fast)):
            w0, c0 = time.perf_counter(), time.process_time()
            fn()
            runs[name][0].append(time.perf_counter() - w0)
            runs[name][1].append(time.process_time() - c0)
    return {name: (statistics.median(w), statistics.median(c)) for name, (w, c) in runs.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--bs", type=int, default=64)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--k", type=int, default=8)
    args = ap.parse_args()
    print(f"tree build, bs={args.bs} B={args.budget} L={args.block_size} K={args.k}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, median of {args.repeat}")
    print(f"{'draft logits scale':>18} {'mean top-1 p':>12} {'reference ms':>12} {'batched ms':>10} {'ratio':>6}"
          f" | {'cpu: reference ms':>17} {'batched ms':>10} {'ratio':>6}")
    for scale in (2.0, 4.0, 6.0):
        g = torch.Generator().manual_seed(0)
        logits = torch.randn(args.bs, args.block_size - 1, 32_000, generator=g) * scale
        ids, lp = dl.draft_topk_from_logits(logits, k=args.k)
        anchor = torch.zeros(args.bs, dtype=torch.int64)
        fast = dl.build_tree(ids, lp, anchor, args.budget)
        ref = dl.build_tree_reference(ids, lp, anchor, args.budget)
        assert fast.equals(ref), "batched and reference trees differ"
        t = _time_both(
            lambda: dl.build_tree_reference(ids, lp, anchor, args.budget),
            lambda: dl.build_tree(ids, lp, anchor, args.budget),
            args.repeat,
        )
        (w_ref, c_ref), (w_fast, c_fast) = t["ref"], t["fast"]
        top1 = lp[..., 0].exp().mean().item()
        print(f"{scale:>18.1f} {top1:>12.3f} {w_ref * 1e3:>12.1f} {w_fast * 1e3:>10.2f} {w_ref / w_fast:>5.1f}x"
              f" | {c_ref * 1e3:>17.1f} {c_fast * 1e3:>10.2f} {c_ref / c_fast:>5.1f}x")


if __name__ == "__main__":
    main()
