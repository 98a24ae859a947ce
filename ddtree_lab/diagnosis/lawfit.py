"""Which rule family's law fits a run's recorded outputs best: rule inference on the statistical side.

When the output-law check (:mod:`.law`) rejects the target's law, this module asks which
verifier rule's law the outputs follow instead, reading what that check reads -- the accepted
paths and bonus tokens against the tree and its rows -- and no coin and no decision log. The
families are rule inference's (:func:`ddtree_lab.diagnosis.families.families_for`, one
:class:`~ddtree_lab.faults.RuleVariant` each); each gives, at every node the walk reaches, a
law over its outcomes (move into child ``c_i`` in the buffers' sibling order, or leave the
tree), and a law of the bonus token once it leaves. With ``p_i`` the children's probabilities
in the family's rows and ``S_k`` their running sum (capped at 1):

* the target-only rule (and every family that only changes the rows: another temperature,
  argmax rows, a filter dropped, swapped or applied twice): ``P(c_i) = S_i - S_{i-1}``, out
  ``1 - S_m``; the bonus from the node's row with the children zeroed, renormalised;
* SGLang's threshold ``u <= S_k / t``: ``a_k = min(1, S_k / t)`` in place of ``S_k``;
* ``min(1, p/q)`` with one coin per node: ``a_i = min(1, p_i / q_i)``, ``P(c_i) =
  max(0, a_i - max_{j<i} a_j)``; with each child's own coin ``P(c_i) = a_i prod_{j<i}(1 - a_j)``
  (``q_i`` the drafter's marginal from the tree's log-weights, or 1);
* the root's coin at every level: the levels' intervals of that one coin intersect
  (``P(c_i | path so far) = |I cap [S_{i-1}, S_i)| / |I|``);
* the bonus drawn with the final node's walk coin: that coin is uniform on ``[S_m, 1)``
  given the walk left, so the bonus is the residual's inverse CDF over that part only; drawn
  from the parent's row: that row's residual.

A step's probability under a family is mixed with the target-only rule's,
``(1 - ε) P_family + ε P_target`` (``ε`` = :data:`~ddtree_lab.diagnosis.families.SLIP`), so a
deterministic family (argmax rows) is not ruled out by one outcome it gives probability 0,
and the log-likelihood is summed over the steps (an outcome both give probability 0 costs
``2 log ε``). ``T`` and ``t`` are fitted by maximum
likelihood (log grid, then golden section), costed ``(1/2) log n`` (BIC, ``n`` the steps). The
best family is named when it beats the target-only rule by
:data:`~ddtree_lab.diagnosis.families.MARGIN`, and it **fits** when its own law passes the
output-law check's tests on its own PITs (no test below
:data:`~ddtree_lab.diagnosis.lawsample.LAW_ALPHA`) and it gives no observed outcome probability 0;
else "no family fits". Families that change the rows read the stored top-M raw logits
(level ``full``); a step whose row they cannot compute counts as the target-only rule's for
them (no evidence either way).

Sources: the sequential rejection law on a tree (SpecInfer, Miao et al. 2024, Sec. 4; DDTree);
``min(1, p/q)`` (Leviathan et al. 2023); SGLang's thresholds (``sgl-kernel``
``speculative_sampling.cuh``); the randomised PIT (Brockwell 2007); BIC (Schwarz 1978).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from ..faults import RuleVariant
from ..step import Step
from ..verify.walking import children_of
from .families import MARGIN, SLIP, TEMPERATURE_RANGE, THRESHOLD_RANGE, Family, StepData, families_for
from .common import outcome
from .lawsample import LAW_ALPHA, MIN_DRAWS, LawSample, law_observations, law_tests

__all__ = ["LawFamilyFit", "OutputLawFit", "fit_output_law"]

_LOG_EPS, _LOG_KEEP = math.log(SLIP), math.log1p(-SLIP)
#: The log-probability of a step whose outcome the law gives probability 0 (a slip of a slip).
_LOG_ZERO = 2 * math.log(SLIP)
_TARGET_ONLY = Family("target-only", "the target-only rule", RuleVariant())


@dataclass(frozen=True)
class LawFamilyFit:
    """One family's law at its maximum-likelihood parameter: ``loglik`` (nats, over the steps),
    ``parameter`` (``T``, ``t`` or None), ``zeros`` (observed outcomes it gives probability 0),
    ``undecided`` (steps it could not score: counted as the target-only rule's)."""

    family: Family
    parameter: float | None
    loglik: float
    steps: int
    zeros: int
    undecided: int

    @property
    def score(self) -> float:
        """The log-likelihood less ``(1/2) log n`` per fitted parameter (BIC)."""
        return self.loglik - (0.5 * math.log(max(self.steps, 1)) if self.family.fitted else 0.0)

    def describe(self) -> str:
        """The family in words with its parameter ("the walk at T = 1.00")."""
        if self.family.fitted == "temperature" and self.parameter is not None:
            return f"the walk at T = {self.parameter:.2f}"
        if self.family.fitted == "threshold_acc" and self.parameter is not None:
            return f"{self.family.label} (threshold_acc = {self.parameter:.3g})"
        return self.family.label


@dataclass
class OutputLawFit:
    """What :func:`fit_output_law` found.

    Attributes:
        baseline: the target-only rule's :class:`LawFamilyFit`.
        fits: every family tried, best first (by score).
        best: the family named (beats the target-only rule by ``MARGIN``), or None.
        llr: the top family's score less the target-only rule's log-likelihood (nats).
        fits_law: the named family's own law passes the tests on its PITs, with no outcome of
            probability 0 (False when none is named).
        pvalues: ``(test, p-value)`` of the named family's own law.
        not_tried: families left out and why.
    """

    baseline: LawFamilyFit
    fits: list[LawFamilyFit]
    best: LawFamilyFit | None
    llr: float
    fits_law: bool
    pvalues: list[tuple[str, float]] = field(default_factory=list)
    not_tried: list[str] = field(default_factory=list)

    def sentence(self) -> str:
        """The result in words, for a finding's evidence."""
        top = self.fits[0] if self.fits else None
        if self.best is not None and self.fits_law:
            return (f"the outputs fit {self.best.describe()} best (log LR {self.llr:+.1f} over the target-only rule, "
                    f"{self.best.steps} sampled steps)")
        if self.best is not None:
            worst = min(self.pvalues, key=lambda x: x[1]) if self.pvalues else None
            why = (f"its own law is rejected too ({worst[0]} p = {worst[1]:.2g})" if worst and worst[1] < LAW_ALPHA
                   else f"it gives {self.best.zeros} observed outcome(s) probability 0")
            return f"no rule family's law fits the outputs (closest: {self.best.describe()}, log LR {self.llr:+.1f}; {why})"
        return ("no rule family's law fits the outputs better than the target-only rule"
                + (f" (closest: {top.describe()}, log LR {self.llr:+.1f})" if top is not None else ""))


class _LawStep:
    """One covered step's outcome and what the families read (tree, rows), read once."""

    def __init__(self, step: Step, vocab: int, path: list[int], bonus: int):
        assert step.child_probs is not None and step.node_token_ids is not None  # law_observations checked
        nt, ns = step.retrieve_next_token, step.retrieve_next_sibling
        assert nt is not None and ns is not None
        nt_l, ns_l = nt.tolist(), ns.tolist()
        self.step, self.path, self.bonus = step, path, bonus
        self.kids = [children_of(step.request, nt_l, ns_l, n, step.num_nodes) for n in path]
        self.cp = step.child_probs.double().tolist()
        self.tokens = step.node_token_ids.tolist()
        self.logws = step.node_logws.tolist() if step.node_logws is not None else None
        self.parents = step.parents.tolist() if step.parents is not None else []
        self.data = StepData(step, vocab) if step.coins is not None else StepData(
            step.replace(coins=torch.zeros(step.num_nodes)), vocab)
        g = torch.Generator().manual_seed(2_000_003 * int(step.step) + int(step.request))
        self.v = torch.rand(len(path) + 1, generator=g, dtype=torch.float64).tolist()


def _probs(ls: _LawStep, node: int, kids: list[int], v: RuleVariant) -> list[float] | None:
    if v.rows == "request":
        return [ls.cp[c] for c in kids]
    row = ls.data.row(node, v)
    if row is None:
        return None
    return [sum(row.prob(ls.tokens[c])) / 2 for c in kids]


def _node_law(ls: _LawStep, node: int, kids: list[int], p: list[float], v: RuleVariant,
              interval: tuple[float, float]) -> tuple[list[tuple[float, float]], float]:
    """Per outcome (children, then out) the coin interval (root coin) or ``(0, P)``, and the
    interval's length (1 when the coin is fresh)."""
    s, cum = [], 0.0
    for x in p:
        cum = min(cum + x, 1.0)
        s.append(cum)
    if v.accept == "threshold":
        t = max(v.threshold_acc, 1e-9)
        s = [min(1.0, x / t) for x in s]
    if v.accept.startswith("p-"):
        if v.accept == "p-over-q" and ls.logws is None:
            raise ValueError("no tree log-weights")
        a = []
        for c, x in zip(kids, p):
            q = 1.0 if v.accept == "p-over-one-hot" else math.exp(ls.logws[c] - ls.logws[node])  # type: ignore[index]
            a.append(0.0 if x <= 0 else min(1.0, x / q if q > 0 else math.inf))
        out, top, rest = [], 0.0, 1.0
        for x in a:
            if v.coin == "child":
                out.append((0.0, x * rest))
                rest *= 1.0 - x
            else:
                out.append((0.0, max(0.0, x - top)))
                top = max(top, x)
        out.append((0.0, rest if v.coin == "child" else 1.0 - top))
        return out, 1.0
    edges = [0.0] + s + [1.0]
    if v.coin == "root":
        lo, hi = interval
        return [(max(lo, edges[i]), min(hi, edges[i + 1])) for i in range(len(edges) - 1)], hi - lo
    return [(0.0, edges[i + 1] - edges[i]) for i in range(len(edges) - 1)], 1.0


def _bonus_law(ls: _LawStep, v: RuleVariant, p_kids: list[float]) -> tuple[float, float] | None:
    """``(F(b-), P(b))`` of the bonus under ``v``, or None when its row cannot be computed."""
    s, node, b = ls.step, ls.path[-1], ls.bonus
    kid_tokens = {ls.tokens[c] for c in ls.kids[-1]}
    if b in kid_tokens:
        return 0.0, 0.0
    rows: tuple[np.ndarray, np.ndarray] | None = None
    parent = ls.parents[node] if 0 < node < len(ls.parents) else -1
    if v.bonus == "parent-row" and parent >= 0:
        row = ls.data.row(parent, v, request_rows=True)
        if row is None or not row.exact:
            return None
        keep = ~np.isin(row.ids, list(kid_tokens))
        if float(row.lo[keep].sum()) > 0.0:
            rows = row.ids, np.where(keep, row.lo, 0.0)
    if rows is None and v.rows != "request":
        row = ls.data.row(node, v)
        if row is None or not row.exact:
            return None
        rows = row.ids, np.where(np.isin(row.ids, list(kid_tokens)), 0.0, row.lo)
    if rows is None:  # the recorded row prefix of the final node
        prefix = s.final_row_prefix
        if prefix is None or prefix.shape[0] != b + 1 or s.bonus is None or s.bonus.node != node:
            return None
        r = prefix.double().clone()
        for t in kid_tokens:
            if t <= b:
                r[t] = 0.0
        mass = max(0.0, 1.0 - sum(p_kids))
        lo, pb = float(r[:b].sum()), float(r[b])
    else:
        ids, pr = rows
        mass = float(pr.sum())
        lo, pb = float(pr[ids < b].sum()), float(pr[ids == b].sum())
    if mass <= 0.0:
        return 0.0, 0.0
    f_lo, f_hi = lo / mass, min((lo + pb) / mass, 1.0)
    if v.bonus == "walk-coin" and ls.kids[-1]:
        start = min(sum(p_kids), 1.0)  # the walk coin left the tree: uniform on [S_m, 1)
        if start >= 1.0:
            return None
        width = max(0.0, min(f_hi, 1.0) - max(f_lo, start))
        return (max(0.0, f_lo - start) / (1.0 - start), width / (1.0 - start))
    return f_lo, f_hi - f_lo


def _step_law(ls: _LawStep, v: RuleVariant) -> tuple[float, list[float], float | None] | None:
    """``(log P(outcome), walk PITs, bonus PIT)`` of one step under ``v``; None: not computable."""
    logp, pits, interval = 0.0, [], (0.0, 1.0)
    p_kids: list[float] = []
    for j, n in enumerate(ls.path):
        kids = ls.kids[j]
        if not kids:
            p_kids = []
            continue
        p = _probs(ls, n, kids, v)
        if p is None or any(math.isnan(x) for x in p):
            return None
        try:
            law, length = _node_law(ls, n, kids, p, v, interval)
        except ValueError:
            return None
        nxt = ls.path[j + 1] if j + 1 < len(ls.path) else None
        o = kids.index(nxt) if nxt is not None else len(kids)
        sizes = [max(0.0, hi - lo) for lo, hi in law]
        if length <= 0 or sizes[o] <= 0:
            return -math.inf, pits, None
        pits.append(min((sum(sizes[:o]) + ls.v[j] * sizes[o]) / length, 1.0))
        logp += math.log(sizes[o] / length)
        interval = law[o]
        p_kids = p
    got = _bonus_law(ls, v, p_kids)
    if got is None:
        return None
    f_lo, pb = got
    if pb <= 0.0:
        return -math.inf, pits, None
    return logp + math.log(pb), pits, min(f_lo + ls.v[-1] * pb, 1.0)


def _fit_at(family: Family, steps: list[_LawStep], base: list[float], parameter: float | None):
    v = family.variant
    if family.fitted == "temperature":
        v = dataclasses.replace(v, temperature=float(parameter))  # type: ignore[arg-type]
    elif family.fitted == "threshold_acc":
        v = dataclasses.replace(v, threshold_acc=float(parameter))  # type: ignore[arg-type]
    total, zeros, undecided, laws = 0.0, 0, 0, []
    for ls, lb in zip(steps, base):
        got = _step_law(ls, v)
        laws.append(got)
        if got is None:
            undecided += 1
            total += lb if lb > -math.inf else _LOG_ZERO
            continue
        lf = got[0]
        zeros += lf == -math.inf
        total += _mixed(lf, lb)
    return LawFamilyFit(family, parameter, total, len(steps), zeros, undecided), laws


def _mixed(lf: float, lb: float) -> float:
    """``log((1 - ε) P_family + ε P_target)``; an outcome both give probability 0 costs
    :data:`_LOG_ZERO` (the family and the target-only rule alike)."""
    if lf == -math.inf and lb == -math.inf:
        return _LOG_ZERO
    return float(np.logaddexp(_LOG_KEEP + lf if lf > -math.inf else -math.inf, _LOG_EPS + lb))


def _fit(family: Family, steps: list[_LawStep], base: list[float]):
    if not family.fitted:
        return _fit_at(family, steps, base, None)
    lo, hi = TEMPERATURE_RANGE if family.fitted == "temperature" else THRESHOLD_RANGE
    grid = np.geomspace(lo, hi, 24)
    scored = [_fit_at(family, steps, base, float(t)) for t in grid]
    i = max(range(len(grid)), key=lambda k: scored[k][0].loglik)
    a, b = math.log(grid[max(i - 1, 0)]), math.log(grid[min(i + 1, len(grid) - 1)])
    best = scored[i]
    g = (math.sqrt(5) - 1) / 2
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = _fit_at(family, steps, base, math.exp(c)), _fit_at(family, steps, base, math.exp(d))
    for _ in range(20):  # the law's likelihood is smooth in log T (log t): golden section
        if fc[0].loglik >= fd[0].loglik:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = _fit_at(family, steps, base, math.exp(c))
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = _fit_at(family, steps, base, math.exp(d))
        best = max(best, fc, fd, key=lambda x: x[0].loglik)
    return best


def fit_output_law(steps: list[Step], vocab: int) -> OutputLawFit:
    """Fit every rule family's law to the recorded outputs of ``steps`` (module docstring).

    Args:
        steps: the steps (any requests); those the output-law check covers (sampled, lossless,
            output, rows and buffers recorded, the outcome inside the tree) are scored.
        vocab: V (the tail bound of the stored top-M logits).

    Returns:
        :class:`OutputLawFit` (``best`` None: no family beats the target-only rule).

    Raises:
        ValueError: no step the output-law check covers.
    """
    covered = []
    for s in steps:
        try:
            if not law_observations(s, LawSample()):
                continue
        except ValueError:
            continue
        got = outcome(s)
        if got is None or got[1] < 0:
            continue
        covered.append(_LawStep(s, vocab, got[0], got[1]))
    if not covered:
        raise ValueError("fit_output_law: no sampled, lossless step with its output, rows and buffers recorded")
    base_laws = [_step_law(ls, RuleVariant()) for ls in covered]
    base = [(-math.inf if g is None else g[0]) for g in base_laws]
    baseline = LawFamilyFit(_TARGET_ONLY, None, float(sum(x if x > -math.inf else _LOG_ZERO for x in base)),
                            len(covered), sum(x == -math.inf for x in base), sum(g is None for g in base_laws))
    families: dict[str, Family] = {}
    for ls in covered:
        for f in families_for(ls.step.params):
            families.setdefault(f.name, f)
    not_tried = []
    if not any(ls.data.has_logits for ls in covered):
        rows_need = [n for n, f in families.items() if f.variant.rows != "request" or f.variant.bonus == "parent-row"]
        if rows_need:
            not_tried.append(f"{', '.join(rows_need)}: no step stores its top-M raw logits (level full)")
        families = {n: f for n, f in families.items() if n not in rows_need}
    fits, laws_of = [], {}
    for f in families.values():
        fit, laws = _fit(f, covered, base)
        fits.append(fit)
        laws_of[f.name] = laws
    fits.sort(key=lambda f: -f.score)
    top = fits[0] if fits else None
    llr = top.score - baseline.loglik if top is not None else 0.0
    best = top if top is not None and llr >= MARGIN else None
    pvalues: list[tuple[str, float]] = []
    fits_law = False
    if best is not None:
        sample = LawSample()
        for got in laws_of[best.family.name]:
            if got is None or got[0] == -math.inf:
                continue
            sample.walk.extend(got[1])
            if got[2] is not None:
                sample.bonus.append(got[2])
        pvalues = [(name, p) for name, p, _ in law_tests(sample) if name != "accepts"]
        fits_law = best.zeros == 0 and all(p >= LAW_ALPHA for _, p in pvalues) and (
            len(sample.walk) >= MIN_DRAWS)
    return OutputLawFit(baseline, fits, best, llr, fits_law, pvalues, not_tried)
