"""The drafter and target protocols: what a block drafter reads for one step, what it returns,
and the lifecycle of its per-request state.

A block drafter (DFlash, arXiv 2602.06036) proposes, in one pass, an independent distribution
for each of the ``L - 1`` positions after the anchor: ``draft_logits(context) -> [bs, L-1, V]``.
:func:`ddtree_lab.draft_topk_from_logits` turns them into the draft top-k the tree builder takes.

Lifecycle (docs/DESIGN.md "Drafters"): ``start(num_requests)`` once per batch; after the
target's prefill and after every step the session calls ``commit(request, features, start)``
with the features of the newly committed tokens (their target hidden states at
``target_layer_ids``, concatenated); ``draft_logits`` then drafts the block after each anchor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

import torch

__all__ = ["DraftContext", "Drafter", "Target", "select_features"]


@dataclass
class DraftContext:
    """What a drafter may read for one step of a batch (``bs`` active requests).

    Attributes:
        requests: ``bs`` request indices (those given to ``start``; row ``i`` of every tensor
            below belongs to request ``requests[i]``).
        anchor_token_ids: ``[bs]`` int64, the last committed token of each request (the tree
            root); its own features are not known yet (the target has not run it).
        positions: ``[bs]`` int64, the position of each anchor (= its number of committed
            tokens before it; the drafter holds features for positions ``0 .. positions-1``).
        committed_ids: per request, every committed token id (prompt included, anchor last).
    """

    requests: Sequence[int]
    anchor_token_ids: torch.Tensor
    positions: torch.Tensor
    committed_ids: list[list[int]]

    def __post_init__(self) -> None:
        bs = len(self.requests)
        if tuple(self.anchor_token_ids.shape) != (bs,) or tuple(self.positions.shape) != (bs,):
            raise ValueError(f"anchor_token_ids {tuple(self.anchor_token_ids.shape)} and positions "
                             f"{tuple(self.positions.shape)} must both be [{bs}] (one per request)")
        if len(self.committed_ids) != bs:
            raise ValueError(f"committed_ids has {len(self.committed_ids)} rows for {bs} requests")


@runtime_checkable
class Drafter(Protocol):
    """A block drafter: ``block_size`` L, one pass per step, a per-request feature cache.

    Attributes:
        name: shown in traces.
        block_size: L (the anchor plus L-1 drafted positions).
        target_layer_ids: the target layers whose outputs feed the drafter (z-lab's convention:
            layer ``l``'s output is HF ``hidden_states[l + 1]``); a token's features are those
            hidden states concatenated, ``[k * H]``.
    """

    name: str
    block_size: int
    target_layer_ids: Sequence[int]

    def start(self, num_requests: int) -> None:
        """Forget every request's state; requests ``0 .. num_requests-1`` begin empty."""
        ...

    def commit(self, request: int, features: torch.Tensor, start: int) -> None:
        """Hand over the features ``[n_new, k*H]`` of the tokens committed at positions
        ``start .. start+n_new-1``; the drafter first crops its state to ``start`` tokens."""
        ...

    def draft_logits(self, context: DraftContext) -> torch.Tensor:
        """Draft logits ``[bs, L-1, V]`` float32 for positions 1..L-1 after each anchor."""
        ...

    def metadata(self) -> dict:
        ...


@runtime_checkable
class Target(Protocol):
    """What drafters read of a target (the full adapter is :class:`ddtree_lab.models.TargetModel`)."""

    name: str

    @property
    def hidden_size(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def device(self) -> torch.device: ...

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Input embeddings ``[..., H]`` float32."""
        ...

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[..., V]`` float32 from post-norm hidden states ``[..., H]``."""
        ...


def select_features(hidden_states: Sequence[torch.Tensor], layer_ids: Sequence[int]) -> torch.Tensor:
    """The features of ``layer_ids`` from a HF ``hidden_states`` tuple (z-lab's convention:
    layer ``l``'s output is ``hidden_states[l + 1]``), concatenated on the last dimension.

    Args:
        hidden_states: ``num_layers + 1`` tensors ``[..., H]`` (embeddings first).
        layer_ids: target layer indices in ``0 .. num_layers-1``.

    Returns:
        ``[..., k*H]`` in the dtype of the hidden states.

    Raises:
        ValueError: a layer id out of range, or no layer ids.
    """
    n = len(hidden_states) - 1
    if not layer_ids:
        raise ValueError("layer_ids is empty")
    bad = [l for l in layer_ids if not 0 <= int(l) < n]
    if bad:
        raise ValueError(f"target layer ids {bad} out of range 0..{n - 1}")
    return torch.cat([hidden_states[int(l) + 1] for l in layer_ids], dim=-1)
