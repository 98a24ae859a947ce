"""Verbs that run the model or the lab: record and lab."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

from . import common
from .common import CLIError, check_new_output, check_out_file, count, inputs_of, thread_note



def _read_prompts(args) -> tuple[list[str], list[dict], list[str], list[str]]:
    """Prompts, per-request overrides, request ids and where each came from (for errors)."""
    prompts, overrides, ids, origins = [], [], [], []
    for k, p in enumerate(args.prompt or [], 1):
        if not p:
            raise CLIError(f'--prompt "" (the {_ordinal(k)} --prompt): empty prompt (give the text to continue)')
        prompts.append(p)
        overrides.append({})
        ids.append(str(len(ids)))
        shown = p if len(p) <= 30 else p[:27] + "..."
        origins.append(f"--prompt {json.dumps(shown, ensure_ascii=False)}")
    if args.prompts:
        path = Path(args.prompts)
        if path.is_dir():
            raise CLIError(f"{args.prompts}: is a directory, not a JSONL file")
        if not path.exists():
            raise CLIError(f"{args.prompts}: no such file")
        before = len(prompts)
        allowed = {"prompt", "id", "temperature", "top_k", "top_p", "min_p", "seed", "banned_token_ids"}
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise CLIError(f"{args.prompts}, line {n}: not JSON ({exc.msg})") from exc
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                raise CLIError(f"{args.prompts}, line {n}: expected an object with a string field 'prompt'")
            if not obj["prompt"]:
                raise CLIError(f"{args.prompts}, line {n}: field 'prompt' is empty (give the text to continue)")
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
            if "banned_token_ids" in obj:
                v = obj["banned_token_ids"]
                if not isinstance(v, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in v):
                    raise CLIError(f"{args.prompts}, line {n}: field 'banned_token_ids' must be a list of integers, "
                                   f"got {json.dumps(v)}")
                obj = {**obj, "banned_token_ids": tuple(v)}
            prompts.append(obj["prompt"])
            overrides.append({k: v for k, v in obj.items() if k not in ("prompt", "id")})
            ids.append(str(obj.get("id", len(ids))))
            origins.append(f"{args.prompts}, line {n}")
        if len(prompts) == before:
            raise CLIError(f"{args.prompts}: no prompts (expected one JSON object per line)")
    if not prompts:
        raise CLIError("record needs --prompt TEXT or --prompts FILE.jsonl")
    return prompts, overrides, ids, origins


def _ordinal(n: int) -> str:
    """``1`` -> ``"1st"``, ``2`` -> ``"2nd"``, ``11`` -> ``"11th"``."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


#: record's wall time and peak memory, fitted to two runs of the embedded SmolLM2 (V = 49,152,
#: level full, one request, 8 tokens, 2 shared CPU cores): B = 256: 57 s, 1.7 GB; B = 1024: 81 s,
#: 3.2 GB. Seconds = a + b * B * tokens; GB = c + d * B (the target scores B + 1 rows of V logits).
RECORD_COST_FIT = {"a": 46.0, "b": 0.0039, "c": 1.2, "d": 2.0 / 1024}


WARN_BUDGET = 512  # engines' budgets reach 512 (DDTree: 256-512); above, record warns with the estimate


