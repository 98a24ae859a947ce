"""The compare-policies verb: exact E[tau] of each tree policy at each budget on a recorded run."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from .common import EXIT_ERROR, CLIError, check_budget, check_new_output, count, inputs_of, load_model, load_run, progress

DEFAULT_BUDGETS = "4,8,16,32,64"


def _budgets(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise CLIError(f"--budgets {text}: not a comma-separated list of ints") from exc
    if not out:
        raise CLIError(f"--budgets {text}: give one budget or more")
    for b in out:
        check_budget("--budgets", b, text)
    return out


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.3f}"


PARQUET_COLUMNS = ("run", "step", "request", "policy", "budget", "num_nodes", "tau_greedy", "tau_sampled",
                   "covered", "reason")


def check_parquet_out(text: str, force: bool = False, inputs: tuple[tuple[str, str], ...] = ()) -> Path:
    """The ``--parquet`` file: a ``.parquet`` name in an existing, writable directory, not
    replacing an existing file unless ``force`` (:func:`~ddtree_lab.cli.common.check_new_output`).
    Checked before the run or the model is loaded; ``inputs`` (the verb's, :func:`~ddtree_lab.cli.common.inputs_of`)
    are never written over.

    Raises:
        CLIError: another suffix, a missing directory, an existing path without ``--force``.
    """
    out = Path(text)
    if out.suffix != ".parquet":
        raise CLIError(f"--parquet {text}: give a file name ending in .parquet")
    check_new_output(out, force, "--parquet", inputs=inputs)
    return out


def write_policies_parquet(run_name: str, results, out: Path) -> Path:
    """One row per (run, step, request, policy, budget) to the file ``out`` (pyarrow):
    :data:`PARQUET_COLUMNS`: ``run`` (the RUN argument), the step and request, the policy and
    the budget asked, ``num_nodes`` (draft nodes of its tree), the exact ``tau_greedy`` /
    ``tau_sampled`` (float64, accepted + bonus; null where not scored), ``covered`` (the
    recording alone answered, no forward) and ``reason`` (why a value is null)."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise CLIError("--parquet needs pyarrow (the 'scale' extra)") from exc
    cols: dict[str, list] = {k: [] for k in PARQUET_COLUMNS}
    for r in results:
        cols["run"].append(run_name)
        for k in PARQUET_COLUMNS[1:]:
            cols[k].append(getattr(r, k))
    schema = pa.schema([("run", pa.string()), ("step", pa.int64()), ("request", pa.int64()), ("policy", pa.string()),
                        ("budget", pa.int64()), ("num_nodes", pa.int64()), ("tau_greedy", pa.float64()),
                        ("tau_sampled", pa.float64()), ("covered", pa.bool_()), ("reason", pa.string())])
    import os

    from .common import wrote

    tmp = out.with_name(f".{out.name}.{os.getpid()}.partial")  # renamed at the end: never a half-written file
    try:
        pq.write_table(pa.table(cols, schema=schema), str(tmp))
        os.replace(tmp, out)
    finally:  # renamed away on success; removed after an error or Ctrl-C
        tmp.unlink(missing_ok=True)
    wrote(out)
    return out


def cmd_compare_policies(args) -> int:
    """For every recorded step of RUN, build each tree policy's tree (ddtree_lab.analysis.policies)
    from the step's recorded draft top-k and print the EXACT expected accept length E[tau]
    (accepted draft tokens + bonus) under the target-only rule, greedy and sampled at the run's
    parameters, averaged over the steps (ddtree_lab.analysis.counterfactual). Nodes the recording
    does not cover are scored with --model (one tree forward per step); without it those rows
    say they were not scored and the exit status is 2 (nothing checked for them; 1 would say a
    check found something). The 'cost' policy needs --model (its cost model is measured here)."""
    from ..analysis.counterfactual import measure_cost_model, run_counterfactuals, step_prefix_ids, summarize
    from ..analysis.policies import POLICIES, PolicyContext

    names = args.policy or list(POLICIES)
    unknown = [n for n in names if n not in POLICIES]
    if unknown:
        raise CLIError(f"--policy {unknown[0]}: unknown policy (known: {', '.join(POLICIES)})")
    budgets = _budgets(args.budgets)
    if args.max_steps is not None and args.max_steps < 1:
        raise CLIError(f"--max-steps {args.max_steps}: must be >= 1 (leave it out for every step)")
    parquet = check_parquet_out(args.parquet, args.force, inputs_of(args)) if args.parquet else None
    run = load_run(args.run)
    steps = [s for s in run.steps if s.draft is not None and s.draft.token_ids.numel() and s.tree is not None]
    if not steps:
        raise CLIError(f"{args.run}: no step records a draft top-k and a tree (nothing to compare)")
    target = load_model(args.model)
    context = None
    if "cost" in names:
        prefix = step_prefix_ids(run, steps[0]) if target is not None else None
        if target is None or not prefix:
            names = [n for n in names if n != "cost"]
            print("policy cost: not run (it needs --model and a run with prompt ids, to measure its cost model)")
        else:
            draft_s = [float(s.timings["draft"]) for s in steps if s.timings.get("draft") is not None]
            root = int(steps[0].tree.node_token_ids[0, 0])  # type: ignore[union-attr]  (steps have trees)
            cm = measure_cost_model(target, prefix + [root], steps[0].draft,
                                    draft_seconds=(sum(draft_s) / len(draft_s)) if draft_s else 0.0)
            context = PolicyContext(cost_model=cm)
            print("cost model (s per tree forward, bs 1): " +
                  ", ".join(f"N={n}: {s * 1e3:.1f} ms" for n, s in zip(cm.num_rows, cm.seconds[1])))
    start = time.perf_counter()
    todo = len(steps[: args.max_steps])
    with progress(todo, "compare-policies", quiet=target is None) as bar:  # a tree forward per step with --model
        results = run_counterfactuals(run, names, budgets, target=target, context=context, max_steps=args.max_steps,
                                      progress=bar.update)
    params = steps[0].params
    if params is None:
        raise CLIError(f"{args.run}: step {steps[0].step} records no sampling parameters")
    print(f"{args.run}: {count(len({(r.step, r.request) for r in results}), 'step')}, "
          f"sampled at {'greedy' if params.is_greedy else params.label()} "
          f"({time.perf_counter() - start:.1f} s)")
    print(f"{'policy':<9} {'budget':>6} {'E[tau] greedy':>13} {'E[tau] sampled':>14} {'nodes':>6} {'steps':>9}")
    for row in summarize(results):
        print(f"{row.policy:<9} {row.budget:>6} {_fmt(row.tau_greedy):>13} {_fmt(row.tau_sampled):>14} "
              f"{row.mean_nodes:>6.1f} {row.steps:>4}/{row.total:<4}" + (f"  {row.reason}" if row.reason else ""))
    if run.metadata.get("engine") == "vllm":  # what the engine itself did on the same steps, beside the policies
        scored = {(r.step, r.request) for r in results}
        taus = [s.accept_length + 1 for s in steps if (s.step, s.request) in scored and s.output is not None]
        if taus:
            print(f"vLLM's own chain (k = {run.metadata.get('num_speculative_tokens')}, {run.metadata.get('method')}, "
                  f"each request at its own parameters): observed mean tau {sum(taus) / len(taus):.3f} over the same "
                  f"{count(len(taus), 'step')}")
    if parquet is not None:
        print(f"{count(len(results), 'row')} -> {write_policies_parquet(str(args.run), results, parquet)}")
    unscored = sum(r.tau_sampled is None for r in results)
    if unscored:  # nothing was checked for those rows: not a finding (1) but a comparison that could not be made
        print(f"ddtree-lab compare-policies: {unscored} of {count(len(results), 'row')} not scored (nodes outside "
              "the recorded tree: pass --model default or a model directory to score them)", file=sys.stderr)
        return EXIT_ERROR
    return 0
