"""Losslessness audit: the exact law of what a lossless verifier emits on one step, and a
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

import dataclasses
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

from .retrieve import DDTreeVerifyInput, find_retrieve_problem, tree_attention_mask
from .sampling import SamplingParams, normalize_params, target_probs
from .verify import VerifyOutput, verify_sampled, walk_sampled_batch

__all__ = [
    "AuditCase", "ExactLaw", "AuditReport", "exact_law", "audit", "run_verifier", "case_from_step",
    "case_from_logits", "random_case", "step_logits", "plant_duplicate_sibling", "plain_sample",
    "target_probs_topp_first", "PLANTED_FAULTS", "planted_fault",
]

Verifier = Callable[..., VerifyOutput]


# -- cases ------------------------------------------------------------------------------------


@dataclass
class AuditCase:
    """One verify step to audit (a batch of one).

    Attributes:
        verify_input: the step's buffers, batch of one (``N`` rows).
        logits: ``[N, V]`` float32 target logits of the tree nodes (row ``i``: after node ``i``).
        params: the request's sampling parameters.
        name: what this case is (for reports).
        texts: token id -> text, for labels (optional).
    """

    verify_input: DDTreeVerifyInput
    logits: torch.Tensor
    params: SamplingParams
    name: str = "step"
    texts: dict = field(default_factory=dict)

    def __post_init__(self):
        vi = self.verify_input
        if not isinstance(vi, DDTreeVerifyInput) or vi.batch_size != 1:
            raise ValueError("AuditCase.verify_input must be a DDTreeVerifyInput with one request")
        if self.logits.dim() != 2 or self.logits.shape[0] != vi.num_rows:
            raise ValueError(f"AuditCase.logits must have shape [N={vi.num_rows}, V], got {tuple(self.logits.shape)}")
        problem = find_retrieve_problem(vi.retrieve_next_token, vi.retrieve_next_sibling, vi.num_nodes)
        if problem is not None:
            raise ValueError(f"AuditCase {self.name}: the tree's buffers are broken: {problem}")

    @property
    def vocab_size(self) -> int:
        return int(self.logits.shape[1])

    def probs(self, params: SamplingParams | None = None) -> torch.Tensor:
        """``[N, V]`` float32: the target rows under ``params`` (default: the case's)."""
        return target_probs(self.logits[None].float(), params or self.params, self.verify_input.num_nodes)[0]

    def children(self) -> dict[int, list[int]]:
        """node -> its children in sibling order."""
        vi = self.verify_input
        n = int(vi.num_nodes[0])
        nt, ns = vi.retrieve_next_token[0].tolist(), vi.retrieve_next_sibling[0].tolist()
        out = {}
        for i in range(n):
            kids, c = [], nt[i]
            while c != -1:
                kids.append(c)
                c = ns[c]
            out[i] = kids
        return out

    def label(self, token: int) -> str:
        if token < 0:
            return "(none)"
        text = self.texts.get(int(token))
        return repr(text) if text is not None else f"<{int(token)}>"


def _verify_input_from_parents(tokens: torch.Tensor, parents: torch.Tensor, prefix_len: int = 0,
                               order: torch.Tensor | None = None) -> DDTreeVerifyInput:
    """Buffers of one tree given ``[n]`` tokens and parents (children linked in index order,
    or in descending ``order`` when given)."""
    n = tokens.shape[0]
    nt, ns = [-1] * n, [-1] * n
    kids: dict[int, list[int]] = {}
    for i in range(1, n):
        kids.setdefault(int(parents[i]), []).append(i)
    depths = [0] * n
    for i in range(1, n):
        depths[i] = depths[int(parents[i])] + 1
    for p, ks in kids.items():
        if order is not None:
            ks = sorted(ks, key=lambda i: (-float(order[i]), i))
        nt[p] = ks[0]
        for a, b in zip(ks, ks[1:]):
            ns[a] = b
    num = torch.tensor([n])
    d = torch.tensor(depths, dtype=torch.int64)[None]
    return DDTreeVerifyInput(
        node_token_ids=tokens.long()[None].clone(), retrieve_index=torch.arange(n)[None],
        retrieve_next_token=torch.tensor([nt]), retrieve_next_sibling=torch.tensor([ns]),
        tree_mask=tree_attention_mask(parents.long()[None], num), positions=d + prefix_len, depths=d, num_nodes=num)


def case_from_logits(step, logits: torch.Tensor, params: SamplingParams | None = None, texts=None,
                     name: str | None = None) -> AuditCase:
    """An :class:`AuditCase` from a recorded :class:`ddtree_lab.StepTrace` and the target's
    full ``[n, V]`` logits of its nodes (e.g. from :func:`step_logits`)."""
    return AuditCase(step.verify_input(), logits.float(), params or step.params,
                     name or f"step {step.step}, request {step.request}", dict(texts or {}))


def case_from_step(step, texts=None) -> AuditCase:
    """An :class:`AuditCase` from a recorded step alone (no model), on a reduced vocabulary.

    A trace stores each node's token probability in its parent's row exactly and the rows'
    top-M tokens; the case's vocabulary is those tokens plus one *rest* token holding each
    row's remaining mass. Its logits are the log of the recorded (final, already filtered)
    probabilities with parameters temperature 1 and no filtering (greedy steps: temperature 0
    on the softmax rows), so the audit checks the walk and the final draw, not the
    temperature / top-k / top-p transforms (use :func:`step_logits` and a model for those).
    The accepted-depth law is exact; the first-token law is exact on the stored tokens and
    pools the rest (a fault that only moves mass among unstored tokens, e.g. a reused coin
    on a bundle that stores no display rows, is invisible there: audit with a model).

    Raises:
        ValueError: a step with no stored rows.
    """
    n = step.num_nodes
    where = f"step {step.step}, request {step.request}"
    if step.child_probs is None or step.node_token_ids is None:
        raise ValueError(f"{where}: the trace stores no target probabilities (recording level "
                         f"{getattr(step, 'level', '?')}); audit it with a model")
    missing = torch.isnan(step.child_probs[1:]).nonzero().flatten().add(1).tolist()
    if missing:
        raise ValueError(f"{where}: child_probs missing at nodes {missing[:5]} (recording level "
                         f"{getattr(step, 'level', '?')}); audit a full trace, or give a model")
    top_ids = step.top_token_ids if step.top_token_ids is not None else torch.zeros(n, 0, dtype=torch.int64)
    top_p = step.top_probs if step.top_probs is not None else torch.zeros(n, 0)
    ids = sorted(set(top_ids.flatten().tolist()) | set(step.node_token_ids.tolist()))
    ids = [t for t in ids if t >= 0]
    index = {t: k for k, t in enumerate(ids)}
    rest = len(ids)
    probs = torch.zeros(n, rest + 1, dtype=torch.float64)
    for i in range(n):
        for t, p in zip(top_ids[i].tolist(), top_p[i].tolist()):
            if t >= 0 and p == p:
                probs[i, index[t]] = p
    for i in range(1, n):
        probs[int(step.parents[i]), index[int(step.node_token_ids[i])]] = float(step.child_probs[i])
    probs[:, rest] = (1.0 - probs[:, :rest].sum(-1)).clamp(min=0.0)
    probs = probs / probs.sum(-1, keepdim=True)
    tokens = torch.tensor([index[int(t)] for t in step.node_token_ids.tolist()])
    vi = _verify_input_from_parents(tokens, step.parents, step.prefix_len)
    # keep the recorded sibling order
    vi = dataclasses.replace(vi, retrieve_next_token=step.retrieve_next_token[None].clone(),
                             retrieve_next_sibling=step.retrieve_next_sibling[None].clone())
    logits = torch.log(probs.float())
    params = SamplingParams(temperature=0.0) if step.params.is_greedy else SamplingParams(temperature=1.0)
    src = dict(texts or {})
    names = {k: src.get(t, f"<{t}>") for t, k in index.items()}
    names[rest] = "(rest)"
    return AuditCase(vi, logits, params, f"step {step.step}, request {step.request} (trace rows)", names)


def random_case(seed: int = 0, num_nodes: int = 6, vocab_size: int = 8, params: SamplingParams | None = None,
                scale: float = 2.0) -> AuditCase:
    """A random small tree (distinct sibling tokens) with random logits, for sequence-law audits."""
    g = torch.Generator().manual_seed(seed)
    parents = [-1]
    tokens = [int(torch.randint(vocab_size, (1,), generator=g))]
    used: dict[int, set] = {}
    for i in range(1, num_nodes):
        for _ in range(100):
            p = int(torch.randint(i, (1,), generator=g))
            free = [t for t in range(vocab_size) if t not in used.get(p, set())]
            if free:
                break
        t = free[int(torch.randint(len(free), (1,), generator=g))]
        used.setdefault(p, set()).add(t)
        parents.append(p)
        tokens.append(t)
    logits = torch.randn(num_nodes, vocab_size, generator=g) * scale
    vi = _verify_input_from_parents(torch.tensor(tokens), torch.tensor(parents))
    return AuditCase(vi, logits, params or SamplingParams(temperature=1.0), f"random case (seed {seed})")


@torch.no_grad()
def step_logits(target, run, step) -> torch.Tensor:
    """The target's full ``[n, V]`` float32 logits at a recorded step's tree nodes: prefill the
    committed prefix of the step's request, then one tree forward (the session's own path).

    Args:
        target: a :class:`ddtree_lab.models.TargetModel` (the one the trace was recorded with).
        run: the :class:`ddtree_lab.RunTrace` (its metadata gives the prompt and generated ids).
        step: one of ``run.steps``.

    Raises:
        ValueError: the trace lacks the request's token ids, or the step's prefix is longer
            than them.
    """
    reqs = {int(r["request"]): r for r in run.metadata.get("requests", [])}
    if step.request not in reqs:
        raise ValueError(f"request {step.request}: the trace's metadata has no token ids for it")
    r = reqs[step.request]
    committed = list(r["prompt_token_ids"]) + list(r["generated_token_ids"])
    if step.prefix_len >= len(committed) or committed[step.prefix_len] != step.anchor_token_id:
        raise ValueError(f"step {step.step}, request {step.request}: the recorded tokens do not reach the root "
                         f"at position {step.prefix_len}")
    cache, _, _ = target.prefill(committed[: step.prefix_len])
    return target.tree_forward(cache, step.verify_input(), 0).logits.float().cpu()


def plant_duplicate_sibling(case: AuditCase) -> AuditCase:
    """The case with one root child's token replaced by the token of the root's most probable
    child (two siblings then carry the same token: a lossy tree).

    Raises:
        ValueError: the root has fewer than two children.
    """
    kids = case.children()[0]
    if len(kids) < 2:
        raise ValueError(f"{case.name}: the root has {len(kids)} children; a duplicate needs two")
    p = case.probs()[0]
    tokens = case.verify_input.node_token_ids.clone()
    best = max(kids, key=lambda c: float(p[tokens[0, c]]))
    other = next(c for c in kids if c != best)
    tokens[0, other] = tokens[0, best]
    vi = dataclasses.replace(case.verify_input, node_token_ids=tokens)
    return AuditCase(vi, case.logits, case.params, case.name + " + duplicate sibling", case.texts)


# -- exact law --------------------------------------------------------------------------------


@dataclass
class ExactLaw:
    """The exact law of a lossless verifier's outcome on one case.

    ``kind`` is ``"sequence"`` (outcome: the emitted token tuple) or ``"first-depth"``
    (outcome: ``(first emitted token, accepted depth)``); ``probs`` maps outcome -> probability
    (float64, only positive entries).
    """

    kind: str
    probs: dict

    def first_token(self) -> dict:
        out: dict = {}
        for k, p in self.probs.items():
            t = k[0] if k else -1
            out[t] = out.get(t, 0.0) + p
        return out

    def depth(self) -> dict:
        out: dict = {}
        for k, p in self.probs.items():
            d = len(k) - 1 if self.kind == "sequence" else k[1]
            out[d] = out.get(d, 0.0) + p
        return out


def _dedup(kids: list[int], tokens: list[int]) -> list[int]:
    seen, out = set(), []
    for c in kids:
        if tokens[c] not in seen:
            seen.add(tokens[c])
            out.append(c)
    return out


def exact_law(case: AuditCase, kind: str = "auto", max_outcomes: int = 200_000) -> ExactLaw:
    """The exact law of what a lossless verifier emits on ``case`` (module docstring).

    Args:
        kind: ``"sequence"``, ``"first-depth"`` or ``"auto"`` (sequence when ``N * V`` is at
            most 4096).
        max_outcomes: refuse a sequence enumeration larger than this.

    Returns:
        :class:`ExactLaw` (probabilities in float64 from the float32 target rows).

    Raises:
        ValueError: unknown kind, or an enumeration too large.
    """
    if kind == "auto":
        kind = "sequence" if case.verify_input.num_rows * case.vocab_size <= 4096 else "first-depth"
    if kind not in ("sequence", "first-depth"):
        raise ValueError(f"kind must be 'sequence', 'first-depth' or 'auto', got {kind!r}")
    probs = case.probs().double().cpu().numpy()
    tokens = case.verify_input.node_token_ids[0].tolist()
    kids = {i: _dedup(k, tokens) for i, k in case.children().items()}
    if kind == "sequence":
        law: dict = {}

        def walk(node: int, prefix: tuple, weight: float) -> None:
            child_of = {tokens[c]: c for c in kids[node]}
            row = probs[node]
            for v in np.nonzero(row > 0)[0].tolist():
                w = weight * row[v]
                if v in child_of:
                    walk(child_of[v], prefix + (v,), w)
                else:
                    law[prefix + (v,)] = law.get(prefix + (v,), 0.0) + w
                    if len(law) > max_outcomes:
                        raise ValueError(f"{case.name}: more than {max_outcomes} sequences; use kind='first-depth'")

        walk(0, (), 1.0)
        return ExactLaw("sequence", law)
    # first-depth: R[c] = law of the further accepted depth below c
    order = []
    stack = [0]
    while stack:
        c = stack.pop()
        order.append(c)
        stack.extend(kids[c])
    rest: dict[int, np.ndarray] = {}
    for c in reversed(order):
        r = np.zeros(1)
        stop = 1.0
        for k in kids[c]:
            p = float(probs[c, tokens[k]])
            if p <= 0:
                continue
            stop -= p
            sub = np.concatenate([[0.0], p * rest[k]])
            if sub.shape[0] > r.shape[0]:
                r = np.pad(r, (0, sub.shape[0] - r.shape[0]))
            r[: sub.shape[0]] += sub
        r[0] += max(stop, 0.0)
        rest[c] = r
    law = {}
    root = probs[0]
    child_tok = {tokens[k]: k for k in kids[0]}
    for v in np.nonzero(root > 0)[0].tolist():
        if v in child_tok:
            for d, q in enumerate(rest[child_tok[v]].tolist()):
                if q > 0:
                    law[(v, d + 1)] = float(root[v]) * q
        else:
            law[(v, 0)] = float(root[v])
    return ExactLaw("first-depth", law)


# -- running a verifier -----------------------------------------------------------------------


def _repeat(vi: DDTreeVerifyInput, count: int) -> DDTreeVerifyInput:
    n = vi.num_rows
    rep = {f.name: getattr(vi, f.name).expand(count, *getattr(vi, f.name).shape[1:]).clone()
           for f in dataclasses.fields(vi)}
    rep["retrieve_index"] = torch.arange(count)[:, None] * n + vi.retrieve_index
    return DDTreeVerifyInput(**rep)


def _sampled(vi: DDTreeVerifyInput, logits: torch.Tensor, params, coins: torch.Tensor, final_coins: torch.Tensor,
             make: Callable[[torch.Tensor, SamplingParams, torch.Tensor], torch.Tensor],
             threshold_single: float = 1.0, threshold_acc: float = 1.0, validate: bool = True) -> VerifyOutput:
    """:func:`ddtree_lab.verify_sampled` on the rows ``make(logits[b:b+1], params[b], num_nodes)``.

    When the batch repeats one step (the audit passes ``logits.expand``: stride 0 on the batch,
    equal params) the rows are made and checked once, on the first copy, and every copy is
    walked by the reference's own walk (:func:`ddtree_lab.verify.walk_sampled_batch`, which
    ``verify_sampled`` runs after its checks) over those rows. ``validate=False`` skips those
    checks (the buffer validation every backend runs by default)."""
    items = normalize_params(params, vi.batch_size, logits.shape[-1])
    kw = {"threshold_single": threshold_single, "threshold_acc": threshold_acc}
    if logits.stride(0) == 0 and all(p == items[0] for p in items):
        rows = make(logits[:1], items[0], vi.num_nodes[:1])
        if validate:
            verify_sampled(vi.request(0), rows, coins[:1], final_coins[:1], **kw)  # the reference's checks, once
        return walk_sampled_batch(vi, lambda b, i: rows[0, i], coins, final_coins, threshold_single, threshold_acc,
                                  None, "reference")
    rows = torch.cat([make(logits[b : b + 1], items[b], vi.num_nodes[b : b + 1]) for b in range(logits.shape[0])])
    return verify_sampled(vi, rows, coins, final_coins, **kw)


def _lab_rows(logits, p, num_nodes):
    return target_probs(logits, p, num_nodes)


def _reference(threshold_single: float = 1.0, threshold_acc: float = 1.0, validate: bool = True) -> Verifier:
    def verify(vi, logits, params, coins, final_coins):
        return _sampled(vi, logits, params, coins, final_coins, _lab_rows, threshold_single, threshold_acc, validate)

    verify.__name__ = "reference"
    return verify


def _backend(name: str, threshold_single: float, threshold_acc: float, validate: bool = True) -> Verifier:
    import inspect

    from .verify_backends import verify_tree

    kw = {} if validate or "validate" not in inspect.signature(verify_tree).parameters else {"validate": False}

    def verify(vi, logits, params, coins, final_coins):
        return verify_tree(vi, logits.contiguous(), params, coins, final_coins, backend=name,
                           threshold_single=threshold_single, threshold_acc=threshold_acc, **kw)

    verify.__name__ = name
    return verify


def _resolve(verifier, threshold_single: float, threshold_acc: float, validate: bool = True) -> tuple[Verifier, str]:
    if callable(verifier):
        return verifier, getattr(verifier, "__name__", "callable")
    if verifier == "reference":
        return _reference(threshold_single, threshold_acc, validate), "reference"
    if verifier in ("torch-lazy", "triton"):
        return _backend(verifier, threshold_single, threshold_acc, validate), verifier
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
    fn, _ = _resolve(verifier, threshold_single, threshold_acc)
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
        vi = _repeat(case.verify_input, m)
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


# -- plain sampler ----------------------------------------------------------------------------


def plain_sample(logits_row: torch.Tensor, params: SamplingParams, coins: torch.Tensor) -> torch.Tensor:
    """The lab's plain (non-speculative) sampler, vectorised over coins: ``[D]`` tokens drawn
    by inverse CDF (float64 running sum in token-id order, as :func:`ddtree_lab.verify.residual_draw`)
    from ``target_probs`` of one ``[V]`` logit row; greedy: the argmax."""
    p = target_probs(logits_row.cpu()[None, None].float(), params)[0, 0].double()
    cum = p.cumsum(0)
    idx = torch.searchsorted(cum, coins.double() * cum[-1], right=True).clamp(max=p.shape[0] - 1)
    positive = p.nonzero().flatten()
    bad = p[idx] <= 0
    if bad.any():
        idx[bad] = positive[-1]
    return idx


def target_probs_topp_first(logits: torch.Tensor, params: SamplingParams | Sequence[SamplingParams],
                            num_nodes: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`ddtree_lab.target_probs` with the *other* filtering order: top-p on the
    temperature-scaled softmax of the whole row first, then top-k among the survivors,
    renormalised (a named alternative to the lab's order, for audits; never used silently).
    Shapes as :func:`ddtree_lab.target_probs`."""
    bs = logits.shape[0]
    items = normalize_params(params, bs, logits.shape[-1])
    if "order" in {f.name for f in dataclasses.fields(SamplingParams)}:  # the lab names both orders
        return target_probs(logits, [dataclasses.replace(p, order="top_p_then_top_k") for p in items], num_nodes)
    out = torch.zeros(logits.shape, dtype=torch.float32)
    for b, p in enumerate(items):
        nn = None if num_nodes is None else num_nodes[b : b + 1]
        if p.is_greedy or (p.top_p >= 1.0 or p.top_k <= 0):
            out[b] = target_probs(logits[b : b + 1], p, nn)[0]
            continue
        probs = target_probs(logits[b : b + 1], dataclasses.replace(p, top_k=0, min_p=None), nn)[0]
        kth = torch.topk(probs, p.top_k, dim=-1).values[..., -1:]
        probs = probs * (probs >= kth)
        probs = probs / probs.sum(-1, keepdim=True).clamp(min=1e-30)
        if p.min_p:
            probs = probs * (probs >= p.min_p * probs.max(-1, keepdim=True).values)
            probs = probs / probs.sum(-1, keepdim=True).clamp(min=1e-30)
        out[b] = probs
    return out


# -- planted faults ---------------------------------------------------------------------------


def _fault_rows(make):
    def verify(vi, logits, params, coins, final_coins):
        return _sampled(vi, logits, params, coins, final_coins, make)

    return verify


def _greedy_rows(logits, p, num_nodes):
    return target_probs(logits, SamplingParams(temperature=0.0), num_nodes)


def _t1_rows(logits, p, num_nodes):
    return target_probs(logits, dataclasses.replace(p, temperature=1.0 if p.temperature > 0 else 0.0), num_nodes)


def _other_order_rows(logits, p, num_nodes):
    return target_probs_topp_first(logits, p, num_nodes)


def _coin_reuse(vi, logits, params, coins, final_coins):
    first = _sampled(vi, logits, params, coins, final_coins, _lab_rows)
    last = [[i for i in row if i >= 0][-1] for row in first.accept_index.tolist()]
    reused = coins[torch.arange(vi.batch_size), torch.tensor(last)].contiguous()
    return _sampled(vi, logits, params, coins, reused, _lab_rows)


def _lossy_threshold(vi, logits, params, coins, final_coins):
    return _sampled(vi, logits, params, coins, final_coins, _lab_rows, threshold_acc=0.5)


#: Known lossy verifiers (the verify signature), each a fault seen in serving engines.
PLANTED_FAULTS: dict[str, tuple[Verifier, str]] = {
    "threshold": (_lossy_threshold, "acceptance threshold_acc = 0.5 (< 1): SGLang's rule accepts u <= S_k / 0.5"),
    "coin-reuse": (_coin_reuse, "the final draw reuses the last node's coin, already conditioned by the walk "
                                "(u >= S_K)"),
    "temperature-1": (_fault_rows(_t1_rows), "target rows at temperature 1 instead of the request's"),
    "greedy": (_fault_rows(_greedy_rows), "a sampled request verified greedily (one-hot argmax rows)"),
    "filter-order": (_fault_rows(_other_order_rows), "top-p applied before top-k (the other order)"),
}


def planted_fault(name: str) -> Verifier:
    """The planted lossy verifier ``name`` (one of :data:`PLANTED_FAULTS`)."""
    if name not in PLANTED_FAULTS:
        raise ValueError(f"unknown planted fault {name!r}; known: {', '.join(PLANTED_FAULTS)}")
    fn = PLANTED_FAULTS[name][0]

    def verify(vi, logits, params, coins, final_coins):
        return fn(vi, logits, params, coins, final_coins)

    verify.__name__ = f"fault:{name}"
    return verify


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


def _fit(what: str, law: dict, counts: Counter, label: Callable, min_expected: float = 5.0) -> FitResult:
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
    stat, p, dof, _ = chi2_contingency(np.array(rows, dtype=np.float64).T, lambda_="log-likelihood")
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
    def rejected(self) -> bool:
        """The verifier's empirical law differs from the exact one at level ``alpha``."""
        return self.p_value < self.alpha

    @property
    def verdict(self) -> str:
        if self.rejected:
            return "LOSSY (the empirical law differs from the exact one)"
        if self.findings:
            return "LOSSY by construction (" + "; ".join(self.findings) + ")"
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
        lines.append(f"  verdict: {self.verdict} (p = {self.p_value:.3g})")
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
        fig.update_layout(barmode="group", title=f"{self.case_name}: {self.verdict}, p = {self.p_value:.3g}",
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
    fn, name = _resolve(verifier, threshold_single, threshold_acc, validate)
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

    fit = _fit("outcome (" + ("emitted sequence" if law.kind == "sequence" else "first token, accepted depth") + ")",
               law.probs, counts, lbl)
    first_counts = Counter((k[0] if k else -1) for k in outcomes) if law.kind == "sequence" else \
        Counter(k[0] for k in outcomes)
    depth_counts = Counter((len(k) - 1) for k in outcomes) if law.kind == "sequence" else Counter(k[1] for k in outcomes)
    first = _fit("first emitted token", law.first_token(), first_counts, case.label)
    depth = _fit("accepted depth", law.depth(), depth_counts, lambda d: f"depth {d}")
    sres = vs = None
    if sampler is not None:
        sfn = plain_sample if sampler == "lab" else sampler
        g = torch.Generator().manual_seed(seed + 1)
        coins = torch.rand(draws, generator=g, dtype=torch.float32)
        toks = sfn(case.logits[0], case.params, coins).tolist()
        scounts = Counter(int(t) for t in toks)
        sres = _fit("plain sampler (first token)", law.first_token(), scounts, case.label)
        vs = _two_sample(first_counts, scounts, case.label)
    return AuditReport(case.name, name, law.kind, draws, seed, alpha, fit, first, depth, sres, vs,
                       _findings(case, threshold_single, threshold_acc))