def record_cost(budget: int, tokens: int) -> str | None:
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

    from ..sampling import SamplingParams
    from ..session import LiveSession
    out = Path(args.out)
    check_out_file(args.out)
    check_new_output(args.out, args.force, inputs=inputs_of(args))
    from ..io.append_trace import segment_name_problem

    why = segment_name_problem(args.out)
    if why is not None:
        raise CLIError(f"-o {why}")
    if args.max_new_tokens < 1:
        raise CLIError(f"--max-new-tokens {args.max_new_tokens}: must be >= 1")
    common.check_budget("--budget", args.budget)  # the one rule, checked before the model loads
    if args.threads is not None and args.threads < 1:
        raise CLIError(f"--threads {args.threads}: must be >= 1")
    for name in ("threshold_single", "threshold_acc"):
        t = getattr(args, name)
        if not (math.isfinite(t) and t >= 0):
            raise CLIError(f"--{name.replace('_', '-')} must be a finite number >= 0, got {t}")
    from .. import notebook

    if args.drafter is not None and not args.drafter.strip():
        raise CLIError("--drafter: empty; give 'dflash', 'ridge' or a path")
    if args.drafter is not None and not notebook.drafter_exists(args.drafter):
        raise CLIError(f"--drafter {args.drafter}: no such file or directory (and not 'dflash' or 'ridge')")
    if args.target is not None and not Path(args.target).exists():
        raise CLIError(f"--target {args.target}: no such file or directory")
    if args.target is not None and not Path(args.target).is_dir():
        raise CLIError(f"--target {args.target}: not a model directory")
    prompts, overrides, ids, origins = _read_prompts(args)
    from ..models.target import target_vocab_size

    vocab = target_vocab_size(args.target)  # from the configuration: the weights load later
    which_target = args.target or "the embedded SmolLM2-135M-Instruct"
    for t in getattr(args, "ban", None) or ():
        if t < 0:
            raise CLIError(f"--ban {t}: not a token id of {which_target} (ids are >= 0)")
        if vocab is not None and t >= vocab:
            raise CLIError(f"--ban {t}: not a token id of {which_target} (its vocabulary has ids 0..{vocab - 1})")
    for name in ("temperature", "top_k", "top_p", "min_p"):  # each option alone, so the message names it
        common.check_sampling_option(name, getattr(args, name), vocab)
    seed_max = (2**63 - len(prompts)) // 1000  # request b's coin seed: seed * 1000 + b, in [0, 2**63)
    if not 0 <= args.seed <= seed_max:
        raise CLIError(f"--seed {args.seed}: must be in [0, {seed_max}] (request b's coin seed is seed * 1000 + b, "
                       "which must be in [0, 2**63))")
    base = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          seed=None, banned_token_ids=tuple(getattr(args, "ban", None) or ()))
    params = []
    for b, o in enumerate(overrides):
        try:
            p = dataclasses.replace(base, **o)
        except (ValueError, TypeError) as exc:
            raise CLIError(f"{origins[b]}: {str(exc).removeprefix('SamplingParams: ')}") from exc
        if p.seed is None:
            p = dataclasses.replace(p, seed=args.seed * 1000 + b)
        why = p.problem(vocab)  # vocab None (not stated by the configuration): checked again after the load
        if why is not None:
            raise CLIError(f"{origins[b]}: request {b} ({ids[b]}): {why}")
        params.append(p)
    cost = record_cost(args.budget, len(prompts) * args.max_new_tokens)
    if cost is not None:
        print(f"ddtree-lab record: warning: {cost}", file=sys.stderr)
    threads = thread_note(args.threads)
    if args.quiet:  # transformers' "Loading weights" bar too
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    which = notebook.DEFAULT_DRAFTER if args.drafter is None else args.drafter
    target = common.load_model("default" if args.target is None else args.target, quiet=args.quiet)
    with common.progress(1, f"loading drafter {which}", unit="model", quiet=args.quiet) as loading:
        try:
            drafter = notebook.load_drafter(target, which)
        except (ValueError, OSError) as exc:
            raise CLIError(f"--drafter {which}: {exc}") from exc
        loading.update()
    kw = {"record": args.level, "threshold_single": args.threshold_single, "threshold_acc": args.threshold_acc}
    if args.backend is not None:
        kw["verify_backend"] = args.backend
    # pyright: ignore below: the Drafter protocol (models/drafter.py) declares target_layer_ids a mutable Sequence[int] and the
    # drafters hold a tuple; the fix belongs to the protocol, outside this file
    session = LiveSession(target, drafter,  # pyright: ignore[reportArgumentType]
                          budget=args.budget, sampling=params, seed=args.seed, record_to=out, **kw)
    session.extra_metadata["threads"] = threads
    from tqdm import tqdm

    bar = tqdm(total=len(prompts) * args.max_new_tokens, unit="tok", desc="record", disable=args.quiet or common.bars_off(),
               file=sys.stderr)
    done = 0
    interrupted = False
    try:
        for _ in session.generate(prompts, max_new_tokens=args.max_new_tokens, chat=not args.no_chat,
                                  request_ids=ids):
            now = sum(len(r.generated) for r in session.requests)
            bar.update(now - done)
            done = now
    except KeyboardInterrupt:  # every finished step is on disk already (append-only)
        interrupted = True
        bar.leave = False  # the interrupted line stands alone
    finally:
        bar.close()  # ends the bar's line, so an error prints on its own line
    session.close_recording("interrupted" if interrupted else "closed")  # no-op when generate closed it
    assert session.recorder is not None  # record_to=out (a Path) always opens a recorder
    stopped = session.recorder.stopped
    n = len(session.steps)
    if interrupted:  # one line on stderr: the append-only file keeps every finished step, readable as it is
        print(f"ddtree-lab record: interrupted; kept {count(session.num_steps, 'finished step')} "
              f"({count(n, 'record')}) written before it in {out}" + (f" ({stopped})" if stopped else "")
              + f" (append-only: it reads as it is, `ddtree-lab info {out}`)", file=sys.stderr)
        return 130
    if stopped is not None:
        print(f"ddtree-lab record: {stopped}; the file holds the steps written before", file=sys.stderr)
    print(f"{count(n, 'record')}, {count(len(prompts), 'request')} -> {out}")
    return 0


