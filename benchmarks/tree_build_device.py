"""Tree build time per step on the CPU: the host builders against the device builder (issue 36).

bs = 32, B = 64, L = 16 (15 draft depths), K = 64, draft top-k from random logits over
V = 49,152 (``randn * scale``, scale 2 and 5). Timed, median of ``--repeat`` runs, one thread:

* **heap**: :func:`ddtree_lab.build_tree_reference` (heapq, one request at a time);
* **numpy (old)**: :func:`ddtree_lab.build_tree` (vectorised numpy on the host; the live step's
  build before issue 36, which copied the top-k to the host first);
* **device (new)**: :func:`ddtree_lab.build_device.build_tree_device` with ``validate=False``
  (what the live step runs now: fixed-shape torch ops, no host read), and with the host
  check of the rows (``validate=True``).

Every result is checked equal to the heap's. On a CPU the device builder runs its torch ops
on the host, so this compares the algorithms' CPU cost, not a GPU's.

    python benchmarks/tree_build_device.py [--repeat 15] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import ddtree_lab as dl
from ddtree_lab.build_device import build_tree_device


def timed(fn, repeat: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--bs", type=int, default=32)
    ap.add_argument("--budget", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    bs, budget = args.bs, args.budget
    print(f"tree build per step, bs={bs}, B={budget}, L-1=15, K={budget}, V=49152, {args.threads} thread(s), "
          f"median of {args.repeat} (ms)")
    print(f"{'scale':>5} {'heap':>9} {'numpy(old)':>11} {'device(new)':>12} {'device+check':>13}  equal")
    for scale in (2.0, 5.0):
        g = torch.Generator().manual_seed(0)
        ids, lp = dl.draft_topk_from_logits(torch.randn(bs, 15, 49152, generator=g) * scale, k=budget)
        anchor = torch.zeros(bs, dtype=torch.int64)
        t_heap, heap = timed(lambda: dl.build_tree_reference(ids, lp, anchor, budget), max(3, args.repeat // 5))
        t_np, old = timed(lambda: dl.build_tree(ids, lp, anchor, budget), args.repeat)
        t_dev, new = timed(lambda: build_tree_device(ids, lp, anchor, budget, validate=False), args.repeat)
        t_chk, chk = timed(lambda: build_tree_device(ids, lp, anchor, budget), args.repeat)
        equal = all(t.equals(heap) for t in (old, new, chk))  # type: ignore[union-attr]
        print(f"{scale:>5} {t_heap * 1e3:>9.2f} {t_np * 1e3:>11.2f} {t_dev * 1e3:>12.2f} {t_chk * 1e3:>13.2f}  {equal}")


if __name__ == "__main__":
    main()
