"""Check: coin invariants of each step (coins in [0, 1); the final coin never equals a walk coin).

The bonus draw must use a coin of its own: a walk coin that decided among the final node's
children is conditioned (``u >= S_K`` after a full rejection), so reusing it skews the bonus
law (:mod:`ddtree_lab.audit.faults`, ``coin-reuse``). A trace that records the coin used
passes a replay; only this invariant sees it. Two independent float32 uniforms are equal
with probability about ``2**-24`` per pair, so an exact match is a finding (sampled steps
only: a greedy step reads no coin, and engines record zeros there).
"""

from __future__ import annotations

from ..step import Run, Step
from .common import CheckResult, Finding, group_findings, next_command

__all__ = ["check_coins", "coins_step"]


def coins_step(step: Step) -> list[tuple[str, str | None, int | None, str]]:
    """The broken coin invariants of one step: ``(kind, fault, node, evidence)`` each."""
    if step.coins is None:
        raise ValueError(f"step {step.step}, request {step.request}: no walk coins recorded")
    out = []
    n = step.num_nodes
    coins = step.coins[:n].tolist()
    for i, u in enumerate(coins):
        if not 0.0 <= u < 1.0:
            out.append(("a walk coin outside [0, 1)", None, i, f"coin {u!r}"))
    f = step.final_coin
    if f is not None and not 0.0 <= f < 1.0:
        out.append(("the final coin outside [0, 1)", None, None, f"final coin {f!r}"))
    if f is not None and step.params is not None and not step.params.is_greedy:  # greedy reads no coin
        same = [i for i, u in enumerate(coins) if u == f]
        if same:
            i = same[0]
            used = {d.parent for d in step.decisions}
            how = "which decided among its children" if i in used else "(not used by the walk)"
            out.append(("the final coin reuses a walk coin", "verifier-final-coin-reuse", i,
                        f"final coin {f:.9g} == the coin of node {i} {how}"))
    return out


def check_coins(run: Run, steps: list[Step] | None = None) -> CheckResult:
    """:func:`coins_step` on every step that stores its coins and final coin."""
    steps = run.steps if steps is None else steps
    result = CheckResult("coins", ran=False)
    found = []
    for s in steps:
        if s.coins is None or s.final_coin is None or s.tree is None:
            continue
        result.checked += 1
        for kind, fault, node, evidence in coins_step(s):
            result.per_step.setdefault((s.step, s.request), fault or "unknown")
            found.append(Finding("coins", kind, fault, s.step, s.request, node, evidence, "high",
                                 next_command("coins", s.step, s.request)))
    result.ran = result.checked > 0
    if not result.ran:
        result.why = "no step stores its walk coins and final coin"
    result.findings = group_findings(found)
    return result
