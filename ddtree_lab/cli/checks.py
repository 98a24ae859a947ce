"""Verbs that check: audit (the losslessness audit) and doctor (every invariant, and tree rows against the model)."""

from __future__ import annotations

from pathlib import Path

from . import common
from .common import (MIN_DRAWS, EXIT_PROBLEM, CLIError, bundle_module, check_bundle_dir, check_bundle_selection,
                     check_new_output, check_out_file, check_suffix, count, find_step, inputs_of, kind_of, load_run,
                     params_override, recording_step, select_steps, sglang_module, thread_note, write_output)



def cmd_audit(args) -> int:
    """The losslessness audit: a verifier's law on a step against the exact law."""
    from .. import audit as au

    if args.engine == "list":
        return engine_list(args)
    if args.engine in ("sglang:chain", "vllm:rejection-sampler"):
        args.engine = args.engine.split(":")[0]
    if args.engine is not None and args.engine.startswith(("sglang:", "vllm:")):
        return engine_rule(args)
    known = ("reference", "torch-lazy", "triton", *au.PLANTED_FAULTS)
    if args.verifier not in known:
        raise CLIError(f"--verifier {args.verifier}: unknown verifier (reference, torch-lazy, triton, or a planted "
                       f"fault: {', '.join(au.PLANTED_FAULTS)})")
    if args.draws is None:
        args.draws = 4000
    if args.draws < MIN_DRAWS:
        raise CLIError(f"--draws {args.draws}: need at least {MIN_DRAWS} coin sets (with fewer the test "
                       "cannot reject anything, so every verifier would look lossless)")
    if args.random is not None and args.random < 1:
        raise CLIError(f"--random {args.random}: the number of random cases must be >= 1")
    if args.nodes < 2:
        raise CLIError(f"--nodes {args.nodes}: a random tree needs >= 2 nodes (the root and a draft node)")
    if args.vocab < 2:
        raise CLIError(f"--vocab {args.vocab}: a random case needs a vocabulary of >= 2 tokens")
    if not 0 < args.alpha < 1:
        raise CLIError(f"--alpha {args.alpha}: the significance level must be in (0, 1)")
    if args.threads is not None and args.threads < 1:
        raise CLIError(f"--threads {args.threads}: must be >= 1")
    if args.random is not None and (args.source is not None or args.step is not None or args.request is not None):
        raise CLIError("--random N audits random cases: leave out the TRACE/BUNDLE, --step and --request")
    if args.plot:
        check_out_file(args.plot)
        check_suffix(args.plot, "html", (".html", ".htm"))
        for path in plot_paths(args.plot, args.random if args.random is not None else 1):
            check_new_output(path, args.force, "--plot", inputs=inputs_of(args))
    overrides = [k for k in ("temperature", "top_k", "top_p", "min_p") if getattr(args, k, None) is not None]
    if overrides:  # before any trace or model is loaded
        from ..sampling import SamplingParams

        for name in overrides:  # each option alone, so the message names it
            common.check_sampling_option(name, getattr(args, name))
        if args.random is None and args.model is None:
            raise CLIError("sampling overrides need --model (a trace stores final probabilities, not logits)")
        try:
            params_override(args, SamplingParams(temperature=1.0))
        except (ValueError, TypeError) as exc:
            raise CLIError(f"sampling override: {str(exc).removeprefix('SamplingParams: ')}") from exc
    thread_note(args.threads)
    cases = []
    if args.random is not None:
        from ..sampling import SamplingParams

        base = SamplingParams(temperature=1.0)
        p = params_override(args, base)
        if args.engine:  # the engines' chain samplers verify chains
            from ..engines import random_chain_case

            cases = [random_chain_case(args.seed + k, args.nodes - 1, args.vocab, p) for k in range(args.random)]
        else:
            cases = [au.random_case(args.seed + k, args.nodes, args.vocab, p) for k in range(args.random)]
    elif args.source is None:
        raise CLIError("audit needs a TRACE, a BUNDLE or --random N")
    elif kind_of(args.source) == "bundle":
        bundle = bundle_module()
        check_bundle_dir(args.source)
        b = bundle.load_bundle(args.source)
        check_bundle_selection(b, args, args.source)
        cases = [au.case_from_step(b.step, b.token_texts)]
    else:
        run = load_run(args.source)
        step = find_step(run, args.step, args.request, args.source)
        target = common.load_model(args.model)
        if target is None:
            if any(getattr(args, k, None) is not None for k in ("temperature", "top_k", "top_p", "min_p")):
                raise CLIError("sampling overrides need --model (a trace stores final probabilities, not logits)")
            cases = [au.case_from_step(step, run.token_texts)]
        else:
            with common.progress(1, "target forward of the step's tree", unit="forward") as bar:
                logits = au.step_logits(target, run, step)
                bar.update()
            cases = [au.case_from_logits(step, logits, params_override(args, step.params), run.token_texts)]
    verifier = args.verifier
    worst = 0
    engine = open_engine_of(args)
    for k, case in enumerate(cases):
        if engine is not None:
            from ..engines import audit_engine

            try:
                report = audit_engine(engine.make, case, draft=args.draft, draws=args.draws, seed=args.seed,
                                      alpha=args.alpha)
            except (ValueError, RuntimeError) as exc:
                engine.close()
                raise CLIError(f"--engine {args.engine}: {exc}") from exc
        else:
            report = au.audit(case, verifier, draws=args.draws, seed=args.seed, alpha=args.alpha,
                              threshold_single=args.threshold_single, threshold_acc=args.threshold_acc,
                              validate=not args.no_validate)
        print(report.text(args.top))
        if args.plot:
            path = plot_paths(args.plot, len(cases))[k]
            # plotly.js embedded (~4.8 MB page): the page draws offline and attached to a bug report
            write_output(path, report.figure().to_html(include_plotlyjs=True))
            print(f"  plot -> {path}")
        if report.rejected or report.findings:
            worst = EXIT_PROBLEM
    if engine is not None:
        engine.close()
    return worst


