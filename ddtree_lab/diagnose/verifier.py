"""Check: the verifier that ran, decision by decision against the target-only rule on the recorded rows and coins.

A recorded step holds what the verifier read (each node's probability in its parent's row,
the bonus row up to the drawn token, the coins) and what it decided. Re-walking the
target-only rule (:func:`ddtree_lab.replay.replay_differences`) on those tests the verifier
that ran, not the lab's. Where it departs, each candidate rule is re-walked on the same
rows and coins, and the one reproducing every recorded decision and the bonus is named:
``min(1, p/q)`` with the drafter's marginals (``q`` from the tree's log-weights), a lossy
``threshold_acc`` (its feasible interval read off the recorded coins and masses), a final
coin equal to a walk coin, or (only the bonus differs and no coin explains it) a bonus drawn
from another row than its node's.
"""

from __future__ import annotations

import torch

from ..faults import verify_p_over_q
from ..replay import compare_outputs, replay_differences
from ..step import Run, Step
from ..verify import verify_sampled
from .common import CheckResult, Finding, group_findings, next_command

__all__ = ["check_verifier", "verifier_step"]


def _rows(step: Step, vocab: int) -> torch.Tensor:
    """``[1, n, V]`` float32 holding exactly what the step stores (child probabilities in their
    parents' rows, the bonus row prefix)."""
    n = step.num_nodes
    rows = torch.zeros(1, n, vocab, dtype=torch.float32)
    prefix = step.final_row_prefix
    if prefix is not None and prefix.numel() and step.bonus is not None:
        rows[0, step.bonus.node, : prefix.shape[0]] = prefix
    known = ~torch.isnan(step.child_probs)
    known[0] = False
    idx = known.nonzero()[:, 0]
    rows[0, step.parents[idx], step.node_token_ids[idx]] = step.child_probs[idx]
    return rows


def _same(step: Step, out) -> bool:
    return out is not None and not compare_outputs(step.output, out, None)


def _try(fn):
    try:
        return fn()
    except ValueError:  # a candidate walk that reaches a row the step does not store
        return None


def _threshold_interval(step: Step) -> tuple[float, float]:
    """Feasible ``threshold_acc`` of SGLang's rule ``u <= S / t`` from the recorded decisions."""
    lo, hi = 0.0, float("inf")
    for d in step.decisions:
        if d.coin is None or d.coin <= 0:
            continue
        r = d.cumulative_mass / d.coin
        if d.verdict == "accept":
            hi = min(hi, r)
        else:
            lo = max(lo, r)
    return lo, hi


def verifier_step(step: Step, vocab: int) -> tuple[str, str, str | None, int | None, str] | None:
    """Diagnose one step: None when the recorded walk is the target-only rule's on its rows and
    coins, else ``(kind, sure, fault, node, evidence)``.

    Raises:
        ValueError: the step stores nothing to replay (level ``off``, no rows or coins).
    """
    out, diffs = replay_differences(step, vocab)
    if not diffs:
        return None
    first = diffs[0]
    vi, rows = step.verify_input(), _rows(step, vocab)
    coins = step.coins[None].float()
    final = torch.tensor([0.0 if step.final_coin is None else step.final_coin], dtype=torch.float32)
    mass = [step.final_mass if step.final_row_prefix is not None and step.final_row_prefix.numel() else None]
    where = f"decision log vs the target-only rule: {first.field}: recorded {first.recorded!r}, the rule gives " \
            f"{first.replayed!r}"
    pq = _try(lambda: verify_p_over_q(vi, lambda b, i: rows[b, i], step.node_logws[None], coins, final, mass))
    if _same(step, pq):
        return ("the verifier accepts with min(1, p/q) using the drafter's marginals q (biased on a top-k tree; "
                "the target-only rule is the lossless one)", "high", "verifier-p-over-q", first.node,
                where + "; the p/q rule reproduces every decision and the bonus")
    lo, hi = _threshold_interval(step)
    if hi < 1.0 and lo < hi:
        t = hi
        lossy = _try(lambda: verify_sampled(vi, rows, coins, final, final_masses=mass, threshold_acc=t))
        if _same(step, lossy):
            return (f"the verifier runs a lossy acceptance threshold (threshold_acc in ({lo:.3g}, {hi:.3g}]) the "
                    "output reports as exact", "high", "verifier-threshold", first.node,
                    where + f"; SGLang's rule u <= S/{t:.3g} reproduces every decision")
    decisions_same = all(d.field.startswith(("bonus", "emitted", "bonus_token")) for d in diffs)
    if decisions_same and step.bonus is not None:
        node = step.bonus.node
        for i in range(step.num_nodes):
            c = torch.tensor([float(step.coins[i])], dtype=torch.float32)
            alt = _try(lambda: verify_sampled(vi, rows, coins, c, final_masses=mass))
            if _same(step, alt):
                return ("the final coin reuses a walk coin (the bonus was drawn with node %d's coin, not the "
                        "recorded final coin)" % i, "high", "verifier-final-coin-reuse", node,
                        where + f"; coin {float(step.coins[i]):.6g} reproduces the bonus")
        return ("the bonus token is not drawn from its node's row (the row of another node, e.g. the parent's)",
                "medium", "verifier-bonus-row", node,
                f"the accepted path and every decision follow the target-only rule, but the bonus {step.bonus_token} "
                f"is not the draw of node {node}'s residual row with the final coin {step.final_coin:.6g} "
                f"(that row gives {first.replayed!r}), and no walk coin gives it either")
    return ("the verifier departs from the target-only rule (no known rule reproduces it)", "medium", None,
            first.node, where)


def check_verifier(run: Run, steps: list[Step] | None = None) -> CheckResult:
    """The verifier that ran, on every step that stores its rows, coins and decisions
    (:func:`verifier_step`); one finding per kind and request (first step, count)."""
    steps = run.steps if steps is None else steps
    vocab = run.vocab_size
    result = CheckResult("verifier", ran=False)
    found, skipped = [], []
    for s in steps:
        if s.output is None or s.buffers is None or s.rows is None or s.coins is None or s.rows.cannot("replay"):
            skipped.append(s)
            continue
        try:
            got = verifier_step(s, vocab or max(int(s.node_token_ids.max()), s.final_row_prefix.shape[0]) + 1)
        except ValueError as exc:
            skipped.append(s)
            result.note = f"step {s.step}, request {s.request}: {exc}"
            continue
        result.checked += 1
        if got is None:
            continue
        kind, sure, fault, node, evidence = got
        result.per_step[(s.step, s.request)] = fault or "unknown"
        found.append(Finding("verifier", kind, fault, s.step, s.request, node, evidence, sure,
                             next_command("verifier", s.step, s.request)))
    result.ran = result.checked > 0
    if not result.ran:
        result.why = (f"no step stores the verify rows, coins and decisions ({len(skipped)} step(s) without them: "
                      "level off, or a source without rows)")
    elif skipped:
        result.note = (result.note + "; " if result.note else "") + f"{len(skipped)} step(s) without rows not checked"
    result.findings = group_findings(found)
    return result
