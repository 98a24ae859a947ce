"""ddtree-lab: record, inspect, draw, replay, audit and check DDTree verify steps.

    ddtree-lab record  --prompt TEXT [--prompt ...] | --prompts FILE.jsonl  -o run.ddtrace.safetensors
    ddtree-lab info    TRACE                              # requests, prompts, tau, steps
    ddtree-lab render  TRACE --step S [--request R] -o tree.svg|png|dot|txt
    ddtree-lab bundle  TRACE --step S --request R -o DIR  # a self-contained repro of one step
    ddtree-lab replay  TRACE|BUNDLE|RECORDING [--backend reference|torch-lazy|triton]
    ddtree-lab audit   TRACE --step S [--request R] [--model default] | BUNDLE | --random N
    ddtree-lab doctor  TRACE|BUNDLE|RECORDING [--model default --step S --request R]
    ddtree-lab sglang  hook-dir | replay RECORDING | convert RECORDING -o TRACE
    ddtree-lab lab                                        # JupyterLab on labs/

Steps are addressed as decoding steps (``--step``, 0-based, as ``info`` lists them) of a
request (``--request``; optional when only one request has that step). Errors print one line
naming the file, step and field, and exit with status 2 (1: a check found a difference or a
problem).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

EXIT_PROBLEM = 1
EXIT_ERROR = 2
MIN_DRAWS = 100  # fewer coin sets than this cannot reject at the usual alpha


class CLIError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


# -- loading --------------------------------------------------------------------------------


def _load_trace(path: str):
    from .trace import load_trace

    p = Path(path)
    if p.is_dir():
        raise CLIError(f"{path}: is a directory, not a trace file")
    if _kind_of(path) == "recording":
        raise CLIError(f"{path}: is an SGLang recording, not a lab trace: convert it first with "
                       f"`ddtree-lab sglang convert {path} -o TRACE.ddtrace.safetensors`")
    return load_trace(path)


def _check_bundle_dir(path: str) -> None:
    """A directory given as a bundle must hold bundle.safetensors."""
    if not (Path(path) / "bundle.safetensors").is_file():
        raise CLIError(f"{path}: is not a bundle (no bundle.safetensors in it)")


def _check_out_file(path: str) -> None:
    """An output file path: not a directory, and its directory exists (checked before any work)."""
    p = Path(path)
    if p.is_dir():
        raise CLIError(f"{path}: is a directory (give a file name)")
    if not p.parent.is_dir():
        raise CLIError(f"{path}: directory {p.parent} does not exist")


def _check_suffix(path: str, fmt: str, suffixes: tuple[str, ...]) -> None:
    if Path(path).suffix.lower() not in suffixes:
        raise CLIError(f"{path}: suffix {Path(path).suffix or '(none)'!r} does not match the format {fmt} "
                       f"(use {' or '.join(suffixes)})")


def _select_steps(run, step: int | None, request: int | None, path: str) -> list:
    """The StepTraces matching --step / --request (all when neither is given).

    Raises:
        CLIError: the selection matches nothing (naming the requests / steps that exist).
    """
    steps = run.steps
    if request is not None:
        reqs = sorted({s.request for s in run.steps})
        steps = [s for s in steps if s.request == request]
        if not steps:
            raise CLIError(f"{path}: --request {request} does not exist (requests: {', '.join(map(str, reqs))})")
    if step is not None:
        have = sorted({s.step for s in steps})
        steps = [s for s in steps if s.step == step]
        if not steps:
            who = f"request {request}" if request is not None else "the trace"
            span = f"steps {have[0]}..{have[-1]}" if have else "no steps"
            raise CLIError(f"{path}: --step {step} is out of range for {who} ({span})")
    return steps


def _check_bundle_selection(b, args, path: str) -> None:
    """--step / --request on a bundle must name the bundle's own step (or be left out)."""
    step = getattr(args, "step", None)
    request = getattr(args, "request", None)
    if step is not None and step != b.step.step:
        raise CLIError(f"{path}: the bundle holds step {b.step.step} (request {b.step.request}), not --step {step}")
    if request is not None and request != b.step.request:
        raise CLIError(f"{path}: the bundle holds request {b.step.request} (step {b.step.step}), "
                       f"not --request {request}")


def _recording_step(rec, args, path: str) -> int | None:
    """The verify-call index chosen by --step on a recording (None: all)."""
    if getattr(args, "request", None) is not None:
        raise CLIError(f"{path}: a recording addresses verify calls by --step, not --request "
                       "(convert it with `ddtree-lab sglang convert` to address requests)")
    step = getattr(args, "step", None)
    if step is not None and not 0 <= step < len(rec.steps):
        raise CLIError(f"{path}: --step {step} does not exist (the recording has steps 0..{len(rec.steps) - 1})")
    return step


