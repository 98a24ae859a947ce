"""Reference tree verifiers: greedy and sampled (target-only rule), with a decision log.

The walk is the one of SGLang's ``verify_tree_greedy`` and
``tree_speculative_sampling_target_only`` (``sgl-kernel`` ``speculative_sampling.cuh``):
start at the root; at the current node walk its children through
``retrieve_next_token`` / ``retrieve_next_sibling``; accept at most one child and move to it;
stop when no child is accepted or the node is a leaf; then emit the bonus token.

**Greedy.** Accept the first child whose token is the argmax of the target logits at the
current node (lowest token id on equal logits). The bonus is that argmax.

**Sampled (target-only, thresholds 1.0).** At the current node ``c`` one coin
``u = coins[b, c]``; walk the children in sibling order accumulating target mass
``S_k = p_c(t_1) + ... + p_c(t_k)`` (float32, in sibling order); accept the first child with ``u < S_k`` (strict) and
``p_c(t_k) > 0``. The next level uses the coin of the accepted node. If no child is accepted,
the bonus is drawn with ``final_coins[b]`` from ``p_c`` with the rejected siblings' tokens
zeroed and renormalised; at a leaf, from ``p_c`` unchanged. Because a tree's siblings carry
distinct tokens and the tree was built without looking at the target, the emitted sequence
has exactly the target's law (each child is taken with probability ``p_c(t_k)``, the bonus
with ``p_c(t)`` for every other ``t``).

Against SGLang: its 0.5.23 kernels accept with the same strict ``u < S_k / threshold_acc``
and ``p > 0`` (older sgl-kernel releases compared ``u <= S_k`` without the guard). By
design, the final draw here never returns a zero-probability token, and an empty residual
is an explicit outcome (``support_exhausted``, bonus ``-1``); SGLang's draw starts from
token ``V - 1`` and returns it when float mass rounds below the coin or nothing is left.

The lossy thresholds ``threshold_single`` / ``threshold_acc`` (SGLang's names) exist for
experiments: accept when ``u < S_k / threshold_acc`` or ``p_c(t_k) >= threshold_single``.
Anything but ``1.0`` breaks exactness.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from ._checks import check_shape, check_tensor
from .retrieve import DDTreeVerifyInput
from .sampling import SamplingParams, check_logits_rows, normalize_params

__all__ = [
    "Decision",
    "BonusDraw",
    "VerifyOutput",
    "verify_greedy",
    "verify_sampled",
    "draw_coins",
    "make_generators",
    "residual_draw",
]


@dataclass(frozen=True)
class Decision:
    """One visited sibling: the verdict on node ``node`` as a child of ``parent``.

    ``target_prob`` is ``p_parent(token)`` under the request's target distribution (greedy:
    the softmax of the raw logits, for display); ``cumulative_mass`` is ``S_k`` (sampled) or
    the running sum of those probabilities (greedy); ``coin`` is ``None`` for greedy.
    ``verdict`` is ``"accept"`` or ``"reject"``.
    """

    request: int
    depth: int
    parent: int
    node: int
    token: int
    target_prob: float
    cumulative_mass: float
    coin: float | None
    verdict: str

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class BonusDraw:
    """How the bonus token was chosen at node ``node``.

    ``kind``: ``"argmax"`` (greedy), ``"residual"`` (after rejected children), ``"leaf"``
    (no children: the row unchanged) or ``"exhausted"`` (residual mass 0: no bonus).
    ``residual_mass``: the mass left after zeroing rejected siblings (1.0 at a leaf, up to
    float error). ``coin``: the final coin (``None`` for greedy).
    """

    request: int
    node: int
    token: int
    kind: str
    residual_mass: float
    coin: float | None
    token_prob: float

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class VerifyOutput:
    """Result of verifying a batch (DESIGN.md, "Sampled verify").

    Attributes:
        accept_index: ``[bs, L]`` int64, accepted path as local node indices, root first,
            ``-1`` padded. ``L = max depth + 1``.
        accept_length: ``[bs]`` int64, accepted *draft* tokens (bonus excluded).
        emitted_tokens: ``[bs, L]`` int64, accepted draft tokens then the bonus, ``-1``
            padded (the bonus is absent when the support was exhausted).
        bonus_token: ``[bs]`` int64, ``-1`` when ``support_exhausted``.
        support_exhausted: ``[bs]`` bool.
        decisions: per request, the visited siblings in walk order.
        bonus: per request, the :class:`BonusDraw`.
        backend: which implementation produced this (``"reference"``, ``"triton"``, ...).
    """

    accept_index: torch.Tensor
    accept_length: torch.Tensor
    emitted_tokens: torch.Tensor
    bonus_token: torch.Tensor
    support_exhausted: torch.Tensor
    decisions: list[list[Decision]] = field(default_factory=list)
    bonus: list[BonusDraw] = field(default_factory=list)
    backend: str = "reference"

    def tau(self) -> torch.Tensor:
        """Accept length τ per request: accepted draft tokens + 1 (the bonus), ``[bs]``."""
        return self.accept_length + (~self.support_exhausted).long()


def make_generators(params: Sequence[SamplingParams], device: torch.device | str = "cpu") -> list[torch.Generator]:
    """One ``torch.Generator`` per request, seeded from ``params[b].seed`` (or randomly)."""
    gens = []
    for p in params:
        g = torch.Generator(device=device)
        if p.seed is not None:
            g.manual_seed(p.seed)
        else:
            g.seed()
        gens.append(g)
    return gens


def draw_coins(generators: Sequence[torch.Generator], num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Coins for one verify step: ``coins [bs, N]`` and ``final_coins [bs]``, float32 in [0, 1).

    Each request draws ``N + 1`` uniforms from its own generator (``N`` node coins, then the
    final coin), so a step replays bit for bit from the generator state.
    """
    rows = [torch.rand(num_rows + 1, generator=g, dtype=torch.float32, device=g.device) for g in generators]
    if not rows:
        return torch.zeros(0, num_rows), torch.zeros(0)
    stacked = torch.stack(rows)
    return stacked[:, :num_rows].contiguous(), stacked[:, num_rows].contiguous()


