"""Record stage: a live step's stage outputs (one request) -> a Step at a recording level."""

from __future__ import annotations

import torch

from .sampling import SamplingParams, target_probs
from .step import LEVELS, Step, normalize_timings
from .verify import BonusDraw, VerifyOutput

__all__ = ["make_step_trace", "row_records", "TOP_M_LOGITS", "TOP_M_DISPLAY"]


TOP_M_LOGITS = 64  # M: raw logits kept per row at level "full"


TOP_M_DISPLAY = 16  # m: display probabilities kept per row at level "full"


def _top_logits(logits: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``m`` of each row of ``[n, V]`` logits, by descending value, ties by ascending id."""
    n, vocab = logits.shape
    m = min(m, vocab)
    if n == 0 or m == 0:
        return torch.zeros(n, m, dtype=torch.int64), torch.zeros(n, m, dtype=torch.float32)
    cand = logits.topk(min(m + 8, vocab), -1)
    kth = cand.values[:, m - 1 : m]
    if cand.values.shape[1] < vocab and bool((cand.values[:, -1:] >= kth).any()):
        # ties with the m-th value reach past the candidates: take every entry tied with it
        width = int((logits >= kth).sum(-1).max())
        cand = logits.topk(width, -1)
    order = cand.indices.sort(-1).indices  # ascending token id ...
    ids, vals = cand.indices.gather(-1, order), cand.values.gather(-1, order)
    order = torch.sort(vals, dim=-1, descending=True, stable=True).indices[:, :m]  # ... then descending logit
    return ids.gather(-1, order).contiguous(), vals.gather(-1, order).float().contiguous()


def make_step_trace(
    *,
    step: int,
    request: int,
    params: SamplingParams,
    output: VerifyOutput,
    level: str = "full",
    request_id: str | None = None,
    prefix_len: int = 0,
    node_token_ids: torch.Tensor | None = None,
    parents: torch.Tensor | None = None,
    depths: torch.Tensor | None = None,
    ranks: torch.Tensor | None = None,
    node_logws: torch.Tensor | None = None,
    retrieve_next_token: torch.Tensor | None = None,
    retrieve_next_sibling: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    draft_token_ids: torch.Tensor | None = None,
    draft_logprobs: torch.Tensor | None = None,
    coins: torch.Tensor | None = None,
    final_coin: float | None = None,
    logits: torch.Tensor | None = None,
    probs: torch.Tensor | None = None,
    top_m: int = TOP_M_DISPLAY,
    top_m_logits: int = TOP_M_LOGITS,
    timings: dict | None = None,
    backend: str | None = None,
    extra: dict | None = None,
) -> Step:
    """The one constructor of a :class:`~ddtree_lab.step.Step` from live stage outputs (live
    sessions and SGLang recordings).

    Args:
        step, request, request_id, prefix_len, params: as in :class:`~ddtree_lab.step.Step`
            (``request_id`` default ``str(request)``).
        output: the request's :class:`VerifyOutput` as a batch of one, with its decision log
            and :class:`BonusDraw`.
        level: ``"full"``, ``"light"`` or ``"off"`` (module docstring).
        node_token_ids, parents: ``[n]`` int64 (request-local tree); depths, ranks ``[n]``
            int64 (default: depths from ``parents``, ranks -1); node_logws ``[n]`` float32
            (default NaN: the source has none).
        retrieve_next_token, retrieve_next_sibling, positions: ``[n]`` int64, as verified.
        draft_token_ids, draft_logprobs: ``[L-1, K]`` (default empty ``[0, 0]``).
        coins: ``[n]`` float32; final_coin: the bonus coin.
        logits: ``[n, V]`` raw target logits of the request's nodes (float32/16/bf16), or
            None (a source with probabilities only). ``full`` stores its top-M rows,
            log-sum-exp and node logits from them.
        probs: ``[n, V]`` float32, the rows the verifier compared against
            (:func:`ddtree_lab.target_probs`: greedy rows one-hot), or None: then the rows
            the trace needs are computed from ``logits`` with ``params`` (``light``: only the
            rows of the visited nodes).
        top_m: display tokens per row (``full``); top_m_logits: M (``full``).
        timings: seconds per stage (``retrieve`` is renamed ``compile``).
        backend: the verifier that ran (default ``output.backend``).

    Returns:
        the :class:`~ddtree_lab.step.Step`; fields its level does not store are None.

    Raises:
        ValueError: unknown level, an output that is not a batch of one, missing inputs the
            level needs, or tensors whose shapes disagree (the message names request and field).
    """
    where = f"step {step}, request {request}"
    if level not in LEVELS:
        raise ValueError(f"{where}: level must be one of {LEVELS}, got {level!r}")
    if not isinstance(output, VerifyOutput) or tuple(output.accept_length.shape) != (1,):
        raise ValueError(f"{where}: output must be a VerifyOutput of one request")
    base = dict(step=int(step), request=int(request), request_id=str(request if request_id is None else request_id),
                prefix_len=int(prefix_len), params=params, output=output, timings=normalize_timings(timings),
                backend=str(output.backend if backend is None else backend), extra=dict(extra or {}), level=level)
    if node_token_ids is not None:
        base["stored_num_nodes"] = int(node_token_ids.shape[0])
    if level == "off":
        return Step.from_fields(**base)
    for name, value in (("node_token_ids", node_token_ids), ("parents", parents),
                        ("retrieve_next_token", retrieve_next_token), ("retrieve_next_sibling", retrieve_next_sibling),
                        ("positions", positions), ("coins", coins)):
        if value is None:
            raise ValueError(f"{where}: level {level!r} needs {name}")
    if logits is None and probs is None:
        raise ValueError(f"{where}: level {level!r} needs the verify rows (probs) or the raw logits")
    if not output.bonus:
        raise ValueError(f"{where}: output has no BonusDraw (the bonus row prefix cannot be recorded)")
    n = int(node_token_ids.shape[0])
    cpu = lambda t: t.detach().cpu()  # noqa: E731
    tokens, parents = cpu(node_token_ids).long(), cpu(parents).long()
    for name, value in (("parents", parents), ("retrieve_next_token", retrieve_next_token),
                        ("retrieve_next_sibling", retrieve_next_sibling), ("positions", positions), ("coins", coins)):
        if tuple(value.shape) != (n,):
            raise ValueError(f"{where}: {name} has shape {tuple(value.shape)}, expected [{n}]")
    for name, value in (("logits", logits), ("probs", probs)):
        if value is not None and (value.dim() != 2 or value.shape[0] != n):
            raise ValueError(f"{where}: {name} has shape {tuple(value.shape)}, expected [{n}, V]")
    if depths is None:
        depths = torch.zeros(n, dtype=torch.int64)
        for i in range(1, n):
            depths[i] = depths[int(parents[i])] + 1
    if logits is not None and level == "full":  # light reads (and moves to the host) the visited rows only
        logits = cpu(logits)
        bad = torch.isnan(logits).any(-1)
        if bad.any():
            raise ValueError(f"{where}: logits of node {int(bad.nonzero()[0])} have NaN")

    def verify_rows(nodes: list[int]) -> torch.Tensor:
        index = torch.tensor(nodes, dtype=torch.int64)
        if probs is not None:
            return cpu(probs[index.to(probs.device)]).float()
        rows = cpu(logits[index.to(logits.device)])
        bad = torch.isnan(rows).any(-1) | torch.isneginf(rows).all(-1) | torch.isposinf(rows).any(-1)
        if bad.any():
            raise ValueError(f"{where}: logits of node {nodes[int(bad.nonzero()[0])]} have NaN, +inf or only -inf")
        return target_probs(rows[None], params)[0]

    bonus = output.bonus[0]
    path = [i for i in output.accept_index[0].tolist() if i >= 0] or [0]
    has_parent = torch.arange(n) > 0
    child = torch.zeros(n, dtype=torch.float32)
    if level == "full":
        rows = verify_rows(list(range(n)))
        child[1:] = rows[parents[1:], tokens[1:]]
        bonus_row = rows[bonus.node]
    else:  # light: the rows of the visited nodes only
        rows = verify_rows(path)
        slot = torch.full((n,), -1, dtype=torch.int64)
        slot[torch.tensor(path)] = torch.arange(len(path))
        read = has_parent & (slot[parents.clamp(min=0)] >= 0)
        child[:] = float("nan")
        child[0] = 0.0
        child[read] = rows[slot[parents[read]], tokens[read]]
        bonus_row = rows[path.index(bonus.node)] if bonus.node in path else verify_rows([bonus.node])[0]
    prefix = bonus_row[: bonus.token + 1].clone() if bonus.token >= 0 else torch.zeros(0)
    empty = torch.zeros(0, 0)
    trace = Step.from_fields(
        **base,
        draft_token_ids=(cpu(draft_token_ids).long().clone() if draft_token_ids is not None
                         else torch.zeros(0, 0, dtype=torch.int64)),
        draft_logprobs=cpu(draft_logprobs).float().clone() if draft_logprobs is not None else empty,
        node_token_ids=tokens.clone(), parents=parents.clone(), depths=cpu(depths).long().clone(),
        ranks=cpu(ranks).long().clone() if ranks is not None else torch.full((n,), -1, dtype=torch.int64),
        node_logws=cpu(node_logws).float().clone() if node_logws is not None else torch.full((n,), float("nan")),
        retrieve_index=torch.arange(n), retrieve_next_token=cpu(retrieve_next_token).long().clone(),
        retrieve_next_sibling=cpu(retrieve_next_sibling).long().clone(), positions=cpu(positions).long().clone(),
        coins=cpu(coins).float().clone(), final_coin=None if final_coin is None else float(final_coin),
        child_probs=child, final_row_prefix=prefix.float(), final_mass=float(bonus.residual_mass),
        rows_kind="full" if level == "full" else "read")
    if level == "full":
        display = torch.softmax(logits.float(), -1) if (params.is_greedy and logits is not None) else rows
        top = display.topk(min(top_m, display.shape[-1]), -1)
        trace.top_token_ids, trace.top_probs = top.indices.clone(), top.values.float().clone()
        if logits is not None:
            trace.row_logit_ids, trace.row_logits = _top_logits(logits.float(), top_m_logits)
            trace.row_logsumexp = torch.logsumexp(logits.double(), -1)
            node = torch.full((n,), float("nan"))
            node[1:] = logits[parents[1:], tokens[1:]].float()
            trace.node_logits = node
    return trace


def row_records(parents: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor, display: torch.Tensor,
                bonus: BonusDraw, top_m: int) -> dict[str, torch.Tensor]:
    """Version-1 target-row fields (``child_probs``, ``top_token_ids``, ``top_probs``,
    ``final_row_prefix``) of one request; kept for callers not yet on :func:`make_step_trace`.

    Args:
        parents, tokens: ``[n]`` int64; rows: ``[n, V]`` float32 verify rows; display:
            ``[n, V]`` display rows; bonus: the :class:`BonusDraw`; top_m: display tokens per row.
    """
    n = tokens.shape[0]
    child = torch.zeros(n)
    if n > 1:
        child[1:] = rows[parents[1:], tokens[1:]]
    top = display.topk(min(top_m, display.shape[-1]), -1)
    prefix = rows[bonus.node, : bonus.token + 1].clone() if bonus.token >= 0 else torch.zeros(0)
    return {"child_probs": child, "top_token_ids": top.indices.clone(), "top_probs": top.values.float().clone(),
            "final_row_prefix": prefix}