def _kind_of(path: str) -> str:
    """``"trace"``, ``"bundle"`` (a directory) or ``"recording"`` (an SGLang recording)."""
    p = Path(path)
    if p.is_dir():
        return "bundle"
    if p.suffix == ".json" or (not p.exists() and Path(str(p) + ".json").exists()):
        return "recording"
    if p.exists():
        try:
            from safetensors import safe_open

            with safe_open(str(p), framework="pt") as f:
                meta = f.metadata() or {}
            beside = p.with_suffix(".json")
        except Exception:  # not safetensors: load_trace names the problem
            return "trace"
        if "ddtree_lab" not in meta and beside.exists():
            from .sglang.recording import FORMAT

            try:
                doc = json.loads(beside.read_text())
            except ValueError:
                doc = None
            if isinstance(doc, dict) and doc.get("format") == FORMAT:
                return "recording"
            raise CLIError(f"{path}: safetensors without ddtree_lab metadata and {beside.name} is not an SGLang "
                           "recording: not a trace, bundle or recording (drafter weights?)")
        return "trace"
    raise CLIError(f"{path}: no such file")


def _bundle_module():
    try:
        from . import bundle
    except ImportError as exc:
        raise CLIError(f"bundles need ddtree_lab.bundle, which this install lacks ({exc})") from exc
    return bundle


def _sglang():
    """The SGLang interop package (imports sglang itself only to run its kernels)."""
    from . import sglang as sg

    return sg


def _find_step(run, step: int | None, request: int | None, path: str):
    """The StepTrace of decoding step ``step`` of ``request``."""
    if step is None:
        raise CLIError(f"{path}: --step is required")
    matches = _select_steps(run, step, request, path)
    if len(matches) > 1:
        reqs = ", ".join(str(s.request) for s in matches)
        raise CLIError(f"{path}: step {step} exists for requests {reqs}: pass --request")
    return matches[0]


def _write(path: str, data: str | bytes) -> None:
    p = Path(path)
    if not p.parent.exists():
        raise CLIError(f"{path}: directory {p.parent} does not exist")
    try:
        if isinstance(data, bytes):
            p.write_bytes(data)
        else:
            p.write_text(data, encoding="utf-8")
    except OSError as exc:
        raise CLIError(f"cannot write {path}: {exc.strerror or exc}") from exc


def _threads(n: int | None) -> str:
    import torch

    if n is not None:
        torch.set_num_threads(n)
        return f"{n} (--threads)"
    from .threads import configure_threads  # picks from cores, quota and load

    choice = configure_threads()
    return f"{torch.get_num_threads()} ({choice.reason})"


# -- verbs ----------------------------------------------------------------------------------


def _lossy_note(steps) -> str:
    """``"LOSSY: threshold_acc=0.5 (3 of 8 steps)"`` for the lossy steps among ``steps``, or ``""``."""
    from .views.model import lossy_mark

    lossy = [s for s in steps if s.lossy]
    if not lossy:
        return ""
    marks = "; ".join(sorted({lossy_mark(s.thresholds) for s in lossy}))
    return f"{marks} ({len(lossy)} of {_count(len(steps), 'step')})"


def cmd_info(args) -> int:
    """Requests with prompts, parameters and mean tau; then each request's steps."""
    run = _load_trace(args.trace)
    meta = run.metadata
    target = meta.get("target", {})
    drafter = meta.get("drafter", {})
    tname = target.get("name", "?") if isinstance(target, dict) else str(target)
    dname = drafter.get("name", "?") if isinstance(drafter, dict) else str(drafter)
    print(f"trace {args.trace}: {_count(len(run.steps), 'record')}")
    print(f"target: {tname}" + (f" ({target.get('dtype')}, {target.get('device')})" if isinstance(target, dict)
                                  and target.get("dtype") else ""))
    print(f"drafter: {dname}" + (f", block size {drafter.get('block_size')}" if isinstance(drafter, dict)
                                   and drafter.get("block_size") else ""))
    extras = {k: meta[k] for k in ("budget", "max_depth", "verifier", "source") if k in meta}
    if extras:
        print("run: " + ", ".join(f"{k} {v}" for k, v in extras.items()))
    requests = {int(r["request"]): r for r in meta.get("requests", [])}
    for req in sorted({s.request for s in run.steps} | set(requests)):
        steps = run.for_request(req)
        taus = [s.accept_length + (0 if bool(s.output.support_exhausted[0]) else 1) for s in steps]
        r = requests.get(req, {})
        prompt = r.get("prompt")
        p = steps[0].params if steps else None
        params = r.get("params") or (p.to_dict() if p else {})
        shown = {k: v for k, v in params.items() if v not in (None, 0, 1.0) or k == "temperature"}
        mean = f"{sum(taus) / len(taus):.3f}" if taus else "-"
        rid = r.get("request_id", steps[0].request_id if steps else str(req))
        lossy = _lossy_note(steps)
        print(f"request {req} (id {rid}): {_count(len(steps), 'step')}, mean tau {mean}, "
              + ", ".join(f"{k} {v}" for k, v in shown.items())
              + (f", finish {r['finish_reason']}" if r.get("finish_reason") else "")
              + (f", {lossy}" if lossy else ""))
        if prompt is not None:
            text = prompt if len(prompt) <= 70 else prompt[:67] + "..."
            print(f"  prompt: {json.dumps(text, ensure_ascii=False)}")
        if steps:
            print("  steps (step:tau): " + " ".join(f"{s.step}:{t}" for s, t in zip(steps, taus)))
    return 0


