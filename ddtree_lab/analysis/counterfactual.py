"""Exact counterfactuals of tree policies on recorded steps (issue #27 "Does a tree pay here?").

For a recorded step and a tree policy (:mod:`.policies`), build the policy's tree from the
step's recorded draft top-k and compute its EXACT expected accept length ``E[tau]`` (accepted
draft tokens + 1, the bonus) under the target-only rule: ``1 + sum_i P(the walk reaches and
accepts node i)``, ``P`` the product along the path of each node's acceptance probability given
its parent (:func:`ddtree_lab.verify.whatif.acceptance_probabilities`) -- not a sampled estimate.

The target probability of a node's token in its parent's row comes, per node, from:

* the recording, where the node's path (root..node tokens) is in the recorded tree (sampled:
  its ``child_probs``; greedy: the parent's argmax, from the display rows ``top_token_ids`` or
  a recorded one-hot child), so a policy tree inside the recorded tree needs no model;
* otherwise one batched target tree forward per step over the union of all the trees asked
  (a union of trees sharing the root is a tree): the step's prefix (prompt + generated ids cut
  at ``prefix_len``) is prefilled and the union scored with
  :meth:`ddtree_lab.models.TargetModel.tree_forward`. Without prompt ids or a model such a tree
  is not scored: its :class:`PolicyResult` says why (``tau_* = None``), never a number.

Greedy ``E[tau]`` uses the target's argmax (one-hot rows, the greedy rule); sampled ``E[tau]``
uses the step's own :class:`SamplingParams` (a greedy run's sampled value is its greedy one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ..buffers import compile_retrieve
from ..build import DDTreeBuildResult
from ..sampling import target_probs
from ..step import Run, Step
from ..verify.whatif import acceptance_probabilities
from .policies import CostModel, PolicyContext, ddtree_policy, get_policy

__all__ = [
    "NodeProbs",
    "PolicyResult",
    "path_keys",
    "union_tree",
    "expected_accept_length",
    "reach_probabilities_of",
    "recorded_node_probs",
    "rescore_trees",
    "step_prefix_ids",
    "step_counterfactuals",
    "run_counterfactuals",
    "summarize",
    "SummaryRow",
    "measure_cost_model",
]


def path_keys(tree: DDTreeBuildResult) -> list[tuple[int, ...]]:
    """Each node's path of draft tokens below the root (root: ``()``), tree of a batch of one."""
    n = int(tree.num_nodes[0])
    tok, par = tree.node_token_ids[0, :n].tolist(), tree.parents[0, :n].tolist()
    keys: list[tuple[int, ...]] = [()]
    for i in range(1, n):
        keys.append(keys[par[i]] + (int(tok[i]),))
    return keys


def union_tree(trees: Sequence[DDTreeBuildResult]) -> DDTreeBuildResult:
    """The union of trees with the same root and draft (nodes matched by token path), in tree
    order ``(-logw, depth, path)``; a batch of one.

    Raises:
        ValueError: no trees, or roots that differ.
    """
    if not trees:
        raise ValueError("union_tree needs at least one tree")
    root = int(trees[0].node_token_ids[0, 0])
    nodes: dict[tuple[int, ...], tuple[float, int]] = {}
    for t in trees:
        if int(t.node_token_ids[0, 0]) != root:
            raise ValueError(f"union_tree: roots differ ({root} and {int(t.node_token_ids[0, 0])})")
        for i, k in enumerate(path_keys(t)):
            if i:
                nodes.setdefault(k, (float(t.node_logws[0, i]), int(t.ranks[0, i])))
    order = sorted(nodes, key=lambda k: (-nodes[k][0], len(k), k))
    index: dict[tuple[int, ...], int] = {(): 0}
    n = 1 + len(order)
    tok, par, dep, rnk = [root], [-1], [0], [-1]
    lw = [0.0]
    for i, k in enumerate(order, start=1):
        index[k] = i
        tok.append(k[-1])
        par.append(index[k[:-1]])
        dep.append(len(k))
        rnk.append(nodes[k][1])
        lw.append(nodes[k][0])
    as_t = lambda v, dt: torch.tensor([v], dtype=dt)  # noqa: E731
    return DDTreeBuildResult(node_token_ids=as_t(tok, torch.int64), parents=as_t(par, torch.int64),
                             depths=as_t(dep, torch.int64), ranks=as_t(rnk, torch.int64),
                             node_logws=as_t(lw, torch.float32), num_nodes=torch.tensor([n]))


