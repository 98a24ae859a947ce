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

**The one walk.** :func:`walk` is the only statement of the walk: a generator of
:class:`WalkEvent` s (``"consider"`` a child, ``"move"`` to an accepted child, ``"bonus"``).
What differs between verifiers is the *rule* judging one node's children and drawing the
bonus: greedy (argmax), sampled (the rule above, over full rows or rows computed on demand),
the expansion of the Triton kernels' compact output (the kernel's own verdicts), and the
what-if walk over a trace's child probabilities (:func:`walk_request`).
:func:`events_of` rebuilds the same events from a recorded decision log.

**Floating-point edge.** ``S_k`` is a float32 sum, so when a node's children hold all of its
row's mass (every other token has probability 0: exact arithmetic gives ``S_K = 1 > u``), a
coin between the float32 ``S_K`` and 1 would reject every child and leave an empty residual.
The walk follows exact arithmetic: it then takes the last child with positive probability and
logs its ``cumulative_mass`` as ``1.0`` (the exact sum). ``support_exhausted`` is reserved for
a row with no positive mass (and, with ``threshold_acc > 1``, a lossy rule rejecting ``S = 1``).

The lossy thresholds ``threshold_single`` / ``threshold_acc`` (SGLang's names) exist for
experiments. With any setting that breaks exactness (:func:`is_lossy`: ``threshold_single < 1``
or ``threshold_acc != 1``) every verifier follows SGLang's rule exactly, as sgl-kernel's
``TreeSpeculativeSamplingTargetOnly`` (``speculative_sampling.cuh``) and its Triton / JAX ports
state it: accept a child when ``u <= S_k / max(threshold_acc, 1e-9)`` **or**
``p_c(t_k) >= threshold_single``, in float32, with **no** ``p > 0`` guard and no
floating-point-edge rule -- so ``threshold_single = 0`` accepts the first child whatever its
probability (SGLang's own kernel test at thresholds (0, 0) expects exactly that), and
``threshold_acc = 0`` divides by 1e-9. Every finite value ``>= 0`` is accepted (the 0.5.23 wheel's
kernel refuses values above 1; the lab allows them for experiments). :attr:`VerifyOutput.lossy`
marks such outputs; :mod:`ddtree_lab.threshold_law` gives the emitted law and its distance
from the target's. (The JIT kernel of the sglang 0.5.23 wheel adds a ``p > 0`` guard and a
strict ``<``; at lossy thresholds the lab follows the sgl-kernel rule and its test cases.)

At ``(1, 1)`` (and any ``threshold_single >= 1`` with ``threshold_acc == 1``) the lab keeps
its lossless rule above; it differs from sgl-kernel's ``(1, 1)`` rule only on measure-zero or
rounding events: a coin exactly equal to ``S_k`` (sgl-kernel accepts with ``<=``, so with
``u = 0`` it can take a zero-probability first child; the lab rejects), and the floating-point
edge (the lab accepts the last positive child; sgl-kernel and the 0.5.23 JIT kernel reject
every child and draw from an empty residual). Against the 0.5.23 JIT kernel at ``(1, 1)`` only
the floating-point edge differs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, Sequence

import numpy as np
import torch

from ._checks import check_shape, check_tensor
from .retrieve import DDTreeVerifyInput, check_verify_buffers
from .sampling import SamplingParams, check_logits_rows

__all__ = [
    "Decision",
    "BonusDraw",
    "UndrawnBonus",
    "WalkEvent",
    "VerifyOutput",
    "walk",
    "events_of",
    "walk_request",
    "acceptance_probabilities",
    "is_lossy",
    "sglang_accepts",
    "SGLANG_MIN_THRESHOLD_ACC",
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


@dataclass(frozen=True)
class UndrawnBonus:
    """The bonus draw a what-if walk reached but could not make (the row is not available).

    ``kind``: ``"residual"`` (after rejected children) or ``"leaf"``; ``residual_mass``: the
    mass left for the draw, ``1 - sum`` of the rejected children's probabilities (float64, from
    the stored child probabilities only). ``token`` is ``-1``: nothing was drawn.
    """

    request: int
    node: int
    kind: str
    residual_mass: float
    coin: float | None
    token: int = -1

    def describe(self) -> str:
        coin = "" if self.coin is None else f" with coin {self.coin:.6g}"
        return (f"would draw from the {'residual' if self.kind == 'residual' else 'row'} at node {self.node} "
                f"with mass {self.residual_mass:.6g}{coin}")

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class WalkEvent:
    """One event of the walk (DESIGN.md, "The walk").

    ``kind``: ``"consider"`` (child ``node`` was judged; ``decision`` is its
    :class:`Decision`), ``"move"`` (the walk moved to ``node``, the accepted child;
    ``decision`` is the accepting :class:`Decision`) or
    ``"bonus"`` (the final draw at ``node``; ``bonus`` is the :class:`BonusDraw`, or an
    :class:`UndrawnBonus` from :func:`walk_request` without rows).
    """

    kind: str
    request: int
    node: int
    decision: Decision | None = None
    bonus: "BonusDraw | UndrawnBonus | None" = None

    def to_dict(self) -> dict:
        return {"kind": self.kind, "request": self.request, "node": self.node,
                "decision": None if self.decision is None else self.decision.to_dict(),
                "bonus": None if self.bonus is None else self.bonus.to_dict()}


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
        thresholds: ``(threshold_single, threshold_acc)`` the rule ran with.
        lossy: whether those thresholds break exactness (:func:`is_lossy`).
    """

    accept_index: torch.Tensor
    accept_length: torch.Tensor
    emitted_tokens: torch.Tensor
    bonus_token: torch.Tensor
    support_exhausted: torch.Tensor
    decisions: list[list[Decision]] = field(default_factory=list)
    bonus: list[BonusDraw] = field(default_factory=list)
    backend: str = "reference"
    thresholds: tuple[float, float] = (1.0, 1.0)
    lossy: bool = False

    def tau(self) -> torch.Tensor:
        """Accept length τ per request: accepted draft tokens + 1 (the bonus), ``[bs]``."""
        return self.accept_length + (~self.support_exhausted).long()

    def events(self, request: int) -> list[WalkEvent]:
        """The walk events of ``request`` (:func:`events_of` of its decision log and bonus)."""
        return events_of(self.decisions[request], self.bonus[request] if self.bonus else None)


def is_lossy(threshold_single: float = 1.0, threshold_acc: float = 1.0) -> bool:
    """Whether the thresholds change the target-only rule (any ``threshold_single < 1`` or
    ``threshold_acc != 1``): the emitted law is then no longer the target's."""
    return threshold_single < 1.0 or threshold_acc != 1.0


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


# -- the one walk ---------------------------------------------------------------------------


def _children(request: int, next_token, next_sibling, node: int, limit: int) -> list[int]:
    """Node ``node``'s children in sibling order (at most ``limit`` hops: a defence for
    ``validate=False``; validated buffers never get near it)."""
    out = []
    child = next_token[node]
    while child != -1:
        if len(out) >= limit:
            raise ValueError(f"request {request}, node {node}: sibling chain longer than the tree "
                             "(a cycle in retrieve_next_sibling)")
        out.append(child)
        child = next_sibling[child]
    return out


def walk(request: int, num_nodes: int, next_token: Sequence[int], next_sibling: Sequence[int],
         rule) -> Iterator[WalkEvent]:
    """The walk of one request (module docstring): the only place that states it.

    From the root, the rule judges the current node's children in sibling order
    (``rule.decide(node, depth, children) -> list[Decision]``: the visited siblings, the last
    one accepted or all rejected); on an accept the walk moves to that child; otherwise (or at
    a leaf) ``rule.bonus(node, children, rejected_nodes)`` makes the final draw.

    Args:
        request: the request index written into every event.
        num_nodes: the request's node count (bounds the walk).
        next_token, next_sibling: the request's ``retrieve_next_token`` / ``retrieve_next_sibling``
            as Python lists (local indices, ``-1`` for none).
        rule: greedy, sampled, kernel-expansion or what-if rule (this module's ``_*Rule``).

    Yields:
        :class:`WalkEvent` s in order: ``consider`` per judged child, ``move`` per accepted
        child, one final ``bonus``.

    Raises:
        ValueError: a cycle (request and node named), or a rule whose verdicts do not follow
            the children in order.
    """
    cur, depth, visited = 0, 1, 1
    while True:
        children = _children(request, next_token, next_sibling, cur, num_nodes)
        decisions = rule.decide(cur, depth, children) if children else []
        for k, d in enumerate(decisions):
            if k >= len(children) or d.node != children[k] or (d.verdict == "accept" and k != len(decisions) - 1):
                raise ValueError(f"request {request}, node {cur}: decision {k} ({d.node}, {d.verdict}) does not "
                                 f"follow the children {children} in sibling order")
            yield WalkEvent("consider", request, d.node, decision=d)
        if decisions and decisions[-1].verdict == "accept":
            cur = decisions[-1].node
            visited += 1
            if visited > num_nodes:
                raise ValueError(f"request {request}, node {cur}: the walk revisits nodes "
                                 "(a cycle in retrieve_next_token)")
            depth += 1
            yield WalkEvent("move", request, cur, decision=decisions[-1])
            continue
        yield WalkEvent("bonus", request, cur, bonus=rule.bonus(cur, children, [d.node for d in decisions]))
        return


def _collect(events) -> tuple[list[int], list[Decision], "BonusDraw | UndrawnBonus | None"]:
    """``(path, decisions, bonus)`` of one request's events."""
    path, log, bonus = [0], [], None
    for e in events:
        if e.kind == "consider":
            log.append(e.decision)
        elif e.kind == "move":
            path.append(e.node)
        else:
            bonus = e.bonus
    return path, log, bonus


def events_of(decisions: Sequence[Decision], bonus: "BonusDraw | UndrawnBonus | None" = None) -> list[WalkEvent]:
    """The walk events of one request rebuilt from its recorded decision log and bonus draw.

    Equal to ``list(walk(...))`` of the run that recorded them; a stepper's cursor ``k``
    means "``events[:k]`` have happened".

    Args:
        decisions: the request's :class:`Decision` s in walk order (``VerifyOutput.decisions[b]``,
            ``StepTrace.decisions``).
        bonus: its :class:`BonusDraw` (``None``: no bonus event).
    """
    events = []
    for d in decisions:
        events.append(WalkEvent("consider", d.request, d.node, decision=d))
        if d.verdict == "accept":
            events.append(WalkEvent("move", d.request, d.node, decision=d))
    if bonus is not None:
        events.append(WalkEvent("bonus", bonus.request, bonus.node, bonus=bonus))
    return events


#: SGLang floors ``threshold_acc`` at this value before dividing (``max(threshold_acc, 1e-9f)``).
SGLANG_MIN_THRESHOLD_ACC = 1e-9


def sglang_accepts(p: float, mass: float, u: float, threshold_single: float, threshold_acc: float) -> bool:
    """SGLang's accept test at lossy thresholds (module docstring), in float32 as its kernels
    compute it: ``u <= S / max(threshold_acc, 1e-9)`` or ``p >= threshold_single``; no ``p > 0``
    guard. ``p``, ``mass`` (``S``), ``u``: float32 values as Python floats."""
    ta = max(np.float32(threshold_acc), np.float32(SGLANG_MIN_THRESHOLD_ACC))
    return bool(np.float32(u) <= np.float32(mass) / ta) or bool(np.float32(p) >= np.float32(threshold_single))


def _accepts(p: float, mass: float, u: float, threshold_single: float, threshold_acc: float) -> bool:
    """The accept test: the lossless target-only rule (``p > 0`` and ``u < S``, or
    ``p >= threshold_single``) unless the thresholds are lossy, then :func:`sglang_accepts`."""
    if is_lossy(threshold_single, threshold_acc):
        return sglang_accepts(p, mass, u, threshold_single, threshold_acc)
    return p > 0.0 and (u < mass or p >= threshold_single)


class _GreedyRule:
    """Accept the child whose token is the row's argmax; the bonus is that argmax."""

    def __init__(self, request, tokens, argmax, probs):
        self.request, self.tokens, self.argmax, self.probs = request, tokens, argmax, probs

    def decide(self, node, depth, children):
        want, mass, out = self.argmax[node], 0.0, []
        for child in children:
            p = float(self.probs[node, self.tokens[child]])
            mass += p
            ok = self.tokens[child] == want
            out.append(Decision(self.request, depth, node, child, self.tokens[child], p, mass, None,
                                "accept" if ok else "reject"))
            if ok:
                break
        return out

    def bonus(self, node, children, rejected):
        t = self.argmax[node]
        return BonusDraw(self.request, node, t, "argmax", 1.0, None, float(self.probs[node, t]))


class _SampledRule:
    """The target-only rule over float32 rows ``row_of(i)`` (read only where the walk goes)."""

    def __init__(self, request, tokens, row_of, coins, final_coin, threshold_single, threshold_acc,
                 final_mass=None, residual_empty=None):
        self.request, self.tokens, self.row_of = request, tokens, row_of
        self.coins, self.final_coin, self.final_mass = coins, final_coin, final_mass
        self.ts, self.ta = threshold_single, threshold_acc
        self.residual_empty = residual_empty or self._residual_empty
        self._row = (None, None)
        self._residual_cache = (None, None)

    def row(self, node):
        if self._row[0] != node:
            self._row = (node, self.row_of(node))
        return self._row[1]

    def child_probs(self, node, children):
        return self.row(node)[[self.tokens[c] for c in children]].tolist()

    def residual(self, node, rejected_tokens):
        """Cached :func:`_residual` of node ``node``'s row (the FP-edge test and the bonus
        draw share it)."""
        key = (node, tuple(rejected_tokens))
        if self._residual_cache[0] != key:
            self._residual_cache = (key, _residual(self.row(node), rejected_tokens))
        return self._residual_cache[1]

    def _residual_empty(self, node, children):
        _residual_row, cum = self.residual(node, [self.tokens[c] for c in children])
        return cum.numel() == 0 or not float(cum[-1]) > 0.0

    def decide(self, node, depth, children):
        u = self.coins[node]
        mass, out, last_positive = 0.0, [], None
        for child, p in zip(children, self.child_probs(node, children)):
            mass = float(np.float32(mass + p))  # S_k in float32, as a kernel sums it
            ok = _accepts(p, mass, u, self.ts, self.ta)
            out.append(Decision(self.request, depth, node, child, self.tokens[child], p, mass, u,
                                "accept" if ok else "reject"))
            if ok:
                return out
            if p > 0.0:
                last_positive = len(out) - 1
        # exact arithmetic: children holding the whole row sum to S_K = 1 > u (module docstring);
        # SGLang's lossy rule has no such edge rule
        if last_positive is not None and not is_lossy(self.ts, self.ta) and self.residual_empty(node, children):
            d = out[last_positive]
            return out[:last_positive] + [replace(d, cumulative_mass=1.0, verdict="accept")]
        return out

    def bonus(self, node, children, rejected):
        token, mass, token_p = _draw(*self.residual(node, [self.tokens[c] for c in rejected]), self.final_coin,
                                     self.final_mass)
        kind = "exhausted" if token < 0 else ("residual" if rejected else "leaf")
        return BonusDraw(self.request, node, token, kind, mass, self.final_coin, token_p)


def _finish(vi, paths, bonus_tokens, exhausted, decisions, bonus, backend, thresholds=(1.0, 1.0)) -> VerifyOutput:
    bs = vi.batch_size
    width = max(_max_path(vi), max((len(p) for p in paths), default=1))
    tokens = vi.node_token_ids.tolist()
    index_rows, emitted_rows = [], []
    for b, path in enumerate(paths):
        out = [tokens[b][i] for i in path[1:]] + ([] if exhausted[b] else [bonus_tokens[b]])
        index_rows.append(path + [-1] * (width - len(path)))
        emitted_rows.append(out + [-1] * (width - len(out)))
    return VerifyOutput(
        accept_index=torch.tensor(index_rows, dtype=torch.int64).reshape(bs, width),
        emitted_tokens=torch.tensor(emitted_rows, dtype=torch.int64).reshape(bs, width),
        accept_length=torch.tensor([len(p) - 1 for p in paths], dtype=torch.int64),
        bonus_token=torch.tensor(bonus_tokens, dtype=torch.int64),
        support_exhausted=torch.tensor(exhausted, dtype=torch.bool),
        decisions=decisions,
        bonus=bonus,
        backend=backend,
        thresholds=(float(thresholds[0]), float(thresholds[1])),
        lossy=is_lossy(*thresholds),
    )


def walk_batch(vi: DDTreeVerifyInput, rule_of: Callable[[int], object], backend: str,
               thresholds: tuple[float, float] = (1.0, 1.0)) -> VerifyOutput:
    """Run :func:`walk` for every request of ``vi`` with ``rule_of(b)`` and assemble the
    :class:`VerifyOutput` (every verifier and backend ends here)."""
    nt, ns = vi.retrieve_next_token.tolist(), vi.retrieve_next_sibling.tolist()
    paths, bonus_tokens, exhausted, decisions, bonus = [], [], [], [], []
    for b in range(vi.batch_size):
        path, log, draw = _collect(walk(b, int(vi.num_nodes[b]), nt[b], ns[b], rule_of(b)))
        paths.append(path)
        bonus_tokens.append(draw.token)
        exhausted.append(draw.token < 0)
        decisions.append(log)
        bonus.append(draw)
    return _finish(vi, paths, bonus_tokens, exhausted, decisions, bonus, backend, thresholds)


def verify_greedy(verify_input: DDTreeVerifyInput, target_logits: torch.Tensor, *, validate: bool = True) -> VerifyOutput:
    """Greedy tree verification (SGLang ``verify_tree_greedy``), whole batch.

    Args:
        verify_input: buffers from :func:`ddtree_lab.compile_retrieve`.
        target_logits: ``[bs, N, V]`` float32 / float16 / bfloat16, the target's logits at
            every node (row ``i`` predicts the token after node ``i``).
        validate: check the buffers first (:func:`ddtree_lab.check_verify_buffers`, O(N) per
            request); ``False`` only for timing.

    Returns:
        :class:`VerifyOutput`; ``decisions`` hold, per visited sibling, the softmax
        probability of its token (for display), the running sum, and the verdict.

    Raises:
        ValueError: shape mismatch, broken buffers (:class:`ddtree_lab.RetrieveError`, request
            and node named), a token outside the vocabulary, or a NaN / all ``-inf`` row on the
            walked path (request and node named).
    """
    check_tensor("target_logits", target_logits, dtype=(torch.float32, torch.float16, torch.bfloat16), ndim=3)
    _check_verify_input(verify_input, target_logits, "target_logits")
    if validate:
        check_verify_buffers(verify_input)
    check_logits_rows(target_logits, verify_input.num_nodes)
    argmax = target_logits.float().argmax(-1).tolist()
    probs = torch.softmax(target_logits.float(), dim=-1)
    tokens = verify_input.node_token_ids.tolist()
    return walk_batch(verify_input, lambda b: _GreedyRule(b, tokens[b], argmax[b], probs[b]), "reference")


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
    return _draw(*_residual(row, rejected), coin, mass)


def _residual(row: torch.Tensor, rejected: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(residual, running sum)``, float64: ``row`` with the ``rejected`` tokens zeroed."""
    residual = row.double().clone()
    rejected = [t for t in rejected if t < residual.shape[0]]
    if rejected:
        residual[torch.tensor(rejected, dtype=torch.int64, device=row.device)] = 0.0
    return residual, residual.cumsum(0)


def _draw(residual: torch.Tensor, cum: torch.Tensor, coin: float, mass: float | None) -> tuple[int, float, float]:
    if mass is None:
        mass = float(cum[-1]) if cum.numel() else 0.0
    if mass <= 0.0:
        return -1, 0.0, 0.0
    target = coin * mass
    idx = int(torch.searchsorted(cum, torch.tensor([target], dtype=torch.float64, device=cum.device), right=True)[0])
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
    validate: bool = True,
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
        threshold_single, threshold_acc: 1.0 for the exact rule; any finite value >= 0 is
            accepted (0 included, as SGLang) and marks the output ``lossy`` (module docstring).
        final_masses: per request, the residual mass of the bonus draw when ``target_probs``
            holds the final row only up to the drawn token (trace replay, see
            :func:`residual_draw`); ``None`` computes it from the row.
        validate: check the buffers first (:func:`ddtree_lab.check_verify_buffers`, O(N) per
            request); ``False`` only for timing.

    Returns:
        :class:`VerifyOutput` with the decision log (node, token, ``p``, ``S_k``, coin, verdict)
        and, per request, the :class:`BonusDraw` (residual mass and the coin used).

    Raises:
        ValueError: shape or range errors, broken buffers (:class:`ddtree_lab.RetrieveError`),
            coins outside [0, 1), NaN or negative probabilities on a walked row, or negative /
            non-finite thresholds (each names request and node where it applies).
    """
    check_tensor("target_probs", target_probs, dtype=torch.float32, ndim=3)
    _check_verify_input(verify_input, target_probs, "target_probs")
    bs, n = verify_input.node_token_ids.shape
    _check_coins(coins, final_coins, bs, n)
    _check_thresholds(threshold_single, threshold_acc)
    if validate:
        check_verify_buffers(verify_input)
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
    tokens = vi.node_token_ids.tolist()
    coin_rows, final = coins.tolist(), final_coins.tolist()

    def rule_of(b):
        return _SampledRule(b, tokens[b], lambda i: row_of(b, i), coin_rows[b], final[b], threshold_single,
                            threshold_acc, None if final_masses is None else final_masses[b])

    return walk_batch(vi, rule_of, backend, (threshold_single, threshold_acc))


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
    """Every finite value >= 0 (what SGLang accepts, 0 included; see the module docstring)."""
    for name, t in (("threshold_single", threshold_single), ("threshold_acc", threshold_acc)):
        if isinstance(t, bool) or not isinstance(t, (int, float)):
            raise TypeError(f"{name} must be a number, got {t!r}")
        if not (math.isfinite(t) and t >= 0.0):
            raise ValueError(f"{name} must be a finite number >= 0, got {t}")


# -- what-if analyses -----------------------------------------------------------------------


def _as_list(name, x, n=None):
    values = x.tolist() if isinstance(x, torch.Tensor) else list(x)
    if n is not None and len(values) != n:
        raise ValueError(f"{name} has {len(values)} entries, expected {n}")
    return values


#: :func:`walk_request` without rows counts a node's children as holding its whole row when
#: their float64 probability sum reaches ``1 - CHILDREN_COVER_TOL``.
CHILDREN_COVER_TOL = 2.0 ** -20


def walk_request(
    retrieve_next_token,
    retrieve_next_sibling,
    node_token_ids,
    child_probs,
    coins,
    final_coin: float | None = None,
    *,
    request: int = 0,
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
    row_of: Callable[[int], torch.Tensor] | None = None,
    final_mass: float | None = None,
) -> list[WalkEvent]:
    """Re-walk one request with the target-only rule from stored child probabilities (pure;
    for what-if analyses such as "what if this coin had been 0.3").

    Args:
        retrieve_next_token, retrieve_next_sibling, node_token_ids: ``[n]`` (tensors or lists)
            of the request (local indices).
        child_probs: ``[n]`` float, ``child_probs[i]`` = target p of node ``i``'s token in its
            parent's row (``StepTrace.child_probs``; root entry ignored).
        coins: ``[n]`` coins in [0, 1) (``coins[i]`` decides among node ``i``'s children).
        final_coin: the bonus coin (``None``: the bonus is not drawn).
        request: the request index written into the events.
        threshold_single, threshold_acc: as :func:`verify_sampled`.
        row_of: optional ``row_of(node) -> [V]`` float32 full row; with it the bonus is drawn
            (and the children-cover-the-row test is exact), as :func:`verify_sampled` does.
        final_mass: passed to :func:`residual_draw` with ``row_of`` (a stored prefix row).

    Returns:
        the :class:`WalkEvent` s. Without ``row_of`` the final event's ``bonus`` is an
        :class:`UndrawnBonus` ("would draw from the residual at node X with mass M"), and a
        node's children count as holding its whole row when their probabilities sum to at
        least ``1 - CHILDREN_COVER_TOL``.

    Raises:
        ValueError: lengths differ, a coin outside [0, 1), a negative or NaN child probability
            of a reached child, bad thresholds, or a cycle.
    """
    nt = _as_list("retrieve_next_token", retrieve_next_token)
    n = len(nt)
    ns = _as_list("retrieve_next_sibling", retrieve_next_sibling, n)
    tokens = _as_list("node_token_ids", node_token_ids, n)
    cp = [float(v) for v in _as_list("child_probs", child_probs, n)]
    cs = [float(v) for v in _as_list("coins", coins, n)]
    _check_thresholds(threshold_single, threshold_acc)
    for i, c in enumerate(cs):
        if not 0.0 <= c < 1.0:
            raise ValueError(f"coins, request {request}, node {i}: {c} is not in [0, 1)")
    if final_coin is not None and not 0.0 <= final_coin < 1.0:
        raise ValueError(f"final_coin, request {request}: {final_coin} is not in [0, 1)")

    class _WhatIf(_SampledRule):
        def child_probs(self, node, children):
            out = []
            for c in children:
                if not cp[c] >= 0.0:
                    raise ValueError(f"child_probs, request {request}, node {c}: {cp[c]} is not a probability")
                out.append(cp[c])
            return out

        def _residual_empty(self, node, children):
            if row_of is not None:
                return super()._residual_empty(node, children)
            return math.fsum(cp[c] for c in children) >= 1.0 - CHILDREN_COVER_TOL

        def bonus(self, node, children, rejected):
            if row_of is not None and final_coin is not None:
                return super().bonus(node, children, rejected)
            mass = max(0.0, 1.0 - math.fsum(cp[c] for c in rejected))
            return UndrawnBonus(request, node, "residual" if rejected else "leaf", mass, final_coin)

    rule = _WhatIf(request, tokens, row_of, cs, final_coin, threshold_single, threshold_acc, final_mass)
    return list(walk(request, n, nt, ns, rule))


def acceptance_probabilities(
    retrieve_next_token,
    retrieve_next_sibling,
    child_probs,
    *,
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
) -> torch.Tensor:
    """Each node's exact probability of being accepted, given the walk reached its parent.

    For a coin ``u ~ U[0, 1)`` and children ``1..K`` in sibling order with target
    probabilities ``p_k`` and exact partial sums ``S_k``: child ``k`` is accepted iff it
    passes the accept test and no earlier sibling does. With lossless thresholds (the rule
    ``p_k > 0`` and ``u < S_k``) this is ``p_k``; with lossy ones (SGLang's rule,
    module docstring: ``u <= S_k / max(threshold_acc, 1e-9)`` or ``p_k >= threshold_single``,
    no ``p > 0`` guard) it is ``min(1, S_k / max(threshold_acc, 1e-9)) - L`` (or ``1 - L`` when
    ``p_k >= threshold_single``), ``L`` the coin range already taken by earlier siblings, and 0
    after a sibling accepted outright. Exact arithmetic (float64), not the kernels' float32.

    Args:
        retrieve_next_token, retrieve_next_sibling: ``[n]`` of one request.
        child_probs: ``[n]``, target p of each node's token in its parent's row (root ignored).
        threshold_single, threshold_acc: as :func:`verify_sampled`.

    Returns:
        ``[n]`` float64 (root 0).

    Raises:
        ValueError: lengths differ, bad thresholds, a cycle in the sibling chains.
    """
    nt = _as_list("retrieve_next_token", retrieve_next_token)
    n = len(nt)
    ns = _as_list("retrieve_next_sibling", retrieve_next_sibling, n)
    cp = [float(v) for v in _as_list("child_probs", child_probs, n)]
    _check_thresholds(threshold_single, threshold_acc)
    lossy = is_lossy(threshold_single, threshold_acc)
    divisor = max(threshold_acc, SGLANG_MIN_THRESHOLD_ACC) if lossy else 1.0
    out = [0.0] * n
    for parent in range(n):
        taken, certain, mass = 0.0, False, 0.0
        for child in _children(0, nt, ns, parent, n):
            p = cp[child]
            mass += p
            if certain or not (p > 0.0 or lossy):
                continue
            reach = min(1.0, mass / divisor)
            if p >= threshold_single:
                out[child] = 1.0 - taken
                certain = True
            else:
                out[child] = max(0.0, reach - taken)
                taken = max(taken, reach)
    return torch.tensor(out, dtype=torch.float64)
