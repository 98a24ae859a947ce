"""The audit's verdict: a verifier's empirical law over many coin sets against the exact law (G-tests), as a report.

Losslessness audit: the exact law of what a lossless verifier emits on one step, and a
statistical test of a verifier's empirical law against it.

A verify step is *lossless* when, over the coins, the tokens it emits have exactly the law of
sampling them one by one from the target (Leviathan et al. 2023, Chen et al. 2023; the
target-only tree rule of SGLang's ``tree_speculative_sampling_target_only`` and of
:func:`ddtree_lab.verify_sampled`). For one step -- a tree, the target's logits at its nodes
and the request's :class:`ddtree_lab.SamplingParams` -- that law is computable:

* ``"sequence"``: the whole emitted sequence, by enumeration (small trees and vocabularies):
  at node ``c`` draw ``v ~ p_c``; if a child of ``c`` carries ``v`` move there, else emit ``v``
  and stop; at a leaf emit ``v ~ p_leaf``.
* ``"first-depth"``: for real vocabularies, the joint law of the first emitted token and the
  accepted depth (accepted draft tokens): ``P(first = v, depth = 0) = p_root(v)`` for a token
  no child of the root carries, and ``P(first = t_c, depth = 1 + k) = p_root(t_c) R_c(k)``
  with ``R_c(k)`` the law of the further accepted depth below child ``c``
  (``R_c(0) = 1 - sum_children p_c(t)``). Its marginals are the first-token law ``p_root``
  and the accepted-depth law.

Children carrying a token already carried by an earlier sibling are not counted by the law
(a lossless verifier cannot emit that token more often than ``p_c(t)``): a tree with
duplicate sibling tokens is lossy, and the audit also lists the duplicates as a finding.

:func:`audit` draws many coin sets with a fixed seed, runs a verifier (``"reference"``,
``"torch-lazy"``, ``"triton"`` or any callable with :func:`ddtree_lab.verify_tree`'s
signature ``(verify_input, target_logits, params, coins, final_coins) -> VerifyOutput``),
and tests the observed outcome counts against the exact law with a G-test (cells with an
expected count below 5 are pooled; any observed outcome of probability 0 fails at once). It
also samples the first token with the plain (non-speculative) sampler under the same
parameters and compares both laws, so a filtering-order mismatch between verify and
sampling shows. :data:`PLANTED_FAULTS` holds the known lossy verifiers the tests and
``labs/05_audit.ipynb`` plant.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Callable, cast

import numpy as np
import torch

from .case import AuditCase
from .faults import PLANTED_FAULTS, planted_fault
from .law import exact_law
from .verifiers import Verifier, backend_verifier, plain_sample, reference_verifier, repeat_case

__all__ = ["AuditReport", "Cell", "FitResult", "fit_counts", "audit", "run_verifier", "resolve_verifier"]


# -- cases ------------------------------------------------------------------------------------


# -- exact law --------------------------------------------------------------------------------


# -- running a verifier -----------------------------------------------------------------------


# -- plain sampler ----------------------------------------------------------------------------


# -- planted faults ---------------------------------------------------------------------------


# -- the test ---------------------------------------------------------------------------------


@dataclass
class Cell:
    """One cell of the goodness-of-fit table."""

    label: str
    observed: int
    expected: float

    @property
    def residual(self) -> float:
        """Pearson residual ``(O - E) / sqrt(E)``."""
        return (self.observed - self.expected) / math.sqrt(self.expected) if self.expected > 0 else math.inf


@dataclass
class FitResult:
    """A G-test of observed counts against an exact law (pooled cells)."""

    what: str
    p_value: float
    statistic: float
    dof: int
    cells: list
    impossible: list

    def over(self, k: int = 5) -> list:
        return sorted(self.cells, key=lambda c: -c.residual)[:k]

    def under(self, k: int = 5) -> list:
        return sorted(self.cells, key=lambda c: c.residual)[:k]


def fit_counts(what: str, law: dict, counts: Counter, label: Callable, min_expected: float = 5.0) -> FitResult:
    """G-test of observed ``counts`` (outcome -> count) against an exact ``law`` (outcome ->
    probability): cells with an expected count below ``min_expected`` pooled, any observed
    outcome of probability 0 failing at once (p = 0). ``label(outcome)`` names a cell."""
    from scipy.stats import power_divergence

    total = sum(counts.values())
    impossible = [(label(k), c) for k, c in counts.items() if law.get(k, 0.0) <= 0.0]
    cells, pooled_o, pooled_e = [], 0, 0.0
    for k, p in sorted(law.items(), key=lambda kv: -kv[1]):
        e = p * total
        if e >= min_expected:
            cells.append(Cell(label(k), counts.get(k, 0), e))
        else:
            pooled_o += counts.get(k, 0)
            pooled_e += e
    if pooled_e > 0:
        if pooled_e < min_expected and cells:
            last = cells.pop()
            cells.append(Cell(f"{last.label} + {len(law) - len(cells) - 1} rare", last.observed + pooled_o,
                              last.expected + pooled_e))
        else:
            cells.append(Cell("(rare outcomes, pooled)", pooled_o, pooled_e))
    if impossible:
        return FitResult(what, 0.0, math.inf, max(len(cells) - 1, 0), cells, impossible)
    if len(cells) < 2:
        return FitResult(what, 1.0, 0.0, 0, cells, impossible)
    obs = np.array([c.observed for c in cells], dtype=np.float64)
    exp = np.array([c.expected for c in cells], dtype=np.float64)
    exp *= obs.sum() / exp.sum()
    stat, p = power_divergence(obs, exp, lambda_="log-likelihood")
    return FitResult(what, float(p), float(stat), len(cells) - 1, cells, impossible)


def _two_sample(a: Counter, b: Counter, label: Callable, min_expected: float = 5.0) -> FitResult:
    """G-test of homogeneity of two samples of first tokens (pooled rare cells)."""
    from scipy.stats import chi2_contingency

    keys = sorted(set(a) | set(b), key=lambda k: -(a.get(k, 0) + b.get(k, 0)))
    na, nb = sum(a.values()), sum(b.values())
    rows, labels, pool = [], [], [0, 0]
    for k in keys:
        x, y = a.get(k, 0), b.get(k, 0)
        if min(x + y, 1e9) * min(na, nb) / (na + nb) >= min_expected:
            rows.append([x, y])
            labels.append(label(k))
        else:
            pool[0] += x
            pool[1] += y
    if sum(pool):
        rows.append(pool)
        labels.append("(rare, pooled)")
    cells = [Cell(lbl, r[0], (r[0] + r[1]) * na / (na + nb)) for lbl, r in zip(labels, rows)]
    if len(rows) < 2:
        return FitResult("verify vs plain sampler (first token)", 1.0, 0.0, 0, cells, [])
    table = np.array(rows, dtype=np.float64).T
    # scipy types its result bunch loosely: (statistic, p-value, degrees of freedom, expected counts)
    stat, p, dof, _ = cast("tuple[float, float, int, np.ndarray]", chi2_contingency(table, lambda_="log-likelihood"))
    return FitResult("verify vs plain sampler (first token)", float(p), float(stat), int(dof), cells, [])


@dataclass
class AuditReport:
    """The audit of one verifier on one case.

    Attributes:
        case, verifier: what was audited.
        kind: ``"sequence"`` or ``"first-depth"``.
        draws, seed, alpha: the test's size, coin seed and significance level.
        law: the G-test of the verifier's outcomes (sequences, or (first token, depth)).
        first_token, depth: G-tests of the two marginals (``first-depth``: derived from the
            same draws).
        sampler: the plain sampler's first-token law against the exact one (or None).
        verify_vs_sampler: verify's first tokens against the plain sampler's (or None).
        findings: static reasons the step is lossy whatever the coins (thresholds < 1,
            duplicate sibling tokens).
    """

    case_name: str
    verifier: str
    kind: str
    draws: int
    seed: int
    alpha: float
    law: FitResult
    first_token: FitResult
    depth: FitResult
    sampler: FitResult | None
    verify_vs_sampler: FitResult | None
    findings: list

    @property
    def p_value(self) -> float:
        """The smallest p-value of the verifier's tests (law and marginals), Bonferroni x3."""
        return min(1.0, 3 * min(self.law.p_value, self.first_token.p_value, self.depth.p_value))

    @property
    def p_value_text(self) -> str:
        """The verdict's p-value with its combination named: ``"p = 1 (Bonferroni over the
        outcome, first-token and depth tests: min(1, 3 x 0.317))"``."""
        tests = (self.law, self.first_token, self.depth)
        smallest = min(r.p_value for r in tests)
        return (f"p = {self.p_value:.3g} (Bonferroni over the {', '.join(r.what for r in tests)} tests: "
                f"min(1, 3 x {smallest:.3g}))")

    @property
    def rejected(self) -> bool:
        """The verifier's empirical law differs from the exact one at level ``alpha``."""
        return self.p_value < self.alpha

    @property
    def single_outcome(self) -> bool:
        """The exact law is one outcome on this case (every test has 0 degrees of freedom): the
        audit then tests only that every draw gives it, which a lossy verifier may pass too."""
        return all(r.dof == 0 for r in (self.law, self.first_token, self.depth))

    @property
    def verdict(self) -> str:
        if self.rejected:
            return "LOSSY (the empirical law differs from the exact one)"
        if self.findings:
            return "LOSSY by construction (" + "; ".join(self.findings) + ")"
        if self.single_outcome:
            return ("consistent with lossless, weakly: the exact law is a single outcome on this case and every draw "
                    "gave it (0 degrees of freedom); a step with several possible outcomes tests more, "
                    "`ddtree-lab diagnose` the whole run")
        return "consistent with lossless"

    def text(self, k: int = 5) -> str:
        """The report as plain text: p-values, the most over- and under-represented outcomes,
        the verdict."""
        lines = [f"audit of {self.verifier} on {self.case_name}: {self.draws} draws (seed {self.seed}), "
                 f"G-test, alpha {self.alpha:g}"]
        for r in (self.law, self.first_token, self.depth, self.sampler, self.verify_vs_sampler):
            if r is None:
                continue
            lines.append(f"  {r.what}: p = {r.p_value:.3g} (G = {r.statistic:.4g}, {r.dof} dof, {len(r.cells)} cells)")
            for lbl, c in r.impossible[:k]:
                lines.append(f"    impossible outcome seen {c} times: {lbl}")
        lines.append("  most over-represented (observed / expected):")
        lines += [f"    {c.label}: {c.observed} / {c.expected:.1f}" for c in self.law.over(k) if c.residual > 0]
        lines.append("  most under-represented (observed / expected):")
        lines += [f"    {c.label}: {c.observed} / {c.expected:.1f}" for c in self.law.under(k) if c.residual < 0]
        for f in self.findings:
            lines.append(f"  finding: {f}")
        lines.append(f"  verdict: {self.verdict}; {self.p_value_text}")
        return "\n".join(lines)

    def figure(self, max_cells: int = 30):
        """A plotly figure: observed against expected counts of the law's cells (the cells with
        the largest |residual| first), with the verdict in the title."""
        import plotly.graph_objects as go

        cells = sorted(self.law.cells, key=lambda c: -abs(c.residual))[:max_cells]
        labels = [c.label for c in cells]
        fig = go.Figure([
            go.Bar(name="expected (exact law)", x=labels, y=[c.expected for c in cells]),
            go.Bar(name=f"observed ({self.verifier})", x=labels, y=[c.observed for c in cells]),
        ])
        fig.update_layout(barmode="group", title=f"{self.case_name}: {self.verdict}<br><sup>{self.p_value_text}</sup>",
                          xaxis_title=self.law.what, yaxis_title="count", height=420)
        return fig


