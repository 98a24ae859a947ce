"""Sampled tree verify: the serving-style pipeline against the lazy verifier, same inputs.

The pipeline (what SGLang's sampled verify does): softmax over V for all bs x N tree rows,
top-k renormalise, top-p renormalise -- each a pass over [bs, N, V] float32 -- then the
walk. The lazy verifier reads only the rows the walk reaches and computes the top-k / top-p
cut-offs there.

* ``--mode cpu`` (default without CUDA): torch ops on the CPU. Pipeline =
  ``ddtree_lab.target_probs`` over all rows (softmax -> top-k -> renormalise -> top-p ->
  renormalise) then the reference walk; lazy = the ``torch-lazy`` backend (the same walk,
  each reached row's distribution computed on demand). Both outputs are checked equal.
* ``--mode gpu`` (default with CUDA): pipeline = FlashInfer's ``top_k_renorm_probs`` /
  ``top_p_renorm_probs`` after a torch softmax when ``flashinfer`` imports, else the same
  steps in torch ops (the table says which); its walk is *not* timed (favours the
  pipeline). Lazy = the Triton sampled kernel (launch only, compact outputs). Also prints
  the memory floor: the bytes of the rows the walk reaches, read once, at the measured
  device copy bandwidth. Installs nothing; about 1-3 minutes on one H100/H200.

Shapes (issue 4): bs in {1, 8, 32}, N in {16, 64, 256}, V = 151,936, top-k 50 / top-p 0.9,
temperature 1, bf16 logits. The CPU default runs a subset (bs in {1, 8}, N in {16, 64}).
Trees come from random drafts (L = 16, K = 8); the target puts extra mass on each node's
first-choice child so walks go several levels deep (mean accepted length printed).

    python benchmarks/verify.py [--mode cpu|gpu] [--bs 1 8] [--nodes 16 64] [--vocab 151936]
    TRITON_INTERPRET=1 python benchmarks/verify.py --mode gpu --dry-run --vocab 512 --bs 4 --nodes 16
        (the GPU mode's code path on CPU tensors, to check the script; timings meaningless)
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import ddtree_lab as dl

TOP_K, TOP_P, TEMPERATURE = 50, 0.9, 1.0


def make_case(bs: int, num_nodes: int, vocab: int, device: str, seed: int = 0):
    """(verify_input, bf16 logits [bs, N, V] on device, coins, final_coins)."""
    g = torch.Generator().manual_seed(seed)
    draft_vocab = min(4096, vocab)
    ids, lp = dl.draft_topk_from_logits(torch.randn(bs, 15, draft_vocab, generator=g) * 3, k=8)
    tree = dl.build_tree(ids, lp, torch.randint(0, draft_vocab, (bs,), generator=g), num_nodes - 1)
    vi = dl.compile_retrieve(tree, 100)
    gd = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(bs, num_nodes, vocab, generator=gd, device=device, dtype=torch.float32).mul_(2.0)
    # the target agrees with the drafter's first choice most of the time
    b_idx, i_idx = torch.nonzero((tree.ranks == 0) & (tree.parents >= 0), as_tuple=True)
    keep = torch.rand(len(b_idx), generator=g) < 0.85
    b_idx, i_idx = b_idx[keep], i_idx[keep]
    parent, token = tree.parents[b_idx, i_idx], tree.node_token_ids[b_idx, i_idx]
    logits[b_idx.to(device), parent.to(device), token.to(device)] += 14.0
    logits = logits.to(torch.bfloat16)
    coins = torch.rand(bs, num_nodes, generator=g)
    final = torch.rand(bs, generator=g)
    return vi, logits, coins, final


def _median_time(fn, repeat: int, sync=lambda: None) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_cpu(args) -> None:
    params = dl.SamplingParams(TEMPERATURE, top_k=TOP_K, top_p=TOP_P)
    print(f"CPU, torch {torch.__version__}, {torch.get_num_threads()} threads; V={args.vocab}, bf16 logits, "
          f"T={TEMPERATURE} top-k {TOP_K} top-p {TOP_P}; median of {args.repeat}; "
          f"load average {os.getloadavg()[0]:.1f} (shared machine: expect noise)")
    print("pipeline = target_probs over all bs*N rows + reference walk; lazy = torch-lazy backend (reached rows only)")
    header = f"{'bs':>3} {'N':>4} {'rows':>6} {'reached':>7} {'acc.len':>7} {'pipeline s':>10} {'lazy s':>8} {'ratio':>6} " \
             f"{'pipe MB':>8} {'lazy MB':>8}"
    print(header)
    for bs in args.bs:
        for n in args.nodes:
            vi, logits, coins, final = make_case(bs, n, args.vocab, "cpu")

            def pipeline():
                probs = dl.target_probs(logits, params, vi.num_nodes)
                return dl.verify_sampled(vi, probs, coins, final, validate=False)

            def lazy():
                return dl.verify_tree(vi, logits, params, coins, final, backend="torch-lazy", validate=False)

            a, b = pipeline(), lazy()
            assert torch.equal(a.emitted_tokens, b.emitted_tokens) and torch.equal(a.accept_index, b.accept_index)
            t_pipe = _median_time(pipeline, args.repeat)
            t_lazy = _median_time(lazy, args.repeat)
            reached = int((b.accept_length + 1).sum())
            elems = bs * n * args.vocab
            pipe_mb = elems * (2 + 4 + 2 * 4 + 2 * 4) / 1e6  # lower bound, see _bytes_note
            lazy_mb = reached * args.vocab * 2 / 1e6
            print(f"{bs:>3} {n:>4} {bs * n:>6} {reached:>7} {float(b.accept_length.float().mean()):>7.2f} "
                  f"{t_pipe:>10.3f} {t_lazy:>8.3f} {t_pipe / t_lazy:>5.1f}x {pipe_mb:>8.0f} {lazy_mb:>8.1f}")
    print(_bytes_note())


def _bytes_note() -> str:
    return ("bytes: pipeline = lower bound bs*N*V*22 (bf16 read 2 + softmax write 4 + read/write 4+4 per renorm "
            "stage x2; sort traffic not counted); lazy = reached rows * V * 2 (each reached bf16 row once; the "
            "threshold searches re-read it from cache)")


def _pipeline_gpu():
    """(name, fn(logits, top_k, top_p) -> probs) for the GPU pipeline's transforms."""
    try:
        import flashinfer.sampling as fs

        def run(logits):
            probs = torch.softmax(logits.float().div_(TEMPERATURE), dim=-1).view(-1, logits.shape[-1])
            probs = fs.top_k_renorm_probs(probs, TOP_K)
            return fs.top_p_renorm_probs(probs, TOP_P)

        run(torch.randn(2, 1, 1000, device="cuda").bfloat16())  # probe the API once
        return "flashinfer top_k/top_p_renorm_probs + torch softmax", run
    except Exception:
        pass

    return "torch ops (softmax, topk renorm, sort/cumsum top-p renorm)", _pipeline_torch