def cmd_render(args) -> int:
    """Draw one step's tree as SVG, PNG, DOT or text (format from --format or the -o suffix)."""
    from .views import decisions_text, render_svg, step_view, to_dot, to_text

    fmt = args.format
    if args.out:
        _check_out_file(args.out)
    if fmt is None:
        suffix = Path(args.out).suffix.lower() if args.out else ".txt"
        fmt = {".svg": "svg", ".png": "png", ".dot": "dot", ".gv": "dot", ".txt": "text"}.get(suffix)
        if fmt is None:
            raise CLIError(f"{args.out}: unknown picture suffix {suffix!r} (use .svg, .png, .dot or .txt, or --format)")
    elif args.out:
        _check_suffix(args.out, fmt, {"svg": (".svg",), "png": (".png",), "dot": (".dot", ".gv"),
                                      "text": (".txt",), "decisions": (".txt",)}[fmt])
    if fmt == "png" and not args.out:
        raise CLIError("--format png needs -o FILE")
    run = _load_trace(args.trace)
    step = _find_step(run, args.step, args.request, args.trace)
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
    else:
        data = to_text(view)
    if args.out:
        _write(args.out, data)
        print(f"step {step.step}, request {step.request} -> {args.out}")
    else:
        sys.stdout.write(data if isinstance(data, str) else "")
    return 0


def cmd_bundle(args) -> int:
    """Write a minimal self-contained repro of one verify step into a directory."""
    bundle = _bundle_module()
    run = _load_trace(args.trace)
    step = _find_step(run, args.step, args.request, args.trace)
    out = Path(args.out)
    if not out.parent.exists():
        raise CLIError(f"{args.out}: parent directory {out.parent} does not exist")
    b = bundle.make_bundle(run, step)
    path = bundle.save_bundle(b, out)
    size = sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
    print(f"step {step.step}, request {step.request} -> {path} ({size / 1024:.1f} KB)")
    return 0


def _print_differences(where: str, diffs) -> None:
    for d in diffs:
        print(f"{where}: {d}")


def _replay_trace(args) -> int:
    from . import trace as tr

    if args.backend != "reference":
        raise CLIError(f"{args.trace}: a trace stores probabilities, not logits: replay it with --backend reference, "
                       f"or make a bundle (ddtree-lab bundle) to replay with {args.backend}")
    run = _load_trace(args.trace)
    steps = _select_steps(run, args.step, args.request, args.trace)
    differing, exact, tolerant = 0, 0, 0
    lossy = _lossy_note(steps)
    if lossy:
        print(f"{lossy}: replayed under the recorded thresholds (the emitted law is not the target's)")
    with_diffs = getattr(tr, "replay_differences", None)
    for s in steps:
        where = f"step {s.step}, request {s.request}"
        try:
            if with_diffs is not None:
                _, diffs = with_diffs(s)
                if diffs:
                    differing += 1
                    _print_differences(where, diffs)
                    continue
            else:
                tr.replay(s)
        except tr.ReplayMismatch as exc:
            differing += 1
            print(f"{where}: {exc}")
            continue
        except ValueError as exc:  # stored inputs the verifier rejects
            differing += 1
            print(f"{where}: the verifier refuses the stored inputs: {exc}")
            continue
        if s.backend.startswith("triton"):
            tolerant += 1
        else:
            exact += 1
    if exact == len(steps):
        print(f"{_count(len(steps), 'step')} replayed bit for bit (reference verifier)")
        return 0
    parts = []
    if exact:
        parts.append(f"{exact} bit for bit")
    if tolerant:
        parts.append(f"{tolerant} within the Triton kernel tolerance (recorded by the Triton backend)")
    if differing:
        parts.append(f"{differing} differ")
    print(f"{_count(len(steps), 'step')} replayed with the reference verifier: " + ", ".join(parts))
    return EXIT_PROBLEM if differing else 0


def _replay_bundle(args) -> int:
    bundle = _bundle_module()
    _check_bundle_dir(args.trace)
    b = bundle.load_bundle(args.trace)
    _check_bundle_selection(b, args, args.trace)
    if b.step.lossy:
        from .views.model import lossy_mark

        print(f"{args.trace}: {lossy_mark(b.step.thresholds)}: replayed under the recorded thresholds "
              "(the emitted law is not the target's)")
    result = bundle.replay_bundle(b, backend=args.backend)
    diffs = getattr(result, "differences", result if isinstance(result, list) else [])
    for d in diffs:
        print(f"{args.trace}: {d}")
    exactness = ("within the Triton kernel tolerance (recorded by the Triton backend)"
                 if b.step.backend.startswith("triton") else "bit for bit")
    if diffs:
        print(f"{args.trace}: {_count(len(diffs), 'difference')} with {args.backend}")
        return EXIT_PROBLEM
    print(f"{args.trace}: replayed with {args.backend}, same as recorded ({exactness})")
    return 0


def _replay_recording(path: str, backend: str, args=None) -> int:
    sg = _sglang()
    rec = sg.load_recording(path)
    step = _recording_step(rec, args, path) if args is not None else None
    if step is None:
        results = sg.replay_recording(rec, backend)
    else:
        from .sglang.replay import replay_step

        results = [replay_step(rec.steps[step], r, backend, step) for r in range(len(rec.steps[step]["rows"]))]
    for line in sg.replay_report(results):
        print(line)
    counts = sg.count_verdicts(results)
    return EXIT_PROBLEM if counts.get("differs", 0) - counts.get("by design", 0) > 0 else 0