def _findings(case: AuditCase, threshold_single: float, threshold_acc: float) -> list[str]:
    out = []
    if threshold_single < 1.0 or threshold_acc != 1.0:  # verify.is_lossy: anything else changes the rule
        out.append(f"lossy thresholds (threshold_single = {threshold_single}, threshold_acc = {threshold_acc}; "
                   "exact needs threshold_single >= 1 and threshold_acc == 1)")
    tokens = case.verify_input.node_token_ids[0].tolist()
    for node, kids in case.children().items():
        seen: dict[int, int] = {}
        for c in kids:
            if tokens[c] in seen:
                out.append(f"node {node}: children {seen[tokens[c]]} and {c} carry the same token "
                           f"{case.label(tokens[c])}")
            seen.setdefault(tokens[c], c)
    return out


def audit(case: AuditCase, verifier: Verifier | str = "reference", draws: int = 4000, seed: int = 0,
          kind: str = "auto", alpha: float = 1e-3, sampler: Callable | str | None = "lab",
          threshold_single: float = 1.0, threshold_acc: float = 1.0, chunk: int = 256,
          progress: Callable[[int], None] | None = None, validate: bool = True) -> AuditReport:
    """Audit ``verifier`` on ``case`` against the exact lossless law (module docstring).

    Args:
        case: the step (:class:`AuditCase`).
        verifier: ``"reference"``, ``"torch-lazy"``, ``"triton"``, a :data:`PLANTED_FAULTS`
            name, or a callable ``(verify_input, target_logits [bs, N, V], params, coins [bs, N],
            final_coins [bs]) -> VerifyOutput``.
        draws: coin sets drawn (a few thousand find the planted faults on real steps).
        seed: seeds the coins (and the sampler's coins with ``seed + 1``).
        kind: ``"sequence"``, ``"first-depth"`` or ``"auto"`` (see :func:`exact_law`).
        alpha: significance level of the verdict.
        sampler: the plain sampler to compare: ``"lab"`` (:func:`plain_sample`), ``None``, or
            a callable ``(logits_row [V], params, coins [D]) -> [D] int64``.
        threshold_single, threshold_acc: passed to the built-in backends (every value SGLang
            accepts); ``threshold_single < 1`` or ``threshold_acc != 1`` is reported lossy.
        chunk: copies of the step per verifier call.
        validate: the built-in backends check the buffers first (default, as every backend
            does); ``False`` lets them walk a tree they would refuse (e.g. duplicate sibling
            tokens) so its law can be measured.

    Returns:
        :class:`AuditReport` (``.text()``, ``.figure()``, ``.verdict``, ``.p_value``).

    Raises:
        ValueError: the verifier refused the step (the message names verifier, step and why),
            or draws is not an integer >= 1.
    """
    if isinstance(draws, bool) or not isinstance(draws, int) or draws < 1:
        raise ValueError(f"audit: draws must be an integer >= 1, got {draws!r}")
    fn, name = resolve_verifier(verifier, threshold_single, threshold_acc, validate)
    law = exact_law(case, kind)
    try:
        outcomes = run_verifier(case, fn, draws, seed, law.kind, chunk, threshold_single, threshold_acc, progress)
    except ValueError as exc:
        raise ValueError(f"{name} refused {case.name}: {exc}") from exc
    counts = Counter(outcomes)

    def lbl(k):
        if law.kind == "sequence":
            return " ".join(case.label(t) for t in k) or "(none)"
        return f"{case.label(k[0])} depth {k[1]}"

    fit = fit_counts("outcome (" + ("emitted sequence" if law.kind == "sequence" else "first token, accepted depth") + ")",
               law.probs, counts, lbl)
    first_counts = Counter((k[0] if k else -1) for k in outcomes) if law.kind == "sequence" else \
        Counter(k[0] for k in outcomes)
    depth_counts = Counter((len(k) - 1) for k in outcomes) if law.kind == "sequence" else Counter(k[1] for k in outcomes)
    first = fit_counts("first emitted token", law.first_token(), first_counts, case.label)
    depth = fit_counts("accepted depth", law.depth(), depth_counts, lambda d: f"depth {d}")
    sres = vs = None
    if sampler is not None:
        if sampler == "lab":
            sfn = plain_sample
        elif callable(sampler):
            sfn = sampler
        else:
            raise ValueError(f"audit: sampler must be 'lab', None or a callable, got {sampler!r}")
        g = torch.Generator().manual_seed(seed + 1)
        coins = torch.rand(draws, generator=g, dtype=torch.float32)
        toks = sfn(case.logits[0], case.params, coins).tolist()
        scounts = Counter(int(t) for t in toks)
        sres = fit_counts("plain sampler (first token)", law.first_token(), scounts, case.label)
        vs = _two_sample(first_counts, scounts, case.label)
    return AuditReport(case.name, name, law.kind, draws, seed, alpha, fit, first, depth, sres, vs,
                       _findings(case, threshold_single, threshold_acc))


