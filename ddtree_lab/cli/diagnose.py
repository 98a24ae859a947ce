"""Verb diagnose: every check a run's contents allow, one line per finding (the bug named, with its evidence)."""

from __future__ import annotations

from pathlib import Path

from .common import EXIT_PROBLEM, CLIError, load_run, progress, state_temperature_option


def cmd_diagnose(args) -> int:
    """Name the bug, not the symptom: each finding gives the bug kind in plain words, where
    (step, request, node), the numbers, how sure, and the next command. Without --model only the
    recorded data is used (the verifier that ran, coins, sampling transform, greedy verdicts,
    drafter hit rate); with --model default (or DIR) the tree forward and KV commit (first
    divergent step by bisection), the drafter's input and plain greedy decoding are checked too.
    A check that could not run says so and never counts as passing. The verifier's rule is
    named by rule inference (rule families fitted to the decisions), confirmed by the catalogue
    of known rules; --no-catalogue leaves inference alone. A run that does not record its
    sampling parameters (DDTree reference traces) is greedy or sampled as its file says
    (``args.temperature``, a request's ``temperature``) or as ``--temperature T`` states.

    Exit status: 1 on a finding or a damaged part of the file, 0 when every check that ran
    found nothing, 2 on bad input."""
    from ..diagnosis import diagnose

    if args.model is not None and args.model != "default" and not Path(args.model).is_dir():
        raise CLIError(f"--model {args.model}: not 'default' and not a model directory")
    run = load_run(args.run)
    state_temperature_option(run, args, args.run)  # before a model loads
    if not run.steps and run.source == "engine summary":
        raise CLIError(f"{args.run}: an engine's acceptance summary: it records no steps to diagnose; "
                       f"`ddtree-lab info {args.run}` shows its acceptance figures")
    if not run.steps:
        raise CLIError(f"{args.run}: no readable steps" + (f" ({run.problems[0]})" if run.problems else ""))
    from ..diagnosis import MODEL_CHECKS, RECORD_CHECKS

    total = len(RECORD_CHECKS) + (1 + len(MODEL_CHECKS) if args.model is not None else 0)
    with progress(total, "diagnose", unit="check", quiet=args.model is None) as bar:  # seconds without a model
        ran: list[str] = []

        def tick(name: str) -> None:
            if ran:
                bar.update()
            ran.append(name)
            bar.set_postfix_str(name)

        try:
            result = diagnose(run, model=args.model, step=args.step, request=args.request,
                              catalogue=not args.no_catalogue, progress=tick)
        except KeyError as exc:
            raise CLIError(f"{args.run}: {exc.args[0] if exc.args else exc}") from exc
        bar.update()
    print(result.text().replace(" RUN ", f" {args.run} "))
    if not any(r.ran for r in result.results):
        raise CLIError(f"{args.run}: no check could run on this run")
    if run.problems:
        print(f"{len(run.problems)} damaged or unreadable part(s) of {args.run} left out (listed above as "
              "'unreadable'): not diagnosed")
    return EXIT_PROBLEM if result.findings or run.problems else 0
