"""Record stage: a live step's stage objects (one request) -> a Step at a recording level."""

from __future__ import annotations

import warnings

import torch

from .buffers import DDTreeVerifyInput, tree_attention_mask
from .build import DDTreeBuildResult
from .sampling import SamplingParams, target_probs
from .step import LEVELS, DraftTopK, Step, TargetRows, normalize_timings
from .verify import BonusDraw, VerifyOutput

__all__ = ["record_step", "target_rows", "make_step_trace", "row_records", "TOP_M_LOGITS", "TOP_M_DISPLAY"]


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


def record_step(
    *,
    step: int,
    request: int,
    params: SamplingParams,
    tree: DDTreeBuildResult,
    buffers: DDTreeVerifyInput,
    output: VerifyOutput,
    coins: torch.Tensor,
    final_coin: float | None,
    draft: DraftTopK | None = None,
    logits: torch.Tensor | None = None,
    probs: torch.Tensor | None = None,
    level: str = "full",
    request_id: str | None = None,
    prefix_len: int = 0,
    top_m: int = TOP_M_DISPLAY,
    top_m_logits: int = TOP_M_LOGITS,
    timings: dict | None = None,
    backend: str | None = None,
    extra: dict | None = None,
    rows: TargetRows | None = None,
) -> Step:
    """The record of one request's live step, made of the stage objects themselves (live
    sessions, SGLang recordings, synthetic runs): the tree and the buffers are kept as the
    stages produced them (cut to the request's ``n`` nodes, moved to the CPU), the target
    rows are reduced to what ``level`` keeps (:class:`~ddtree_lab.step.TargetRows`).

    Args:
        step, request, request_id, prefix_len, params: as in :class:`~ddtree_lab.step.Step`
            (``request_id`` default ``str(request)``).
        tree: the request's :class:`DDTreeBuildResult`, a batch of one (``tree.request(b)``;
            padding rows past ``num_nodes`` are dropped here).
        buffers: the request's :class:`DDTreeVerifyInput` as the verifier read it, a batch of
            one with request-local ``retrieve_index`` (``buffers.request(b)``).
        output: the request's :class:`VerifyOutput` as a batch of one, with its decision log
            and :class:`BonusDraw`.
        coins: ``[N']`` float32 walk coins of the request (``N' >= n``; cut to ``n``);
            final_coin: the bonus coin.
        draft: the request's :class:`~ddtree_lab.step.DraftTopK` (None: an empty ``[0, 0]`` one).
        logits: ``[N', V]`` raw target logits of the request's rows (float32/16/bf16), or None
            (a source with probabilities only). ``full`` keeps their top-M, log-sum-exp and node
            logits.
        probs: ``[N', V]`` float32, the rows the verifier compared against
            (:func:`ddtree_lab.target_probs`: greedy rows one-hot), or None: then the rows are
            computed from ``logits`` with ``params`` (``light``: only the visited nodes' rows).
        level: ``"full"``, ``"light"`` or ``"off"`` (:data:`~ddtree_lab.step.LEVELS`).
        top_m: display tokens per row (``full``); top_m_logits: M (``full``).
        timings: seconds per stage (``retrieve`` is renamed ``compile``).
        backend: the verifier that ran (default ``output.backend``).
        rows: the level's :class:`~ddtree_lab.step.TargetRows` made already (the sync-free
            step makes level ``light``'s from the walk's own log); then ``logits`` / ``probs``
            are not needed and not read.

    Returns:
        the :class:`~ddtree_lab.step.Step`; stages its level does not keep are None
        (level ``off``: the outputs and the node count only).

    Raises:
        ValueError: unknown level, a tree / buffers / output that is not a batch of one, rows or
            coins shorter than the tree, missing verify rows, or NaN / infinite logits (the
            message names the request, the node and the field).
    """
    where = f"step {step}, request {request}"
    if level not in LEVELS:
        raise ValueError(f"{where}: level must be one of {LEVELS}, got {level!r}")
    if not isinstance(output, VerifyOutput) or tuple(output.accept_length.shape) != (1,):
        raise ValueError(f"{where}: output must be a VerifyOutput of one request")
    for name, obj in (("tree", tree), ("buffers", buffers)):
        if obj.batch_size != 1:
            raise ValueError(f"{where}: {name} must be a batch of one request, got {obj.batch_size}")
    n = int(tree.num_nodes[0])
    if int(buffers.num_nodes[0]) != n:
        raise ValueError(f"{where}: buffers.num_nodes is {int(buffers.num_nodes[0])}, tree.num_nodes is {n}")
    def record(**stages) -> Step:
        return Step(step=int(step), request=int(request),
                    request_id=str(request if request_id is None else request_id), prefix_len=int(prefix_len),
                    params=params, output=output, timings=normalize_timings(timings),
                    backend=str(output.backend if backend is None else backend), extra=dict(extra or {}), level=level,
                    **stages)

    if level == "off":
        return record(stored_num_nodes=n)
    if logits is None and probs is None and rows is None:
        raise ValueError(f"{where}: level {level!r} needs the verify rows (probs) or the raw logits")
    if not output.bonus:
        raise ValueError(f"{where}: output has no BonusDraw (the bonus row prefix cannot be recorded)")
    if coins.dim() != 1 or coins.shape[0] < n:
        raise ValueError(f"{where}: coins has shape {tuple(coins.shape)}, expected [{n}] or longer")
    for name, value in (("logits", logits), ("probs", probs)):
        if value is not None and (value.dim() != 2 or value.shape[0] < n):
            raise ValueError(f"{where}: {name} has shape {tuple(value.shape)}, expected [{n}, V]")
    tree, buffers = tree.compact(), buffers.compact()
    if draft is None:
        draft = DraftTopK(torch.zeros(0, 0, dtype=torch.int64), torch.zeros(0, 0))
    else:
        draft = DraftTopK(draft.token_ids.detach().cpu().clone(), draft.logprobs.detach().cpu().clone())
    if rows is None:
        rows = target_rows(where, tree, output, params, level, None if logits is None else logits[:n],
                           None if probs is None else probs[:n], top_m, top_m_logits)
    elif rows.child_probs is None or tuple(rows.child_probs.shape) != (n,):
        raise ValueError(f"{where}: rows.child_probs must have shape [{n}]")
    return record(tree=tree, buffers=buffers, draft=draft, coins=coins[:n].detach().cpu().clone(),
                  final_coin=None if final_coin is None else float(final_coin), rows=rows)