def cmd_replay(args) -> int:
    """Re-verify recorded steps; print each difference from the recorded output."""
    kind = _kind_of(args.trace)
    if kind == "bundle":
        return _replay_bundle(args)
    if kind == "recording":
        return _replay_recording(args.trace, args.backend, args)
    return _replay_trace(args)


def _load_model(spec: str | None):
    if spec is None:
        return None
    if spec == "default":
        from .models import load_default_target

        return load_default_target()
    from .models import TargetModel

    if not Path(spec).is_dir():
        raise CLIError(f"--model {spec}: not 'default' and not a model directory")
    return TargetModel.from_pretrained(spec)


def _params_override(args, base):
    import dataclasses

    changes = {k: getattr(args, k) for k in ("temperature", "top_k", "top_p", "min_p")
               if getattr(args, k, None) is not None}
    return dataclasses.replace(base, **changes) if changes else base


def cmd_audit(args) -> int:
    """The losslessness audit: a verifier's law on a step against the exact law."""
    from . import audit as au

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
        _check_out_file(args.plot)
        _check_suffix(args.plot, "html", (".html", ".htm"))
    overrides = [k for k in ("temperature", "top_k", "top_p", "min_p") if getattr(args, k, None) is not None]
    if overrides:  # before any trace or model is loaded
        from .sampling import SamplingParams

        if args.random is None and args.model is None:
            raise CLIError("sampling overrides need --model (a trace stores final probabilities, not logits)")
        try:
            _params_override(args, SamplingParams(temperature=1.0))
        except (ValueError, TypeError) as exc:
            raise CLIError(f"sampling override: {str(exc).removeprefix('SamplingParams: ')}") from exc
    _threads(args.threads)
    cases = []
    if args.random is not None:
        from .sampling import SamplingParams

        base = SamplingParams(temperature=1.0)
        p = _params_override(args, base)
        cases = [au.random_case(args.seed + k, args.nodes, args.vocab, p) for k in range(args.random)]
    elif args.source is None:
        raise CLIError("audit needs a TRACE, a BUNDLE or --random N")
    elif _kind_of(args.source) == "bundle":
        bundle = _bundle_module()
        _check_bundle_dir(args.source)
        b = bundle.load_bundle(args.source)
        _check_bundle_selection(b, args, args.source)
        cases = [au.case_from_step(b.step, b.token_texts)]
    else:
        run = _load_trace(args.source)
        step = _find_step(run, args.step, args.request, args.source)
        target = _load_model(args.model)
        if target is None:
            if any(getattr(args, k, None) is not None for k in ("temperature", "top_k", "top_p", "min_p")):
                raise CLIError("sampling overrides need --model (a trace stores final probabilities, not logits)")
            cases = [au.case_from_step(step, run.token_texts)]
        else:
            logits = au.step_logits(target, run, step)
            cases = [au.case_from_logits(step, logits, _params_override(args, step.params), run.token_texts)]
    verifier = args.verifier
    worst = 0
    for k, case in enumerate(cases):
        report = au.audit(case, verifier, draws=args.draws, seed=args.seed, alpha=args.alpha,
                          threshold_single=args.threshold_single, threshold_acc=args.threshold_acc,
                          validate=not args.no_validate)
        print(report.text(args.top))
        if args.plot:
            path = args.plot if len(cases) == 1 else f"{Path(args.plot).with_suffix('')}-{k}.html"
            # plotly.js embedded (~4.8 MB page): the page draws offline and attached to a bug report
            _write(path, report.figure().to_html(include_plotlyjs=True))
            print(f"  plot -> {path}")
        if report.rejected or report.findings:
            worst = EXIT_PROBLEM
    return worst


def _trace_problems(step) -> list[str]:
    """Every broken invariant of a recorded step's buffers."""
    import torch

    from . import retrieve

    vi = step.verify_input()
    problems: list[str] = []
    finder = getattr(retrieve, "find_retrieve_problems", None)
    logws = step.node_logws[None] if step.node_logws is not None and not torch.isnan(step.node_logws).any() else None
    n = step.num_nodes
    if int(step.positions[0]) != step.prefix_len:
        problems.append(f"node 0: position {int(step.positions[0])} != prefix length {step.prefix_len}")
    if finder is not None:  # every invariant: links, cycles, depths, positions, mask, duplicate tokens
        problems += [str(p) for p in finder(vi, node_logws=logws)]
    else:
        kw = dict(retrieve_index=vi.retrieve_index, node_logws=logws, depths=vi.depths)
        p = retrieve.find_retrieve_problem(vi.retrieve_next_token, vi.retrieve_next_sibling, vi.num_nodes, **kw)
        if p is not None:
            problems.append(str(p))
        pos, dep = step.positions.tolist(), step.depths.tolist()
        for i in range(1, n):
            if pos[i] != pos[0] + dep[i]:
                problems.append(f"node {i}: position {pos[i]} != root position {pos[0]} + depth {dep[i]}")
    if not problems:
        parents, _ = retrieve.decode_retrieve(vi.retrieve_next_token, vi.retrieve_next_sibling, vi.num_nodes)
        bad = (parents[0, :n] != step.parents).nonzero().flatten().tolist()
        for i in bad:
            problems.append(f"node {i}: recorded parent {int(step.parents[i])} but the buffers link it under "
                            f"{int(parents[0, i])}")
    if not problems and finder is None:
        tokens = step.node_token_ids.tolist()
        children: dict[int, list[int]] = {}
        for i in range(1, n):
            children.setdefault(int(step.parents[i]), []).append(i)
        for par, kids in sorted(children.items()):
            seen: dict[int, int] = {}
            for c in kids:
                if tokens[c] in seen:
                    problems.append(f"node {c}: same token {tokens[c]} as its sibling {seen[tokens[c]]} "
                                    f"(children of node {par}): the tree is lossy")
                seen.setdefault(tokens[c], c)
    return problems


