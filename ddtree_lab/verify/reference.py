"""The reference verifiers (greedy, sampled target-only) over full target rows, and their input checks."""

from __future__ import annotations

import math
from typing import Sequence

import torch

from .._arguments import check_shape, check_tensor
from ..buffers import DDTreeVerifyInput, check_verify_buffers
from ..sampling import SamplingParams, check_logits_rows
from .rules import GreedyRule, SampledRule
from .types import VerifyOutput
from .walking import host_tree, walk_batch

__all__ = ["verify_greedy", "verify_sampled", "walk_sampled_batch", "draw_coins", "make_generators",
           "check_verify_input", "validate_coins", "check_thresholds", "check_verify_shapes", "verify_input_flags",
           "raise_verify_input_values", "check_coin_shapes", "coin_flags", "raise_coin_values"]


def make_generators(params: Sequence[SamplingParams], device: torch.device | str = "cpu") -> list[torch.Generator]:
    """One ``torch.Generator`` per request, seeded from ``params[b].seed`` (or randomly)."""
    gens = []
    for p in params:
        g = torch.Generator(device=device)
        if p.seed is not None:
            g.manual_seed(p.seed)
        else:
            g.seed()
        gens.append(g)
    return gens


def draw_coins(generators: Sequence[torch.Generator], num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Coins for one verify step: ``coins [bs, N]`` and ``final_coins [bs]``, float32 in [0, 1).

    Each request draws ``N + 1`` uniforms from its own generator (``N`` node coins, then the
    final coin), so a step replays bit for bit from the generator state.
    """
    rows = [torch.rand(num_rows + 1, generator=g, dtype=torch.float32, device=g.device) for g in generators]
    if not rows:
        return torch.zeros(0, num_rows), torch.zeros(0)
    stacked = torch.stack(rows)
    return stacked[:, :num_rows].contiguous(), stacked[:, num_rows].contiguous()


def check_verify_shapes(vi: DDTreeVerifyInput, rows: torch.Tensor, name: str) -> None:
    """The type and shape half of :func:`check_verify_input` (reads no value: no host sync)."""
    if not isinstance(vi, DDTreeVerifyInput):
        raise TypeError(f"verify_input must be a DDTreeVerifyInput, got {type(vi).__name__}")
    bs, n = vi.node_token_ids.shape
    if rows.dim() != 3 or tuple(rows.shape[:2]) != (bs, n):
        raise ValueError(f"{name} must have shape [bs={bs}, N={n}, V], got {tuple(rows.shape)}")
    check_shape("num_nodes", vi.num_nodes, (bs,))
    for fname in ("retrieve_next_token", "retrieve_next_sibling"):
        check_shape(fname, getattr(vi, fname), (bs, n))


def verify_input_flags(vi: DDTreeVerifyInput, vocab: int) -> torch.Tensor:
    """``[4]`` bool on ``vi``'s device, computed without a host read: num_nodes outside
    ``[1, N]``; a ``retrieve_next_token`` / ``retrieve_next_sibling`` entry out of range; a
    token id outside ``[0, vocab)`` (shapes checked first: :func:`check_verify_shapes`)."""
    n = vi.node_token_ids.shape[1]
    real = torch.arange(n, device=vi.node_token_ids.device)[None, :] < vi.num_nodes[:, None]
    flags = [((vi.num_nodes < 1) | (vi.num_nodes > n)).any()]
    for fname in ("retrieve_next_token", "retrieve_next_sibling"):
        buf = getattr(vi, fname)
        flags.append((((buf < -1) | (buf >= vi.num_nodes[:, None])) & real).any())
    flags.append((real & ((vi.node_token_ids < 0) | (vi.node_token_ids >= vocab))).any())
    return torch.stack(flags)


def raise_verify_input_values(vi: DDTreeVerifyInput, vocab: int) -> None:
    """Raise the first value problem :func:`verify_input_flags` flags, naming request and node
    (reads the values on the host: for the error path)."""
    n = vi.node_token_ids.shape[1]
    bad_count = (vi.num_nodes < 1) | (vi.num_nodes > n)
    if bad_count.any():
        b = int(bad_count.nonzero()[0])
        raise ValueError(f"num_nodes, request {b}: {int(vi.num_nodes[b])} is outside [1, N={n}]")
    for fname in ("retrieve_next_token", "retrieve_next_sibling"):
        buf = getattr(vi, fname)
        bad = (buf < -1) | (buf >= vi.num_nodes[:, None])
        bad &= torch.arange(n, device=buf.device)[None, :] < vi.num_nodes[:, None]
        if bad.any():
            b, i = (int(v) for v in bad.nonzero()[0])
            raise ValueError(f"{fname}, request {b}, node {i}: {int(buf[b, i])} is out of range")
    real = torch.arange(n, device=vi.node_token_ids.device)[None, :] < vi.num_nodes[:, None]
    bad = real & ((vi.node_token_ids < 0) | (vi.node_token_ids >= vocab))
    if bad.any():
        b, i = (int(v) for v in bad.nonzero()[0])
        raise ValueError(f"node_token_ids, request {b}, node {i}: token {int(vi.node_token_ids[b, i])} not in [0, {vocab})")


def check_verify_input(vi: DDTreeVerifyInput, rows: torch.Tensor, name: str) -> None:
    """Raise TypeError / ValueError unless ``vi`` fits ``rows`` ``[bs, N, V]`` and its buffers and
    token ids are in range (one host read of the value checks' flags; the message names the
    first bad request and node)."""
    check_verify_shapes(vi, rows, name)
    vocab = rows.shape[2]
    if verify_input_flags(vi, vocab).any():
        raise_verify_input_values(vi, vocab)


def verify_greedy(verify_input: DDTreeVerifyInput, target_logits: torch.Tensor, *, validate: bool = True) -> VerifyOutput:
    """Greedy tree verification (SGLang ``verify_tree_greedy``), whole batch.

    Args:
        verify_input: buffers from :func:`ddtree_lab.compile_retrieve`.
        target_logits: ``[bs, N, V]`` float32 / float16 / bfloat16, the target's logits at
            every node (row ``i`` predicts the token after node ``i``).
        validate: check the buffers first (:func:`ddtree_lab.check_verify_buffers`, O(N) per
            request); ``False`` only for timing.

    Returns:
        :class:`VerifyOutput`; ``decisions`` hold, per visited sibling, the softmax
        probability of its token (for display), the running sum, and the verdict.

    Raises:
        ValueError: shape mismatch, broken buffers (:class:`ddtree_lab.RetrieveError`, request
            and node named), a token outside the vocabulary, or a NaN / all ``-inf`` row on the
            walked path (request and node named).
    """
    check_tensor("target_logits", target_logits, dtype=(torch.float32, torch.float16, torch.bfloat16), ndim=3)
    check_verify_input(verify_input, target_logits, "target_logits")
    if validate:
        check_verify_buffers(verify_input)
    check_logits_rows(target_logits, verify_input.num_nodes)
    argmax = target_logits.float().argmax(-1).tolist()
    probs = torch.softmax(target_logits.float(), dim=-1)
    tokens = verify_input.node_token_ids.tolist()
    return walk_batch(verify_input, lambda b: GreedyRule(b, tokens[b], argmax[b], probs[b]), "reference")


def verify_sampled(
    verify_input: DDTreeVerifyInput,
    target_probs: torch.Tensor,
    coins: torch.Tensor,
    final_coins: torch.Tensor,
    *,
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
    final_masses: Sequence[float | None] | None = None,
    validate: bool = True,
) -> VerifyOutput:
    """Sampled tree verification, target-only rule (module docstring), whole batch.

    Greedy requests can sit in the same batch: give them one-hot rows (as
    :func:`ddtree_lab.target_probs` does for temperature 0) and the rule accepts the
    argmax child whatever the coin.

    Args:
        verify_input: buffers from :func:`ddtree_lab.compile_retrieve`.
        target_probs: ``[bs, N, V]`` float32, each node's row from
            :func:`ddtree_lab.target_probs` (rows sum to 1; padding rows ignored).
        coins: ``[bs, N]`` float32 in [0, 1); ``coins[b, i]`` decides among the children of
            node ``i`` (SGLang's ``uniform_samples`` layout).
        final_coins: ``[bs]`` float32 in [0, 1), for the bonus draw.
        threshold_single, threshold_acc: 1.0 for the exact rule; any finite value >= 0 is
            accepted (0 included, as SGLang) and marks the output ``lossy`` (module docstring).
        final_masses: per request, the residual mass of the bonus draw when ``target_probs``
            holds the final row only up to the drawn token (trace replay, see
            :func:`residual_draw`); ``None`` computes it from the row.
        validate: check the buffers first (:func:`ddtree_lab.check_verify_buffers`, O(N) per
            request); ``False`` only for timing.

    Returns:
        :class:`VerifyOutput` with the decision log (node, token, ``p``, ``S_k``, coin, verdict)
        and, per request, the :class:`BonusDraw` (residual mass and the coin used).

    Raises:
        ValueError: shape or range errors, broken buffers (:class:`ddtree_lab.RetrieveError`),
            coins outside [0, 1), NaN or negative probabilities on a walked row, or negative /
            non-finite thresholds (each names request and node where it applies).
    """
    check_tensor("target_probs", target_probs, dtype=torch.float32, ndim=3)
    check_verify_input(verify_input, target_probs, "target_probs")
    bs, n = verify_input.node_token_ids.shape
    validate_coins(coins, final_coins, bs, n)
    check_thresholds(threshold_single, threshold_acc)
    if validate:
        check_verify_buffers(verify_input)
    bad_rows = (torch.isnan(target_probs).any(-1) | (target_probs < 0).any(-1)).tolist()

    def row_of(b: int, i: int) -> torch.Tensor:
        if bad_rows[b][i]:
            raise ValueError(f"target_probs, request {b}, node {i}: row has NaN or negative entries")
        return target_probs[b, i]

    return walk_sampled_batch(verify_input, row_of, coins, final_coins, threshold_single, threshold_acc,
                              final_masses, "reference")


def walk_sampled_batch(vi, row_of, coins, final_coins, threshold_single, threshold_acc, final_masses,
                       backend: str) -> VerifyOutput:
    """The sampled walk of every request of a batch; ``row_of(b, i)`` gives node ``i``'s float32
    row of request ``b`` and is called only for rows the walk reaches (the reference reads a
    full tensor, the lazy backend computes rows on demand)."""
    tree = host_tree(vi)
    tokens = tree.tokens
    coin_rows, final = coins.tolist(), final_coins.tolist()

    def rule_of(b):
        return SampledRule(b, tokens[b], lambda i: row_of(b, i), coin_rows[b], final[b], threshold_single,
                            threshold_acc, None if final_masses is None else final_masses[b])

    return walk_batch(vi, rule_of, backend, (threshold_single, threshold_acc), tree)


def check_coin_shapes(coins: torch.Tensor, final_coins: torch.Tensor, bs: int, n: int) -> None:
    """The type and shape half of :func:`validate_coins` (no host read)."""
    check_tensor("coins", coins, dtype=torch.float32, ndim=2)
    check_shape("coins", coins, (bs, n))
    check_tensor("final_coins", final_coins, dtype=torch.float32, ndim=1)
    check_shape("final_coins", final_coins, (bs,))


def coin_flags(coins: torch.Tensor, final_coins: torch.Tensor) -> torch.Tensor:
    """``[2]`` bool on the coins' device (no host read): a coin / a final coin outside ``[0, 1)``."""
    return torch.stack([(~((c >= 0) & (c < 1))).any().to(coins.device) for c in (coins, final_coins)])


def raise_coin_values(coins: torch.Tensor, final_coins: torch.Tensor) -> None:
    """Raise for the first coin outside ``[0, 1)``, naming request (and node)."""
    for name, c in (("coins", coins), ("final_coins", final_coins)):
        bad = ~((c >= 0) & (c < 1))
        if bad.any():
            where = [int(v) for v in bad.nonzero()[0]]
            raise ValueError(f"{name}, request {where[0]}{', node ' + str(where[1]) if len(where) > 1 else ''}: "
                             f"{float(c[tuple(where)])} is not in [0, 1)")


def validate_coins(coins: torch.Tensor, final_coins: torch.Tensor, bs: int, n: int) -> None:
    """Raise TypeError / ValueError unless ``coins [bs, N]`` and ``final_coins [bs]`` are float32
    in ``[0, 1)`` (one host read)."""
    check_coin_shapes(coins, final_coins, bs, n)
    if coin_flags(coins, final_coins).any():
        raise_coin_values(coins, final_coins)


def check_thresholds(threshold_single: float, threshold_acc: float) -> None:
    """Every finite value >= 0 (what SGLang accepts, 0 included; see the module docstring)."""
    for name, t in (("threshold_single", threshold_single), ("threshold_acc", threshold_acc)):
        if isinstance(t, bool) or not isinstance(t, (int, float)):
            raise TypeError(f"{name} must be a number, got {t!r}")
        if not (math.isfinite(t) and t >= 0.0):
            raise ValueError(f"{name} must be a finite number >= 0, got {t}")
