"""The torch-batched backend: the sampled walk of a whole batch as tensor ops, with no host read.

The same rule as every other verifier (:mod:`ddtree_lab.verify.rules`: the target-only
accept test with its float32 running sum in sibling order, the floating-point edge, the
residual bonus draw; SGLang's rule at lossy thresholds; greedy requests as one-hot rows), the
same walk over ``retrieve_next_token`` / ``retrieve_next_sibling`` -- but every request walks
at once, one depth per iteration, and nothing is read back to the host: the loop bounds are
shapes the caller knows (the tree's depth bound and the most children a node can have), the
value checks are flags on the device, and the result stays on the device until the caller
reads it (the live step reads it once, with everything else it needs: issue 36).

Its decision log and bonus record come as tensors (``log=True``: :class:`BatchedLog`), which
:func:`decisions_from_log` turns into the :class:`~ddtree_lab.verify.Decision` s and
:class:`~ddtree_lab.verify.BonusDraw` the other verifiers log, on the host, later: the live
step's level ``light`` (``LiveSession(verify_backend="torch-batched")``) does that in a writer
thread. There is no :class:`~ddtree_lab.VerifyOutput` and no walk event here.

Per depth: one row per request gathered from the logits and turned into its request's
probabilities (:func:`ddtree_lab.sampling.filtered_probs`, the reference's row function, one
call per distinct :class:`SamplingParams`), the current node's children followed along the
sibling links (``max_children`` gathers), their running sum in float32 (``max_children``
adds: the rule's sum is sequential, which no parallel scan reproduces bit for bit), the
accept test over all children at once. Because each op is the reference's own op on the same
float32 values, the result equals :func:`ddtree_lab.verify_sampled` on
:func:`ddtree_lab.target_probs` exactly on the CPU (``tests/test_verify_batched.py``). On a
GPU one op differs: the bonus draw's float64 running sum over the vocabulary is a parallel
scan there, not the CPU's sequential one, so a final coin within float64 rounding of a
boundary may draw the neighbouring token (not yet compared on a GPU).

Cost: every depth computes one full row per request, also for requests whose walk has
stopped (knowing which have stopped is a host read); on a CPU that is slower than the
per-request walks (``benchmarks/host_syncs.out.txt``), which is why a CPU session keeps
``torch-lazy``. On a GPU the launches are many and small (counted on the CPU: about
``9 * max_children + 84`` torch ops per depth, views included, and ~14 more per extra
parameter set); every shape is known from the inputs' shapes, as CUDA graph capture needs,
but capture has not been tried (no GPU was lent for it).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Sequence

import numpy as np
import torch

from .._arguments import check_tensor
from ..buffers import DDTreeVerifyInput
from ..hostsync import to_device
from ..sampling import SamplingParams, filtered_probs, normalize_params
from .reference import check_coin_shapes, check_thresholds, check_verify_shapes, coin_flags, verify_input_flags
from .rules import SGLANG_MIN_THRESHOLD_ACC
from .types import BonusDraw, Decision, is_lossy

__all__ = ["BatchedVerifyOutput", "BatchedLog", "verify_batched", "raise_batched_problems", "FLAG_NAMES",
           "decisions_from_log"]

#: What each entry of :attr:`BatchedVerifyOutput.flags` says when True.
FLAG_NAMES = ("num_nodes out of range", "retrieve_next_token out of range", "retrieve_next_sibling out of range",
              "node token id out of range", "coin outside [0, 1)", "final coin outside [0, 1)",
              "a walked target row has NaN, +inf or every entry -inf, or no mass left after its bans", "a node has more than max_children children",
              "a path is deeper than max_depth")


@dataclass
class BatchedLog:
    """What the walk read and decided, as tensors (``verify_batched(..., log=True)``): enough
    to write the decision log, the bonus record and the level-``light`` rows on the host later
    (:func:`decisions_from_log`), after one copy. ``D + 1`` walk levels, ``K = max_children``.

    Attributes:
        node: ``[bs, D + 1]`` int64, the node whose children level ``d`` judged (-1: the walk had stopped).
        children, child_probs, masses: ``[bs, D + 1, K]``: its children in sibling order (-1
            past the last), their target probabilities and the running sums ``S_k`` (float32).
        coins: ``[bs, D + 1]`` float32, the coin of each level's node.
        decided: ``[bs, D + 1]`` int64, decisions logged at each level (the visited siblings).
        accepted, edge: ``[bs, D + 1]`` bool: the last visited sibling was accepted; by the
            floating-point edge (logged with ``cumulative_mass`` 1.0).
        bonus_node: ``[bs]`` int64; bonus_mass, bonus_token_prob: ``[bs]`` float64;
        bonus_leaf: ``[bs]`` bool, the bonus node had no children.
        final_probs: ``[bs, V]`` float32, the bonus node's row (level ``light`` keeps its prefix).
    """

    node: torch.Tensor
    children: torch.Tensor
    child_probs: torch.Tensor
    masses: torch.Tensor
    coins: torch.Tensor
    decided: torch.Tensor
    accepted: torch.Tensor
    edge: torch.Tensor
    bonus_node: torch.Tensor
    bonus_mass: torch.Tensor
    bonus_token_prob: torch.Tensor
    bonus_leaf: torch.Tensor
    final_probs: torch.Tensor


@dataclass
class BatchedVerifyOutput:
    """Result of :func:`verify_batched`: device tensors, nothing read back.

    Attributes:
        accept_index: ``[bs, D + 1]`` int64, the accepted path as local node indices, root
            first, ``-1`` padded (``D`` the depth bound).
        accept_length: ``[bs]`` int64, accepted draft tokens (bonus excluded).
        emitted_tokens: ``[bs, D + 1]`` int64, accepted draft tokens then the bonus, ``-1`` padded.
        bonus_token: ``[bs]`` int64, ``-1`` when ``support_exhausted``.
        support_exhausted: ``[bs]`` bool.
        flags: ``[len(FLAG_NAMES)]`` bool, the value checks (:data:`FLAG_NAMES`); the outputs
            mean nothing where one is True (:func:`raise_batched_problems` names it).
        backend: ``"torch-batched"``. thresholds, lossy: as :class:`~ddtree_lab.VerifyOutput`.
        log: the :class:`BatchedLog` (``log=True``), else None.
    """

    accept_index: torch.Tensor
    accept_length: torch.Tensor
    emitted_tokens: torch.Tensor
    bonus_token: torch.Tensor
    support_exhausted: torch.Tensor
    flags: torch.Tensor
    backend: str = "torch-batched"
    thresholds: tuple[float, float] = (1.0, 1.0)
    lossy: bool = False
    log: BatchedLog | None = None

    def tau(self) -> torch.Tensor:
        """Accept length τ per request: accepted draft tokens + 1 (the bonus), ``[bs]``."""
        return self.accept_length + (~self.support_exhausted).long()


def _bound(name: str, value, default: int) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    return value


def _row_probs(raw: torch.Tensor, items: Sequence[SamplingParams], groups) -> torch.Tensor:
    """``[bs, V]`` float32 probabilities of the rows ``raw`` (one per request), each under its
    request's parameters: one :func:`filtered_probs` call per distinct parameter set."""
    if len(groups) == 1:
        return filtered_probs(raw, items[0])
    probs = torch.empty_like(raw)
    for p, idx in groups:
        probs.index_copy_(0, idx, filtered_probs(raw.index_select(0, idx), p))
    return probs


