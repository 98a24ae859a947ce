"""Analyses of recorded steps: pure functions of :class:`ddtree_lab.step.Step` records.

Two kinds:

**What a run did** (any trace format):

* :func:`expected_accept_length` -- the exact expected number of accepted draft tokens of a
  step's tree under the target-only rule. The walk accepts child ``c`` of an accepted node
  with probability ``p(c)`` (its coin falls in ``[S_{k-1}, S_k)``, an interval of length
  ``p(c)``), each level with a fresh coin, so node ``i`` is accepted with probability
  ``reach(i) = prod_{j on the path root -> i, j != root} p(j)`` and
  ``E[accepted draft tokens] = sum_{i != root} reach(i)``. ``sum_{i at depth d} reach(i)`` is
  the target mass the tree covers at depth ``d`` (the probability that the target's first
  ``d`` tokens form a path of the tree), which bounds what *any* lossless verifier can accept
  at depth ``d`` on that tree (it must emit the target's law, and only tree paths can be
  accepted), so no lossless verifier beats the expectation on that tree (Ringel & Romano,
  arXiv 2604.12989, §3-§4: the tree objective is the same sum with drafter probabilities).
* :func:`drafter_estimate` -- the same sum with the drafter's path probabilities
  ``exp(node_logw)``: what DDTree maximised when it built the tree; beside the exact value it
  shows the drafter's calibration.
* :func:`step_table`, :func:`acceptance_by_depth`, :func:`accepted_sibling_ranks`,
  :func:`throughput`, :func:`sibling_conditioned_quality`, :func:`looks_greedy`.

**What a run would have done under other parameters** (trace format v2): :class:`TunerData`
packs the stored top-M raw logits of many steps once; :meth:`TunerData.analyse` recomputes,
for a temperature / top-k / top-p / min-p and a budget ``B' <= B``, every node's target
probability, the exact expected accept length and the covered mass per depth -- as intervals
``[lo, hi]`` that are points wherever the stored data determine the value. The maths of the
bounds is in :func:`token_prob_bounds`.

Accept-length words follow DESIGN.md: ``accept length`` counts accepted draft tokens;
``tau = accept length + 1`` (the bonus token).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from .sampling import SamplingParams

__all__ = [
    "reach_probabilities", "expected_accept_length", "tau", "setting_label", "step_seconds", "drafter_estimate", "step_table", "acceptance_by_depth",
    "sibling_ranks", "accepted_sibling_ranks", "throughput", "sibling_conditioned_quality", "LooksGreedy",
    "looks_greedy", "token_prob_bounds", "TunerData", "TunerResult",
]


# -- what a run did ----------------------------------------------------------------------------


def reach_probabilities(parents: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Probability that the target-only walk accepts each node.

    Args:
        parents: ``[n]`` int64, ``parents[0] == -1``, parents before children (tree order).
        probs: ``[n]`` each node's target probability in its parent's row (root ignored).

    Returns:
        ``[n]`` float64: ``reach[0] = 1``, ``reach[i] = reach[parents[i]] * probs[i]``.

    Raises:
        ValueError: shapes differ, or a parent does not precede its child.
    """
    if parents.shape != probs.shape or parents.dim() != 1:
        raise ValueError(f"parents {tuple(parents.shape)} and probs {tuple(probs.shape)} must be equal 1-D shapes")
    n = parents.shape[0]
    if n > 1 and not bool((parents[1:] < torch.arange(1, n)).all() and (parents[1:] >= 0).all()):
        raise ValueError("parents must precede their children (tree order) and only node 0 may be the root")
    reach = torch.ones(n, dtype=torch.float64)
    p = probs.double()
    for i in range(1, n):
        reach[i] = reach[parents[i]] * p[i]
    return reach


def expected_accept_length(step) -> float:
    """Exact expected accepted draft tokens of ``step``'s tree under its recorded parameters
    (module docstring): ``sum_{i >= 1} prod_{path} child_probs``. Greedy steps store one-hot
    verify probabilities, so the value is the (deterministic) observed accept length."""
    return float(reach_probabilities(step.parents, step.child_probs)[1:].sum())


def drafter_estimate(step) -> float:
    """The drafter's own expectation of the accepted draft tokens: ``sum_{i >= 1} exp(node_logw_i)``."""
    return float(step.node_logws[1:].double().exp().sum())


def tau(step) -> int:
    """Observed tau of a step: accepted draft tokens + 1 (the bonus; 0 when the support was
    exhausted)."""
    return step.accept_length + (0 if bool(step.output.support_exhausted[0]) else 1)


def step_table(steps: Sequence) -> list[dict]:
    """One row per step: ``step``, ``request``, ``request_id``, ``setting`` (parameters as
    text), ``budget`` (draft nodes), ``observed`` accept length, ``expected`` (exact, see
    :func:`expected_accept_length`), ``drafter`` (:func:`drafter_estimate`) and ``tau``
    (observed + bonus)."""
    return [{"step": s.step, "request": s.request, "request_id": s.request_id, "setting": setting_label(s.params),
             "budget": s.num_nodes - 1, "observed": s.accept_length, "expected": expected_accept_length(s),
             "drafter": drafter_estimate(s), "tau": tau(s)} for s in steps]


