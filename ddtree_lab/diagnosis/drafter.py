"""Check: the drafter's input (anchor, mask slot, target features) from its recorded draft top-k, and its hit rate against its model card.

With a model: each step's draft is recomputed from a fresh causal forward of the committed
tokens (the target features the drafter should have had) and the recorded anchor, through the
drafter's own ``start`` / ``commit`` / ``draft_logits``; the recorded draft top-k log-probs must
match. Where they do not, the drafter is re-run with each candidate input fault
(:data:`ddtree_lab.faults.DRAFTER_FAULTS`: the token before the anchor, logits read one mask
slot early, zero features, every committed token given its step root's features) and the one
reproducing the recorded draft is named.

Without a model: the first-position hit rate (draft top-1 = the first emitted token) against
the model card's held-out ``top1_by_position[0]``; a one-sided binomial tail below
:data:`HIT_ALPHA` at half the card's rate is a low-certainty sign, never a name.
"""

from __future__ import annotations

import math

import torch

from ..faults import DRAFTER_FAULTS
from ..models.drafter import DraftContext
from ..step import DraftTopK, Run, Step
from .common import CheckResult, Finding, group_findings, next_command
from .forward import request_prefix

__all__ = ["check_drafter_inputs", "check_drafter_hits", "DRAFT_ATOL", "HIT_ALPHA"]

#: Max |recorded - recomputed draft log-prob| still counted equal (batched vs single drafting).
DRAFT_ATOL = 2e-2
#: Significance of the no-model hit-rate sign.
HIT_ALPHA = 1e-3


def _binom_cdf(k: int, n: int, p: float) -> float:
    return sum(math.comb(n, j) * p**j * (1 - p) ** (n - j) for j in range(k + 1))


def check_drafter_hits(run: Run, steps: list[Step] | None = None) -> CheckResult:
    """First-position hit rate of the recorded drafts against the drafter's model card."""
    steps = run.steps if steps is None else steps
    result = CheckResult("drafter-hits", ran=False)
    meta = run.metadata.get("drafter")
    meta = meta if isinstance(meta, dict) else {}
    problem = meta.get("record_problem")
    record = meta.get("record")
    card = record.get("held_out_eval") if isinstance(record, dict) else None
    rates = card.get("top1_by_position") if isinstance(card, dict) else None
    if not rates:
        result.why = ("the drafter's metadata has no model-card hit rates (held_out_eval.top1_by_position)"
                      + (f": {problem}" if problem else ""))
        return result
    p0 = rates[0] if isinstance(rates, list) else None
    if isinstance(p0, bool) or not isinstance(p0, (int, float)) or not 0.0 <= p0 <= 1.0:
        result.why = (f"the drafter's model card gives held_out_eval.top1_by_position[0] = {p0!r}, not a hit rate "
                      "in [0, 1]")
        return result
    hits = n = 0
    for s in steps:
        if s.draft_token_ids is None or s.draft_token_ids.numel() == 0 or s.output is None or not s.emitted:
            continue
        n += 1
        hits += int(int(s.draft_token_ids[0, 0]) == s.emitted[0])
    result.checked = n
    if n == 0:
        result.why = "no step stores its draft top-k and output"
        return result
    result.ran = True
    p0 = float(p0)
    tail = _binom_cdf(hits, n, p0 / 2)
    result.note = (f"first-position hit rate {hits}/{n} = {hits / n:.3f}, card {p0:.3f}; flagged only below half the "
                   f"card's rate at P < {HIT_ALPHA:g} (sampled steps and short runs hit less than the card)"
                   + (f"; the card is unchecked: {problem}" if problem else ""))
    if tail < HIT_ALPHA:
        result.findings.append(Finding(
            "drafter-hits", "the drafter hits far below its model card (wrong anchor, mask slot or missing target "
            "features are the usual causes)", None, None, None, None,
            f"first-position hit rate {hits}/{n} = {hits / n:.3f} against the card's {p0:.3f} (P <= {tail:.2g} at half "
            "the card's rate)", "low", "ddtree-lab diagnose RUN --model default  # names the input that is wrong"))
    return result