def _check_verify_input(vi: DDTreeVerifyInput, rows: torch.Tensor, name: str) -> None:
    if not isinstance(vi, DDTreeVerifyInput):
        raise TypeError(f"verify_input must be a DDTreeVerifyInput, got {type(vi).__name__}")
    bs, n = vi.node_token_ids.shape
    if rows.dim() != 3 or tuple(rows.shape[:2]) != (bs, n):
        raise ValueError(f"{name} must have shape [bs={bs}, N={n}, V], got {tuple(rows.shape)}")
    vocab = rows.shape[2]
    check_shape("num_nodes", vi.num_nodes, (bs,))
    bad_count = (vi.num_nodes < 1) | (vi.num_nodes > n)
    if bad_count.any():
        b = int(bad_count.nonzero()[0])
        raise ValueError(f"num_nodes, request {b}: {int(vi.num_nodes[b])} is outside [1, N={n}]")
    for fname in ("retrieve_next_token", "retrieve_next_sibling"):
        buf = getattr(vi, fname)
        check_shape(fname, buf, (bs, n))
        bad = (buf < -1) | (buf >= vi.num_nodes[:, None])
        bad &= torch.arange(n, device=buf.device)[None, :] < vi.num_nodes[:, None]
        if bad.any():
            b, i = (int(v) for v in bad.nonzero()[0])
            raise ValueError(f"{fname}, request {b}, node {i}: {int(buf[b, i])} is out of range")
    real = torch.arange(n, device=vi.node_token_ids.device)[None, :] < vi.num_nodes[:, None]
    bad = real & ((vi.node_token_ids < 0) | (vi.node_token_ids >= vocab))
    if bad.any():
        b, i = (int(v) for v in bad.nonzero()[0])
        raise ValueError(f"node_token_ids, request {b}, node {i}: token {int(vi.node_token_ids[b, i])} not in [0, {vocab})")


def _max_path(vi: DDTreeVerifyInput) -> int:
    return int(vi.depths.max()) + 1 if vi.depths.numel() else 1


