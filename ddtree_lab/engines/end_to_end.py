"""End-to-end audits of an engine's sampled-verify rule, draft sampling included.

The lab's chain audit (:mod:`ddtree_lab.engines.common`) takes the draft tokens and their
probabilities ``q`` as given. A q-aware rule is lossless only if ``q`` is exactly the law the
draft tokens were drawn from, so here the engine's *own* draft-side sampler draws the chain
and returns ``q``, the engine's own verify consumes both, and the audit judges what is emitted
(the accepted draft tokens, then the bonus token) against the exact law of the ideal rule,
summed over every draft chain the drafter could have drawn.

A case (:class:`RuleCase`) is small enough to enumerate:

* the **target** is Markov: the logits after a prefix are ``target_logits[i, last]``, with
  ``i`` the prefix's draft length and ``last`` its last token (the root for ``i = 0``), so the
  row that scores draft ``i + 1`` depends on the draft it follows, as in a real verify;
* the **drafter** is either DFlash 2's candidate lattice (:class:`SelectorDraft`: ``K``
  candidates per slot and the ``K x K`` transition scores ``build_lattice`` produces) walked at
  the request's temperature, or per-step draft logits (:class:`LogitsDraft`: base logits plus a
  bias by the previous token, as DSpark's Markov head adds) sampled at the draft temperature,
  or their argmax (one-hot drafts);
* each request of the batch has its own :class:`ddtree_lab.SamplingParams` (greedy rows,
  mixed greedy / sampled batches, temperatures other than 1, top-k / top-p).

Exact laws (:func:`exact_rule_law`), from the papers, not from any engine:

* ``"token-wise"``: Leviathan et al. 2023, Algorithm 1 -- draft ``t`` at position ``i`` is
  accepted with probability ``min(1, p_i(t) / q_i(t))``; the first rejection emits a token of
  ``max(p_i - q_i, 0)`` renormalised; after ``gamma`` acceptances the bonus is drawn from
  ``p_gamma``.
* ``"block"``: Sun et al. 2024, "Block Verification Accelerates Speculative Decoding"
  (arXiv:2403.10444), Algorithm 2 -- prefix weights ``w_0 = 1``,
  ``w_i = min(1, w_{i-1} p_{i-1}(d_i) / q_{i-1}(d_i))``; residual mass
  ``h_i = sum_x max(w_i p_i(x) - q_i(x), 0)`` for ``i < gamma``; from ``i = gamma`` down,
  ``i`` is accepted with probability ``h_i / (h_i + 1 - w_i)`` (``w_gamma`` at ``gamma``,
  1 where ``w_i = 1``); the bonus is drawn from ``max(w_i p_i - q_i, 0) / h_i`` (``p_gamma``
  at ``gamma``).

Both are lossless: the first emitted token's law is ``p_0`` (a test checks it on the
enumerated laws), and the rules differ in the law of the accept length. Target rows are the
lab's (:func:`ddtree_lab.target_probs`), so an engine's own temperature / top-k / top-p
transform is under the audit too. The statistics are the lab's (:mod:`ddtree_lab.audit`):
a G-test of the emitted sequences, the first emitted token and the accept length per request,
Bonferroni over those three and over the requests, at ``alpha = 1e-3``.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..audit import AuditReport, fit_counts
from ..sampling import SamplingParams, target_probs

__all__ = ["SelectorDraft", "LogitsDraft", "Rule", "RuleCase", "RuleReport", "RULE_LAWS", "target_rows", "draft_paths",
           "exact_rule_law", "audit_rule", "random_selector_case", "random_logits_case"]

#: The ideal rules whose exact law the audit computes (module docstring).
RULE_LAWS = ("token-wise", "block")


@dataclass
class SelectorDraft:
    """DFlash 2's candidate lattice for one request.

    Attributes:
        candidate_ids: ``[gamma, K]`` int64, the ``K`` candidate tokens of each slot (distinct
            within a slot).
        scores: ``[gamma, K, K]`` float32, ``scores[e, p, c]`` the score of candidate ``c`` of
            slot ``e`` after candidate ``p`` of slot ``e - 1`` (slot 0 follows the anchor and
            reads ``scores[0, 0]``), the layout of ``CandidateSelector.build_lattice``.
    """

    candidate_ids: torch.Tensor
    scores: torch.Tensor

    def __post_init__(self):
        g, k = self.candidate_ids.shape
        if tuple(self.scores.shape) != (g, k, k):
            raise ValueError(f"SelectorDraft.scores must be [gamma={g}, K={k}, K={k}], got {tuple(self.scores.shape)}")
        for e in range(g):
            ids = self.candidate_ids[e].tolist()
            if len(set(ids)) != k:
                raise ValueError(f"SelectorDraft.candidate_ids: slot {e} repeats a candidate ({ids})")

    @property
    def gamma(self) -> int:
        return int(self.candidate_ids.shape[0])


@dataclass
class LogitsDraft:
    """Per-step draft logits for one request (DSpark's Markov draft head, reduced).

    Attributes:
        base_logits: ``[gamma, V]`` float32, the draft's logits of each step.
        bias: ``[gamma, V, V]`` float32, ``bias[s, prev]`` added at step ``s`` after token
            ``prev`` (the Markov head's step bias).
        greedy: the draft is the argmax (one-hot ``q``) instead of a sample at the draft
            temperature.
    """

    base_logits: torch.Tensor
    bias: torch.Tensor
    greedy: bool = False

    def __post_init__(self):
        g, v = self.base_logits.shape
        if tuple(self.bias.shape) != (g, v, v):
            raise ValueError(f"LogitsDraft.bias must be [gamma={g}, V={v}, V={v}], got {tuple(self.bias.shape)}")

    @property
    def gamma(self) -> int:
        return int(self.base_logits.shape[0])

    def step_logits(self, step: int, prev: int) -> torch.Tensor:
        """``[V]`` float32: the draft logits of ``step`` after token ``prev``."""
        return self.base_logits[step] + self.bias[step, prev]


@dataclass
class RuleCase:
    """One end-to-end audit case (module docstring).

    Attributes:
        name: what the case is (for reports).
        root_token: the anchor token.
        target_logits: ``[gamma + 1, V, V]`` float32 Markov target: row ``[i, last]`` is the
            target's logits after a prefix of ``i`` draft tokens ending in ``last``.
        requests: one :class:`ddtree_lab.SamplingParams` per request of the batch.
        draft: the drafter (:class:`SelectorDraft` or :class:`LogitsDraft`), shared by the requests.
    """

    name: str
    root_token: int
    target_logits: torch.Tensor
    requests: list
    draft: SelectorDraft | LogitsDraft

    def __post_init__(self):
        g1, v, v2 = self.target_logits.shape
        if v != v2 or g1 != self.draft.gamma + 1:
            raise ValueError(f"RuleCase {self.name}: target_logits must be [gamma+1={self.draft.gamma + 1}, V, V], "
                             f"got {tuple(self.target_logits.shape)}")
        if not self.requests:
            raise ValueError(f"RuleCase {self.name}: no requests")
        if not 0 <= self.root_token < v:
            raise ValueError(f"RuleCase {self.name}: root_token {self.root_token} outside the vocabulary of {v}")

    @property
    def gamma(self) -> int:
        return self.draft.gamma

    @property
    def vocab_size(self) -> int:
        return int(self.target_logits.shape[-1])


def target_rows(case: RuleCase, params: SamplingParams) -> torch.Tensor:
    """``[gamma + 1, V, V]`` float64: the target's rows under ``params`` by the lab's transforms
    (:func:`ddtree_lab.target_probs`), row ``[i, last]`` as in :class:`RuleCase`."""
    rows = target_probs(case.target_logits.float(), [params] * (case.gamma + 1))
    return rows.double()


def _softmax(x: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.softmax(x.double() / temperature, -1)


def draft_paths(case: RuleCase, params: SamplingParams) -> list[tuple[float, list[int], torch.Tensor]]:
    """Every draft chain the drafter can draw for a request, with its probability and ``q``.

    The selector walks by inverse CDF at the request's temperature (the argmax for greedy
    requests, ``q`` then one-hot); a logits draft samples ``softmax(logits / T)`` at the
    request's temperature (its argmax for a greedy draft or request).

    Returns:
        ``(probability, draft tokens [gamma], q [gamma, V] float64)`` per chain of positive
        probability.
    """
    d = case.draft
    v = case.vocab_size
    greedy = params.is_greedy or (isinstance(d, LogitsDraft) and d.greedy)
    temp = max(float(params.temperature), 1e-5)
    out: list = []

    def rows_after(step: int, prev_index: int, prev_token: int) -> tuple[list[int], torch.Tensor]:
        if isinstance(d, SelectorDraft):
            s = d.scores[step, 0 if step == 0 else prev_index]
            probs = torch.zeros(d.scores.shape[-1], dtype=torch.float64)
            if greedy:
                probs[int(s.argmax())] = 1.0
            else:
                probs = _softmax(s, temp)
            return d.candidate_ids[step].tolist(), probs
        s = d.step_logits(step, prev_token)
        probs = torch.zeros(v, dtype=torch.float64)
        if greedy:
            probs[int(s.argmax())] = 1.0
        else:
            probs = _softmax(s, temp)
        return list(range(v)), probs

    def walk(step: int, prev_index: int, prev_token: int, weight: float, tokens: list, qs: list) -> None:
        if step == case.gamma:
            out.append((weight, list(tokens), torch.stack(qs)))
            return
        ids, probs = rows_after(step, prev_index, prev_token)
        q = torch.zeros(v, dtype=torch.float64)
        q[torch.tensor(ids)] = probs
        for k in torch.nonzero(probs > 0).flatten().tolist():
            walk(step + 1, k, ids[k], weight * float(probs[k]), tokens + [ids[k]], qs + [q])

    walk(0, 0, case.root_token, 1.0, [], [])
    return out


def _add(law: dict, key: tuple, w: float) -> None:
    if w > 0:
        law[key] = law.get(key, 0.0) + w


def _token_wise(law: dict, weight: float, drafts: list, p: list, q: torch.Tensor) -> None:
    stay = weight
    for i, t in enumerate(drafts):
        a = min(1.0, float(p[i][t] / q[i, t])) if q[i, t] > 0 else 0.0
        resid = (p[i] - q[i]).clamp(min=0.0)
        z = float(resid.sum())
        if a < 1.0 and z > 0:
            for x in torch.nonzero(resid > 0).flatten().tolist():
                _add(law, tuple(drafts[:i]) + (x,), stay * (1.0 - a) * float(resid[x]) / z)
        stay *= a
        if stay == 0.0:
            return
    for x in torch.nonzero(p[-1] > 0).flatten().tolist():
        _add(law, tuple(drafts) + (x,), stay * float(p[-1][x]))


def _block(law: dict, weight: float, drafts: list, p: list, q: torch.Tensor) -> None:
    g = len(drafts)
    w = [1.0]
    for i, t in enumerate(drafts):
        w.append(min(1.0, w[-1] * float(p[i][t] / q[i, t])) if q[i, t] > 0 else 0.0)
    resid, h, eta = [], [], []
    for i in range(g + 1):
        if i == g:
            r = p[g].clone()
            resid.append(r)
            h.append(float(r.sum()))
            eta.append(w[g])
            continue
        r = (w[i] * p[i] - q[i]).clamp(min=0.0)
        resid.append(r)
        h.append(float(r.sum()))
        eta.append(1.0 if i == 0 or w[i] >= 1.0 else (h[i] / (h[i] + 1.0 - w[i]) if w[i] > 0 else 0.0))
    above = 1.0
    for i in range(g, -1, -1):
        pi = above * eta[i]
        above *= 1.0 - eta[i]
        if pi <= 0 or h[i] <= 0:
            continue
        for x in torch.nonzero(resid[i] > 0).flatten().tolist():
            _add(law, tuple(drafts[:i]) + (x,), weight * pi * float(resid[i][x]) / h[i])


def exact_rule_law(case: RuleCase, request: int, rule: str) -> dict:
    """The exact law of the emitted sequence (accepted draft tokens, then the bonus) of
    request ``request`` under the ideal ``rule`` (:data:`RULE_LAWS`), summed over the draft
    chains of :func:`draft_paths`.

    Returns:
        ``{emitted token tuple: probability}`` (float64, positive entries).

    Raises:
        ValueError: an unknown rule or request.
    """
    if rule not in RULE_LAWS:
        raise ValueError(f"rule must be one of {RULE_LAWS}, got {rule!r}")
    if not 0 <= request < len(case.requests):
        raise ValueError(f"request {request}: the case has {len(case.requests)} requests")
    params = case.requests[request]
    rows = target_rows(case, params)
    law: dict = {}
    for weight, drafts, q in draft_paths(case, params):
        lasts = [case.root_token] + drafts
        p = [rows[i, lasts[i]] for i in range(case.gamma + 1)]
        (_token_wise if rule == "token-wise" else _block)(law, weight, drafts, p, q)
    return law


@dataclass(frozen=True)
class Rule:
    """One engine rule (``sglang_rules.RULES``, ``vllm_rules.RULES``): its draft side, verify, the ideal law it must match, its planted faults."""

    name: str
    draft: str
    verify: str
    law: str
    faults: tuple


@dataclass
class RuleReport:
    """The end-to-end audit of one engine rule on one case: one :class:`ddtree_lab.audit.AuditReport`
    per request (kind ``"sequence"``), combined.

    Attributes:
        rule: the engine rule (``sglang:dflash2-dspark`` ...).
        case_name, law: the case and the ideal rule judged against (:data:`RULE_LAWS`).
        reports: per request.
        alpha: the significance level.
        seconds: wall time of the engine calls.
    """

    rule: str
    case_name: str
    law: str
    reports: list
    alpha: float
    seconds: float = 0.0
    notes: list = field(default_factory=list)

    @property
    def p_value(self) -> float:
        """Bonferroni over the requests of each request's (already Bonferroni x3) p-value."""
        return min(1.0, len(self.reports) * min(r.p_value for r in self.reports))

    @property
    def rejected(self) -> bool:
        return self.p_value < self.alpha

    @property
    def draws(self) -> int:
        return sum(r.draws for r in self.reports)

    @property
    def verdict(self) -> str:
        if self.rejected:
            return "LOSSY (the emitted law differs from the exact one)"
        if all(r.single_outcome for r in self.reports):
            return "consistent with lossless, weakly (every request has a single possible outcome)"
        return "consistent with lossless"

    def text(self, k: int = 3) -> str:
        lines = [f"{self.rule} on {self.case_name}: judged against the {self.law} law, {self.draws} draws, "
                 f"p = {self.p_value:.3g} (Bonferroni over {len(self.reports)} requests), alpha {self.alpha:g}: "
                 f"{self.verdict}"]
        for r in self.reports:
            lines += ["  " + line for line in r.text(k).splitlines()]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _label(k) -> str:
    return " ".join(f"<{t}>" for t in k) if isinstance(k, tuple) else f"<{k}>"


def _report(rule: str, case: RuleCase, b: int, law: dict, outcomes: list, seed: int, alpha: float,
            law_name: str) -> AuditReport:
    counts = Counter(outcomes)
    fit = fit_counts("outcome (emitted sequence)", law, counts, _label)
    first_law: dict = {}
    depth_law: dict = {}
    for k, p in law.items():
        first_law[k[0]] = first_law.get(k[0], 0.0) + p
        depth_law[len(k) - 1] = depth_law.get(len(k) - 1, 0.0) + p
    first = fit_counts("first emitted token", first_law, Counter(k[0] for k in outcomes), _label)
    depth = fit_counts("accept length", depth_law, Counter(len(k) - 1 for k in outcomes), lambda d: f"{d} accepted")
    p = case.requests[b]
    name = f"{case.name}, request {b} ({'greedy' if p.is_greedy else f'T={p.temperature:g}'}" + \
        (f", top-k {p.top_k}" if p.top_k else "") + (f", top-p {p.top_p:g}" if p.top_p < 1 else "") + ")"
    return AuditReport(name, f"{rule} vs the {law_name} law", "sequence", len(outcomes), seed, alpha, fit, first, depth,
                       None, None, [])


def audit_rule(rule: str, run: Callable, case: RuleCase, law: str, draws: int = 2000, seed: int = 0,
               alpha: float = 1e-3, chunk: int = 256) -> RuleReport:
    """Run an engine rule end to end and judge each request's emitted law.

    Args:
        rule: the rule's name (for the report).
        run: ``run(case, copies, trial_seed) -> [[emitted tuple] * copies] * len(case.requests)``:
            one batch holding ``copies`` rows of every request, the engine's own draws seeded
            with ``trial_seed`` (each call a fresh trial).
        law: the ideal rule it must match (:data:`RULE_LAWS`).
        draws: draws per request.
        chunk: rows of each request per call.

    Raises:
        ValueError: draws < 1, an unknown law, or what the runner refuses.
    """
    import time

    if isinstance(draws, bool) or not isinstance(draws, int) or draws < 1:
        raise ValueError(f"audit_rule: draws must be an integer >= 1, got {draws!r}")
    laws = [exact_rule_law(case, b, law) for b in range(len(case.requests))]
    outcomes: list[list] = [[] for _ in case.requests]
    done, trial = 0, 0
    t0 = time.perf_counter()
    while done < draws:
        m = min(chunk, draws - done)
        got = run(case, m, seed * 1_000_003 + trial)
        for b, rows in enumerate(got):
            outcomes[b] += rows
        done += m
        trial += 1
    seconds = time.perf_counter() - t0
    reports = [_report(rule, case, b, laws[b], outcomes[b], seed, alpha, law) for b in range(len(case.requests))]
    return RuleReport(rule, case.name, law, reports, alpha, seconds)


def _markov_target(g: torch.Generator, gamma: int, vocab: int, scale: float) -> torch.Tensor:
    return torch.randn(gamma + 1, vocab, vocab, generator=g) * scale


def random_selector_case(seed: int = 0, requests: list | None = None, gamma: int = 3, vocab: int = 6,
                         top_k: int = 3, scale: float = 1.0, name: str | None = None) -> RuleCase:
    """A random DFlash 2 selector case: ``top_k`` distinct candidates per slot (the target's
    likelier tokens favoured so deep acceptances occur), random lattice scores, a Markov target."""
    if not 1 <= top_k <= vocab:
        raise ValueError(f"random_selector_case: need 1 <= top_k <= vocab, got top_k {top_k}, vocab {vocab}")
    g = torch.Generator().manual_seed(seed)
    target = _markov_target(g, gamma, vocab, scale)
    ids = torch.stack([torch.randperm(vocab, generator=g)[:top_k] for _ in range(gamma)])
    scores = torch.randn(gamma, top_k, top_k, generator=g) * scale
    for e in range(gamma):  # the target leans toward the slot's candidates, so deep acceptances occur
        target[e][:, ids[e]] += 1.5 * scale
    return RuleCase(name or f"selector case (seed {seed})", int(torch.randint(vocab, (1,), generator=g)), target,
                    list(requests or [SamplingParams(temperature=1.0)]), SelectorDraft(ids, scores))


def random_logits_case(seed: int = 0, requests: list | None = None, gamma: int = 3, vocab: int = 6,
                       greedy_draft: bool = False, scale: float = 1.0, name: str | None = None) -> RuleCase:
    """A random per-step draft logits case (a base row per step plus a bias by the previous
    token) with a Markov target whose rows lean toward the draft's, so deep acceptances occur."""
    g = torch.Generator().manual_seed(seed)
    target = _markov_target(g, gamma, vocab, scale)
    base = torch.randn(gamma, vocab, generator=g) * scale
    bias = torch.randn(gamma, vocab, vocab, generator=g) * (0.5 * scale)
    target[:gamma] += 0.5 * (base[:, None, :] + bias)  # target row [s, prev] scores the token draft step s draws after prev
    return RuleCase(name or f"logits case (seed {seed}{', greedy draft' if greedy_draft else ''})",
                    int(torch.randint(vocab, (1,), generator=g)), target,
                    list(requests or [SamplingParams(temperature=1.0)]), LogitsDraft(base, bias, greedy_draft))


def law_self_check(case: RuleCase, request: int, rule: str) -> float:
    """The largest gap between the first emitted token's law under ``rule`` and the target's
    ``p_0`` (a lossless rule: 0 up to float64 rounding). Used by the tests."""
    law = exact_rule_law(case, request, rule)
    p0 = target_rows(case, case.requests[request])[0, case.root_token]
    first = torch.zeros_like(p0)
    for k, p in law.items():
        first[k[0]] += p
    return float((first - p0).abs().max()) if math.isfinite(float(first.sum())) else math.inf