def setting_label(params: SamplingParams) -> str:
    """Parameters as a short label: ``greedy`` or ``T=0.7 top-k=20 top-p=0.9 min-p=0.05``."""
    if params.is_greedy:
        return "greedy"
    parts = [f"T={params.temperature:g}"]
    if params.top_k > 0:
        parts.append(f"top-k={params.top_k}")
    if params.top_p < 1.0:
        parts.append(f"top-p={params.top_p:g}")
    if params.min_p:
        parts.append(f"min-p={params.min_p:g}")
    return " ".join(parts)


def sibling_ranks(parents: torch.Tensor) -> torch.Tensor:
    """``[n]`` int64: each node's position among its parent's children in sibling order
    (0 = first child; children are linked in ascending index = descending log-weight); root -1."""
    n = parents.shape[0]
    out = torch.full((n,), -1, dtype=torch.int64)
    seen: dict[int, int] = {}
    for i in range(1, n):
        p = int(parents[i])
        out[i] = seen.get(p, 0)
        seen[p] = int(out[i]) + 1
    return out


def acceptance_by_depth(steps: Sequence) -> dict[str, list]:
    """Acceptance at each depth ``d = 1..D`` over ``steps``.

    Returns:
        ``depth``; ``offered[d]``: steps whose accepted node at depth ``d-1`` has a child in the
        tree; ``accepted[d]``: steps that accepted a node at depth ``d``; ``rate`` =
        accepted / offered (None where nothing was offered); ``fraction`` = accepted / steps.
    """
    max_d = max((int(s.depths.max()) for s in steps), default=0)
    offered = [0] * (max_d + 1)
    accepted = [0] * (max_d + 1)
    for s in steps:
        path = s.accepted_path
        has_child = set(s.parents[1:].tolist())
        for d, node in enumerate(path):
            if d >= 1:
                accepted[d] += 1
            if node in has_child and d + 1 <= max_d:
                offered[d + 1] += 1
    depth = list(range(1, max_d + 1))
    return {"depth": depth, "offered": offered[1:], "accepted": accepted[1:],
            "rate": [a / o if o else None for a, o in zip(accepted[1:], offered[1:])],
            "fraction": [a / len(steps) if steps else None for a in accepted[1:]]}


def accepted_sibling_ranks(steps: Sequence) -> list[dict]:
    """For every accepted draft node: ``depth``, ``sibling_rank`` (position among its parent's
    children, 0 = first child) and ``draft_rank`` (the rank of its token in the drafter's
    top-k at that depth), with ``step``, ``request`` and ``setting`` -- long form for plots."""
    rows = []
    for s in steps:
        sib = sibling_ranks(s.parents)
        for node in s.accepted_path[1:]:
            rows.append({"step": s.step, "request": s.request, "setting": setting_label(s.params),
                         "depth": int(s.depths[node]), "sibling_rank": int(sib[node]),
                         "draft_rank": int(s.ranks[node])})
    return rows


def step_seconds(step) -> float:
    """Wall seconds of the step (sum of its stage timings; a batch's requests share them)."""
    return float(sum(v for v in step.timings.values() if isinstance(v, (int, float))))


def throughput(steps: Sequence) -> dict:
    """Tokens per second from the recorded stage timings.

    A batch step's timings are shared by its requests, so the batch rate counts each step
    number's time once: ``batch_tokens_per_s = sum emitted / sum_{step numbers} seconds``.
    ``per_request`` gives each request's emitted tokens over the time of the steps it was in;
    ``per_step`` each step number's emitted tokens (all requests) over its time.

    Returns:
        ``{"batch_tokens_per_s", "per_request": [{request, setting, tokens, seconds,
        tokens_per_s}], "per_step": [{step, tokens, seconds, tokens_per_s}]}``; rates are None
        where no time was recorded.
    """
    by_step: dict[int, list] = {}
    for s in steps:
        by_step.setdefault(s.step, []).append(s)
    per_step = []
    for k in sorted(by_step):
        tokens = sum(len(s.emitted) for s in by_step[k])
        sec = max(step_seconds(s) for s in by_step[k])
        per_step.append({"step": k, "tokens": tokens, "seconds": sec, "tokens_per_s": tokens / sec if sec > 0 else None})
    per_request = []
    for r in sorted({s.request for s in steps}):
        mine = [s for s in steps if s.request == r]
        tokens = sum(len(s.emitted) for s in mine)
        sec = sum(step_seconds(s) for s in mine)
        per_request.append({"request": r, "setting": setting_label(mine[0].params), "tokens": tokens, "seconds": sec,
                            "tokens_per_s": tokens / sec if sec > 0 else None})
    tok = sum(x["tokens"] for x in per_step)
    sec = sum(x["seconds"] for x in per_step)
    return {"batch_tokens_per_s": tok / sec if sec > 0 else None, "per_request": per_request, "per_step": per_step}