def _logprobs(logits: torch.Tensor, draft: DraftTopK) -> torch.Tensor:
    return torch.log_softmax(logits.float(), -1).gather(-1, draft.token_ids.long())


def check_drafter_inputs(run: Run, target, drafter, steps: list[Step] | None = None) -> CheckResult:
    """Every step's recorded draft against the drafter re-run on fresh target features
    (module docstring).

    Args:
        run: a run whose metadata holds each request's token ids.
        target, drafter: the models it was recorded with (the drafter's state is reset).
    """
    from ..models.dflash import target_features

    steps = run.steps if steps is None else steps
    result = CheckResult("drafter", ran=False)
    usable = [s for s in steps if s.draft_token_ids is not None and s.draft_token_ids.numel() and s.prefix_len is not None
              and s.tree is not None]
    if not usable:
        result.why = "no step stores its draft top-k and prefix length"
        return result
    layers = list(getattr(drafter, "target_layer_ids", None) or []) or None
    found = []
    for r in sorted({s.request for s in usable}):
        mine = sorted((s for s in usable if s.request == r), key=lambda s: s.step)
        try:
            ids = request_prefix(run, r)
        except ValueError as exc:  # e.g. a bundle or an SGLang recording without token ids
            result.note = (result.note + "; " if result.note else "") + str(exc)
            continue
        last = max(s.prefix_len for s in mine if s.prefix_len is not None)  # all of them (`usable`)
        if layers is None:
            _, feats, _ = target.prefill(ids[:last])
        else:
            feats = target_features(target, ids[:last], layers)
        drafter.start(3)  # slot 0: right features, 1: zeros, 2: stale (each step root's)
        have, prev = 0, None
        for s in mine:
            assert s.prefix_len is not None and s.draft is not None  # `usable` keeps only steps with both
            p: int = s.prefix_len  # declared: the closures below read them
            draft: DraftTopK = s.draft
            chunk = feats[have:p]
            drafter.commit(0, chunk, have)
            drafter.commit(1, torch.zeros_like(chunk), have)
            stale = chunk if prev is None else feats[prev : prev + 1].expand_as(chunk)
            drafter.commit(2, stale, have)
            have, prev = p, p
            ctx = lambda slot, anchor: DraftContext([slot], torch.tensor([anchor]), torch.tensor([p]),  # noqa: E731
                                                    [ids[: p + 1]])
            right = drafter.draft_logits(ctx(0, ids[p]))[0]
            want = draft.logprobs.float()
            k = min(want.shape[0], right.shape[0])

            def err(logits):
                return float((_logprobs(logits[:k], draft)[:k] - want[:k]).abs().max())

            result.checked += 1
            e0 = err(right)
            if e0 <= DRAFT_ATOL:
                continue
            shifted = right.clone()
            shifted[1:] = right[:-1]
            cands = {"drafter-wrong-anchor": lambda: drafter.draft_logits(ctx(0, ids[p - 1]))[0],
                     "drafter-mask-slot": lambda: shifted,
                     "drafter-features-zero": lambda: drafter.draft_logits(ctx(1, ids[p]))[0],
                     "drafter-features-stale": lambda: drafter.draft_logits(ctx(2, ids[p]))[0]}
            names = [n for n, f in cands.items() if err(f()) <= DRAFT_ATOL]
            evidence = (f"recorded draft log-probs differ from the drafter re-run on fresh target features by {e0:.3g}")
            if len(names) == 1:
                kind, fault, sure = DRAFTER_FAULTS[names[0]], names[0], "high"
                evidence += "; re-running it with that input reproduces the draft"
            else:
                kind = "the drafter's input differs from the committed context (unknown: anchor, positions or features)"
                fault, sure = None, "medium"
            result.per_step[(s.step, r)] = fault or "unknown"
            found.append(Finding("drafter", kind, fault, s.step, r, None, evidence, sure,
                                 next_command("drafter", s.step, r)))
    result.ran = result.checked > 0
    if not result.ran:
        result.why = result.note or "no step could be re-drafted"
    result.findings = group_findings(found)
    return result
