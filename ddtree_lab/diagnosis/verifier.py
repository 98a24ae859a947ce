"""Check: the verifier that ran, decision by decision against the target-only rule on the recorded rows and coins.

A recorded step holds what the verifier read (each node's probability in its parent's row,
the bonus row up to the drawn token, the coins) and what it decided. Re-walking the
target-only rule (:func:`ddtree_lab.replaying.replay_differences`) on those tests the verifier
that ran, not the lab's. Where it departs, each candidate rule is re-walked on the same
rows and coins, and the one reproducing every recorded decision and the bonus is named:
``min(1, p/q)`` with the drafter's marginals (``q`` from the tree's log-weights), a lossy
``threshold_acc`` (its feasible interval read off the recorded coins and masses), a final
coin equal to a walk coin, or (only the bonus differs and no coin explains it) a bonus drawn
from another row than its node's. That list is the **catalogue**; before it, rule inference
(:mod:`.inference`) fits every rule family to the request's decisions and names the best with
its parameter and its likelihood ratio against the target-only rule. The catalogue then
confirms it (both are said), or names what inference leaves unnamed; with ``catalogue=False``
inference alone names the rule. A departure no family explains stays "unknown", with the
decisions no family explains as :class:`~ddtree_lab.problems.Problem` s on the finding.
"""

from __future__ import annotations

import dataclasses

import torch

from ..faults import verify_p_over_q
from ..replaying import by_design_line, compare_outputs, replay_differences, stored_rows
from ..step import Run, Step
from ..verify import verify_sampled
from ..verify.walking import children_of
from .common import CheckResult, Finding, engine_by_design, engine_emitted, group_findings, next_command
from .inference import RuleInference, infer_rule, threshold_interval

__all__ = ["check_verifier", "verifier_step", "engine_finding"]


def _same(step: Step, out) -> bool:
    if out is None:
        return False
    if step.output is None:
        raise ValueError(f"step {step.step}, request {step.request}: no verify output recorded to compare with")
    return not compare_outputs(step.output, out, None)


def _try(fn):
    try:
        return fn()
    except ValueError:  # a candidate walk that reaches a row the step does not store
        return None


def _walk_follows_rule(step: Step) -> bool:
    """Whether every recorded decision is the target-only rule's verdict on its own recorded
    numbers (``p`` = the stored child probability, ``S_k`` its float32 running sum, the coin
    of the parent), stopping at the first accept."""
    import numpy as np

    from ..verify.rules import accepts

    cp, coins = step.child_probs, step.coins
    assert cp is not None and coins is not None  # verifier_step checks both first
    mass, parent = 0.0, None
    for d in step.decisions:
        if d.parent != parent:
            mass, parent = 0.0, d.parent
        mass = float(np.float32(mass + d.target_prob))
        if d.coin is None or float(coins[d.parent]) != d.coin or d.target_prob != float(cp[d.node]):
            return False
        want = "accept" if (accepts(d.target_prob, mass, d.coin, 1.0, 1.0) or d.cumulative_mass == 1.0) else "reject"
        if d.verdict != want or (d.cumulative_mass != mass and d.cumulative_mass != 1.0):
            return False
    return True


def _bonus_coins(step: Step) -> tuple[bool, list[int], bool]:
    """``(the final coin draws the bonus, walk nodes whose coin draws it, the bonus has zero
    residual probability in its node's row)`` from the stored row prefix and residual mass."""
    b, prefix, final_mass, coins = step.bonus, step.final_row_prefix, step.final_mass, step.coins
    assert b is not None and coins is not None  # both callers check the bonus; verifier_step checks the coins
    t = b.token
    if t < 0 or prefix is None or prefix.shape[0] != t + 1 or final_mass is None:
        return False, [], False
    rejected = [d.token for d in step.decisions if d.parent == b.node and d.verdict == "reject"]
    r = prefix.double().clone()
    for tok in rejected:
        if tok <= t:
            r[tok] = 0.0
    if float(r[t]) <= 0.0:
        return False, [], True
    cum = r.cumsum(0)
    lo, hi = (float(cum[t - 1]) if t else 0.0), float(cum[t])

    def draws(c: float) -> bool:
        return lo <= c * final_mass < hi

    if step.final_coin is None:
        raise ValueError(f"step {step.step}, request {step.request}: the bonus {t} was drawn, but no final coin "
                         "was recorded")
    return draws(float(step.final_coin)), [i for i in range(step.num_nodes) if draws(float(coins[i]))], False


