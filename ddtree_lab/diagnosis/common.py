"""What every diagnose check returns: findings (bug kind, evidence, certainty, next command) and its status."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..step import Step

__all__ = ["Finding", "CheckResult", "SURE", "next_command", "group_findings", "engine_emitted", "outcome",
           "engine_by_design"]

#: How sure a finding is: ``high`` (a named fault reproduces the recorded data exactly),
#: ``medium`` (an invariant of the rule is broken, the cause is one of a few), ``low`` (a
#: statistical sign).
SURE = ("high", "medium", "low")


@dataclass(frozen=True)
class Finding:
    """One bug found in a run.

    Attributes:
        check: the check that found it (``verifier``, ``coins``, ``sampling``, ``greedy``,
            ``tree-forward``, ``commit``, ``drafter``, ``record``).
        kind: the bug kind in plain words (e.g. "the tree mask shows earlier siblings").
        fault: the planted-fault name (:data:`ddtree_lab.faults.FAULT_KINDS`) the finding names,
            or None for a kind without one ("unknown mask/positions fault").
        step, request, node: where (None where it does not apply).
        evidence: the numbers, in words.
        sure: one of :data:`SURE`.
        next: the command (or notebook cell) to look closer.
        steps: how many steps show it (the first is ``step``).
        problems: the recorded fields behind it, as :class:`~ddtree_lab.problems.Problem` s
            (e.g. the decisions no verifier rule family explains), or empty.
    """

    check: str
    kind: str
    fault: str | None
    step: int | None
    request: int | None
    node: int | None
    evidence: str
    sure: str
    next: str = ""
    steps: int = 1
    problems: tuple = ()

    def line(self) -> str:
        at = [f"step {self.step}" if self.step is not None else None,
              f"request {self.request}" if self.request is not None else None,
              f"node {self.node}" if self.node is not None else None]
        where = ", ".join(a for a in at if a)
        more = f" (and {self.steps - 1} more step{'s' if self.steps != 2 else ''})" if self.steps > 1 else ""
        name = f" [{self.fault}]" if self.fault else ""
        nxt = f"; next: {self.next}" if self.next else ""
        return f"FINDING {self.check}: {self.kind}{name} at {where or 'the run'}{more}: {self.evidence}; " \
               f"sure: {self.sure}{nxt}"


@dataclass
class CheckResult:
    """What one check did: ``ran`` (it compared ``checked`` items), or not (``why``: it could
    not run, which never counts as passing), ``not_run`` (the part of it that could not run),
    and its findings."""

    check: str
    ran: bool
    checked: int = 0
    why: str = ""
    findings: list[Finding] = field(default_factory=list)
    note: str = ""
    per_step: dict = field(default_factory=dict)  # (step, request) -> the fault name or kind found there
    not_run: str = ""  # the part of the check that could not run (it never counts as passing)
    #: documented by-design differences of the engine (:func:`engine_by_design`), one line each in the
    #: wording of :func:`ddtree_lab.replaying.by_design_line`: said, never counted as findings
    by_design: list[str] = field(default_factory=list)

    def line(self) -> str:
        if not self.ran:
            return f"could not run {self.check}: {self.why}"
        if self.findings:
            return (f"{self.check}: {len(self.findings)} finding(s) over {self.checked} item(s){self.note_text()}"
                    + (f"; not run: {self.not_run}" if self.not_run else ""))
        if self.not_run:
            return (f"ran part of {self.check}: {self.checked} item(s), nothing found{self.note_text()}; not run: "
                    f"{self.not_run}")
        return f"passed {self.check}: {self.checked} item(s), nothing found{self.note_text()}"

    def note_text(self) -> str:
        """The note in parentheses (by-design differences counted first), or "" when there is none."""
        from ..replaying import BY_DESIGN

        design = f"{len(self.by_design)} {BY_DESIGN}, not a finding" if self.by_design else ""
        note = "; ".join(n for n in (design, self.note) if n)
        return f" ({note})" if note else ""


def next_command(kind: str, step: int | None, request: int | None) -> str:
    """The command to look at a finding closer: ``render`` of the step's tree (with the
    decision log), or ``bundle`` for a verifier finding."""
    if step is None:
        return "open labs/08_bug_zoo.ipynb (the zoo: what each kind looks like)"
    where = f"--step {step}" + (f" --request {request}" if request is not None else "")
    if kind in ("verifier", "coins"):
        out = f"bug-s{step}" + (f"-r{request}" if request is not None else "")
        return f"ddtree-lab render RUN {where} --format decisions; ddtree-lab bundle RUN {where} -o {out}"
    return f"ddtree-lab render RUN {where} -o tree.svg"


def group_findings(per_step: list[Finding]) -> list[Finding]:
    """One finding per (check, kind, fault, request): the first step's, with ``steps`` the count."""
    out: dict[tuple, Finding] = {}
    count: dict[tuple, int] = {}
    for f in per_step:
        key = (f.check, f.kind, f.fault, f.request)
        count[key] = count.get(key, 0) + f.steps
        first = out.get(key)
        if first is None or (f.step is not None and first.step is not None and f.step < first.step):
            out[key] = f
    return [Finding(**{**f.__dict__, "steps": count[k]}) for k, f in out.items()]


