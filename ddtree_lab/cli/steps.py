"""Verbs over recorded steps: info, render, bundle, replay, sglang."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .common import (EXIT_PROBLEM, CLIError, bundle_module, check_new_output, check_out_file, check_suffix, count,
                     find_step, inputs_of, kind_of, load_run, lossy_note, recording_step, select_steps, sglang_module,
                     state_temperature_option, write_output, wrote)



def cmd_info(args) -> int:
    """Requests with prompts, parameters and mean tau; then each request's steps."""
    from ..io.append_trace import AppendRun  # the run with an index (info_lines)
    from ..sampling import param_is_off

    run = load_run(args.trace)
    state_temperature_option(run, args, args.trace)
    if isinstance(run, AppendRun) and run.metadata.get("lazy"):
        # a large append-only recording: from its index, no step decoded
        print("\n".join(run.info_lines()))
        return 0
    # an append-only recording cut short: the same lines as a whole one, and one "partial:" line saying what it lacks
    partial = run.partial_line() if isinstance(run, AppendRun) else ""
    stopped = set(run.stop_problems) if isinstance(run, AppendRun) else set()
    problems = [p for p in run.problems if p not in stopped]
    meta = run.metadata
    target = meta.get("target", {})
    drafter = meta.get("drafter", {})
    tname = target.get("name", "?") if isinstance(target, dict) else str(target)
    dname = drafter.get("name", "?") if isinstance(drafter, dict) else str(drafter)
    print(f"{run.source} {args.trace}: {count(len(run.steps), 'record')}"
          + (f"; {count(len(problems), 'problem')} reading it:" if problems else ""))
    for problem in problems:  # named here (stdout), not only in the warnings on stderr
        print(f"  problem: {problem}")
    if partial:
        print(partial)
    # a step that did not finish lacks its output because the process stopped, not because of the recording level
    lacking = sorted({m for s in run.steps if not s.extra.get("did_not_return") for m in s.missing_stages()})
    if lacking:
        print(f"not recorded: {', '.join(lacking)} (the views show what there is; replay and audit need buffers, "
              "rows and coins)")
    print(f"target: {tname}" + (f" ({target.get('dtype')}, {target.get('device')})" if isinstance(target, dict)
                                  and target.get("dtype") else ""))
    print(f"drafter: {dname}" + (f", block size {drafter.get('block_size')}" if isinstance(drafter, dict)
                                   and drafter.get("block_size") else ""))
    if isinstance(drafter, dict) and drafter.get("record_problem"):
        print(f"  drafter's model card: {drafter['record_problem']}")
    extras = {k: meta[k] for k in ("budget", "max_depth", "verifier", "source") if k in meta}
    if extras:
        print("run: " + ", ".join(f"{k} {v}" for k, v in extras.items()))
    if run.steps and all(s.rows is None for s in run.steps) or not run.steps:
        from ..io.decoding_mode import mode_text, records_parameters
        from ..views.run_summary import run_summary_text

        if run.steps and not records_parameters(run):
            print(mode_text(run))

        print(run_summary_text(run).rstrip())
        return 0
    requests = {int(r.get("request", i)): r for i, r in enumerate(meta.get("requests", []))}
    def returned(s):  # an append-only recording: a verify call that never returned has its inputs only
        return s.output is not None and not s.extra.get("did_not_return")

    for s in run.steps:
        if not returned(s) and not partial:  # (an append-only recording's are in its "partial:" line)
            print(f"did not return: step {s.step}, request {s.request} (its inputs are on disk: `ddtree-lab doctor` "
                  "checks them)")
    for req in sorted({s.request for s in run.steps} | set(requests)):
        steps = [s for s in run.for_request(req) if returned(s)]
        # an SGLang recording's steps: SGLang's own emitted tokens (the step's output is the lab's walk)
        taus = [len(s.extra["sglang_emitted"]) if "sglang_emitted" in s.extra else
                s.accept_length + (0 if s.output is not None and bool(s.output.support_exhausted[0]) else 1)
                for s in steps]
        r = requests.get(req, {})
        prompt = r.get("prompt")
        p = steps[0].params if steps else None
        params = r.get("params") or (p.to_dict() if p else {})
        shown = {k: v for k, v in params.items() if not param_is_off(k, v)}
        mean = f"{sum(taus) / len(taus):.3f}" if taus else "-"
        rid = r.get("request_id", steps[0].request_id if steps else str(req))
        lossy = lossy_note(steps)
        print(f"request {req} (id {rid}): {count(len(steps), 'step')}, mean tau {mean}, "
              + ", ".join(f"{k} {v}" for k, v in shown.items())
              + (f", finish {r['finish_reason']}" if r.get("finish_reason") else "")
              + (f", {lossy}" if lossy else ""))
        if prompt is not None:
            text = prompt if len(prompt) <= 70 else prompt[:67] + "..."
            print(f"  prompt: {json.dumps(text, ensure_ascii=False)}")
        generated = r.get("generated_token_ids")
        if isinstance(generated, list) and generated:
            print(f"  generated ({count(len(generated), 'token')}): {generated_text(run, generated)}")
        if steps:
            print("  steps (step:tau): " + " ".join(f"{s.step}:{t}" for s, t in zip(steps, taus)))
        for s in steps:
            if s.extra.get("verdict") not in (None, "agrees"):
                print(f"  step {s.step}: SGLang emitted {s.extra.get('sglang_emitted')}, the target-only rule on its "
                      f"inputs {s.emitted} (the views draw the lab's walk; `ddtree-lab diagnose` names it)")
    skipped = meta.get("skipped_rows") or []
    if skipped:
        print(f"{count(len(skipped), 'recorded row')} not converted (no lab step): "
              + "; ".join(f"call {x.get('call')} row {x.get('row')} ({x.get('request_id')}): {x.get('why')}"
                          for x in skipped[:3]) + ("; ..." if len(skipped) > 3 else ""))
    return EXIT_PROBLEM if run.problems else 0


