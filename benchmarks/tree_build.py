"""Draft logits -> tree -> verify buffers: the lab's batched path, the authors' per-request path,
and the memory floor.

Shape from issue 11: bs=64, B=256, L=16 (15 draft depths), K=min(B, V), V in {49,152, 151,936},
float32 draft logits (``randn * scale``; the mean top-1 draft probability is printed).

* **lab**: :func:`ddtree_lab.draft_topk_from_logits` (no vocabulary sort, one normaliser pass),
  :func:`ddtree_lab.build_tree` (whole batch) and :func:`ddtree_lab.compile_retrieve` (retrieve
  buffers, tree mask, positions).
* **authors**: the per-request path of the DDTree reference implementation
  (liranringel/ddtree, ``ddtree.py``, ``build_ddtree_tree``; Ringel & Romano, arXiv 2604.12989,
  Algorithm 1), written here from its description, one request at a time: ``torch.topk`` over
  V and ``torch.logsumexp`` for the log-probs, the best-first heap over rank tuples, the
  ancestor ("visibility") matrix row by row.
* **floor**: one read of the logits (a max-reduction over V), the least any exact top-k must do.

Goals on a CPU with one thread each side: lab >= 2x faster than authors, lab within 3x of
the floor. The three run alternately (same load on a shared machine); medians of wall time,
then of this process's CPU time, are printed.
A second table times the batched tree builder alone against the per-request heapq
reference of ``ddtree_lab.build_tree_reference`` (K=8, V=32,000).

    python benchmarks/tree_build.py [--repeat 5] [--vocab 49152 151936] [--threads 1]
"""

from __future__ import annotations

import argparse
import heapq
import statistics
import time

import numpy as np
import torch

import ddtree_lab as dl


def authors_tree(logits: torch.Tensor, budget: int):
    """One request, as the reference ``ddtree.py`` does it: ``logits [L-1, V]`` float32 ->
    ``(tokens [n], depths [n], parents [1+n], visibility [1+n, 1+n] bool)``."""
    k = min(budget, logits.shape[-1])
    depth_limit = logits.shape[0]
    top, top_ids = torch.topk(logits, k, dim=-1)
    lp = (top - torch.logsumexp(logits, dim=-1, keepdim=True)).numpy()
    ids = top_ids.numpy()
    tokens = np.empty(budget, np.int64)
    depths = np.empty(budget, np.int64)
    parents = np.empty(budget + 1, np.int64)
    parents[0] = -1
    # heap entries: (-log-weight, rank tuple, parent index, depth, rank at depth, log-weight)
    heap = [(-float(lp[0, 0]), (0,), 0, 1, 0, float(lp[0, 0]))]
    n = 0
    while heap and n < budget:
        _, ranks, parent, depth, rank, logw = heapq.heappop(heap)
        tokens[n], depths[n] = ids[depth - 1, rank], depth
        n += 1
        parents[n] = parent
        if rank + 1 < k:
            w = logw - float(lp[depth - 1, rank]) + float(lp[depth - 1, rank + 1])
            heapq.heappush(heap, (-w, ranks[:-1] + (rank + 1,), parent, depth, rank + 1, w))
        if depth < depth_limit:
            w = logw + float(lp[depth, 0])
            heapq.heappush(heap, (-w, ranks + (0,), n, depth + 1, 0, w))
    vis = np.zeros((n + 1, n + 1), dtype=bool)
    vis[0, 0] = True
    for i in range(1, n + 1):
        vis[i, :i] = vis[parents[i], :i]
        vis[i, i] = True
    return tokens[:n], depths[:n], parents[: n + 1], vis


def authors_path(logits: torch.Tensor, budget: int):
    return [authors_tree(logits[b], budget) for b in range(logits.shape[0])]


def lab_path(logits: torch.Tensor, budget: int, anchor: torch.Tensor, prefix: torch.Tensor):
    ids, lp = dl.draft_topk_from_logits(logits, k=min(budget, logits.shape[-1]))
    tree = dl.build_tree(ids, lp, anchor, budget)
    return dl.compile_retrieve(tree, prefix)


def floor_path(logits: torch.Tensor):
    return logits.amax(-1)


def _time(fns: dict, repeat: int, cpu: bool = False) -> dict:
    """Median wall (or, with ``cpu``, process CPU) seconds of each function, run alternately
    after one warm-up each. CPU time is less sensitive to other programs on a shared machine."""
    for fn in fns.values():
        fn()
    clock = time.process_time if cpu else time.perf_counter
    runs = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            t0 = clock()
            fn()
            runs[name].append(clock() - t0)
    return {name: statistics.median(v) for name, v in runs.items()}


