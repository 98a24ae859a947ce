"""Tree policies: which draft tree to verify from one request's draft top-k (issue #27).

A tree policy is a plain function ``policy(draft, anchor_token_id, budget, context) ->
DDTreeBuildResult`` over the drafter's per-position top-k of ONE request
(:class:`ddtree_lab.step.DraftTopK`, ``token_ids [L-1, K]`` int64, ``logprobs [L-1, K]``
float32, rows sorted descending). A node at depth ``d`` with rank ``r`` takes the token
``token_ids[d-1, r]`` and its log-weight is its parent's plus ``logprobs[d-1, r]`` (the
drafter's positions are independent, DDTree's model). The result is a batch of one in tree
order, the key of :mod:`ddtree_lab.build` ``(-node_logw, depth, rank tuple)``: parents before
children, siblings in descending log-weight, so :func:`ddtree_lab.compile_retrieve` accepts it
and SGLang's ``retrive_*`` layout holds.

Built in (:data:`POLICIES`):

* ``ddtree``: DDTree best-first, the ``budget`` most probable prefixes (arXiv 2604.12989,
  Algorithm 1; :func:`ddtree_lab.build.build_tree`).
* ``chain``: the drafter's top-1 path, ``min(budget, L-1)`` nodes (plain block speculative
  decoding, DFlash's chain).
* ``beam2``, ``beam4``: fixed-width beams: depth by depth, the ``k`` best children (by
  log-weight) of the previous depth's kept nodes, until ``budget`` nodes (a k-ary beam tree
  as in Medusa / EAGLE static-width trees).
* ``capped4``: best-first as DDTree but with at most 4 nodes per depth.
* ``cost``: a per-round budget chosen by expected tokens per second over a measured
  :class:`CostModel`: the DDTree order is grown node by node and the round keeps the prefix
  of ``m <= budget`` nodes that maximises ``(1 + sum_{i<=m} exp(logw_i)) / (t_draft +
  t_target(1 + m, bs))`` (the drafter's path probability as the estimate of a node's
  reach-and-accept probability). This is CaDDTree's / BASTION's idea, written from their
  descriptions (grow while the marginal expected accepted tokens of a node, times the
  throughput, beat the marginal cost of that node); no code of theirs is used. Without a cost
  model in the context it raises.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np
import torch

from ..build import DDTreeBuildResult, build_tree
from ..step import DraftTopK

__all__ = [
    "CostModel",
    "PolicyContext",
    "TreePolicy",
    "POLICIES",
    "get_policy",
    "check_policy_input",
    "tree_from_nodes",
    "ddtree_policy",
    "chain_policy",
    "beam_policy",
    "capped_best_first_policy",
    "cost_aware_policy",
    "policy_name",
    "stack_trees",
    "build_policy_trees",
]


@dataclass(frozen=True)
class CostModel:
    """Measured seconds of one target tree forward as a function of its rows ``N`` (root
    included) and the batch size, plus the per-round drafter cost.

    Attributes:
        num_rows: ``[P]`` the measured ``N`` (strictly increasing).
        seconds: ``{batch_size: [P] seconds}`` wall seconds per tree forward at each ``N``.
        draft_seconds: seconds of one drafter forward + build per round (added to every round).
        device: where it was measured (text, for the tables).

    ``forward_seconds(n, bs)`` interpolates linearly in ``N`` (and extrapolates the last
    segment); an unmeasured batch size scales the nearest measured one linearly in ``bs``.
    """

    num_rows: tuple[int, ...]
    seconds: dict[int, tuple[float, ...]]
    draft_seconds: float = 0.0
    device: str = "cpu"

    def __post_init__(self):
        if len(self.num_rows) < 1 or any(b <= a for a, b in zip(self.num_rows, self.num_rows[1:])):
            raise ValueError(f"CostModel.num_rows must be non-empty and strictly increasing, got {self.num_rows}")
        if self.num_rows[0] < 1:
            raise ValueError(f"CostModel.num_rows must start at >= 1 (the root), got {list(self.num_rows)}")
        if not self.seconds:
            raise ValueError("CostModel.seconds is empty")
        if any(b < 1 for b in self.seconds):
            raise ValueError(f"CostModel batch sizes must be >= 1, got {sorted(self.seconds)}")
        for bs, secs in self.seconds.items():
            if len(secs) != len(self.num_rows) or any(not (s >= 0 and math.isfinite(s)) for s in secs):
                raise ValueError(f"CostModel.seconds[{bs}] must hold {len(self.num_rows)} finite non-negative seconds, "
                                 f"got {secs}")
        if not (self.draft_seconds >= 0 and math.isfinite(self.draft_seconds)):
            raise ValueError(f"CostModel.draft_seconds must be a finite number >= 0, got {self.draft_seconds}")

    def forward_seconds(self, n: int, batch_size: int = 1) -> float:
        """Seconds of one target tree forward over ``n`` rows at ``batch_size``.

        Raises:
            ValueError: ``n < 1`` or ``batch_size < 1``.
        """
        if n < 1:
            raise ValueError(f"n must be >= 1 (the root), got {n}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        bs = min(self.seconds, key=lambda b: abs(b - batch_size))
        ys = np.asarray(self.seconds[bs], dtype=np.float64)
        xs = np.asarray(self.num_rows, dtype=np.float64)
        if len(xs) == 1:
            y = float(ys[0])
        elif n <= xs[-1]:
            y = float(np.interp(n, xs, ys))
        else:
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
            y = float(ys[-1] + slope * (n - xs[-1]))
        return max(y, 0.0) * batch_size / bs

    def round_seconds(self, n: int, batch_size: int = 1) -> float:
        """Seconds of one round: drafter + a tree forward over ``n`` rows."""
        return self.draft_seconds + self.forward_seconds(n, batch_size)

    def to_dict(self) -> dict:
        """JSON-ready fields (``seconds`` keyed by the batch size as text)."""
        return {"num_rows": list(self.num_rows), "seconds": {str(k): list(v) for k, v in self.seconds.items()},
                "draft_seconds": self.draft_seconds, "device": self.device}

    @classmethod
    def from_dict(cls, d: dict) -> "CostModel":
        """The inverse of :meth:`to_dict` (a cost model measured elsewhere, e.g. on a GPU by
        ``benchmarks/tree_cost.py --json``).

        Raises:
            ValueError: a missing or mistyped field, named (and what ``__post_init__`` refuses).
        """
        if not isinstance(d, dict):
            raise ValueError(f"a cost model must be a JSON object, got {type(d).__name__}")
        for f in ("num_rows", "seconds"):
            if f not in d:
                raise ValueError(f"cost model: field {f!r} is missing")
        try:
            num_rows = tuple(int(n) for n in d["num_rows"])
            seconds = {int(k): tuple(float(x) for x in v) for k, v in dict(d["seconds"]).items()}
            draft = float(d.get("draft_seconds", 0.0))
        except (TypeError, ValueError) as e:
            raise ValueError(f"cost model: num_rows / seconds / draft_seconds do not parse as numbers: {e}") from None
        return cls(num_rows, seconds, draft, str(d.get("device", "unknown")))


@dataclass(frozen=True)
class PolicyContext:
    """What a policy may know beyond the draft: the cost model (``cost`` policy), the batch
    size it runs at, and the deepest depth allowed (default ``L-1``)."""

    cost_model: CostModel | None = None
    batch_size: int = 1
    max_depth: int | None = None
    extra: dict = field(default_factory=dict)


class TreePolicy(Protocol):
    def __call__(self, draft: DraftTopK, anchor_token_id: int, budget: int,
                 context: PolicyContext | None = None) -> DDTreeBuildResult: ...


def check_policy_input(draft: DraftTopK, anchor_token_id: int, budget: int) -> tuple[np.ndarray, np.ndarray]:
    """Check a policy's arguments; return the draft as numpy ``(tokens [D, K] int64, logprobs
    [D, K] float64)``.

    Raises:
        TypeError: ``draft`` is not a DraftTopK, wrong dtypes, a non-int budget or anchor.
        ValueError: ``budget < 0``, shapes not ``[L-1, K]`` alike, a row not sorted descending
            or holding NaN, a negative anchor token.
    """
    if not isinstance(draft, DraftTopK):
        raise TypeError(f"draft must be a DraftTopK (one request), got {type(draft).__name__}")
    if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)):
        raise TypeError(f"budget must be an int, got {type(budget).__name__}")
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    if isinstance(anchor_token_id, bool) or not isinstance(anchor_token_id, (int, np.integer)) or anchor_token_id < 0:
        raise ValueError(f"anchor_token_id must be a non-negative int, got {anchor_token_id!r}")
    tok, lp = draft.token_ids, draft.logprobs
    if tok.ndim != 2 or lp.ndim != 2 or tuple(tok.shape) != tuple(lp.shape):
        raise ValueError(f"draft.token_ids and draft.logprobs must both be [L-1, K], got "
                         f"{tuple(tok.shape)} and {tuple(lp.shape)}")
    if tok.dtype != torch.int64:
        raise TypeError(f"draft.token_ids must be int64, got {tok.dtype}")
    if not lp.is_floating_point():
        raise TypeError(f"draft.logprobs must be floating point, got {lp.dtype}")
    lpn = lp.detach().cpu().double().numpy()
    if np.isnan(lpn).any():
        raise ValueError("draft.logprobs holds NaN")
    if lpn.shape[1] > 1 and (np.diff(lpn, axis=1) > 0).any():
        raise ValueError("draft.logprobs rows must be sorted descending")
    return tok.detach().cpu().numpy(), lpn


def tree_from_nodes(anchor_token_id: int, nodes: list[tuple[tuple[int, ...], float]],
                    tokens: np.ndarray, device: torch.device | str = "cpu") -> DDTreeBuildResult:
    """A batch-of-one tree from its draft nodes given as ``(rank tuple, log-weight)``.

    The set must be closed under "parent" (every prefix of a rank tuple present); the nodes are
    put in tree order ``(-logw, depth, rank tuple)`` (the order of :mod:`ddtree_lab.build`).

    Raises:
        ValueError: a node whose parent is missing.
    """
    order = sorted(nodes, key=lambda x: (-x[1], len(x[0]), x[0]))
    index: dict[tuple[int, ...], int] = {(): 0}
    n = 1 + len(order)
    tok = np.full(n, -1, np.int64)
    par = np.full(n, -1, np.int64)
    dep = np.zeros(n, np.int64)
    rnk = np.full(n, -1, np.int64)
    lw = np.zeros(n, np.float64)
    tok[0] = anchor_token_id
    for i, (ranks, w) in enumerate(order, start=1):
        if ranks[:-1] not in index:
            raise ValueError(f"node {ranks}: its parent {ranks[:-1]} is not in the tree")
        index[ranks] = i
        d = len(ranks)
        tok[i], par[i], dep[i], rnk[i], lw[i] = tokens[d - 1, ranks[-1]], index[ranks[:-1]], d, ranks[-1], w
    t = lambda a: torch.from_numpy(a[None]).to(device)  # noqa: E731
    return DDTreeBuildResult(node_token_ids=t(tok), parents=t(par), depths=t(dep), ranks=t(rnk),
                             node_logws=t(lw.astype(np.float32)), num_nodes=torch.tensor([n], device=device))


def _depth_limit(lp: np.ndarray, context: PolicyContext | None) -> int:
    d = lp.shape[0]
    if context is not None and context.max_depth is not None:
        if not 0 <= context.max_depth <= d:
            raise ValueError(f"context.max_depth must be in [0, {d}], got {context.max_depth}")
        d = context.max_depth
    return d if lp.shape[1] > 0 else 0


def ddtree_policy(draft: DraftTopK, anchor_token_id: int, budget: int,
                  context: PolicyContext | None = None) -> DDTreeBuildResult:
    """DDTree best-first: the ``budget`` most probable draft prefixes (arXiv 2604.12989,
    Algorithm 1, via :func:`ddtree_lab.build.build_tree`; ``N = 1 + budget`` rows, fewer
    nodes only where the draft has zero-probability tokens). Raises as
    :func:`check_policy_input` and :func:`build_tree`."""
    _, lp = check_policy_input(draft, anchor_token_id, budget)
    tree = build_tree(draft.token_ids[None], draft.logprobs[None].float(),
                      torch.tensor([anchor_token_id], dtype=torch.int64), budget,
                      max_depth=_depth_limit(lp, context))
    return tree.compact()


def chain_policy(draft: DraftTopK, anchor_token_id: int, budget: int,
                 context: PolicyContext | None = None) -> DDTreeBuildResult:
    """The drafter's top-1 chain: ranks ``(0, 0, ..)`` down to depth ``min(budget, L-1)``
    (the budget is the depth). Raises as :func:`check_policy_input`."""
    tokens, lp = check_policy_input(draft, anchor_token_id, budget)
    depth = min(budget, _depth_limit(lp, context))
    nodes, w = [], 0.0
    for d in range(depth):
        if lp[d, 0] == -math.inf:
            break
        w += lp[d, 0]
        nodes.append(((0,) * (d + 1), w))
    return tree_from_nodes(anchor_token_id, nodes, tokens)


def beam_policy(width: int) -> Callable[..., DDTreeBuildResult]:
    """The fixed-width ``width``-ary beam policy: depth by depth, the ``width`` best children
    (by log-weight, ties by rank tuple) of the nodes kept at the depth above, until ``budget``
    nodes are placed (the last depth may be partial; the ``budget`` best of it by log-weight).

    Raises:
        ValueError: ``width < 1``.
    """
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")

    def policy(draft: DraftTopK, anchor_token_id: int, budget: int,
               context: PolicyContext | None = None) -> DDTreeBuildResult:
        tokens, lp = check_policy_input(draft, anchor_token_id, budget)
        depth = _depth_limit(lp, context)
        k = lp.shape[1]
        beam: list[tuple[tuple[int, ...], float]] = [((), 0.0)]
        nodes: list[tuple[tuple[int, ...], float]] = []
        for d in range(depth):
            if len(nodes) >= budget or not beam:
                break
            cand = [(r + (j,), w + lp[d, j]) for r, w in beam for j in range(k) if lp[d, j] > -math.inf]
            cand.sort(key=lambda x: (-x[1], x[0]))
            beam = cand[: min(width, budget - len(nodes))]
            nodes.extend(beam)
        return tree_from_nodes(anchor_token_id, nodes, tokens)

    policy.__name__ = f"beam{width}_policy"
    policy.__doc__ = f"Fixed-width beam, width {width} (:func:`beam_policy`)."
    return policy


def capped_best_first_policy(cap: int) -> Callable[..., DDTreeBuildResult]:
    """Best-first (DDTree's heap over rank tuples: pop the best, push its next sibling and its
    first child) with at most ``cap`` nodes per depth: a popped node at a full depth is
    skipped (and so is its subtree). Stops after ``budget`` nodes or an empty heap.

    Raises:
        ValueError: ``cap < 1``.
    """
    if cap < 1:
        raise ValueError(f"cap must be >= 1, got {cap}")

    def policy(draft: DraftTopK, anchor_token_id: int, budget: int,
               context: PolicyContext | None = None) -> DDTreeBuildResult:
        tokens, lp = check_policy_input(draft, anchor_token_id, budget)
        depth = _depth_limit(lp, context)
        k = lp.shape[1]
        per_depth = [0] * (depth + 1)
        nodes: list[tuple[tuple[int, ...], float]] = []
        heap: list[tuple[float, int, tuple[int, ...]]] = [(-lp[0, 0], 1, (0,))] if depth > 0 and lp[0, 0] > -math.inf else []
        while heap and len(nodes) < budget:
            negw, d, ranks = heapq.heappop(heap)
            w = -negw
            r = ranks[-1]
            if r + 1 < k and lp[d - 1, r + 1] > -math.inf:  # next sibling
                heapq.heappush(heap, (-(w - lp[d - 1, r] + lp[d - 1, r + 1]), d, ranks[:-1] + (r + 1,)))
            if per_depth[d] >= cap:
                continue
            per_depth[d] += 1
            nodes.append((ranks, w))
            if d < depth and lp[d, 0] > -math.inf:  # first child
                heapq.heappush(heap, (-(w + lp[d, 0]), d + 1, ranks + (0,)))
        return tree_from_nodes(anchor_token_id, nodes, tokens)

    policy.__name__ = f"capped{cap}_policy"
    policy.__doc__ = f"Best-first with at most {cap} nodes per depth (:func:`capped_best_first_policy`)."
    return policy


def cost_aware_policy(draft: DraftTopK, anchor_token_id: int, budget: int,
                      context: PolicyContext | None = None) -> DDTreeBuildResult:
    """The per-round budget by expected tokens per second (module docstring, ``cost``):
    of the DDTree trees with ``m = 0..budget`` nodes (nested: the first ``m`` of the DDTree
    order), keep the one maximising ``(1 + sum_{i<=m} exp(logw_i)) / context.cost_model.
    round_seconds(1 + m, context.batch_size)``; ties go to the smaller tree. The drafter's
    seconds are in every ``m``'s cost (the round's draft is spent by the time the policy runs),
    so ``m = 0`` means "verify the root alone this round", not plain decoding.

    Raises:
        ValueError: no ``context.cost_model``; as :func:`check_policy_input`.
    """
    if context is None or context.cost_model is None:
        raise ValueError("the 'cost' policy needs context=PolicyContext(cost_model=CostModel(...))")
    full = ddtree_policy(draft, anchor_token_id, budget, context)
    n = int(full.num_nodes[0])
    gain = 1.0 + np.concatenate([[0.0], np.cumsum(np.exp(full.node_logws[0, 1:n].double().numpy()))])
    cost = np.array([context.cost_model.round_seconds(1 + m, context.batch_size) for m in range(n)])
    rate = gain / np.maximum(cost, 1e-12)
    m = int(np.argmax(rate))  # first maximum: the smaller tree on ties
    # the first m nodes of tree order are closed under "parent" (parents come first)
    return DDTreeBuildResult(node_token_ids=full.node_token_ids[:, : m + 1], parents=full.parents[:, : m + 1],
                             depths=full.depths[:, : m + 1], ranks=full.ranks[:, : m + 1],
                             node_logws=full.node_logws[:, : m + 1], num_nodes=torch.tensor([m + 1]))


#: The built-in policies by name.
POLICIES: dict[str, Callable[..., DDTreeBuildResult]] = {
    "ddtree": ddtree_policy,
    "chain": chain_policy,
    "beam2": beam_policy(2),
    "beam4": beam_policy(4),
    "capped4": capped_best_first_policy(4),
    "cost": cost_aware_policy,
}


def get_policy(name: str) -> Callable[..., DDTreeBuildResult]:
    """The policy called ``name`` in :data:`POLICIES`.

    Raises:
        KeyError: an unknown name (the message lists the known ones).
    """
    if name not in POLICIES:
        raise KeyError(f"policy: unknown name {name!r} (known: {', '.join(POLICIES)})")
    return POLICIES[name]


def policy_name(policy: Callable[..., DDTreeBuildResult]) -> str:
    """The name a policy is recorded under: its key in :data:`POLICIES` when it is one of the
    built-in functions, else its ``__name__`` (a user's own function)."""
    for name, fn in POLICIES.items():
        if fn is policy:
            return name
    return str(getattr(policy, "__name__", type(policy).__name__))


def stack_trees(trees: list[DDTreeBuildResult]) -> DDTreeBuildResult:
    """The batch of ``bs = len(trees)`` trees from batches of one, padded to the largest
    ``N`` as :class:`DDTreeBuildResult` pads (token, parent, depth, rank ``-1``, log-weight
    ``-inf``). Fields are taken on the CPU.

    Raises:
        ValueError: no trees, or a tree that is not a batch of one.
    """
    if not trees:
        raise ValueError("stack_trees needs at least one tree")
    for b, t in enumerate(trees):
        if t.batch_size != 1:
            raise ValueError(f"request {b}: a policy must return a batch of one tree, got batch size {t.batch_size}")
    n = max(int(t.num_nodes[0]) for t in trees)
    pad = {"node_token_ids": -1, "parents": -1, "depths": -1, "ranks": -1, "node_logws": -math.inf}
    out = {}
    for name, value in pad.items():
        rows = []
        for t in trees:
            k = int(t.num_nodes[0])
            row = getattr(t, name)[0, :k].detach().cpu()
            rows.append(torch.cat([row, torch.full((n - k,), value, dtype=row.dtype)]))
        out[name] = torch.stack(rows)
    out["num_nodes"] = torch.tensor([int(t.num_nodes[0]) for t in trees], dtype=torch.int64)
    return DDTreeBuildResult(**out)


def build_policy_trees(policy: Callable[..., DDTreeBuildResult], draft_token_ids: torch.Tensor,
                       draft_logprobs: torch.Tensor, anchor_token_ids: torch.Tensor, budgets: list[int],
                       context: PolicyContext | None = None) -> DDTreeBuildResult:
    """Each request's tree by ``policy``, as one batch (what :class:`ddtree_lab.LiveSession`
    verifies when given a policy).

    Args:
        draft_token_ids: ``[bs, L-1, K]`` int64; draft_logprobs: ``[bs, L-1, K]`` float32
            (each request's :class:`DraftTopK`, rows sorted descending).
        anchor_token_ids: ``[bs]`` int64, the roots. budgets: one budget per request.
        context: handed to every call (its ``batch_size`` is the batch's).

    Returns:
        :func:`stack_trees` of ``policy(DraftTopK(ids[b], lps[b]), anchor[b], budgets[b],
        context)``, padded to the largest ``N``.

    Raises:
        ValueError: ``budgets`` of the wrong length, a policy tree with more draft nodes than
            its budget (naming the request), as the policy and :func:`stack_trees`.
    """
    bs = int(draft_token_ids.shape[0])
    if len(budgets) != bs or int(anchor_token_ids.shape[0]) != bs:
        raise ValueError(f"build_policy_trees: {bs} drafts, {len(budgets)} budgets and "
                         f"{int(anchor_token_ids.shape[0])} anchors (one of each per request)")
    trees = []
    for b in range(bs):
        t = policy(DraftTopK(draft_token_ids[b], draft_logprobs[b]), int(anchor_token_ids[b]), int(budgets[b]), context)
        if not isinstance(t, DDTreeBuildResult):
            raise TypeError(f"request {b}: policy {policy_name(policy)} returned {type(t).__name__}, "
                            "not a DDTreeBuildResult")
        if int(t.num_nodes[0]) - 1 > int(budgets[b]):
            raise ValueError(f"request {b}: policy {policy_name(policy)} built {int(t.num_nodes[0]) - 1} draft "
                             f"nodes for budget {budgets[b]}")
        trees.append(t)
    return stack_trees(trees)