def _fast_ok(step: Step) -> bool:
    """The target-only walk checked on the recorded numbers alone (no row tensors): siblings
    judged in the buffers' order, each verdict the rule's on its own ``p``, ``S_k`` and coin,
    the walk moving to the accepted child, the bonus drawn at its end by the final coin from
    the stored prefix. True means the full replay would agree; False: run it."""
    if step.thresholds != (1.0, 1.0) or step.bonus is None or step.bonus.token < 0:
        return False
    vi = step.verify_input()  # step.retrieve_next_token / _sibling, or ValueError without buffers
    nt, ns = vi.retrieve_next_token[0].tolist(), vi.retrieve_next_sibling[0].tolist()
    decisions, k, cur = step.decisions, 0, 0
    while True:
        try:
            kids = children_of(step.request, nt, ns, cur, step.num_nodes)
        except ValueError:  # a cycle: the full replay says what is wrong
            return False
        if not kids:
            break
        mine = []
        while k < len(decisions) and decisions[k].parent == cur:
            mine.append(decisions[k])
            k += 1
        if [d.node for d in mine] != kids[: len(mine)] or not mine:
            return False
        if any(d.verdict != "reject" for d in mine[:-1]):
            return False
        if mine[-1].verdict == "accept":
            cur = mine[-1].node
            continue
        if len(mine) != len(kids):
            return False
        break
    if k != len(decisions) or step.bonus.node != cur or not _walk_follows_rule(step):
        return False
    ok, _, _ = _bonus_coins(step)
    return ok and _bonus_prob_follows_rows(step)


def _bonus_prob_follows_rows(step: Step) -> bool:
    """Whether the bonus's recorded ``token_prob`` is its residual probability in the stored
    row prefix (a verifier that drew from rows of its own logs that row's value)."""
    b, prefix, mass = step.bonus, step.final_row_prefix, step.final_mass
    if b is None or b.token_prob is None or prefix is None or mass is None or not mass > 0:
        return True  # nothing recorded to compare: _bonus_coins decided
    rejected = {d.token for d in step.decisions if d.parent == b.node and d.verdict == "reject"}
    want = 0.0 if b.token in rejected else float(prefix[b.token].double()) / mass
    return abs(float(b.token_prob) - want) <= 1e-6 + 1e-5 * abs(want)


def verifier_step(step: Step, vocab: int) -> tuple[list[str] | None, str | None, int | None, str] | None:
    """Diagnose one step: None when the recorded walk is the target-only rule's on its rows and
    coins, else ``(candidate faults reproducing it, a kind for none, node, evidence)``.

    Raises:
        ValueError: the step stores nothing to replay (level ``off``, no rows or coins).
    """
    if step.coins is None or step.child_probs is None:
        raise ValueError(f"step {step.step}, request {step.request}: recorded at level {step.level!r}: no verify rows "
                         "to replay")
    if _fast_ok(step):
        return None
    out, diffs = replay_differences(step, vocab)
    if not diffs:
        return None
    first = diffs[0]
    where = f"decision log vs the target-only rule: {first.field}: recorded {first.recorded!r}, the rule gives " \
            f"{first.replayed!r}"
    if _walk_follows_rule(step) and step.bonus is not None:
        node = step.bonus.node
        ok, walk, zero = _bonus_coins(step)
        how = ("has zero residual probability in that node's row" if zero else
               f"is not the draw of that node's residual row with the final coin {step.final_coin:.6g}")
        text = f"every decision follows the target-only rule, but the bonus {step.bonus_token} at node {node} {how}"
        if walk and not ok:
            return ["verifier-final-coin-reuse"], None, node, text + f"; node {walk[0]}'s walk coin draws it"
        if not ok:
            return ["verifier-bonus-row"], None, node, text + ", and no walk coin draws it"
        return [], "the bonus draw departs from the rule (unknown cause)", node, where
    return None, "the verifier departs from the target-only rule (no known rule reproduces it)", first.node, where


