"""What the engine adapters share: chain cases, engine outputs as lab outputs, the real-draft
law, the adapter's planted fault, and one audit entry point.

A chain is a tree with one child per node (``0 -> 1 -> ... -> K``): node ``i``'s target row
scores node ``i+1``'s token, row ``K`` is the bonus row. Engines' chain samplers (vLLM's
``RejectionSampler``, SGLang's ``chain_speculative_sampling_triton``) verify exactly that.

With *real* draft probabilities ``q_i`` (row ``i`` the drafter's law of node ``i+1``'s token
``t``), the rule of Leviathan et al. 2023 (Algorithm 1; vLLM's ``rejection_random_sample_kernel``,
SGLang's ``speculative_sampling_classic_kernel``) accepts ``t`` with probability
``min(1, p_i(t) / q_i(t))`` and otherwise emits a token of ``max(p_i - q_i, 0)``
renormalised. Given the drafted tokens this is the target-only rule on rows ``p'_i`` with
``p'_i(t) = min(1, p_i(t) / q_i(t))`` and ``p'_i(v) = (1 - p'_i(t)) r_i(v)`` elsewhere
(``r_i`` the residual): :func:`real_draft_case` builds that case, so the lab's exact law
(:func:`ddtree_lab.audit.exact_law`) is the law the engine must produce with those ``q``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from ..audit import AuditCase, AuditReport, audit
from ..buffers import DDTreeVerifyInput, encode_retrieve, tree_attention_mask
from ..sampling import SamplingParams, apply_bans_batch, normalize_params, target_probs
from ..verify import VerifyOutput

__all__ = ["ENGINE_FAULTS", "DRAFT_MODES", "check_chain", "engine_inputs", "chain_case", "random_chain_case", "drafter_probs",
           "real_draft_case", "output_from_rows", "fault_params", "audit_engine"]

#: Faults the adapters can plant in their own input (to show the audit catches them).
ENGINE_FAULTS = {"temperature-1": "the adapter hands the engine temperature 1 instead of the request's "
                                   "(sampled requests; greedy ones stay greedy)"}

#: How the drafted tokens' probabilities reach a chain sampler.
DRAFT_MODES = ("target-only", "real")


def check_chain(vi: DDTreeVerifyInput, engine: str) -> int:
    """The chain length ``K`` (draft tokens) of a batch of full chains.

    Raises:
        ValueError: a request that is not the chain ``0 -> 1 -> ... -> N-1`` over all ``N``
            rows (naming the request and its ``retrieve_next_token``), or ``N < 2``.
    """
    bs, n = vi.node_token_ids.shape
    if n < 2:
        raise ValueError(f"{engine}: a chain needs a root and at least one draft node, got N = {n}")
    want = list(range(1, n)) + [-1]
    for b in range(bs):
        nt, ns = vi.retrieve_next_token[b].tolist(), vi.retrieve_next_sibling[b].tolist()
        if int(vi.num_nodes[b]) != n or nt != want or any(v != -1 for v in ns):
            raise ValueError(f"{engine}: request {b} is not a full chain 0 -> 1 -> ... -> {n - 1} "
                             f"(num_nodes {int(vi.num_nodes[b])}, retrieve_next_token {nt}); "
                             "its chain sampler verifies chains only")
    return n - 1


def chain_case(tokens: torch.Tensor, logits: torch.Tensor, params: SamplingParams, name: str = "chain",
               prefix_len: int = 0) -> AuditCase:
    """An :class:`AuditCase` for the chain ``tokens[0] (root) -> tokens[1] -> ...``.

    Args:
        tokens: ``[N]`` int64, the root's token then the draft tokens.
        logits: ``[N, V]`` float32 target logits (row ``i`` after node ``i``).
    """
    n = int(tokens.shape[0])
    parents = torch.arange(-1, n - 1, dtype=torch.int64)[None]
    num = torch.tensor([n])
    ri, nt, ns = encode_retrieve(parents, num)
    depth = torch.arange(n, dtype=torch.int64)[None]
    vi = DDTreeVerifyInput(node_token_ids=tokens.long()[None].clone(), retrieve_index=ri, retrieve_next_token=nt,
                           retrieve_next_sibling=ns, tree_mask=tree_attention_mask(parents, num),
                           positions=depth + prefix_len, depths=depth.clone(), num_nodes=num)
    return AuditCase(vi, logits.float(), params, name)


def random_chain_case(seed: int = 0, length: int = 4, vocab_size: int = 8, params: SamplingParams | None = None,
                      scale: float = 1.0, plant: float = 2.0) -> AuditCase:
    """A random chain of ``length`` draft tokens over ``vocab_size`` tokens; each draft token's
    logit in its parent's row is raised by ``plant`` so deep acceptances occur."""
    if length < 1 or vocab_size < 2:
        raise ValueError(f"random_chain_case: need length >= 1 and vocab_size >= 2, got {length}, {vocab_size}")
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(vocab_size, (length + 1,), generator=g)
    logits = torch.randn(length + 1, vocab_size, generator=g) * scale
    logits[torch.arange(length), tokens[1:]] += plant
    return chain_case(tokens, logits, params or SamplingParams(temperature=1.0), f"random chain (seed {seed})")