def _pipeline_torch(logits):
    """softmax -> top-k renormalise -> top-p renormalise over all rows, in torch ops."""
    probs = torch.softmax(logits.float().div_(TEMPERATURE), dim=-1)
    kth = torch.topk(probs, TOP_K, dim=-1).values[..., -1:]
    probs = probs.masked_fill_(probs < kth, 0.0)
    probs.div_(probs.sum(-1, keepdim=True))
    sorted_p, order = torch.sort(probs, dim=-1, descending=True)
    cum = sorted_p.cumsum(-1)
    sorted_p.masked_fill_(cum - sorted_p >= TOP_P, 0.0)
    probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return probs.div_(probs.sum(-1, keepdim=True))


def _copy_bandwidth(device: str, sync) -> float:
    src = torch.empty((512 if device == "cuda" else 16) * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = _median_time(lambda: dst.copy_(src), 10, sync)
    return 2 * src.numel() / t


def run_gpu(args) -> None:
    from ddtree_lab.verify import sampled_launcher

    device = "cpu" if args.dry_run else "cuda"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    name, pipeline = _pipeline_gpu() if device == "cuda" else ("torch ops (dry run)", _pipeline_torch)
    bw = _copy_bandwidth(device, sync)
    params = [dl.SamplingParams(TEMPERATURE, top_k=TOP_K, top_p=TOP_P)] * max(args.bs)
    gpu_name = torch.cuda.get_device_name() if device == "cuda" else "none (dry run on CPU, interpreted kernel)"
    print(f"GPU {gpu_name}, torch {torch.__version__}; V={args.vocab}, bf16, T={TEMPERATURE} "
          f"top-k {TOP_K} top-p {TOP_P}; median of {args.repeat}; copy bandwidth {bw / 1e9:.0f} GB/s")
    print(f"pipeline = {name} over all rows (walk not timed); triton = sampled tree-verify kernel")
    print(f"{'bs':>3} {'N':>4} {'reached':>7} {'acc.len':>7} {'pipeline ms':>11} {'triton ms':>9} {'ratio':>6} "
          f"{'floor ms':>8} {'vs floor':>8} {'pipe GB':>8} {'floor MB':>8} {'agree':>6}")
    for bs in args.bs:
        for n in args.nodes:
            vi, logits, coins, final = make_case(bs, n, args.vocab, device)
            launch, out = sampled_launcher(vi, logits, params[:bs], coins, final)
            t_pipe = _median_time(lambda logits=logits: pipeline(logits), args.repeat, sync)
            t_tri = _median_time(launch, args.repeat, sync)
            assert int(out["err"].abs().sum()) == 0
            # the same requests through the torch-lazy backend: paths and bonus tokens agree
            lazy = dl.verify_tree(vi, logits, params[:bs], coins, final, backend="torch-lazy")
            agree = int(((out["btok"].cpu().long() == lazy.bonus_token)
                         & (out["plen"].cpu().long() == lazy.accept_length + 1)).sum())
            reached = int(out["plen"].sum())
            floor_bytes = reached * args.vocab * 2
            t_floor = floor_bytes / bw
            pipe_gb = bs * n * args.vocab * 22 / 1e9
            print(f"{bs:>3} {n:>4} {reached:>7} {float(out['plen'].float().mean()) - 1:>7.2f} {t_pipe * 1e3:>11.3f} "
                  f"{t_tri * 1e3:>9.3f} {t_pipe / t_tri:>5.1f}x {t_floor * 1e3:>8.3f} {t_tri / t_floor:>7.1f}x "
                  f"{pipe_gb:>8.2f} {floor_bytes / 1e6:>8.1f} {agree:>3}/{bs:<2}")
            del logits
            if device == "cuda":
                torch.cuda.empty_cache()
    print(_bytes_note())
    print("agree: requests whose accepted length and bonus token equal the torch-lazy backend's")
    print("goals (issue 4): ratio >= 5x at bs=32, N=64; triton within 2x of the floor")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    gpu = torch.cuda.is_available()
    ap.add_argument("--mode", choices=("cpu", "gpu"), default="gpu" if gpu else "cpu")
    ap.add_argument("--bs", type=int, nargs="+", default=None)
    ap.add_argument("--nodes", type=int, nargs="+", default=None)
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--repeat", type=int, default=None)
    ap.add_argument("--dry-run", action="store_true",
                    help="GPU mode's code path on CPU tensors (needs TRITON_INTERPRET=1 and a small --vocab)")
    ap.add_argument("--threads", type=int, default=1,
                    help="CPU mode: torch threads for both sides (default 1: stable on a shared machine)")
    args = ap.parse_args()
    if args.mode == "gpu":
        args.bs = args.bs or [1, 8, 32]
        args.nodes = args.nodes or [16, 64, 256]
        args.repeat = args.repeat or 20
        run_gpu(args)
    else:
        args.bs = args.bs or [1, 8]
        args.nodes = args.nodes or [16, 64]
        args.repeat = args.repeat or 3
        torch.set_num_threads(args.threads)
        run_cpu(args)


if __name__ == "__main__":
    main()