def _same_trees(vi, authors) -> bool:
    """The lab's tree holds the authors' nodes (same tokens at the same depths per request)."""
    for b, (tokens, depths, _parents, vis) in enumerate(authors):
        n = int(vi.num_nodes[b])
        if n != 1 + tokens.shape[0]:
            return False
        lab = sorted(zip(vi.depths[b, 1:n].tolist(), vi.node_token_ids[b, 1:n].tolist()))
        if lab != sorted(zip(depths.tolist(), tokens.tolist())):
            return False
        if int(vi.tree_mask[b, :n, :n].sum()) != int(vis.sum()):
            return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--bs", type=int, default=64)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--vocab", type=int, nargs="+", default=[49_152, 151_936])
    ap.add_argument("--scale", type=float, default=3.0, help="draft logits = randn * scale")
    ap.add_argument("--threads", type=int, default=1, help="torch threads, both sides (default 1)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (lab and floor on the device; "
                    "the authors' path copies its top-k to the host as theirs does)")
    ap.add_argument("--skip-builders", action="store_true", help="skip the builder-only table")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    print(f"draft logits -> tree -> verify buffers, bs={args.bs} B={args.budget} L={args.block_size} "
          f"K=min(B,V), fp32 on {dev}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"median of {args.repeat}")
    print(f"{'V':>8} {'top-1 p':>8} {'authors ms':>11} {'lab ms':>9} {'floor ms':>9} "
          f"{'authors/lab':>12} {'lab/floor':>10}   goals: authors/lab >= 2, lab/floor <= 3")
    for vocab in args.vocab:
        g = torch.Generator().manual_seed(0)
        logits = (torch.randn(args.bs, args.block_size - 1, vocab, generator=g) * args.scale).to(dev)
        anchor = torch.zeros(args.bs, dtype=torch.int64)
        prefix = torch.full((args.bs,), 100, dtype=torch.int64)
        vi = lab_path(logits, args.budget, anchor, prefix)
        host = logits.cpu()
        same = _same_trees(vi, authors_path(host, args.budget))
        top1 = float(torch.softmax(host[:4], -1).amax(-1).mean())

        def run(fn):
            def go():
                fn()
                sync()
            return go

        fns = {"authors": run(lambda: authors_path(logits.cpu() if dev.type == "cuda" else logits, args.budget)),
               "lab": run(lambda: lab_path(logits, args.budget, anchor, prefix)),
               "floor": run(lambda: floor_path(logits))}
        for what, cpu in (("wall", False), ("cpu", True)):
            if cpu and dev.type == "cuda":
                continue
            t = _time(fns, args.repeat, cpu)
            print(f"{vocab:>8} {top1:>8.3f} {t['authors'] * 1e3:>11.1f} {t['lab'] * 1e3:>9.1f} {t['floor'] * 1e3:>9.1f} "
                  f"{t['authors'] / t['lab']:>11.2f}x {t['lab'] / t['floor']:>9.2f}x   {what}; same trees: {same}")
        del logits, host
    if args.skip_builders:
        return
    print()
    print("tree builder alone: batched build_tree vs the per-request heapq reference, K=8, V=32,000")
    print(f"{'draft logits scale':>18} {'mean top-1 p':>12} {'reference ms':>12} {'batched ms':>10} {'ratio':>6}")
    for scale in (2.0, 4.0, 6.0):
        g = torch.Generator().manual_seed(0)
        logits = torch.randn(args.bs, args.block_size - 1, 32_000, generator=g) * scale
        ids, lp = dl.draft_topk_from_logits(logits, k=8)
        anchor = torch.zeros(args.bs, dtype=torch.int64)
        assert dl.build_tree(ids, lp, anchor, args.budget).equals(dl.build_tree_reference(ids, lp, anchor, args.budget))
        t = _time({"ref": lambda: dl.build_tree_reference(ids, lp, anchor, args.budget),
                   "fast": lambda: dl.build_tree(ids, lp, anchor, args.budget)}, max(args.repeat, 5))
        top1 = lp[..., 0].exp().mean().item()
        print(f"{scale:>18.1f} {top1:>12.3f} {t['ref'] * 1e3:>12.1f} {t['fast'] * 1e3:>10.2f} {t['ref'] / t['fast']:>5.1f}x")


if __name__ == "__main__":
    main()
