"""The verify rules: greedy and sampled (target-only) accept tests and the bonus draw, with a decision log.

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
marks such outputs; :mod:`ddtree_lab.audit.thresholds` gives the emitted law and its distance
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

from dataclasses import replace
from typing import Sequence

import numpy as np
import torch

from .types import BonusDraw, Decision, is_lossy

__all__ = ["accepts", "sglang_accepts", "SGLANG_MIN_THRESHOLD_ACC", "GreedyRule", "SampledRule", "residual_draw"]


# -- the one walk ---------------------------------------------------------------------------


#: SGLang floors ``threshold_acc`` at this value before dividing (``max(threshold_acc, 1e-9f)``).
SGLANG_MIN_THRESHOLD_ACC = 1e-9


def sglang_accepts(p: float, mass: float, u: float, threshold_single: float, threshold_acc: float) -> bool:
    """SGLang's accept test at lossy thresholds (module docstring), in float32 as its kernels
    compute it: ``u <= S / max(threshold_acc, 1e-9)`` or ``p >= threshold_single``; no ``p > 0``
    guard. ``p``, ``mass`` (``S``), ``u``: float32 values as Python floats."""
    ta = max(np.float32(threshold_acc), np.float32(SGLANG_MIN_THRESHOLD_ACC))
    return bool(np.float32(u) <= np.float32(mass) / ta) or bool(np.float32(p) >= np.float32(threshold_single))


def accepts(p: float, mass: float, u: float, threshold_single: float, threshold_acc: float) -> bool:
    """The accept test: the lossless target-only rule (``p > 0`` and ``u < S``, or
    ``p >= threshold_single``) unless the thresholds are lossy, then :func:`sglang_accepts`."""
    if is_lossy(threshold_single, threshold_acc):
        return sglang_accepts(p, mass, u, threshold_single, threshold_acc)
    return p > 0.0 and (u < mass or p >= threshold_single)


class GreedyRule:
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


class SampledRule:
    """The target-only rule over float32 rows ``row_of(i)`` (read only where the walk goes)."""

    def __init__(self, request, tokens, row_of, coins, final_coin, threshold_single, threshold_acc,
                 final_mass=None, residual_empty=None):
        self.request, self.tokens, self.row_of = request, tokens, row_of
        self.coins, self.final_coin, self.final_mass = coins, final_coin, final_mass
        self.ts, self.ta = threshold_single, threshold_acc
        self.residual_empty = residual_empty or self._residual_empty
        self._row: tuple[int, torch.Tensor] | None = None
        self._residual_cache: tuple[tuple[int, tuple[int, ...]], tuple[torch.Tensor, torch.Tensor]] | None = None

    def row(self, node) -> torch.Tensor:
        if self._row is None or self._row[0] != node:
            self._row = (node, self.row_of(node))
        return self._row[1]

    def child_probs(self, node, children):
        return self.row(node)[[self.tokens[c] for c in children]].tolist()

    def residual(self, node, rejected_tokens):
        """Cached :func:`_residual` of node ``node``'s row (the FP-edge test and the bonus
        draw share it)."""
        key = (node, tuple(rejected_tokens))
        if self._residual_cache is None or self._residual_cache[0] != key:
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
            ok = accepts(p, mass, u, self.ts, self.ta)
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


# -- what-if analyses -----------------------------------------------------------------------