def drafter_probs(case: AuditCase, seed: int = 0, noise: float = 1.0) -> torch.Tensor:
    """A drafter's ``[K, V]`` float32 probabilities for a chain case: the target rows under the
    case's parameters, perturbed by Gaussian logit noise (``noise``), every drafted token
    kept at positive probability. Row ``i`` is the law of node ``i+1``'s token."""
    k = int(case.verify_input.num_nodes[0]) - 1
    g = torch.Generator().manual_seed(seed)
    p = case.probs()[:k].double()
    logq = torch.log(p.clamp(min=1e-6)) + noise * torch.randn(p.shape, generator=g, dtype=torch.float64)
    q = torch.softmax(logq, -1)
    return (q / q.sum(-1, keepdim=True)).float()


def real_draft_case(case: AuditCase, draft_probs: torch.Tensor) -> AuditCase:
    """The chain case whose target-only law is the real-draft rule's law given the drafted
    tokens (module docstring): rows ``p'_i`` as logits, temperature 1, no filtering.

    Args:
        draft_probs: ``[K, V]`` float32, row ``i`` the drafter's law of node ``i+1``'s token.

    Raises:
        ValueError: not a chain, wrong shape, or a drafted token of draft probability 0 (it
            could not have been drafted).
    """
    k = check_chain(case.verify_input, "real_draft_case")
    v = case.vocab_size
    if tuple(draft_probs.shape) != (k, v):
        raise ValueError(f"draft_probs must be [K={k}, V={v}], got {tuple(draft_probs.shape)}")
    p = case.probs().double()
    q = draft_probs.double()
    tokens = case.verify_input.node_token_ids[0, 1:].tolist()
    rows = p.clone()
    for i, t in enumerate(tokens):
        if not q[i, t] > 0:
            raise ValueError(f"node {i + 1}: its token {t} has draft probability {float(q[i, t])}: "
                             "a drafter could not have drawn it")
        acc = min(1.0, float(p[i, t] / q[i, t]))
        resid = (p[i] - q[i]).clamp(min=0.0)
        resid[t] = 0.0
        z = float(resid.sum())
        rows[i] = resid * ((1.0 - acc) / z) if z > 0 else torch.zeros_like(resid)
        rows[i, t] = acc
    logits = torch.log(rows.float())
    return AuditCase(case.verify_input, logits, SamplingParams(temperature=0.0 if case.params.is_greedy else 1.0),
                     case.name + " (real draft probabilities)", case.texts)