def generated_text(run, ids: list, width: int = 100) -> str:
    """A request's generated tokens for ``info``: the recorded token texts joined with runs of
    byte tokens decoded together (:func:`ddtree_lab.texts.join_texts`; JSON-quoted,
    cut to ``width`` characters with "..."), or the ids themselves where the run records no text
    for some of them (the first 16, then "...")."""
    missing = [t for t in ids if not isinstance(t, int) or t not in run.token_texts]
    if missing:
        shown = ", ".join(str(t) for t in ids[:16]) + (", ..." if len(ids) > 16 else "")
        return f"ids [{shown}] (no text recorded for {count(len(missing), 'token')}: token ids shown)"
    from ..texts import join_texts

    text = join_texts(run.token_texts[t] for t in ids)  # byte tokens together: <0xCE><0x95> -> "Ε"
    return json.dumps(text if len(text) <= width else text[: width - 3] + "...", ensure_ascii=False)


def cmd_render(args) -> int:
    """Draw one step's tree as SVG, PNG, DOT or text, or its decision table as text or Markdown
    (format from --format or the -o suffix: .md is the Markdown decision table)."""
    from ..views import decisions_markdown, decisions_text, render_svg, step_view, to_dot, to_text

    fmt = args.format
    if args.out:
        check_out_file(args.out)
        check_new_output(args.out, args.force, inputs=inputs_of(args))
    if fmt is None:
        suffix = Path(args.out).suffix.lower() if args.out else ".txt"
        fmt = {".svg": "svg", ".png": "png", ".dot": "dot", ".gv": "dot", ".txt": "text", ".md": "decisions-md"}.get(suffix)
        if fmt is None:
            raise CLIError(f"{args.out}: unknown picture suffix {suffix!r} (use .svg, .png, .dot, .txt or .md, or "
                           "--format)")
    elif args.out:
        check_suffix(args.out, fmt, {"svg": (".svg",), "png": (".png",), "dot": (".dot", ".gv"),
                                      "text": (".txt",), "decisions": (".txt",), "decisions-md": (".md",)}[fmt])
    if fmt == "png" and not args.out:
        raise CLIError("--format png needs -o FILE")
    run = load_run(args.trace)
    if not run.steps:  # e.g. an engine summary of histograms: no step order, nothing to draw
        raise CLIError(f"{args.trace}: this {run.source} holds no per-step records (no tree, no step to draw); "
                       "`ddtree-lab info` summarises it")
    step = find_step(run, args.step, args.request, args.trace)
    view = step_view(step, run, args.collapse)
    if fmt == "svg":
        data: str | bytes = render_svg(to_dot(view))
    elif fmt == "png":
        if not args.out:
            raise CLIError("--format png needs -o FILE")
        import graphviz

        try:
            data = graphviz.Source(to_dot(view)).pipe(format="png")
        except graphviz.ExecutableNotFound as exc:
            raise CLIError("graphviz's dot is not installed (apt-get install graphviz)") from exc
    elif fmt == "dot":
        data = to_dot(view)
    elif fmt == "decisions":
        data = decisions_text(view)
    elif fmt == "decisions-md":
        data = decisions_markdown(view)
    else:
        data = to_text(view)
    if args.out:
        write_output(args.out, data)
        print(f"step {step.step}, request {step.request} -> {args.out}")
    else:
        sys.stdout.write(data if isinstance(data, str) else "")
    return 0


