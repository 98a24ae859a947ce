"""Does a tree pay here? Tree policies x budgets on recorded fixture runs (issue #27).

For each recorded run (fixtures/traces) and each step (the first --steps of it), every tree
policy of ddtree_lab.analysis.policies is built at every budget from the step's recorded draft
top-k, and its EXACT expected accept length E[tau] (target-only rule, greedy and at the run's
sampling parameters; ddtree_lab.analysis.counterfactual) is computed: recorded rows where the
recording covers the tree, one target tree forward per step (the union of all trees) otherwise.

The cost side is measured here, with the real target (SmolLM2-135M, fp32, this CPU): seconds
per target tree forward against N (median of --repeats), and the drafter's seconds per round
(a short LiveSession with the default drafter, median of its 'draft' + 'build' stages). Then

    expected tokens/s = sum_steps E[tau] / sum_steps (t_draft + t_forward(1 + nodes))
    plain decoding     = 1 / t_forward(1)            (one token per one-row forward, no drafter)

and the break-even budgets: the smallest budget at which a policy beats plain decoding, and the
smallest at which it beats the chain at the same budget by more than 1%; "E[tau] to pay" is the
E[tau] those trees would need to match plain decoding.

    DDTREE_LAB_THREADS=1 python benchmarks/tree_policies.py [--steps 60] [--repeats 5]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch

from ddtree_lab.analysis.counterfactual import measure_cost_model, run_counterfactuals, step_prefix_ids
from ddtree_lab.analysis.policies import POLICIES, PolicyContext
from ddtree_lab.io import load

ROOT = Path(__file__).resolve().parent.parent
RUNS = ["smollm2_t08_b32", "smollm2_greedy_b32"]
BUDGETS = [4, 8, 16, 32, 64]
NUM_ROWS = (1, 5, 9, 17, 33, 65, 129)


def drafter_seconds(target, rounds: int) -> float:
    """Median drafter + build seconds per round of a short live run (default drafter, bs 1)."""
    from ddtree_lab.models.loading import load_drafter
    from ddtree_lab.session import LiveSession

    drafter = load_drafter(target)
    run = LiveSession(target, drafter, budget=4, record="light").run("Name three colours.", max_new_tokens=rounds)
    secs = [s.timings.get("draft", 0.0) + s.timings.get("build", 0.0) for s in run.steps]
    return statistics.median(secs[1:] or secs)  # the first round warms up


def table(run_name, run, results, cm, plain_tps, out):
    sampled_label = "greedy" if run.steps[0].params.is_greedy else run.steps[0].params.label()
    groups = {}
    for r in results:
        groups.setdefault((r.policy, r.budget), []).append(r)

    def tps(rs):
        if any(r.tau_sampled is None for r in rs):
            return None
        return sum(r.tau_sampled for r in rs) / sum(cm.round_seconds(1 + r.num_nodes) for r in rs)

    def need(rs):  # the E[tau] at which these trees would match plain decoding's tokens/s
        return sum(cm.round_seconds(1 + r.num_nodes) for r in rs) / len(rs) * plain_tps

    rate = {k: tps(v) for k, v in groups.items()}
    steps = len({(r.step, r.request) for r in results})
    out(f"\n## {run_name}: {steps} steps, sampled column at {sampled_label}, recorded budget "
        f"{run.metadata.get('budget')}")
    out(f"{'policy':<8} {'budget':>6} {'nodes':>6} {'E[tau] greedy':>13} {'E[tau] sampled':>14} "
        f"{'covered':>8} {'tok/s':>7} {'x plain':>8} {'x chain':>8} {'E[tau] to pay':>13}")
    for (name, b), rs in groups.items():
        ok = all(r.tau_sampled is not None and r.tau_greedy is not None for r in rs)
        g = sum(r.tau_greedy for r in rs) / len(rs) if ok else None
        s = sum(r.tau_sampled for r in rs) / len(rs) if ok else None
        t, c = rate[(name, b)], rate.get(("chain", b))
        f = lambda x, w, p=3: ("-" if x is None else f"{x:.{p}f}").rjust(w)  # noqa: E731
        out(f"{name:<8} {b:>6} {sum(r.num_nodes for r in rs) / len(rs):>6.1f} {f(g, 13)} {f(s, 14)} "
            f"{sum(r.covered for r in rs):>4}/{len(rs):<3} {f(t, 7, 2)} {f(t and t / plain_tps, 8, 2)} "
            f"{f(t and c and t / c, 8, 2)} {f(need(rs), 13)}")
    out(f"break-even (expected tokens/s; plain decoding {plain_tps:.2f} tok/s):")
    for name in dict.fromkeys(k[0] for k in groups):
        vs_plain = [b for b in BUDGETS if rate.get((name, b)) and rate[(name, b)] >= plain_tps]
        vs_chain = [b for b in BUDGETS if rate.get((name, b)) and rate.get(("chain", b))
                    and rate[(name, b)] > 1.01 * rate[("chain", b)]]
        best = max(BUDGETS, key=lambda b: rate.get((name, b)) or 0.0)
        out(f"  {name:<8} beats plain from budget {vs_plain[0] if vs_plain else 'never'}; beats the chain "
            f"(same budget) from {vs_chain[0] if vs_chain else 'never'}; best budget {best} "
            f"({rate.get((name, best)) or 0:.2f} tok/s)")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=None, help="steps per run (the first N; default all)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "tree_policies.out.txt"))
    args = ap.parse_args()
    lines = []

    def out(text=""):
        print(text, flush=True)
        lines.append(text)

    from ddtree_lab.models import load_default_target

    start = time.perf_counter()
    target = load_default_target(dtype=torch.float32)
    runs = {name: load(ROOT / "fixtures" / "traces" / f"{name}.ddtrace.safetensors") for name in RUNS}
    first = runs[RUNS[0]].steps[0]
    prefix = step_prefix_ids(runs[RUNS[0]], first) + [int(first.node_token_ids[0])]
    t_draft = drafter_seconds(target, rounds=8)
    cm = measure_cost_model(target, prefix, first.draft, NUM_ROWS, repeats=args.repeats, draft_seconds=t_draft)
    plain_tps = 1.0 / cm.forward_seconds(1)
    out("# Does a tree pay here? Tree policies x budgets, exact counterfactual E[tau] on recorded runs")
    out(f"machine: {platform.processor() or platform.machine()}, torch threads {torch.get_num_threads()}, "
        f"target SmolLM2-135M fp32 on CPU, drafter: the lab's default; steps per run: {args.steps or 'all'}; "
        f"policies {list(POLICIES)}; budgets {BUDGETS}")
    out(f"cost model (median of {args.repeats}, prefix {len(prefix) - 1} tokens, bs 1): drafter + build "
        f"{t_draft * 1e3:.1f} ms per round; target tree forward: " +
        ", ".join(f"N={n} {s * 1e3:.1f} ms" for n, s in zip(cm.num_rows, cm.seconds[1])))
    ctx = PolicyContext(cost_model=cm)
    for name, run in runs.items():
        t0 = time.perf_counter()
        res = run_counterfactuals(run, list(POLICIES), BUDGETS, target=target, context=ctx, max_steps=args.steps)
        table(name, run, res, cm, plain_tps, out)
        out(f"({time.perf_counter() - t0:.0f} s)")
    out(f"\ntotal {time.perf_counter() - start:.0f} s. Live tau per policy (and the counterfactual's bias "
        "against it) is not measured: LiveSession builds its trees with build_tree only.")
    Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