def reach_probabilities_of(tree: DDTreeBuildResult, child_probs: Sequence[float]) -> torch.Tensor:
    """``[n]`` float64: each node's exact probability that the target-only walk reaches and
    accepts it (root 1), from ``child_probs [n]`` (target p of each node's token in its parent's
    row; one-hot for greedy). Raises as :func:`acceptance_probabilities`."""
    n = int(tree.num_nodes[0])
    vi = compile_retrieve(tree, 0)
    acc = acceptance_probabilities(vi.retrieve_next_token[0, :n], vi.retrieve_next_sibling[0, :n], list(child_probs))
    par = tree.parents[0, :n].tolist()
    reach = torch.zeros(n, dtype=torch.float64)
    reach[0] = 1.0
    for i in range(1, n):
        reach[i] = reach[par[i]] * acc[i]
    return reach


def expected_accept_length(tree: DDTreeBuildResult, child_probs: Sequence[float]) -> float:
    """Exact ``E[tau]`` (accepted draft tokens + the bonus) of the target-only walk on ``tree``:
    ``1 + sum`` of :func:`reach_probabilities_of` over the draft nodes."""
    return float(reach_probabilities_of(tree, child_probs)[1:].sum()) + 1.0


@dataclass
class NodeProbs:
    """Per token path (see :func:`path_keys`): ``sampled`` target p of the node's token in its
    parent's row under the step's params, ``greedy`` 1.0 / 0.0 (is it the parent's argmax);
    ``argmax``: per parent path, the parent row's argmax token where known (any child's greedy
    answer)."""

    sampled: dict[tuple[int, ...], float]
    greedy: dict[tuple[int, ...], float]
    argmax: dict[tuple[int, ...], int] = field(default_factory=dict)


def recorded_node_probs(step: Step) -> NodeProbs:
    """What the recording answers: every recorded node's child probability (sampled; a greedy
    step's one-hot rows count as greedy) and, where the display rows are kept, the greedy
    answer for any token under a recorded node (``top_token_ids[parent, 0]`` is its argmax)."""
    out = NodeProbs({}, {})
    if step.tree is None or step.child_probs is None or step.params is None:
        return out
    keys = path_keys(step.tree)
    cp = step.child_probs.tolist()
    greedy_run = step.params.is_greedy
    for i, k in enumerate(keys):
        if i and math.isfinite(cp[i]):
            if not greedy_run:
                out.sampled[k] = float(cp[i])
            if greedy_run and cp[i] >= 1.0:
                out.greedy[k] = 1.0
            elif greedy_run and cp[i] == 0.0:
                out.greedy[k] = 0.0
    top = step.top_token_ids
    if top is not None:
        out.argmax = {k: int(top[i, 0]) for i, k in enumerate(keys)}
    return out


def _greedy_lookup(rec: NodeProbs, key: tuple[int, ...]) -> float | None:
    if key in rec.greedy:
        return rec.greedy[key]
    if key[:-1] in rec.argmax:
        return 1.0 if rec.argmax[key[:-1]] == key[-1] else 0.0
    return None


def step_prefix_ids(run: Run, step: Step) -> list[int] | None:
    """The committed ids before the step's root (prompt + generated, cut at ``prefix_len``), or
    None when the run has no token ids for the request.

    Raises:
        ValueError: the ids there do not end where the recorded root says (a mismatched run).
    """
    reqs = {int(r["request"]): r for r in run.metadata.get("requests", []) or []}
    r = reqs.get(step.request)
    if r is None or r.get("prompt_token_ids") is None or step.prefix_len is None:
        return None
    committed = list(r["prompt_token_ids"]) + list(r.get("generated_token_ids") or [])
    if len(committed) <= step.prefix_len:
        return None
    root = int(step.node_token_ids[0]) if step.node_token_ids is not None else None
    if root is not None and committed[step.prefix_len] != root:
        raise ValueError(f"step {step.step}, request {step.request}: committed id {committed[step.prefix_len]} at "
                         f"prefix_len {step.prefix_len} is not the recorded root {root}")
    return committed[: step.prefix_len]


