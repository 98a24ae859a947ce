"""The cost of a target tree forward against its rows N and the batch size (issue #27's cost model).

The same function ``benchmarks/tree_policies.py`` and ``ddtree-lab compare-policies`` use for the
``cost`` policy and for expected tokens/s
(:func:`ddtree_lab.analysis.counterfactual.measure_cost_model`), on the embedded default target
(SmolLM2-135M) on ``--device``: DDTree trees of N - 1 nodes from a recorded draft (the first step
of ``fixtures/traces/smollm2_t08_b32``) after that step's prefix, median of ``--repeats`` timed
forwards after a warm-up (on CUDA each ended by ``torch.cuda.synchronize``).

    python benchmarks/tree_cost.py --device cuda    # scripts/gpu_check.sh runs this on a GPU

Exit status 1 (and nothing measured) when ``--device cuda`` is asked and no CUDA device is
visible: a check that could not run never reads as passing.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
RUN = ROOT / "fixtures" / "traces" / "smollm2_t08_b32.ddtrace.safetensors"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--rows", default="1,5,9,17,33,65,129", help="comma-separated N (rows, root included)")
    ap.add_argument("--batch-sizes", default="1,8,32", help="comma-separated batch sizes")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = ap.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"tree_cost: NOT RUN: --device {args.device} but torch.cuda.is_available() is false", file=sys.stderr)
        return 1
    from ddtree_lab.analysis.counterfactual import measure_cost_model, step_prefix_ids
    from ddtree_lab.io import load
    from ddtree_lab.models import load_default_target

    rows = [int(x) for x in args.rows.split(",")]
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    run = load(RUN)
    first = run.steps[0]
    prefix = step_prefix_ids(run, first)
    if prefix is None:
        print(f"tree_cost: NOT RUN: {RUN.name} has no prompt ids", file=sys.stderr)
        return 1
    target = load_default_target(dtype=getattr(torch, args.dtype), device=args.device)
    t0 = time.perf_counter()
    cm = measure_cost_model(target, prefix + [int(first.node_token_ids[0])], first.draft, rows,
                            repeats=args.repeats, batch_sizes=sizes)
    name = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "CPU"
    print(f"target tree forward, {target.name} {args.dtype} on {name} ({cm.device}), prefix {len(prefix)} tokens, "
          f"median of {args.repeats} (ms):")
    print(f"{'bs':>4} " + " ".join(f"{'N=' + str(n):>9}" for n in cm.num_rows))
    for bs in sizes:
        print(f"{bs:>4} " + " ".join(f"{s * 1e3:>9.2f}" for s in cm.seconds[bs]))
    flat = [cm.seconds[bs][-1] / cm.seconds[bs][0] for bs in sizes]
    print("N=" + str(cm.num_rows[-1]) + " over N=1 per batch size: " +
          ", ".join(f"bs {bs} x{f:.2f}" for bs, f in zip(sizes, flat)) + f" ({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
