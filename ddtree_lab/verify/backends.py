"""Verify from raw target logits with a chosen backend (reference, torch-lazy, Triton), recording which one ran.

Two entry points with the reference verifiers' meaning:

* :func:`verify_tree` -- sampled verify (greedy requests, ``temperature == 0``, ride along as
  one-hot rows): the same result as
  ``verify_sampled(vi, target_probs(logits, params, vi.num_nodes), coins, final_coins)``.
* :func:`verify_tree_greedy` -- greedy verify: the same result as
  ``verify_greedy(vi, logits)``.

Backends (``VerifyOutput.backend`` says which one ran; nothing falls back silently):

* ``"reference"`` -- the reference verifiers over the full ``[bs, N, V]`` probability tensor.
* ``"torch-lazy"`` -- the reference walk, computing each row's distribution only when the
  walk reaches it (bit-identical to the reference; the CPU benchmark's lazy algorithm).
* ``"triton"`` -- the kernels in :mod:`ddtree_lab.kernels.tree_verify` on a CUDA device;
  recorded as ``"triton-interpret"`` when the kernels were imported under
  ``TRITON_INTERPRET=1`` and run on the CPU.
* ``"auto"`` -- ``"triton"`` when it can run on the logits' device (a CUDA tensor and
  Triton installed, or the interpreter active), else ``"reference"``.

Exactness of the Triton backend against the reference: tokens, indices, verdicts, bonus kind
and ``support_exhausted`` bit for bit; probabilities in the decision log and bonus record
within :data:`PROB_ATOL` + :data:`PROB_RTOL` x value. The one exception is a coin lying
within that tolerance of a decision boundary (or a top-p / min-p cut landing within it), where
either verdict is a correct rounding of the rule (probability ~1e-6 per decision).

Invalid input: shapes, buffer ranges, token ids, coins and parameters are checked on the
host before launch with the reference's messages. A NaN, ``+inf`` or all ``-inf`` logit row
is reported as in the reference when the walk reaches it; the lazy backends do not read (or
check) rows the walk never reaches.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .._arguments import check_tensor
from ..buffers import DDTreeVerifyInput, check_verify_buffers
from ..sampling import SamplingParams, apply_bans_batch, normalize_params, target_probs
from .lazy import verify_lazy
from .reference import (check_coin_shapes, check_thresholds, check_verify_input, check_verify_shapes, coin_flags,
                        raise_coin_values, raise_verify_input_values, verify_greedy, verify_input_flags,
                        verify_sampled)
from .triton import KERNEL_ORDER, triton_usable, verify_triton_greedy, verify_triton_sampled
from .types import VerifyOutput

__all__ = ["verify_tree", "verify_tree_greedy", "select_backend", "BACKENDS"]

BACKENDS = ("auto", "reference", "torch-lazy", "triton")



def _check_values(vi: DDTreeVerifyInput, vocab: int, coins: torch.Tensor, final_coins: torch.Tensor) -> None:
    """The value checks of :func:`check_verify_input` and :func:`validate_coins` with one host
    read per device (their flags stacked; the messages come from re-running the failing check)."""
    flags = {}
    for f in (verify_input_flags(vi, vocab), coin_flags(coins, final_coins)):
        flags.setdefault(f.device, []).append(f)
    if any(bool(torch.cat(fs).any()) for fs in flags.values()):
        raise_verify_input_values(vi, vocab)
        raise_coin_values(coins, final_coins)


def select_backend(backend: str, device: torch.device | str) -> tuple[str, str]:
    """Resolve ``backend`` for tensors on ``device``: ``(name, why)``.

    ``name`` is ``"reference"``, ``"torch-lazy"``, ``"triton"`` or ``"triton-interpret"``.

    Raises:
        ValueError: unknown backend name.
        RuntimeError: ``backend="triton"`` where the kernels cannot run (the reason named).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend in ("reference", "torch-lazy"):
        return backend, "requested"
    usable, name, why = triton_usable(device)
    if backend == "triton":
        if not usable:
            raise RuntimeError(f"backend 'triton' cannot run: {why}")
        return name, why
    return (name, why) if usable else ("reference", f"auto: {why}")