def reproduces(step: Step, vocab: int, name: str, threshold_acc: float = 1.0) -> bool:
    """Whether the candidate rule ``name`` (``verifier-p-over-q``, or ``verifier-threshold`` at
    ``threshold_acc``) re-walked on the step's stored rows and coins gives its recorded output."""
    vi, rows = step.verify_input(), stored_rows(step, vocab)
    if step.coins is None:
        raise ValueError(f"step {step.step}, request {step.request}: no walk coins recorded")
    coins = step.coins[None].float()
    final = torch.tensor([0.0 if step.final_coin is None else step.final_coin], dtype=torch.float32)
    mass = [step.final_mass if step.final_row_prefix is not None and step.final_row_prefix.numel() else None]
    if name == "verifier-p-over-q":
        logws = step.node_logws
        if logws is None:
            raise ValueError(f"step {step.step}, request {step.request}: no tree recorded (node_logws)")
        out = _try(lambda: verify_p_over_q(vi, lambda b, i: rows[b, i], logws[None], coins, final, mass))
    else:
        out = _try(lambda: verify_sampled(vi, rows, coins, final, final_masses=mass, threshold_acc=threshold_acc))
    return _same(step, out)


_KINDS = {
    "verifier-p-over-q": ("the verifier accepts with min(1, p/q) using the drafter's marginals q (biased on a top-k "
                          "tree; the target-only rule is the lossless one)", "high"),
    "verifier-threshold": ("the verifier runs a lossy acceptance threshold the output reports as exact", "high"),
    "verifier-final-coin-reuse": ("the bonus was drawn with a walk coin, not the recorded final coin", "high"),
    "verifier-bonus-row": ("the bonus token is not drawn from its node's row (another node's row, e.g. the "
                           "parent's)", "medium"),
}


def engine_finding(step: Step):
    """For a step converted from an engine's recording (an SGLang recording: its ``output`` is
    the lab's walk on the recorded rows and coins, the engine's own in ``extra``): None when the
    engine's output is the rule's, a :class:`Finding` when it is not; False for any other step."""
    emitted = engine_emitted(step)
    if emitted is None:
        return False
    extra = step.extra
    if extra.get("verdict") == "agrees":
        return None
    diffs = extra.get("differences") or []
    why = (extra.get("explanation") or "").strip()
    evidence = (f"SGLang emitted {emitted} (accept length {extra.get('sglang_accept_length')}), the "
                f"target-only rule on the same recorded rows and coins emits {step.emitted}"
                + (f"; {diffs[0]}" if diffs else "") + (f"; {why}" if why else ""))
    return Finding("verifier", "SGLang's verify kernel departs from the target-only rule on its own recorded rows and "
                   "coins", None, step.step, step.request, None, evidence, "high",
                   f"ddtree-lab replay RUN --step {step.step}  # SGLang's call {extra.get('call')}, row "
                   f"{extra.get('row')}, against the lab's walk (on the SGLang recording)")


