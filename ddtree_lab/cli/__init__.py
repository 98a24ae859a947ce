"""ddtree-lab: record, inspect, draw, replay, audit and check DDTree verify steps.

    ddtree-lab record  --prompt TEXT [--prompt ...] | --prompts FILE.jsonl  -o run.ddtrace
    ddtree-lab info    TRACE                              # requests, prompts, tau, steps
    ddtree-lab render  TRACE --step S [--request R] -o tree.svg|png|dot|txt
    ddtree-lab bundle  TRACE --step S --request R -o DIR  # a self-contained repro of one step
    ddtree-lab report  RUN --step S --request R [-o FILE.md] [--archive FILE.tar.gz|.zip]  # a bug report
    ddtree-lab replay  TRACE|BUNDLE|RECORDING [--backend reference|torch-lazy|triton]
    ddtree-lab audit   TRACE --step S [--request R] [--model default] | BUNDLE | --random N
    ddtree-lab doctor  TRACE|BUNDLE|RECORDING [--model default --step S --request R]
    ddtree-lab diagnose RUN [--model default|DIR] [--no-catalogue] [--step S --request R]   # the bug named
    ddtree-lab sglang  hook-dir | replay RECORDING | convert RECORDING -o TRACE
    ddtree-lab export  RUN --parquet DIR                  # per-step and per-node tables for DuckDB
    ddtree-lab compare-policies RUN [--model default] [--policy NAME ...] [--budgets 4,8,16,32,64] [--parquet OUT.parquet]
    ddtree-lab lab                                        # JupyterLab on labs/

Steps are addressed as decoding steps (``--step``, 0-based, as ``info`` lists them) of a
request (``--request``; optional when only one request has that step). Errors print one line
naming the file, step and field, and exit with status 2 (1: a check found a difference or a
problem).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .checks import cmd_audit, cmd_doctor
from .diagnose import cmd_diagnose
from .common import EXIT_ERROR, CLIError, quiet_libraries
from .live import cmd_lab, cmd_record
from .steps import cmd_bundle, cmd_info, cmd_render, cmd_replay, cmd_sglang
from ..step import LEVELS


# -- loading --------------------------------------------------------------------------------


# -- verbs ----------------------------------------------------------------------------------


# -- parser ---------------------------------------------------------------------------------


def _step_args(p, required: bool = False) -> None:
    p.add_argument("--step", type=int, required=required,
                   help="decoding step (0-based, as `info` lists them)")
    p.add_argument("--request", type=int, help="request index (needed when several requests have the step)")


def _stated_temperature_arg(p) -> None:
    p.add_argument("--temperature", type=float, default=None, metavar="T",
                   help="the temperature of a run that does not record it (DDTree reference traces): 0 = greedy, "
                        "> 0 = sampled; refused where the file records one that differs")


def _sampling_args(p, defaults: bool) -> None:
    p.add_argument("--temperature", type=float, default=0.0 if defaults else None, help="0 means greedy")
    p.add_argument("--top-k", type=int, default=0 if defaults else None, help="<= 0 means off")
    p.add_argument("--top-p", type=float, default=1.0 if defaults else None, help="1.0 means off")
    p.add_argument("--min-p", type=float, default=None, help="off when not given")


def _output(p, *flags: str, **kw):
    """An option naming what the verb writes (``action.writes = True``); the verb gets one
    ``--force``, and without it an existing output is refused (:func:`.common.check_new_output`).
    tests/test_cli_outputs.py walks the parser: every option that writes is made here."""
    action = p.add_argument(*flags, **kw)
    action.writes = True
    if not any("--force" in a.option_strings for a in p._actions):
        p.add_argument("--force", action="store_true",
                       help="replace an existing output (without it nothing that exists is replaced)")
    return action


def _input(p, *flags, **kw):
    """An argument naming something the verb reads (a source, ``--prompts``, ``--model`` ...):
    recorded in the verb's ``args._reads`` so that no output may be written onto it
    (:func:`.common.inputs_of`, :func:`.common.check_new_output`)."""
    action = p.add_argument(*flags, **kw)
    label = action.option_strings[0] if action.option_strings else (action.metavar or action.dest.upper())
    p.set_defaults(_reads=(p.get_default("_reads") or ()) + ((label, action.dest),))
    return action


class _Help(argparse.RawDescriptionHelpFormatter):
    """Help text as written, each option's default appended (except None / off flags)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (action.option_strings and action.default is not None and action.default is not False
                and action.default != argparse.SUPPRESS and "%(default)" not in text):
            text += " (default: %(default)s)"
        return text


