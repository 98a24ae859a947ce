"""Check: which sampling transform explains the recorded rows (the recorded parameters, greedy, T = 1, the other order, a filter dropped).

At level ``full`` a step stores, per node row, the top-M raw logits (ids and values) and the
row's log-sum-exp. For a node whose token is among its parent's top-M logits, a candidate
transform's probability of that token is known exactly (when top-k / top-p cut inside the
top M) or within a proven interval (the tail's mass under temperature ``T`` is bounded by the
stored log-sum-exp and the M-th logit, module :func:`prob_interval`). The recorded child
probability must lie in the interval of the recorded parameters; where it does not, the
candidates whose intervals hold it at every node of the step are named ("the trace says
T = 0.8, the rows are T = 1").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
import math

import numpy as np

from ..sampling import SamplingParams
from ..step import Run, Step
from .common import CheckResult, Finding, group_findings, next_command

__all__ = ["check_sampling", "sampling_step", "prob_interval", "row_interval", "RowBounds", "candidates", "tail_bounds"]

#: The recorded probability may sit this far outside a candidate's interval (float32 rows).
ATOL, RTOL = 2e-5, 1e-3
#: A top-p cut this close to a running sum is not decided (float32 vs float64 sums).
CUT_MARGIN = 1e-4


def candidates(p: SamplingParams) -> dict[str, SamplingParams | str]:
    """The transforms tried for a request with parameters ``p`` (T > 0): the recorded ones,
    greedy, T = 1 (when T != 1), the other filtering order (when both top-k and top-p are on),
    top-p dropped (when on), min-p dropped (when on), the bans dropped (when any)."""
    out: dict[str, SamplingParams | str] = {"recorded": p, "sampling-greedy": "greedy"}
    if p.temperature != 1.0:
        out["sampling-temperature-1"] = dataclasses.replace(p, temperature=1.0)
    if p.top_k > 0 and p.top_p < 1.0:
        other = "top_p_then_top_k" if p.order == "top_k_then_top_p" else "top_k_then_top_p"
        out["sampling-other-order"] = dataclasses.replace(p, order=other)
    if p.top_p < 1.0:
        out["sampling-top-p-dropped"] = dataclasses.replace(p, top_p=1.0)
    if p.min_p:
        out["sampling-min-p-dropped"] = dataclasses.replace(p, min_p=None)
    if p.banned_token_ids:
        out["sampling-banned-token-kept"] = dataclasses.replace(p, banned_token_ids=())
    return out


def tail_bounds(s1: float, gap: float, t: float, rest: int) -> tuple[float, float]:
    """Bounds on the softmax mass at temperature ``t`` of the ``rest`` entries a top-M row does
    not store, in units of ``exp(s_0)`` (the row's top scaled logit). ``s1``: their mass at T = 1
    in units of ``exp(l_0)`` (from the stored log-sum-exp); ``gap = l_{M-1} - l_0 <= 0``: no
    unstored logit lies above the M-th. At T < 1 each unstored term shrinks by at least
    ``exp(gap (1/t - 1))``; at T > 1 each is at most ``exp(gap / t)``."""
    if t == 1.0:
        return (s1, s1)
    if t < 1.0:
        return (0.0, s1 * math.exp(gap * (1.0 / t - 1.0)))
    return (s1, max(rest, 0) * math.exp(gap / t))


# -- rows from the stored top-M raw logits -------------------------------------------------------


@dataclass(frozen=True)
class RowBounds:
    """One row under a transform, over the stored ids: ``lo`` / ``hi`` bounds ``[M]``, the
    bound ``other`` on any token outside the stored ids (0 when the transform keeps none)."""

    ids: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    other: float

    @property
    def exact(self) -> bool:
        return self.other == 0.0 and bool(np.all(self.hi - self.lo <= 1e-12 + 1e-9 * self.hi))

    def prob(self, token: int) -> tuple[float, float]:
        k = np.nonzero(self.ids == token)[0]
        if k.size:
            return float(self.lo[k[0]]), float(self.hi[k[0]])
        return 0.0, self.other


def _top_p_cut(e: np.ndarray, keep: np.ndarray, z_lo: float, z_hi: float, top_p: float) -> np.ndarray | None:
    """The top-p keep mask over the stored entries under normalisers in ``[z_lo, z_hi]``, or
    None when the cut is not decided inside them (as the sampling check decides it)."""
    masks = []
    for z in (z_lo, z_hi):
        probs = np.where(keep, e / z, 0.0)
        order = np.sort(probs)[::-1]
        cum = np.cumsum(order)
        reach = np.nonzero(cum >= top_p)[0]
        if reach.size == 0:
            return None
        k = int(reach[0])
        if abs(cum[k] - top_p) < CUT_MARGIN or (k > 0 and abs(cum[k - 1] - top_p) < CUT_MARGIN):
            return None
        masks.append(keep & (probs >= order[k]))
    return masks[0] if bool(np.array_equal(masks[0], masks[1])) else None


def row_interval(ids, logits, lse: float, cand: SamplingParams | str, vocab: int, twice: bool = False) -> RowBounds | None:
    """Bounds on a whole row's probabilities under ``cand`` from its stored top-M raw logits.

    Args:
        ids, logits: ``[M]`` the row's top-M raw logits (descending; ties by ascending id),
            tensors or arrays.
        lse: the row's float64 log-sum-exp over the whole vocabulary.
        cand: :class:`SamplingParams`, or ``"greedy"`` (one-hot at the argmax of the tokens
            not banned: pass the request's parameters through ``twice=False``).
        vocab: V.
        twice: apply ``cand``'s top-p a second time to the renormalised row (exact rows only).

    Returns:
        the row's bounds (:func:`prob_interval` reads one token from them), or None when a
        top-k tie or a top-p cut is not decided by the stored entries.
    """
    ids_a = np.asarray(ids.tolist() if hasattr(ids, "tolist") else ids, dtype=np.int64)
    m = ids_a.size
    if isinstance(cand, str):
        one = np.zeros(m)
        one[0] = 1.0
        return RowBounds(ids_a, one, one.copy(), 0.0)
    lf = np.asarray(logits.tolist() if hasattr(logits, "tolist") else logits, dtype=np.float32)
    t = float(cand.temperature)
    l = lf.astype(np.float64)
    s = (lf / np.float32(t)).astype(np.float64)
    e = np.exp(s - s[0])
    s1 = max(math.exp(lse - l[0]) - float(np.exp(l - l[0]).sum()), 0.0)
    tail = tail_bounds(s1, float(l[-1] - l[0]), t, vocab - m)
    banned = set(cand.banned_token_ids)
    allowed = np.array([i not in banned for i in ids_a.tolist()], dtype=bool)
    if banned:
        e = np.where(allowed, e, 0.0)
        if len(banned & set(ids_a.tolist())) < len(banned):
            tail = (0.0, tail[1])
    tail_full, keep = tail, allowed
    has_k = 0 < cand.top_k < vocab
    if has_k:
        kept = np.nonzero(allowed)[0]
        if cand.top_k <= kept.size:
            kth = s[kept[cand.top_k - 1]]
            if float(s[-1]) == float(kth) and vocab > m:
                return None
            keep, tail = allowed & (s >= kth), (0.0, 0.0)
        else:
            tail = (0.0, tail[1])
    if cand.top_p < 1.0:
        if cand.order == "top_k_then_top_p" or not has_k:
            base = float(e[keep].sum())
            mask = _top_p_cut(e, keep, base + tail[0], base + tail[1], cand.top_p)
        else:
            full = float(e.sum())
            mask = _top_p_cut(e, allowed, full + tail_full[0], full + tail_full[1], cand.top_p)
            mask = None if mask is None else mask & keep
        if mask is None:
            return None
        keep, tail = mask, (0.0, 0.0)
    if cand.min_p:
        top = float(e[keep].max()) if keep.any() else 0.0
        keep = keep & (e >= cand.min_p * top)
        tail = (0.0, 0.0) if float(e[-1]) < cand.min_p * top else (0.0, tail[1])
    ek = np.where(keep, e, 0.0)
    base = float(ek.sum())
    lo, hi = ek / (base + tail[1]), ek / (base + tail[0])
    row = RowBounds(ids_a, lo, hi, tail[1] / (base + tail[0]) if tail[1] > 0 else 0.0)
    if twice and cand.top_p < 1.0:
        if not row.exact:
            return None
        mask = _top_p_cut(lo, lo > 0, 1.0, 1.0, cand.top_p)
        if mask is None:
            return None
        p = np.where(mask, lo, 0.0)
        p = p / p.sum()
        row = RowBounds(ids_a, p, p.copy(), 0.0)
    return row



def prob_interval(ids, logits, lse: float, token: int, cand, vocab: int) -> tuple[float, float] | None:
    """``(lo, hi)`` bounds of ``token``'s probability under ``cand`` from one stored row, or None
    (:func:`row_interval` read at one token).

    Args:
        ids, logits: ``[M]`` the row's top-M raw logits (descending; ties by ascending id).
        lse: the row's float64 log-sum-exp over the whole vocabulary.
        token: the child's token id.
        cand: :class:`SamplingParams` or ``"greedy"`` (one-hot at the argmax).
        vocab: V.
    """
    row = row_interval(ids, logits, lse, cand, vocab)
    if row is None:
        return None
    if not isinstance(cand, str) and token in set(cand.banned_token_ids):
        return (0.0, 0.0)
    if not bool(np.any(row.ids == token)):  # outside the stored entries: bounded only when the transform keeps none
        return (0.0, 0.0) if row.other == 0.0 else None
    return row.prob(token)


def sampling_step(step: Step, vocab: int) -> tuple[int, dict[str, int], int | None, str] | None:
    """``(nodes decided, {candidate: nodes contradicting it}, first node contradicting the
    recorded parameters, its evidence)`` for one sampled step; None when no node was decided."""
    where = f"step {step.step}, request {step.request}"
    params = step.params
    if params is None:
        raise ValueError(f"{where}: no sampling parameters recorded")
    cands = candidates(params)
    bad = dict.fromkeys(cands, 0)
    decided, first, evidence = 0, None, ""
    node_parents, node_token_ids = step.parents, step.node_token_ids
    if node_parents is None or node_token_ids is None:
        raise ValueError(f"{where}: no tree recorded (parents, node_token_ids)")
    cp, parents, tokens = step.child_probs, node_parents.tolist(), node_token_ids.tolist()
    ids, logits, lse = step.row_logit_ids, step.row_logits, step.row_logsumexp
    if cp is None or ids is None or logits is None or lse is None:
        raise ValueError(f"{where}: no full target rows recorded (child_probs, row_logit_ids, row_logits, "
                         "row_logsumexp: level full, format v2)")
    for i in range(1, step.num_nodes):
        p = float(cp[i])
        if math.isnan(p):
            continue
        par = parents[i]
        got = {}
        for name, c in cands.items():
            iv = prob_interval(ids[par], logits[par], float(lse[par]), tokens[i], c, vocab)
            if iv is not None:
                got[name] = iv
        if "recorded" not in got:
            continue
        decided += 1
        for name, (lo, hi) in got.items():
            if not (lo - ATOL - RTOL * lo <= p <= hi + ATOL + RTOL * hi):
                bad[name] += 1
                if name == "recorded" and first is None:
                    first = i
                    evidence = (f"node {i} (token {tokens[i]}): recorded p = {p:.6g}, the recorded parameters "
                                f"({params.label()}) "
                                f"give {lo:.6g}" + (f"..{hi:.6g}" if hi - lo > 1e-9 else ""))
    return (decided, bad, first, evidence) if decided else None


_NAMES = {"sampling-greedy": "a request with T > 0 was verified greedily (its sampling parameters were dropped)",
          "sampling-temperature-1": "the verifier's rows are at temperature 1, not the request's temperature",
          "sampling-other-order": "the verifier's rows apply the other filtering order (top-p and top-k swapped)",
          "sampling-top-p-dropped": "the verifier's rows drop the request's top-p (the parameter never reached them)",
          "sampling-min-p-dropped": "the verifier's rows drop the request's min-p (the parameter never reached them)",
          "sampling-banned-token-kept": "the verifier's rows keep the tokens the request bans (its logits processors "
                                        "never reached them)"}


def banned_step(step: Step) -> tuple[int | None, str] | None:
    """``(node, evidence)`` where a step's rows or output keep a token its request bans (any
    level: the recorded child probabilities and the emitted tokens), or None."""
    if step.params is None:
        raise ValueError(f"step {step.step}, request {step.request}: no sampling parameters recorded")
    if step.node_token_ids is None:
        raise ValueError(f"step {step.step}, request {step.request}: no tree recorded (node_token_ids)")
    banned = set(step.params.banned_token_ids)
    cp, tokens = step.child_probs, step.node_token_ids.tolist()
    for i in range(1, step.num_nodes):
        if tokens[i] in banned and cp is not None and float(cp[i]) > 0.0:  # NaN compares False
            return i, f"node {i}: banned token {tokens[i]} has target p = {float(cp[i]):.6g} in its parent's row"
    if step.output is not None:
        hit = [t for t in step.emitted if t in banned]
        if hit:
            return None, f"emitted banned token {hit[0]}"
    return None


def check_sampling(run: Run, steps: list[Step] | None = None) -> CheckResult:
    """:func:`banned_step` on every step whose request bans tokens, then :func:`sampling_step`
    on every sampled step stored at level ``full``; the finding names the transform that
    explains the rows of the step (or none of the known ones)."""
    steps = run.steps if steps is None else steps
    result = CheckResult("sampling", ran=False)
    found, seen = [], set()  # seen: the (step, request) compared by either part
    for s in steps:
        if s.params is None or not s.params.banned_token_ids or s.tree is None:
            continue
        seen.add((s.step, s.request))
        got = banned_step(s)
        if got is not None:
            result.per_step[(s.step, s.request)] = "sampling-banned-token-kept"
            found.append(Finding("sampling", _NAMES["sampling-banned-token-kept"], "sampling-banned-token-kept",
                                 s.step, s.request, got[0], f"{got[1]} (the request bans "
                                 f"{list(s.params.banned_token_ids)})", "high",
                                 next_command("sampling", s.step, s.request)))
    bans_only = bool(seen)
    vocab = run.vocab_size
    eligible = [s for s in steps if s.params is not None and not s.params.is_greedy and s.rows is not None
                and s.row_logits is not None and s.row_logsumexp is not None and s.child_probs is not None]
    if vocab is None:
        eligible = []
        result.note = "the run does not say its vocabulary size: the transforms not checked"
    stats = []
    for s in eligible:
        if (s.step, s.request) in result.per_step:
            continue  # named above from the bans
        assert vocab is not None  # `eligible` is emptied above when the run has no vocabulary size
        got = sampling_step(s, vocab)
        if got is None:
            continue
        seen.add((s.step, s.request))
        stats.append((s, got))
    # the transform must explain every step of a request: candidates never contradicted there
    fits_of: dict[int, list[str]] = {}
    for s, (_, bad, _, _) in stats:
        fits = fits_of.setdefault(s.request, [n for n in bad if n != "recorded"])
        fits_of[s.request] = [n for n in fits if bad[n] == 0]
    for s, (decided, bad, first, evidence) in stats:
        if not bad["recorded"]:
            continue
        fits = fits_of[s.request]
        if len(fits) == 1:
            kind, fault, sure = _NAMES[fits[0]], fits[0], "high"
        else:
            kind = ("the rows follow none of the known transforms of the recorded sampling parameters"
                    if not fits else "the rows do not follow the recorded sampling parameters (" + " or ".join(fits) + ")")
            fault, sure = None, "medium"
        result.per_step[(s.step, s.request)] = fault or "unknown"
        found.append(Finding("sampling", kind, fault, s.step, s.request, first,
                             f"{evidence}; {bad['recorded']} of {decided} decided node(s) contradict them", sure,
                             next_command("sampling", s.step, s.request)))
    result.checked = len(seen)
    result.ran = result.checked > 0
    if not result.ran:
        sampled = any(s.params is not None and not s.params.is_greedy for s in steps)
        result.why = ("the run has no sampled step (T > 0) and no request with banned tokens" if not sampled else
                      "the run does not say its vocabulary size" if vocab is None else
                      "no sampled step (T > 0) stores its top-M raw logits (level full) with a node decided by them"
                      if not eligible else "no node's token is decided by the stored top-M logits")
    elif bans_only and not eligible:
        result.note = "only the bans checked: no sampled step stores its top-M raw logits (level full)"
    result.findings = group_findings(found)
    return result