def check_verifier(run: Run, steps: list[Step] | None = None, catalogue: bool = True) -> CheckResult:
    """The verifier that ran, on every step that stores its rows, coins and decisions
    (:func:`verifier_step`); one finding per kind and request (first step, count).

    Where a sampled request's walk departs from the target-only rule, rule inference
    (:func:`~ddtree_lab.diagnosis.inference.infer_rule`) fits the rule families to all its
    steps; ``catalogue`` (default True) also re-walks the catalogue's candidate rules (module
    docstring) to confirm or name the rule; False: inference alone names it.
    """
    steps = run.steps if steps is None else steps
    result = CheckResult("verifier", ran=False)
    found, skipped, bounds, ok_steps, thresholds, found_engine = [], [], {}, [], {}, []

    def vocab_of(s):  # the replay reads no token past the largest one the step stores (rows stay small)
        return max(int(s.node_token_ids.max()) + 1, s.final_row_prefix.shape[0])
    for s in steps:
        design = engine_by_design(s)
        if design:  # documented, not a bug: said in the one wording, not a finding
            result.checked += 1
            result.by_design.append(by_design_line(
                f"step {s.step}, request {s.request}",
                f"SGLang emitted {engine_emitted(s)}, the target-only rule on the same recorded rows and coins emits "
                f"{s.emitted}: {design}"))
            continue
        engine = engine_finding(s)
        if engine is not False:  # an engine's recording: its own output against the rule
            result.checked += 1
            if engine is not None:
                result.per_step[(s.step, s.request)] = "unknown"
                found_engine.append(engine)
            continue
        if s.output is None or s.buffers is None or s.rows is None or s.coins is None or s.rows.cannot("replay"):
            skipped.append(s)
            continue
        try:
            got = verifier_step(s, vocab_of(s))
        except ValueError as exc:
            skipped.append(s)
            where = f"step {s.step}, request {s.request}: "
            result.note = str(exc) if str(exc).startswith(where) else where + str(exc)
            continue
        result.checked += 1
        lo, hi = threshold_interval(s.decisions)
        a, b = bounds.get(s.request, (0.0, float("inf")))
        bounds[s.request] = (max(a, lo), min(b, hi))
        if got is not None:
            if not catalogue and got[0]:  # a bonus-side catalogue name: left to inference
                got = (None, "the verifier departs from the target-only rule", got[2], got[3])
            found.append((s, got))
        else:
            ok_steps.append(s)
    # one rule for the whole request: a candidate must reproduce every step of it whose walk
    # departs or agrees (a threshold is one constant, admitted by every step's decisions)
    common: dict[int, list[str]] = {}
    inferred: dict[int, RuleInference] = {}
    for r in sorted({s.request for s, _ in found}):
        mine = [s for s in ok_steps if s.request == r] + [s for s, _ in found if s.request == r]
        sampled = [s for s in mine if s.params is not None and not s.params.is_greedy]
        if sampled:
            inferred[r] = infer_rule(sorted(sampled, key=lambda s: s.step), run.vocab_size or max(map(vocab_of, sampled)))
        if not catalogue or not any(n is None for s, (n, _, _, _) in found if s.request == r):
            continue
        a, b = bounds[r]
        # a threshold inside the feasible interval, not on its edge: at the edge u == S / t and
        # float rounding decides the verdict
        cands = [("verifier-p-over-q", 1.0)] + ([("verifier-threshold", (a + b) / 2)] if a < b < 1.0 else [])
        common[r] = [name for name, t in cands if all(reproduces(s, vocab_of(s), name, t) for s in mine)]
        if "verifier-threshold" in common[r]:
            thresholds[r] = (a, b)
    findings = []
    for s, (names, unknown, node, evidence) in found:
        pick = names if names is not None else common.get(s.request, [])
        inf = inferred.get(s.request)
        fault, kind, sure, problems = _name(s, pick, unknown, inf, thresholds)
        if inf is not None:
            evidence += _inference_evidence(s, inf)
        if len(pick) == 1 and (fault is None or fault == pick[0]):
            if pick[0] == "verifier-threshold":
                a, b = thresholds[s.request]
                evidence += (f"; the catalogue: SGLang's rule u <= S/t with t in ({a:.3g}, {b:.3g}] (admitted by every "
                             "step) reproduces every step of the request")
            elif pick[0] == "verifier-p-over-q":
                evidence += "; the catalogue: the p/q rule reproduces every step of the request"
            else:
                evidence += f"; the catalogue: {pick[0]}"
        named = (f"rule:{inf.best.family.name}" if inf is not None and inf.best is not None and inf.explains
                 and not inf.tied else None)
        result.per_step[(s.step, s.request)] = fault or named or "unknown"
        findings.append(Finding("verifier", kind, fault, s.step, s.request, node, evidence, sure,
                                next_command("verifier", s.step, s.request), problems=tuple(problems)))
    found = findings + _engine_inference(run, steps, found_engine)
    result.ran = result.checked > 0
    if not result.ran:
        result.why = (f"no step stores the verify rows, coins and decisions ({len(skipped)} step(s) without them: "
                      "level off, or a source without rows)")
    elif skipped:
        result.note = (result.note + "; " if result.note else "") + f"{len(skipped)} step(s) without rows not checked"
    if not catalogue:
        result.note = (result.note + "; " if result.note else "") + "catalogue off: rules named by inference alone"
    result.findings = group_findings(found)
    return result