@torch.no_grad()
def rescore_trees(target, prefix_ids: Sequence[int], trees: Sequence[DDTreeBuildResult], params) -> NodeProbs:
    """Score the union of ``trees`` with one target tree forward at ``prefix_ids`` (the ids
    before the root): :meth:`TargetModel.prefill` then :meth:`TargetModel.tree_forward`.

    Returns:
        :class:`NodeProbs` of every union node: sampled p under ``params``
        (:func:`ddtree_lab.target_probs`), greedy one-hot of the parent's argmax.

    Raises:
        ValueError: empty ``prefix_ids``.
    """
    if not prefix_ids:
        raise ValueError("rescore_trees needs the ids before the root (prefix_ids is empty)")
    union = union_tree(trees)
    n = int(union.num_nodes[0])
    cache, _, _ = target.prefill(list(prefix_ids))
    fwd = target.tree_forward(cache, compile_retrieve(union, len(prefix_ids)))
    logits = fwd.logits[:n].float().cpu()
    probs = target_probs(logits[None], params)[0]
    argmax = logits.argmax(-1).tolist()
    keys, tok, par = path_keys(union), union.node_token_ids[0].tolist(), union.parents[0].tolist()
    out = NodeProbs({}, {})
    for i in range(1, n):
        out.sampled[keys[i]] = float(probs[par[i], tok[i]])
        out.greedy[keys[i]] = 1.0 if argmax[par[i]] == tok[i] else 0.0
    return out


@dataclass
class PolicyResult:
    """One policy at one budget on one recorded step.

    Attributes:
        step, request: the recorded step. policy, budget: what was built.
        num_nodes: draft nodes of the policy's tree (root not counted).
        tau_greedy, tau_sampled: exact ``E[tau]`` (None: could not be computed, see ``reason``).
        covered: the recording alone answered (no forward). reason: why a value is None.
        tree: the policy's tree.
        accept_by_depth: ``P(accepted draft tokens >= d)`` for ``d = 1 ..`` the tree's depth,
            exact, under the step's sampling rule (the sum of the reach probabilities of the
            nodes at depth ``d``: the walk accepts at most one node per depth); None where
            ``tau_sampled`` is. Their sum is ``tau_sampled - 1``.
        reach: ``[num_nodes + 1]`` each node's exact probability that the walk reaches and
            accepts it (root 1.0) under the step's sampling rule; None where ``tau_sampled`` is.
    """

    step: int
    request: int
    policy: str
    budget: int
    num_nodes: int
    tau_greedy: float | None
    tau_sampled: float | None
    covered: bool
    reason: str | None
    tree: DDTreeBuildResult
    accept_by_depth: tuple[float, ...] | None = None
    reach: tuple[float, ...] | None = None


def _by_depth(tree: DDTreeBuildResult, reach: torch.Tensor) -> tuple[float, ...]:
    n = int(tree.num_nodes[0])
    depths = tree.depths[0, :n].tolist()
    out = [0.0] * max(depths, default=0)
    for i in range(1, n):
        out[depths[i] - 1] += float(reach[i])
    return tuple(out)


def _probs_for(keys, rec_lookup, fresh: dict | None):
    vals = [0.0]
    for k in keys[1:]:
        v = rec_lookup(k)
        if v is None and fresh is not None:
            v = fresh.get(k)
        if v is None:
            return None
        vals.append(v)
    return vals


