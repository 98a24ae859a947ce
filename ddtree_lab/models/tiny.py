"""Random-weight models for measurements that need the pipeline, not the weights.

:func:`random_target` is a small Llama with random weights and the embedded default's
tokenizer (so prompts, chat template and vocabulary are SmolLM2's); :class:`RandomDrafter` is
a seeded block drafter whose logits depend only on the anchor token and the position. Both
run a :class:`ddtree_lab.LiveSession` in milliseconds per step on a CPU: the host-sync test
(``tests/test_host_syncs.py``) and the GPU plan's timings use them where trained weights add
nothing.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .drafter import DraftContext
from .target import TargetModel
from ..hostsync import to_device

__all__ = ["RandomDrafter", "random_target"]


def random_target(hidden_size: int = 64, num_layers: int = 2, seed: int = 0, dtype: torch.dtype = torch.float32,
                  device: str | torch.device = "cpu") -> TargetModel:
    """A Llama target with random weights and the embedded default's tokenizer.

    Args:
        hidden_size: H (heads of 16 dimensions, 2 key-value heads).
        num_layers: decoder layers.
        seed: seeds the weights.

    Returns:
        a :class:`TargetModel` named ``random-llama-H{hidden_size}-L{num_layers}``, vocabulary
        that of SmolLM2 (49,152).

    Raises:
        FileNotFoundError: the embedded default (its tokenizer) is not installed.
    """
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from .default_target import default_target_dir

    path = default_target_dir()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    heads = max(2, hidden_size // 16)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=2,
                         max_position_embeddings=4096, tie_word_embeddings=True,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(dtype=dtype, device=device)  # pyright: ignore[reportCallIssue]  # transformers types this .to as unbound
    return TargetModel(model, tokenizer, name=f"random-llama-H{hidden_size}-L{num_layers}")


class RandomDrafter:
    """A seeded block drafter (the :class:`ddtree_lab.models.Drafter` protocol) that ignores the
    target's features: the logits of position ``j`` after anchor ``a`` are
    ``scale * (E[a] + P[j]) @ E.T`` for a random embedding ``E`` ``[V, 16]`` and position
    vectors ``P`` ``[L-1, 16]``. It reads no value of its inputs on the host.

    Args:
        vocab_size: V. block_size: L. seed: seeds ``E`` and ``P``. scale: sharpness of the
        distributions (larger: more mass on the top tokens). device: where the logits are made.
    """

    name = "random-drafter"
    target_layer_ids: Sequence[int]

    def __init__(self, vocab_size: int, block_size: int = 16, seed: int = 0, scale: float = 3.0,
                 device: str | torch.device = "cpu"):
        g = torch.Generator().manual_seed(seed)
        self.block_size = int(block_size)
        self.target_layer_ids = (0,)
        self.embedding = (torch.randn(vocab_size, 16, generator=g) / 4.0).to(device)
        self.positions = (torch.randn(self.block_size - 1, 16, generator=g) / 4.0).to(device)
        self.scale = float(scale)

    def start(self, num_requests: int) -> None:
        """Nothing to forget: the drafter keeps no per-request state."""

    def commit(self, request: int, features: torch.Tensor, start: int) -> None:
        """Ignored (the drafter reads no features)."""

    @torch.no_grad()
    def draft_logits(self, context: DraftContext) -> torch.Tensor:
        """``[bs, L-1, V]`` float32 (class docstring)."""
        anchors = to_device(context.anchor_token_ids, self.embedding.device)
        x = self.embedding[anchors][:, None, :] + self.positions[None]  # [bs, L-1, 16]
        return (self.scale * 4.0) * (x @ self.embedding.T)

    def metadata(self) -> dict:
        return {"kind": "RandomDrafter", "name": self.name, "block_size": self.block_size}
