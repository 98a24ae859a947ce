"""The tuner's re-analysis: a run's stored top-M raw logits under other sampling parameters and budgets, with error bounds."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from ..sampling import SamplingParams


__all__ = ["token_prob_bounds", "TunerData", "TunerResult"]


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


_V2_FIELDS = ("row_logit_ids", "row_logits", "row_logsumexp", "node_logits")
