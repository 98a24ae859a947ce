"""Step traces: everything one DDTree step did for one request, and the trace file format.

A :class:`StepTrace` holds the drafter's top-k, the tree, the verify buffers, the sampling
parameters, the coins, the target rows the verifier read, the verify output with its
decision log, and stage timings. A :class:`RunTrace` is a list of them plus run metadata.
:func:`make_step_trace` is the one constructor (live sessions and SGLang recordings);
:func:`compare_outputs` the one comparator of a recorded and a replayed output.

**Recording levels** (``StepTrace.level``): ``"full"`` stores everything below;
``"light"`` stores the tree, buffers, coins, outputs, decisions and the rows the verifier
read (``child_probs`` of the children of the visited nodes, the bonus row prefix), no top-M
rows; ``"off"`` stores the outputs only. A field a level does not store is ``None``
(:meth:`StepTrace.missing` lists them); in ``light`` steps, ``child_probs`` of nodes whose
parent the walk never visited are NaN ("not read").

**What is stored exactly and what is bounded** (a target row is ``V`` floats, 196 kB for
SmolLM2, so rows are cut):

* exact: tree, buffers, draft top-k, coins, parameters, outputs, decisions;
* exact: ``child_probs[i] = p_parent(i)(token_i)``, the target probability (under the
  request's parameters; greedy: the one-hot verify row) of every node's token in its
  parent's row -- all a verifier reads while walking the tree, whatever the coins;
* exact: the bonus row *up to the drawn token* (``final_row_prefix``) and the residual mass
  (float64) -- all the inverse-CDF draw reads for the recorded coin (see
  :func:`ddtree_lab.verify.residual_draw`);
* exact (format v2, level ``full``): per node row, the top ``M`` *raw* target logits
  (before temperature) ``row_logits [n, M]`` float32 with their ids ``row_logit_ids
  [n, M]`` int64, sorted by descending logit, ties by ascending token id (the set is the
  first ``M`` in that order); ``node_logits [n]`` float32, the raw logit of node ``i``'s
  token in its parent's row (root NaN; children may lie outside the top ``M``);
  ``row_logsumexp [n]`` float64, ``log sum_v exp(logit_v)`` over the full row at
  temperature 1. Run metadata holds ``vocab_size`` (``V``) and ``top_m_logits`` (``M``).
* bounded: every token outside a row's top ``M`` has a raw logit ``<= row_logits[i, M-1]``;
  there are ``V - M`` of them, and their total temperature-1 mass is
  ``1 - sum_j exp(row_logits[i, j] - row_logsumexp[i])``. Anything that depends only on the
  top ``M`` (every top-k <= M at any temperature) is exact; anything else is bounded by
  these two facts (the tuner derives its error bounds from them).
* truncated, for display: each node's row as its top ``m`` tokens (``top_token_ids``,
  ``top_probs``; greedy requests: the softmax of the raw logits), ``m = 16`` by default.
  :meth:`StepTrace.truncation_bound` returns the mass outside them.

With these, :func:`replay` re-runs the reference verifier on a stored step and checks it
reproduces the recorded output bit for bit.

**File format** (``.ddtrace.safetensors``, version 2): one safetensors file. Tensors are
named ``"{k}.{field}"`` for step ``k``; the safetensors metadata key ``"ddtree_lab"`` holds
one JSON document: ``format``, ``version``, run ``metadata``, token texts, each step's
scalars, parameters, decision log and ``thresholds`` (``[threshold_single, threshold_acc]``
with its ``lossy`` flag; files without them read as ``[1, 1]``, not lossy), and ``tensors``: for every tensor its dtype, shape and
SHA-256 of its bytes. The key ``"ddtree_lab_sha256"`` holds the SHA-256 of the JSON document.
Loading checks both, and every tensor's dtype and shape against the document and the tree,
before anything uses a value; a corrupted file is refused with one line naming file, step
and field. Version 1 files (no checksums; timing key ``retrieve``, read as ``compile``)
still load. Loading reads tensors and JSON only: no code from the file is ever executed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from .container import TraceFormatError, read_container, write_container
from .buffers import DDTreeVerifyInput, tree_attention_mask
from .sampling import SamplingParams
from .verify import BonusDraw, Decision, VerifyOutput, is_lossy, verify_sampled

__all__ = ["StepTrace", "RunTrace", "Difference", "make_step_trace", "compare_outputs", "row_records",
           "save_trace", "load_trace", "replay", "replay_differences", "ReplayMismatch", "TraceFormatError",
           "LEVELS", "STAGES", "TOP_M_LOGITS"]

FORMAT = "ddtree-lab-trace"
VERSION = 2
LEVELS = ("full", "light", "off")
STAGES = ("draft", "build", "compile", "target", "verify", "record", "commit")
TOP_M_LOGITS = 64  # M: raw logits kept per row at level "full"
TOP_M_DISPLAY = 16  # m: display probabilities kept per row at level "full"

# Tensor fields of a StepTrace: name -> dtype. Output tensors (accept_index, emitted_tokens)
# live in StepTrace.output and are stored under these names too.
_TENSOR_FIELDS = {
    "draft_token_ids": torch.int64,
    "draft_logprobs": torch.float32,
    "node_token_ids": torch.int64,
    "parents": torch.int64,
    "depths": torch.int64,
    "ranks": torch.int64,
    "node_logws": torch.float32,
    "retrieve_index": torch.int64,
    "retrieve_next_token": torch.int64,
    "retrieve_next_sibling": torch.int64,
    "positions": torch.int64,
    "coins": torch.float32,
    "child_probs": torch.float32,
    "top_token_ids": torch.int64,
    "top_probs": torch.float32,
    "final_row_prefix": torch.float32,
    "row_logit_ids": torch.int64,
    "row_logits": torch.float32,
    "row_logsumexp": torch.float64,
    "node_logits": torch.float32,
    "accept_index": torch.int64,
    "emitted_tokens": torch.int64,
}
_OUTPUT_FIELDS = ("accept_index", "emitted_tokens")
_V1_FIELDS = [k for k in _TENSOR_FIELDS if k not in ("row_logit_ids", "row_logits", "row_logsumexp", "node_logits")]
_NODE_FIELDS = ("node_token_ids", "parents", "depths", "ranks", "node_logws", "retrieve_index", "retrieve_next_token",
                "retrieve_next_sibling", "positions", "coins", "child_probs", "row_logsumexp", "node_logits")
# what each level must store (besides the outputs); "full" may lack the logit rows when the
# source has none (an SGLang recording holds probabilities only)
_REQUIRED = {
    "off": (),
    "light": ("node_token_ids", "parents", "depths", "ranks", "node_logws", "retrieve_index", "retrieve_next_token",
              "retrieve_next_sibling", "positions", "coins", "child_probs", "final_row_prefix", "draft_token_ids",
              "draft_logprobs"),
}
_REQUIRED["full"] = _REQUIRED["light"] + ("top_token_ids", "top_probs")


class ReplayMismatch(AssertionError):
    """Replaying a step gave a different output than the one recorded (``.differences``)."""

    def __init__(self, message: str, differences: Sequence["Difference"] = ()):
        super().__init__(message)
        self.differences = list(differences)


def normalize_timings(timings: dict | None) -> dict:
    """Stage timings in seconds under the one set of names :data:`STAGES`; the version-1 key
    ``retrieve`` is read as ``compile``. Unknown keys are kept as they are."""
    out = {}
    for k, v in (timings or {}).items():
        out["compile" if k == "retrieve" else str(k)] = float(v)
    return out


@dataclass
class StepTrace:
    """One step of one request. Tensors are per request (``n`` = its number of tree nodes).

    A field the step's recording ``level`` does not store is ``None`` (module docstring).

    Attributes:
        step, request: decoding step number in the run (0-based) and request index in the batch.
        request_id: a user-facing id (e.g. an engine's request id), or ``str(request)``.
        prefix_len: tokens in the target KV cache before the root.
        params: the request's :class:`SamplingParams`.
        output: the recorded :class:`VerifyOutput` of this request (batch of one).
        draft_token_ids, draft_logprobs: ``[L-1, K]`` the drafter's top-k.
        node_token_ids, parents, depths, ranks: ``[n]`` int64; node_logws: ``[n]`` float32.
        retrieve_index, retrieve_next_token, retrieve_next_sibling, positions: ``[n]`` int64
            (as the verifier read them, request-local: ``retrieve_index[i] == i``).
        coins: ``[n]`` float32; final_coin: the bonus coin (a float32 value).
        child_probs: ``[n]`` float32, ``p_parent(token_i)`` (root 0; ``light``: NaN where
            the parent was not visited).
        top_token_ids, top_probs: ``[n, m]`` display rows (module docstring).
        final_row_prefix: ``[t + 1]`` float32, the bonus row up to the drawn token ``t``
            (empty when the support was exhausted).
        final_mass: float64, residual mass of the bonus draw.
        row_logit_ids, row_logits: ``[n, M]`` int64 / float32, each row's top-M raw logits.
        row_logsumexp: ``[n]`` float64, log-sum-exp of each full raw row.
        node_logits: ``[n]`` float32, raw logit of node ``i``'s token in its parent's row.
        timings: seconds per stage (:data:`STAGES`).
        backend: which verifier ran.
        extra: JSON-able facts from the source (e.g. an SGLang recording: kernel, rank, call,
            SGLang's own output and any difference from the lab's verifier).
        level: ``"full"``, ``"light"`` or ``"off"``.
    """

    step: int
    request: int
    request_id: str
    prefix_len: int
    params: SamplingParams
    output: VerifyOutput
    draft_token_ids: torch.Tensor | None = None
    draft_logprobs: torch.Tensor | None = None
    node_token_ids: torch.Tensor | None = None
    parents: torch.Tensor | None = None
    depths: torch.Tensor | None = None
    ranks: torch.Tensor | None = None
    node_logws: torch.Tensor | None = None
    retrieve_index: torch.Tensor | None = None
    retrieve_next_token: torch.Tensor | None = None
    retrieve_next_sibling: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    coins: torch.Tensor | None = None
    final_coin: float | None = None
    child_probs: torch.Tensor | None = None
    top_token_ids: torch.Tensor | None = None
    top_probs: torch.Tensor | None = None
    final_row_prefix: torch.Tensor | None = None
    final_mass: float | None = None
    row_logit_ids: torch.Tensor | None = None
    row_logits: torch.Tensor | None = None
    row_logsumexp: torch.Tensor | None = None
    node_logits: torch.Tensor | None = None
    timings: dict = field(default_factory=dict)
    backend: str = "reference"
    extra: dict = field(default_factory=dict)
    level: str = "full"
    stored_num_nodes: int | None = None  # n of an "off" step (it stores no node tensors)

    @property
    def num_nodes(self) -> int:
        if self.node_token_ids is not None:
            return int(self.node_token_ids.shape[0])
        if self.stored_num_nodes is None:
            raise ValueError(f"step {self.step}, request {self.request}: the number of tree nodes was not recorded")
        return int(self.stored_num_nodes)

    @property
    def anchor_token_id(self) -> int:
        if self.node_token_ids is None:
            raise ValueError(f"step {self.step}, request {self.request}: recorded at level {self.level!r}: no tree")
        return int(self.node_token_ids[0])

    @property
    def accept_length(self) -> int:
        return int(self.output.accept_length[0])

    @property
    def thresholds(self) -> tuple[float, float]:
        """``(threshold_single, threshold_acc)`` the verifier ran with (``(1, 1)``: exact)."""
        return self.output.thresholds

    @property
    def lossy(self) -> bool:
        """Whether the thresholds broke exactness (:func:`ddtree_lab.verify.is_lossy`)."""
        return self.output.lossy

    @property
    def accepted_path(self) -> list[int]:
        return [i for i in self.output.accept_index[0].tolist() if i >= 0]

    @property
    def emitted(self) -> list[int]:
        return [t for t in self.output.emitted_tokens[0].tolist() if t >= 0]

    @property
    def bonus_token(self) -> int:
        return int(self.output.bonus_token[0])

    @property
    def decisions(self) -> list[Decision]:
        return self.output.decisions[0] if self.output.decisions else []

    @property
    def bonus(self) -> BonusDraw | None:
        return self.output.bonus[0] if self.output.bonus else None

    def missing(self) -> list[str]:
        """Tensor fields this step does not store (its level, or a source without them)."""
        return [name for name in _TENSOR_FIELDS if name not in _OUTPUT_FIELDS and getattr(self, name) is None]

    def token_ids(self) -> set[int]:
        """Every token id this step mentions (tree, draft top-k, display rows, outputs)."""
        seen = set(self.emitted) | {self.bonus_token}
        for name in ("node_token_ids", "draft_token_ids", "top_token_ids"):
            t = getattr(self, name)
            if t is not None:
                seen.update(t.flatten().tolist())
        seen.discard(-1)
        return seen

    def truncation_bound(self) -> torch.Tensor:
        """``[n]``: probability mass outside the stored display top-m of each row (an upper
        bound on the error of any probability read from the truncated rows).

        Raises:
            ValueError: the step stores no display rows (level ``light`` / ``off``).
        """
        if self.top_probs is None:
            raise ValueError(f"step {self.step}, request {self.request}: recorded at level {self.level!r}: "
                             "no display rows (top_probs)")
        return (1.0 - self.top_probs.double().sum(-1)).clamp(min=0.0)

    def verify_input(self) -> DDTreeVerifyInput:
        """The recorded buffers as a batch of one (mask recomputed from the parents)."""
        if self.retrieve_next_token is None or self.parents is None:
            raise ValueError(f"step {self.step}, request {self.request}: recorded at level {self.level!r}: "
                             "no verify buffers")
        n = self.num_nodes
        num = torch.tensor([n])
        return DDTreeVerifyInput(
            node_token_ids=self.node_token_ids[None], retrieve_index=self.retrieve_index[None],
            retrieve_next_token=self.retrieve_next_token[None], retrieve_next_sibling=self.retrieve_next_sibling[None],
            tree_mask=tree_attention_mask(self.parents[None], num), positions=self.positions[None],
            depths=self.depths[None], num_nodes=num)


@dataclass
class RunTrace:
    """A recorded run: metadata, steps, and the texts of the tokens they mention.

    ``metadata`` gains ``vocab_size`` (from the target's metadata) and ``top_m_logits`` (M of
    the stored logit rows; None when no step stores them) when they are missing.
    """

    metadata: dict
    steps: list[StepTrace]
    token_texts: dict[int, str] = field(default_factory=dict)

    def __post_init__(self):
        if self.metadata.get("vocab_size") is None:
            target = self.metadata.get("target")
            if isinstance(target, dict) and target.get("vocab_size") is not None:
                self.metadata["vocab_size"] = int(target["vocab_size"])
        if self.metadata.get("top_m_logits") is None:
            rows = next((s.row_logits for s in self.steps if s.row_logits is not None), None)
            self.metadata["top_m_logits"] = None if rows is None else int(rows.shape[-1])

    @property
    def vocab_size(self) -> int | None:
        v = self.metadata.get("vocab_size")
        return None if v is None else int(v)

    def for_request(self, request: int) -> list[StepTrace]:
        return [s for s in self.steps if s.request == request]

    def find_step(self, step: int, request: int) -> StepTrace:
        """The record of decoding step ``step`` of request ``request``.

        Raises:
            KeyError: no such record (the message lists the steps the request has).
        """
        for s in self.steps:
            if s.step == step and s.request == request:
                return s
        have = sorted({s.step for s in self.steps if s.request == request})
        if not have:
            raise KeyError(f"request {request}: not in this trace (requests: {sorted({s.request for s in self.steps})})")
        raise KeyError(f"request {request} has no step {step} (its steps: {have[0]}..{have[-1]})")

    def generated_tokens(self, request: int) -> list[int]:
        """The request's generated ids: the prefill's first token, then each step's emitted
        tokens (cut at EOS or the token limit)."""
        return list(self.metadata["requests"][request]["generated_token_ids"])

    def text(self, token_id: int) -> str:
        return self.token_texts.get(int(token_id), f"<{int(token_id)}>")


# -- the one constructor ----------------------------------------------------------------------


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
) -> StepTrace:
    """The one :class:`StepTrace` constructor (live sessions and SGLang recordings).

    Args:
        step, request, request_id, prefix_len, params: as in :class:`StepTrace`
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
        the :class:`StepTrace`; fields its level does not store are None.

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
        return StepTrace(**base)
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

    from .sampling import target_probs

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
    trace = StepTrace(
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
        child_probs=child, final_row_prefix=prefix.float(), final_mass=float(bonus.residual_mass))
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


# -- the one output comparator ------------------------------------------------------------------


@dataclass(frozen=True)
class Difference:
    """One field where a replayed (or other) output differs from the recorded one.

    ``request`` is the row in the batch; ``field`` names the output field (``accept_index``,
    ``emitted_tokens``, ``bonus_token``, ...), ``decision k <field>`` for the ``k``-th decision
    of the log (``node``, ``token``, ``target_prob``, ...), or ``bonus <field>`` for the bonus
    draw; ``node`` is the tree node concerned where there is one.
    """

    request: int
    field: str
    recorded: object
    replayed: object
    decision: int | None = None
    node: int | None = None

    def __str__(self) -> str:
        at = f" (node {self.node})" if self.node is not None else ""
        return f"request {self.request}: {self.field}{at}: recorded {self.recorded!r} != replayed {self.replayed!r}"


def _within(a, b, tolerance) -> bool:
    if a is None or b is None or tolerance is None:
        return a == b
    atol, rtol = tolerance
    return abs(float(a) - float(b)) <= atol + rtol * abs(float(a))


def compare_outputs(recorded: VerifyOutput, replayed: VerifyOutput, tolerance: tuple[float, float] | None = None,
                    decisions: bool = True) -> list[Difference]:
    """Every difference between two verify outputs, decision by decision, then the bonus draw,
    then the output tensors, per request.

    Args:
        recorded, replayed: :class:`VerifyOutput` of the same batch size.
        tolerance: ``None``: every field bit for bit. ``(atol, rtol)``: probabilities
            (``target_prob``, ``cumulative_mass``, the bonus's ``residual_mass`` and
            ``token_prob``) agree when ``|a - b| <= atol + rtol |a|`` (Triton steps:
            :data:`ddtree_lab.verify.PROB_ATOL` / ``PROB_RTOL``); indices, tokens,
            coins and verdicts stay exact.
        decisions: compare the decision logs and bonus draws (False for an output that has
            none, e.g. one read back from an engine's kernel).

    Returns:
        the :class:`Difference` list, empty when they agree. Paths and emitted tokens are
        compared without their ``-1`` padding.
    """
    bs = int(recorded.accept_length.shape[0])
    if int(replayed.accept_length.shape[0]) != bs:
        return [Difference(-1, "batch size", bs, int(replayed.accept_length.shape[0]))]
    out: list[Difference] = []
    for b in range(bs):
        if decisions:
            got = replayed.decisions[b] if b < len(replayed.decisions) else []
            want = recorded.decisions[b] if b < len(recorded.decisions) else []
            for k in range(max(len(got), len(want))):
                w = want[k] if k < len(want) else None
                g = got[k] if k < len(got) else None
                if w is None or g is None:
                    out.append(Difference(b, f"decision {k}", None if w is None else (w.node, w.token, w.verdict),
                                          None if g is None else (g.node, g.token, g.verdict), k,
                                          (w or g).node))
                    continue
                for name in ("parent", "node", "token", "target_prob", "cumulative_mass", "coin", "verdict"):
                    a, c = getattr(w, name), getattr(g, name)
                    close = (_within(a, c, tolerance) if name in ("target_prob", "cumulative_mass")
                             else a == c or (isinstance(a, float) and isinstance(c, float) and math.isnan(a) and math.isnan(c)))
                    if not close:
                        out.append(Difference(b, f"decision {k} {name}", a, c, k, w.node))
            wb = recorded.bonus[b] if b < len(recorded.bonus) else None
            gb = replayed.bonus[b] if b < len(replayed.bonus) else None
            if (wb is None) != (gb is None):
                out.append(Difference(b, "bonus draw", wb, gb))
            elif wb is not None:
                for name in ("node", "token", "residual_mass", "coin", "token_prob"):
                    a, c = getattr(wb, name), getattr(gb, name)
                    close = _within(a, c, tolerance) if name in ("residual_mass", "token_prob") else a == c
                    if not close:
                        out.append(Difference(b, f"bonus {name}", a, c, node=wb.node))
        fields_ = {
            "accept_index": ([v for v in recorded.accept_index[b].tolist() if v >= 0],
                             [v for v in replayed.accept_index[b].tolist() if v >= 0]),
            "accept_length": (int(recorded.accept_length[b]), int(replayed.accept_length[b])),
            "emitted_tokens": ([v for v in recorded.emitted_tokens[b].tolist() if v >= 0],
                               [v for v in replayed.emitted_tokens[b].tolist() if v >= 0]),
            "bonus_token": (int(recorded.bonus_token[b]), int(replayed.bonus_token[b])),
            "support_exhausted": (bool(recorded.support_exhausted[b]), bool(replayed.support_exhausted[b])),
        }
        for name, (a, c) in fields_.items():
            if a != c:
                out.append(Difference(b, name, a, c))
    return out


# -- save / load ----------------------------------------------------------------------------


def _step_json(s: StepTrace) -> dict:
    bonus = s.bonus
    return {
        "step": s.step, "request": s.request, "request_id": s.request_id, "prefix_len": s.prefix_len,
        "level": s.level, "num_nodes": s.num_nodes if (s.node_token_ids is not None or s.stored_num_nodes is not None)
        else None,
        "params": s.params.to_dict(), "final_coin": s.final_coin, "final_mass": s.final_mass,
        "accept_length": s.accept_length, "bonus_token": s.bonus_token,
        "support_exhausted": bool(s.output.support_exhausted[0]),
        "decisions": [[d.depth, d.parent, d.node, d.token, d.target_prob, d.cumulative_mass, d.coin, d.verdict]
                      for d in s.decisions],
        "bonus": None if bonus is None else bonus.to_dict(), "timings": s.timings, "backend": s.backend,
        "extra": s.extra, "thresholds": [float(t) for t in s.output.thresholds], "lossy": bool(s.output.lossy),
    }


def step_tensors(s: StepTrace, prefix: str) -> dict[str, torch.Tensor]:
    """The stored tensors of a step, named ``prefix + field`` (fields that are None are left out)."""
    out = {}
    for name, dtype in _TENSOR_FIELDS.items():
        value = getattr(s.output, name)[0] if name in _OUTPUT_FIELDS else getattr(s, name)
        if value is not None:
            out[prefix + name] = value.detach().to("cpu", dtype).contiguous()
    return out


def save_trace(run: RunTrace, path: str | Path) -> Path:
    """Write ``run`` to one safetensors file, format version 2 (module docstring); returns
    the path. Never creates directories.

    Raises:
        FileNotFoundError: the directory of ``path`` does not exist.
        IsADirectoryError: ``path`` is a directory.
        OSError: the file cannot be written (the message names ``path``).
    """
    tensors = {}
    for k, s in enumerate(run.steps):
        tensors.update(step_tensors(s, f"{k}."))
    doc = {"format": FORMAT, "version": VERSION, "metadata": run.metadata,
           "token_texts": {str(k): v for k, v in run.token_texts.items()},
           "steps": [_step_json(s) for s in run.steps]}
    return write_container(path, doc, tensors)


def check_step_tensors(where: str, js: dict, t: dict[str, torch.Tensor], vocab: int | None, version: int,
                       exempt: Sequence[str] = ()) -> None:
    """Shapes, dtypes and index ranges of one step's tensors against its JSON and its tree
    (``exempt``: fields a container stores in another form, e.g. a bundle's bonus row).

    Raises:
        TraceFormatError: naming ``where`` (file and step) and the field.
    """
    level = js.get("level", "full")
    if level not in LEVELS:
        raise TraceFormatError(f"{where}: level {level!r} is not one of {LEVELS}")
    required = _V1_FIELDS if version == 1 else [*_REQUIRED[level], *_OUTPUT_FIELDS]
    for name in required:
        if name not in t and name not in exempt:
            raise TraceFormatError(f"{where}: tensor field {name!r} is missing")
    for name, value in t.items():
        if name not in _TENSOR_FIELDS:
            raise TraceFormatError(f"{where}: unknown tensor field {name!r}")
        if value.dtype != _TENSOR_FIELDS[name]:
            raise TraceFormatError(f"{where}: field {name!r} has dtype {value.dtype}, expected {_TENSOR_FIELDS[name]}")

    def bad(name: str, why: str) -> TraceFormatError:
        return TraceFormatError(f"{where}: field {name!r}: {why}")

    n = js.get("num_nodes")
    if "node_token_ids" in t:
        n = int(t["node_token_ids"].shape[0]) if t["node_token_ids"].dim() == 1 else -1
    if n is not None and (not isinstance(n, int) or n < 1):
        raise bad("node_token_ids", f"expected a 1-D tensor of at least one node, got shape "
                                    f"{tuple(t['node_token_ids'].shape) if 'node_token_ids' in t else n}")
    for name in _NODE_FIELDS:
        if name in t and tuple(t[name].shape) != (n,):
            raise bad(name, f"shape {tuple(t[name].shape)}, expected [{n}] (one per tree node)")
    for a, b in (("draft_token_ids", "draft_logprobs"), ("top_token_ids", "top_probs"), ("row_logit_ids", "row_logits")):
        if a in t and t[a].dim() != 2:
            raise bad(a, f"expected a 2-D tensor, got shape {tuple(t[a].shape)}")
        if a in t and b in t and t[b].shape != t[a].shape:
            raise bad(b, f"shape {tuple(t[b].shape)} != {a} {tuple(t[a].shape)}")
        if (a in t) != (b in t):
            raise bad(b if a in t else a, f"stored without {a if b in t else b}")
    for name in ("top_token_ids", "row_logit_ids"):
        if name in t and t[name].shape[0] != n:
            raise bad(name, f"shape {tuple(t[name].shape)}: expected {n} rows")
    for name in ("final_row_prefix", *_OUTPUT_FIELDS):
        if name in t and t[name].dim() != 1:
            raise bad(name, f"expected a 1-D tensor, got shape {tuple(t[name].shape)}")
    if "accept_index" in t and t["emitted_tokens"].shape != t["accept_index"].shape:
        raise bad("emitted_tokens", f"shape {tuple(t['emitted_tokens'].shape)} != accept_index "
                                    f"{tuple(t['accept_index'].shape)}")
    bonus = int(js["bonus_token"])
    if "final_row_prefix" in t and t["final_row_prefix"].shape[0] != (bonus + 1 if bonus >= 0 else 0):
        raise bad("final_row_prefix", f"length {t['final_row_prefix'].shape[0]}, expected bonus token + 1 = "
                                      f"{bonus + 1 if bonus >= 0 else 0}")
    limit = vocab if vocab is not None else 1 << 24  # no vocabulary has 16 M tokens
    for name in ("node_token_ids", "top_token_ids", "row_logit_ids", "draft_token_ids"):
        if name in t and t[name].numel() and (int(t[name].min()) < 0 or int(t[name].max()) >= limit):
            v = int(t[name].max()) if int(t[name].max()) >= limit else int(t[name].min())
            raise bad(name, f"token id {v} outside [0, {limit})")
    if not -1 <= bonus < limit:
        raise TraceFormatError(f"{where}: bonus_token {bonus} outside [-1, {limit})")
    for name, lo in (("parents", -1), ("retrieve_next_token", -1), ("retrieve_next_sibling", -1),
                     ("retrieve_index", 0), ("accept_index", -1)):
        if name in t and t[name].numel() and n is not None and (int(t[name].min()) < lo or int(t[name].max()) >= n):
            raise bad(name, f"node index outside [{lo}, {n})")
    if "coins" in t and t["coins"].numel() and not bool(((t["coins"] >= 0) & (t["coins"] < 1)).all()):
        raise bad("coins", "a coin outside [0, 1)")


def load_trace(path: str | Path) -> RunTrace:
    """Read a trace file written by :func:`save_trace` (version 2, or version 1). Never
    executes code from the file.

    Raises:
        FileNotFoundError: no such file.
        IsADirectoryError: ``path`` is a directory.
        TraceFormatError: not a ddtree-lab trace, an unknown version, a checksum that fails,
            or a missing / badly typed / badly shaped field (one line: file, step, field).
    """
    path = Path(path)
    doc, tensors = read_container(path, FORMAT, (1, VERSION))
    version = doc["version"]
    if not isinstance(doc.get("steps"), list) or not isinstance(doc.get("metadata", {}), dict):
        raise TraceFormatError(f"{path}: 'steps' must be a list and 'metadata' an object")
    metadata = doc.get("metadata", {})
    vocab = metadata.get("vocab_size") or (metadata.get("target") or {}).get("vocab_size")
    vocab = int(vocab) if isinstance(vocab, int) and vocab > 0 else None
    by_step: dict[int, dict] = {}
    for key, value in tensors.items():
        k, _, name = key.partition(".")
        if not k.isdigit() or not name:
            raise TraceFormatError(f"{path}: tensor {key!r} is not named 'STEP.FIELD'")
        by_step.setdefault(int(k), {})[name] = value
    if by_step and max(by_step) >= len(doc["steps"]):
        raise TraceFormatError(f"{path}: step {max(by_step)}: tensors of a step the document does not list")
    steps = []
    for k, js in enumerate(doc["steps"]):
        where = f"{path}: step {k}"
        got = by_step.get(k, {})
        try:
            SamplingParams.from_dict(js["params"])
        except (KeyError, TypeError, ValueError) as exc:
            raise TraceFormatError(f"{where}: params: {str(exc).removeprefix('SamplingParams: ')}") from exc
        try:
            check_step_tensors(where, js, got, vocab, version)
            step = step_from_json(js, got, where)
        except TraceFormatError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise TraceFormatError(f"{where}: bad field ({exc!r})") from exc
        why = step.params.problem()
        if why is not None:
            raise TraceFormatError(f"{where}: params: {why}")
        if step.step < 0 or step.request < 0:
            raise TraceFormatError(f"{where}: negative step or request number")
        steps.append(step)
    try:
        texts = {int(k): str(v) for k, v in doc.get("token_texts", {}).items()}
    except (AttributeError, TypeError, ValueError) as exc:
        raise TraceFormatError(f"{path}: token_texts must map token ids to strings ({exc})") from exc
    return RunTrace(metadata=metadata, steps=steps, token_texts=texts)


def _thresholds_of(js: dict, where: str) -> tuple[float, float]:
    """A step record's ``thresholds`` (files written before they were stored: ``(1, 1)``).

    Raises:
        TraceFormatError: not two finite numbers >= 0, or a ``lossy`` flag that disagrees.
    """
    raw = js.get("thresholds", [1.0, 1.0])
    if (not isinstance(raw, list) or len(raw) != 2
            or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in raw)
            or not all(math.isfinite(x) and x >= 0 for x in raw)):
        raise TraceFormatError(f"{where}thresholds must be [threshold_single, threshold_acc], two finite numbers >= 0, "
                               f"got {raw!r}")
    thresholds = (float(raw[0]), float(raw[1]))
    if "lossy" in js and bool(js["lossy"]) != is_lossy(*thresholds):
        raise TraceFormatError(f"{where}lossy={js['lossy']!r} disagrees with thresholds {list(thresholds)}")
    return thresholds


