"""Why the mode-dependent checks could not run on a run the lab did not record: greedy, sampled, or unknown.

The ``greedy``, ``sampling`` and ``output-law`` checks (and, with a model,
``greedy-decoding``) pick their steps by each step's recorded sampling parameters. A run read
from the DDTree reference's traces records none, so without this each of them said "the run has
no greedy step" / "no sampled step" at once. Here their reasons are rewritten from the
temperature the file records or the user stated (:mod:`ddtree_lab.io.decoding_mode`): the mode,
where it came from and what the file lacks for the check; an unknown mode is said once
(:data:`MODE_UNKNOWN`, one line for every check it stops: :meth:`Diagnosis.text
<ddtree_lab.diagnosis.Diagnosis.text>`).
"""

from __future__ import annotations

from ..io.decoding_mode import mode_of, records_parameters, request_temperatures
from ..step import Run, Step
from .common import CheckResult

__all__ = ["MODE_CHECKS", "MODE_UNKNOWN", "explain_mode"]

#: The checks that need to know greedy from sampled.
MODE_CHECKS = ("output-law", "sampling", "greedy", "greedy-decoding")

#: The reason of every mode check on a run whose mode is unknown (printed once).
MODE_UNKNOWN = ("greedy or sampled is unknown: the file records no temperature (state it: --temperature T, "
                "0 = greedy, > 0 = sampled; in Python ddtree_lab.io.decoding_mode.state_temperature)")


def _modes(run: Run, steps: list[Step]) -> dict[str, list[tuple[int, float | None, str]]]:
    wanted = {s.request for s in steps}
    out: dict[str, list[tuple[int, float | None, str]]] = {}
    for req, t, where in request_temperatures(run):
        if req in wanted:
            out.setdefault(mode_of(t), []).append((req, t, where))
    return out


def _said(entries: list[tuple[int, float | None, str]], mode: str, every: bool) -> str:
    temps = sorted({t for _, t, _ in entries if t is not None})
    wheres = sorted({w for _, _, w in entries})
    who = "the run is" if every else f"request{'s' if len(entries) > 1 else ''} " \
        f"{', '.join(str(r) for r, _, _ in entries)} {'are' if len(entries) > 1 else 'is'}"
    return f"{who} {mode} (temperature {', '.join(f'{t:g}' for t in temps)}, {'; '.join(wheres)})"


def explain_mode(results: list[CheckResult], run: Run, steps: list[Step]) -> None:
    """Rewrite (in place) the reason of each mode check of ``results`` that did not run, for a
    run whose steps record no sampling parameters; a run that records them is left alone."""
    if records_parameters(run) or not steps:
        return
    modes = _modes(run, steps)
    every = len(modes) == 1
    greedy, sampled, unknown = modes.get("greedy", []), modes.get("sampled", []), modes.get("unknown", [])
    reasons: dict[str, str]
    if unknown and not greedy and not sampled or not modes:
        reasons = dict.fromkeys(MODE_CHECKS, MODE_UNKNOWN)
    else:
        g = _said(greedy, "greedy", every) if greedy else ""
        s = _said(sampled, "sampled", every) if sampled else ""
        u = (f"; request{'s' if len(unknown) > 1 else ''} {', '.join(str(r) for r, _, _ in unknown)}: "
             f"{MODE_UNKNOWN}") if unknown else ""
        reasons = {
            "greedy": (f"{g}, but the file records no target logits to check its verdicts against (with --model, "
                       "greedy-decoding compares its tokens with plain greedy decoding)" if g else f"{s}: no greedy step")
            + u,
            "sampling": (f"{s}, but the file records no raw logits (the check reads the top-M logits of level full)"
                         if s else f"{g}: no sampled step") + u,
            "output-law": (f"{s}, but the file records no target rows (the law is computed from them; "
                           "with --model the target recomputes them)" if s else f"{g}: greedy steps follow a point law (the greedy checks)") + u,
            "greedy-decoding": (f"{s}: only greedy requests are compared with plain greedy decoding" if not g
                                else "") + u,
        }
    for r in results:
        if r.check in reasons and not r.ran and reasons[r.check] and not r.why.startswith(("needs the model", "with the model")):
            r.why = reasons[r.check]
