"""Model loading: the embedded default target with a drafter, and drafters by name or path."""

from __future__ import annotations

from os import PathLike
from pathlib import Path

__all__ = ["DEFAULT_DRAFTER", "drafter_exists", "load_drafter", "load_default"]


DEFAULT_DRAFTER = "dflash"
"""The drafter :func:`load_default` gives the embedded target: the one with the higher measured
τ on the held-out prompts (``benchmarks/live_tau.out.txt``)."""


def drafter_exists(drafter: str | PathLike) -> bool:
    """Whether ``drafter`` names one (``"dflash"``, ``"ridge"``) or is an existing path; checked
    before any model loads. Whether the weights are good is the loaders' business."""
    if not isinstance(drafter, (str, PathLike)):
        return False
    return drafter in ("dflash", "ridge") or (bool(str(drafter)) and Path(drafter).exists())


def load_drafter(target, drafter: str = DEFAULT_DRAFTER):
    """A drafter for ``target``: ``"dflash"`` (the DFlash drafter trained here,
    ``fixtures/drafters/smollm2_dflash_b16``), ``"ridge"`` (the per-offset ridge heads,
    ``fixtures/drafters/smollm2_ridge_b16.safetensors``), or a path: a directory is a DFlash
    checkpoint (``config.json`` + safetensors, the public layout), a file is ridge weights.

    Raises:
        ValueError: an empty string or a name that is neither known nor an existing path, or
            weights that do not fit ``target`` / do not parse (the loaders name the file).
    """
    from .dflash import DFlashDrafter
    from .ridge import RidgeDrafter

    if drafter == "dflash":
        return DFlashDrafter.load(target)
    if drafter == "ridge":
        return RidgeDrafter.load(target)
    if not drafter_exists(drafter):
        raise ValueError(f"drafter must be 'dflash', 'ridge' or an existing path, got {drafter!r}")
    path = Path(drafter)
    return DFlashDrafter.load(target, path) if path.is_dir() else RidgeDrafter.load(target, path)


def load_default(device: str = "cpu", drafter: str = DEFAULT_DRAFTER):
    """The embedded default target (SmolLM2-135M-Instruct, fp32) and a drafter for it (L=16).

    Args:
        device: where both run.
        drafter: ``"dflash"``, ``"ridge"`` or a path (:func:`load_drafter`); the default is
            :data:`DEFAULT_DRAFTER`.

    Also sets torch's thread count for this machine once (:mod:`ddtree_lab.threads`;
    ``DDTREE_LAB_THREADS=N`` overrides).

    Raises:
        ValueError: a drafter that is neither a known name nor an existing path, or weights that
            do not fit the target.
    """
    import torch

    from ..threads import configure_threads

    configure_threads()
    from .target import load_default_target

    if not drafter_exists(drafter):
        raise ValueError(f"drafter must be 'dflash', 'ridge' or an existing path, got {drafter!r}")
    target = load_default_target(dtype=torch.float32, device=device)
    return target, load_drafter(target, drafter)