def step_counterfactuals(step: Step, policies: Sequence[str], budgets: Sequence[int], *, target=None,
                         prefix_ids: Sequence[int] | None = None, context: PolicyContext | None = None,
                         policy_of: Callable[[str], Callable] = get_policy) -> list[PolicyResult]:
    """Exact ``E[tau]`` of each policy at each budget on one recorded step (module docstring).

    Args:
        step: a recorded step with its ``draft`` top-k, ``tree``, ``rows`` and ``params``.
        policies: names in :data:`POLICIES` (or known to ``policy_of``). budgets: draft nodes.
        target: a :class:`TargetModel` to score what the recording does not cover (optional).
        prefix_ids: the ids before the root (:func:`step_prefix_ids`); needed with ``target``.
        context: the :class:`PolicyContext` (the ``cost`` policy's cost model).

    Returns:
        one :class:`PolicyResult` per (policy, budget), policies outer.

    Raises:
        ValueError: the step has no draft top-k or no sampling parameters; a bad budget.
        KeyError: an unknown policy name.
    """
    if step.draft is None or step.draft.token_ids.numel() == 0:
        raise ValueError(f"step {step.step}, request {step.request}: no draft top-k recorded")
    if step.params is None:
        raise ValueError(f"step {step.step}, request {step.request}: no sampling parameters recorded")
    if step.tree is None:
        raise ValueError(f"step {step.step}, request {step.request}: no tree recorded (its root is the anchor)")
    anchor = int(step.tree.node_token_ids[0, 0])
    fns = {name: policy_of(name) for name in policies}
    trees = {(name, b): fns[name](step.draft, anchor, int(b), context) for name in policies for b in budgets}
    rec = recorded_node_probs(step)
    greedy_run = step.params.is_greedy
    rec_sampled = (lambda k: _greedy_lookup(rec, k)) if greedy_run else rec.sampled.get
    rec_greedy = lambda k: _greedy_lookup(rec, k)  # noqa: E731
    keys = {kb: path_keys(t) for kb, t in trees.items()}
    need = [kb for kb in trees if _probs_for(keys[kb], rec_sampled, None) is None
            or _probs_for(keys[kb], rec_greedy, None) is None]
    fresh, why = None, None
    if need:
        if target is None:
            why = "not scored: nodes outside the recorded tree and no model (--model)"
        elif not prefix_ids:
            why = "not scored: nodes outside the recorded tree and the recording has no prompt ids"
        else:
            fresh = rescore_trees(target, prefix_ids, [trees[kb] for kb in need], step.params)
    out = []
    for (name, b), tree in trees.items():
        ks = keys[(name, b)]
        ps = _probs_for(ks, rec_sampled, fresh.sampled if fresh and not greedy_run else
                        (fresh.greedy if fresh else None))
        pg = _probs_for(ks, rec_greedy, fresh.greedy if fresh else None)
        reach = None if ps is None else reach_probabilities_of(tree, ps)
        out.append(PolicyResult(
            step.step, step.request, name, int(b), len(ks) - 1,
            None if pg is None else expected_accept_length(tree, pg),
            None if reach is None else float(reach[1:].sum()) + 1.0,
            (name, b) not in need, None if (pg is not None and ps is not None) else why, tree,
            None if reach is None else _by_depth(tree, reach),
            None if reach is None else tuple(reach.tolist())))
    return out


def run_counterfactuals(run: Run, policies: Sequence[str], budgets: Sequence[int], *, target=None,
                        context: PolicyContext | None = None, max_steps: int | None = None,
                        progress=None) -> list[PolicyResult]:
    """:func:`step_counterfactuals` over a run's steps that record a draft (at most
    ``max_steps`` of them, in order); ``target`` scores the uncovered nodes when the run has
    token ids; ``progress`` (a callable, e.g. a tqdm bar's ``update``) is called once per step done."""
    out: list[PolicyResult] = []
    steps = [s for s in run.steps if s.draft is not None and s.draft.token_ids.numel() and s.tree is not None]
    for s in steps[:max_steps]:
        prefix = step_prefix_ids(run, s) if target is not None else None
        out.extend(step_counterfactuals(s, policies, budgets, target=target, prefix_ids=prefix, context=context))
        if progress is not None:
            progress()
    return out


@dataclass
class SummaryRow:
    """Mean over steps of one (policy, budget): ``steps`` scored of ``total``; the means are
    ``None`` unless every step was scored (a mean over a subset would not compare)."""

    policy: str
    budget: int
    tau_greedy: float | None
    tau_sampled: float | None
    mean_nodes: float
    steps: int
    total: int
    covered: int
    reason: str | None


