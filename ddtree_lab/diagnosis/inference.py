"""Rule inference: which verifier rule explains a request's recorded decisions (families fitted by likelihood).

Where a recorded walk departs from the target-only rule, the verifier check asks which rule
ran instead. Each **family** is a parametrised departure from the target-only rule along one
axis (:class:`ddtree_lab.faults.RuleVariant`; the families, and each step's record read once for them,
in :mod:`.families`):

* ``temperature``: the walk on rows at another temperature ``T`` (the request's filters kept);
* ``greedy``: argmax decisions (one-hot rows inside the verifier) on a sampled request;
* ``p-over-q`` / ``p-over-q-own-coin`` / ``p-over-one-hot-q`` / ``p-over-one-hot-q-own-coin``:
  per-child acceptance ``u < min(1, p/q)`` with the drafter's marginal ``q`` (from the tree's
  log-weights) or a one-hot ``q = 1``, judged with the parent's coin or each child's own;
* ``threshold``: SGLang's lossy rule ``u <= S_k / t`` (:mod:`ddtree_lab.verify.rules`), ``t``
  estimated;
* ``other-order``: temperature then top-p then top-k instead of top-k then top-p (or back);
* ``top-k-dropped`` / ``top-p-dropped`` / ``min-p-dropped`` / ``top-p-twice``: a filter not
  applied, or top-p applied a second time to the renormalised row (top-k and min-p are
  idempotent: applied twice is once);
* ``root-coin``: the root's coin decides every level (a coin reused across levels);
* ``bonus-walk-coin`` / ``bonus-parent-row``: the decisions follow the rule, the bonus is drawn
  with the final node's walk coin, or from its parent's row.

**The score.** Given the recorded coins, every family is deterministic: it gives, for each
recorded field of each decision -- the coin it would use, the target probability and running
mass ``S_k`` it would log, its verdict -- and for the bonus token and residual mass, one
predicted value. Conditioning on the recorded walk so far (the recorded parent and earlier
siblings), each field is an observation with probability ``1 - ε`` when the recorded value is
the predicted one (numbers within the sampling check's float32 tolerance), ``ε`` when not
(a slip: :data:`SLIP`), and ``1/2`` when the family cannot decide it (a probability known
only within an interval, from the top-M raw logits a step stores, that straddles the coin).
The log-likelihood of a family is the sum over a request's steps; its parameter (``T`` on a
log grid over ``[0.05, 4]`` then golden-section refined; ``t`` the middle of the interval the
decisions admit, else the best of a grid) is the maximum-likelihood one, ties broken toward the
``T`` whose interval midpoints lie nearest the recorded probabilities. Families are compared
by that log-likelihood less the fitted parameter's cost: ``(1/2) log n`` (BIC, ``n`` the
observations), or for ``t``, whose likelihood is flat over the interval the decisions admit,
that interval's Occam factor ``log(range / width)`` under a log-uniform prior;
the best one is named when it beats the target-only rule by :data:`MARGIN` (a likelihood ratio
of 100), and "explains" the recording when none of its observations is a slip; families as
likely as it (within one nat) are reported as tied, and then none is named alone. The target-only
rule reads the recorded rows (``child_probs``, the bonus row prefix); the families that change
the rows recompute them from the stored top-M raw logits (level ``full``), exactly where the
transform's support lies inside them and within proven bounds elsewhere (the bounds of
:func:`ddtree_lab.diagnosis.sampling.row_interval`, which the sampling check reads token by token).

On a clean recording the target-only rule has no slip, so no family can beat it: inference
never names a rule on a run whose decisions follow the target-only rule.

Sources: the target-only rule and its lossless law (SpecInfer, Miao et al. 2024, Sec. 4;
DDTree); ``min(1, p/q)`` (Leviathan et al. 2023; Chen et al. 2023); SGLang's lossy thresholds
(``sgl-kernel`` ``speculative_sampling.cuh``); the slip likelihood of deterministic choice
models (e.g. Luce-style trembling-hand models); the Bayesian information criterion (Schwarz 1978).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np

from ..faults import RuleVariant
from ..problems import Problem
from ..sampling import SamplingParams
from ..step import Step
from .families import MARGIN, SLIP, TEMPERATURE_RANGE, THRESHOLD_RANGE, Family, StepData, engine_walk, families_for
from .sampling import ATOL, RTOL

__all__ = ["Family", "FamilyFit", "RuleInference", "families_for", "infer_rule", "engine_walk", "SLIP", "MARGIN",
           "TEMPERATURE_RANGE", "THRESHOLD_RANGE"]


#: On an engine's own walk (:func:`engine_walk`), a verdict whose coin lies within this of the
#: running mass ``S_k`` the lab sums is undecided: the engine sums in its own order and float32
#: rounding there decides the verdict, not the rule.
EDGE = 2e-6
_GRID = 32
_LOG_MATCH, _LOG_SLIP, _LOG_HALF = math.log1p(-SLIP), math.log(SLIP), math.log(0.5)


@dataclass(frozen=True)
class FamilyFit:
    """A family at its maximum-likelihood parameter over a request's steps: ``loglik``,
    ``observations`` (fields scored), ``slips`` (fields it does not predict), ``undecided``
    (fields it cannot decide), ``parameter`` (None for parameter-free families)."""

    family: Family
    parameter: float | None
    loglik: float
    observations: int
    slips: int
    undecided: int
    penalty: float | None = None

    @property
    def score(self) -> float:
        """The log-likelihood less the fitted parameter's cost: ``penalty`` when set (the Occam
        factor of a likelihood flat over an interval), else ``(1/2) log n`` (BIC)."""
        if not self.family.fitted:
            return self.loglik
        return self.loglik - (self.penalty if self.penalty is not None else 0.5 * math.log(max(self.observations, 1)))

    def describe(self, params: SamplingParams | None) -> str:
        """The family in words with its parameter ("the verifier used T ≈ 1.00, the request asked 0.8")."""
        if self.family.fitted == "temperature" and self.parameter is not None:
            asked = f", the request asked {params.temperature:g}" if params is not None else ""
            return f"the verifier used T ≈ {self.parameter:.2f}{asked}"
        if self.family.fitted == "threshold_acc" and self.parameter is not None:
            return f"{self.family.label} (threshold_acc ≈ {self.parameter:.3g})"
        return self.family.label


@dataclass
class RuleInference:
    """What :func:`infer_rule` found for one request.

    Attributes:
        request: the request.
        baseline: the target-only rule's :class:`FamilyFit`.
        fits: every family tried, best first (by :attr:`FamilyFit.score`).
        best: the family named (beats the target-only rule by :data:`MARGIN`), or None.
        llr: the best family's log-likelihood ratio against the target-only rule (nats).
        explains: the best family predicts every observation (no slip).
        unexplained: the target-only rule's slips that the closest family does not predict either, as
            :class:`~ddtree_lab.problems.Problem` s (kind ``rule_unexplained``; ``field`` the
            decision field, ``value`` recorded, ``limit`` the target-only rule's value).
        not_tried: families left out and why (e.g. no top-M raw logits at level light).
        tied: other families as likely as the best (log-likelihood within one nat, as many
            slips): the decisions do not tell them apart, and no family is named alone.
    """

    request: int
    baseline: FamilyFit
    fits: list[FamilyFit]
    best: FamilyFit | None
    llr: float
    explains: bool
    unexplained: list[Problem] = field(default_factory=list)
    not_tried: list[str] = field(default_factory=list)
    tied: list[FamilyFit] = field(default_factory=list)


_TARGET_ONLY = Family("target-only", "the target-only rule", RuleVariant())

# -- one step's observations under one family ----------------------------------------------------


def _near(recorded: float, lo: float, hi: float) -> bool:
    return lo - ATOL - RTOL * abs(lo) <= recorded <= hi + ATOL + RTOL * abs(hi)


@dataclass
class _Obs:
    step: int
    node: int
    field: str
    recorded: float | None
    expected: float | None
    logp: float


def _observe(recorded, lo, hi, exact_match=None) -> float:
    if recorded is None or lo is None or hi is None:
        return _LOG_SLIP if recorded is None and lo is not None else _LOG_HALF
    ok = exact_match if exact_match is not None else _near(float(recorded), lo, hi)
    return _LOG_MATCH if ok else _LOG_SLIP


def _score(sd: StepData, variant: RuleVariant) -> list[_Obs]:
    """Every observation of one step under ``variant`` (module docstring)."""
    s, obs = sd.step, []
    recorded_rows = variant.rows == "request"
    parent, s_lo, s_hi, s32 = None, 0.0, 0.0, 0.0
    for d in sd.decisions:
        if d.parent != parent:
            parent, s_lo, s_hi, s32 = d.parent, 0.0, 0.0, 0.0
        node = d.node
        u = sd.coins[d.parent] if variant.coin == "parent" else sd.coins[node] if variant.coin == "child" else \
            sd.coins[0]
        obs.append(_Obs(s.step, node, "coin", d.coin, u, _observe(d.coin, u, u, d.coin is not None
                                                                  and abs(d.coin - u) <= 1e-7)))
        if recorded_rows:
            p_lo = p_hi = sd.cp[node]
            if math.isnan(p_lo):
                p_lo = p_hi = float("nan")
        else:
            row = sd.row(d.parent, variant)
            p_lo, p_hi = row.prob(sd.tokens[node]) if row is not None else (float("nan"), float("nan"))
        known = not math.isnan(p_lo)
        exp_p = p_lo if known and p_hi - p_lo <= 1e-12 else None
        obs.append(_Obs(s.step, node, "target_prob", d.target_prob, exp_p,
                        _observe(d.target_prob, p_lo, p_hi) if known else _LOG_HALF))
        if known:
            if recorded_rows:
                s32 = float(np.float32(s32 + p_lo))
                s_lo = s_hi = s32
            else:
                s_lo, s_hi = s_lo + p_lo, min(s_hi + p_hi, 1.0)
        else:
            s_lo, s_hi = float("nan"), float("nan")
        mass_known = not math.isnan(s_lo)
        edge = d.cumulative_mass == 1.0 and d.verdict == "accept" and mass_known and s_hi >= 1.0 - 1e-4
        obs.append(_Obs(s.step, node, "cumulative_mass", d.cumulative_mass, s_lo if mass_known else None,
                        (_LOG_MATCH if edge else _observe(d.cumulative_mass, s_lo, s_hi)) if mass_known else _LOG_HALF))
        verdict = _verdict(variant, u, p_lo, p_hi, s_lo, s_hi, sd, d) if known and mass_known else None
        if sd.verdicts_only and mass_known and abs(u - s_lo) <= EDGE:
            verdict = None  # the engine sums S_k its own way: at u ~ S its float rounding decides
        if verdict is None:
            lp = _LOG_HALF
        else:
            lp = _LOG_MATCH if verdict == d.verdict or (edge and d.verdict == "accept") else _LOG_SLIP
        obs.append(_Obs(s.step, node, "verdict", 1.0 if d.verdict == "accept" else 0.0,
                        None if verdict is None else float(verdict == "accept"), lp))
    bonus = _bonus_obs(sd, variant)
    if sd.verdicts_only:  # the engine records its verdicts and bonus token, not the lab's numbers
        obs = [o for o in obs if o.field == "verdict"]
        bonus = [o for o in bonus if o.field == "bonus_token"]
    obs.extend(bonus)
    return obs


def _verdict(variant: RuleVariant, u: float, p_lo: float, p_hi: float, s_lo: float, s_hi: float, sd: StepData, d):
    """The family's verdict on a child, or None when its bounds straddle the coin."""
    if variant.accept == "cumulative":
        if p_hi <= 0.0:
            return "reject"
        if u < s_lo and p_lo > 0.0:
            return "accept"
        return "reject" if u >= s_hi else None
    if variant.accept == "threshold":
        t = max(np.float32(variant.threshold_acc), np.float32(1e-9))
        if np.float32(u) <= np.float32(s_lo) / t:
            return "accept"
        return "reject" if np.float32(u) > np.float32(s_hi) / t else None
    if variant.accept == "p-over-one-hot":
        q = 1.0
    else:
        if sd.logws is None:
            return None
        q = math.exp(float(sd.logws[d.node]) - float(sd.logws[d.parent]))
    if p_hi <= 0.0:
        return "reject"
    if p_lo > 0.0 and u < min(1.0, p_lo / q if q > 0 else math.inf):
        return "accept"
    return "reject" if u >= min(1.0, p_hi / q if q > 0 else math.inf) else None


def _bonus_obs(sd: StepData, variant: RuleVariant) -> list[_Obs]:
    """The bonus token and residual mass under ``variant``, given the recorded walk."""
    s, b = sd.step, sd.bonus
    if b is None or b.token < 0 or s.final_coin is None:
        return []
    node, t = b.node, b.token
    rejected_nodes = [d.node for d in sd.decisions if d.parent == node and d.verdict == "reject"]
    rejected = {sd.tokens[c] for c in rejected_nodes}
    coin = float(sd.coins[node]) if variant.bonus == "walk-coin" else float(s.final_coin)
    recorded_mass = s.final_mass
    parent = sd.parents[node] if 0 < node < len(sd.parents) else -1
    if variant.bonus == "parent-row" and parent >= 0:
        row = sd.row(parent, variant, request_rows=True)
        if row is not None and row.exact and not float(row.lo[~np.isin(row.ids, list(rejected))].sum()) > 0.0:
            parent = -1  # nothing left in the parent's row: the node's own draw stands
    if variant.rows == "request" and (variant.bonus != "parent-row" or parent < 0):
        prefix = s.final_row_prefix
        if prefix is None or prefix.shape[0] != t + 1:
            return [_Obs(s.step, node, "bonus_token", float(t), None, _LOG_HALF)]
        r = prefix.double().clone()
        for tok in rejected:
            if tok <= t:
                r[tok] = 0.0
        mass = 1.0 - sum(sd.cp[c] for c in rejected_nodes)
        cum = r.cumsum(0)
        lo, hi = (float(cum[t - 1]) if t else 0.0), float(cum[t])
        slack = 2e-6
        ok = float(r[t]) > 0.0 and lo - slack <= coin * mass < hi + slack
        return [_Obs(s.step, node, "bonus_token", float(t), None, _LOG_MATCH if ok else _LOG_SLIP),
                _Obs(s.step, node, "final_mass", recorded_mass, mass,
                     _observe(recorded_mass, mass - 1e-5, mass + 1e-5))] + \
            _bonus_prob_obs(s, node, float(r[t]) / mass if mass > 0 else None)
    if variant.bonus == "parent-row":
        row = sd.row(parent, variant, request_rows=True)
    else:
        row = sd.row(node, variant)
    if row is None or not row.exact:
        return [_Obs(s.step, node, "bonus_token", float(t), None, _LOG_HALF)]
    order = np.argsort(row.ids, kind="stable")
    ids, p = row.ids[order], row.lo[order].copy()
    p[np.isin(ids, list(rejected))] = 0.0
    mass = float(p.sum())
    if mass <= 0.0:
        return [_Obs(s.step, node, "bonus_token", float(t), None, _LOG_SLIP)]
    cum = np.cumsum(p)
    k = int(np.searchsorted(cum, coin * mass, side="right"))
    k = min(k, len(p) - 1)
    if p[k] <= 0.0:
        k = int(np.nonzero(p > 0)[0][-1])
    got = int(ids[k])
    return [_Obs(s.step, node, "bonus_token", float(t), float(got), _LOG_MATCH if got == t else _LOG_SLIP),
            _Obs(s.step, node, "final_mass", recorded_mass, mass, _observe(recorded_mass, mass - 1e-4, mass + 1e-4))] + \
        _bonus_prob_obs(s, node, float(p[k]) / mass if got == t else None)


def _bonus_prob_obs(s: Step, node: int, expected: float | None) -> list[_Obs]:
    """The bonus's recorded ``token_prob`` (the verifier's own row value) against the family's
    residual probability of the token (None: the family draws another token, already a slip)."""
    b = s.bonus
    if b is None or b.token_prob is None or expected is None:
        return []
    return [_Obs(s.step, node, "bonus_prob", float(b.token_prob), expected,
                 _observe(float(b.token_prob), expected, expected))]


# -- fitting -------------------------------------------------------------------------------------


def _fit_at(family: Family, data: list[StepData], parameter: float | None) -> tuple[FamilyFit, list[_Obs]]:
    variant = family.variant
    if family.fitted == "temperature":
        variant = dataclasses.replace(variant, temperature=float(parameter))  # type: ignore[arg-type]
    elif family.fitted == "threshold_acc":
        variant = dataclasses.replace(variant, threshold_acc=float(parameter))  # type: ignore[arg-type]
    obs = [o for sd in data for o in _score(sd, variant)]
    ll = sum(o.logp for o in obs)
    return FamilyFit(family, parameter, ll, len(obs), sum(o.logp == _LOG_SLIP for o in obs),
                     sum(o.logp == _LOG_HALF for o in obs)), obs


def _closeness(obs: list[_Obs]) -> float:
    """Tie-break: how far the recorded probabilities lie from the family's (log ratio, capped)."""
    out = 0.0
    for o in obs:
        if o.field == "target_prob" and o.expected is not None and o.recorded and o.expected > 0:
            out += min(abs(math.log(float(o.recorded) / o.expected)), 5.0)
    return out


def _golden(f, a: float, b: float, iterations: int):
    """The best ``(value, ...)`` of ``f`` (maximised on its first item) seen by a golden-section
    search on ``[a, b]`` (log T)."""
    g = (math.sqrt(5) - 1) / 2
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = f(c), f(d)
    best = max(fc, fd, key=lambda x: x[0])
    for _ in range(iterations):
        if fc[0] >= fd[0]:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = f(d)
        best = max(best, fc, fd, key=lambda x: x[0])
    return best


def _fit_temperature(family: Family, data: list[StepData]) -> tuple[FamilyFit, list[_Obs]]:
    """``T`` by maximum likelihood: the log grid, then two golden-section searches inside the
    best grid cell's neighbours: one on the likelihood (tie-broken by closeness), one on the
    closeness alone. The likelihood is a step function of ``T`` (a field matches within float
    tolerance or not) whose top is a narrow plateau around the true ``T``; the closeness (how
    far the recorded probabilities lie from the family's) is smooth and leads onto it."""
    lo, hi = TEMPERATURE_RANGE
    grid = np.geomspace(lo, hi, _GRID)
    seen: dict[float, tuple] = {}

    def evaluate(log_t: float):
        if log_t not in seen:
            fit, obs = _fit_at(family, data, float(math.exp(log_t)))
            seen[log_t] = (fit, obs, _closeness(obs))
        return seen[log_t]

    def objective(log_t: float):
        fit, obs, close = evaluate(log_t)
        return fit.loglik - 1e-3 * close, fit, obs

    def closeness(log_t: float):
        fit, obs, close = evaluate(log_t)
        return -close, fit, obs

    scored = [objective(math.log(t)) for t in grid]
    i = max(range(len(grid)), key=lambda k: scored[k][0])
    j = max(range(len(grid)), key=lambda k: -seen[math.log(grid[k])][2])
    best = scored[i]
    for centre, f in ((i, objective), (j, closeness)):
        a, b = math.log(grid[max(centre - 1, 0)]), math.log(grid[min(centre + 1, len(grid) - 1)])
        got = _golden(f, a, b, 40)
        cand = objective(math.log(got[1].parameter))
        if cand[0] > best[0]:
            best = cand
    return best[1], best[2]


def threshold_interval(decisions) -> tuple[float, float]:
    """The ``t`` that SGLang's lossy rule ``u <= S / t`` (``threshold_acc``) admits on every one
    of ``decisions`` (:class:`~ddtree_lab.verify.Decision`; those without a positive coin are
    skipped): ``(lo, hi)``, ``hi`` infinite when no decision accepted."""
    lo, hi = 0.0, float("inf")
    for d in decisions:
        if d.coin is None or d.coin <= 0:
            continue
        r = d.cumulative_mass / d.coin
        if d.verdict == "accept":
            hi = min(hi, r)
        else:
            lo = max(lo, r)
    return lo, hi


def _fit_threshold(family: Family, data: list[StepData]) -> tuple[FamilyFit, list[_Obs]]:
    """``t`` of SGLang's rule. Where the decisions admit an interval ``(a, b]`` of ``t``, the
    likelihood is flat over it (every ``t`` in it gives the same verdicts), so the parameter's
    cost is its Occam factor under a log-uniform prior on :data:`THRESHOLD_RANGE`:
    ``log(range / width)`` in log ``t``, not BIC's ``(1/2) log n`` (which assumes a peak
    narrowing with ``n``); elsewhere (no interval, a grid value) BIC."""
    a, b = threshold_interval(d for sd in data for d in sd.decisions)
    lo_r, hi_r = THRESHOLD_RANGE
    cands = [float(x) for x in np.geomspace(lo_r, hi_r, 32)]
    mid = None
    if a < b:
        mid = (a + b) / 2 if math.isfinite(b) else 2 * a
        cands.append(mid)
    fits = [_fit_at(family, data, t) for t in cands]
    fit, obs = max(fits, key=lambda f: (f[0].loglik, f[0].parameter == mid))  # ties: the interval's middle
    if mid is not None and fit.parameter == mid:
        width = math.log(min(b, hi_r) / max(a, lo_r)) if min(b, hi_r) > max(a, lo_r) else 0.0
        if width > 0:
            fit = dataclasses.replace(fit, penalty=max(0.0, math.log(math.log(hi_r / lo_r) / width)))
    return fit, obs


def _greedy_limit(fit: FamilyFit | None) -> bool:
    return fit is not None and fit.family.name == "temperature" and (fit.parameter or 1.0) <= 0.1


def infer_rule(steps: list[Step], vocab: int, families: list[Family] | None = None, engine: bool = False) -> RuleInference:
    """Fit every rule family to one request's recorded decisions (module docstring).

    Args:
        steps: the request's steps that store coins, child probabilities and decisions (the
            ones that agree with the target-only rule too: a rule must explain them as well).
        vocab: V (the tail bound of the stored top-M logits).
        families: the families to try (default :func:`families_for` of the request's parameters).
        engine: the steps are converted from an engine's recording: fit the engine's own walk
            (:func:`engine_walk`: its verdicts and bonus token), not the lab's.

    Returns:
        :class:`RuleInference` (``best`` None: no family beats the target-only rule).

    Raises:
        ValueError: no step, steps of more than one request, or a step without coins or rows
            (the step named).
    """
    if not steps:
        raise ValueError("infer_rule: no step")
    requests = {s.request for s in steps}
    if len(requests) != 1:
        raise ValueError(f"infer_rule: steps of several requests {sorted(requests)}: fit one request at a time")
    for s in steps:
        if s.coins is None or s.child_probs is None or s.output is None:
            raise ValueError(f"step {s.step}, request {s.request}: no coins, verify rows or output recorded")
    data = [StepData(s, vocab, engine) for s in steps]
    params = steps[0].params
    fams = families_for(params) if families is None else families
    not_tried = []
    if not any(sd.has_logits for sd in data):
        rows_need = [f for f in fams if f.variant.rows != "request" or f.variant.bonus == "parent-row"]
        if rows_need:
            not_tried.append(f"{', '.join(f.name for f in rows_need)}: no step stores its top-M raw logits (level full)")
        fams = [f for f in fams if f not in rows_need]
    base, base_obs = _fit_at(_TARGET_ONLY, data, None)
    fits, obs_of = [], {}
    for fam in fams:
        if fam.fitted == "temperature":
            fit, obs = _fit_temperature(fam, data)
        elif fam.fitted == "threshold_acc":
            fit, obs = _fit_threshold(fam, data)
        else:
            fit, obs = _fit_at(fam, data, None)
        fits.append(fit)
        obs_of[fam.name] = obs
    fits.sort(key=lambda f: -f.score)
    top = fits[0] if fits else None
    llr = (top.score - base.loglik) if top is not None else 0.0
    best = top if top is not None and llr >= MARGIN else None
    tied = [] if best is None else [f for f in fits if f is not best and f.slips == best.slips
                                    and best.loglik - f.loglik < 1.0]
    greedy = next((f for f in [best] + tied if f is not None and f.family.name == "greedy"), None)
    if greedy is not None:  # greedy is the temperature family's T -> 0 limit: one claim, not two
        tied = [f for f in [best] + tied if f is not None and f is not greedy and not _greedy_limit(f)]
        best = greedy
    closest = best if best is not None else top
    explained = set() if closest is None else {(o.step, o.node, o.field) for o in obs_of[closest.family.name]
                                               if o.logp == _LOG_MATCH}
    request = steps[0].request
    unexplained = [Problem("rule_unexplained", o.step, request, o.node, o.field, o.recorded, o.expected,
                           f"{o.field}: recorded {o.recorded!r}, the target-only rule gives {o.expected!r}; the "
                           "closest rule family does not give the recorded value either", part="output")
                   for o in base_obs if o.logp == _LOG_SLIP and (o.step, o.node, o.field) not in explained]
    return RuleInference(request, base, fits, best, llr, best is not None and best.slips == 0, unexplained, not_tried,
                         tied)
