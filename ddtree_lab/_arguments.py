"""Argument checks shared by the public entry points (tensor type, dtype, rank, shape): each error names the argument."""

from __future__ import annotations

import torch


def check_tensor(
    name: str,
    x: object,
    *,
    dtype: torch.dtype | tuple[torch.dtype, ...],
    ndim: int,
) -> torch.Tensor:
    """Raise TypeError/ValueError unless ``x`` is a tensor of the given dtype(s) and rank."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    if x.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} must have dtype {want}, got {x.dtype} (no implicit conversion)")
    if x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}")
    return x


def check_shape(name: str, x: torch.Tensor, shape: tuple[int, ...]) -> None:
    """Raise ValueError unless ``x.shape == shape``."""
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")
