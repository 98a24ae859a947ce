"""Diagnosis of a recorded step or run: every check in one place, three views of it.

Every check returns fields, never text to parse: a broken invariant is a
:class:`~ddtree_lab.problems.Problem` (``kind``, ``step``, ``request``, ``node``, ``field``,
``value``, ``limit``, ``message``), a named bug is a :class:`Finding`. The three views:

* :func:`check` (:mod:`.invariants`): the fast invariants of one step (buffers, tree, rows,
  coins, outputs), as Problems;
* :func:`doctor`: :func:`check` on the chosen steps and, with the target model, one step's
  recorded rows against causal forwards (:mod:`.causal`), as Problems;
* :func:`diagnose`: the bug named, not the symptom; every check the run's contents allow, one
  module each:

  * ``record`` (:func:`check_record`): :func:`check` on every step;
  * ``verifier`` (:mod:`.verifier`): the verifier that ran, decision by decision, against the
    target-only rule on the recorded rows and coins, and which rule it follows instead (rule
    inference, :mod:`.inference`, confirmed by the catalogue of known rules unless
    ``catalogue=False``);
  * ``coins`` (:mod:`.coins`): coins in [0, 1), the final coin never a walk coin;
  * ``output-law`` (:mod:`.law`): the recorded outputs across steps against the exact law of a
    lossless verifier, bonus token included (statistical; reads no coin, no decision log);
  * ``sampling`` (:mod:`.sampling`): which transform of the stored raw logits the rows follow;
  * ``greedy`` (:mod:`.greedy`): greedy verdicts take the argmax of the stored raw logits;
  * ``drafter-hits`` (:mod:`.drafter`): the first-position hit rate against the model card;
  * ``engine-parameters`` (:mod:`ddtree_lab.diagnosis.engine`, vLLM recordings only): the
    per-position temperature / top-k / top-p vLLM's sampler applied against the request's;

  and, with a model (``model="default"``, a directory, or ``(target, drafter)``):

  * ``tree-forward`` (:mod:`.forward`): the first divergent step by bisection, then the mask /
    positions fault or the KV-commit fault that reproduces its rows;
  * ``drafter`` (:mod:`.drafter`): each draft against the drafter re-run on fresh features;
  * ``greedy-decoding`` (:mod:`.greedy`): greedy requests against plain greedy decoding (a run
    the lab did not record, e.g. DDTree reference traces: the requests whose file records, or
    whose user states, temperature 0).

  On a run whose steps record no sampling parameters, the mode checks say why from the
  temperature the file records or the user stated (:mod:`.mode`); an unknown mode is said once.

  A check that could not run says why (:class:`CheckResult`) and never counts as passing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..problems import Problem
from ..replaying import BY_DESIGN
from ..step import Run, Step
from .causal import RecordedRowsCheck, TreeLogitsCheck, check_recorded_rows, check_tree_logits
from .coins import check_coins
from .common import CheckResult, Finding
from .drafter import check_drafter_hits, check_drafter_inputs
from .forward import check_tree_forward
from .greedy import check_greedy, check_greedy_decoding
from .invariants import check
from .law import check_law, check_law_with_model
from .mode import MODE_UNKNOWN, explain_mode
from .sampling import check_sampling
from .verifier import check_verifier

__all__ = ["Problem", "check", "doctor", "Doctor", "diagnose", "Diagnosis", "Finding", "CheckResult", "check_record",
           "load_models", "RECORD_CHECKS", "MODEL_CHECKS", "check_tree_logits", "TreeLogitsCheck",
           "check_recorded_rows", "RecordedRowsCheck"]

RECORD_CHECKS = ("record", "verifier", "coins", "output-law", "sampling", "greedy", "drafter-hits")
MODEL_CHECKS = ("tree-forward", "drafter", "greedy-decoding")


@dataclass
class Diagnosis:
    """What :func:`diagnose` found: every check's :class:`CheckResult`, the findings, seconds."""

    results: list[CheckResult]
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)

    @property
    def findings(self) -> list[Finding]:
        return [f for r in self.results for f in r.findings]

    @property
    def by_design(self) -> list[str]:
        """The documented by-design differences of the engine the checks met (one line each,
        :func:`ddtree_lab.replaying.by_design_line`): said, never findings."""
        return [line for r in self.results for line in r.by_design]

    @property
    def faults(self) -> set[str]:
        """The planted-fault names the findings name."""
        return {f.fault for f in self.findings if f.fault}

    def text(self) -> str:
        """One line per finding, one per by-design difference (``BY DESIGN``), then one per check
        (ran and what it compared, or why not)."""
        lines = [f.line() for f in self.findings]
        lines += [f"BY DESIGN {r.check}: {line}" for r in self.results for line in r.by_design]
        unknown = [r.check for r in self.results if not r.ran and r.why == MODE_UNKNOWN]
        for r in self.results:
            if r.check not in unknown:
                lines.append(r.line())
            elif r.check == unknown[0]:  # the unknown mode said once, for every check it stops
                lines.append(f"could not run {', '.join(unknown)}: {MODE_UNKNOWN}")
        lines += [f"unreadable: {p}" for p in self.problems]
        n, design = len(self.findings), len(self.by_design)
        also = f" ({design} {BY_DESIGN}, not a finding)" if design else ""
        lines.append(f"{n} finding{'s' if n != 1 else ''}{also}; {sum(r.ran for r in self.results)} of "
                     f"{len(self.results)} checks ran ({self.seconds:.1f} s)")
        return "\n".join(lines)