def resolve_verifier(verifier: Verifier | str, threshold_single: float, threshold_acc: float,
                     validate: bool = True) -> tuple[Verifier, str]:
    if callable(verifier):
        return verifier, getattr(verifier, "__name__", "callable")
    if verifier == "reference":
        return reference_verifier(threshold_single, threshold_acc, validate), "reference"
    if verifier in ("torch-lazy", "triton"):
        return backend_verifier(verifier, threshold_single, threshold_acc, validate), verifier
    if verifier in PLANTED_FAULTS:
        return planted_fault(verifier), f"planted fault: {verifier}"
    raise ValueError(f"verifier must be 'reference', 'torch-lazy', 'triton', a planted fault "
                     f"({', '.join(PLANTED_FAULTS)}) or a callable, got {verifier!r}")


def run_verifier(case: AuditCase, verifier: Verifier | str = "reference", draws: int = 4000, seed: int = 0,
                 kind: str = "first-depth", chunk: int = 256, threshold_single: float = 1.0,
                 threshold_acc: float = 1.0, progress: Callable[[int], None] | None = None) -> list:
    """Outcomes of ``draws`` verifications of ``case`` with independent coins (fixed ``seed``).

    The verifier is called on chunks of ``chunk`` copies of the step (``target_logits`` is
    ``case.logits`` expanded, stride 0 on the batch), coins from ``torch.rand`` of a
    generator seeded with ``seed``.

    Returns:
        one outcome per draw: the emitted token tuple (``kind="sequence"``) or
        ``(first emitted token or -1, accept_length)``.
    """
    fn, _ = resolve_verifier(verifier, threshold_single, threshold_acc)
    if kind not in ("sequence", "first-depth"):
        raise ValueError(f"kind must be 'sequence' or 'first-depth', got {kind!r}")
    g = torch.Generator().manual_seed(seed)
    n = case.verify_input.num_rows
    outcomes: list = []
    done = 0
    while done < draws:
        m = min(chunk, draws - done)
        coins = torch.rand(m, n, generator=g, dtype=torch.float32)
        final = torch.rand(m, generator=g, dtype=torch.float32)
        vi = repeat_case(case.verify_input, m)
        logits = case.logits[None].expand(m, -1, -1)
        out = fn(vi, logits, [case.params] * m, coins, final)
        emitted = out.emitted_tokens.tolist()
        lengths = out.accept_length.tolist()
        for row, a in zip(emitted, lengths):
            toks = tuple(t for t in row if t >= 0)
            outcomes.append(toks if kind == "sequence" else ((toks[0] if toks else -1), int(a)))
        done += m
        if progress is not None:
            progress(m)
    return outcomes