def engine_list(args) -> int:
    """``audit --engine list``: the inventory of both engines' entry points
    (:mod:`ddtree_lab.engines.inventory`) with each rule's last verdict (benchmarks/engine_audit.json)."""
    from ..engines import inventory as inv

    if args.source is not None or args.random is not None or args.engine_fault is not None:
        raise CLIError("--engine list prints the inventory: leave out the TRACE/BUNDLE, --random and --engine-fault")
    try:
        found = inv.inventory()
    except inv.InventoryError as exc:
        print(str(exc))
        return EXIT_PROBLEM
    verdicts = inv.last_verdicts()
    if args.format == "markdown":
        print(inv.inventory_table(found, verdicts))
    else:
        print(inv.inventory_blocks(found, verdicts))
    if not verdicts:
        print(f"(no verdicts yet: run benchmarks/engine_audit.py, which writes {inv.VERDICTS_FILE.name})")
    return 0


def engine_rule(args) -> int:
    """``audit --engine sglang:RULE`` / ``vllm:RULE``: one engine rule end to end on its standard
    case (seed ``--seed``); vLLM's rules run in a worker in the vLLM venv."""
    from ..engines import end_to_end as e2e
    from ..engines import sglang_rules as sr
    from ..engines import vllm_rules as vr

    engine, rule = args.engine.split(":", 1)
    rules = sr.RULES if engine == "sglang" else vr.RULES
    if args.source is not None or args.random is not None or args.step is not None:
        raise CLIError(f"--engine {args.engine} audits the rule on its own case: leave out the TRACE/BUNDLE, "
                       "--random and --step")
    if args.engine_fault is not None and args.engine_fault not in rules[rule].faults:
        raise CLIError(f"--engine-fault {args.engine_fault}: --engine {args.engine} takes "
                       f"{', '.join(rules[rule].faults)}")
    if any(getattr(args, k, None) is not None for k in ("temperature", "top_k", "top_p", "min_p")):
        raise CLIError(f"--engine {args.engine}: the rule's case fixes its requests' parameters (docs/ENGINES.md)")
    draws = args.draws if args.draws is not None else (400 if engine == "vllm" or rule.startswith("dflash2") else 3000)
    if draws < MIN_DRAWS:
        raise CLIError(f"--draws {draws}: need at least {MIN_DRAWS} draws per request")
    if not 0 < args.alpha < 1:
        raise CLIError(f"--alpha {args.alpha}: the significance level must be in (0, 1)")
    name = args.engine + (f" + {args.engine_fault}" if args.engine_fault else "")
    try:
        if engine == "sglang":
            report = e2e.audit_rule(name, sr.run_rule(rule, args.engine_fault),
                                    sr.standard_case(rule, args.seed, args.engine_fault), sr.RULES[rule].law,
                                    draws=draws, seed=args.seed, alpha=args.alpha)
        else:
            from ..engines.vllm import VLLMWorker

            with VLLMWorker() as worker:
                report = e2e.audit_rule(name, vr.run_rule(rule, worker, args.engine_fault),
                                        vr.standard_case(rule, args.seed, args.engine_fault), vr.RULES[rule].law,
                                        draws=draws, seed=args.seed, alpha=args.alpha)
    except (ValueError, RuntimeError) as exc:
        raise CLIError(f"--engine {args.engine}: {exc}") from exc
    print(report.text(args.top))
    print(f"  ({report.seconds:.1f} s in the engine)")
    return EXIT_PROBLEM if report.rejected else 0
