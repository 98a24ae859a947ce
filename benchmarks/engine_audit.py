"""The engine audit: every engine rule the lab audits on a CPU, its verdict, p-value, draws, its
planted faults' p-values, false alarms over many seeds, and the time.

Rules: SGLang's end-to-end rules (ddtree_lab.engines.sglang_rules: DFlash 2 selector + DSpark
accept, block mode on, block-wise rejection with draft logits and one-hot drafts), SGLang's
chain sampler and vLLM's RejectionSampler (draft tokens given: ddtree_lab.engines.common; vLLM
only with its venv), and vLLM's new model runner end to end (ddtree_lab.engines.vllm_rules:
DFlash 2's CandidateSampler walk + rejection_sample, block verification off and on, one-hot
drafts; in the vLLM worker, kernels in Triton's interpreter, so fewer draws: ``--draws-vllm``). Each rule: one audit of its standard case (seed 0), each planted fault on
its fault case, then ``--seeds`` audits of the standard case for seeds 0.. (a new case and new
engine draws per seed) counting rejections at alpha = 1e-3 (false alarms: the rules are
lossless). The DFlash 2 rules run SGLang's chain kernel in Triton's interpreter (~65 ms a row
on this 2-core machine), so their sweep uses fewer draws (``--sweep-draws-interpreted``).

    DDTREE_LAB_THREADS=1 python benchmarks/engine_audit.py > benchmarks/engine_audit.out.txt

Writes benchmarks/engine_audit.json (each rule's last verdict, read by
``ddtree-lab audit --engine list``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

OUT = Path(__file__).with_name("engine_audit.json")
ALPHA = 1e-3


def sglang_rule(rule: str, args) -> dict:
    from ddtree_lab.engines import end_to_end as e2e
    from ddtree_lab.engines import sglang_rules as sr

    why = sr.sglang_rules_unavailable_reason(rule)
    if why is not None:
        return {"verdict": f"not run: {why}"}
    law = sr.RULES[rule].law
    interpreted = rule.startswith("dflash2")
    draws = args.draws_interpreted if interpreted else args.draws
    t0 = time.perf_counter()
    main = e2e.audit_rule(f"sglang:{rule}", sr.run_rule(rule), sr.standard_case(rule, 0), law, draws=draws, seed=0)
    faults = {}
    for f in sr.RULES[rule].faults:
        rep = e2e.audit_rule(rule, sr.run_rule(rule, f), sr.standard_case(rule, 0, f), law, draws=draws, seed=0)
        faults[f] = rep.p_value
    sweep_draws = args.sweep_draws_interpreted if interpreted else args.sweep_draws
    alarms, ps = 0, []
    for s in range(args.seeds):
        rep = e2e.audit_rule(rule, sr.run_rule(rule), sr.standard_case(rule, s), law, draws=sweep_draws, seed=s)
        alarms += rep.rejected
        ps.append(rep.p_value)
    return {"verdict": main.verdict, "p_value": main.p_value, "draws": main.draws, "law": law,
            "faults": faults, "false_alarms": alarms, "seeds": args.seeds, "sweep_draws": sweep_draws * len(main.reports),
            "sweep_min_p": min(ps) if ps else None, "seconds": round(time.perf_counter() - t0, 1)}


def vllm_rule(rule: str, args, worker) -> dict:
    from ddtree_lab.engines import end_to_end as e2e
    from ddtree_lab.engines import vllm_rules as vr

    if worker is None:
        return {"verdict": f"not run: {vr.vllm_rules_unavailable_reason() or 'the vLLM worker did not start'}"}
    law = vr.RULES[rule].law
    t0 = time.perf_counter()
    main = e2e.audit_rule(f"vllm:{rule}", vr.run_rule(rule, worker), vr.standard_case(rule, 0), law,
                          draws=args.draws_vllm, seed=0)
    faults = {}
    for f in vr.RULES[rule].faults:
        rep = e2e.audit_rule(rule, vr.run_rule(rule, worker, f), vr.standard_case(rule, 0, f), law,
                             draws=args.draws_vllm, seed=0)
        faults[f] = rep.p_value
    alarms, ps = 0, []
    for s in range(args.seeds):
        rep = e2e.audit_rule(rule, vr.run_rule(rule, worker), vr.standard_case(rule, s), law,
                             draws=args.sweep_draws_vllm, seed=s)
        alarms += rep.rejected
        ps.append(rep.p_value)
    return {"verdict": main.verdict, "p_value": main.p_value, "draws": main.draws, "law": law,
            "faults": faults, "false_alarms": alarms, "seeds": args.seeds,
            "sweep_draws": args.sweep_draws_vllm * len(main.reports), "sweep_min_p": min(ps) if ps else None,
            "seconds": round(time.perf_counter() - t0, 1)}


def chain_rule(engine: str, args) -> dict:
    import ddtree_lab as dl
    from ddtree_lab.engines import audit_engine, open_engine, random_chain_case

    params = dl.SamplingParams(temperature=0.8, top_k=5, top_p=0.9)
    t0 = time.perf_counter()
    try:
        eng, bad = open_engine(engine), open_engine(engine, "temperature-1")
    except (RuntimeError, ValueError) as err:
        return {"verdict": f"not run: {err}"}
    try:
        draws = args.draws_chain
        main = audit_engine(eng.make, random_chain_case(2, 3, 8, params), draws=draws, seed=0)
        fault = audit_engine(bad.make, random_chain_case(2, 3, 8, params), draws=draws, seed=0)
        alarms, ps = 0, []
        for s in range(args.seeds):
            rep = audit_engine(eng.make, random_chain_case(100 + s, 3, 8, params), draws=args.sweep_draws_chain, seed=s)
            alarms += rep.rejected
            ps.append(rep.p_value)
    finally:
        eng.close()
        bad.close()
    return {"verdict": main.verdict, "p_value": main.p_value, "draws": main.draws, "law": "chain, draft tokens given",
            "faults": {"temperature-1": fault.p_value}, "false_alarms": alarms, "seeds": args.seeds,
            "sweep_draws": args.sweep_draws_chain, "sweep_min_p": min(ps) if ps else None,
            "seconds": round(time.perf_counter() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=20, help="seeds of the false-alarm sweep per rule")
    ap.add_argument("--draws", type=int, default=3000, help="draws per request, torch rules")
    ap.add_argument("--draws-interpreted", type=int, default=400, help="draws per request, DFlash 2 rules")
    ap.add_argument("--sweep-draws", type=int, default=1500, help="sweep draws per request, torch rules")
    ap.add_argument("--sweep-draws-interpreted", type=int, default=60, help="sweep draws per request, DFlash 2 rules")
    ap.add_argument("--draws-chain", type=int, default=1500, help="draws, chain samplers (SGLang, vLLM)")
    ap.add_argument("--sweep-draws-chain", type=int, default=200, help="sweep draws, chain samplers")
    ap.add_argument("--draws-vllm", type=int, default=400, help="draws per request, vLLM new-runner rules")
    ap.add_argument("--sweep-draws-vllm", type=int, default=60, help="sweep draws per request, vLLM new-runner rules")
    ap.add_argument("--rules", default="all", help="comma-separated engine:rule names, or all")
    args = ap.parse_args()
    from ddtree_lab.threads import configure_threads

    configure_threads()  # DDTREE_LAB_THREADS, else the cores and their load (the header says what it chose)
    from ddtree_lab.engines import sglang_rules as sr
    from ddtree_lab.engines import vllm_rules as vr

    names = [f"sglang:{r}" for r in sr.RULES] + ["sglang:chain", "vllm:rejection-sampler"] + \
        [f"vllm:{r}" for r in vr.RULES]
    if args.rules != "all":
        names = [n for n in names if n in args.rules.split(",")]
    print(f"engine audit: alpha {ALPHA:g}, {args.seeds} seeds per rule; {platform.machine()}, "
          f"{os.cpu_count()} CPUs, torch {torch.__version__}, torch threads {torch.get_num_threads()}")
    t0 = time.perf_counter()
    old = json.loads(OUT.read_text()).get("rules", {}) if OUT.exists() else {}
    worker = None
    if any(n.split(":")[1] in vr.RULES for n in names if n.startswith("vllm:")):
        from ddtree_lab.engines.vllm import VLLMWorker

        try:
            worker = VLLMWorker()
        except RuntimeError as err:
            print(f"vLLM worker: {err}")
    for name in names:
        engine, rule = name.split(":")
        if rule in ("chain", "rejection-sampler"):
            res = chain_rule("sglang" if rule == "chain" else "vllm", args)
        elif engine == "vllm":
            res = vllm_rule(rule, args, worker)
        else:
            res = sglang_rule(rule, args)
        faults = ", ".join(f"{f} p = {p:.3g}" for f, p in res.get("faults", {}).items())
        if "p_value" in res:
            print(f"{name:34s} {res['verdict']}; p = {res['p_value']:.3g} ({res['draws']} draws, {res['law']} law); "
                  f"planted: {faults}; false alarms {res['false_alarms']}/{res['seeds']} "
                  f"({res['sweep_draws']} draws each, smallest p {res['sweep_min_p']:.3g}); {res['seconds']} s", flush=True)
        else:
            print(f"{name:34s} {res['verdict']}", flush=True)
        old[name] = res  # written after each rule: a cut run keeps what it measured
        OUT.write_text(json.dumps({"alpha": ALPHA, "rules": old}, indent=1) + "\n")
    if worker is not None:
        worker.close()
    total = time.perf_counter() - t0
    print(f"total {total:.0f} s")


if __name__ == "__main__":
    main()