def cmd_doctor(args) -> int:
    """Check verify buffers (every broken invariant) and, with --model, tree logits."""
    if args.sample < 1:
        raise CLIError(f"--sample {args.sample}: must be >= 1")
    kind = _kind_of(args.source)
    found = 0
    checked = 0
    if kind == "recording":
        sg = _sglang()
        rec = sg.load_recording(args.source)
        only = _recording_step(rec, args, args.source)
        checked = rec.num_rows if only is None else len(rec.steps[only]["rows"])
        for p in sg.recording_problems(rec):  # links, coins, SGLang's outputs against the buffers
            if only is not None and not p.startswith(f"step {only} "):
                continue
            found += 1
            print(f"{args.source}: {p}")
    elif kind == "bundle":
        bundle = _bundle_module()
        _check_bundle_dir(args.source)
        b = bundle.load_bundle(args.source)
        _check_bundle_selection(b, args, args.source)
        checked = 1
        for p in _trace_problems(b.step if hasattr(b, "step") else b):
            found += 1
            print(f"{args.source}: {p}")
    else:
        run = _load_trace(args.source)
        for s in _select_steps(run, args.step, args.request, args.source):
            checked += 1
            for p in _trace_problems(s):
                found += 1
                print(f"{args.source}: step {s.step}, request {s.request}: {p}")
        if args.model is not None:
            target = _load_model(args.model)
            step = _find_step(run, args.step, args.request, args.source)
            from . import doctor

            check = doctor.check_recorded_rows(target, run, step, sample=args.sample, seed=args.seed)
            print(f"step {step.step}, request {step.request}: {check.text()}")
            if check.first_bad is not None:
                found += 1
    print(f"{_count(checked, 'row' if kind == 'recording' else 'step')} checked, {_count(found, 'problem')}")
    return EXIT_PROBLEM if found else 0


def _read_prompts(args) -> tuple[list[str], list[dict], list[str], list[str]]:
    """Prompts, per-request overrides, request ids and where each came from (for errors)."""
    prompts, overrides, ids, origins = [], [], [], []
    for p in args.prompt or []:
        prompts.append(p)
        overrides.append({})
        ids.append(str(len(ids)))
        origins.append(f"--prompt {len(origins)}")
    if args.prompts:
        path = Path(args.prompts)
        if path.is_dir():
            raise CLIError(f"{args.prompts}: is a directory, not a JSONL file")
        if not path.exists():
            raise CLIError(f"{args.prompts}: no such file")
        before = len(prompts)
        allowed = {"prompt", "id", "temperature", "top_k", "top_p", "min_p", "seed"}
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise CLIError(f"{args.prompts}, line {n}: not JSON ({exc.msg})") from exc
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                raise CLIError(f"{args.prompts}, line {n}: expected an object with a string field 'prompt'")
            unknown = set(obj) - allowed
            if unknown:
                raise CLIError(f"{args.prompts}, line {n}: unknown field(s) {', '.join(sorted(unknown))} "
                               f"(known: {', '.join(sorted(allowed))})")
            for k in ("temperature", "top_p", "min_p"):
                v = obj.get(k)
                if k in obj and (isinstance(v, bool) or not isinstance(v, (int, float))):
                    raise CLIError(f"{args.prompts}, line {n}: field {k!r} must be a number, got {json.dumps(v)}")
            for k in ("top_k", "seed"):
                v = obj.get(k)
                if k in obj and (isinstance(v, bool) or not isinstance(v, int)):
                    raise CLIError(f"{args.prompts}, line {n}: field {k!r} must be an integer, got {json.dumps(v)}")
            prompts.append(obj["prompt"])
            overrides.append({k: v for k, v in obj.items() if k not in ("prompt", "id")})
            ids.append(str(obj.get("id", len(ids))))
            origins.append(f"{args.prompts}, line {n}")
        if len(prompts) == before:
            raise CLIError(f"{args.prompts}: no prompts (expected one JSON object per line)")
    if not prompts:
        raise CLIError("record needs --prompt TEXT or --prompts FILE.jsonl")
    return prompts, overrides, ids, origins


