"""Draft stage: the block drafter's logits -> draft top-k (``draft_token_ids``, ``draft_logprobs``).

The drafter proposes, for each of the ``L-1`` positions after the anchor, an independent
distribution over the vocabulary (DFlash, arXiv 2602.06036, §3). DDTree reads only each
row's top ``K`` tokens and their log-probabilities, normalised over the full vocabulary and
sorted by descending log-prob (DDTree, arXiv 2604.12989, §4.1): that pair is the
*draft top-k* every later stage consumes.
"""

from __future__ import annotations

import numpy as np
import torch

from ._arguments import check_shape, check_tensor

__all__ = ["check_draft_topk", "draft_topk_from_logits", "draft_topk_device"]


_NORMALISATION_SLACK = 1e-3  # top-k mass may exceed 1 by this much (float32 log-softmax)


def check_draft_topk(draft_token_ids: torch.Tensor, draft_logprobs: torch.Tensor) -> None:
    """Validate a batch of draft top-k rows; raise ValueError naming request and depth.

    Args:
        draft_token_ids: ``[bs, L-1, K]`` int64, token ids, distinct within a row, >= 0.
        draft_logprobs: ``[bs, L-1, K]`` float32, sorted descending along K, no NaN or
            ``+inf``, mass of each row at most ``1 + 1e-3`` (normalised over the vocabulary).
            The first column must be finite (every depth has a best token).
    """
    check_tensor("draft_token_ids", draft_token_ids, dtype=torch.int64, ndim=3)
    check_tensor("draft_logprobs", draft_logprobs, dtype=torch.float32, ndim=3)
    check_shape("draft_logprobs", draft_logprobs, tuple(draft_token_ids.shape))
    bs, depth, k = draft_token_ids.shape
    if depth < 1 or k < 1:
        raise ValueError(f"draft top-k must have at least one depth and one column, got shape {(bs, depth, k)}")

    # numpy on the host: these arrays are small, and torch's threaded kernels stall on a busy CPU.
    lp = draft_logprobs.detach().cpu().numpy()
    ids = draft_token_ids.detach().cpu().numpy()

    def fail(what: str, bad: np.ndarray) -> None:  # bad: [bs, L-1] or [bs, L-1, k] bool
        if bad.any():  # cheap on the whole array; locate only on failure
            b, d = np.argwhere(bad.reshape(bs, depth, -1).any(-1))[0]
            raise ValueError(f"draft top-k, request {b}, depth {d + 1}: {what}")

    fail("draft_logprobs has NaN", np.isnan(lp))
    fail("draft_logprobs has +inf", np.isposinf(lp))
    fail("draft_logprobs > 0 (log-probabilities must be <= 0)", lp > 0)
    fail("the best draft log-prob is -inf (the row has no token)", np.isneginf(lp[..., 0]))
    fail("draft_logprobs not sorted in descending order", lp[..., 1:] > lp[..., :-1])
    fail("negative token id", ids < 0)
    srt = np.sort(ids, axis=-1)
    fail("a token id appears twice in the row", srt[..., 1:] == srt[..., :-1])
    mass = np.exp(lp.astype(np.float64)).sum(-1)
    fail(
        f"top-k probability mass exceeds 1 (+{_NORMALISATION_SLACK}): log-probs must be normalised over the vocabulary",
        mass > 1.0 + _NORMALISATION_SLACK,
    )