def sibling_conditioned_quality(steps: Sequence) -> list[dict]:
    """How often the drafter's best token at depth ``d + 1`` is the token the target emits
    there, split by what was accepted at depth ``d``.

    For each step and each depth ``d`` on its accepted path (``d = 0`` is the root) with a
    token emitted at depth ``d + 1`` (the accepted draft token there, or the bonus) and a
    drafter row for depth ``d + 1``: ``hit = emitted[d] == draft_token_ids[d, 0]``. The
    condition is ``after``: ``"root"`` (d = 0), ``"rank 0"`` (the node accepted at depth ``d``
    is the drafter's top token there) or ``"rank > 0"`` (a lower-ranked sibling). A block
    drafter proposes every depth's marginal at once, conditioned implicitly on its own top
    tokens, so its quality is expected to drop after a non-top-1 acceptance (DFlash, arXiv
    2602.06036; DDTree §5).

    Returns:
        long-form rows ``{setting, after, depth, hits, total, rate}`` per (setting, after,
        depth), plus rows with ``depth = "all"`` per (setting, after).
    """
    counts: dict[tuple, list[int]] = {}
    for s in steps:
        emitted = s.emitted
        path = s.accepted_path
        rows = s.draft_token_ids.shape[0]
        label = setting_label(s.params)
        for d, node in enumerate(path):
            if d >= len(emitted) or d >= rows:
                break
            after = "root" if d == 0 else ("rank 0" if int(s.ranks[node]) == 0 else "rank > 0")
            hit = int(emitted[d] == int(s.draft_token_ids[d, 0]))
            for key in ((label, after, d), (label, after, "all")):
                c = counts.setdefault(key, [0, 0])
                c[0] += hit
                c[1] += 1
    out = []
    for (label, after, d), (h, t) in sorted(counts.items(), key=lambda kv: (kv[0][0], kv[0][1], str(kv[0][2]))):
        out.append({"setting": label, "after": after, "depth": d, "hits": h, "total": t, "rate": h / t})
    return out


@dataclass
class LooksGreedy:
    """Verdict of :func:`looks_greedy` for one request.

    Attributes:
        request, setting: the request and its parameters as text.
        steps, tokens: steps and emitted tokens examined.
        argmax_tokens: emitted tokens that were the argmax of the row they were emitted from.
        log10_p: log10 of the probability, under the request's own (sampled) target law, that
            every examined token is the argmax: ``sum log10 max_v p(v)`` over their rows -- the
            p-value of "all argmax" if the verifier is lossless.
        flagged: a sampled request, at least ``min_tokens`` tokens, all argmax, and
            ``log10_p < log10(alpha)``.
    """

    request: int
    setting: str
    steps: int
    tokens: int
    argmax_tokens: int
    log10_p: float
    flagged: bool

    @property
    def message(self) -> str:
        if self.flagged:
            return (f"request {self.request} ({self.setting}) looks greedy: all {self.tokens} emitted tokens over "
                    f"{self.steps} steps were the target argmax (probability 10^{self.log10_p:.1f} for a lossless "
                    f"sampler)")
        return (f"request {self.request} ({self.setting}): {self.argmax_tokens} of {self.tokens} emitted tokens "
                f"were the argmax")


def looks_greedy(steps: Sequence, min_tokens: int = 16, alpha: float = 1e-3) -> list[LooksGreedy]:
    """Flag sampled requests whose emitted tokens were all the target argmax (issue: "a
    sampled request that accepted only argmax tokens over many steps").

    Each emitted token comes from a stored row: an accepted draft node from its parent's row
    (its probability is ``child_probs``), the bonus from the bonus node's row (looked up in
    the stored top-M). The argmax is the row's stored top-1 (``top_probs[row, 0]``); a token
    counts as argmax when its probability equals that maximum. If the verifier is lossless the
    emitted sequence follows the target law, so by the chain rule the probability that *all*
    examined tokens are argmax is the product of the row maxima along the observed path (the
    rows the tokens were emitted from): :attr:`LooksGreedy.log10_p`. Greedy requests are never
    flagged.

    Args:
        steps: recorded steps (any requests).
        min_tokens: fewest emitted tokens before a request can be flagged.
        alpha: flag when the all-argmax probability is below it.

    Returns:
        one :class:`LooksGreedy` per request, by request.
    """
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    out = []
    for r in sorted({s.request for s in steps}):
        mine = sorted((s for s in steps if s.request == r), key=lambda s: s.step)
        tokens = argmax = 0
        logp = 0.0
        for s in mine:
            path = s.accepted_path
            emitted = s.emitted
            for j, tok in enumerate(emitted):
                if j + 1 < len(path):  # accepted draft node path[j + 1]
                    node = path[j + 1]
                    row, p = int(s.parents[node]), float(s.child_probs[node])
                else:
                    row = s.bonus.node
                    ids = s.top_token_ids[row].tolist()
                    p = float(s.top_probs[row, ids.index(tok)]) if tok in ids else 0.0
                top = float(s.top_probs[row, 0])
                tokens += 1
                if p >= top:
                    argmax += 1
                if top > 0:
                    logp += math.log10(top)
        params = mine[0].params
        flagged = (not params.is_greedy and tokens >= min_tokens and argmax == tokens and logp < math.log10(alpha))
        out.append(LooksGreedy(r, setting_label(params), len(mine), tokens, argmax, logp, flagged))
    return out


