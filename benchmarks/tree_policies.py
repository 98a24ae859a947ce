"""Does a tree pay here? Tree policies x budgets, exact counterfactuals against live runs (issue #27).

On the embedded default (SmolLM2-135M target, fp32 on this CPU, the lab's default DFlash
drafter), held-out prompts (``fixtures/drafters/dflash_prompts.json`` "held_out": topics and
templates the drafter's training prompts never use, scripts/dflash_prompts.py), at T = 0 and
T = 0.8:

1. **Cost.** Seconds per target tree forward against N (rows, root included) at batch sizes 1
   and 8 (:func:`ddtree_lab.analysis.counterfactual.measure_cost_model`, median of
   ``--repeats``), and the drafter's seconds per round at batch size 1 (median ``draft`` +
   ``build`` stage of a one-prompt run; the batched rounds' median is printed beside it).
2. **One recorded trajectory** per temperature: a live DDTree run at budget 32 (level full).
3. **Exact counterfactuals** on that trajectory: every policy of
   :data:`ddtree_lab.analysis.policies.POLICIES` at every budget, built from each recorded
   step's draft top-k, its exact E[tau] (accepted + bonus) under the target-only rule, the
   nodes the recording does not cover scored with one target tree forward per step.
4. **Live runs** of the same prompts under each policy and budget
   (``LiveSession(policy=...)``): live tau = mean over steps of accepted draft tokens + 1
   (``docs/DESIGN.md``: accept length tau), and the **counterfactual bias** = counterfactual
   E[tau] (from the ONE recorded trajectory) - live tau.

Tokens per second, per request stream (batch size 1 costs):

    expected tok/s = sum_steps E[tau] / sum_steps (t_draft + t_forward(1 + nodes))
    live-tau tok/s = live tau / (t_draft + t_forward(1 + live mean nodes))
    plain decoding = 1 / t_forward(1)          (one token per one-row forward, no drafter)

The wall tok/s column (the live runs' batch of prompts) is compared with plain decoding of that
batch, ``bs / t_forward(1, bs)``, printed in the header.

Break-even budget: the smallest budget at which a policy's expected tok/s beats plain decoding,
and the smallest at which it beats the chain's best budget. The live runs' own wall clock
(tokens generated / seconds, the 8 prompts as one batch) is printed too: it shares the CPU
with whatever else runs, the cost model is the figure to compare policies by.

    DDTREE_LAB_THREADS=1 python benchmarks/tree_policies.py [--prompts 8] [--new-tokens 64] [--live-workers 2]

**Another device's cost.** ``--cost-model FILE`` takes a cost model measured elsewhere
(``benchmarks/tree_cost.py --json``; ``scripts/gpu_check.sh`` writes one on a GPU) instead of
timing this CPU: the recordings, exact E[tau] and live tau still come from this CPU (tau does
not depend on the device), the seconds, tok/s and break-even budgets from that device. Only the
``cost`` policy builds other trees under another cost model, so ``--live-policies cost`` is the
live grid such a run needs:

    python benchmarks/tree_policies.py --cost-model benchmarks/tree_cost.h200.json --live-policies cost \
        --out benchmarks/tree_policies.h200.out.txt --json benchmarks/tree_policies.h200.json \
        --figure benchmarks/tree_policies.h200.html

Writes ``--out`` (the table), ``benchmarks/tree_policies.json`` (the rows, read by
``labs/04_topk_topp_tuner.ipynb``) and ``benchmarks/tree_policies.html`` (the plotly figure;
plotly.js inlined, so it opens offline; a static PNG beside it only where kaleido is installed).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from ddtree_lab.analysis.counterfactual import measure_cost_model, step_counterfactuals, step_prefix_ids
from ddtree_lab.analysis.policies import POLICIES, CostModel, PolicyContext
from ddtree_lab.sampling import SamplingParams
from ddtree_lab.session import LiveSession

ROOT = Path(__file__).resolve().parent.parent
BUDGETS = [4, 8, 16, 32, 64]
SOLO_TOKENS = 32  # the bs-1 run that times the drafter's round
RECORDED_BUDGET = 32
NUM_ROWS = (1, 5, 9, 17, 33, 65)
BATCH_SIZES = (1, 8)


def by_batch_size(run) -> dict[int, int]:
    """Step number -> how many requests took part (the batch size of that step)."""
    out: dict[int, int] = {}
    for s in run.steps:
        out[s.step] = out.get(s.step, 0) + 1
    return out


def counterfactuals(run, target, cm, names, budgets, first=0, last=None):
    """step_counterfactuals over the run's steps ``first:last``, each with the cost model at the
    batch size its step ran at."""
    bs = by_batch_size(run)
    res = []
    for s in run.steps[first:last]:
        ctx = PolicyContext(cost_model=cm, batch_size=bs[s.step])
        res.extend(step_counterfactuals(s, names, budgets, target=target, prefix_ids=step_prefix_ids(run, s),
                                        context=ctx))
    return res


def live(target, drafter, prompts, new_tokens, temperature, policy, budget, cm, record):
    session = LiveSession(target, drafter, budget=budget, sampling=SamplingParams(temperature=temperature, seed=1),
                          seed=1, record=record, policy=policy,
                          policy_context=PolicyContext(cost_model=cm) if policy == "cost" else None)
    t0 = time.perf_counter()
    run = session.run(prompts, max_new_tokens=new_tokens)
    wall = time.perf_counter() - t0
    acc = [s.accept_length for s in run.steps]
    gen = sum(len(run.generated_tokens(b)) for b in range(len(prompts)))
    return run, {"tau": sum(a + 1 for a in acc) / len(acc), "steps": len(acc),
                 "nodes": sum(s.num_nodes - 1 for s in run.steps) / len(acc),
                 "by_depth": [sum(a >= d for a in acc) / len(acc) for d in range(1, 9)],
                 "wall_s": wall, "wall_tok_s": gen / wall,
                 "step_s": sum(session.stage_totals.values()) / max(session.num_steps, 1)}


def read_cost_model(path: str) -> tuple[dict, CostModel]:
    """``(document, CostModel)`` of a ``benchmarks/tree_cost.py --json`` file; exits with a
    message naming the file and what is wrong (missing, not JSON, no or a bad ``cost_model``)."""
    try:
        doc = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise SystemExit(f"tree_policies: --cost-model {path}: no such file") from None
    except OSError as e:
        raise SystemExit(f"tree_policies: --cost-model {path}: cannot be read ({e.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SystemExit(f"tree_policies: --cost-model {path}: not valid JSON ({e})") from None
    if not isinstance(doc, dict) or "cost_model" not in doc:
        raise SystemExit(f"tree_policies: --cost-model {path}: no 'cost_model' field (write it with "
                         "benchmarks/tree_cost.py --json)")
    try:
        cm = CostModel.from_dict(doc["cost_model"])
    except ValueError as e:
        raise SystemExit(f"tree_policies: --cost-model {path}: {e}") from None
    if cm.draft_seconds <= 0:
        raise SystemExit(f"tree_policies: --cost-model {path}: no drafter cost (draft_seconds {cm.draft_seconds}); "
                         "write it with benchmarks/tree_cost.py --rounds --json")
    rounds = doc.get("rounds", {})
    need = {"batch_size": int, "budget": int, "draft_s": float, "step_s": float}
    if not isinstance(rounds, dict) or not all(
            isinstance(r, dict) and all(isinstance(r.get(k), (int, float)) and not isinstance(r.get(k), bool)
                                        for k in need) for r in rounds.values()):
        raise SystemExit(f"tree_policies: --cost-model {path}: 'rounds' must map to objects with numeric "
                         f"{sorted(need)} (as benchmarks/tree_cost.py --rounds writes them)")
    return doc, cm


_WORKER: dict = {}


def _worker_init():
    from ddtree_lab.models import load_default_target
    from ddtree_lab.models.loading import load_drafter
    from ddtree_lab.threads import configure_threads

    configure_threads()
    _WORKER["target"] = load_default_target(dtype=torch.float32)
    _WORKER["drafter"] = load_drafter(_WORKER["target"])


def _worker_live(job):
    (temp, name, b), prompts, new_tokens, cm = job
    _, row = live(_WORKER["target"], _WORKER["drafter"], prompts, new_tokens, temp, name, b, cm, "light")
    return (temp, name, b), row


def live_in_workers(configs, workers, prompts, new_tokens, cm) -> dict:
    """The live grid over ``workers`` processes (spawned; each loads the target and the drafter
    once): ``{(temperature, policy, budget): row}``. Seeds are per configuration, so a
    configuration's tau does not depend on which worker ran it or in what order."""
    import multiprocessing

    rows = {}
    with multiprocessing.get_context("spawn").Pool(workers, initializer=_worker_init) as pool:
        jobs = [(c, prompts, new_tokens, cm) for c in configs]
        for i, (key, row) in enumerate(pool.imap_unordered(_worker_live, jobs)):
            rows[key] = row
            print(f"  live {i + 1}/{len(configs)}: T={key[0]} {key[1]} B={key[2]}: tau {row['tau']:.3f} "
                  f"({row['wall_s']:.0f} s)", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--temperatures", default="0,0.8")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--live-minutes", type=float, default=25.0,
                    help="if the estimated live grid exceeds this, live runs only at --reduced-budgets")
    ap.add_argument("--reduced-budgets", default="8,32")
    ap.add_argument("--deadline-minutes", type=float, default=None,
                    help="start no live run after this many minutes since the start (the rest are listed as "
                         "not run); default: no deadline")
    ap.add_argument("--cost-model", default=None,
                    help="a cost model measured elsewhere (benchmarks/tree_cost.py --json, e.g. on a GPU by "
                         "scripts/gpu_check.sh) instead of measuring one on this CPU")
    ap.add_argument("--live-policies", default=",".join(POLICIES),
                    help="policies to run live (default all); with --cost-model only 'cost' builds other trees")
    ap.add_argument("--live-workers", type=int, default=1,
                    help="run the live grid in this many processes (one torch thread each; --deadline-minutes "
                         "applies to one process only); default 1")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "tree_policies.out.txt"))
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "tree_policies.json"))
    ap.add_argument("--figure", default=str(ROOT / "benchmarks" / "tree_policies.html"))
    args = ap.parse_args()
    given = read_cost_model(args.cost_model) if args.cost_model else None  # a bad file fails before the model loads
    if args.prompts < 1 or args.new_tokens < 1:
        raise SystemExit(f"tree_policies: --prompts and --new-tokens must be >= 1, got {args.prompts}, {args.new_tokens}")
    try:
        temps = [float(t) for t in args.temperatures.split(",")]
    except ValueError:
        raise SystemExit(f"tree_policies: --temperatures must be comma-separated numbers, got {args.temperatures!r}") \
            from None
    if any(not (t >= 0 and math.isfinite(t)) for t in temps):
        raise SystemExit(f"tree_policies: --temperatures must be finite and >= 0, got {args.temperatures!r}")
    if args.live_workers < 1:
        raise SystemExit(f"tree_policies: --live-workers must be >= 1, got {args.live_workers}")
    live_names = [n for n in args.live_policies.split(",") if n]
    unknown = [n for n in live_names if n not in POLICIES]
    if unknown:
        raise SystemExit(f"tree_policies: --live-policies names no policy {unknown} (policies: {list(POLICIES)})")
    lines: list[str] = []

    def out(text=""):
        print(text, flush=True)
        lines.append(text)

    from ddtree_lab.models import load_default_target
    from ddtree_lab.models.loading import load_drafter

    start = time.perf_counter()
    target = load_default_target(dtype=torch.float32)
    drafter = load_drafter(target)
    prompts = json.loads((ROOT / "fixtures" / "drafters" / "dflash_prompts.json").read_text())["held_out"][: args.prompts]
    names = list(POLICIES)

    # -- the recorded trajectories (DDTree, budget 32, full rows), the first live configuration --
    recorded, live_rows = {}, {}
    for temp in temps:
        run, row = live(target, drafter, prompts, args.new_tokens, temp, "ddtree", RECORDED_BUDGET, None, "full")
        recorded[temp] = run
        live_rows[(temp, "ddtree", RECORDED_BUDGET)] = row
    per_run = statistics.mean(r["wall_s"] for r in live_rows.values())

    # -- cost model -------------------------------------------------------------------------------
    first = recorded[temps[0]].steps[0]
    prefix = step_prefix_ids(recorded[temps[0]], first) + [int(first.node_token_ids[0])]
    drafts = [s.timings["draft"] + s.timings["build"] for r in recorded.values() for s in r.steps]
    t_draft_batch = statistics.median(drafts)  # a round of the recorded batch of len(prompts) requests
    elsewhere = None
    if given is not None:  # measured on another device: its drafter round (bs 1) comes with it
        elsewhere, cm = given
        t_draft = cm.draft_seconds
        solo_rounds = None
        batch_rounds = [r["draft_s"] for r in elsewhere.get("rounds", {}).values() if r["batch_size"] == len(prompts)]
        t_draft_batch = statistics.median(batch_rounds) if batch_rounds else None
    else:
        # the per-stream figures are batch-size-1 costs: the drafter's round at bs 1, measured on one prompt
        solo, _ = live(target, drafter, prompts[:1], SOLO_TOKENS, temps[0], "ddtree", RECORDED_BUDGET, None, "light")
        solo_rounds = len(solo.steps)
        t_draft = statistics.median(s.timings["draft"] + s.timings["build"] for s in solo.steps)
        cm = measure_cost_model(target, prefix, first.draft, NUM_ROWS, repeats=args.repeats, draft_seconds=t_draft,
                                batch_sizes=BATCH_SIZES)
    plain_tps = 1.0 / cm.forward_seconds(1)
    plain_batch_tps = len(prompts) / cm.forward_seconds(1, len(prompts)) if len(prompts) in cm.seconds else None
    load_at_cost = os.getloadavg()[0]  # the cost model is only as good as the CPU was quiet

    # -- live grid: measured one configuration first ------------------------------------------------
    # cheapest budgets first, both temperatures, so that a deadline leaves comparable pairs
    configs = [(t, n, b) for b in sorted(BUDGETS, key=lambda b: (b not in (8, 32), b)) for t in temps
               for n in live_names if (t, n, b) not in live_rows]
    estimate = per_run * len(configs) / 60
    live_budgets = BUDGETS
    if estimate > args.live_minutes:
        live_budgets = [int(b) for b in args.reduced_budgets.split(",")]
        configs = [c for c in configs if c[2] in live_budgets]
    out("# Does a tree pay here? Tree policies x budgets: exact counterfactual E[tau], live tau, bias, cost")
    out(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores shared with other jobs, torch threads "
        f"{torch.get_num_threads()}; target {target.name} fp32 on CPU; drafter {drafter.name} (the lab's default)")
    if elsewhere is None:
        out(f"load average (1 min) while the cost model was measured: {load_at_cost:.1f} on {os.cpu_count()} cores")
    else:
        out(f"COST MEASURED ELSEWHERE: {elsewhere.get('device_name')} ({args.cost_model}: {elsewhere.get('weights')} "
            f"weights, {elsewhere.get('dtype')}, torch {elsewhere.get('torch')}, median of {elsewhere.get('repeats')}). "
            "The recordings, the exact E[tau] and the live tau come from this CPU (tau does not depend on the "
            "device); the seconds, tok/s and break-even from that device. Live runs: policies "
            f"{live_names} only (the others' trees do not depend on the cost model: their live tau is the CPU "
            "table's); the wall tok/s column is left empty (this CPU's wall clock).")
    out(f"prompts: {len(prompts)} held-out prompts x {args.new_tokens} new tokens, one batch per run (topics and "
        "templates never in the drafter's training prompts, `train` and `engine_train` of "
        f"fixtures/drafters/dflash_prompts.json): {prompts}")
    out(f"policies {names}; budgets {BUDGETS}; temperatures {temps}; seed 1")
    out(f"live runs: one took {per_run:.0f} s (DDTree B={RECORDED_BUDGET}); the whole grid was estimated at "
        f"{estimate:.0f} min -> live runs at budgets {live_budgets}" +
        ("" if live_budgets == BUDGETS else f" only (over the {args.live_minutes:.0f}-minute limit); "
         "counterfactuals for the whole grid"))
    if elsewhere is None:
        out(f"cost model (this CPU, median of {args.repeats}, prefix {len(prefix) - 1} tokens): drafter + build "
            f"{t_draft * 1e3:.1f} ms per round at bs 1 (median over {solo_rounds} rounds of one prompt), "
            f"{t_draft_batch * 1e3:.1f} ms per round of the batch of {len(prompts)} (median over the recorded rounds)")
    else:
        out(f"cost model ({cm.device}): drafter + build {t_draft * 1e3:.2f} ms per round at bs 1 (the median over the "
            "live-step budgets at bs 1)" + ("" if t_draft_batch is None else
                                            f", {t_draft_batch * 1e3:.2f} ms at bs {len(prompts)}"))
        for r in elsewhere.get("rounds", {}).values():
            model_round = r["draft_s"] + cm.forward_seconds(1 + r["budget"], r["batch_size"])
            out(f"  the lab's whole live step there, bs {r['batch_size']} B={r['budget']}: {r['step_s'] * 1e3:.1f} ms "
                f"(the cost model's round {model_round * 1e3:.1f} ms, timed apart; the step adds compile, verify, "
                "record and commit)")
    for bs in sorted(cm.seconds):
        out(f"  target tree forward, bs {bs}: " + ", ".join(f"N={n} {s * 1e3:.1f} ms"
                                                          for n, s in zip(cm.num_rows, cm.seconds[bs])))
    out(f"plain decoding (1 / t_forward(N=1, bs 1)): {plain_tps:.2f} tok/s per stream: the reference for the "
        "exp / live tok/s columns (batch-size-1 costs)")
    if plain_batch_tps is not None and elsewhere is None:
        out(f"plain decoding of the batch of {len(prompts)} ({len(prompts)} / t_forward(N=1, bs {len(prompts)})): "
            f"{plain_batch_tps:.2f} tok/s: the reference for the wall tok/s column (the live runs' batch)")

    # -- counterfactuals: the timing goal on 100 steps, then the rest ----------------------------------
    cf = {}
    for temp in temps:
        run = recorded[temp]
        t0 = time.perf_counter()
        head = counterfactuals(run, target, cm, names, BUDGETS, last=100)
        dt = time.perf_counter() - t0
        steps = len({(r.step, r.request) for r in head})
        out(f"counterfactual timing (goal <= 120 s): {steps} recorded steps x {len(names)} policies x {len(BUDGETS)} "
            f"budgets in {dt:.1f} s at T={temp}")
        cf[temp] = head + counterfactuals(run, target, cm, names, BUDGETS, first=100)

    t0 = time.perf_counter()
    not_run = []
    if args.live_workers > 1:
        out(f"live runs: {len(configs)} configurations in {args.live_workers} worker processes (one torch thread "
            f"each, so the configurations share the CPU {args.live_workers} at a time: a wall tok/s reads low)")
        live_rows.update(live_in_workers(configs, args.live_workers, prompts, args.new_tokens, cm))
    else:
        last = per_run
        for i, (temp, name, b) in enumerate(configs):
            if args.deadline_minutes is not None and (time.perf_counter() - start + last) / 60 > args.deadline_minutes:
                not_run.append((temp, name, b))
                continue
            _, row = live(target, drafter, prompts, args.new_tokens, temp, name, b, cm, "light")
            last = row["wall_s"]
            live_rows[(temp, name, b)] = row
            print(f"  live {i + 1}/{len(configs)}: T={temp} {name} B={b}: tau {row['tau']:.3f} ({row['wall_s']:.0f} s)",
                  flush=True)
    live_minutes = (time.perf_counter() - t0) / 60
    if not_run:
        out(f"live runs NOT made (the {args.deadline_minutes:.0f}-minute deadline; their bias is '-'): " +
            ", ".join(f"T={t} {n} B={b}" for t, n, b in not_run))

    # -- the table ----------------------------------------------------------------------------------
    def wall_tps(lv):  # this CPU's wall clock: not shown beside another device's costs
        return None if (lv is None or elsewhere is not None) else lv["wall_tok_s"]

    records = []
    for temp in temps:
        res = cf[temp]
        groups: dict[tuple[str, int], list] = {}
        for r in res:
            groups.setdefault((r.policy, r.budget), []).append(r)
        key = "tau_greedy" if temp == 0 else "tau_sampled"

        def tps(rs):
            if any(getattr(r, key) is None for r in rs):
                return None
            return sum(getattr(r, key) for r in rs) / sum(cm.round_seconds(1 + r.num_nodes) for r in rs)

        rate = {k: tps(v) for k, v in groups.items()}
        chain_best = max(v for (n, _), v in rate.items() if n == "chain" and v)
        out(f"\n## T={temp}: counterfactual from the DDTree B={RECORDED_BUDGET} recording "
            f"({len(recorded[temp].steps)} steps), live runs of the same prompts; E[tau] and tau count the bonus")
        out(f"{'policy':<8} {'B':>3} {'nodes':>6} {'E[tau] cf':>9} {'covered':>8} {'live tau':>8} {'bias':>7} "
            f"{'live nodes':>10} {'step ms':>8} {'exp tok/s':>9} {'x plain':>7} {'x chain':>7} {'live tok/s':>10} "
            f"{'wall tok/s':>10}")
        for (name, b), rs in groups.items():
            e = sum(getattr(r, key) for r in rs) / len(rs) if rate[(name, b)] is not None else None
            lv = live_rows.get((temp, name, b))
            bias = None if (lv is None or e is None) else e - lv["tau"]
            live_tps = None if lv is None else lv["tau"] / cm.round_seconds(1 + lv["nodes"])
            nodes = sum(r.num_nodes for r in rs) / len(rs)
            step_ms = cm.round_seconds(1 + round(nodes)) * 1e3
            f = lambda x, w, p=3: ("-" if x is None else f"{x:.{p}f}").rjust(w)  # noqa: E731
            t = rate[(name, b)]
            out(f"{name:<8} {b:>3} {nodes:>6.1f} {f(e, 9)} {sum(r.covered for r in rs):>4}/{len(rs):<3} "
                f"{f(lv and lv['tau'], 8)} {('-' if bias is None else f'{bias:+.3f}'):>7} "
                f"{f(lv and lv['nodes'], 10, 1)} {step_ms:>8.1f} {f(t, 9, 2)} {f(t and t / plain_tps, 7, 2)} "
                f"{f(t and t / chain_best, 7, 2)} {f(live_tps, 10, 2)} {f(wall_tps(lv), 10, 2)}")
            records.append({"temperature": temp, "policy": name, "budget": b, "nodes": nodes, "cf_tau": e,
                            "covered": sum(r.covered for r in rs), "steps": len(rs),
                            "live_tau": lv and lv["tau"], "bias": bias, "live_nodes": lv and lv["nodes"],
                            "round_ms": step_ms, "expected_tok_s": t, "live_tau_tok_s": live_tps,
                            "live_wall_tok_s": wall_tps(lv), "live_step_s": lv and lv["step_s"],
                            "by_depth": lv and lv["by_depth"]})
        out(f"break-even (expected tok/s; plain decoding {plain_tps:.2f} tok/s, the chain's best "
            f"{chain_best:.2f} tok/s):")
        for name in names:
            vs_plain = [b for b in BUDGETS if (rate.get((name, b)) or 0) > plain_tps]
            vs_chain = [b for b in BUDGETS if (rate.get((name, b)) or 0) > chain_best]
            best = max(BUDGETS, key=lambda b: rate.get((name, b)) or 0.0)
            out(f"  {name:<8} beats plain from budget {vs_plain[0] if vs_plain else 'never'}; beats the chain's best "
                f"from {vs_chain[0] if vs_chain else 'never'}; best budget {best} ({rate.get((name, best)) or 0:.2f} "
                f"tok/s, E[tau] {sum(getattr(r, key) for r in groups[(name, best)]) / len(groups[(name, best)]):.3f})")
        biases = [r["bias"] for r in records if r["temperature"] == temp and r["bias"] is not None]
        if biases:
            out(f"counterfactual bias at T={temp}: mean {statistics.mean(biases):+.3f}, range "
                f"{min(biases):+.3f} .. {max(biases):+.3f} over {len(biases)} live configurations")
    out(f"\nlive grid {live_minutes:.1f} min; total {(time.perf_counter() - start) / 60:.1f} min")
    meta = {"not_run_live": [list(c) for c in not_run], "target": target.name, "drafter": drafter.name, "prompts": prompts, "new_tokens": args.new_tokens,
            "cost_from": args.cost_model, "cost_device": (elsewhere or {}).get("device_name", "this CPU"),
            "plain_tok_s": plain_tps, "plain_batch_tok_s": plain_batch_tps, "draft_seconds_batch": t_draft_batch,
            "live_budgets": live_budgets, "recorded_budget": RECORDED_BUDGET,
            "cost_model": cm.to_dict()}
    Path(args.json).write_text(json.dumps({"meta": meta, "rows": records}, indent=1) + "\n")
    from ddtree_lab.views.policies import tokens_per_second_figure

    fig = tokens_per_second_figure(records, plain_tps)
    fig.write_html(args.figure, include_plotlyjs=True)
    try:
        import kaleido  # noqa: F401

        fig.write_image(str(Path(args.figure).with_suffix(".png")))
        out(f"figure: {args.figure} and its PNG")
    except ImportError:
        out(f"figure: {args.figure} (HTML only: kaleido is not installed, no static image)")
    Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