def verify_tree(
    verify_input: DDTreeVerifyInput,
    target_logits: torch.Tensor,
    params: SamplingParams | Sequence[SamplingParams],
    coins: torch.Tensor,
    final_coins: torch.Tensor,
    *,
    backend: str = "auto",
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
    validate: bool = True,
) -> VerifyOutput:
    """Sampled tree verify from raw logits (mixed greedy / sampled requests in one call).

    Args:
        verify_input: buffers from :func:`ddtree_lab.compile_retrieve`.
        target_logits: ``[bs, N, V]`` float32 / float16 / bfloat16 target logits, read as given.
        params: one :class:`SamplingParams` or one per request (``temperature == 0``: greedy,
            as one-hot rows).
        coins: ``[bs, N]`` float32 in [0, 1); final_coins: ``[bs]`` float32 in [0, 1).
        backend: ``"auto"``, ``"reference"``, ``"torch-lazy"`` or ``"triton"`` (module docstring).
        threshold_single, threshold_acc: 1.0 for the exact rule; any finite value >= 0 (0
            included, as SGLang) marks the output ``lossy`` (see :func:`verify_sampled`).
        validate: check the buffers first (:func:`ddtree_lab.check_verify_buffers`, O(N) per
            request); ``False`` only for timing.

    Returns:
        :class:`VerifyOutput` equal to ``verify_sampled(verify_input, target_probs(...), coins,
        final_coins)`` (tolerance in the module docstring), ``backend`` naming what ran.

    Raises:
        ValueError / TypeError: as the reference (shapes, ranges, broken buffers, coins,
            parameters, a bad logit row -- only rows the walk reaches for the lazy backends);
            ``backend="triton"`` for a request whose ``order`` is not ``"top_k_then_top_p"``
            (the kernel fuses that order only; ``"auto"`` then runs the reference).
        RuntimeError: ``backend="triton"`` where it cannot run.
    """
    check_tensor("target_logits", target_logits, dtype=(torch.float32, torch.float16, torch.bfloat16), ndim=3)
    check_verify_shapes(verify_input, target_logits, "target_logits")
    bs, n, vocab = target_logits.shape
    items = normalize_params(params, bs, vocab)
    check_coin_shapes(coins, final_coins, bs, n)
    check_thresholds(threshold_single, threshold_acc)
    _check_values(verify_input, vocab, coins, final_coins)
    if validate:
        check_verify_buffers(verify_input)
    name, _why = select_backend(backend, target_logits.device)
    other_order = [b for b, p in enumerate(items) if p.order != KERNEL_ORDER]
    if other_order and name.startswith("triton"):
        if backend == "triton":
            b = other_order[0]
            raise ValueError(f"request {b}: order {items[b].order!r}: the Triton kernel fuses {KERNEL_ORDER!r} only "
                             "(use backend='reference' or 'torch-lazy')")
        name = "reference"
    if name == "reference":
        probs = target_probs(target_logits, items, verify_input.num_nodes.to(target_logits.device))
        return verify_sampled(verify_input, probs, coins, final_coins,
                              threshold_single=threshold_single, threshold_acc=threshold_acc, validate=False)
    if name == "torch-lazy":
        return verify_lazy(verify_input, target_logits, items, coins, final_coins, threshold_single, threshold_acc)
    target_logits = apply_bans_batch(target_logits, items)  # the kernel knows no bans: -inf before it
    return verify_triton_sampled(verify_input, target_logits, items, coins, final_coins, name,
                                 threshold_single, threshold_acc)


def verify_tree_greedy(
    verify_input: DDTreeVerifyInput, target_logits: torch.Tensor, *, backend: str = "auto", validate: bool = True
) -> VerifyOutput:
    """Greedy tree verify with a chosen backend; the same result as :func:`verify_greedy`.

    The Triton kernel reads each walked row once (argmax, lowest id on ties, and the softmax
    normaliser for the logged probabilities). ``backend="torch-lazy"`` is the reference here
    (the reference greedy walk is already cheap); it is recorded as ``"reference"``.

    Args / Raises: as :func:`verify_tree` without the sampling arguments (``validate`` as there).
    """
    check_tensor("target_logits", target_logits, dtype=(torch.float32, torch.float16, torch.bfloat16), ndim=3)
    check_verify_input(verify_input, target_logits, "target_logits")
    if validate:
        check_verify_buffers(verify_input)
    bs, n, vocab = target_logits.shape
    name, _why = select_backend(backend, target_logits.device)
    if name in ("reference", "torch-lazy"):
        return verify_greedy(verify_input, target_logits, validate=False)
    return verify_triton_greedy(verify_input, target_logits, name)