# -- what a run would have done under other parameters (trace format v2) -------------------------

_V2_FIELDS = ("row_logit_ids", "row_logits", "row_logsumexp", "node_logits")


def _lse_slack(vocab_size: int) -> float:
    """Relative error allowed on ``exp(row_logsumexp)``: float64 summation over ``V`` terms
    (``gamma_V ~ V * 2^-53``) plus the exp / log roundings."""
    return (vocab_size + 16) * 2.0 ** -53


def token_prob_bounds(row_logits: torch.Tensor, row_logsumexp: torch.Tensor, vocab_size: int,
                      query_rows: torch.Tensor, query_pos: torch.Tensor, query_logits: torch.Tensor,
                      params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Bounds on a token's target probability in a row known only by its top ``M`` raw logits.

    The row transform is :func:`ddtree_lab.target_probs`'s, in real arithmetic: ``l / T ->
    top-k (keep >= k-th) -> renormalise -> top-p (keep t iff the mass strictly more probable
    than t is < top_p) -> renormalise -> min-p (keep p >= min_p * max p) -> renormalise``;
    ``T = 0``: one-hot at the argmax (lowest id on ties). Every filter keeps a set
    ``{v : l_v >= theta}``, so the final support is the top ``c`` stored tokens (ties kept
    together) plus, only when ``c = M``, some of the ``R = V - M`` unstored "tail" tokens.

    What is known of the tail: each tail logit ``x_r <= l_M`` (the M-th stored logit) and, from
    the full-row log-sum-exp, ``S_1 = sum_r e^{x_r} = e^{lse} - sum_{j<=M} e^{l_j}`` (allowing
    float64 rounding, :func:`_lse_slack`). With ``a = 1/T`` and ``y_r = e^{x_r}``, the tail mass
    at temperature ``T`` is ``S_T = sum_r y_r^a``, and

    * ``T < 1`` (``a > 1``, ``y^a`` convex): ``y_r^a <= y_r e^{l_M (a-1)}`` gives
      ``S_T <= e^{l_M (a-1)} S_1``; the power-mean inequality gives ``S_T >= R^{1-a} S_1^a``;
    * ``T > 1`` (``a < 1``): ``y_r^{a-1} >= e^{l_M (a-1)}`` gives ``S_T >= e^{l_M (a-1)} S_1``;
      power means give ``S_T <= R^{1-a} S_1^a``;
    * ``T = 1``: ``S_T = S_1``.

    Stage by stage (all in units of the top logit, ``e_j = e^{(l_j - l_1)/T}``, prefix sums
    ``P_c = sum_{j<c} e_j``):

    * top-k, ``k <= M``: exact top set ``{l_j >= l_k}``; tail kept only if ``l_k = l_M``
      (ties), then at most ``min(R, S_1 / e^{l_M})`` tokens of ``e^{l_M/T}`` each.
      ``M < k < V``: all stored kept; the ``k - M`` largest tail tokens hold at least
      ``(k-M)/R`` of ``S_T``. Off / ``k >= V``: all kept.
    * top-p: stored token ``j`` is kept iff ``P_{first tie of j} / (E_k + tail) < top_p``,
      decided when it holds (or fails) at both ends of the tail interval; the kept mass is at
      least ``top_p`` of the mass before the cut, which bounds the kept tail from below.
    * min-p: ``p_t / max p = e_t / e_1`` does not depend on the normaliser: exact for stored
      tokens and for a query's own logit; the kept tail is only bounded by ``[0, tail]``.

    A query token's probability is ``e_t / D`` with ``D`` the final support's mass; the bounds
    take ``D`` at its extremes given whether ``t`` is kept for sure, maybe, or never. Where
    the value depends only on stored logits (every ``k <= M`` without a tie at the M-th
    logit, or a top-p / min-p cut inside the stored tokens for every admissible tail) the
    interval is a point, up to float64 rounding.

    Args:
        row_logits: ``[R, M]`` float raw logits sorted descending (ties: ascending id).
        row_logsumexp: ``[R]`` float64, log-sum-exp of each full row at temperature 1.
        vocab_size: ``V >= M``.
        query_rows: ``[K]`` int64 row of each query.
        query_pos: ``[K]`` int64 position of the query token in its row's stored top ``M``,
            or -1 when it is not stored.
        query_logits: ``[K]`` float raw logit of the query token (used when ``query_pos == -1``).
        params: the :class:`SamplingParams` to analyse under (seed ignored).

    Returns:
        ``(lo, hi)``: ``[K]`` float64 with ``lo <= p <= hi``.

    Raises:
        ValueError: bad shapes, ``V < M``, or invalid params.
    """
    why = params.problem(vocab_size)
    if why is not None:
        raise ValueError(f"params: {why}")
    if row_logits.dim() != 2 or row_logsumexp.shape != row_logits.shape[:1]:
        raise ValueError(f"row_logits must be [R, M] and row_logsumexp [R]; got {tuple(row_logits.shape)} and "
                         f"{tuple(row_logsumexp.shape)}")
    num_rows, m = row_logits.shape
    if vocab_size < m:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the stored top-M {m}")
    k_q = query_rows.shape[0]
    if query_pos.shape != (k_q,) or query_logits.shape != (k_q,):
        raise ValueError("query_rows, query_pos and query_logits must be [K] each")
    l = row_logits.double()
    qpos = query_pos.long()
    stored = qpos >= 0
    pos_c = qpos.clamp(min=0)
    if params.is_greedy:
        one = (stored & (qpos == 0)).double()
        return one, one.clone()
    a = 1.0 / float(params.temperature)
    n_tail = vocab_size - m
    l1 = l[:, :1]
    lm = l[:, -1]
    z = (l - l1) * a  # [R, M] <= 0
    e = torch.exp(z)
    P = torch.cat([torch.zeros(num_rows, 1, dtype=torch.float64), e.cumsum(-1)], -1)  # [R, M + 1]
    idx = torch.arange(m).expand(num_rows, m)
    # tie groups in the sorted row: first index and one past the last index of each entry's group
    start = torch.ones(num_rows, m, dtype=torch.bool)
    start[:, 1:] = l[:, 1:] != l[:, :-1]
    first = torch.where(start, idx, torch.zeros_like(idx)).cummax(-1).values
    end_ = torch.ones(num_rows, m, dtype=torch.bool)
    end_[:, :-1] = l[:, :-1] != l[:, 1:]
    last1 = torch.where(end_, idx + 1, torch.full_like(idx, m)).flip(-1).cummin(-1).values.flip(-1)

    # tail mass at T = 1 (units of e^{l_1}) and at T
    ylm = torch.exp(lm - l1[:, 0])  # e^{l_M - l_1}
    if n_tail > 0:
        total = torch.exp(row_logsumexp.double() - l1[:, 0])
        s1 = total - torch.exp(l - l1).sum(-1)
        slack = _lse_slack(vocab_size) * total
        s1_lo = (s1 - slack).clamp(min=0.0)
        s1_hi = torch.minimum((s1 + slack).clamp(min=0.0), n_tail * ylm)
        s1_lo = torch.minimum(s1_lo, s1_hi)
        if a == 1.0:
            s_lo, s_hi = s1_lo, s1_hi
        else:
            def pm(s):  # R^{1-a} s^a, 0 at s = 0
                return torch.where(s > 0, torch.exp((1 - a) * math.log(n_tail) + a * torch.log(s.clamp(min=1e-300))),
                                   torch.zeros_like(s))

            def lin(s):  # e^{(l_M - l_1)(a-1)} s, 0 at s = 0
                return torch.where(s > 0, torch.exp((a - 1) * (lm - l1[:, 0]) + torch.log(s.clamp(min=1e-300))),
                                   torch.zeros_like(s))

            if a > 1.0:
                s_lo, s_hi = pm(s1_lo), lin(s1_hi)
            else:
                s_lo, s_hi = lin(s1_lo), pm(s1_hi)
            s_hi = torch.minimum(s_hi, n_tail * torch.exp(z[:, -1]))
            s_lo = torch.minimum(s_lo, s_hi)
    else:  # the top M is the whole row
        s1_lo = s1_hi = s_lo = s_hi = torch.zeros(num_rows, dtype=torch.float64)

    # top-k
    k = params.top_k
    tail_ok_k = torch.ones(num_rows, dtype=torch.bool)  # tail tokens may survive top-k
    tie_only = False  # top-k keeps only tail tokens tied with l_M
    if 0 < k <= m and k < vocab_size:
        kth = l[:, k - 1 : k]
        c_k = (l >= kth).sum(-1)
        tied = (lm == kth[:, 0]) & (n_tail > 0)
        n_tie = torch.minimum(torch.floor(s1_hi / ylm.clamp(min=1e-300)), torch.full_like(s1_hi, float(n_tail)))
        tau_hi = torch.where(tied, torch.minimum(s_hi, n_tie * torch.exp(z[:, -1])), torch.zeros_like(s_hi))
        tau_lo = torch.zeros_like(s_lo)
        tail_ok_k = tied
        tie_only = True
    elif m < k < vocab_size:
        c_k = torch.full((num_rows,), m, dtype=torch.int64)
        tau_lo = s_lo * (min(k - m, n_tail) / n_tail)
        tau_hi = s_hi
    else:
        c_k = torch.full((num_rows,), m, dtype=torch.int64)
        tau_lo, tau_hi = s_lo, s_hi
    tail_certain_k = not (0 < k < vocab_size)  # every tail token survives top-k
    e_k = P.gather(1, c_k[:, None])[:, 0]

    # top-p
    in_k = idx < c_k[:, None]
    if params.top_p < 1.0:
        above = P.gather(1, first)
        cert = in_k & (above / (e_k + tau_lo)[:, None] < params.top_p)
        poss = in_k & (above / (e_k + tau_hi)[:, None] < params.top_p)
        c_p_lo, c_p_hi = cert.sum(-1), poss.sum(-1)
        t_hi = torch.where(c_p_hi == m, tau_hi, torch.zeros_like(tau_hi))
        t_lo = torch.where(c_p_lo == m, (params.top_p * (e_k + tau_lo) - e_k).clamp(min=0.0), torch.zeros_like(tau_lo))
        t_lo = torch.minimum(t_lo, tau_lo)
    else:
        c_p_lo = c_p_hi = c_k
        t_hi, t_lo = tau_hi, tau_lo

    # min-p (ratio to the top token, independent of the normaliser)
    log_min_p = math.log(params.min_p) if params.min_p else -math.inf
    c_m = (z >= log_min_p).sum(-1)
    if params.min_p:
        t_lo = torch.zeros_like(t_lo)
    t_hi = torch.where(c_m == m, t_hi, torch.zeros_like(t_hi))

    c_lo = torch.minimum(torch.minimum(c_k, c_p_lo), c_m)
    c_hi = torch.minimum(torch.minimum(c_k, c_p_hi), c_m)
    t_hi = torch.where(c_hi == m, t_hi, torch.zeros_like(t_hi))
    t_lo = torch.where(c_lo == m, t_lo, torch.zeros_like(t_lo))

    # queries
    r = query_rows.long()
    ql = query_logits.double()
    e_q = torch.where(stored, e[r, pos_c], torch.exp((ql - l1[r, 0]) * a))
    P_lo = P.gather(1, c_lo[:, None])[:, 0]
    P_hi = P.gather(1, c_hi[:, None])[:, 0]
    # stored tokens
    d_min_s = torch.maximum(P_lo[r], P[r, last1[r, pos_c]]) + t_lo[r]
    d_max = P_hi[r] + t_hi[r]
    hi_s = torch.where(pos_c < c_hi[r], e_q / d_min_s, torch.zeros_like(e_q))
    lo_s = torch.where(pos_c < c_lo[r], e_q / d_max, torch.zeros_like(e_q))
    # tail tokens (their own logit known)
    keep_min_p = ((ql - l1[r, 0]) * a >= log_min_p) | (not params.min_p)
    poss_t = (c_hi[r] == m) & (t_hi[r] > 0) & keep_min_p & (e_q > 0)
    if tie_only:
        poss_t &= tail_ok_k[r] & (ql == lm[r])
    hi_t = torch.where(poss_t, e_q / (P[r, m] + torch.maximum(t_lo[r], e_q)), torch.zeros_like(e_q))
    cert_t = (c_lo[r] == m) & keep_min_p & (e_q > 0)
    if not tail_certain_k:
        cert_t &= False
    if params.top_p < 1.0:
        cert_t &= (1.0 - e_q / (e_k[r] + torch.maximum(tau_hi[r], e_q))) < params.top_p
    lo_t = torch.where(cert_t, e_q / (P[r, m] + torch.maximum(t_hi[r], e_q)), torch.zeros_like(e_q))
    lo = torch.where(stored, lo_s, lo_t)
    hi = torch.where(stored, hi_s, hi_t)
    # rounding: a point stays a point, bounds stay ordered and inside [0, 1]
    lo, hi = lo.clamp(0.0, 1.0), hi.clamp(0.0, 1.0)
    return torch.minimum(lo, hi), torch.maximum(lo, hi)


def _v2(step, name: str) -> torch.Tensor:
    value = getattr(step, name, None)
    if value is None:
        raise ValueError(f"step {step.step}, request {step.request}: no {name!r} (a trace format v1 step); re-analysis "
                         "needs trace format v2 (re-record the run)")
    return value


@dataclass
class TunerResult:
    """A re-analysis by :meth:`TunerData.analyse`. Intervals ``[lo, hi]`` bound the exact value
    (points where the stored data determine it); accept lengths count draft tokens.

    Attributes:
        params, budget: what was analysed (``budget``: ``B'``; each step uses
            ``min(B', its recorded B)``).
        node_lo, node_hi: ``[num_nodes]`` float64, each node's target probability in its
            parent's row (root: 1), all steps' nodes flat (see :class:`TunerData`).
        reach_lo, reach_hi: ``[num_nodes]`` probability that the walk accepts the node (0 for
            nodes beyond the budget).
        expected_lo, expected_hi: ``[num_steps]`` expected accepted draft tokens per step.
        cover_lo, cover_hi: ``[num_steps, D]`` target mass the tree covers at depth ``1..D``.
    """

    params: SamplingParams
    budget: int
    node_lo: torch.Tensor
    node_hi: torch.Tensor
    reach_lo: torch.Tensor
    reach_hi: torch.Tensor
    expected_lo: torch.Tensor
    expected_hi: torch.Tensor
    cover_lo: torch.Tensor
    cover_hi: torch.Tensor

    @property
    def mean_expected(self) -> tuple[float, float]:
        """``(lo, hi)`` of the mean expected accepted draft tokens over the steps."""
        return float(self.expected_lo.mean()), float(self.expected_hi.mean())

    @property
    def mean_tau(self) -> tuple[float, float]:
        """``(lo, hi)`` of the mean expected tau (accepted draft tokens + bonus)."""
        lo, hi = self.mean_expected
        return lo + 1.0, hi + 1.0

    @property
    def mean_cover(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``([D], [D])`` the mean covered mass per depth over the steps."""
        return self.cover_lo.mean(0), self.cover_hi.mean(0)

    @property
    def max_error(self) -> float:
        """Largest half-width of the per-step expected accept length intervals."""
        return float(((self.expected_hi - self.expected_lo) / 2).max()) if self.expected_lo.numel() else 0.0


class TunerData:
    """Many recorded steps packed once for fast re-analysis (:meth:`analyse`).

    Build with :meth:`from_steps` / :meth:`from_run` from format-v2 steps, which carry per
    node ``i``: ``row_logit_ids [n, M]`` int64 and ``row_logits [n, M]`` float32 (the top-M raw
    target logits of node i's row, descending, ties by ascending id), ``row_logsumexp [n]``
    float64 (the full row's log-sum-exp at temperature 1) and ``node_logits [n]`` float32 (the
    raw logit of node i's token in its parent's row; root NaN).

    Attributes (all steps' nodes flat, step by step in tree order):
        steps: the step records, in input order.
        vocab_size, top_m: ``V`` and ``M``.
        node_step, node_local, node_depth, node_parent: ``[num_nodes]`` int64 (``node_parent``:
            flat index, -1 for roots).
        recorded_budget, observed: ``[num_steps]`` int64 draft nodes and accepted draft tokens.
    """

    def __init__(self, steps: list, vocab_size: int, rows: torch.Tensor, lse: torch.Tensor, node_step, node_local,
                 node_depth, node_parent, query_nodes, query_rows, query_pos, query_logits):
        self.steps = steps
        self.vocab_size = int(vocab_size)
        self.top_m = int(rows.shape[1])
        self.rows, self.lse = rows, lse
        self.node_step, self.node_local, self.node_depth, self.node_parent = node_step, node_local, node_depth, node_parent
        self.query_nodes, self.query_rows, self.query_pos, self.query_logits = query_nodes, query_rows, query_pos, query_logits
        self.num_steps = len(steps)
        self.max_depth = int(node_depth.max()) if node_depth.numel() else 0
        self.recorded_budget = torch.tensor([s.num_nodes - 1 for s in steps], dtype=torch.int64)
        self.observed = torch.tensor([s.accept_length for s in steps], dtype=torch.int64)
        self._levels = [(node_depth == d).nonzero()[:, 0] for d in range(1, self.max_depth + 1)]
        self._level_parents = [node_parent[i] for i in self._levels]

    @classmethod
    def from_run(cls, run, steps: Sequence | None = None) -> "TunerData":
        """Pack a :class:`ddtree_lab.step.Run` (all its steps, or ``steps``); the vocabulary
        size comes from the run metadata (``vocab_size``, or the target's)."""
        vocab = run.metadata.get("vocab_size") or run.metadata.get("target", {}).get("vocab_size")
        if vocab is None:
            raise ValueError("run metadata has no 'vocab_size' (a trace format v1 run?); pass vocab_size to from_steps")
        return cls.from_steps(run.steps if steps is None else steps, int(vocab))

    @classmethod
    def from_steps(cls, steps: Sequence, vocab_size: int) -> "TunerData":
        """Pack format-v2 steps (class docstring).

        Raises:
            ValueError: no steps, a v1 step, or a field of the wrong shape (naming step,
                request and field).
        """
        steps = list(steps)
        if not steps:
            raise ValueError("no steps to analyse")
        rows, lses, n_step, n_local, n_depth, n_parent = [], [], [], [], [], []
        q_nodes, q_rows, q_pos, q_logits = [], [], [], []
        offset = row_offset = 0
        m = None
        for k, s in enumerate(steps):
            ids, logits, lse, node_logits = (_v2(s, f) for f in _V2_FIELDS)
            n = s.num_nodes
            where = f"step {s.step}, request {s.request}"
            if m is None:
                m = ids.shape[-1]
            if ids.shape != (n, m) or logits.shape != (n, m):
                raise ValueError(f"{where}: row_logit_ids {tuple(ids.shape)} / row_logits {tuple(logits.shape)} must be "
                                 f"[{n}, {m}] (one top-M row per node, the same M in every step)")
            if lse.shape != (n,) or node_logits.shape != (n,):
                raise ValueError(f"{where}: row_logsumexp and node_logits must be [{n}]")
            if m > vocab_size:
                raise ValueError(f"{where}: top-M {m} exceeds vocab_size {vocab_size}")
            parents = s.parents.long()
            # rows of the nodes that have children, in node order
            has_child = torch.zeros(n, dtype=torch.bool)
            if n > 1:
                has_child[parents[1:]] = True
            internal = has_child.nonzero()[:, 0]
            row_of = torch.full((n,), -1, dtype=torch.int64)
            row_of[internal] = torch.arange(internal.shape[0]) + row_offset
            rows.append(logits[internal].double())
            lses.append(lse[internal].double())
            n_step.append(torch.full((n,), k, dtype=torch.int64))
            n_local.append(torch.arange(n))
            n_depth.append(s.depths.long())
            n_parent.append(torch.where(parents >= 0, parents + offset, parents))
            if n > 1:
                child = torch.arange(1, n)
                tok = s.node_token_ids[1:].long()
                eq = ids[parents[1:]] == tok[:, None]
                pos = torch.where(eq.any(-1), eq.int().argmax(-1), torch.full_like(tok, -1))
                xl = node_logits[1:].double()
                if torch.isnan(xl).any() or torch.isposinf(xl).any():
                    bad = int(torch.nonzero(torch.isnan(xl) | torch.isposinf(xl))[0, 0]) + 1
                    raise ValueError(f"{where}, node {bad}: node_logits is NaN or +inf")
                q_nodes.append(child + offset)
                q_rows.append(row_of[parents[1:]])
                q_pos.append(pos)
                q_logits.append(xl)
            offset += n
            row_offset += internal.shape[0]
        cat = torch.cat
        empty_i, empty_f = torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.float64)
        return cls(steps, vocab_size, cat(rows), cat(lses), cat(n_step), cat(n_local), cat(n_depth), cat(n_parent),
                   cat(q_nodes) if q_nodes else empty_i, cat(q_rows) if q_rows else empty_i,
                   cat(q_pos) if q_pos else empty_i, cat(q_logits) if q_logits else empty_f)

    @property
    def num_nodes(self) -> int:
        return int(self.node_step.shape[0])

    def analyse(self, params: SamplingParams, budget: int | None = None) -> TunerResult:
        """Re-analyse every packed step under ``params`` and budget ``B'``.

        Each node's target probability in its parent's row comes from
        :func:`token_prob_bounds`; the tree of budget ``B'`` is the first ``B'`` draft nodes in
        tree order (best-first: a prefix of the pop order is the tree of the smaller budget,
        DDTree Algorithm 1); the expected accept length and the covered mass per depth follow
        as in the module docstring, with interval arithmetic (every term is a product of
        non-negative factors, so lower and upper bounds propagate factor by factor).

        Args:
            params: :class:`SamplingParams` (seed ignored).
            budget: ``B' >= 0``, or None for each step's recorded budget.

        Raises:
            ValueError: invalid params or budget.
        """
        if budget is None:
            budget = int(self.recorded_budget.max())
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
            raise ValueError(f"budget must be an int >= 0, got {budget!r}")
        lo_q, hi_q = token_prob_bounds(self.rows, self.lse, self.vocab_size, self.query_rows, self.query_pos,
                                       self.query_logits, params)
        n = self.num_nodes
        inside = self.node_local <= budget
        node_lo = torch.ones(n, dtype=torch.float64)
        node_hi = torch.ones(n, dtype=torch.float64)
        node_lo[self.query_nodes] = lo_q
        node_hi[self.query_nodes] = hi_q
        reach_lo = torch.ones(n, dtype=torch.float64)
        reach_hi = torch.ones(n, dtype=torch.float64)
        for nodes, parents in zip(self._levels, self._level_parents):
            reach_lo[nodes] = reach_lo[parents] * node_lo[nodes]
            reach_hi[nodes] = reach_hi[parents] * node_hi[nodes]
        draft = inside & (self.node_local > 0)
        reach_lo = torch.where(inside, reach_lo, torch.zeros_like(reach_lo))
        reach_hi = torch.where(inside, reach_hi, torch.zeros_like(reach_hi))
        s, d = self.num_steps, max(self.max_depth, 1)
        sel = draft.nonzero()[:, 0]
        exp_lo = torch.zeros(s, dtype=torch.float64).index_add_(0, self.node_step[sel], reach_lo[sel])
        exp_hi = torch.zeros(s, dtype=torch.float64).index_add_(0, self.node_step[sel], reach_hi[sel])
        flat = self.node_step[sel] * d + (self.node_depth[sel] - 1)
        cov_lo = torch.zeros(s * d, dtype=torch.float64).index_add_(0, flat, reach_lo[sel]).view(s, d)
        cov_hi = torch.zeros(s * d, dtype=torch.float64).index_add_(0, flat, reach_hi[sel]).view(s, d)
        return TunerResult(params, budget, node_lo, node_hi, reach_lo, reach_hi, exp_lo, exp_hi, cov_lo, cov_hi)

    def step_nodes(self, k: int) -> slice:
        """The flat node range of packed step ``k``."""
        if not 0 <= k < self.num_steps:
            raise IndexError(f"step index {k} out of range: {self.num_steps} steps packed")
        idx = (self.node_step == k).nonzero()[:, 0]
        return slice(int(idx[0]), int(idx[-1]) + 1)