def engine_emitted(step) -> list[int] | None:
    """The tokens the engine itself emitted at a step converted from its recording (an SGLang
    recording: the step's ``output`` is the lab's walk on the recorded inputs, SGLang's own
    output is in ``extra``), or None for a step whose output is the verifier's that ran."""
    extra = step.extra or {}
    if extra.get("source") != "sglang" or "sglang_emitted" not in extra:
        return None
    return list(extra["sglang_emitted"])


def engine_by_design(step) -> str:
    """The explanation of a step converted from an engine's recording whose engine output
    differs from the target-only rule by design (an SGLang recording: the replay's
    ``by_design``, e.g. SGLang's float32 ``u < S`` rejecting where exact arithmetic accepts at
    ``u ~ S``; docs/SGLANG.md), or ``""``. Traces converted before ``extra["by_design"]`` was
    kept: a differing step with an explanation (the only differing rows a conversion keeps
    with one)."""
    extra = step.extra or {}
    if engine_emitted(step) is None or extra.get("verdict") != "differs":
        return ""
    why = str(extra.get("explanation") or "").strip()
    return why if extra.get("by_design", bool(why)) else ""


def outcome(step: Step) -> tuple[list[int], int] | None:
    """``(accepted path of node indices, bonus token)`` the verifier that ran produced: the
    step's output, or for a step converted from an SGLang recording (whose ``output`` is the
    lab's walk) SGLang's emitted tokens followed down the tree; None when they leave it."""
    from ..verify.walking import children_of

    emitted = engine_emitted(step)
    if emitted is None:
        return (step.accepted_path or [0]), step.bonus_token
    if not emitted:
        return None
    next_token, next_sibling, node_token_ids = step.retrieve_next_token, step.retrieve_next_sibling, step.node_token_ids
    if next_token is None or next_sibling is None:
        raise ValueError(f"step {step.step}, request {step.request}: no verify buffers recorded to follow the engine's "
                         "emitted tokens down")
    if node_token_ids is None:
        raise ValueError(f"step {step.step}, request {step.request}: no tree recorded to follow the engine's emitted "
                         "tokens down")
    nt, ns, tokens = next_token.tolist(), next_sibling.tolist(), node_token_ids.tolist()
    path = [0]
    for t in emitted[:-1]:
        nxt = next((c for c in children_of(step.request, nt, ns, path[-1], step.num_nodes) if tokens[c] == t), None)
        if nxt is None:
            return None
        path.append(nxt)
    return path, emitted[-1]