def step_from_json(js: dict, t: dict, where: str = "") -> StepTrace:
    """A :class:`StepTrace` from its JSON record and its (checked) tensors; ``where`` (e.g.
    ``"FILE: step 3"``) prefixes a :class:`TraceFormatError` for bad thresholds."""
    decisions = [Decision(0, int(d[0]), int(d[1]), int(d[2]), int(d[3]), float(d[4]), float(d[5]),
                          None if d[6] is None else float(d[6]), str(d[7])) for d in js["decisions"]]
    bonus = None
    if js.get("bonus") is not None:
        bonus = dict(js["bonus"])
        bonus["request"] = 0
        bonus = BonusDraw(**bonus)
    thresholds = _thresholds_of(js, f"{where}: " if where else "")
    output = VerifyOutput(
        accept_index=t["accept_index"][None], accept_length=torch.tensor([int(js["accept_length"])]),
        emitted_tokens=t["emitted_tokens"][None], bonus_token=torch.tensor([int(js["bonus_token"])]),
        support_exhausted=torch.tensor([bool(js["support_exhausted"])]), decisions=[decisions],
        bonus=[] if bonus is None else [bonus], backend=str(js.get("backend", "reference")),
        thresholds=thresholds, lossy=is_lossy(*thresholds))
    fields_ = {name: t.get(name) for name in _TENSOR_FIELDS if name not in _OUTPUT_FIELDS}
    final_coin, final_mass = js.get("final_coin"), js.get("final_mass")
    return StepTrace(step=int(js["step"]), request=int(js["request"]), request_id=str(js["request_id"]),
                     prefix_len=int(js["prefix_len"]), params=SamplingParams.from_dict(js["params"]),
                     final_coin=None if final_coin is None else float(final_coin),
                     final_mass=None if final_mass is None else float(final_mass), output=output,
                     timings=normalize_timings(js.get("timings")), backend=str(js.get("backend", "reference")),
                     extra=dict(js.get("extra") or {}), level=str(js.get("level", "full")),
                     stored_num_nodes=None if js.get("num_nodes") is None else int(js["num_nodes"]), **fields_)