#: record's wall time and peak memory, fitted to two runs of the embedded SmolLM2 (V = 49,152,
#: level full, one request, 8 tokens, 2 shared CPU cores): B = 256: 57 s, 1.7 GB; B = 1024: 81 s,
#: 3.2 GB. Seconds = a + b * B * tokens; GB = c + d * B (the target scores B + 1 rows of V logits).
RECORD_COST_FIT = {"a": 46.0, "b": 0.0039, "c": 1.2, "d": 2.0 / 1024}
WARN_BUDGET = 512  # engines' budgets reach 512 (DDTree: 256-512); above, record warns with the estimate


def _record_cost(budget: int, tokens: int) -> str | None:
    """A warning with the estimated time and memory of a record run above ``WARN_BUDGET``, or None."""
    if budget <= WARN_BUDGET:
        return None
    f = RECORD_COST_FIT
    seconds, gb = f["a"] + f["b"] * budget * tokens, f["c"] + f["d"] * budget
    return (f"--budget {budget} is large: expect roughly {seconds:.0f} s and {gb:.1f} GB for {tokens} tokens on a "
            "small CPU (fitted to B=256: 57 s, 1.7 GB and B=1024: 81 s, 3.2 GB for 8 tokens, 2 cores)")


def cmd_record(args) -> int:
    """Run a live DDTree session over the prompts and write its trace."""
    import dataclasses

    from .sampling import SamplingParams
    from .session import LiveSession
    from .trace import save_trace

    out = Path(args.out)
    _check_out_file(args.out)
    if args.max_new_tokens < 1:
        raise CLIError(f"--max-new-tokens {args.max_new_tokens}: must be >= 1")
    from .tree import MAX_BUDGET

    if not 1 <= args.budget <= MAX_BUDGET:  # the one rule, checked before the model loads
        raise CLIError(f"--budget {args.budget}: must be in [1, {MAX_BUDGET}] (draft nodes per tree)")
    if args.threads is not None and args.threads < 1:
        raise CLIError(f"--threads {args.threads}: must be >= 1")
    for name in ("threshold_single", "threshold_acc"):
        t = getattr(args, name)
        if not (math.isfinite(t) and t >= 0):
            raise CLIError(f"--{name.replace('_', '-')} must be a finite number >= 0, got {t}")
    from . import lab

    if args.drafter is not None and not args.drafter.strip():
        raise CLIError("--drafter: empty; give 'dflash', 'ridge' or a path")
    if args.drafter is not None and not lab.drafter_exists(args.drafter):
        raise CLIError(f"--drafter {args.drafter}: no such file or directory (and not 'dflash' or 'ridge')")
    if args.target is not None and not Path(args.target).exists():
        raise CLIError(f"--target {args.target}: no such file or directory")
    if args.target is not None and not Path(args.target).is_dir():
        raise CLIError(f"--target {args.target}: not a model directory")
    prompts, overrides, ids, origins = _read_prompts(args)
    base = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          seed=None)
    params = []
    for b, o in enumerate(overrides):
        try:
            p = dataclasses.replace(base, **o)
        except (ValueError, TypeError) as exc:
            raise CLIError(f"{origins[b]}: {str(exc).removeprefix('SamplingParams: ')}") from exc
        if p.seed is None:
            p = dataclasses.replace(p, seed=args.seed * 1000 + b)
        why = p.problem()
        if why is not None:
            raise CLIError(f"{origins[b]}: request {b} ({ids[b]}): {why}")
        params.append(p)
    cost = _record_cost(args.budget, len(prompts) * args.max_new_tokens)
    if cost is not None:
        print(f"ddtree-lab record: warning: {cost}", file=sys.stderr)
    threads = _threads(args.threads)
    if args.quiet:  # transformers' "Loading weights" bar too
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    which = lab.DEFAULT_DRAFTER if args.drafter is None else args.drafter
    target = _load_model("default" if args.target is None else args.target)
    try:
        drafter = lab.load_drafter(target, which)
    except (ValueError, OSError) as exc:
        raise CLIError(f"--drafter {which}: {exc}") from exc
    kw = {"record": args.level, "threshold_single": args.threshold_single, "threshold_acc": args.threshold_acc}
    if args.backend is not None:
        kw["verify_backend"] = args.backend
    session = LiveSession(target, drafter, budget=args.budget, sampling=params, seed=args.seed, **kw)
    from tqdm import tqdm

    bar = tqdm(total=len(prompts) * args.max_new_tokens, unit="tok", desc="record", disable=args.quiet,
               file=sys.stderr)
    done = 0
    try:
        for _ in session.generate(prompts, max_new_tokens=args.max_new_tokens, chat=not args.no_chat,
                                  request_ids=ids):
            now = sum(len(r.generated) for r in session.requests)
            bar.update(now - done)
            done = now
    finally:
        bar.close()  # ends the bar's line, so an error prints on its own line
    run = session.trace()
    run.metadata["threads"] = threads
    save_trace(run, out)
    print(f"{_count(len(run.steps), 'record')}, {_count(len(prompts), 'request')} -> {out}")
    return 0