def plot_paths(plot: str, n: int) -> list[str]:
    """The ``--plot`` files of ``n`` audited cases: the name itself for one, NAME-k.html for several."""
    return [plot] if n == 1 else [f"{Path(plot).with_suffix('')}-{k}.html" for k in range(n)]


def open_engine_of(args):
    """The engine ``audit --engine`` names (:mod:`ddtree_lab.engines`), or None."""
    if args.engine is None:
        if args.draft != "target-only" or args.engine_fault is not None:
            raise CLIError("--draft and --engine-fault go with --engine vllm|sglang")
        return None
    if args.verifier != "reference" or args.threshold_single != 1.0 or args.threshold_acc != 1.0 or args.no_validate:
        raise CLIError("--engine audits the engine's own verifier: leave out --verifier, --threshold-* and --no-validate")
    from ..engines import open_engine

    try:
        engine = open_engine(args.engine, args.engine_fault)
    except (ValueError, RuntimeError) as exc:
        raise CLIError(f"--engine {args.engine}: {exc}") from exc
    print(f"engine: {engine.about}")
    return engine


def cmd_doctor(args) -> int:
    """Check verify buffers (every broken invariant) and, with --model, tree logits
    (:func:`ddtree_lab.doctor`; a SGLang recording: :func:`ddtree_lab.sglang.recording_problems`)."""
    if args.sample < 1:
        raise CLIError(f"--sample {args.sample}: must be >= 1")
    kind = kind_of(args.source)
    from ..replaying import BY_DESIGN, by_design_line

    found = design = 0
    checked = 0
    if kind == "recording":
        sg = sglang_module()
        rec = sg.load_recording(args.source)
        only = recording_step(rec, args, args.source)
        checked = rec.num_rows if only is None else len(rec.steps[only]["rows"])
        for p in sg.recording_problems(rec):  # links, coins, SGLang's outputs against the buffers
            if only is not None and not p.startswith(f"step {only} "):
                continue
            found += 1
            print(f"{args.source}: {p}")
        from ..sglang.replay import replay_step

        for k, step in enumerate(rec.steps):  # a by-design row: the one wording every verb gives it, not a problem
            for row in range(len(step["rows"]) if only in (None, k) else 0):
                try:
                    r = replay_step(step, row, "reference", k)
                except ValueError:  # a row the lab's verifier refuses: its problem is listed above
                    continue
                if r.by_design:
                    design += 1
                    print(by_design_line(f"{args.source}: step {r.step} row {r.row} {r.request_id} {r.kind}",
                                         r.explanation))
    else:  # any source io.load opens: the doctor view of the diagnosis package
        from ..diagnosis import doctor

        run = load_run(args.source)
        found += len(run.problems)
        for p in run.problems:  # each problem counted is named (stdout), not only warned about on stderr
            print(f"problem: {p}")
        steps = select_steps(run, args.step, args.request, args.source)
        if not steps and not run.problems:
            raise CLIError(f"{args.source}: nothing to check: this {run.source} records no steps")
        if steps and all(s.buffers is None for s in steps):
            raise CLIError(f"{args.source}: nothing to check: this {run.source} records no verify buffers")
        target = step = None
        if args.model is not None:
            step = find_step(run, args.step, args.request, args.source)  # before the model loads (seconds)
            target = common.load_model(args.model)
        with common.progress(1, f"causal forwards of {count(args.sample, 'sampled node')}", unit="check",
                             quiet=target is None) as bar:
            report = doctor(run, steps, target, step, sample=args.sample, seed=args.seed)
            bar.update()
        checked += report.checked
        found += len(report.problems)
        for p in report.invariants:
            print(f"{args.source}: {p}")
        from ..diagnosis.common import engine_by_design

        for s in steps:  # a converted engine recording's by-design steps: said, not counted as problems
            why = engine_by_design(s)
            if why:
                design += 1
                print(by_design_line(f"{args.source}: step {s.step}, request {s.request}", why))
        if report.rows is not None:
            assert step is not None  # the model check (report.rows) runs only with --model, which found the step
            print(f"step {step.step}, request {step.request}: {report.rows.text()}")
            if not report.rows.checked:
                raise CLIError(f"step {step.step}, request {step.request}: the model check compared no node (none of "
                               "the sampled nodes' tokens is in its parent's stored rows); try another --seed or "
                               "`ddtree-lab diagnose` with --model")
    also = f" ({design} {BY_DESIGN}, not a problem)" if design else ""
    print(f"{count(checked, 'row' if kind == 'recording' else 'step')} checked, {count(found, 'problem')}{also}")
    return EXIT_PROBLEM if found else 0