def _children(next_token: list[int], next_sibling: list[int], node: int, limit: int):
    child = next_token[node]
    steps = 0
    while child != -1:
        steps += 1
        if steps > limit:
            raise ValueError(f"node {node}: sibling chain longer than the tree (a cycle in retrieve_next_sibling)")
        yield child
        child = next_sibling[child]


def _finish(vi, paths, bonus_tokens, exhausted, decisions, bonus, backend) -> VerifyOutput:
    bs = vi.batch_size
    width = max(_max_path(vi), max((len(p) for p in paths), default=1))
    accept_index = torch.full((bs, width), -1, dtype=torch.int64)
    emitted = torch.full((bs, width), -1, dtype=torch.int64)
    tokens = vi.node_token_ids.tolist()
    for b, path in enumerate(paths):
        accept_index[b, : len(path)] = torch.tensor(path, dtype=torch.int64)
        drafted = [tokens[b][i] for i in path[1:]]
        out = drafted + ([] if exhausted[b] else [bonus_tokens[b]])
        if out:
            emitted[b, : len(out)] = torch.tensor(out, dtype=torch.int64)
    return VerifyOutput(
        accept_index=accept_index,
        accept_length=torch.tensor([len(p) - 1 for p in paths], dtype=torch.int64),
        emitted_tokens=emitted,
        bonus_token=torch.tensor(bonus_tokens, dtype=torch.int64),
        support_exhausted=torch.tensor(exhausted, dtype=torch.bool),
        decisions=decisions,
        bonus=bonus,
        backend=backend,
    )


def verify_greedy(verify_input: DDTreeVerifyInput, target_logits: torch.Tensor) -> VerifyOutput:
    """Greedy tree verification (SGLang ``verify_tree_greedy``), whole batch.

    Args:
        verify_input: buffers from :func:`ddtree_lab.compile_retrieve`.
        target_logits: ``[bs, N, V]`` float32 / float16 / bfloat16, the target's logits at
            every node (row ``i`` predicts the token after node ``i``).

    Returns:
        :class:`VerifyOutput`; ``decisions`` hold, per visited sibling, the softmax
        probability of its token (for display), the running sum, and the verdict.

    Raises:
        ValueError: shape mismatch, a buffer index out of range, a token outside the
            vocabulary, or a NaN / all ``-inf`` row on the walked path (request and node named).
    """
    check_tensor("target_logits", target_logits, dtype=(torch.float32, torch.float16, torch.bfloat16), ndim=3)
    _check_verify_input(verify_input, target_logits, "target_logits")
    check_logits_rows(target_logits, verify_input.num_nodes)
    argmax = target_logits.float().argmax(-1).tolist()
    probs = torch.softmax(target_logits.float(), dim=-1)
    nt, ns = verify_input.retrieve_next_token.tolist(), verify_input.retrieve_next_sibling.tolist()
    tokens = verify_input.node_token_ids.tolist()
    paths, bonus_tokens, exhausted, decisions, bonus = [], [], [], [], []
    for b in range(verify_input.batch_size):
        n = int(verify_input.num_nodes[b])
        cur, path, log = 0, [0], []
        while True:
            want = argmax[b][cur]
            mass, nxt = 0.0, None
            for child in _children(nt[b], ns[b], cur, n):
                p = float(probs[b, cur, tokens[b][child]])
                mass += p
                ok = tokens[b][child] == want
                log.append(Decision(b, len(path), cur, child, tokens[b][child], p, mass, None, "accept" if ok else "reject"))
                if ok:
                    nxt = child
                    break
            if nxt is None:
                break
            cur = nxt
            path.append(cur)
            if len(path) > n:
                raise ValueError(f"request {b}, node {cur}: the walk revisits nodes (a cycle in retrieve_next_token)")
        paths.append(path)
        bonus_tokens.append(argmax[b][cur])
        exhausted.append(False)
        decisions.append(log)
        bonus.append(BonusDraw(b, cur, argmax[b][cur], "argmax", 1.0, None, float(probs[b, cur, argmax[b][cur]])))
    return _finish(verify_input, paths, bonus_tokens, exhausted, decisions, bonus, "reference")


