"""The verify stage's records: Decision, BonusDraw, UndrawnBonus, WalkEvent, VerifyOutput."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

__all__ = ["Decision", "BonusDraw", "UndrawnBonus", "WalkEvent", "VerifyOutput", "is_lossy", "events_of"]


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


def events_of(decisions: Sequence[Decision], bonus: "BonusDraw | UndrawnBonus | None" = None) -> list[WalkEvent]:
    """The walk events of one request rebuilt from its recorded decision log and bonus draw.

    Equal to ``list(walk(...))`` of the run that recorded them; a stepper's cursor ``k``
    means "``events[:k]`` have happened".

    Args:
        decisions: the request's :class:`Decision` s in walk order (``VerifyOutput.decisions[b]``,
            ``Step.decisions``).
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