def output_from_rows(vi: DDTreeVerifyInput, rows: torch.Tensor, backend: str) -> VerifyOutput:
    """A lab :class:`VerifyOutput` from an engine's chain output rows.

    Args:
        rows: ``[bs, K+1]`` integer, emitted tokens then ``-1`` (vLLM's
            ``output_token_ids`` layout: accepted drafts, then the recovered or bonus token).

    Raises:
        ValueError: a row with a gap, no token, or an accepted token that is not the chain's.
    """
    bs, n = vi.node_token_ids.shape
    if tuple(rows.shape) != (bs, n):
        raise ValueError(f"{backend}: output rows must be [bs={bs}, K+1={n}], got {tuple(rows.shape)}")
    rows = rows.to(torch.int64)
    valid = rows >= 0
    count = valid.sum(1)
    if (count < 1).any() or (valid != (torch.arange(n)[None] < count[:, None])).any():
        bad = int(((count < 1) | (valid != (torch.arange(n)[None] < count[:, None])).any(1)).nonzero()[0])
        raise ValueError(f"{backend}: request {bad}: output row {rows[bad].tolist()} is not tokens then -1")
    accept = count - 1
    drafts = vi.node_token_ids[:, 1:]
    for b in range(bs):
        a = int(accept[b])
        if rows[b, :a].tolist() != drafts[b, :a].tolist():
            raise ValueError(f"{backend}: request {b}: accepted {rows[b, :a].tolist()} but the chain drafts "
                             f"{drafts[b, :a].tolist()}")
    idx = torch.arange(n)[None].expand(bs, n)
    accept_index = torch.where(idx <= accept[:, None], idx, -1)
    return VerifyOutput(accept_index=accept_index, accept_length=accept, emitted_tokens=rows.clone(),
                        bonus_token=rows[torch.arange(bs), accept], support_exhausted=torch.zeros(bs, dtype=torch.bool),
                        backend=backend)


def fault_params(params: SamplingParams, fault: str | None) -> SamplingParams:
    """``params`` as the adapter hands them to the engine, with ``fault`` planted.

    Raises:
        ValueError: an unknown fault.
    """
    if fault is None:
        return params
    if fault not in ENGINE_FAULTS:
        raise ValueError(f"unknown engine fault {fault!r}; known: {', '.join(ENGINE_FAULTS)}")
    return params if params.is_greedy else dataclasses.replace(params, temperature=1.0)


def engine_inputs(logits: torch.Tensor, params, bs: int, target=None) -> tuple[torch.Tensor, list[SamplingParams]]:
    """What an engine adapter hands the engine's verify: ``[bs, N, V]`` logits with the banned
    tokens at -inf (the engine's logits processors run before its verify) and one
    :class:`SamplingParams` per request. ``target``: an adapter's fixed ``(row [N, V], params)``,
    which replaces ``logits`` and ``params`` for every request.

    Raises:
        ValueError / TypeError: what :func:`~ddtree_lab.sampling.normalize_params` refuses.
    """
    if target is not None:
        row, p0 = target
        logits, params = row[None].expand(bs, -1, -1), [p0] * bs
    items = normalize_params(params, bs, logits.shape[-1])
    return apply_bans_batch(logits, items), items


def lab_rows(logits: torch.Tensor, params, num_nodes=None) -> torch.Tensor:
    """``[bs, N, V]`` float32 target rows by the lab's transforms (:func:`ddtree_lab.target_probs`)."""
    return target_probs(logits, normalize_params(params, logits.shape[0], logits.shape[-1]), num_nodes)


def audit_engine(make_verifier: Callable, case: AuditCase, draft: str = "target-only", draft_seed: int = 0,
                 **audit_kw) -> AuditReport:
    """Audit an engine adapter on ``case`` against the exact law.

    Args:
        make_verifier: ``make_verifier(draft_probs or None, original case) -> verifier`` (the
            engine module's ``verifier`` factory, with its options bound).
        case: the step (a chain for the chain samplers).
        draft: ``"target-only"`` (no draft probabilities: the target-only rule) or
            ``"real"`` (:func:`drafter_probs` of ``draft_seed``; the exact law is then
            :func:`real_draft_case`'s).
        audit_kw: passed to :func:`ddtree_lab.audit.audit` (draws, seed, alpha, ...).

    Raises:
        ValueError: an unknown draft mode, or what the verifier refuses.
    """
    if draft not in DRAFT_MODES:
        raise ValueError(f"draft must be one of {DRAFT_MODES}, got {draft!r}")
    if draft == "target-only" or case.params.is_greedy:
        return audit(case, make_verifier(None, case), **audit_kw)
    q = drafter_probs(case, draft_seed)
    judged = real_draft_case(case, q)
    audit_kw.setdefault("sampler", None)  # the plain sampler's law is the target's, not this case's
    return audit(judged, make_verifier(q, case), **audit_kw)
