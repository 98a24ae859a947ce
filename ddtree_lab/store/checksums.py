"""The SHA-256 of a tensor's bytes: the one checksum every file the lab writes (traces, bundles, SGLang recordings) stores."""

from __future__ import annotations

import hashlib

import torch

__all__ = ["tensor_sha256"]


def tensor_sha256(t: torch.Tensor) -> str:
    """SHA-256 (hex) of a tensor's bytes, read on the CPU in C order. Dtypes numpy has no type
    for (bfloat16) are not stored by the lab's files and raise ``TypeError``."""
    return hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()