def target_rows(where: str, tree: DDTreeBuildResult, output: VerifyOutput, params: SamplingParams, level: str,
                logits: torch.Tensor | None, probs: torch.Tensor | None, top_m: int = TOP_M_DISPLAY,
                top_m_logits: int = TOP_M_LOGITS) -> TargetRows:
    """What recording level ``level`` (``"full"`` or ``"light"``) keeps of one request's
    target rows (:class:`~ddtree_lab.step.TargetRows`).

    Args:
        where: ``"step S, request R"`` for error messages.
        tree: the request's tree, a batch of one with exactly ``n`` rows (on the CPU).
        output: its :class:`VerifyOutput` (batch of one, with a :class:`BonusDraw`).
        params: its :class:`SamplingParams` (turns ``logits`` into verify rows).
        logits: ``[n, V]`` raw logits or None; probs: ``[n, V]`` float32 verify rows or None.

    Raises:
        ValueError: NaN / +inf / all -inf logits (naming the node).
    """
    n = int(tree.num_nodes[0])
    tokens, parents = tree.node_token_ids[0], tree.parents[0]
    if logits is not None and level == "full":  # light reads (and moves to the host) the visited rows only
        logits = logits.detach().cpu()
        bad = torch.isnan(logits).any(-1)
        if bad.any():
            raise ValueError(f"{where}: logits of node {int(bad.nonzero()[0])} have NaN")
    full_logits = _top_logits(logits.float(), top_m_logits) if (logits is not None and level == "full") else None

    def verify_rows(nodes: list[int]) -> torch.Tensor:
        index = torch.tensor(nodes, dtype=torch.int64)
        if probs is not None:
            return probs[index.to(probs.device)].detach().cpu().float()
        assert logits is not None
        rows = logits[index.to(logits.device)].detach().cpu()
        bad = torch.isnan(rows).any(-1) | torch.isneginf(rows).all(-1) | torch.isposinf(rows).any(-1)
        if bad.any():
            raise ValueError(f"{where}: logits of node {nodes[int(bad.nonzero()[0])]} have NaN, +inf or only -inf")
        return target_probs(rows[None], params)[0]

    bonus = output.bonus[0]
    path = [i for i in output.accept_index[0].tolist() if i >= 0] or [0]
    child = torch.zeros(n, dtype=torch.float32)
    if level == "full":
        rows = verify_rows(list(range(n)))
        child[1:] = rows[parents[1:], tokens[1:]]
        bonus_row = rows[bonus.node]
    else:  # light: the rows of the visited nodes only
        rows = verify_rows(path)
        slot = torch.full((n,), -1, dtype=torch.int64)
        slot[torch.tensor(path)] = torch.arange(len(path))
        read = (torch.arange(n) > 0) & (slot[parents.clamp(min=0)] >= 0)
        child[:] = float("nan")
        child[0] = 0.0
        child[read] = rows[slot[parents[read]], tokens[read]]
        bonus_row = rows[path.index(bonus.node)] if bonus.node in path else verify_rows([bonus.node])[0]
    prefix = bonus_row[: bonus.token + 1].clone() if bonus.token >= 0 else torch.zeros(0)
    kept = TargetRows(kind="full" if level == "full" else "read", child_probs=child, final_row_prefix=prefix.float(),
                      final_mass=float(bonus.residual_mass))
    if level == "full":
        display = torch.softmax(logits.float(), -1) if (params.is_greedy and logits is not None) else rows
        top = display.topk(min(top_m, display.shape[-1]), -1)
        kept.top_token_ids, kept.top_probs = top.indices.clone(), top.values.float().clone()
        if logits is not None and full_logits is not None:
            kept.row_logit_ids, kept.row_logits = full_logits
            kept.row_logsumexp = torch.logsumexp(logits.double(), -1)
            node = torch.full((n,), float("nan"))
            node[1:] = logits[parents[1:], tokens[1:]].float()
            kept.node_logits = node
    return kept


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
    """Deprecated: a :class:`~ddtree_lab.step.Step` from flat per-node tensors (``[n]``
    int64 tree and buffer fields, ``[L-1, K]`` draft top-k, ``[n]`` coins, ``[n, V]`` rows).
    The stage objects are assembled from them (depths from ``parents`` when absent, ranks -1,
    node log-weights NaN, the tree mask from ``parents``) and handed to :func:`record_step`;
    use that with the stage objects instead.

    Raises:
        ValueError: as :func:`record_step`, and a level other than ``off`` without the tree
            and buffer fields, or per-node tensors whose shapes disagree (naming the field).
    """
    warnings.warn("make_step_trace is deprecated: use ddtree_lab.record.record_step with the stage objects",
                  DeprecationWarning, stacklevel=2)
    where = f"step {step}, request {request}"
    if level not in LEVELS:
        raise ValueError(f"{where}: level must be one of {LEVELS}, got {level!r}")
    if not isinstance(output, VerifyOutput) or tuple(output.accept_length.shape) != (1,):
        raise ValueError(f"{where}: output must be a VerifyOutput of one request")
    if level == "off":
        return Step(step=int(step), request=int(request), request_id=str(request if request_id is None else request_id),
                    prefix_len=int(prefix_len), params=params, output=output, timings=normalize_timings(timings),
                    backend=str(output.backend if backend is None else backend), extra=dict(extra or {}), level=level,
                    stored_num_nodes=None if node_token_ids is None else int(node_token_ids.shape[0]))
    for name, value in (("node_token_ids", node_token_ids), ("parents", parents),
                        ("retrieve_next_token", retrieve_next_token), ("retrieve_next_sibling", retrieve_next_sibling),
                        ("positions", positions), ("coins", coins)):
        if value is None:
            raise ValueError(f"{where}: level {level!r} needs {name}")
    assert node_token_ids is not None and parents is not None and coins is not None and positions is not None
    assert retrieve_next_token is not None and retrieve_next_sibling is not None
    n = int(node_token_ids.shape[0])
    for name, value in (("parents", parents), ("retrieve_next_token", retrieve_next_token),
                        ("retrieve_next_sibling", retrieve_next_sibling), ("positions", positions), ("coins", coins)):
        if tuple(value.shape) != (n,):
            raise ValueError(f"{where}: {name} has shape {tuple(value.shape)}, expected [{n}]")
    for name, value in (("logits", logits), ("probs", probs)):
        if value is not None and (value.dim() != 2 or value.shape[0] != n):
            raise ValueError(f"{where}: {name} has shape {tuple(value.shape)}, expected [{n}, V]")
    tokens, parents = node_token_ids.detach().cpu().long(), parents.detach().cpu().long()
    if depths is None:
        depths = torch.zeros(n, dtype=torch.int64)
        for i in range(1, n):
            depths[i] = depths[int(parents[i])] + 1
    depths = depths.detach().cpu().long()
    num = torch.tensor([n])
    tree = DDTreeBuildResult(
        node_token_ids=tokens[None], parents=parents[None], depths=depths[None],
        ranks=(torch.full((n,), -1, dtype=torch.int64) if ranks is None else ranks.detach().cpu().long())[None],
        node_logws=(torch.full((n,), float("nan")) if node_logws is None else node_logws.detach().cpu().float())[None],
        num_nodes=num)
    buffers = DDTreeVerifyInput(
        node_token_ids=tokens[None], retrieve_index=torch.arange(n)[None],
        retrieve_next_token=retrieve_next_token.detach().cpu().long()[None],
        retrieve_next_sibling=retrieve_next_sibling.detach().cpu().long()[None],
        tree_mask=tree_attention_mask(parents[None], num), positions=positions.detach().cpu().long()[None],
        depths=depths[None], num_nodes=num)
    draft = None if draft_token_ids is None else DraftTopK(
        draft_token_ids.long(), draft_logprobs.float() if draft_logprobs is not None else torch.zeros(0, 0))
    return record_step(step=step, request=request, params=params, tree=tree, buffers=buffers, output=output,
                       coins=coins.float(), final_coin=final_coin, draft=draft, logits=logits, probs=probs, level=level,
                       request_id=request_id, prefix_len=prefix_len, top_m=top_m, top_m_logits=top_m_logits,
                       timings=timings, backend=backend, extra=extra)


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