class _SubParser(argparse.ArgumentParser):
    """A verb's parser: help formatted by :class:`_Help`."""

    def __init__(self, **kw):
        super().__init__(formatter_class=_Help, **kw)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ddtree-lab", description=__doc__, formatter_class=_Help)
    sub = ap.add_subparsers(dest="command", required=True, metavar="VERB", parser_class=_SubParser)

    p = sub.add_parser("record", help="run a live session and write a trace", description=cmd_record.__doc__)
    p.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    _input(p, "--prompts", help="JSONL file: one object per line with 'prompt' and optional 'id', "
                                     "'temperature', 'top_k', 'top_p', 'min_p', 'seed', "
                                     "'banned_token_ids'")
    _input(p, "--target", help="local Hugging Face model directory (default: the embedded SmolLM2-135M)")
    _input(p, "--drafter", help="'dflash', 'ridge', a DFlash checkpoint directory or a ridge safetensors file "
                                     "(default: the lab's default drafter for the embedded target)")
    _sampling_args(p, defaults=True)
    p.add_argument("--ban", type=int, action="append", metavar="TOKEN_ID",
                   help="a token id every request bans (logit -inf before every transform, as an engine's "
                        "bad-words / logit-bias processors); repeat for more")
    p.add_argument("--seed", type=int, default=0, help="coin seed (request b: seed * 1000 + b unless its own)")
    p.add_argument("--budget", type=int, default=32, help="draft nodes per tree (B)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate per request")
    p.add_argument("--level", choices=list(LEVELS), default="full", help="recording level")
    p.add_argument("--backend", choices=["reference", "torch-lazy", "triton", "auto"], help="verify backend")
    p.add_argument("--threshold-single", type=float, default=1.0,
                   help="SGLang's threshold_single (1: exact; below 1 the run is recorded as lossy)")
    p.add_argument("--threshold-acc", type=float, default=1.0,
                   help="SGLang's threshold_acc (1: exact; any other value is recorded as lossy)")
    p.add_argument("--threads", type=int, help="torch threads (default: ddtree_lab.threads picks them for this machine)")
    p.add_argument("--no-chat", action="store_true", help="do not wrap prompts in the chat template")
    p.add_argument("--quiet", action="store_true", help="no progress bars (record's and the model loader's)")
    _output(p, "-o", "--out", required=True,
            help="trace file to write: the lab's append-only segment file, named NAME.ddtrace")
    p.set_defaults(func=cmd_record)

    p = sub.add_parser("info", help="requests, prompts, tau and steps of a trace", description=cmd_info.__doc__)
    p.add_argument("trace")
    _stated_temperature_arg(p)
    p.set_defaults(func=cmd_info)

    from .export import cmd_export

    p = sub.add_parser("export", help="per-step and per-node Parquet tables of a run", description=cmd_export.__doc__)
    _input(p, "trace", metavar="RUN")
    _output(p, "--parquet", required=True, metavar="DIR", help="directory for steps.parquet and nodes.parquet")
    p.set_defaults(func=cmd_export)

    from .policies import DEFAULT_BUDGETS, cmd_compare_policies

    p = sub.add_parser("compare-policies", help="exact E[tau] of tree policies on a recorded run",
                       description=cmd_compare_policies.__doc__)
    _input(p, "run", metavar="RUN")
    _input(p, "--model", help="'default' or a model directory: score the nodes the recording lacks")
    p.add_argument("--policy", action="append", help="a policy name (repeat; default: all)")
    p.add_argument("--budgets", default=DEFAULT_BUDGETS, help="comma-separated draft-node budgets")
    p.add_argument("--max-steps", type=int, help="only the first N steps")
    _output(p, "--parquet", metavar="OUT.parquet",
            help="also write one row per (run, step, policy, budget) to this new file")
    p.set_defaults(func=cmd_compare_policies)

    p = sub.add_parser("render", help="draw one step's tree", description=cmd_render.__doc__)
    _input(p, "trace", help="any source (trace, bundle, recording, ...); a bundle needs no --step")
    _step_args(p)
    _output(p, "-o", "--out", help="output file; .svg .png .dot .txt .md (default: text on standard output)")
    p.add_argument("--format", choices=["svg", "png", "dot", "text", "decisions", "decisions-md"],
                   help="overrides the suffix; decisions: the decision table as text, decisions-md: as a Markdown "
                        "table (.md)")
    p.add_argument("--collapse", action="store_true", help="draw each parent's unvisited children as one node")
    p.set_defaults(func=cmd_render)

    from .report import cmd_report

    p = sub.add_parser("report", help="one step as a Markdown bug report (tree, decisions, diagnosis, environment)",
                       description=cmd_report.__doc__)
    _input(p, "trace", metavar="RUN", help="any source (trace, bundle, recording, ...)")
    _step_args(p)
    _output(p, "-o", "--out", help="Markdown file to write (FILE.md; the tree's FILE-tree.png and FILE-tree.svg beside "
                                   "it); default: the Markdown on standard output")
    _output(p, "--archive", metavar="FILE", help="also write everything (Markdown, pictures, a bundle of the step) into "
                                                 "one FILE.tar.gz or FILE.zip")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("bundle", help="a self-contained repro of one verify step", description=cmd_bundle.__doc__)
    _input(p, "trace")
    _step_args(p, required=True)
    _output(p, "-o", "--out", required=True, help="directory to write")
    p.set_defaults(func=cmd_bundle)

    p = sub.add_parser("replay", help="re-verify and print every difference", description=cmd_replay.__doc__)
    p.add_argument("trace", metavar="TRACE|BUNDLE|RECORDING")
    p.add_argument("--backend", choices=["reference", "torch-lazy", "triton"], default="reference",
                   help="verify backend that re-runs the steps")
    _step_args(p)
    p.set_defaults(func=cmd_replay)

    p = sub.add_parser("audit", help="losslessness audit of a verifier on a step", description=cmd_audit.__doc__)
    _input(p, "source", nargs="?", metavar="TRACE|BUNDLE")
    _step_args(p)
    p.add_argument("--random", type=int, metavar="N", help="audit N random small cases instead")
    p.add_argument("--nodes", type=int, default=6, help="nodes of a random case")
    p.add_argument("--vocab", type=int, default=8, help="vocabulary of a random case")
    _input(p, "--model", help="'default' or a model directory: recompute the step's full target logits")
    from ..audit import PLANTED_FAULTS

    p.add_argument("--verifier", default="reference",
                   help="reference, torch-lazy, triton, or a planted fault: " + ", ".join(PLANTED_FAULTS))
    from ..engines import DRAFT_MODES, ENGINE_FAULTS, ENGINES
    from ..engines import vllm_rules
    from ..engines.sglang_rules import RULE_FAULTS, RULES

    p.add_argument("--engine", choices=ENGINES + ("list", "sglang:chain", "vllm:rejection-sampler")
                   + tuple(f"sglang:{r}" for r in RULES) + tuple(f"vllm:{r}" for r in vllm_rules.RULES),
                   help="audit the engine's own verifier (vllm / vllm:rejection-sampler: its RejectionSampler in the "
                   "vLLM venv, scripts/setup_vllm.sh; sglang / sglang:chain: its kernels, --random cases are then "
                   "chains; sglang:RULE / vllm:RULE: the rule end to end, its own draft sampling included, docs/ENGINES.md; "
                   "vllm:RULE runs vLLM's new model runner in the vLLM venv); "
                   "list: the inventory of both engines with each rule's last verdict")
    p.add_argument("--format", choices=["text", "markdown"], default="text",
                   help="with --engine list: one block per entry point wrapped to the terminal (text), or the "
                   "Markdown table of docs/ENGINES.md")
    p.add_argument("--draft", choices=DRAFT_MODES, default="target-only",
                   help="with --engine: no draft probabilities (target-only rule) or real ones from a noisy drafter")
    p.add_argument("--engine-fault", choices=sorted(set(ENGINE_FAULTS) | set(RULE_FAULTS) | set(vllm_rules.RULE_FAULTS)),
                   help="with --engine: plant this fault in the adapter (sglang:RULE / vllm:RULE: one of that rule's "
                   "faults)")
    p.add_argument("--draws", type=int, default=None,
                   help="coin sets drawn (default 4000; sglang:RULE: per request, 400 for the DFlash 2 rules whose "
                   "kernel runs in Triton's interpreter, 3000 for the others; vllm:RULE: per request, 400)")
    p.add_argument("--seed", type=int, default=0, help="coin seed")
    p.add_argument("--alpha", type=float, default=1e-3, help="significance level")
    p.add_argument("--threshold-single", type=float, default=1.0, help="SGLang's threshold_single (1: exact)")
    p.add_argument("--threshold-acc", type=float, default=1.0, help="SGLang's threshold_acc (1: exact)")
    _sampling_args(p, defaults=False)
    p.add_argument("--no-validate", action="store_true",
                   help="let the built-in backends walk buffers they would refuse (to measure their law)")
    p.add_argument("--top", type=int, default=5, help="outcomes listed as most over / under represented")
    _output(p, "--plot", help="write the plotly figure to this .html file")
    p.add_argument("--threads", type=int)
    p.set_defaults(func=cmd_audit)

    p = sub.add_parser("doctor", help="check buffers (and, with --model, tree logits)", description=cmd_doctor.__doc__)
    p.add_argument("source", metavar="TRACE|BUNDLE|RECORDING")
    _step_args(p)
    p.add_argument("--model", help="'default' or a model directory: compare recorded rows with causal forwards")
    p.add_argument("--sample", type=int, default=8, help="nodes compared with causal forwards")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampled nodes")
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("diagnose", help="name the bug a run shows (one line per finding)",
                       description=cmd_diagnose.__doc__)
    p.add_argument("run", metavar="RUN", help="a trace, bundle or converted recording (ddtree_lab.io.load)")
    p.add_argument("--model", help="'default' or a model directory: also re-run the target and drafter")
    p.add_argument("--no-catalogue", action="store_true",
                   help="name the verifier's rule by rule inference alone (no re-walk of the known rules)")
    _step_args(p)
    _stated_temperature_arg(p)
    p.set_defaults(func=cmd_diagnose)

    p = sub.add_parser("sglang", help="SGLang recordings: hook-dir, replay, convert", description=cmd_sglang.__doc__)
    ss = p.add_subparsers(dest="sglang_cmd", required=True, metavar="COMMAND")
    ss.add_parser("hook-dir", help="print the directory to prepend to PYTHONPATH for the recording hook")
    q = ss.add_parser("replay", help="replay a recording with the lab's verifiers")
    q.add_argument("recording")
    q.add_argument("--backend", choices=["reference", "torch-lazy", "triton"], default="reference",
                   help="verify backend that re-runs the rows")
    q = ss.add_parser("convert", help="convert a recording into a lab trace")
    _input(q, "recording")
    _output(q, "-o", "--out", required=True, help="lab trace file to write (NAME.ddtrace.safetensors)")
    p.set_defaults(func=cmd_sglang)

    from .vllm import add_vllm_parser

    add_vllm_parser(sub, _output, _input)

    p = sub.add_parser("lab", help="open JupyterLab on working copies of labs/ (as `make lab`)",
                       description=cmd_lab.__doc__)
    p.add_argument("--port", type=int, default=int(os.environ.get("DDTREE_LAB_PORT", "8888")),
                   help="first port to try (DDTREE_LAB_PORT); the next free one is used if it is taken")
    p.add_argument("--dry-run", action="store_true", help="print the command instead of running it")
    p.set_defaults(func=cmd_lab)
    return ap