def cmd_bundle(args) -> int:
    """Write a minimal self-contained repro of one verify step into a directory."""
    bundle = bundle_module()
    out = Path(args.out)
    if not out.parent.exists():
        raise CLIError(f"{args.out}: parent directory {out.parent} does not exist")
    check_new_output(out, args.force, files=bundle.FILES, inputs=inputs_of(args))
    run = load_run(args.trace)
    step = find_step(run, args.step, args.request, args.trace)
    b = bundle.make_bundle(run, step)
    path = bundle.save_bundle(b, out)
    wrote(path)
    size = sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
    print(f"step {step.step}, request {step.request} -> {path} ({size / 1024:.1f} KB)")
    return 0


def _print_differences(where: str, diffs) -> None:
    for d in diffs:
        print(f"{where}: {d}")


#: what each source is, for hints that send a file to the verb that reads it
WHAT_IT_IS = {
    "lab trace": "a lab trace (written by `ddtree-lab sglang convert`, `save_trace` or `ddtree_lab.io.convert`)",
    "lab trace (append-only)": "a lab trace recorded by `ddtree-lab record` / `LiveSession(record_to=...)`",
    "bundle": "a bundle of one step (`ddtree-lab bundle`)",
    "ddtree reference": "tree traces of the DDTree reference code",
    "engine summary": "an engine's acceptance summary",
}


def _backend_hint(args, run, steps) -> str:
    """Why ``--backend`` (not the reference) cannot replay this trace, and the command that can."""
    where = f"--step {steps[0].step} --request {steps[0].request}" if len(steps) == 1 else "--step S --request R"
    what = WHAT_IT_IS.get(run.source, f"a {run.source}")
    if any(s.extra.get("source") == "sglang" for s in steps) or run.metadata.get("source") == "sglang recording":
        return (f"{args.trace}: converted from an SGLang recording: --backend {args.backend} needs the whole target "
                "rows, and its steps keep only what the verifier read; replay the recording itself, whose rows every "
                f"backend reads (ddtree-lab replay RECORDING --backend {args.backend}), or this file with backend "
                "'reference' (bit-exact)")
    return (f"{args.trace}: {what}: --backend {args.backend} needs the whole target rows, and its steps keep only "
            "what the verifier read (no lab recording keeps whole [n, V] rows); replay it with backend 'reference' "
            f"(bit-exact), or run {args.backend} on a step with the target recomputing its rows: ddtree-lab audit "
            f"{args.trace} {where} --model default --verifier {args.backend}")


