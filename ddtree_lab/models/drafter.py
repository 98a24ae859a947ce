"""The drafter protocol: what a block drafter reads for one step and what it returns.

A block drafter (DFlash, arXiv 2602.06036) proposes, in one pass, an independent distribution
for each of the ``L - 1`` positions after the anchor: ``draft_logits(context) -> [bs, L-1, V]``.
:func:`ddtree_lab.draft_topk_from_logits` turns them into the draft top-k the tree builder takes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

__all__ = ["DraftContext", "Drafter"]


@dataclass
class DraftContext:
    """What a drafter may read for one step of a batch.

    Attributes:
        committed_ids: per request, every committed token id (prompt included, anchor last).
        anchor_token_ids: ``[bs]`` int64, the last committed token (the tree root).
        target_hidden: ``[bs, H]`` float32, the target's last-layer (post-norm) hidden state
            at the position before the anchor (the one whose logits produced the anchor).
    """

    committed_ids: list[list[int]]
    anchor_token_ids: torch.Tensor
    target_hidden: torch.Tensor


@runtime_checkable
class Drafter(Protocol):
    """A block drafter: ``block_size`` L, one pass per step."""

    name: str
    block_size: int

    def draft_logits(self, context: DraftContext) -> torch.Tensor:
        """Draft logits ``[bs, L-1, V]`` float32 for positions 1..L-1 after the anchor."""
        ...

    def metadata(self) -> dict:
        ...