def cmd_sglang(args) -> int:
    """SGLang interop: the hook directory, replaying and converting recordings."""
    sg = _sglang()
    if args.sglang_cmd == "hook-dir":
        print(sg.hook_dir())
        return 0
    if args.sglang_cmd == "replay":
        return _replay_recording(args.recording, args.backend)
    if args.sglang_cmd == "convert":
        out = Path(args.out)
        _check_out_file(args.out)
        path = sg.convert(args.recording, out)
        print(f"{args.recording} -> {path}")
        return 0
    raise CLIError(f"unknown sglang command {args.sglang_cmd!r}")


def cmd_lab(args) -> int:
    """Open JupyterLab on working copies of labs/ in .lab/ (ignored by git; labs/ stays as
    committed), bound to 127.0.0.1 with a fresh random token, on the first free port from
    --port on. `make lab` (scripts/lab.sh) runs this command."""
    import secrets
    import shutil

    from . import labserver

    if not 1 <= args.port <= 65535:
        raise CLIError(f"--port {args.port}: must be in 1..65535")
    root = Path(__file__).resolve().parent.parent
    labs, work = root / "labs", root / ".lab"
    if not labs.is_dir():
        raise CLIError(f"{labs}: no labs/ directory (run from a ddtree-lab checkout)")
    beside = Path(sys.executable).parent / "jupyter"  # this environment's Jupyter first
    jupyter = str(beside) if beside.exists() else shutil.which("jupyter") or str(beside)
    token = os.environ.get("DDTREE_LAB_TOKEN") or secrets.token_hex(24)
    port = labserver.free_port(args.port)
    if port != args.port:
        print(f"[lab] port {args.port} is in use (another lab?): using {port}")
    cmd = labserver.jupyter_command(jupyter, port, token, work, as_root=hasattr(os, "geteuid") and os.geteuid() == 0)
    if args.dry_run:
        print(f"[lab] would copy labs/*.ipynb to {work}/ and serve the copies")
        print(f"[lab] open {labserver.lab_url(port, '<token>')}")
        print(" ".join(cmd).replace(token, "<token>"))
        return 0
    if not Path(jupyter).exists():
        raise CLIError("jupyter is not installed (pip install 'ddtree-lab[lab]')")
    for line in labserver.working_copies(labs, work):
        print(f"[lab] {line}")
    print("[lab] working copies in .lab/ (git ignores them; labs/ stays as committed)")
    print(f"[lab] open {labserver.lab_url(port, token)}", flush=True)
    os.execv(jupyter, cmd)
    return 0  # pragma: no cover


# -- parser ---------------------------------------------------------------------------------


def _step_args(p, required: bool = False) -> None:
    p.add_argument("--step", type=int, required=required,
                   help="decoding step (0-based, as `info` lists them)")
    p.add_argument("--request", type=int, help="request index (needed when several requests have the step)")


def _sampling_args(p, defaults: bool) -> None:
    p.add_argument("--temperature", type=float, default=0.0 if defaults else None, help="0 means greedy")
    p.add_argument("--top-k", type=int, default=0 if defaults else None, help="<= 0 means off")
    p.add_argument("--top-p", type=float, default=1.0 if defaults else None, help="1.0 means off")
    p.add_argument("--min-p", type=float, default=None, help="off when not given")