def _last_true(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last True along dim 1 of ``mask [bs, K]`` (0 where none)."""
    k = mask.shape[1]
    return torch.where(mask.any(1), k - 1 - mask.flip(1).to(torch.int8).argmax(1), 0)


def verify_batched(
    verify_input: DDTreeVerifyInput,
    target_logits: torch.Tensor,
    params: SamplingParams | Sequence[SamplingParams],
    coins: torch.Tensor,
    final_coins: torch.Tensor,
    *,
    max_depth: int | None = None,
    max_children: int | None = None,
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
    check: bool = True,
    log: bool = False,
) -> BatchedVerifyOutput:
    """Sampled tree verify of a whole batch on the logits' device, with no host read (module docstring).

    Args:
        verify_input: buffers from :func:`ddtree_lab.compile_retrieve` (any device; moved to
            the logits').
        target_logits: ``[bs, N, V]`` float32 / float16 / bfloat16 raw target logits.
        params: one :class:`SamplingParams` or one per request (``temperature == 0``: greedy,
            one-hot rows).
        coins: ``[bs, N]`` float32; final_coins: ``[bs]`` float32, in ``[0, 1)``.
        max_depth: the deepest node's depth, or a bound on it (default ``N - 1``): the walk
            runs ``max_depth + 1`` iterations.
        max_children: the most children any node has, or a bound (default ``N - 1``; for
            DDTree trees the draft top-k width).
        threshold_single, threshold_acc: as :func:`ddtree_lab.verify_sampled`.
        check: read the value flags once and raise for the first problem
            (:func:`raise_batched_problems`); ``False`` leaves ``flags`` for the caller to read
            with its own results (the live step), and no host read happens here.
        log: also return what the walk read and decided (:class:`BatchedLog`, on the device).

    Returns:
        :class:`BatchedVerifyOutput` on the logits' device; its paths, tokens, bonus and
        ``support_exhausted`` equal :func:`ddtree_lab.verify_sampled` on
        :func:`ddtree_lab.target_probs` (same rule, same float32 ops).

    Raises:
        TypeError / ValueError: wrong types or shapes, bad thresholds or bounds, invalid
            parameters (naming the request); with ``check``, the value problems
            :func:`ddtree_lab.verify_tree` reports (range, coins, a bad logit row the walk
            reaches), named as it names them.
    """
    check_tensor("target_logits", target_logits, dtype=(torch.float32, torch.float16, torch.bfloat16), ndim=3)
    check_verify_shapes(verify_input, target_logits, "target_logits")
    bs, n, vocab = target_logits.shape
    items = normalize_params(params, bs, vocab)
    check_coin_shapes(coins, final_coins, bs, n)
    check_thresholds(threshold_single, threshold_acc)
    depth_bound = _bound("max_depth", max_depth, max(n - 1, 0))
    kmax = max(1, _bound("max_children", max_children, max(n - 1, 1)))
    dev = target_logits.device
    vi = verify_input
    nt, ns = to_device(vi.retrieve_next_token, dev), to_device(vi.retrieve_next_sibling, dev)
    tokens, num_nodes = to_device(vi.node_token_ids, dev), to_device(vi.num_nodes, dev)
    u_all, final = to_device(coins, dev), to_device(final_coins, dev)
    lossy = is_lossy(threshold_single, threshold_acc)
    by_params: dict[SamplingParams, list[int]] = {}
    for b, p in enumerate(items):
        by_params.setdefault(p, []).append(b)
    groups = [(p, to_device(torch.tensor(rows, dtype=torch.int64), dev)) for p, rows in by_params.items()]
    # float32 thresholds made on the device (a fill, not a copy; a tensor divisor, never a
    # Python scalar, which CUDA may turn into multiplication by its reciprocal)
    ts = torch.full((1, 1), float(np.float32(threshold_single)), dtype=torch.float32, device=dev)
    ta = torch.full((1, 1), float(max(np.float32(threshold_acc), np.float32(SGLANG_MIN_THRESHOLD_ACC))),
                    dtype=torch.float32, device=dev)
    # range checks first: the walk below clamps every index, so bad buffers cannot read out of bounds
    safe_nt = torch.where((nt >= 0) & (nt < n), nt, -1)
    safe_ns = torch.where((ns >= 0) & (ns < n), ns, -1)
    safe_tok = tokens.clamp(0, vocab - 1)

    batch = torch.arange(bs, device=dev)
    cur = torch.zeros(bs, dtype=torch.int64, device=dev)
    alive = num_nodes >= 1
    path = torch.full((bs, depth_bound + 1), -1, dtype=torch.int64, device=dev)
    path[:, 0] = 0
    final_probs = torch.zeros(bs, vocab, dtype=torch.float32, device=dev)
    final_rejected = torch.zeros(bs, vocab, dtype=torch.bool, device=dev)
    bad_row = torch.zeros(bs, dtype=torch.bool, device=dev)
    crowded = torch.zeros(bs, dtype=torch.bool, device=dev)
    levels: list[tuple[torch.Tensor, ...]] = []
    final_node = torch.zeros(bs, dtype=torch.int64, device=dev)
    final_leaf = torch.zeros(bs, dtype=torch.bool, device=dev)
    for d in range(depth_bound + 1):
        raw = target_logits[batch, cur].float()  # [bs, V]: the current node's row of each request
        bad_row |= alive & (torch.isnan(raw).any(1) | torch.isposinf(raw).any(1) | torch.isneginf(raw).all(1))
        probs = _row_probs(raw, items, groups)
        bad_row |= alive & torch.isnan(probs).any(1)  # no mass left (every finite logit banned)
        # the children in sibling order, along the links
        child = safe_nt.gather(1, cur[:, None])[:, 0]
        chain = []
        for _ in range(kmax):
            chain.append(child)
            child = torch.where(child >= 0, safe_ns.gather(1, child.clamp(min=0)[:, None])[:, 0], -1)
        crowded |= alive & (child >= 0)
        kids = torch.stack(chain, 1)  # [bs, K], -1 past the last child
        valid = (kids >= 0) & alive[:, None]
        kid_tok = safe_tok.gather(1, kids.clamp(min=0))
        p = torch.where(valid, probs.gather(1, kid_tok), 0.0)
        running, mass = torch.zeros(bs, dtype=torch.float32, device=dev), []
        for k in range(kmax):  # S_k in float32, in sibling order (the rule's sum)
            running = running + p[:, k]
            mass.append(running)
        s = torch.stack(mass, 1)
        u = u_all.gather(1, cur[:, None])
        if lossy:  # SGLang's rule: u <= S / max(threshold_acc, 1e-9) or p >= threshold_single
            ok = valid & ((u <= s / ta) | (p >= ts))
        else:
            ok = valid & (p > 0) & ((u < s) | (p.double() >= threshold_single))
        accepted = ok.any(1)
        pick = ok.to(torch.int8).argmax(1)  # the first accepted child
        edge = torch.zeros_like(accepted)
        rejected = torch.zeros(bs, vocab + 1, dtype=torch.bool, device=dev)
        rejected.scatter_(1, torch.where(valid, kid_tok, vocab), True)
        rejected = rejected[:, :vocab]
        if not lossy:  # the floating-point edge: children holding the whole row take the last positive one
            positive = valid & (p > 0)
            edge = alive & ~accepted & positive.any(1) & ~((probs > 0) & ~rejected).any(1)
            pick = torch.where(edge, _last_true(positive), pick)
            accepted = accepted | edge
        move = alive & accepted
        stop = alive & ~accepted
        final_probs = torch.where(stop[:, None], probs, final_probs)
        final_rejected = torch.where(stop[:, None], rejected, final_rejected)
        if log:
            final_node = torch.where(stop, cur, final_node)
            final_leaf = torch.where(stop, ~valid.any(1), final_leaf)
            decided = torch.where(move, pick + 1, torch.where(alive, valid.sum(1), 0))
            levels.append((torch.where(alive, cur, -1), torch.where(valid, kids, -1), p, s, u[:, 0], decided,
                           move, edge & alive))
        nxt = kids.gather(1, pick[:, None])[:, 0]
        if d < depth_bound:
            path[:, d + 1] = torch.where(move, nxt, -1)
        cur = torch.where(move, nxt, cur)
        alive = move
    too_deep = alive  # still moving after max_depth + 1 levels
    # the bonus: inverse-CDF draw from the residual (float64 running sum in token order)
    residual = torch.where(final_rejected, 0.0, final_probs.double())
    cum = residual.cumsum(1)
    total = cum[:, -1]
    idx = torch.searchsorted(cum, (final.double() * total)[:, None], right=True)[:, 0]
    landed = residual.gather(1, idx.clamp(max=vocab - 1)[:, None])[:, 0]
    idx = torch.where((idx >= vocab) | (landed <= 0.0), _last_true(residual > 0), idx)
    exhausted = total <= 0.0
    bonus = torch.where(exhausted, -1, idx)
    record = None
    if log:
        parts = [torch.stack(x, 1) for x in zip(*levels)]
        token_prob = torch.where(exhausted, 0.0, residual.gather(1, idx[:, None])[:, 0] / torch.where(exhausted, 1.0, total))
        record = BatchedLog(*parts, bonus_node=final_node, bonus_mass=torch.where(exhausted, 0.0, total),
                            bonus_token_prob=token_prob, bonus_leaf=final_leaf, final_probs=final_probs)
    accept_length = (path >= 0).sum(1) - 1
    emitted = torch.full_like(path, -1)
    emitted[:, :-1] = torch.where(path[:, 1:] >= 0, tokens.gather(1, path[:, 1:].clamp(min=0)), -1)
    emitted.scatter_(1, accept_length[:, None], bonus[:, None])
    on_dev = DDTreeVerifyInput(**{f.name: to_device(getattr(vi, f.name), dev) for f in fields(vi)})
    flags = torch.cat([verify_input_flags(on_dev, vocab), coin_flags(u_all, final),
                       torch.stack([bad_row.any(), crowded.any(), too_deep.any()])])
    out = BatchedVerifyOutput(accept_index=path, accept_length=accept_length, emitted_tokens=emitted,
                              bonus_token=bonus, support_exhausted=exhausted, flags=flags,
                              thresholds=(float(threshold_single), float(threshold_acc)), lossy=lossy, log=record)
    if check and bool(flags.any()):
        raise_batched_problems(out.flags.tolist(), vi, target_logits, items, coins, final_coins,
                               threshold_single, threshold_acc)
    return out


def raise_batched_problems(flags: Sequence[bool], verify_input: DDTreeVerifyInput, target_logits: torch.Tensor,
                           params, coins: torch.Tensor, final_coins: torch.Tensor, threshold_single: float = 1.0,
                           threshold_acc: float = 1.0) -> None:
    """Raise the error :func:`verify_batched`'s ``flags`` (read on the host) stand for.

    The value problems come from running :func:`ddtree_lab.verify_tree` (``torch-lazy``, with its
    checks) on the same input: it names the request and node as every verifier does. A bound
    exceeded (``max_children`` / ``max_depth`` too small for the tree) is named here.

    Raises:
        ValueError: always when a flag is set (and nothing when none is).
    """
    if not any(flags):
        return
    from .backends import verify_tree

    bounds = [FLAG_NAMES[i] for i in (7, 8) if flags[i]]
    if any(flags[:7]):
        verify_tree(verify_input, target_logits, params, coins, final_coins, backend="torch-lazy",
                    threshold_single=threshold_single, threshold_acc=threshold_acc)
    what = "; ".join(bounds) or ", ".join(FLAG_NAMES[i] for i, f in enumerate(flags) if f)
    raise ValueError(f"verify_batched: {what} (the host verify found no other problem in the same input)")


def decisions_from_log(log: BatchedLog, b: int, request: int, node_token_ids: Sequence[int], bonus_token: int,
                       final_coin: float) -> "tuple[list[Decision], BonusDraw]":
    """Request ``b``'s decision log and bonus record from a :class:`BatchedLog` already on the
    host: the :class:`~ddtree_lab.verify.Decision` s and :class:`~ddtree_lab.verify.BonusDraw`
    the per-request walks log (``request`` is written into each; ``node_token_ids`` its
    tokens as a list). Reads Python values only (call it off the critical path)."""
    nodes, kids, probs, masses = log.node[b].tolist(), log.children[b].tolist(), log.child_probs[b].tolist(), \
        log.masses[b].tolist()
    coins, decided, accepted, edge = log.coins[b].tolist(), log.decided[b].tolist(), log.accepted[b].tolist(), \
        log.edge[b].tolist()
    out = []
    for d, parent in enumerate(nodes):
        if parent < 0:
            break
        for k in range(decided[d]):
            last = k == decided[d] - 1
            verdict = "accept" if (last and accepted[d]) else "reject"
            mass = 1.0 if (last and edge[d]) else masses[d][k]
            child = kids[d][k]
            out.append(Decision(request, d + 1, parent, child, node_token_ids[child], probs[d][k], mass, coins[d],
                                verdict))
    token = int(bonus_token)
    kind = "exhausted" if token < 0 else ("leaf" if bool(log.bonus_leaf[b]) else "residual")
    bonus = BonusDraw(request, int(log.bonus_node[b]), token, kind, float(log.bonus_mass[b]), float(final_coin),
                      float(log.bonus_token_prob[b]))
    return out, bonus