def cmd_lab(args) -> int:
    """Open JupyterLab on working copies of labs/ in .lab/ (ignored by git; labs/ stays as
    committed), bound to 127.0.0.1 with a fresh random token, on the first free port from
    --port on. `make lab` (scripts/lab.sh) runs this command."""
    import secrets
    import shutil

    from . import labserver

    if not 1 <= args.port <= 65535:
        raise CLIError(f"--port {args.port}: must be in 1..65535")
    root = Path(__file__).resolve().parents[2]
    labs, work = root / "labs", root / ".lab"
    if not labs.is_dir():
        raise CLIError(f"{labs}: no labs/ directory (run from a ddtree-lab checkout)")
    beside = Path(sys.executable).parent / "jupyter"  # this environment's Jupyter first
    jupyter = str(beside) if beside.exists() else shutil.which("jupyter") or str(beside)
    token = os.environ.get("DDTREE_LAB_TOKEN") or secrets.token_hex(24)
    port = labserver.free_port(args.port)
    if port != args.port:
        print(f"[lab] port {args.port} is in use (another lab?): using {port}")
    cmd = labserver.jupyter_command(jupyter, port, work, as_root=hasattr(os, "geteuid") and os.geteuid() == 0)
    env = labserver.jupyter_env(token)  # the token in the environment, not in argv where `ps` shows it
    if args.dry_run:
        print(f"[lab] would copy labs/*.ipynb to {work}/ and serve the copies")
        print(f"[lab] open {labserver.lab_url(port, '<token>')}")
        print("JUPYTER_TOKEN=<token> " + " ".join(cmd))
        return 0
    if not Path(jupyter).exists():
        raise CLIError("jupyter is not installed (pip install 'ddtree-lab[lab]')")
    for line in labserver.working_copies(labs, work) + labserver.trust_shipped(labs, work):
        print(f"[lab] {line}")
    print("[lab] working copies in .lab/ (git ignores them; labs/ stays as committed)")
    print(f"[lab] open {labserver.lab_url(port, token)}", flush=True)
    os.execve(jupyter, cmd, env)
    return 0  # pragma: no cover
