"""A live DDTree step on the embedded default target: where the time goes, per recording level.

For each batch size (default 1, 4, 8) at budget B=32, greedy, on SmolLM2-135M-Instruct with a
drafter of L=16 (``--drafter``; ridge by default, the drafter the saved output
``benchmarks/live_step.out.txt`` was measured with): the mean step time, each stage's share (draft, build, compile, target,
verify, record, commit: the names every ``Step.timings`` uses), the target forward's share,
and tokens/s against plain greedy decoding of the same prompts (batched, one token per request
per forward; both sides include their prefill). Goal on a CPU: at bs=4, B=32, level ``light``,
everything but the target forward <= 15% of the step. It also runs bs=4 ``light`` with torch's
default thread count beside the lab's choice (:mod:`ddtree_lab.threads`).

    python benchmarks/live_step.py [--bs 1 4 8] [--tokens 24] [--levels full light off] [--device cpu] [--drafter dflash]
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import ddtree_lab as dl
from ddtree_lab import notebook
from ddtree_lab.session import STAGES
from ddtree_lab.threads import choose_threads, configure_threads

PROMPTS = [
    "Explain why the sky is blue.",
    "Write a short poem about the sea.",
    "What are three uses of copper?",
    "Give me a recipe for tomato soup.",
    "Describe how a bicycle works.",
    "Name three rivers in Europe and one fact about each.",
    "Why do cats purr?",
    "Summarise the plot of Romeo and Juliet in two sentences.",
]


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def plain(target, prompts, tokens, device) -> tuple[float, int]:
    ids = [target.encode_prompt(p) for p in prompts]
    _sync(device)
    t0 = time.perf_counter()
    out = target.greedy_decode_batch(ids, tokens)
    _sync(device)
    return time.perf_counter() - t0, sum(len(o) for o in out)


def live(target, drafter, prompts, tokens, budget, level, device) -> dict:
    session = dl.LiveSession(target, drafter, budget=budget, record=level)
    _sync(device)
    t0 = time.perf_counter()
    session.run(prompts, max_new_tokens=tokens)
    _sync(device)
    wall = time.perf_counter() - t0
    generated = sum(len(r.generated) for r in session.requests)
    totals = dict(session.stage_totals)
    step = sum(totals.values())
    return {"wall": wall, "generated": generated, "steps": session.num_steps, "totals": totals, "step_s": step,
            "backend": session.verify_backend}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bs", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--budget", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=24, help="new tokens per request")
    ap.add_argument("--levels", nargs="+", default=["full", "light", "off"], choices=["full", "light", "off"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--skip-threads", action="store_true", help="skip the torch-default-threads run")
    ap.add_argument("--drafter", default="ridge", help="'ridge', 'dflash' or a path (ddtree_lab.notebook.load_drafter)")
    args = ap.parse_args()
    choice = configure_threads()
    target, drafter = notebook.load_default(device=args.device, drafter=args.drafter)
    print(f"live DDTree step, {target.name} fp32 on {args.device}, {drafter.name} drafter L={drafter.block_size}, "
          f"B={args.budget}, greedy, {args.tokens} new tokens per request; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads ({choice.reason})")
    live(target, drafter, PROMPTS[:1], 4, args.budget, "light", args.device)  # warm-up
    head = " ".join(f"{s:>7}" for s in STAGES)
    print(f"{'bs':>3} {'level':>6} {'backend':>10} {'steps':>5} {'step ms':>8} | {head} | {'target':>6} "
          f"{'other':>6} | {'tok/s':>7} {'plain':>7} {'ratio':>6}")
    print(f"{'':>3} {'':>6} {'':>10} {'':>5} {'':>8} | {'(% of the step)':^{len(head)}} |")
    worst = {}
    for bs in args.bs:
        prompts = PROMPTS[:bs]
        p_wall, p_tokens = plain(target, prompts, args.tokens, args.device)
        for level in args.levels:
            r = live(target, drafter, prompts, args.tokens, args.budget, level, args.device)
            tot, step = r["totals"], r["step_s"]
            shares = " ".join(f"{100 * tot[s] / step:>6.1f}%" for s in STAGES)
            other = 1 - tot["target"] / step
            rate, p_rate = r["generated"] / r["wall"], p_tokens / p_wall
            print(f"{bs:>3} {level:>6} {r['backend']:>10} {r['steps']:>5} {1e3 * step / r['steps']:>8.1f} | {shares} | "
                  f"{100 * tot['target'] / step:>5.1f}% {100 * other:>5.1f}% | {rate:>7.1f} {p_rate:>7.1f} "
                  f"{rate / p_rate:>5.2f}x")
            worst[(bs, level)] = (other, max((s for s in STAGES if s != "target"), key=lambda s: tot[s]))
    if (4, "light") in worst:
        other, stage = worst[(4, "light")]
        print(f"goal: bs=4 light, everything but the target forward = {100 * other:.1f}% of the step "
              f"(<= 15%: {'met' if other <= 0.15 else 'MISSED'}); costliest other stage: {stage}")
    for key, (_other, stage) in worst.items():
        print(f"  bs={key[0]} {key[1]}: costliest stage after the target: {stage}")
    if not args.skip_threads and 4 in args.bs and args.device == "cpu":
        cores = os.cpu_count() or 1
        chosen = torch.get_num_threads()
        torch.set_num_threads(cores)
        r = live(target, drafter, PROMPTS[:4], args.tokens, args.budget, "light", args.device)
        torch.set_num_threads(chosen)
        r1 = live(target, drafter, PROMPTS[:4], args.tokens, args.budget, "light", args.device)
        print(f"threads: bs=4 light with {cores} threads (torch's default here) "
              f"{1e3 * r['step_s'] / r['steps']:.0f} ms/step, with the lab's {chosen} "
              f"{1e3 * r1['step_s'] / r1['steps']:.0f} ms/step ({r['step_s'] / r['steps'] / (r1['step_s'] / r1['steps']):.1f}x); "
              f"auto choice on this machine now: {choose_threads(env={}).threads} ({choose_threads(env={}).reason})")


if __name__ == "__main__":
    main()