def residual_draw(row: torch.Tensor, rejected: Sequence[int], coin: float,
                  mass: float | None = None) -> tuple[int, float, float]:
    """Inverse-CDF draw of the bonus token: ``(token, residual mass, its probability)``.

    The residual is ``row`` with the ``rejected`` tokens zeroed; the running sum is float64 in
    token-id order; the token is the first index whose running sum exceeds ``coin * mass``.
    It is never a zero-probability token: when rounding puts the target at or past the end,
    the last token with positive residual is taken. Token ``-1`` when the residual is empty.

    The draw reads ``row`` only up to the chosen token, plus the total ``mass``: a trace
    stores exactly that prefix and the mass, and replays the draw by passing ``mass``
    (``None``: the float64 sum of the whole residual row).

    Args:
        row: ``[V]`` (or a prefix of it when ``mass`` is given) target probabilities, float32.
        rejected: token ids zeroed before the draw (the rejected siblings).
        coin: the final coin in [0, 1).
    """
    residual = row.double().clone()
    rejected = [t for t in rejected if t < residual.shape[0]]
    if rejected:
        residual[torch.tensor(rejected, dtype=torch.int64, device=row.device)] = 0.0
    cum = residual.cumsum(0)
    if mass is None:
        mass = float(cum[-1]) if cum.numel() else 0.0
    if mass <= 0.0:
        return -1, 0.0, 0.0
    target = coin * mass
    idx = int(torch.searchsorted(cum, torch.tensor([target], dtype=torch.float64, device=row.device), right=True)[0])
    if idx >= residual.shape[0] or residual[idx] <= 0.0:
        positive = residual.nonzero()
        if positive.numel() == 0:
            raise ValueError(f"residual_draw: the row (length {residual.shape[0]}) has no positive residual "
                             f"although mass = {mass} was given: the stored prefix does not cover this draw")
        idx = int(positive[-1])
    return idx, mass, float(residual[idx]) / mass


def verify_sampled(
    verify_input: DDTreeVerifyInput,
    target_probs: torch.Tensor,
    coins: torch.Tensor,
    final_coins: torch.Tensor,
    *,
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
    final_masses: Sequence[float | None] | None = None,
) -> VerifyOutput:
    """Sampled tree verification, target-only rule (module docstring), whole batch.

    Greedy requests can sit in the same batch: give them one-hot rows (as
    :func:`ddtree_lab.target_probs` does for temperature 0) and the rule accepts the
    argmax child whatever the coin.

    Args:
        verify_input: buffers from :func:`ddtree_lab.compile_retrieve`.
        target_probs: ``[bs, N, V]`` float32, each node's row from
            :func:`ddtree_lab.target_probs` (rows sum to 1; padding rows ignored).
        coins: ``[bs, N]`` float32 in [0, 1); ``coins[b, i]`` decides among the children of
            node ``i`` (SGLang's ``uniform_samples`` layout).
        final_coins: ``[bs]`` float32 in [0, 1), for the bonus draw.
        threshold_single, threshold_acc: 1.0 for the exact rule (see module docstring).
        final_masses: per request, the residual mass of the bonus draw when ``target_probs``
            holds the final row only up to the drawn token (trace replay, see
            :func:`residual_draw`); ``None`` computes it from the row.

    Returns:
        :class:`VerifyOutput` with the decision log (node, token, ``p``, ``S_k``, coin, verdict)
        and, per request, the :class:`BonusDraw` (residual mass and the coin used).

    Raises:
        ValueError: shape or range errors, coins outside [0, 1), NaN or negative
            probabilities on a walked row, or thresholds outside (0, 1] (each names request
            and node where it applies).
    """
    check_tensor("target_probs", target_probs, dtype=torch.float32, ndim=3)
    _check_verify_input(verify_input, target_probs, "target_probs")
    bs, n = verify_input.node_token_ids.shape
    _check_coins(coins, final_coins, bs, n)
    _check_thresholds(threshold_single, threshold_acc)
    bad_rows = (torch.isnan(target_probs).any(-1) | (target_probs < 0).any(-1)).tolist()

    def row_of(b: int, i: int) -> torch.Tensor:
        if bad_rows[b][i]:
            raise ValueError(f"target_probs, request {b}, node {i}: row has NaN or negative entries")
        return target_probs[b, i]

    return walk_sampled_batch(verify_input, row_of, coins, final_coins, threshold_single, threshold_acc,
                              final_masses, "reference")


