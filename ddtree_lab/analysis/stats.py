"""Statistics of recorded runs: exact expected accept length, acceptance by depth and sibling rank, throughput, looks-greedy.

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

from ..sampling import SamplingParams

__all__ = [
    "OFFERED_DEFINITION", "reach_probabilities", "expected_accept_length", "tau", "setting_label", "step_seconds", "drafter_estimate", "step_table", "acceptance_by_depth",
    "sibling_ranks", "accepted_sibling_ranks", "throughput", "sibling_conditioned_quality", "LooksGreedy",
    "looks_greedy",
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
    return params.label("=")


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


#: what "offered" counts in acceptance by depth, printed wherever the column or axis is shown.
OFFERED_DEFINITION = ("offered at depth d = steps whose walk reached depth d-1 at a node with a child in the tree "
                      "(a depth-d draft token was there to accept); rate = accepted / offered")


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