def draft_topk_from_logits(
    draft_logits: torch.Tensor, k: int | None = None, budget: int | None = None, *, block_bytes: int = 1 << 23
) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn raw draft logits into the draft top-k form that :func:`build_tree` takes.

    No sort over the vocabulary. Rows are processed in blocks of about ``block_bytes`` (so
    each block is read from memory once and stays in cache): per row, the maximum ``m`` and
    the chunk maxima give a threshold ``t`` with at least ``K`` logits at or above it (the
    ``K``-th largest of at least ``K`` chunk maxima); the normaliser
    ``ls = log sum exp(x - m)`` is summed once (as ``exp2``); the candidates ``x >= t - eps``
    (``eps`` a few float32 ulps, so that no logit left out can round to the ``K``-th
    log-prob) are sorted stably by log-prob, descending, in ascending token-id order. Only
    degenerate rows (more than a quarter of the vocabulary at the threshold, e.g. all logits
    equal) fall back to a sort of the row, and vocabularies of 2^18 tokens or more to the
    stable sort of every row.

    Args:
        draft_logits: ``[bs, L-1, V]`` floating, the drafter's logits for positions 1..L-1.
        k: columns to keep; default ``min(budget, V)`` -- by DDTree's Lemma 1 a larger K
            cannot change a tree of budget ``budget`` (a node of rank >= B has B better
            siblings, so it is never among the B best prefixes).
        budget: used for the default ``k``; one of ``k`` or ``budget`` is required.
        block_bytes: working-set size of one block of rows (a tuning knob, no effect on
            the result).

    Returns:
        ``(draft_token_ids [bs, L-1, K] int64, draft_logprobs [bs, L-1, K] float32)``, on
        the device of ``draft_logits``, each row sorted by descending log-prob
        ``(x - m) - ls`` (float32; equal to ``torch.log_softmax`` within float32 rounding);
        equal log-probs are ordered by ascending token id.

    Raises:
        ValueError: bad shape, NaN / ``+inf`` logits or a row of only ``-inf`` (naming
            request and depth), ``budget`` or ``k`` out of range (naming the argument given).
    """
    check_tensor("draft_logits", draft_logits, dtype=(torch.float32, torch.float16, torch.bfloat16, torch.float64), ndim=3)
    vocab = draft_logits.shape[-1]
    if k is None:
        if budget is None:
            raise ValueError("draft_topk_from_logits needs k or budget")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise ValueError(f"budget must be an int >= 1 (K = min(budget, V={vocab})), got {budget!r}")
        k = min(int(budget), vocab)
    elif isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= vocab:
        raise ValueError(f"k must be an int in [1, V={vocab}], got {k!r}")
    bs, depth = draft_logits.shape[:2]
    rows = draft_logits.reshape(bs * depth, vocab)
    ids_out = torch.empty(bs * depth, k, dtype=torch.int64, device=rows.device)
    lp_out = torch.empty(bs * depth, k, dtype=torch.float32, device=rows.device)
    if rows.shape[0] == 0:
        return ids_out.view(bs, depth, k), lp_out.view(bs, depth, k)
    if vocab >= 1 << 18:  # beyond the sort key's column bits: the plain stable sort
        for r0 in range(0, rows.shape[0], 64):
            blk = rows[r0 : r0 + 64].float()
            _check_row_max(blk.amax(-1), r0, depth)
            val, idx = torch.sort(torch.log_softmax(blk, -1), dim=-1, descending=True, stable=True)
            lp_out[r0 : r0 + 64], ids_out[r0 : r0 + 64] = val[:, :k], idx[:, :k]
        return ids_out.view(bs, depth, k), lp_out.view(bs, depth, k)
    chunk = max(1, vocab // (16 * k))  # >= 16K chunks where V allows: a tight threshold
    nch = vocab // chunk
    body = nch * chunk
    per = max(1, min(rows.shape[0], block_bytes // (4 * vocab)))
    buf = torch.empty(per, vocab, dtype=torch.float32, device=rows.device)  # exp2 scratch
    log2e = 1.4426950408889634
    for r0 in range(0, rows.shape[0], per):
        blk = rows[r0 : r0 + per].float()
        n = blk.shape[0]
        # strided chunks: chunk c holds columns c, c + nch, c + 2*nch, ... (a vectorised max)
        chunks = blk[:, :body].view(n, chunk, nch)
        cmax = chunks.amax(1)  # [n, nch]
        m = cmax.amax(-1, keepdim=True)
        if body < vocab:
            m = torch.maximum(m, blk[:, body:].amax(-1, keepdim=True))
        _check_row_max(m[:, 0], r0, depth)  # NaN and +inf propagate through max; all -inf stays -inf
        t = cmax.topk(k, -1, sorted=False).values.amin(-1, keepdim=True) if nch > k else cmax.amin(-1, keepdim=True)
        tmp = torch.sub(blk, m, out=buf[:n])  # exact 0 at the maximum: ls >= 0, log-probs <= 0
        ls = tmp.mul_(log2e).exp2_().sum(-1, keepdim=True).log_()
        thr = t - ((t - m).abs() + ls.abs() + 1.0) * 2.0**-20  # 8 ulps of the log-probs' scale below t
        # candidates: the elements >= thr of the chunks whose maximum reaches thr, and of the tail
        cr, cc = (cmax >= thr).nonzero(as_tuple=True)
        pr, pj = (chunks[cr, :, cc] >= thr[cr]).nonzero(as_tuple=True)
        rr, col = cr[pr], pj * nch + cc[pr]
        if body < vocab:
            tr, tj = (blk[:, body:] >= thr).nonzero(as_tuple=True)
            rr, col = torch.cat([rr, tr]), torch.cat([col, tj + body])
        count = torch.bincount(rr, minlength=n)
        big = count > max(k, vocab // 4)
        if bool(big.any()):  # degenerate rows (e.g. all logits equal): sort them whole
            for i in big.nonzero()[:, 0].tolist():
                val, idx = torch.sort((blk[i] - m[i]) - ls[i], descending=True, stable=True)
                lp_out[r0 + i], ids_out[r0 + i] = val[:k], idx[:k]
            ok = ~big[rr]
            rr, col = rr[ok], col[ok]
            count = count.masked_fill(big, 0)
        vals = (blk[rr, col] - m[rr, 0]) - ls[rr, 0] + 0.0  # + 0.0: no -0.0
        # one sort on (row asc, log-prob desc, token id asc): an int64 key from the float bits
        o = torch.sort(_order_key(rr, vals, col)).indices
        starts = torch.cumsum(count, 0) - count
        live = (~big).nonzero()[:, 0]
        take = o[(starts[live, None] + torch.arange(k, device=blk.device)).reshape(-1)]
        lp_out[r0 + live] = vals[take].view(-1, k)
        ids_out[r0 + live] = col[take].view(-1, k)
    return ids_out.view(bs, depth, k), lp_out.view(bs, depth, k)


def draft_topk_device(draft_logits: torch.Tensor, k: int, *, block_bytes: int = 1 << 23
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`draft_topk_from_logits` with no host read, for the live step on an accelerator (issue 36).

    The same log-probs ``(x - m) - ls`` by the same float32 ops, the same order (descending
    log-prob, ascending token id on equal log-probs), so the same top-k bit for bit
    (``tests/test_host_syncs.py``); but where :func:`draft_topk_from_logits` extracts a few
    candidates per row (a data-dependent size the host must read), this takes the ``K``
    smallest of one int64 key per logit (``desc(log-prob) << 18 | token id``: unique, so
    ``torch.topk`` has no ties to break), and instead of raising on a bad row it returns a flag
    per row for the caller to read with its other results. Vocabularies of 2^18 tokens or
    more take a stable sort of each row's ``log_softmax``, as there.

    Args:
        draft_logits: ``[bs, L-1, V]`` floating.
        k: columns to keep, an int in ``[1, V]``.
        block_bytes: working-set size of one block of rows (as there; the blocks are shapes,
            not values, so choosing them reads nothing).

    Returns:
        ``(draft_token_ids [bs, L-1, K] int64, draft_logprobs [bs, L-1, K] float32, bad
        [bs, L-1] bool)`` on the logits' device; ``bad`` marks a row with NaN, ``+inf`` or only
        ``-inf`` (its top-k means nothing: :func:`draft_topk_from_logits` names it).

    Raises:
        ValueError: bad shape or ``k`` (no value is read).
    """
    check_tensor("draft_logits", draft_logits, dtype=(torch.float32, torch.float16, torch.bfloat16, torch.float64), ndim=3)
    bs, depth, vocab = draft_logits.shape
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= vocab:
        raise ValueError(f"k must be an int in [1, V={vocab}], got {k!r}")
    rows = draft_logits.reshape(bs * depth, vocab)
    ids_out = torch.empty(bs * depth, k, dtype=torch.int64, device=rows.device)
    lp_out = torch.empty(bs * depth, k, dtype=torch.float32, device=rows.device)
    bad = torch.zeros(bs * depth, dtype=torch.bool, device=rows.device)
    step = 64 if vocab >= 1 << 18 else max(1, min(max(rows.shape[0], 1), block_bytes // (4 * vocab)))
    log2e = 1.4426950408889634
    cols = torch.arange(vocab, device=rows.device)
    for r0 in range(0, rows.shape[0], step):
        blk = rows[r0 : r0 + step].float()
        m = blk.amax(-1, keepdim=True)
        bad[r0 : r0 + step] = torch.isnan(m[:, 0]) | torch.isinf(m[:, 0])
        if vocab >= 1 << 18:
            val, idx = torch.sort(torch.log_softmax(blk, -1), dim=-1, descending=True, stable=True)
            lp_out[r0 : r0 + step], ids_out[r0 : r0 + step] = val[:, :k], idx[:, :k]
            continue
        ls = torch.sub(blk, m).mul_(log2e).exp2_().sum(-1, keepdim=True).log_()
        vals = (blk - m) - ls + 0.0  # + 0.0: no -0.0
        key = _order_key(torch.zeros_like(cols), vals, cols.expand_as(vals))
        take = torch.topk(key, k, dim=-1, largest=False, sorted=True).indices
        lp_out[r0 : r0 + step] = vals.gather(1, take)
        ids_out[r0 : r0 + step] = take
    return ids_out.view(bs, depth, k), lp_out.view(bs, depth, k), bad.view(bs, depth)


def _order_key(rows: torch.Tensor, vals: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """int64 keys ordering by row ascending, ``vals`` (float32, no NaN) descending, column
    ascending: ``row << 50 | desc(vals) << 18 | col`` (rows < 2^13, columns < 2^18)."""
    u = vals.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    asc = torch.where(u >= 0x80000000, 0xFFFFFFFF - u, u | 0x80000000)  # float order as uint32
    return (rows << 50) | ((0xFFFFFFFF - asc) << 18) | cols


def _check_row_max(m: torch.Tensor, r0: int, depth: int) -> None:
    """Raise for the first row (flat index ``r0 + i``) whose maximum is NaN, +inf or -inf."""
    bad = torch.isnan(m) | torch.isinf(m)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        what = "NaN" if torch.isnan(m[i]) else "+inf" if m[i] > 0 else "every entry -inf"
        row = r0 + i
        raise ValueError(f"draft_logits, request {row // depth}, depth {row % depth + 1}: {what}")