def _replay_trace(args) -> int:
    from ..replaying import replay_differences

    run = load_run(args.trace)
    steps = select_steps(run, args.step, args.request, args.trace)
    if args.backend != "reference" and steps and all(s.rows is None or s.rows.cannot("full rows") for s in steps):
        raise CLIError(_backend_hint(args, run, steps))
    if not any(s.output is not None and s.buffers is not None and s.rows is not None for s in steps):
        lacking = sorted({m for s in steps for m in s.missing_stages()})
        what = ", ".join(lacking) if lacking else "steps"
        raise CLIError(f"{args.trace}: nothing to replay: this {run.source} records no {what} "
                       "(replay needs the buffers, the rows the verifier read and the coins)")
    differing, exact, tolerant = 0, 0, 0
    lossy = lossy_note(steps)
    if lossy:
        print(f"{lossy}: replayed under the recorded thresholds (the emitted law is not the target's)")
    pending = 0
    for s in steps:
        where = f"step {s.step}, request {s.request}"
        if s.output is None:  # an append-only recording's step whose verifier never returned
            pending += 1
            print(f"{where}: {s.extra.get('why') or 'did not finish'} (its verify inputs are on disk, no output to "
                  "compare)")
            continue
        try:
            _, diffs = replay_differences(s, run.vocab_size, args.backend)
        except ValueError as exc:  # nothing to replay, another backend, or inputs the verifier rejects
            if args.backend != "reference":
                raise CLIError(str(exc)) from exc
            differing += 1
            print(f"{where}: the verifier refuses the stored inputs: {exc}")
            continue
        if diffs:
            differing += 1
            _print_differences(where, diffs)
        elif s.backend.startswith("triton"):
            tolerant += 1
        else:
            exact += 1
    from ..diagnosis.common import engine_by_design
    from ..replaying import by_design_line

    for s in steps:  # a converted engine recording: the engine's own output against the lab's walk
        why = engine_by_design(s)
        if why:
            print(by_design_line(f"step {s.step}, request {s.request}", f"the engine's own output (SGLang's): {why}"))
    # steps the selection names that were left out as damaged when the file was read (no Step to replay)
    damaged = sum(1 for (st, q) in getattr(run, "left_out", {})
                  if (args.step is None or st == args.step) and (args.request is None or q == args.request))
    stopped = set(getattr(run, "stop_problems", ()))
    notes = [p for p in run.problems if p not in stopped]  # damage, named below
    from ..io.append_trace import AppendRun

    partial = run.partial_line() if isinstance(run, AppendRun) else ""
    total = len(steps) + damaged
    if exact == total and not notes and not partial:
        print(f"{count(total, 'step')} replayed bit for bit (reference verifier)")
        return 0
    same = exact + tolerant
    parts = [f"{same} the same" + (f" ({exact} bit for bit, {tolerant} within the Triton kernel tolerance: recorded "
                                   "by the Triton backend)" if tolerant else " (bit for bit)" if same else ""),
             f"{differing} differ"]
    why = ([f"{pending} did not finish"] if pending else []) + ([f"{damaged} damaged"] if damaged else [])
    parts.append(f"{pending + damaged} not replayable" + (f" ({', '.join(why)})" if why else ""))
    print(f"{count(total, 'step')} with the reference verifier: " + ", ".join(parts))
    if partial:
        print(partial)
    for problem in notes:
        print(f"  problem: {problem}")
    return EXIT_PROBLEM if differing or damaged or pending or notes else 0


def _replay_recording(path: str, backend: str, args=None) -> int:
    sg = sglang_module()
    from ..io import source_of

    try:
        source = source_of(path)
    except (OSError, ValueError):
        source = None  # load_recording names the problem
    if source is not None and not source.startswith("sglang recording"):
        raise CLIError(f"{path}: {WHAT_IT_IS.get(source, f'a {source}')}, not an SGLang recording (made inside a "
                       f"running SGLang server, docs/SGLANG.md); replay it with: ddtree-lab replay {path}")
    rec = sg.load_recording(path)
    step = recording_step(rec, args, path) if args is not None else None
    if step is None:
        results = sg.replay_recording(rec, backend)
    else:
        from ..sglang.replay import replay_step

        results = [replay_step(rec.steps[step], r, backend, step) for r in range(len(rec.steps[step]["rows"]))]
    for line in sg.replay_report(results):
        print(line)
    for call in rec.metadata.get("did_not_return") or []:  # an append-only recording's hung calls
        print(f"call {call}: did not return (its inputs are on disk: ddtree_lab.sglang.pending.replay_pending)")
    counts = sg.count_verdicts(results)
    return EXIT_PROBLEM if counts.get("differs", 0) - counts.get("by design", 0) > 0 else 0


def cmd_replay(args) -> int:
    """Re-verify recorded steps; print each difference from the recorded output."""
    if kind_of(args.trace) == "recording":  # every backend reads a recording's own rows
        return _replay_recording(args.trace, args.backend, args)
    return _replay_trace(args)


def cmd_sglang(args) -> int:
    """SGLang interop: the hook directory, replaying and converting recordings."""
    sg = sglang_module()
    if args.sglang_cmd == "hook-dir":
        print(sg.hook_dir())
        return 0
    if args.sglang_cmd == "replay":
        return _replay_recording(args.recording, args.backend)
    if args.sglang_cmd == "convert":
        out = Path(args.out)
        check_out_file(args.out)
        check_new_output(args.out, args.force, inputs=inputs_of(args))
        from ..io import convert

        path = convert(args.recording, out)
        wrote(path)
        print(f"{args.recording} -> {path}")
        return 0
    raise CLIError(f"unknown sglang command {args.sglang_cmd!r}")
