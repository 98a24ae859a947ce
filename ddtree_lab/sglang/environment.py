"""The environment switch of the SGLang recorder (:class:`~ddtree_lab.sglang.recorder.SGLangRecorder`):
:func:`install_from_env` and the start-up hook directory :func:`hook_dir`.

SGLang runs its model in scheduler subprocesses, so the
recorder is switched on by environment variables that every subprocess inherits, and a
``sitecustomize`` hook directory (:func:`hook_dir`, ``ddtree-lab sglang hook-dir``) put on
``PYTHONPATH``::

    DDTREE_LAB_SGLANG_RECORD=/tmp/rec \\
    PYTHONPATH=$(ddtree-lab sglang hook-dir):$PYTHONPATH \\
    python -m sglang.launch_server --model-path ... --speculative-algorithm EAGLE ...

Each recording process writes ``/tmp/rec/sglang-rank{R}-pid{P}.ddrec``, append-only
(:mod:`ddtree_lab.sglang.append`): each call's inputs before its kernel runs, its outputs after,
so a hang or a kill leaves every finished call and the inputs of the one that did not return on
disk; the recorder then keeps no steps in memory. ``..._FORMAT=files`` writes the older
``.json`` + ``.safetensors`` pair instead, rewritten every ``..._FLUSH`` (8) steps. Other
variables: ``..._RANK`` (default 0), ``..._MAX_STEPS`` (64), ``..._CALLS`` (``start:stop``),
``..._REQUESTS`` (comma-separated request ids), ``..._ROWS`` (rows per call, 8),
``..._PROB_ROWS`` (``path`` or ``all``), ``..._TARGETS`` (override the patch points, see
:data:`~ddtree_lab.sglang.recorder.PATCH_POINTS`).
"""

from __future__ import annotations

import atexit
import os
from pathlib import Path

from .recorder import RecordFilter, SGLangRecorder

__all__ = ["install_from_env", "hook_dir", "ENV_PREFIX"]

ENV_PREFIX = "DDTREE_LAB_SGLANG_RECORD"
_ENV_RECORDER: SGLangRecorder | None = None


def _parse_targets(text: str) -> dict[str, dict[str, str]]:
    targets: dict[str, dict[str, str]] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        where, _, kind = item.partition("=")
        module, _, attr = where.partition(":")
        if not (module and attr and kind):
            raise ValueError(f"{ENV_PREFIX}_TARGETS entry {item!r} is not module:attr=kind")
        targets.setdefault(module, {})[attr] = kind
    return targets


def _parse_calls(text: str) -> tuple[int, int]:
    start, sep, stop = text.partition(":")
    try:
        if sep and ":" not in stop:
            return int(start), int(stop)
    except ValueError:
        pass
    raise ValueError(f"{ENV_PREFIX}_CALLS must be start:stop (two ints), got {text!r}")


def install_from_env(environ: dict | None = None) -> SGLangRecorder | None:
    """Install a recorder configured by ``DDTREE_LAB_SGLANG_RECORD*`` (module docstring); None when unset.

    The recorder saves to ``$DDTREE_LAB_SGLANG_RECORD/sglang-rank{R}-pid{P}`` every
    ``..._FLUSH`` (8) steps, when it reaches ``..._MAX_STEPS``, and at exit; the directory
    ``$DDTREE_LAB_SGLANG_RECORD`` is created if missing.
    """
    global _ENV_RECORDER
    env = os.environ if environ is None else environ
    out_dir = env.get(ENV_PREFIX)
    if not out_dir:
        return None
    if _ENV_RECORDER is not None:
        return _ENV_RECORDER
    calls = env.get(f"{ENV_PREFIX}_CALLS")
    requests = env.get(f"{ENV_PREFIX}_REQUESTS")
    f = RecordFilter(
        rank=int(env.get(f"{ENV_PREFIX}_RANK", 0)),
        max_steps=int(env.get(f"{ENV_PREFIX}_MAX_STEPS", 64)),
        calls=_parse_calls(calls) if calls else None,
        requests=frozenset(r.strip() for r in requests.split(",") if r.strip()) if requests else None,
        max_rows=int(env.get(f"{ENV_PREFIX}_ROWS", 8)),
        prob_rows=env.get(f"{ENV_PREFIX}_PROB_ROWS", "path"),
    )
    flush = max(1, int(env.get(f"{ENV_PREFIX}_FLUSH", 8)))
    layout = env.get(f"{ENV_PREFIX}_FORMAT", "append")
    if layout not in ("append", "files"):
        raise ValueError(f"{ENV_PREFIX}_FORMAT must be 'append' or 'files', got {layout!r}")
    targets = _parse_targets(env[f"{ENV_PREFIX}_TARGETS"]) if env.get(f"{ENV_PREFIX}_TARGETS") else None
    saved = {"count": 0}

    def path() -> Path:
        return Path(out_dir) / f"sglang-rank{f.rank}-pid{os.getpid()}"

    def save(rec: SGLangRecorder) -> None:
        if rec.sink is not None:  # append-only: every call is on disk already; the metadata last
            rec.sink.metadata(rec.run_metadata({"source": "install_from_env"}))
        elif rec.steps and len(rec.steps) != saved["count"]:
            rec.save(path(), {"source": "install_from_env"})
            saved["count"] = len(rec.steps)

    def on_step(rec: SGLangRecorder) -> None:
        if rec.sink is None and (len(rec.steps) % flush == 0 or len(rec.steps) >= f.max_steps):
            save(rec)
        if rec.sink is not None:
            rec.drop_steps()  # on disk: memory stays bounded (calls counted in calls_recorded)

    Path(out_dir).mkdir(parents=True, exist_ok=True)  # the directory the user named
    rec = SGLangRecorder(f, on_step=on_step)
    if layout == "append":
        from .append import AppendSink

        rec.sink = AppendSink(str(path()) + ".ddrec", rec.run_metadata({"source": "install_from_env"}))
    rec.install(targets)
    atexit.register(save, rec)
    _ENV_RECORDER = rec
    return rec


def hook_dir() -> str:
    """The directory to put on ``PYTHONPATH`` so every Python process (SGLang's schedulers
    included) runs :func:`install_from_env` at start-up (a ``sitecustomize`` module that also
    runs the ``sitecustomize`` it shadows)."""
    return str(Path(__file__).resolve().parent.parent / "_sglang_hook")