def check_record(run: Run, steps=None) -> CheckResult:
    """:func:`check` on every step, as a diagnose check (the first problem of a step named)."""
    steps = run.steps if steps is None else steps
    result = CheckResult("record", ran=bool(steps), checked=len(steps))
    if not steps:
        result.why = "the run has no steps"
    rounding = 0
    for s in steps:
        problems = check(s)
        kept = [p for p in problems if not _float_rounding(p)]
        rounding += len(problems) - len(kept)
        problems = kept
        if problems:
            p = problems[0]
            kind = ("the buffers' positions are inconsistent with the depths" if p.field == "positions"
                    else f"the recorded step is inconsistent ({p.part})")
            result.per_step[(s.step, s.request)] = "unknown"
            result.findings.append(Finding("record", kind, None, s.step, s.request, p.node,
                                           f"{p.message} ({len(problems)} problem(s) in the step)", "high",
                                           f"ddtree-lab doctor RUN --step {s.step} --request {s.request}"))
    if rounding:
        result.note = (f"{rounding} row mass(es) above 1 by less than {ROUNDING_SLACK:g} (float32 rounding of a "
                       "softmax over the vocabulary), not counted")
    return result


#: A recorded mass above 1 by less than this is float32 rounding over a whole row, not a bug.
ROUNDING_SLACK = 1e-4


def _float_rounding(problem: Problem) -> bool:
    """A mass a little above 1 (``check``'s own slack is 1e-5): float32 rounding, not a bug."""
    return (problem.kind in ("children_mass", "residual_mass") and problem.value is not None
            and 1.0 < problem.value <= 1.0 + ROUNDING_SLACK)


@dataclass
class Doctor:
    """What :func:`doctor` found: ``checked`` steps, their invariant ``problems`` (:func:`check`)
    and, with a model, ``rows`` (:func:`check_recorded_rows` of one step)."""

    checked: int
    invariants: list[Problem]
    rows: RecordedRowsCheck | None = None

    @property
    def problems(self) -> list[Problem]:
        """Every problem: the invariants', then the model check's."""
        return self.invariants + (self.rows.problems if self.rows is not None else [])


def doctor(run: Run, steps: list[Step] | None = None, target=None, rows_step: Step | None = None,
           sample: int = 8, seed: int = 0) -> Doctor:
    """Check ``steps`` (default: every step of ``run``) and, with ``target``, one step's rows.

    :func:`check` runs on each step (fast, no model). With ``target`` (a
    :class:`ddtree_lab.models.TargetModel`), :func:`check_recorded_rows` compares ``sample``
    draft nodes (drawn with ``seed``) of ``rows_step`` (default: the first of ``steps``) with
    causal forwards of their parents' paths.

    Returns:
        :class:`Doctor` (its ``problems``: every :class:`~ddtree_lab.problems.Problem`).

    Raises:
        ValueError: ``target`` given and there is no step, or the run lacks the request's token ids.
    """
    steps = run.steps if steps is None else steps
    found = [p for s in steps for p in check(s)]
    rows = None
    if target is not None:
        if rows_step is None and not steps:
            raise ValueError("doctor: no step to compare with the model")
        rows = check_recorded_rows(target, run, rows_step if rows_step is not None else steps[0], sample=sample,
                                   seed=seed)
    return Doctor(len(steps), found, rows)


def load_models(model, run: Run):
    """``(target, drafter)`` for ``model``: ``"default"`` (the embedded target and the drafter the
    run names: ``dflash`` or ``ridge``), a local model directory (drafter None), or a
    ``(target, drafter)`` pair passed through.

    Raises:
        ValueError: anything else.
    """
    if isinstance(model, tuple) and len(model) == 2:
        return model
    if model == "default":
        from ..models.loading import load_default

        kind = (run.metadata.get("drafter") or {}).get("kind", "")
        return load_default(drafter="ridge" if "Ridge" in str(kind) else "dflash")
    if isinstance(model, str) and model:
        from pathlib import Path

        from ..models import TargetModel

        if not Path(model).is_dir():
            raise ValueError(f"--model must be 'default' or a model directory, got {model!r}")
        return TargetModel.from_pretrained(model), None
    raise ValueError(f"model must be 'default', a directory or (target, drafter), got {model!r}")


