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
    """What a drafter may read for one step of a batch (row ``b`` = request ``requests[b]``).

    Attributes:
        requests: per row, the request index the session gave to :meth:`Drafter.commit`.
        anchor_token_ids: ``[bs]`` int64, the last committed token (the tree root).
        positions: ``[bs]`` int64, the anchor's position (tokens committed before it); the
            drafter has been handed the features of positions ``0 .. positions[b]-1``.
        committed_ids: per row, every committed token id (prompt included, anchor last).
    """

    requests: list[int]
    anchor_token_ids: torch.Tensor
    positions: torch.Tensor
    committed_ids: list[list[int]]


@runtime_checkable
class Drafter(Protocol):
    """A block drafter: ``block_size`` L, one pass per step, fed the target's features.

    Lifecycle (docs/DESIGN.md, "Drafters"): ``start(num_requests)`` once per run;
    ``commit(request, features, start)`` after prefill (every prompt token) and after every
    step (the root and the accepted nodes); ``draft_logits(context)`` once per step.
    """

    name: str
    block_size: int
    target_layer_ids: list[int]  # layer l's output is HF hidden_states[l + 1]

    def start(self, num_requests: int) -> None:
        """Forget every request; requests ``0 .. num_requests-1`` follow."""
        ...

    def commit(self, request: int, features: torch.Tensor, start: int) -> None:
        """Crop the request's cache to ``start`` positions, then append ``features``
        ``[n_new, k*H]`` (positions ``start .. start+n_new-1``)."""
        ...

    def draft_logits(self, context: DraftContext) -> torch.Tensor:
        """Draft logits ``[bs, L-1, V]`` float32 for positions 1..L-1 after the anchor."""
        ...

    def metadata(self) -> dict:
        ...
