"""The bug zoo: every planted fault kind in a short live run of the embedded default, what a user sees first, and what `diagnose` says.

For each kind of :data:`ddtree_lab.faults.FAULT_KINDS`: a live run (2 prompts, 24 tokens,
T = 0.8, top-k 20, top-p 0.9, budget 16; the min-p and ban faults with a request that uses
them) with the fault planted; the symptom (τ and acceptance
by depth against the clean run); ``diagnose(run, model=...)`` (with the loaded target and
drafter); the steps where the fault is active and observable (ground truth from the model:
recorded rows against fresh right forwards, recorded drafts against fresh drafter runs, the
lab's replay of the recorded walk, recorded rows against the right rows of the recorded
parameters) and on how many of them diagnose names the fault. Then the false-alarm count over
clean runs (greedy, T = 0.8, filtered, mixed batches, other seeds and budgets, bans), the
output-law check's power and false alarms alone on synthetic runs, and the timings of diagnose
on a run of at least 100 step records, without and with the model. For the verifier-rule kinds
a "catalogue off" column: ``diagnose(run, catalogue=False)`` (the rule named by rule inference
alone), and the share of observable steps named with the catalogue on and off.

    DDTREE_LAB_THREADS=1 python benchmarks/bug_zoo.py [--quick | --verifier-only] > benchmarks/bug_zoo.out.txt

``--verifier-only`` (the reduced size) runs only the verifier-rule kinds and the clean runs, and
writes their rows into the existing ``bug_zoo.json``, keeping the other kinds' rows of the last
full run (the output says so).

Writes ``benchmarks/bug_zoo.json`` (the matrix and figures, read by labs/08_bug_zoo.ipynb).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import ddtree_lab as dl
from ddtree_lab.diagnosis.forward import request_prefix, row_atol, step_rows_diff
from ddtree_lab.faults import (COMMIT_FAULTS, DRAFTER_FAULTS, FAULT_KINDS, FORWARD_FAULTS, SAMPLING_FAULTS,
                               VERIFIER_FAULTS)
from ddtree_lab.replaying import replay_differences

PROMPTS = ["Tell me about lighthouses.", "What is two plus two?"]
SAMPLED = dl.SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=1)
CHECKS = ("record", "verifier", "coins", "output-law", "sampling", "greedy", "drafter-hits", "tree-forward", "drafter",
          "greedy-decoding")
#: A fault that drops a filter or a ban shows only where the request uses it (the ids banned:
#: ' a', ' of', ' that', frequent in both prompts' answers).
KIND_SAMPLING = {"sampling-min-p-dropped": dl.SamplingParams(temperature=1.2, top_k=40, min_p=0.1, seed=1),
                 "sampling-banned-token-kept": dl.SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=1,
                                                                 banned_token_ids=(253, 282, 338))}
GOAL_RATE = 0.9


def live(target, drafter, faults=None, prompts=PROMPTS, sampling=SAMPLED, budget=16, tokens=24, seed=0):
    s = dl.LiveSession(target, drafter, budget=budget, sampling=sampling, seed=seed, faults=faults)
    run = s.run(prompts, max_new_tokens=tokens)
    run.metadata.pop("planted_faults", None)  # diagnose never reads it; removed to be sure
    return run


def symptom(run) -> dict:
    acc = [s.accept_length for s in run.steps]
    return {"tau": round(sum(a + 1 for a in acc) / len(acc), 3), "steps": len(acc),
            "acceptance_by_depth": [round(sum(a >= d for a in acc) / len(acc), 3) for d in (1, 2, 3)]}


@torch.no_grad()
def observable(run, target, drafter, kind: str) -> set:
    """Ground truth: the (step, request) where the fault changed what was recorded."""
    out = set()
    if kind in FORWARD_FAULTS or kind in COMMIT_FAULTS:
        for s in run.steps:
            prefix = request_prefix(run, s.request)[: s.prefix_len]
            state, _, _ = target.prefill_batch([prefix])
            logits = target.tree_forward_batch(state, s.buffers).logits[0].float()
            if float(step_rows_diff(s, logits).max()) > row_atol(s):
                out.add((s.step, s.request))
    elif kind in SAMPLING_FAULTS:
        for s in run.steps:
            prefix = request_prefix(run, s.request)[: s.prefix_len]
            state, _, _ = target.prefill_batch([prefix])
            logits = target.tree_forward_batch(state, s.buffers).logits.float()
            rows = dl.target_probs(logits, s.params)[0]
            want = torch.zeros(s.num_nodes)
            want[1:] = rows[s.parents[1:], s.node_token_ids[1:]]
            if float((want - s.child_probs).abs()[1:].max()) > 1e-4:
                out.add((s.step, s.request))
    elif kind in VERIFIER_FAULTS:
        for s in run.steps:
            _, diffs = replay_differences(s, run.vocab_size)
            reused = s.final_coin in s.coins[: s.num_nodes].tolist()
            if diffs or reused:
                out.add((s.step, s.request))
    return out


def per_step(diagnosis) -> dict:
    names: dict = {}
    for r in diagnosis.results:
        for key, name in r.per_step.items():
            names.setdefault(key, set()).add(name)
    return names


def zoo(target, drafter, kinds) -> list[dict]:
    rows = []
    for kind in kinds:
        t0 = time.perf_counter()
        run = live(target, drafter, [kind], sampling=KIND_SAMPLING.get(kind, SAMPLED))
        t_run = time.perf_counter() - t0
        t0 = time.perf_counter()
        d = dl.diagnose(run, model=(target, drafter))
        t_diag = time.perf_counter() - t0
        named = per_step(d)
        off = per_step(dl.diagnose(run, catalogue=False)) if kind in VERIFIER_FAULTS else None
        if kind in DRAFTER_FAULTS:  # the drafter check's mismatching steps are the observable ones
            obs = {k for r in d.results if r.check == "drafter" for k in r.per_step}
        else:
            obs = observable(run, target, drafter, kind)
        hit = sum(kind in named.get(k, ()) for k in obs)
        hit_off = None if off is None else sum(kind in off.get(k, ()) for k in obs)
        cells = {}
        for r in d.results:
            if not r.ran:
                cells[r.check] = "-"
            elif any(f.fault == kind for f in r.findings):
                cells[r.check] = "N"
            elif r.findings:
                cells[r.check] = "f"
            else:
                cells[r.check] = "."
        rows.append({"kind": kind, "what": FAULT_KINDS[kind], **symptom(run), "observable": len(obs), "named": hit,
                     "rate": round(hit / len(obs), 3) if obs else None, "cells": cells,
                     "named_catalogue_off": hit_off,
                     "rate_catalogue_off": round(hit_off / len(obs), 3) if obs and hit_off is not None else None,
                     "other_names": sorted(d.faults - {kind}),
                     "first": next((f.line() for f in d.findings if f.fault == kind),
                                   d.findings[0].line() if d.findings else "(nothing)"),
                     "run_s": round(t_run, 1), "diagnose_s": round(t_diag, 1)})
        print(f"  {kind}: observable {len(obs)}, named {hit}" + ("" if hit_off is None else
              f" (catalogue off: {hit_off})") + f", diagnose {t_diag:.1f} s", flush=True)
    return rows


def clean_configs(quick: bool) -> list[dict]:
    g = dl.SamplingParams(temperature=0.0)
    t8 = dl.SamplingParams(temperature=0.8)
    f = SAMPLED
    out = []
    for seed in range(4):
        out.append({"name": f"greedy seed {seed}", "sampling": g, "seed": seed, "budget": 16})
        out.append({"name": f"T=0.8 seed {seed}", "sampling": dataclass_seed(t8, seed), "seed": seed, "budget": 16})
        out.append({"name": f"T=0.8 top-k 20 top-p 0.9 seed {seed}", "sampling": dataclass_seed(f, seed),
                    "seed": seed, "budget": 16})
    for budget in (4, 8, 32):
        out.append({"name": f"greedy budget {budget}", "sampling": g, "seed": 0, "budget": budget})
        out.append({"name": f"T=0.8 budget {budget}", "sampling": t8, "seed": 5, "budget": budget})
    for seed in range(3):
        out.append({"name": f"mixed batch (greedy + T=0.8 top-p 0.95) seed {seed}", "seed": seed, "budget": 16,
                    "sampling": [g, dl.SamplingParams(temperature=0.8, top_p=0.95, seed=seed)]})
    out.append({"name": "T=1.2 top-k 40 min-p 0.05", "seed": 2, "budget": 16,
                "sampling": dl.SamplingParams(temperature=1.2, top_k=40, min_p=0.05, seed=3)})
    out.append({"name": "bans (greedy + T=0.8 filtered, 3 tokens banned)", "seed": 4, "budget": 16,
                "sampling": [dl.SamplingParams(temperature=0.0, banned_token_ids=(253, 282, 338)),
                             KIND_SAMPLING["sampling-banned-token-kept"]]})
    return out[:6] if quick else out


def dataclass_seed(p, seed):
    import dataclasses

    return dataclasses.replace(p, seed=100 + seed)


def false_alarms(target, drafter, quick: bool) -> list[dict]:
    rows = []
    for c in clean_configs(quick):
        run = live(target, drafter, None, sampling=c["sampling"], budget=c["budget"], tokens=16, seed=c["seed"])
        d0 = dl.diagnose(run)
        d = dl.diagnose(run, model=(target, drafter))
        lines = [f.line() for f in d0.findings + d.findings]
        rows.append({"config": c["name"], "steps": len(run.steps), "findings": len(d.findings) + len(d0.findings),
                     "lines": lines[:3], "ran": sum(r.ran for r in d.results)})
        print(f"  clean {c['name']}: {len(run.steps)} steps, {rows[-1]['findings']} finding(s)", flush=True)
    return rows


def law_power(quick: bool) -> dict:
    """The output-law check alone (no model, no coins read) on synthetic runs
    (:func:`ddtree_lab.io.synthetic.synthetic_steps`: 4 requests, budget 16, V = 200, T = 1):
    false alarms over clean runs, and for each verifier fault the share of runs it flags at
    25 and 100 decoding steps (100 and 400 step records), with the recorded coins replaced
    by fresh ones (a verifier whose recorded coins are not the ones it used)."""
    from ddtree_lab.diagnosis.law import check_law
    from ddtree_lab.io.synthetic import SyntheticShape, synthetic_steps

    shape = SyntheticShape(requests=4, budget=16, vocab=200, level="light", temperature=1.0)
    g = torch.Generator().manual_seed(0)

    def flagged(faults, seed, steps):
        run = dl.Run({"vocab_size": 200}, [s.replace(coins=torch.rand(s.num_nodes, generator=g), final_coin=0.5)
                                           for k in range(steps) for s in synthetic_steps(shape, seed, k, faults=faults)])
        return bool(check_law(run).findings)

    runs = 4 if quick else 20
    out = {"clean_runs": runs * 2, "clean_flagged": sum(flagged(None, seed, 25) for seed in range(runs * 2)),
           "runs_per_cell": runs, "faults": {}}
    for kind in VERIFIER_FAULTS:
        out["faults"][kind] = {str(n): sum(flagged([kind], 1000 + seed, n) for seed in range(runs)) for n in (25, 100)}
        print(f"  output-law on {kind}: {out['faults'][kind]} of {runs} runs flagged", flush=True)
    return out


def timings(target, drafter) -> dict:
    run = live(target, drafter, None, tokens=170)
    t0 = time.perf_counter()
    dl.diagnose(run)
    no_model = time.perf_counter() - t0
    t0 = time.perf_counter()
    dl.diagnose(run, model=(target, drafter))
    with_model = time.perf_counter() - t0
    return {"step_records": len(run.steps), "decoding_steps": 1 + max(s.step for s in run.steps),
            "no_model_s": round(no_model, 2), "with_model_s": round(with_model, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="three kinds and six clean runs (a smoke test)")
    ap.add_argument("--verifier-only", action="store_true",
                    help="the reduced size: only the verifier-rule kinds and the clean runs (other rows kept)")
    ap.add_argument("--json", default=str(Path(__file__).with_name("bug_zoo.json")))
    args = ap.parse_args()
    from ddtree_lab.models.loading import load_default

    t0 = time.perf_counter()
    target, drafter = load_default()
    load_s = time.perf_counter() - t0
    kinds = list(FAULT_KINDS)[:3] if args.quick else list(VERIFIER_FAULTS) if args.verifier_only else list(FAULT_KINDS)
    if args.verifier_only:
        print("REDUCED SIZE (--verifier-only): only the verifier-rule kinds and the clean runs are run here; the other "
              "kinds' rows of the matrix come from the last full run in bug_zoo.json", flush=True)
    clean = symptom(live(target, drafter))
    print(f"models loaded in {load_s:.1f} s; clean run: tau {clean['tau']}, acceptance by depth "
          f"{clean['acceptance_by_depth']}", flush=True)
    rows = zoo(target, drafter, kinds)
    alarms = false_alarms(target, drafter, args.quick)
    law = law_power(args.quick)
    times = timings(target, drafter)
    if args.verifier_only and Path(args.json).exists():
        old = json.loads(Path(args.json).read_text())
        fresh = {r["kind"] for r in rows}
        rows = [r for r in old["zoo"] if r["kind"] not in fresh and r["kind"] in FAULT_KINDS] + rows
        rows.sort(key=lambda r: list(FAULT_KINDS).index(r["kind"]))

    print("\n== The zoo: symptom first (what the views show), then what diagnose says ==")
    print(f"clean: tau {clean['tau']}, P(accept >= 1, 2, 3) {clean['acceptance_by_depth']}")
    for r in rows:
        print(f"\n{r['kind']} ({r['what']})\n  symptom: tau {r['tau']} (clean {clean['tau']}), P(accept >= 1, 2, 3) "
              f"{r['acceptance_by_depth']}\n  diagnose: {r['first']}")
        if r["other_names"]:
            print(f"  also named: {', '.join(r['other_names'])}")
    print("\n== Detection matrix (N: the check names this fault; f: it flags something else or unnamed; "
          ".: ran, nothing found; -: could not run) ==")
    short = {c: c[:8] for c in CHECKS}
    print(f"{'kind':32s} " + " ".join(f"{short[c]:>8s}" for c in CHECKS) + "  observable named  rate  cat-off")
    for r in rows:
        rate = "n/a" if r["rate"] is None else f"{r['rate']:.2f}"
        off = r.get("rate_catalogue_off")
        off_s = "" if r["kind"] not in VERIFIER_FAULTS else "n/a" if off is None else f"{off:.2f}"
        print(f"{r['kind']:32s} " + " ".join(f"{r['cells'].get(c, '?'):>8s}" for c in CHECKS) +
              f"  {r['observable']:10d} {r['named']:5d}  {rate:>4s}  {off_s:>7s}")
    print("  (cat-off: the share of observable steps named with diagnose(run, catalogue=False), the verifier's rule "
          "named by rule inference alone; verifier-rule kinds only)")
    print("\n== Verifier-rule kinds: share of the observable steps named, catalogue on / off ==")
    for r in rows:
        if r["kind"] in VERIFIER_FAULTS:
            on = "n/a" if r["rate"] is None else f"{r['rate']:.2f}"
            off = r.get("rate_catalogue_off")
            print(f"  {r['kind']:32s} {r['observable']:3d} observable: on {on} ({r['named']}), off "
                  + ("n/a" if off is None else f"{off:.2f} ({r['named_catalogue_off']})"))
    rated = [r for r in rows if r["rate"] is not None]
    met = [r for r in rated if r["rate"] >= GOAL_RATE]
    fa = sum(a["findings"] > 0 for a in alarms)
    print("\n== False alarms over clean runs (no fault planted; diagnose with and without the model) ==")
    for a in alarms:
        print(f"  {a['config']:48s} {a['steps']:3d} steps  {a['findings']} finding(s)" +
              ("" if not a["lines"] else "  " + a["lines"][0]))
    print(f"\n== The output-law check alone (statistical; no model, no coin read), synthetic runs ==\n"
          f"  false alarms: {law['clean_flagged']} of {law['clean_runs']} clean runs (100 step records each)")
    for kind, cells in law["faults"].items():
        print(f"  {kind:32s} flagged in {cells['25']} of {law['runs_per_cell']} runs at 100 step records, "
              f"{cells['100']} of {law['runs_per_cell']} at 400")
    print(f"\n== Timings (models loaded once: {load_s:.1f} s) ==\n  run of {times['step_records']} step records "
          f"({times['decoding_steps']} decoding steps, 2 requests): diagnose without a model {times['no_model_s']} s, "
          f"with the model {times['with_model_s']} s")
    print("\n== Goals ==")
    below = [f"{r['kind']} {r['rate']:.2f}" for r in rated if r["rate"] < GOAL_RATE]
    print(f"  named with its cause on >= 90% of the observable steps: {len(met)} of {len(rated)} kinds"
          + (f" (below: {', '.join(below)})" if below else " (every kind)"))
    vr = [r for r in rows if r["kind"] in VERIFIER_FAULTS and r["rate"] is not None]
    on_met = sum(r["rate"] >= GOAL_RATE for r in vr)
    off_met = sum((r.get("rate_catalogue_off") or 0.0) >= GOAL_RATE for r in vr)
    print(f"  verifier-rule kinds named on >= 90% of the observable steps: catalogue on {on_met} of {len(vr)}, "
          f"catalogue off {off_met} of {len(vr)}")
    unobserved = [r["kind"] for r in rows if r["rate"] is None]
    if unobserved:
        print(f"  kinds never observable in their run: {', '.join(unobserved)}")
    print(f"  false alarms: {fa} of {len(alarms)} clean runs (goal 0 over >= 20)")
    print(f"  diagnose without a model on >= 100 step records: {times['no_model_s']} s (goal <= 5 s); "
          f"with the model: {times['with_model_s']} s (goal <= 120 s)")
    Path(args.json).write_text(json.dumps({"clean": clean, "zoo": rows, "false_alarms": alarms, "timings": times,
                                           "output_law": law, "verifier_only": bool(args.verifier_only),
                                           "load_s": round(load_s, 1), "checks": list(CHECKS)}, indent=1))


if __name__ == "__main__":
    main()