def _one_line(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return " ".join(text.split())


#: exit status of a verb stopped by Ctrl-C (128 + SIGINT, as a shell reports it)
EXIT_INTERRUPTED = 130


def _outputs(ap: argparse.ArgumentParser, args) -> list[tuple[str, str]]:
    """``(flag, path)`` of every output the verb's command line names (the options made with
    :func:`_output`), nested sub-verbs (``sglang convert``) included."""
    out: list[tuple[str, str]] = []
    parser: argparse.ArgumentParser | None = ap
    while parser is not None:
        nxt = None
        for a in parser._actions:
            if isinstance(a, argparse._SubParsersAction):
                nxt = a.choices.get(getattr(args, a.dest, None) or "")
            elif getattr(a, "writes", False) and getattr(args, a.dest, None):
                out.append((a.option_strings[0] if a.option_strings else a.dest, str(getattr(args, a.dest))))
        parser = nxt
    return out


def interrupted_line(command: str, outputs: list[tuple[str, str]], existed: dict[str, bool],
                     written: list[str]) -> str:
    """The one line a verb stopped by Ctrl-C prints: ``ddtree-lab VERB: interrupted``, and for a
    verb that writes, what it wrote whole (``written``) and which outputs it did not write
    (``outputs``, ``(flag, path)``; ``existed``: whether each path was there before the verb ran,
    left as it was then, or not created)."""
    line = f"ddtree-lab {command}: interrupted"
    if not outputs and not written:
        return line
    done = {str(Path(w)) for w in written}
    missing = [(flag, path) for flag, path in outputs if str(Path(path)) not in done
               and not any(Path(w).parent == Path(path) for w in written)]  # a directory output: its files
    parts = [f"written whole: {', '.join(written)}"] if written else []
    if missing:
        what = ", ".join(f"{flag} {path} ({'left as it was' if existed.get(path) else 'not created'})"
                         for flag, path in missing)
        parts.append(f"{'nothing written' if not written else 'not written'}: {what}")
    return line + "; " + "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    """Run the verb the command line names; returns the exit status (0, 1 a check found a
    problem, 2 an error, 130 interrupted by Ctrl-C: one line on standard error, no traceback)."""
    from .common import WRITTEN

    try:
        ap = build_parser()
        args = ap.parse_args(argv)
    except KeyboardInterrupt:
        print("ddtree-lab: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    outputs = _outputs(ap, args)
    existed = {path: Path(path).exists() for _, path in outputs}
    WRITTEN.clear()
    from ..threads import configure_threads

    try:
        configure_threads()  # DDTREE_LAB_THREADS=N overrides; record / audit --threads N too
        quiet_libraries()  # no progress bars in a log (standard error not a terminal)
        return args.func(args)
    except KeyboardInterrupt:  # Ctrl-C: one line saying what was (not) written; every output is whole or absent
        print(interrupted_line(args.command, outputs, existed, list(WRITTEN)), file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # e.g. `ddtree-lab info TRACE | head`
        sys.stdout = open(os.devnull, "w")
        return 0
    except CLIError as exc:
        print(f"ddtree-lab {args.command}: {_one_line(exc)}", file=sys.stderr)
    except (ValueError, TypeError, KeyError, OSError, RuntimeError, AssertionError) as exc:
        print(f"ddtree-lab {args.command}: {_one_line(exc)}", file=sys.stderr)
    return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