def walk_sampled_batch(vi, row_of, coins, final_coins, threshold_single, threshold_acc, final_masses,
                       backend: str) -> VerifyOutput:
    """The sampled walk of every request of a batch; ``row_of(b, i)`` gives node ``i``'s float32
    row of request ``b`` and is called only for rows the walk reaches (the reference reads a
    full tensor, the lazy backend computes rows on demand)."""
    nt, ns = vi.retrieve_next_token.tolist(), vi.retrieve_next_sibling.tolist()
    tokens = vi.node_token_ids.tolist()
    coin_rows, final = coins.tolist(), final_coins.tolist()
    paths, bonus_tokens, exhausted, decisions, bonus = [], [], [], [], []
    for b in range(vi.batch_size):
        path, log, draw = _walk_sampled(b, int(vi.num_nodes[b]), lambda i, b=b: row_of(b, i), nt[b], ns[b],
                                        tokens[b], coin_rows[b], final[b], threshold_single, threshold_acc,
                                        None if final_masses is None else final_masses[b])
        paths.append(path)
        bonus_tokens.append(draw.token)
        exhausted.append(draw.token < 0)
        decisions.append(log)
        bonus.append(draw)
    return _finish(vi, paths, bonus_tokens, exhausted, decisions, bonus, backend)


def _check_coins(coins: torch.Tensor, final_coins: torch.Tensor, bs: int, n: int) -> None:
    check_tensor("coins", coins, dtype=torch.float32, ndim=2)
    check_shape("coins", coins, (bs, n))
    check_tensor("final_coins", final_coins, dtype=torch.float32, ndim=1)
    check_shape("final_coins", final_coins, (bs,))
    for name, c in (("coins", coins), ("final_coins", final_coins)):
        bad = ~((c >= 0) & (c < 1))
        if bad.any():
            where = [int(v) for v in bad.nonzero()[0]]
            raise ValueError(f"{name}, request {where[0]}{', node ' + str(where[1]) if len(where) > 1 else ''}: "
                             f"{float(c[tuple(where)])} is not in [0, 1)")


def _check_thresholds(threshold_single: float, threshold_acc: float) -> None:
    for name, t in (("threshold_single", threshold_single), ("threshold_acc", threshold_acc)):
        if not 0.0 < t <= 1.0:
            raise ValueError(f"{name} must be in (0, 1], got {t}")


def _walk_sampled(b, count, row_of, nt, ns, tokens, coin_row, final_coin, threshold_single, threshold_acc,
                  final_mass=None):
    """The sampled walk of request ``b``: (path, decisions, BonusDraw).

    ``row_of(i)`` returns node ``i``'s float32 probability row ``[V]``; it is called only for
    the rows the walk reaches (the reference passes rows of a full tensor, the lazy torch
    backend computes them on demand). ``final_mass``: see :func:`residual_draw`.
    """
    cur, path, log = 0, [0], []
    while True:
        row = row_of(cur)
        u = coin_row[cur]
        mass, nxt, rejected = 0.0, None, []
        children = list(_children(nt, ns, cur, count))
        child_p = row[[tokens[c] for c in children]].tolist() if children else []
        for child, p in zip(children, child_p):
            mass = float(np.float32(mass + p))  # S_k in float32, as a kernel sums it
            ok = p > 0.0 and (u < mass / threshold_acc or p >= threshold_single)
            log.append(Decision(b, len(path), cur, child, tokens[child], p, mass, u, "accept" if ok else "reject"))
            if ok:
                nxt = child
                break
            rejected.append(tokens[child])
        if nxt is None:
            break
        cur = nxt
        path.append(cur)
        if len(path) > count:
            raise ValueError(f"request {b}, node {cur}: the walk revisits nodes (a cycle in retrieve_next_token)")
    token, residual_mass, token_p = residual_draw(row, rejected, final_coin, final_mass)
    kind = "exhausted" if token < 0 else ("residual" if rejected else "leaf")
    return path, log, BonusDraw(b, cur, token, kind, residual_mass, final_coin, token_p)
