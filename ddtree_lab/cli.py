"""Command line: inspect, replay and render trace files.

    ddtree-lab info   TRACE                 # run metadata and a per-request summary
    ddtree-lab replay TRACE                 # re-verify every step, bit for bit
    ddtree-lab render TRACE --step K [--out step.svg | --format dot|text|decisions]
"""

from __future__ import annotations

import argparse
import json
import sys

from . import lab
from .trace import ReplayMismatch, TraceFormatError, load_trace, replay
from .views import decisions_text, step_svg, step_view, to_dot, to_text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ddtree-lab", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    p_info = sub.add_parser("info", help="metadata and summary of a trace file")
    p_info.add_argument("trace")
    p_replay = sub.add_parser("replay", help="re-run the reference verifier on every stored step")
    p_replay.add_argument("trace")
    p_render = sub.add_parser("render", help="draw one step's tree")
    p_render.add_argument("trace")
    p_render.add_argument("--step", type=int, required=True,
                          help="record index (0-based; one record per request per step, in the order `info` counts)")
    p_render.add_argument("--format", choices=["svg", "dot", "text", "decisions"], default="svg")
    p_render.add_argument("--out", help="output file (default: standard output)")
    p_render.add_argument("--collapse", action="store_true", help="draw each parent's unvisited children as one node")
    args = ap.parse_args(argv)
    try:
        run = load_trace(args.trace)
    except (TraceFormatError, FileNotFoundError) as exc:
        print(f"ddtree-lab: {exc}", file=sys.stderr)
        return 2
    if args.command == "info":
        meta = {k: v for k, v in run.metadata.items() if k != "requests"}
        print(json.dumps(meta, indent=1, default=str))
        for row in lab.summary(run):
            print(row)
        return 0
    if args.command == "replay":
        for k, step in enumerate(run.steps):
            try:
                replay(step)
            except ReplayMismatch as exc:
                print(f"ddtree-lab: record {k}: replay differs: {exc}", file=sys.stderr)
                return 1
            except ValueError as exc:  # stored inputs the verifier rejects (e.g. a coin outside [0, 1))
                print(f"ddtree-lab: record {k} (step {step.step}, request {step.request}): {exc}", file=sys.stderr)
                return 1
        print(f"{len(run.steps)} steps replayed bit for bit")
        return 0
    if not 0 <= args.step < len(run.steps):
        print(f"ddtree-lab: --step {args.step} out of range: the trace has {len(run.steps)} steps", file=sys.stderr)
        return 2
    step = run.steps[args.step]
    if args.format == "svg":
        text = step_svg(step, run, args.collapse)
    elif args.format == "dot":
        text = to_dot(step_view(step, run, args.collapse))
    elif args.format == "decisions":
        text = decisions_text(step_view(step, run))
    else:
        text = to_text(step_view(step, run, args.collapse))
    if args.out:
        try:
            with open(args.out, "w", encoding="utf-8") as f:
                f.write(text)
        except OSError as exc:
            print(f"ddtree-lab: cannot write {args.out}: {exc}", file=sys.stderr)
            return 2
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