def diagnose(run: Run, model=None, step: int | None = None, request: int | None = None,
             confirm: bool = True, catalogue: bool = True, progress=None) -> Diagnosis:
    """Name the bugs of ``run``: every check it allows (module docstring), the findings gathered.

    Args:
        run: a :class:`ddtree_lab.Run` (``ddtree_lab.io.load(path)``).
        model: None (recorded data only), ``"default"``, a model directory, or ``(target, drafter)``.
        step, request: restrict the checks to one step and/or request (the model checks then
            re-run only those steps: no bisection).
        confirm: with a model, re-run a request under a named forward / commit fault to count
            the steps it reproduces.
        catalogue: the verifier check re-walks its catalogue of known rules to confirm (or
            name) the rule inference names; False: inference alone names it (and the
            output-law check's family law likewise stands alone).
        progress: None, or a callable given each check's name just before it runs (and
            ``"loading the model"`` before a model loads): :data:`RECORD_CHECKS` then, with a model,
            :data:`MODEL_CHECKS` (the CLI's progress bar).

    Returns:
        :class:`Diagnosis`.

    Raises:
        KeyError: ``step`` / ``request`` not in the run.
        ValueError: a bad ``model``.
    """
    t0 = time.perf_counter()
    steps = run.steps
    if request is not None:
        steps = [s for s in steps if s.request == request]
        if not steps:
            raise KeyError(f"request {request}: not in this run (requests: {sorted({s.request for s in run.steps})})")
    if step is not None:
        if request is not None:
            steps = [run.find_step(step, request)]
        else:
            steps = [s for s in steps if s.step == step]
            if not steps:
                raise KeyError(f"step {step}: not in this run")
    tick = progress if progress is not None else (lambda name: None)
    results = []
    def verifier(run: Run, steps: list[Step] | None) -> CheckResult:
        return check_verifier(run, steps, catalogue=catalogue)

    for name, check_of in zip(RECORD_CHECKS, (check_record, verifier, check_coins, check_law, check_sampling,
                                            check_greedy, check_drafter_hits)):
        tick(name)
        results.append(check_of(run, steps))
    if run.metadata.get("engine") == "vllm":  # a recording from inside vLLM also holds its sampler's parameters
        from .engine import check_engine_parameters

        tick("engine-parameters")
        results.append(check_engine_parameters(run, steps))
    if model is None:
        for name in MODEL_CHECKS:
            results.append(CheckResult(name, ran=False, why="needs the model (--model default or DIR)"))
    else:
        tick("loading the model")
        target, drafter = load_models(model, run)
        tick("tree-forward")
        results.append(check_tree_forward(run, target, steps, confirm=confirm))
        tick("drafter")
        if drafter is None:
            results.append(CheckResult("drafter", ran=False, why="no drafter for a model directory"))
        else:
            results.append(check_drafter_inputs(run, target, drafter, steps))
        tick("greedy-decoding")
        results.append(check_greedy_decoding(run, target) if step is None else
                       CheckResult("greedy-decoding", ran=False, why="compares whole requests (no --step)"))
        law = check_law_with_model(run, target, steps)  # a run without rows (DDTree reference): rows recomputed
        if law is not None:
            results = [law if r.check == "output-law" else r for r in results]
    _fold_consequences(results)
    explain_mode(results, run, steps)
    return Diagnosis(results, time.perf_counter() - t0, list(run.problems))


#: checks whose findings on a request follow from wrong sampling parameters in the engine's sampler
_FROM_PARAMETERS = ("record", "verifier", "coins", "output-law", "sampling", "greedy")


def _fold_parameters(results: list[CheckResult]) -> None:
    """Wrong sampling parameters in an engine's sampler (``engine-parameters``) change every row
    it reads: the other record checks' findings on those requests are their consequences, kept
    as a note on each check rather than more bugs."""
    engine = next((r for r in results if r.check == "engine-parameters" and r.findings), None)
    if engine is None:
        return
    hit = {request for (_, request) in engine.per_step}
    for r in results:
        if r.check not in _FROM_PARAMETERS or not r.findings:
            continue
        keep = [f for f in r.findings if not (f.request in hit or (f.request is None and hit))]
        folded = len(r.findings) - len(keep)
        if folded:
            r.findings = keep
            r.note = (r.note + "; " if r.note else "") + (
                f"{folded} finding(s) on requests whose sampler applied wrong parameters (engine-parameters): "
                "a consequence, not counted")


def _fold_consequences(results: list[CheckResult]) -> None:
    """A wrong tree forward or KV commit feeds the drafter wrong features from its step on: an
    unnamed drafter-input finding of that request at or after it is its consequence, kept as a
    note on the drafter check rather than a second bug. Wrong engine parameters likewise
    (:func:`_fold_parameters`)."""
    _fold_parameters(results)
    first = {f.request: f.step for r in results if r.check == "tree-forward" for f in r.findings}
    for r in results:
        if r.check != "drafter" or not first:
            continue
        keep, folded = [], 0
        for f in r.findings:
            start = first.get(f.request)  # tree-forward findings always name their step
            if f.fault is None and start is not None and f.step is not None and f.step >= start:
                folded += f.steps
            else:
                keep.append(f)
        if folded:
            r.findings = keep
            r.note = (r.note + "; " if r.note else "") + (f"{folded} step(s) whose draft differs after a tree-forward / "
                                                          "commit finding of the request (its features came from "
                                                          "that forward): a consequence, not counted")

