"""The rule families that rule inference (:mod:`.inference`) and the output-law fit
(:mod:`.lawfit`) both try, and what a step records for them.

* :class:`Family`, :func:`families_for`: the families tried for a request (one
  :class:`~ddtree_lab.faults.RuleVariant` each; the filter families only where the request
  filters), the ranges their parameters are searched over (:data:`TEMPERATURE_RANGE`,
  :data:`THRESHOLD_RANGE`), the slip probability :data:`SLIP` and the margin :data:`MARGIN` a
  family must beat the target-only rule by;
* :func:`engine_walk`: the decisions an engine's own output implies on a step converted from
  its recording;
* :class:`StepData`: one step's record read once, and a node's row under a family (from the
  stored top-M raw logits, within proven bounds: :func:`ddtree_lab.diagnosis.sampling.row_interval`).

What each family means and how it is scored: :mod:`.inference`'s docstring.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..faults import RuleVariant
from ..sampling import SamplingParams
from ..step import Step
from ..verify import BonusDraw, Decision
from ..verify.walking import children_of
from .common import engine_emitted, outcome
from .sampling import RowBounds, row_interval

__all__ = ["Family", "StepData", "families_for", "engine_walk", "SLIP", "MARGIN", "TEMPERATURE_RANGE",
           "THRESHOLD_RANGE"]

#: Probability of a slip (a recorded field the family does not predict) in the likelihood.
SLIP = 1e-3
#: A family is named when its log-likelihood beats the target-only rule's by this (ratio 100).
MARGIN = math.log(100.0)

#: The temperatures searched (log grid, then golden-section refinement).
TEMPERATURE_RANGE = (0.05, 4.0)
#: The thresholds ``threshold_acc`` searched (log grid), and the range of its log-uniform prior.
THRESHOLD_RANGE = (0.05, 4.0)


@dataclass(frozen=True)
class Family:
    """One rule family: ``name`` (stable id), ``label`` (words), the :class:`RuleVariant` it
    plants, ``fitted`` (the parameter estimated: ``"temperature"``, ``"threshold_acc"`` or
    None) and ``fault`` (the planted fault of :data:`ddtree_lab.faults.FAULT_KINDS` it is, or None)."""

    name: str
    label: str
    variant: RuleVariant
    fitted: str | None = None
    fault: str | None = None


def families_for(params: SamplingParams | None) -> list[Family]:
    """The families tried for a request with ``params`` (module docstring): the filter
    families only when the request uses that filter, the others always."""
    v = RuleVariant
    out = [Family("temperature", "the walk at another temperature", v(rows="temperature", temperature=1.0),
                  "temperature"),
           Family("greedy", "argmax decisions on a sampled request (one-hot rows inside the verifier)",
                  v(rows="greedy"), fault="verifier-greedy"),
           Family("p-over-q", "per-child acceptance min(1, p/q) with the drafter's marginals q, the parent's coin",
                  v(accept="p-over-q"), fault="verifier-p-over-q"),
           Family("p-over-q-own-coin", "per-child acceptance min(1, p/q) with the drafter's marginals q, each child "
                  "judged with its own coin", v(accept="p-over-q", coin="child"), fault="verifier-p-over-q-own-coin"),
           Family("p-over-one-hot-q", "per-child acceptance min(1, p/q) with a one-hot q (u < p), the parent's coin",
                  v(accept="p-over-one-hot")),
           Family("p-over-one-hot-q-own-coin", "per-child acceptance min(1, p/q) with a one-hot q (u < p), each child "
                  "judged with its own coin", v(accept="p-over-one-hot", coin="child")),
           Family("threshold", "SGLang's lossy acceptance u <= S/t, reported as exact", v(accept="threshold"),
                  "threshold_acc", fault="verifier-threshold"),
           Family("root-coin", "the root's coin decides every level (a coin reused across levels)", v(coin="root"),
                  fault="verifier-root-coin"),
           Family("bonus-walk-coin", "the decisions follow the rule; the bonus is drawn with the final node's walk "
                  "coin, not the final coin", v(bonus="walk-coin"), fault="verifier-final-coin-reuse"),
           Family("bonus-parent-row", "the decisions follow the rule; the bonus is drawn from the final node's "
                  "parent's row", v(bonus="parent-row"), fault="verifier-bonus-row")]
    if params is None or params.is_greedy:
        return out
    if params.top_k > 0 and params.top_p < 1.0:
        out.append(Family("other-order", "the verifier's rows apply the other filtering order (top-k and top-p "
                          "swapped)", v(rows="other-order")))
    if params.top_k > 0:
        out.append(Family("top-k-dropped", "the verifier's rows drop the request's top-k", v(rows="top-k-dropped")))
    if params.top_p < 1.0:
        out.append(Family("top-p-dropped", "the verifier's rows drop the request's top-p", v(rows="top-p-dropped")))
        out.append(Family("top-p-twice", "the verifier's rows apply the request's top-p twice", v(rows="top-p-twice")))
    if params.min_p:
        out.append(Family("min-p-dropped", "the verifier's rows drop the request's min-p", v(rows="min-p-dropped")))
    return out


def engine_walk(step: Step) -> tuple[list[Decision], BonusDraw | None] | None:
    """The decisions an engine's own output implies on a step converted from its recording (an
    SGLang recording: the step's ``output`` is the lab's walk on the recorded rows and coins,
    the engine's emitted tokens are in ``extra``, :func:`~ddtree_lab.diagnosis.common.engine_emitted`).

    Along the engine's accepted path, in sibling order (``retrieve_next_sibling``), the children
    before the accepted one are rejected and the accepted one accepted; at the last node every
    child is rejected; the bonus is the engine's last emitted token. Only those verdicts and the
    bonus token are the engine's: the coin, target probability and running mass ``S_k`` (float32)
    filled in are the recorded coins and rows the engine was given, which rule inference does not
    score on such a step (``StepData.verdicts_only``).

    Returns:
        ``(decisions, bonus)``, or None: not an engine's step, or its tokens leave the tree.
    """
    if engine_emitted(step) is None or step.coins is None or step.child_probs is None:
        return None
    try:
        got = outcome(step)
    except ValueError:  # no buffers or tree to follow the tokens down
        return None
    if got is None:
        return None
    path, bonus_token = got
    nt, ns = step.retrieve_next_token, step.retrieve_next_sibling
    assert nt is not None and ns is not None and step.node_token_ids is not None  # outcome followed them
    nt_l, ns_l, tok_l = nt.tolist(), ns.tolist(), step.node_token_ids.tolist()
    coins, cp = step.coins.tolist(), step.child_probs.double().tolist()
    out = []
    for depth, parent in enumerate(path, start=1):
        nxt = path[depth] if depth < len(path) else None
        mass = 0.0
        for child in children_of(step.request, nt_l, ns_l, parent, step.num_nodes):
            mass = float(np.float32(mass + cp[child]))
            out.append(Decision(step.request, depth, parent, child, tok_l[child], cp[child], mass, coins[parent],
                                "accept" if child == nxt else "reject"))
            if child == nxt:
                break
    node = path[-1]
    bonus = BonusDraw(step.request, node, int(bonus_token), "residual" if nt_l[node] >= 0 else "leaf", float("nan"),
                      step.final_coin, float("nan"))
    return out, bonus


class StepData:
    """What a step records for the score, read once (tensors to lists)."""

    def __init__(self, step: Step, vocab: int, engine: bool = False):
        self.step = step
        self.vocab = vocab
        coins = step.coins
        assert coins is not None and step.child_probs is not None  # infer_rule checks them
        self.coins = coins.tolist()
        self.cp = step.child_probs.double().tolist()
        tokens, parents, logws = step.node_token_ids, step.parents, step.node_logws
        self.tokens = tokens.tolist() if tokens is not None else []
        self.parents = parents.tolist() if parents is not None else []
        #: an engine's own walk records only its verdicts and bonus token (:func:`engine_walk`)
        self.verdicts_only = engine
        if engine:
            walk = engine_walk(step)
            if walk is None:
                raise ValueError(f"step {step.step}, request {step.request}: the engine's emitted tokens "
                                 f"{engine_emitted(step)} do not follow the recorded tree")
            self.decisions, self.bonus = walk
        else:
            self.decisions, self.bonus = list(step.decisions), step.bonus
        self.logws = logws.tolist() if logws is not None else None
        self.params = step.params
        ids, logits, lse = step.row_logit_ids, step.row_logits, step.row_logsumexp
        self.has_logits = ids is not None and logits is not None and lse is not None
        self.ids, self.logits, self.lse = ids, logits, lse
        self._rows: dict = {}

    def row(self, node: int, variant: RuleVariant, request_rows: bool = False) -> RowBounds | None:
        """Node ``node``'s row under ``variant`` (``request_rows``: the request's own) from the
        stored top-M logits, or None (not stored, or not decided by them)."""
        ids, logits, lse = self.ids, self.logits, self.lse
        if ids is None or logits is None or lse is None or self.params is None or node >= len(ids):
            return None
        from ..faults import variant_params

        key = (node, None if request_rows else (variant.rows, variant.temperature))
        if key not in self._rows:
            p = self.params
            if variant.rows == "greedy" and not request_rows:
                allowed = [i for i in ids[node].tolist() if i not in set(p.banned_token_ids)]
                one = np.zeros(len(allowed))
                one[0] = 1.0
                got = RowBounds(np.asarray(allowed, dtype=np.int64), one, one.copy(), 0.0)
            else:
                cand = p if request_rows else variant_params(p, variant)
                got = row_interval(ids[node], logits[node], float(lse[node]), cand, self.vocab,
                                   twice=variant.rows == "top-p-twice" and not request_rows)
            self._rows[key] = got
        return self._rows[key]