class _Help(argparse.RawDescriptionHelpFormatter):
    """Help text as written, each option's default appended (except None / off flags)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (action.option_strings and action.default is not None and action.default is not False
                and action.default != argparse.SUPPRESS and "%(default)" not in text):
            text += " (default: %(default)s)"
        return text


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ddtree-lab", description=__doc__, formatter_class=_Help)
    sub = ap.add_subparsers(dest="command", required=True, metavar="VERB",
                            parser_class=lambda **kw: argparse.ArgumentParser(formatter_class=_Help, **kw))

    p = sub.add_parser("record", help="run a live session and write a trace", description=cmd_record.__doc__)
    p.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    p.add_argument("--prompts", help="JSONL file: one object per line with 'prompt' and optional 'id', "
                                     "'temperature', 'top_k', 'top_p', 'min_p', 'seed'")
    p.add_argument("--target", help="local Hugging Face model directory (default: the embedded SmolLM2-135M)")
    p.add_argument("--drafter", help="'dflash', 'ridge', a DFlash checkpoint directory or a ridge safetensors file "
                                     "(default: the lab's default drafter for the embedded target)")
    _sampling_args(p, defaults=True)
    p.add_argument("--seed", type=int, default=0, help="coin seed (request b: seed * 1000 + b unless its own)")
    p.add_argument("--budget", type=int, default=32, help="draft nodes per tree (B)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate per request")
    p.add_argument("--level", choices=["full", "light", "off"], default="full", help="recording level")
    p.add_argument("--backend", choices=["reference", "torch-lazy", "triton", "auto"], help="verify backend")
    p.add_argument("--threshold-single", type=float, default=1.0,
                   help="SGLang's threshold_single (1: exact; below 1 the run is recorded as lossy)")
    p.add_argument("--threshold-acc", type=float, default=1.0,
                   help="SGLang's threshold_acc (1: exact; any other value is recorded as lossy)")
    p.add_argument("--threads", type=int, help="torch threads (default: ddtree_lab.threads picks them for this machine)")
    p.add_argument("--no-chat", action="store_true", help="do not wrap prompts in the chat template")
    p.add_argument("--quiet", action="store_true", help="no progress bars (record's and the model loader's)")
    p.add_argument("-o", "--out", required=True, help="trace file to write")
    p.set_defaults(func=cmd_record)

    p = sub.add_parser("info", help="requests, prompts, tau and steps of a trace", description=cmd_info.__doc__)
    p.add_argument("trace")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("render", help="draw one step's tree", description=cmd_render.__doc__)
    p.add_argument("trace")
    _step_args(p, required=True)
    p.add_argument("-o", "--out", help="output file; .svg .png .dot .txt (default: text on standard output)")
    p.add_argument("--format", choices=["svg", "png", "dot", "text", "decisions"], help="overrides the suffix")
    p.add_argument("--collapse", action="store_true", help="draw each parent's unvisited children as one node")
    p.set_defaults(func=cmd_render)

    p = sub.add_parser("bundle", help="a self-contained repro of one verify step", description=cmd_bundle.__doc__)
    p.add_argument("trace")
    _step_args(p, required=True)
    p.add_argument("-o", "--out", required=True, help="directory to write")
    p.set_defaults(func=cmd_bundle)

    p = sub.add_parser("replay", help="re-verify and print every difference", description=cmd_replay.__doc__)
    p.add_argument("trace", metavar="TRACE|BUNDLE|RECORDING")
    p.add_argument("--backend", choices=["reference", "torch-lazy", "triton"], default="reference",
                   help="verify backend that re-runs the steps")
    _step_args(p)
    p.set_defaults(func=cmd_replay)

    p = sub.add_parser("audit", help="losslessness audit of a verifier on a step", description=cmd_audit.__doc__)
    p.add_argument("source", nargs="?", metavar="TRACE|BUNDLE")
    _step_args(p)
    p.add_argument("--random", type=int, metavar="N", help="audit N random small cases instead")
    p.add_argument("--nodes", type=int, default=6, help="nodes of a random case")
    p.add_argument("--vocab", type=int, default=8, help="vocabulary of a random case")
    p.add_argument("--model", help="'default' or a model directory: recompute the step's full target logits")
    from .audit import PLANTED_FAULTS

    p.add_argument("--verifier", default="reference",
                   help="reference, torch-lazy, triton, or a planted fault: " + ", ".join(PLANTED_FAULTS))
    p.add_argument("--draws", type=int, default=4000, help="coin sets drawn")
    p.add_argument("--seed", type=int, default=0, help="coin seed")
    p.add_argument("--alpha", type=float, default=1e-3, help="significance level")
    p.add_argument("--threshold-single", type=float, default=1.0, help="SGLang's threshold_single (1: exact)")
    p.add_argument("--threshold-acc", type=float, default=1.0, help="SGLang's threshold_acc (1: exact)")
    _sampling_args(p, defaults=False)
    p.add_argument("--no-validate", action="store_true",
                   help="let the built-in backends walk buffers they would refuse (to measure their law)")
    p.add_argument("--top", type=int, default=5, help="outcomes listed as most over / under represented")
    p.add_argument("--plot", help="write the plotly figure to this .html file")
    p.add_argument("--threads", type=int)
    p.set_defaults(func=cmd_audit)

    p = sub.add_parser("doctor", help="check buffers (and, with --model, tree logits)", description=cmd_doctor.__doc__)
    p.add_argument("source", metavar="TRACE|BUNDLE|RECORDING")
    _step_args(p)
    p.add_argument("--model", help="'default' or a model directory: compare recorded rows with causal forwards")
    p.add_argument("--sample", type=int, default=8, help="nodes compared with causal forwards")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampled nodes")
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("sglang", help="SGLang recordings: hook-dir, replay, convert", description=cmd_sglang.__doc__)
    ss = p.add_subparsers(dest="sglang_cmd", required=True, metavar="COMMAND")
    ss.add_parser("hook-dir", help="print the directory to prepend to PYTHONPATH for the recording hook")
    q = ss.add_parser("replay", help="replay a recording with the lab's verifiers")
    q.add_argument("recording")
    q.add_argument("--backend", choices=["reference", "torch-lazy", "triton"], default="reference",
                   help="verify backend that re-runs the rows")
    q = ss.add_parser("convert", help="convert a recording into a lab trace")
    q.add_argument("recording")
    q.add_argument("-o", "--out", required=True)
    p.set_defaults(func=cmd_sglang)

    p = sub.add_parser("lab", help="open JupyterLab on working copies of labs/ (as `make lab`)",
                       description=cmd_lab.__doc__)
    p.add_argument("--port", type=int, default=int(os.environ.get("DDTREE_LAB_PORT", "8888")),
                   help="first port to try (DDTREE_LAB_PORT); the next free one is used if it is taken")
    p.add_argument("--dry-run", action="store_true", help="print the command instead of running it")
    p.set_defaults(func=cmd_lab)
    return ap


def _count(n: int, word: str) -> str:
    """``"1 step"``, ``"2 steps"``: a count with its noun in the right number."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _one_line(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return " ".join(text.split())


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .threads import configure_threads

    try:
        configure_threads()  # DDTREE_LAB_THREADS=N overrides; record / audit --threads N too
        return args.func(args)
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