# -- replay ---------------------------------------------------------------------------------


def _replay_rows(step: StepTrace, vocab: int) -> torch.Tensor:
    """A ``[1, n, V]`` row tensor holding exactly what the trace stores: each node's token
    probability in its parent's row (NaN, "not read", left 0), and the bonus row's prefix."""
    n = step.num_nodes
    rows = torch.zeros(1, n, vocab, dtype=torch.float32)
    prefix = step.final_row_prefix
    if prefix.numel():
        rows[0, step.bonus.node, : prefix.shape[0]] = prefix
    known = ~torch.isnan(step.child_probs)
    known[0] = False
    idx = known.nonzero()[:, 0]
    rows[0, step.parents[idx], step.node_token_ids[idx]] = step.child_probs[idx]
    return rows


def _tolerance(step: StepTrace):
    if not step.backend.startswith("triton"):
        return None
    from .verify import PROB_ATOL, PROB_RTOL

    return (PROB_ATOL, PROB_RTOL)


def replay_differences(step: StepTrace, vocab_size: int | None = None) -> tuple[VerifyOutput, list[Difference]]:
    """Re-run the reference verifier on a stored step: ``(replayed output, differences)``
    (:func:`compare_outputs` against the recorded output; Triton steps compare probabilities
    within the kernel's tolerance, everything else bit for bit).

    Raises:
        ValueError: the step stores no rows to replay (level ``off``), or its buffers are
            broken (naming step, request and the problem).
    """
    where = f"step {step.step}, request {step.request}"
    if step.child_probs is None or step.final_row_prefix is None or step.coins is None:
        raise ValueError(f"{where}: recorded at level {step.level!r}: no verify rows to replay")
    tops = [int(step.node_token_ids.max()), step.final_row_prefix.shape[0] - 1]
    vocab = vocab_size or max(tops) + 1
    if max(tops) >= vocab:
        raise ValueError(f"{where}: token id {max(tops)} is outside the vocabulary of {vocab}")
    from .buffers import find_retrieve_problem

    vi, rows = step.verify_input(), _replay_rows(step, vocab)
    problem = find_retrieve_problem(vi.retrieve_next_token, vi.retrieve_next_sibling, vi.num_nodes,
                                    retrieve_index=vi.retrieve_index, depths=vi.depths)
    if problem is not None:
        raise ReplayMismatch(f"{where}: recorded buffers are broken: {problem}")
    coins = step.coins[None]
    final = torch.tensor([0.0 if step.final_coin is None else step.final_coin], dtype=torch.float32)
    tol = _tolerance(step)
    mass = step.final_mass if step.final_row_prefix.numel() else None
    ts, ta = step.thresholds  # a lossy step replays under its own thresholds
    try:
        out = verify_sampled(vi, rows, coins, final, final_masses=[mass], threshold_single=ts, threshold_acc=ta)
    except ValueError:
        # a different walk ends on a row whose bonus prefix is not stored: compare the walk
        out = verify_sampled(vi, rows, coins, final, threshold_single=ts, threshold_acc=ta)
        diffs = compare_outputs(step.output, out, tol)
        if diffs:
            return out, diffs
        raise
    return out, compare_outputs(step.output, out, tol)


def replay(step: StepTrace, vocab_size: int | None = None, check: bool = True) -> VerifyOutput:
    """Re-run the reference verifier on a stored step.

    Steps recorded with the Triton backend compare indices, tokens, coins and verdicts bit for
    bit and probabilities within the kernel's stated tolerance; every other backend bit for
    bit. (Traces store probabilities, not logits, so replay runs the reference verifier.)

    Greedy requests are verified with one-hot rows, as the live session does (the rule then
    accepts exactly the argmax child). With ``check`` (default), raise
    :class:`ReplayMismatch` naming the first difference (all of them in ``.differences``).

    Raises:
        ReplayMismatch: (``check``) the replay differs, or the recorded buffers are broken.
        ValueError: the step stores nothing to replay (level ``off``).
    """
    out, diffs = replay_differences(step, vocab_size)
    if check and diffs:
        more = f" (and {len(diffs) - 1} more)" if len(diffs) > 1 else ""
        raise ReplayMismatch(f"step {step.step}, request {step.request}: {diffs[0]}{more}", diffs)
    return out
