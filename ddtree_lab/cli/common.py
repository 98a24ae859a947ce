"""The command line's shared parts: errors and exit codes, opening sources, selecting steps, argument checks."""

from __future__ import annotations

import os
import tempfile
import sys
from pathlib import Path


EXIT_PROBLEM = 1


EXIT_ERROR = 2


MIN_DRAWS = 100  # fewer coin sets than this cannot reject at the usual alpha


class CLIError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


def load_run(path: str):
    """Any source through :func:`ddtree_lab.io.load`; damaged steps are named on stderr and the
    others kept."""
    from ..io import load

    try:
        run = load(path)
    except (FileNotFoundError, IsADirectoryError) as exc:
        raise CLIError(str(exc)) from exc
    for problem in run.problems:
        print(f"warning: {problem}", file=sys.stderr)
    return run


def state_temperature_option(run, args, path: str) -> None:
    """``--temperature T`` of ``info`` / ``diagnose``: the mode of a run that does not record it
    (:func:`ddtree_lab.io.decoding_mode.state_temperature`); refused for a run that records its
    parameters or a file temperature that differs."""
    t = getattr(args, "temperature", None)
    if t is None:
        return
    from ..io.decoding_mode import state_temperature

    try:
        state_temperature(run, t)
    except ValueError as exc:
        raise CLIError(f"{path}: {exc}") from exc


def check_bundle_dir(path: str) -> None:
    """A directory given as a bundle must hold bundle.safetensors."""
    if not (Path(path) / "bundle.safetensors").is_file():
        raise CLIError(f"{path}: is not a bundle (no bundle.safetensors in it)")


def check_out_file(path: str) -> None:
    """An output file path: not a directory, and its directory exists (checked before any work)."""
    p = Path(path)
    if p.is_dir():
        raise CLIError(f"{path}: is a directory (give a file name)")
    if p.parent.exists() and not p.parent.is_dir():
        raise CLIError(f"{path}: {p.parent} is a file, not a directory")
    if not p.parent.is_dir():
        raise CLIError(f"{path}: directory {p.parent} does not exist")


def inputs_of(args) -> tuple[tuple[str, str], ...]:
    """``(label, path)`` of every input the verb's command line names: the arguments the parser
    made with ``cli._input`` (``args._reads``: the positional source, ``--prompts``,
    ``--model`` ...), those given only. The label is the flag, or the positional's metavar."""
    out = []
    for label, dest in getattr(args, "_reads", ()):
        value = getattr(args, dest, None)
        for v in value if isinstance(value, list) else [value]:
            if v is not None and v != "default":
                out.append((label, str(v)))
    return tuple(out)


def input_files(path: str | Path) -> list[Path]:
    """The files an input path stands for: itself, and for an SGLang recording (given as
    ``NAME``, ``NAME.json`` or ``NAME.safetensors``) both ``NAME.json`` and ``NAME.safetensors``
    (and an append-only ``NAME.ddrec``). A directory (a bundle, a model) stands for itself:
    everything inside it is input."""
    p = Path(path)
    found = [p]
    if not p.exists() or kind_of(str(p)) == "recording":
        from ..sglang.recording import recording_paths

        found += [*recording_paths(p), Path(str(p) + ".ddrec")]
    return [f for f in found if f.exists()]


def _is_input(out: Path, inputs: tuple[tuple[str, str], ...]) -> tuple[str, str, Path] | None:
    """``(label, given path, input file)`` of the input that the existing file ``out`` is (the
    same file: symlinks and relative paths resolved, hard links by inode) or lies inside (an
    input directory), or None."""
    if not out.exists():
        return None
    real = out.resolve()
    for label, given in inputs:
        for f in input_files(given):
            try:
                same = os.path.samefile(out, f)
            except OSError:
                same = False
            if same or real == f.resolve() or (f.is_dir() and real.is_relative_to(f.resolve())):
                return label, given, f
    return None