def _engine_inference(run: Run, steps: list[Step], found: list[Finding]) -> list[Finding]:
    """Rule inference on an engine's own walk (an SGLang recording): for each sampled request
    with a departing step, the families are fitted to the verdicts and bonus tokens the engine
    emitted on all its converted steps (:func:`~ddtree_lab.diagnosis.inference.engine_walk`), and
    the finding gets the inference's figures; a request whose tokens leave the tree says so."""
    out = []
    done: dict[int | None, RuleInference | str] = {}

    def vocab_of(s: Step) -> int:
        tokens = s.node_token_ids
        return int(tokens.max()) + 1 if tokens is not None else 0

    for f in found:
        if f.request not in done:
            mine = sorted((s for s in steps if s.request == f.request and engine_emitted(s) is not None
                           and s.params is not None and not s.params.is_greedy and s.coins is not None
                           and s.child_probs is not None), key=lambda s: s.step)
            if not mine:
                done[f.request] = "rule inference: not run (no sampled step of the request stores its coins and rows)"
            else:
                try:
                    done[f.request] = infer_rule(mine, run.vocab_size or max(map(vocab_of, mine)), engine=True)
                except ValueError as exc:
                    done[f.request] = f"rule inference: not run ({exc})"
        inf = done[f.request]
        step = next((s for s in steps if s.step == f.step and s.request == f.request), None)
        if isinstance(inf, str) or step is None:
            extra = f"; {inf}" if isinstance(inf, str) else ""
        else:
            extra = _inference_evidence(step, inf).replace("; rule inference:", "; rule inference on SGLang's own verdicts:", 1)
        out.append(dataclasses.replace(f, evidence=f.evidence + extra))
    return out


def _name(step: Step, pick: list[str], unknown: str | None, inf: RuleInference | None, thresholds) -> tuple:
    """``(fault, kind, sure, problems)`` of a departing step from the catalogue's ``pick`` and
    the request's rule inference."""
    problems = [] if inf is None else [p for p in inf.unexplained if p.step == step.step]
    best = None if inf is None else inf.best
    if best is not None and inf is not None and inf.tied and inf.explains:
        names = " or ".join(f.describe(step.params) for f in [best] + inf.tied)
        if len(pick) == 1:
            return pick[0], _KINDS[pick[0]][0], _KINDS[pick[0]][1], problems
        return None, f"the verifier follows one of: {names} (rule inference cannot tell them apart here)", "medium", \
            problems
    if best is not None and inf is not None and inf.explains:
        fault = best.family.fault
        if best.family.name == "temperature" and fault is None:
            t = best.parameter or 0.0
            fault = "verifier-temperature-1" if abs(t - 1.0) <= 0.05 else None
        elif fault is None and len(pick) == 1:
            # a family with no catalogue name of its own; a catalogue pick is not asked to override a
            # family that explains every field (the bonus judged on the family's rows, not the request's)
            fault = pick[0]
        return fault, best.describe(step.params), "high", problems
    if len(pick) == 1:
        return pick[0], _KINDS[pick[0]][0], _KINDS[pick[0]][1], problems
    if best is not None:
        kind = (f"the verifier departs from the target-only rule; closest rule family: {best.describe(step.params)} "
                f"({best.slips} recorded field(s) it does not predict)")
        return None, kind, "medium", problems
    if pick:
        return None, "the verifier follows " + " or ".join(pick), "medium", problems
    if inf is not None:
        return None, "the verifier departs from the target-only rule (no rule family explains its decisions)", \
            "medium", problems
    return None, unknown or "the verifier departs from the target-only rule (no known rule reproduces it)", "medium", \
        problems


def _inference_evidence(step: Step, inf: RuleInference) -> str:
    """The inference's figures for a finding: the family, its likelihood ratio, what is unexplained."""
    if inf.best is not None:
        out = (f"; rule inference: {inf.best.describe(step.params)}, log-likelihood ratio {inf.llr:.1f} against the "
               f"target-only rule over the request's {inf.best.observations} recorded fields ({inf.best.slips} not "
               f"predicted, {inf.best.undecided} undecided)")
    else:
        runner = inf.fits[0] if inf.fits else None
        out = ("; rule inference: no rule family beats the target-only rule by a likelihood ratio of 100"
               + (f" (closest: {runner.family.name}, ratio e^{runner.score - inf.baseline.loglik:.1f})" if runner else ""))
    mine = [p for p in inf.unexplained if p.step == step.step]
    if mine:
        out += "; unexplained: " + "; ".join(f"node {p.node} {p.field} recorded {p.value!r}, the rule gives {p.limit!r}"
                                            for p in mine[:3]) + (f" (+{len(mine) - 3} more)" if len(mine) > 3 else "")
    if inf.not_tried:
        out += "; not tried: " + "; ".join(inf.not_tried)
    return out