def summarize(results: Sequence[PolicyResult]) -> list[SummaryRow]:
    """One :class:`SummaryRow` per (policy, budget), in first-seen order. A mean is over the
    steps, given only when every step has both values; a row with steps unscored says so in
    ``reason``."""
    groups: dict[tuple[str, int], list[PolicyResult]] = {}
    for r in results:
        groups.setdefault((r.policy, r.budget), []).append(r)
    rows = []
    for (name, b), rs in groups.items():
        ok = [r for r in rs if r.tau_greedy is not None and r.tau_sampled is not None]
        mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
        bad = [r.reason for r in rs if r.reason]
        whole = len(ok) == len(rs)  # a mean over a subset of the steps is not comparable: none
        rows.append(SummaryRow(name, b, mean([r.tau_greedy for r in ok]) if whole else None,
                               mean([r.tau_sampled for r in ok]) if whole else None,
                               sum(r.num_nodes for r in rs) / len(rs), len(ok), len(rs),
                               sum(r.covered for r in rs), f"{len(rs) - len(ok)} steps {bad[0]}" if bad else None))
    return rows


@torch.no_grad()
def measure_cost_model(target, prefix_ids: Sequence[int], draft, num_rows: Sequence[int] = (1, 5, 9, 17, 33, 65),
                       repeats: int = 3, draft_seconds: float = 0.0, batch_sizes: Sequence[int] = (1,)) -> CostModel:
    """Measure seconds per target tree forward against ``N`` and the batch size on the
    target's device (CPU or CUDA).

    Each ``N`` scores the DDTree tree of ``N - 1`` nodes built from ``draft``
    (:class:`DraftTopK`; a smaller tree where the draft holds fewer prefixes) after the prefix
    ``prefix_ids`` (its last id is the root). Batch size 1 uses :meth:`TargetModel.prefill` /
    ``tree_forward`` / ``keep_path``; a batch of ``bs`` copies of the request uses
    ``prefill_batch`` / ``tree_forward_batch`` / ``keep_paths`` (what a live step runs). The
    tree rows are cut off the cache after every forward; the value kept is the median of
    ``repeats`` timed forwards after one warm-up, each ended by ``torch.cuda.synchronize()``
    on CUDA (so a forward's time is its kernels', not its launch).

    Returns:
        :class:`CostModel` with ``seconds = {bs: ...}`` for every ``bs`` in ``batch_sizes``,
        ``draft_seconds`` and ``device``.

    Raises:
        ValueError: empty ``prefix_ids``, ``repeats < 1``, ``num_rows`` not increasing from >= 1,
            a batch size < 1.
    """
    import time

    if not prefix_ids:
        raise ValueError("measure_cost_model needs prefix_ids (the ids before the root)")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if not num_rows or num_rows[0] < 1:
        raise ValueError(f"num_rows must start at >= 1, got {list(num_rows)}")
    if not batch_sizes or any(int(b) < 1 for b in batch_sizes):
        raise ValueError(f"batch_sizes must be >= 1, got {list(batch_sizes)}")
    device = torch.device(getattr(target, "device", "cpu"))

    def clock() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    root = int(prefix_ids[-1])
    p = len(prefix_ids) - 1
    seconds: dict[int, tuple[float, ...]] = {}
    for bs in (int(b) for b in batch_sizes):
        if bs == 1:
            cache, _, _ = target.prefill(list(prefix_ids[:-1]))
        else:
            state, _, _ = target.prefill_batch([list(prefix_ids[:-1])] * bs)
        secs = []
        for n in num_rows:
            tree = ddtree_policy(draft, root, int(n) - 1, None)
            times = []
            for r in range(repeats + 1):
                if bs == 1:
                    vi = compile_retrieve(tree, p)
                    t0 = clock()
                    target.tree_forward(cache, vi)
                    dt = clock() - t0
                    target.keep_path(cache, p, [])  # cut the tree rows off again
                else:
                    batch = DDTreeBuildResult(**{f: getattr(tree, f).expand(bs, -1).clone() for f in
                                                 ("node_token_ids", "parents", "depths", "ranks", "node_logws")},
                                              num_nodes=tree.num_nodes.expand(bs).clone())
                    vi = compile_retrieve(batch, torch.full((bs,), p, dtype=torch.int64))
                    t0 = clock()
                    target.tree_forward_batch(state, vi)
                    dt = clock() - t0
                    target.keep_paths(state, [[] for _ in range(bs)], vi.num_rows)
                if r:
                    times.append(dt)
            secs.append(sorted(times)[len(times) // 2])
        seconds[bs] = tuple(secs)
    return CostModel(tuple(int(n) for n in num_rows), seconds, draft_seconds=draft_seconds, device=str(device))