def check_new_output(path: str | Path, force: bool, flag: str = "-o", files: tuple[str, ...] = (), *,
                     inputs: tuple[tuple[str, str], ...]) -> None:
    """Refuse to replace anything the user has (checked before any work, by every verb that writes):
    an existing output without ``force``, and one of the verb's own inputs always.

    Args:
        path: the output the verb writes: a file, or a directory when ``files`` is given.
        force: the verb's ``--force``: an existing output is replaced.
        flag: the option that named ``path`` (for the message).
        files: for a directory output, the names the verb writes inside it; only those count
            as existing output (an empty or unrelated directory is not replaced, only added to).
        inputs: ``(label, path)`` of the verb's inputs (:func:`inputs_of`); an output that is one
            of their files (:func:`input_files`: symlinks, relative paths, a recording's
            ``NAME.json`` + ``NAME.safetensors``) or lies inside an input directory is refused,
            ``--force`` or not.

    Raises:
        CLIError: the output (or one of ``files`` in it) is an input (naming the flag and the
            input); or it exists and ``force`` is off: the message names the path and
            ``--force``; or the parent directory does not exist or is not writable.
    """
    p = Path(path)
    for target in [p / name for name in files] if files else [p]:
        hit = _is_input(target, inputs)
        if hit is not None:
            label, given, f = hit
            what = "" if str(f) == given else f" ({f})"
            raise CLIError(f"{flag} {path}: is the verb's own input {label} {given}{what}; "
                           "give another output (an input is never written over, --force or not)")
    if files:
        if p.exists() and not p.is_dir():
            raise CLIError(f"{flag} {path}: is a file (give a directory)")
        there = [p / name for name in files if (p / name).exists()]
        if there and not force:
            raise CLIError(f"{flag} {path}: {there[0]} exists; pass --force to replace "
                           f"{'it' if len(there) == 1 else f'the {len(there)} files'} (nothing is replaced without it)")
        parent = p if p.is_dir() else p.parent
    else:
        if p.exists() and not force:
            raise CLIError(f"{flag} {path}: exists; pass --force to replace it (nothing is replaced without it)")
        parent = p.parent
    if parent.exists() and not parent.is_dir():
        raise CLIError(f"{flag} {path}: {parent} is a file, not a directory")
    if not parent.is_dir():
        raise CLIError(f"{flag} {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise CLIError(f"{flag} {path}: directory {parent} is not writable")
    try:  # os.access says yes to root everywhere; a file made and removed says what a write will meet
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as e:
        raise CLIError(f"{flag} {path}: directory {parent} is not writable ({e.strerror or e})") from None


def check_suffix(path: str, fmt: str, suffixes: tuple[str, ...]) -> None:
    if Path(path).suffix.lower() not in suffixes:
        raise CLIError(f"{path}: suffix {Path(path).suffix or '(none)'!r} does not match the format {fmt} "
                       f"(use {' or '.join(suffixes)})")


def select_steps(run, step: int | None, request: int | None, path: str) -> list:
    """The StepTraces matching --step / --request (all when neither is given).

    Raises:
        CLIError: the selection matches nothing (naming the requests / steps that exist).
    """
    steps = run.steps
    if step is not None:
        damaged = sorted((q, why) for (s, q), why in getattr(run, "left_out", {}).items()
                         if s == step and (request is None or q == request))
        if damaged:  # the step asked for is in range but was left out as damaged: say so and why
            q, why = damaged[0]
            keys = run.keys() if hasattr(run, "keys") else [(s.step, s.request) for s in steps]
            readable = sorted({s for s, r in keys if r == q})
            raise CLIError(f"{path}: step {step}, request {q} is damaged and was left out when the file was read "
                           f"({why.removeprefix(f'{path}: ')}); the readable steps of request {q}: "
                           f"{_spans(readable) or 'none'}")
    if run.source == "bundle" and run.steps:
        only = run.steps[0]
        if (step is not None and step != only.step) or (request is not None and request != only.request):
            raise CLIError(f"{path}: the bundle holds step {only.step} of request {only.request} only")
    # (step, request) of every record; an append-only run gives them from its index (nothing decoded)
    keys = run.keys() if hasattr(run, "keys") else [(s.step, s.request) for s in steps]
    chosen = list(range(len(keys)))
    if request is not None:
        reqs = sorted({q for _, q in keys})
        chosen = [i for i in chosen if keys[i][1] == request]
        if not chosen:
            raise CLIError(f"{path}: --request {request} does not exist (requests: {', '.join(map(str, reqs))})")
    if step is not None:
        have = sorted({keys[i][0] for i in chosen})
        chosen = [i for i in chosen if keys[i][0] == step]
        if not chosen:
            who = f"request {request}" if request is not None else "the trace"
            span = f"steps {have[0]}..{have[-1]}" if have else "no steps"
            raise CLIError(f"{path}: --step {step} is out of range for {who} ({span})")
    return steps if len(chosen) == len(keys) else [steps[i] for i in chosen]


def _spans(values: list[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0..2, 5, 7..8"``."""
    out, start = [], None
    for k, v in enumerate(values):
        if start is None:
            start = v
        if k + 1 == len(values) or values[k + 1] != v + 1:
            out.append(str(v) if v == start else f"{start}..{v}")
            start = None
    return ", ".join(out)


def check_bundle_selection(b, args, path: str) -> None:
    """--step / --request on a bundle must name the bundle's own step (or be left out)."""
    step = getattr(args, "step", None)
    request = getattr(args, "request", None)
    if step is not None and step != b.step.step:
        raise CLIError(f"{path}: the bundle holds step {b.step.step} (request {b.step.request}), not --step {step}")
    if request is not None and request != b.step.request:
        raise CLIError(f"{path}: the bundle holds request {b.step.request} (step {b.step.step}), "
                       f"not --request {request}")


def recording_step(rec, args, path: str) -> int | None:
    """The verify-call index chosen by --step on a recording (None: all)."""
    if getattr(args, "request", None) is not None:
        raise CLIError(f"{path}: a recording addresses verify calls by --step, not --request "
                       "(convert it with `ddtree-lab sglang convert` to address requests)")
    step = getattr(args, "step", None)
    if step is not None and not 0 <= step < len(rec.steps):
        raise CLIError(f"{path}: --step {step} does not exist (the recording has steps 0..{len(rec.steps) - 1})")
    return step


#: How the verbs that treat kinds apart (replay, doctor, audit) group the registered sources.
_KINDS = {"bundle": "bundle", "sglang recording": "recording", "sglang recording (append-only)": "recording"}


def kind_of(path: str) -> str:
    """``"bundle"``, ``"recording"`` (an SGLang recording, either file) or ``"trace"`` (every
    other source), from the registry of sources (:func:`ddtree_lab.io.source_of`). A path no
    source claims is a ``"trace"`` (a directory: a ``"bundle"``), so that opening it names the
    problem."""
    from ..io import source_of

    try:
        return _KINDS.get(source_of(path), "trace")
    except (OSError, ValueError):
        return "bundle" if Path(path).is_dir() else "trace"


def bundle_module():
    try:
        from ..io import bundle
    except ImportError as exc:
        raise CLIError(f"bundles need ddtree_lab.io.bundle, which this install lacks ({exc})") from exc
    return bundle


def sglang_module():
    """The SGLang interop package (imports sglang itself only to run its kernels)."""
    from .. import sglang as sg

    return sg


def find_step(run, step: int | None, request: int | None, path: str):
    """The Step of decoding step ``step`` of ``request`` (a source of one step, e.g. a bundle:
    that step when ``--step`` is left out)."""
    if step is None:
        if len(run.steps) == 1 and request in (None, run.steps[0].request):
            return run.steps[0]
        raise CLIError(f"{path}: --step is required")
    matches = select_steps(run, step, request, path)
    if len(matches) > 1:
        reqs = ", ".join(str(s.request) for s in matches)
        raise CLIError(f"{path}: step {step} exists for requests {reqs}: pass --request")
    return matches[0]


#: the outputs the verb has written whole so far (:func:`write_output`, :func:`wrote`): what
#: ``main`` names when Ctrl-C stops the verb (``ddtree-lab VERB: interrupted; written: ...``)
WRITTEN: list[str] = []


def wrote(path: str | Path) -> None:
    """Note that the output ``path`` is now written whole (named if the verb is interrupted later)."""
    WRITTEN.append(str(path))


def write_output(path: str | Path, data: str | bytes) -> None:
    """Write ``data`` to ``path`` atomically (a temporary file beside it, then ``os.replace``):
    a replaced file (``--force``) is never left half written, and an error or Ctrl-C on the way
    removes the temporary file. :func:`check_new_output` decides beforehand whether ``path`` may
    be replaced."""
    write_outputs({path: data})


def write_outputs(files: dict) -> None:
    """Write several outputs (``{path: str | bytes}``) all or nothing: each to a temporary file
    beside it, then every one renamed in turn; an error or Ctrl-C before the renames leaves no
    temporary file and no output touched.

    Raises:
        CLIError: a directory does not exist, or a file cannot be written (naming it).
    """
    tmps = []
    try:
        for path, data in files.items():
            p = Path(path)
            if not p.parent.exists():
                raise CLIError(f"{path}: directory {p.parent} does not exist")
            tmp = p.with_name(f".{p.name}.{os.getpid()}.partial")
            tmps.append(tmp)
            try:
                if isinstance(data, bytes):
                    tmp.write_bytes(data)
                else:
                    tmp.write_text(data, encoding="utf-8")
            except OSError as exc:
                raise CLIError(f"cannot write {path}: {exc.strerror or exc}") from exc
        for tmp, path in zip(tmps, files):
            try:
                os.replace(tmp, path)
            except OSError as exc:
                raise CLIError(f"cannot write {path}: {exc.strerror or exc}") from exc
            wrote(path)
    finally:  # on success each was renamed away; on an error or Ctrl-C none is left behind
        for tmp in tmps:
            tmp.unlink(missing_ok=True)


def thread_note(n: int | None) -> str:
    import torch

    if n is not None:
        torch.set_num_threads(n)
        return f"{n} (--threads)"
    from ..threads import configure_threads  # picks from cores, quota and load

    choice = configure_threads()
    return f"{torch.get_num_threads()} ({choice.reason})"


def lossy_note(steps) -> str:
    """``"LOSSY: threshold_acc=0.5 (3 of 8 steps)"`` for the lossy steps among ``steps``, or ``""``."""
    from ..views.model import lossy_mark

    lossy = [s for s in steps if s.lossy]
    if not lossy:
        return ""
    marks = "; ".join(sorted({lossy_mark(s.thresholds) for s in lossy}))
    return f"{marks} ({len(lossy)} of {count(len(steps), 'step')})"


def bars_off() -> bool:
    """Whether progress bars are off: standard error is not a terminal (``2>log``, a pipe), where
    a bar's carriage returns and escape codes would only litter the log; ``DDTREE_LAB_PROGRESS=1``
    keeps them on anyway (``0``: off on a terminal too)."""
    forced = os.environ.get("DDTREE_LAB_PROGRESS")
    if forced in ("0", "1"):
        return forced == "0"
    isatty = getattr(sys.stderr, "isatty", None)
    return not (callable(isatty) and isatty())


def quiet_libraries() -> None:
    """Turn the libraries' own bars off too (transformers' "Loading weights", huggingface_hub's)
    when :func:`bars_off`: the environment switch before they are imported, their switch after."""
    if not bars_off():
        return
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def progress(total: int, desc: str, unit: str = "step", quiet: bool = False):
    """A tqdm bar on standard error (standard output stays what the verb prints), for work
    that takes more than a couple of seconds; ``quiet`` turns it off, and so does a standard
    error that is not a terminal (:func:`bars_off`)."""
    from tqdm import tqdm

    class _Bar(tqdm):  # cleared (not left on its own line) when an error or Ctrl-C ends the work
        def __exit__(self, exc_type, exc_value, traceback):
            if exc_type is not None:
                self.leave = False
            return super().__exit__(exc_type, exc_value, traceback)

    return _Bar(total=total, desc=desc, unit=unit, file=sys.stderr, disable=quiet or bars_off(), leave=True,
                dynamic_ncols=True)


def load_model(spec: str | None, quiet: bool = False):
    """The target ``--model`` / ``--target`` names (None: none), loaded behind a progress line
    on standard error ("loading target ...", the seconds it took).

    Raises:
        CLIError: ``spec`` is neither ``"default"`` nor a model directory.
    """
    if spec is None:
        return None
    if spec != "default" and not Path(spec).is_dir():
        raise CLIError(f"--model {spec}: not 'default' and not a model directory")
    what = "the embedded SmolLM2-135M-Instruct" if spec == "default" else spec
    with progress(1, f"loading target {what}", unit="model", quiet=quiet) as bar:
        if spec == "default":
            from ..models import load_default_target

            target = load_default_target()
        else:
            from ..models import TargetModel

            target = TargetModel.from_pretrained(spec)
        bar.update()
    return target


def check_budget(flag: str, budget: int, given: str | None = None) -> None:
    """A draft-node budget B (``record --budget``, each of ``compare-policies --budgets``): in
    ``[1, MAX_BUDGET]`` (:data:`ddtree_lab.build.MAX_BUDGET`), by the one rule of every verb.

    Raises:
        CLIError: out of range: one line naming the flag (and ``given``, the whole option text
            where it holds several budgets).
    """
    from ..build import MAX_BUDGET

    if not 1 <= budget <= MAX_BUDGET:
        what = f"{flag} {given}: budget {budget}" if given is not None and given != str(budget) else f"{flag} {budget}"
        raise CLIError(f"{what}: must be in [1, {MAX_BUDGET}] (draft nodes per tree)")


def check_sampling_option(name: str, value, vocab: int | None = None) -> None:
    """One sampling option (``temperature``, ``top_k``, ``top_p``, ``min_p``) alone, by the rule
    of :class:`ddtree_lab.sampling.SamplingParams`; None (not given) passes.

    Raises:
        CLIError: the value breaks the rule: one line naming the flag and its value.
    """
    if value is None:
        return
    from ..sampling import SamplingParams

    try:
        why = SamplingParams(**{name: value}).problem(vocab)
    except (ValueError, TypeError) as exc:
        why = str(exc).removeprefix("SamplingParams: ")
    if why is not None:
        raise CLIError(f"--{name.replace('_', '-')} {value}: {why}")


def params_override(args, base):
    import dataclasses

    changes = {k: getattr(args, k) for k in ("temperature", "top_k", "top_p", "min_p")
               if getattr(args, k, None) is not None}
    return dataclasses.replace(base, **changes) if changes else base


def count(n: int, word: str) -> str:
    """``"1 step"``, ``"2 steps"``: a count with its noun in the right number."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"
