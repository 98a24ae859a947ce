"""Audit cases: one verify step (buffers, target logits, sampling parameters) from a trace step, logits or at random."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from ..buffers import DDTreeVerifyInput, find_retrieve_problem, verify_input_from_parents
from ..sampling import SamplingParams, target_probs

__all__ = ["AuditCase", "case_from_logits", "case_from_step", "random_case", "step_logits", "plant_duplicate_sibling"]


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


def case_from_logits(step, logits: torch.Tensor, params: SamplingParams | None = None, texts=None,
                     name: str | None = None) -> AuditCase:
    """An :class:`AuditCase` from a recorded :class:`ddtree_lab.Step` and the target's
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
    vi = verify_input_from_parents(tokens, step.parents, step.prefix_len)
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
    vi = verify_input_from_parents(torch.tensor(tokens), torch.tensor(parents))
    return AuditCase(vi, logits, params or SamplingParams(temperature=1.0), f"random case (seed {seed})")


@torch.no_grad()
def step_logits(target, run, step) -> torch.Tensor:
    """The target's full ``[n, V]`` float32 logits at a recorded step's tree nodes: prefill the
    committed prefix of the step's request, then one tree forward (the session's own path).

    Args:
        target: a :class:`ddtree_lab.models.TargetModel` (the one the trace was recorded with).
        run: the :class:`ddtree_lab.Run` (its metadata gives the prompt and generated ids).
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
