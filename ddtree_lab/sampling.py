"""Sampling parameters and the target-side transforms (temperature, top-k, top-p, min-p).

Order (DESIGN.md; SGLang's verify path and vLLM's sampler use the same), the default
``order="top_k_then_top_p"``:
``logits / temperature -> top-k -> renormalise -> top-p over the survivors -> renormalise
-> optional min-p -> renormalise``. The other order, ``order="top_p_then_top_k"`` (top-p on
the whole tempered distribution, then top-k among its survivors, renormalise, min-p), is
available on request, never silently: on ``[0.4, 0.3, 0.2, 0.1]`` with ``top_k=2``,
``top_p=0.5`` the default keeps one token (``[0.57, 0.43]`` after top-k, and 0.57 reaches 0.5)
and the other order keeps two. Plain sampling (a session's first token) and every verifier use
the request's ``order`` through :func:`target_probs`.

Boundary and tie rules (the same rules the Triton verifiers implement):

* **top-k** keeps every token whose (temperature-scaled) logit is ``>=`` the k-th largest
  logit. Tokens tied with the k-th value are all kept, so more than ``k`` tokens can
  survive a tie; none is dropped by index order.
* **top-p** keeps token ``t`` iff the probability mass of the tokens *strictly more
  probable* than ``t`` is ``< top_p``. Equivalently: sort descending, find the first
  position where the running sum reaches ``top_p``, keep every token at least as probable
  as that one (ties at the cut are all kept). The running sum is float32, descending order.
* **min-p** keeps tokens with ``p >= min_p * max p``.
* **temperature** divides in IEEE float32: ``logits.float() / float32(T)``, correctly
  rounded, on every device.
* **greedy** (``temperature == 0``) rows are one-hot at the argmax of the raw logits; on
  equal logits the lowest token id wins (``torch.argmax``'s documented first-occurrence).
* **banned tokens** (``banned_token_ids``: what an engine's logits processors forbid before
  sampling -- vLLM's ``bad_words`` of one token, a ``logit_bias`` of -inf, ``min_tokens``'
  stop-token ban; SGLang's ``logit_bias``) get logit ``-inf`` first, before every transform
  above, greedy included (:func:`apply_bans`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from ._arguments import check_tensor

__all__ = ["SamplingParams", "normalize_params", "target_probs", "greedy_params", "ORDERS", "apply_bans",
           "apply_bans_batch"]

#: The filtering orders :class:`SamplingParams` knows; the first is the default.
ORDERS = ("top_k_then_top_p", "top_p_then_top_k")


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling parameters.

    Attributes:
        temperature: ``>= 0``; 0 means greedy.
        top_k: ``<= 0`` means off; else ``1..V``.
        top_p: in ``(0, 1]``; 1.0 means off.
        min_p: ``None`` or 0 means off; else in ``(0, 1]``.
        seed: seeds the request's coin generator (``None``: drawn from torch's global RNG);
            an int in ``[0, 2**63)``.
        order: ``"top_k_then_top_p"`` (default, SGLang / vLLM) or ``"top_p_then_top_k"``
            (module docstring).
        banned_token_ids: a tuple of token ids the request forbids (logit ``-inf`` before
            every transform; module docstring); empty: none.

    Raises:
        ValueError: at construction, for a value of the wrong type or outside the ranges above
            (the message names the argument); ``top_k`` against the vocabulary is checked by
            :func:`normalize_params`.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float | None = None
    seed: int | None = None
    order: str = ORDERS[0]
    banned_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        why = self.problem()
        if why is not None:
            raise ValueError(f"SamplingParams: {why}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_dict(cls, d: dict) -> "SamplingParams":
        """The inverse of :meth:`to_dict`; a dict without ``order`` (trace format v1) gets the
        default order.

        Raises:
            TypeError: not a dict; ValueError: an unknown key or an invalid value (named).
        """
        if not isinstance(d, dict):
            raise TypeError(f"sampling parameters must be a dict, got {type(d).__name__}")
        known = {"temperature", "top_k", "top_p", "min_p", "seed", "order", "banned_token_ids"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s) {unknown} (known: {sorted(known)})")
        d = dict(d)
        if "banned_token_ids" in d:
            if not isinstance(d["banned_token_ids"], list):
                raise ValueError(f"banned_token_ids must be a list, got {d['banned_token_ids']!r}")
            d["banned_token_ids"] = tuple(d["banned_token_ids"])  # JSON has lists, not tuples
        return cls(**d)

    def problem(self, vocab_size: int | None = None) -> str | None:
        """What is wrong with these parameters, or None (the argument named)."""
        for name in ("temperature", "top_p"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                return f"{name} must be a number, got {v!r}"
            if math.isnan(v):
                return f"{name} is NaN"
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            return f"top_k must be an int, got {self.top_k!r}"
        if self.temperature < 0 or math.isinf(self.temperature):
            return f"temperature must be finite and >= 0, got {self.temperature}"
        if 0.0 < self.temperature and (self.temperature < 1e-6):
            return (f"temperature {self.temperature} is too small to divide logits by in float32 "
                    "(use 0 for greedy, or >= 1e-6)")
        if not 0.0 < self.top_p <= 1.0:
            return f"top_p must be in (0, 1], got {self.top_p}"
        if vocab_size is not None and self.top_k > vocab_size:
            return f"top_k = {self.top_k} exceeds the vocabulary size {vocab_size}"
        if self.min_p is not None:
            if isinstance(self.min_p, bool) or not isinstance(self.min_p, (int, float)) or math.isnan(self.min_p):
                return f"min_p must be a number or None, got {self.min_p!r}"
            if not 0.0 <= self.min_p <= 1.0:
                return f"min_p must be in [0, 1], got {self.min_p}"
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            return f"seed must be an int or None, got {self.seed!r}"
        if self.seed is not None and not 0 <= self.seed < 2**63:
            return f"seed must be in [0, 2**63), got {self.seed}"
        if not isinstance(self.order, str) or self.order not in ORDERS:
            return f"order must be one of {ORDERS}, got {self.order!r}"
        banned = self.banned_token_ids
        if not isinstance(banned, tuple) or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in banned):
            return f"banned_token_ids must be a tuple of token ids >= 0, got {banned!r}"
        if vocab_size is not None and banned:
            if max(banned) >= vocab_size:
                return f"banned token id {max(banned)} is outside the vocabulary (size {vocab_size})"
            if len(set(banned)) >= vocab_size:
                return "banned_token_ids ban every token of the vocabulary"
        return None

    def label(self, sep: str = "=") -> str:
        """Short text of the setting: ``"greedy"`` or ``"T=0.8 top-k=50 top-p=0.9 min-p=0.05"``
        (parameters that are off left out; ``sep`` between a filter's name and value)."""
        if self.is_greedy:
            return "greedy" + (f" banned{sep}{list(self.banned_token_ids)}" if self.banned_token_ids else "")
        parts = [f"T={self.temperature:g}"]
        if self.top_k > 0:
            parts.append(f"top-k{sep}{self.top_k}")
        if self.top_p < 1.0:
            parts.append(f"top-p{sep}{self.top_p:g}")
        if self.min_p:
            parts.append(f"min-p{sep}{self.min_p:g}")
        if self.banned_token_ids:
            parts.append(f"banned{sep}{list(self.banned_token_ids)}")
        return " ".join(parts)

    def to_dict(self) -> dict:
        """JSON-able dict (:meth:`from_dict` reads it back); ``banned_token_ids`` only when
        some are banned (files without bans stay readable by older versions)."""
        d = {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p,
             "min_p": self.min_p, "seed": self.seed, "order": self.order}
        if self.banned_token_ids:
            d["banned_token_ids"] = list(self.banned_token_ids)
        return d


def param_is_off(name: str, value) -> bool:
    """Whether a :class:`SamplingParams` field (``to_dict`` name and value) has exactly its "off"
    value, so that a summary may leave it out: ``top_k <= 0``, ``top_p == 1.0``, ``min_p`` None
    or 0, ``seed`` None, no banned tokens, the default ``order``. ``temperature`` is never off
    (0 is greedy, a mode), nor is ``seed 0`` or ``top_k 1``; an unknown field is shown unless None."""
    if value is None:
        return True
    if name == "top_k":
        return value <= 0
    if name == "top_p":
        return value == 1.0
    if name == "min_p":
        return value == 0
    if name == "banned_token_ids":
        return not value
    if name == "order":
        return value == ORDERS[0]
    return False


def greedy_params() -> SamplingParams:
    """Parameters of a greedy request (temperature 0)."""
    return SamplingParams(temperature=0.0)


def normalize_params(
    params: SamplingParams | Sequence[SamplingParams], batch_size: int, vocab_size: int | None = None
) -> list[SamplingParams]:
    """One :class:`SamplingParams` per request, validated.

    Args:
        params: one for the whole batch, or a sequence of ``batch_size``.
        vocab_size: ``V`` for the ``top_k <= V`` check.

    Raises:
        TypeError: not SamplingParams.
        ValueError: wrong count, or invalid values (the message names the request).
    """
    if isinstance(params, SamplingParams):
        items = [params] * batch_size
    else:
        items = list(params)
        if len(items) != batch_size:
            raise ValueError(f"got {len(items)} SamplingParams for a batch of {batch_size} requests")
    for b, p in enumerate(items):
        if not isinstance(p, SamplingParams):
            raise TypeError(f"request {b}: expected SamplingParams, got {type(p).__name__}")
        why = p.problem(vocab_size)
        if why is not None:
            raise ValueError(f"request {b}: {why}")
    return items


def check_logits_rows(logits: torch.Tensor, num_nodes: torch.Tensor | None = None, name: str = "target logits") -> None:
    """Raise ValueError at the first row (request, node) with NaN or with every entry -inf.

    Rows at or past ``num_nodes[b]`` (padding) are not checked. ``num_nodes`` may sit on
    another device than ``logits`` (the host, where trees are built).
    """
    bad_nan = torch.isnan(logits).any(-1)
    bad_inf = torch.isneginf(logits).all(-1)
    bad_pos = torch.isposinf(logits).any(-1)
    if num_nodes is not None:
        real = torch.arange(logits.shape[1], device=logits.device)[None, :] < num_nodes.to(logits.device)[:, None]
        bad_nan &= real
        bad_inf &= real
        bad_pos &= real
    for what, bad in (("NaN", bad_nan), ("every entry -inf", bad_inf), ("+inf", bad_pos)):
        if bad.any():
            b, i = (int(v) for v in bad.nonzero()[0])
            raise ValueError(f"{name}, request {b}, node {i}: row has {what}")


def _top_k_mask(scaled: torch.Tensor, top_k: int) -> torch.Tensor:
    kth = torch.topk(scaled, top_k, dim=-1).values[..., -1:]
    return scaled >= kth


def top_p_mask(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The nucleus (top-p) keep mask of ``probs`` ``[..., V]`` (float, rows summing to 1): bool
    ``[..., V]``, True for every token whose p is at least that of the first sorted token at
    which the running sum reaches ``top_p`` (ties at the cut kept). Holtzman et al. 2020, sec. 3.1."""
    sorted_p = torch.sort(probs, dim=-1, descending=True).values
    cum = sorted_p.cumsum(-1)
    # First sorted position whose running sum reaches top_p; keep every p >= its value.
    cut_pos = torch.searchsorted(cum, torch.full_like(cum[..., :1], top_p)).clamp(max=probs.shape[-1] - 1)
    cut = sorted_p.gather(-1, cut_pos)
    return probs >= cut


def apply_bans(rows: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """``rows [..., V]`` logits with ``-inf`` at ``p.banned_token_ids`` (a copy; the same tensor
    when nothing is banned)."""
    if not p.banned_token_ids:
        return rows
    rows = rows.clone()
    rows[..., list(p.banned_token_ids)] = -math.inf
    return rows


def apply_bans_batch(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """``logits [bs, N, V]`` with each request's banned tokens at ``-inf`` (:func:`apply_bans`;
    the same tensor when no request bans a token): for code that hands logits to a kernel."""
    if not any(p.banned_token_ids for p in params):
        return logits
    return torch.stack([apply_bans(logits[b], p) for b, p in enumerate(params)])


def filtered_probs(rows: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """``[..., V]`` float32 logits -> probabilities under ``p`` (module docstring: order, tie
    rules, bans); rows already checked. Greedy rows are one-hot at the argmax."""
    rows = apply_bans(rows, p)
    if p.is_greedy:
        return torch.zeros_like(rows).scatter_(-1, rows.argmax(-1, keepdim=True), 1.0)
    vocab = rows.shape[-1]
    # IEEE float32 division by float32(T) on every device (CUDA turns division by a
    # Python scalar into multiplication by its reciprocal, which can move a top-k tie)
    scaled = rows / torch.full_like(rows[..., :1], p.temperature)
    top_k = 0 < p.top_k < vocab
    if p.order == "top_k_then_top_p":
        if top_k:
            scaled = scaled.masked_fill(~_top_k_mask(scaled, p.top_k), -math.inf)
        probs = torch.softmax(scaled, dim=-1)
        if p.top_p < 1.0:
            probs = probs * top_p_mask(probs, p.top_p)
            probs = probs / probs.sum(-1, keepdim=True)
    else:  # top-p on the whole tempered distribution, then top-k among its survivors
        probs = torch.softmax(scaled, dim=-1)
        keep = top_p_mask(probs, p.top_p) if p.top_p < 1.0 else torch.ones_like(probs, dtype=torch.bool)
        if top_k:
            keep &= _top_k_mask(scaled, p.top_k)
        if p.top_p < 1.0 or top_k:
            probs = probs * keep
            probs = probs / probs.sum(-1, keepdim=True)
    return apply_min_p(probs, p.min_p)


def apply_min_p(probs: torch.Tensor, min_p: float | None) -> torch.Tensor:
    """The min-p cut (vLLM / SGLang ``min_p``): zero every probability below ``min_p`` times the
    row's largest, renormalise. ``probs [..., V]`` float32; ``min_p`` None or 0: unchanged."""
    if not min_p:
        return probs
    probs = probs * (probs >= min_p * probs.max(-1, keepdim=True).values)
    return probs / probs.sum(-1, keepdim=True)


def target_probs(
    logits: torch.Tensor,
    params: SamplingParams | Sequence[SamplingParams],
    num_nodes: torch.Tensor | None = None,
) -> torch.Tensor:
    """The target distribution each verifier compares against, row by row.

    Args:
        logits: ``[bs, N, V]`` float32 / float16 / bfloat16 target logits of the tree nodes.
        params: one :class:`SamplingParams` for all requests or one per request.
        num_nodes: optional ``[bs]`` int64 (any device); padding rows (``i >= num_nodes[b]``)
            are not checked and come back all zero.

    Returns:
        ``[bs, N, V]`` float32 probabilities, transforms applied in each request's ``order``
        (module docstring); greedy rows one-hot at the argmax.

    Raises:
        ValueError: a row with NaN, +inf or all -inf (naming request and node), or invalid
            parameters (naming the request).
    """
    check_tensor("logits", logits, dtype=(torch.float32, torch.float16, torch.bfloat16), ndim=3)
    bs, n, vocab = logits.shape
    items = normalize_params(params, bs, vocab)
    check_logits_rows(logits, num_nodes)
    out = torch.zeros(bs, n, vocab, dtype=torch.float32, device=logits.device)
    for b, p in enumerate(items):
        out[b] = filtered_probs(logits[b].float(), p)
    if num_nodes is not None:
        pad = torch.arange(n, device=logits.device)[None, :] >= num_nodes.to(logits.device)[:, None]
        out[pad] = 0.0
    return out
