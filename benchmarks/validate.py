"""What the default buffer validation costs each verify call (``check_verify_buffers``).

Every verifier backend validates its buffers before walking (``validate=True``); this prints
the median time of that check for DDTree trees of several budgets and batch sizes, so timing
runs know what ``validate=False`` removes. CPU, one thread.

    python benchmarks/validate.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import ddtree_lab as dl


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"check_verify_buffers on CPU, 1 thread, median of {args.repeat}; load average "
          f"{os.getloadavg()[0]:.1f} (shared machine: expect noise)")
    print(f"{'bs':>3} {'N':>4} {'ms / call':>9} {'us / node':>9}")
    g = torch.Generator().manual_seed(0)
    for bs in (1, 8, 32):
        for budget in (32, 128, 256):
            ids, lp = dl.draft_topk_from_logits(torch.randn(bs, 15, 2048, generator=g) * 2, k=min(budget, 64))
            tree = dl.build_tree(ids, lp, torch.randint(0, 2048, (bs,), generator=g), budget)
            vi = dl.compile_retrieve(tree, 100)
            dl.check_verify_buffers(vi)
            times = []
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                dl.check_verify_buffers(vi)
                times.append(time.perf_counter() - t0)
            t = statistics.median(times)
            nodes = int(vi.num_nodes.sum())
            print(f"{bs:>3} {vi.num_rows:>4} {t * 1e3:>9.2f} {t * 1e6 / nodes:>9.2f}")


if __name__ == "__main__":
    main()
