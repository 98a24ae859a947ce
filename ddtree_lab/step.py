"""The recorded step: one request's decoding step as the stage objects themselves, and a Run of them.

A :class:`Step` holds what each stage produced for one request, as that stage's own type:
the draft top-k (:class:`DraftTopK`), the tree (:class:`~ddtree_lab.build.DDTreeBuildResult`,
a batch of one), the verify buffers (:class:`~ddtree_lab.buffers.DDTreeVerifyInput`, a batch
of one), the sampling parameters, the coins, what was kept of the target rows
(:class:`TargetRows`), the verify output (:class:`~ddtree_lab.verify.VerifyOutput`, a batch
of one, with its decision log), timings and facts about the source. A stage the source did not
record is ``None`` and :meth:`Step.missing` says so; nothing is rebuilt from flat fields.

The per-node accessors (``step.parents``, ``step.child_probs``, ...) are views into those
objects, trimmed to the request's ``n`` nodes, for the readers that want one tensor.

**Recording levels** (``Step.level``): ``"full"`` keeps every row field below; ``"light"``
the tree, buffers, coins, outputs, decisions and the rows the verifier read; ``"off"`` the
outputs only. Sources without a level (an engine's acceptance summary, the DDTree reference's
tree traces) say what they hold through ``source`` and :meth:`Step.missing`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from dataclasses import replace as dataclasses_replace

import torch

from .buffers import DDTreeVerifyInput, tree_attention_mask
from .build import DDTreeBuildResult
from .sampling import SamplingParams
from .verify import BonusDraw, Decision, VerifyOutput

__all__ = ["Step", "Run", "DraftTopK", "TargetRows", "ROW_KINDS", "LEVELS", "STAGES", "normalize_timings"]

LEVELS = ("full", "light", "off")
STAGES = ("draft", "build", "compile", "target", "verify", "record", "commit")

#: What a :class:`TargetRows` can be: ``"full"`` (display rows and, format v2, the top-M raw
#: logits of every node row, plus what the verifier read), ``"read"`` (only what the verifier
#: read: child probabilities and the bonus row prefix), ``"bundle"`` (a bug-report bundle's
#: reduction of the bonus row: the exact draw, nothing else).
ROW_KINDS = ("full", "read", "bundle")

_ROW_FIELDS = ("child_probs", "top_token_ids", "top_probs", "final_row_prefix", "row_logit_ids", "row_logits",
               "row_logsumexp", "node_logits")
_TREE_FIELDS = ("node_token_ids", "parents", "depths", "ranks", "node_logws")
_BUFFER_FIELDS = ("retrieve_index", "retrieve_next_token", "retrieve_next_sibling", "positions")


def normalize_timings(timings: dict | None) -> dict:
    """Stage timings in seconds under the one set of names :data:`STAGES`; the version-1 key
    ``retrieve`` is read as ``compile``. Unknown keys are kept as they are."""
    out = {}
    for k, v in (timings or {}).items():
        out["compile" if k == "retrieve" else str(k)] = float(v)
    return out


@dataclass(frozen=True)
class DraftTopK:
    """The drafter's top-k for one request: ``token_ids [L-1, K]`` int64 and ``logprobs
    [L-1, K]`` float32, rows sorted by descending log-prob, normalised over the vocabulary
    (``[0, 0]`` when the source recorded none)."""

    token_ids: torch.Tensor
    logprobs: torch.Tensor


@dataclass
class TargetRows:
    """What a step kept of the target's rows at its ``n`` nodes (tensors ``[n]`` or ``[n, m]``).

    Attributes:
        kind: one of :data:`ROW_KINDS`.
        child_probs: ``[n]`` float32, ``p_parent(i)(token_i)`` under the request's parameters
            (root 0; NaN where the walk never read the parent's row).
        final_row_prefix: ``[t + 1]`` float32, the bonus row up to the drawn token ``t``.
        final_mass: float64 residual mass of the bonus draw.
        top_token_ids, top_probs: ``[n, m]`` display rows (``full`` only).
        row_logit_ids, row_logits: ``[n, M]`` the top-M raw logits (format v2, ``full``).
        row_logsumexp: ``[n]`` float64; node_logits: ``[n]`` float32 (format v2, ``full``).
    """

    kind: str
    child_probs: torch.Tensor | None = None
    final_row_prefix: torch.Tensor | None = None
    final_mass: float | None = None
    top_token_ids: torch.Tensor | None = None
    top_probs: torch.Tensor | None = None
    row_logit_ids: torch.Tensor | None = None
    row_logits: torch.Tensor | None = None
    row_logsumexp: torch.Tensor | None = None
    node_logits: torch.Tensor | None = None

    def __post_init__(self):
        if self.kind not in ROW_KINDS:
            raise ValueError(f"TargetRows.kind must be one of {ROW_KINDS}, got {self.kind!r}")

    def cannot(self, question: str) -> str | None:
        """Why these rows cannot answer ``question`` (None: they can).

        Questions: ``"replay"`` (re-run the reference verifier on the recorded coins),
        ``"display"`` (each node's top tokens), ``"reanalysis"`` (other sampling parameters,
        from the top-M raw logits), ``"full rows"`` (any backend: the whole ``[n, V]`` rows).
        """
        if question == "replay":
            return None if self.child_probs is not None and self.final_row_prefix is not None else \
                "no verify rows (child probabilities and the bonus row prefix)"
        if question == "display":
            return None if self.top_probs is not None else f"{self.kind} rows keep no display rows (top_probs)"
        if question == "reanalysis":
            return None if self.row_logits is not None else f"{self.kind} rows keep no top-M raw logits (format v2, level full)"
        if question == "full rows":
            return (f"{self.kind} rows keep only what the verifier read (each node's probability in its parent's "
                    "row and the bonus row up to the drawn token), not the whole [n, V] rows")
        raise ValueError(f"unknown question {question!r}")


@dataclass
class Step:
    """One decoding step of one request, as the stage objects (module docstring).

    Attributes:
        step, request: decoding step number in the run (0-based) and request index in the batch.
        request_id: a user-facing id (e.g. an engine's request id), or ``str(request)``.
        prefix_len: tokens in the target KV cache before the root (None: not recorded).
        params: the request's :class:`SamplingParams` (None: the source does not say).
        output: the recorded :class:`VerifyOutput` of this request (batch of one), or None.
        tree: the :class:`DDTreeBuildResult` of this request (batch of one, ``N = n``).
        buffers: the :class:`DDTreeVerifyInput` as the verifier read it (batch of one,
            request-local ``retrieve_index``).
        draft: the :class:`DraftTopK`.
        coins: ``[n]`` float32 walk coins; final_coin: the bonus coin (float32 value).
        rows: the :class:`TargetRows` kept.
        timings: seconds per stage (:data:`STAGES`).
        backend: which verifier ran. level: ``"full"``, ``"light"`` or ``"off"``.
        extra: JSON-able facts from the source (an SGLang recording: kernel, rank, call, its
            own output and any difference from the lab's verifier).
        source: where the step came from (``"lab trace"``, ``"bundle"``, ``"sglang recording"``,
            ``"ddtree reference"``, ``"engine summary"``).
        stored_num_nodes: ``n`` of a step that stores no tree (level ``off``).
        stored_accept_length: accepted draft tokens of a step that stores no output.
    """

    step: int
    request: int
    request_id: str
    prefix_len: int | None
    params: SamplingParams | None
    output: VerifyOutput | None
    tree: DDTreeBuildResult | None = None
    buffers: DDTreeVerifyInput | None = None
    draft: DraftTopK | None = None
    coins: torch.Tensor | None = None
    final_coin: float | None = None
    rows: TargetRows | None = None
    timings: dict = field(default_factory=dict)
    backend: str = "reference"
    extra: dict = field(default_factory=dict)
    level: str = "full"
    source: str = "lab trace"
    stored_num_nodes: int | None = None
    stored_accept_length: int | None = None

    @classmethod
    def from_fields(cls, *, step: int, request: int, request_id: str, prefix_len: int | None,
                    params: SamplingParams | None, output: VerifyOutput | None, **flat) -> "Step":
        """A step from per-node tensors (``[n]`` / ``[n, m]``, the names of the accessors):
        the stage objects are made once, here (readers of files and the live recorder use it).

        Raises:
            TypeError: an unknown field name.
            ValueError: per-node tensors of different lengths (naming the field).
        """
        where = f"step {step}, request {request}"
        known = set(_TREE_FIELDS) | set(_BUFFER_FIELDS) | set(_ROW_FIELDS) | {
            "draft_token_ids", "draft_logprobs", "final_mass", "rows_kind", "coins", "final_coin", "timings",
            "backend", "extra", "level", "source", "stored_num_nodes", "stored_accept_length"}
        unknown = sorted(set(flat) - known)
        if unknown:
            raise TypeError(f"{where}: unknown step fields {unknown}")
        tree = buffers = draft = rows = None
        tok = flat.get("node_token_ids")
        if tok is not None:
            n = int(tok.shape[0])
            for name in (*_TREE_FIELDS, *_BUFFER_FIELDS):
                v = flat.get(name)
                if v is not None and tuple(v.shape) != (n,):
                    raise ValueError(f"{where}: {name} has shape {tuple(v.shape)}, expected [{n}]")
            parents = flat["parents"]
            num = torch.tensor([n])
            tree = DDTreeBuildResult(node_token_ids=tok[None], parents=parents[None], depths=flat["depths"][None],
                                     ranks=flat["ranks"][None], node_logws=flat["node_logws"][None], num_nodes=num)
            if flat.get("retrieve_next_token") is not None:
                ri = flat.get("retrieve_index")
                buffers = DDTreeVerifyInput(
                    node_token_ids=tok[None], retrieve_index=(torch.arange(n) if ri is None else ri)[None],
                    retrieve_next_token=flat["retrieve_next_token"][None],
                    retrieve_next_sibling=flat["retrieve_next_sibling"][None],
                    tree_mask=tree_attention_mask(parents[None], num), positions=flat["positions"][None],
                    depths=flat["depths"][None], num_nodes=num)
        if flat.get("draft_token_ids") is not None:
            draft = DraftTopK(flat["draft_token_ids"], flat["draft_logprobs"])
        row_values = {k: flat.get(k) for k in _ROW_FIELDS}
        if any(v is not None for v in row_values.values()):
            kind = flat.get("rows_kind") or ("full" if row_values["top_probs"] is not None else "read")
            rows = TargetRows(kind=kind, final_mass=flat.get("final_mass"), **row_values)
        return cls(step=int(step), request=int(request), request_id=str(request_id),
                   prefix_len=None if prefix_len is None else int(prefix_len), params=params, output=output,
                   tree=tree, buffers=buffers, draft=draft, coins=flat.get("coins"), final_coin=flat.get("final_coin"),
                   rows=rows, timings=normalize_timings(flat.get("timings")), backend=str(flat.get("backend", "reference")),
                   extra=dict(flat.get("extra") or {}), level=str(flat.get("level", "full")),
                   source=str(flat.get("source", "lab trace")), stored_num_nodes=flat.get("stored_num_nodes"),
                   stored_accept_length=flat.get("stored_accept_length"))

    def replace(self, **changes) -> "Step":
        """A copy with ``changes`` applied: init fields (``params``, ``rows``, ``level``, ...)
        or per-node accessor names (``child_probs=``, ``top_probs=None``, ``node_token_ids=None``,
        ...), which are written into a copy of the stage object that holds them (``None`` for
        ``node_token_ids`` drops the tree and the buffers; the node count is kept)."""
        init = {k: v for k, v in changes.items() if k in {f.name for f in fields(self)}}
        new = dataclasses_replace(self, **init)
        for name, value in changes.items():
            if name in init:
                continue
            if name == "node_token_ids" and value is None:
                new.stored_num_nodes, new.tree, new.buffers = self.num_nodes, None, None
            elif name in _TREE_FIELDS:
                if value is None:
                    new.tree = None
                elif new.tree is None:
                    raise ValueError(f"Step.replace: step {self.step}, request {self.request} has no tree to set "
                                     f"{name!r} in")
                else:
                    new.tree = dataclasses_replace(new.tree, **{name: value[None]})
            elif name in _BUFFER_FIELDS:
                if value is None:
                    new.buffers = None
                elif new.buffers is None:
                    raise ValueError(f"Step.replace: step {self.step}, request {self.request} has no buffers to set "
                                     f"{name!r} in")
                else:
                    new.buffers = dataclasses_replace(new.buffers, **{name: value[None]})
            elif name in _ROW_FIELDS or name == "final_mass":
                new.rows = dataclasses_replace(new.rows) if new.rows is not None else TargetRows(kind="read")
                setattr(new.rows, name, value)
            elif name in ("draft_token_ids", "draft_logprobs"):
                d = new.draft or DraftTopK(torch.zeros(0, 0, dtype=torch.int64), torch.zeros(0, 0))
                new.draft = None if value is None else DraftTopK(
                    value if name == "draft_token_ids" else d.token_ids, value if name == "draft_logprobs" else d.logprobs)
            else:
                raise TypeError(f"Step.replace: unknown field {name!r}")
        return new

    # -- sizes and outputs ------------------------------------------------------------------

    @property
    def num_nodes(self) -> int:
        if self.tree is not None:
            return int(self.tree.num_nodes[0])
        if self.stored_num_nodes is None:
            raise ValueError(f"step {self.step}, request {self.request}: the number of tree nodes was not recorded")
        return int(self.stored_num_nodes)

    @property
    def anchor_token_id(self) -> int:
        if self.tree is None:
            raise ValueError(f"step {self.step}, request {self.request}: recorded at level {self.level!r}: no tree")
        return int(self.tree.node_token_ids[0, 0])

    @property
    def accept_length(self) -> int:
        """Accepted draft tokens (bonus excluded; τ = accept_length + 1)."""
        if self.output is None:
            if self.stored_accept_length is None:
                raise ValueError(f"step {self.step}, request {self.request}: no verify output and no accept length")
            return int(self.stored_accept_length)
        return int(self.output.accept_length[0])

    def _out(self) -> VerifyOutput:
        if self.output is None:
            raise ValueError(f"step {self.step}, request {self.request} ({self.source}): no verify output recorded")
        return self.output

    @property
    def thresholds(self) -> tuple[float, float]:
        """``(threshold_single, threshold_acc)`` the verifier ran with (``(1, 1)``: exact)."""
        return self._out().thresholds

    @property
    def lossy(self) -> bool:
        """Whether the thresholds broke exactness (:func:`ddtree_lab.verify.is_lossy`)."""
        return False if self.output is None else self.output.lossy

    @property
    def accepted_path(self) -> list[int]:
        return [i for i in self._out().accept_index[0].tolist() if i >= 0]

    @property
    def emitted(self) -> list[int]:
        return [t for t in self._out().emitted_tokens[0].tolist() if t >= 0]

    @property
    def bonus_token(self) -> int:
        return int(self._out().bonus_token[0])

    @property
    def decisions(self) -> list[Decision]:
        out = self.output
        return out.decisions[0] if out is not None and out.decisions else []

    @property
    def bonus(self) -> BonusDraw | None:
        out = self.output
        return out.bonus[0] if out is not None and out.bonus else None

    # -- what is there --------------------------------------------------------------------

    def missing(self) -> list[str]:
        """Per-node fields this step does not store (its level, or a source without them),
        in the order of the trace format."""
        names = ["draft_token_ids", "draft_logprobs", *_TREE_FIELDS, *_BUFFER_FIELDS, "coins", "child_probs",
                 "top_token_ids", "top_probs", "final_row_prefix", "row_logit_ids", "row_logits", "row_logsumexp",
                 "node_logits"]
        return [n for n in names if getattr(self, n) is None]

    def missing_stages(self) -> list[str]:
        """Stage objects this step lacks: ``draft``, ``tree``, ``buffers``, ``params``, ``coins``,
        ``rows``, ``output``."""
        return [n for n in ("draft", "tree", "buffers", "params", "coins", "rows", "output") if getattr(self, n) is None]

    def token_ids(self) -> set[int]:
        """Every token id this step mentions (tree, draft top-k, display rows, outputs)."""
        seen = set(self.emitted) | {self.bonus_token} if self.output is not None else set()
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
        """The recorded buffers (a batch of one).

        Raises:
            ValueError: the step has no buffers (its level or source).
        """
        if self.buffers is None:
            raise ValueError(f"step {self.step}, request {self.request}: recorded at level {self.level!r} "
                             f"({self.source}): no verify buffers")
        return self.buffers

    # -- per-node accessors (views into the stage objects) ------------------------------------

    def _rows_for_writing(self) -> TargetRows:
        if self.rows is None:
            self.rows = TargetRows(kind="read")
        return self.rows

    @property
    def node_token_ids(self) -> torch.Tensor | None:
        """``tree.node_token_ids`` of this request: ``[n]`` int64, token of each node (root: the anchor token);
        None without a tree."""
        return None if self.tree is None else self.tree.node_token_ids[0]

    @property
    def parents(self) -> torch.Tensor | None:
        """``tree.parents`` of this request: ``[n]`` int64, parent of each node (root -1); None without a tree."""
        return None if self.tree is None else self.tree.parents[0]

    @property
    def depths(self) -> torch.Tensor | None:
        """``tree.depths`` of this request: ``[n]`` int64, root 0; None without a tree."""
        return None if self.tree is None else self.tree.depths[0]

    @property
    def ranks(self) -> torch.Tensor | None:
        """``tree.ranks`` of this request: ``[n]`` int64, rank of the node's token at its depth (root and
        unknown: -1); None without a tree."""
        return None if self.tree is None else self.tree.ranks[0]

    @property
    def node_logws(self) -> torch.Tensor | None:
        """``tree.node_logws`` of this request: ``[n]`` float32, node log-weight: sum of draft log-probs along
        the path (NaN: not recorded); None without a tree."""
        return None if self.tree is None else self.tree.node_logws[0]

    @property
    def retrieve_index(self) -> torch.Tensor | None:
        """``buffers.retrieve_index`` of this request: ``[n]`` int64, request-local ``retrieve_index``; None
        without buffers."""
        return None if self.buffers is None else self.buffers.retrieve_index[0]

    @retrieve_index.setter
    def retrieve_index(self, value: torch.Tensor) -> None:
        self.buffers = dataclasses_replace(self.verify_input(), retrieve_index=value[None])

    @property
    def retrieve_next_token(self) -> torch.Tensor | None:
        """``buffers.retrieve_next_token`` of this request: ``[n]`` int64, first child or -1; None without buffers."""
        return None if self.buffers is None else self.buffers.retrieve_next_token[0]

    @retrieve_next_token.setter
    def retrieve_next_token(self, value: torch.Tensor) -> None:
        self.buffers = dataclasses_replace(self.verify_input(), retrieve_next_token=value[None])

    @property
    def retrieve_next_sibling(self) -> torch.Tensor | None:
        """``buffers.retrieve_next_sibling`` of this request: ``[n]`` int64, next sibling or -1; None without
        buffers."""
        return None if self.buffers is None else self.buffers.retrieve_next_sibling[0]

    @retrieve_next_sibling.setter
    def retrieve_next_sibling(self, value: torch.Tensor) -> None:
        self.buffers = dataclasses_replace(self.verify_input(), retrieve_next_sibling=value[None])

    @property
    def positions(self) -> torch.Tensor | None:
        """``buffers.positions`` of this request: ``[n]`` int64, prefix length + depth; None without buffers."""
        return None if self.buffers is None else self.buffers.positions[0]

    @positions.setter
    def positions(self, value: torch.Tensor) -> None:
        self.buffers = dataclasses_replace(self.verify_input(), positions=value[None])

    @property
    def child_probs(self) -> torch.Tensor | None:
        """``rows.child_probs``: ``[n]`` float32, ``p_parent(i)(token_i)`` (root 0; NaN where unread); None when
        not kept."""
        return None if self.rows is None else self.rows.child_probs

    @child_probs.setter
    def child_probs(self, value: torch.Tensor | None) -> None:
        self._rows_for_writing().child_probs = value

    @property
    def top_token_ids(self) -> torch.Tensor | None:
        """``rows.top_token_ids``: ``[n, m]`` int64 display tokens (level ``full``); None when not kept."""
        return None if self.rows is None else self.rows.top_token_ids

    @top_token_ids.setter
    def top_token_ids(self, value: torch.Tensor | None) -> None:
        self._rows_for_writing().top_token_ids = value

    @property
    def top_probs(self) -> torch.Tensor | None:
        """``rows.top_probs``: ``[n, m]`` float32 display probabilities (level ``full``); None when not kept."""
        return None if self.rows is None else self.rows.top_probs

    @top_probs.setter
    def top_probs(self, value: torch.Tensor | None) -> None:
        self._rows_for_writing().top_probs = value

    @property
    def final_row_prefix(self) -> torch.Tensor | None:
        """``rows.final_row_prefix``: ``[t + 1]`` float32, the bonus row up to the drawn token; None when not kept."""
        return None if self.rows is None else self.rows.final_row_prefix

    @final_row_prefix.setter
    def final_row_prefix(self, value: torch.Tensor | None) -> None:
        self._rows_for_writing().final_row_prefix = value

    @property
    def row_logit_ids(self) -> torch.Tensor | None:
        """``rows.row_logit_ids``: ``[n, M]`` int64, ids of the top-M raw logits (format v2, ``full``); None when
        not kept."""
        return None if self.rows is None else self.rows.row_logit_ids

    @row_logit_ids.setter
    def row_logit_ids(self, value: torch.Tensor | None) -> None:
        self._rows_for_writing().row_logit_ids = value

    @property
    def row_logits(self) -> torch.Tensor | None:
        """``rows.row_logits``: ``[n, M]`` float32, the top-M raw logits (format v2, ``full``); None when not kept."""
        return None if self.rows is None else self.rows.row_logits

    @row_logits.setter
    def row_logits(self, value: torch.Tensor | None) -> None:
        self._rows_for_writing().row_logits = value

    @property
    def row_logsumexp(self) -> torch.Tensor | None:
        """``rows.row_logsumexp``: ``[n]`` float64, log-sum-exp of each raw row (format v2, ``full``); None when
        not kept."""
        return None if self.rows is None else self.rows.row_logsumexp

    @row_logsumexp.setter
    def row_logsumexp(self, value: torch.Tensor | None) -> None:
        self._rows_for_writing().row_logsumexp = value

    @property
    def node_logits(self) -> torch.Tensor | None:
        """``rows.node_logits``: ``[n]`` float32, each node's raw logit in its parent's row (format v2,
        ``full``); None when not kept."""
        return None if self.rows is None else self.rows.node_logits

    @node_logits.setter
    def node_logits(self, value: torch.Tensor | None) -> None:
        self._rows_for_writing().node_logits = value

    @property
    def draft_token_ids(self) -> torch.Tensor | None:
        """``draft.token_ids``: ``[L-1, K]`` int64; None without a draft."""
        return None if self.draft is None else self.draft.token_ids

    @property
    def draft_logprobs(self) -> torch.Tensor | None:
        """``draft.logprobs``: ``[L-1, K]`` float32; None without a draft."""
        return None if self.draft is None else self.draft.logprobs

    @property
    def final_mass(self) -> float | None:
        """``rows.final_mass``: float64 residual mass of the bonus draw; None when not kept."""
        return None if self.rows is None else self.rows.final_mass


@dataclass
class Run:
    """A recorded run: metadata, steps, the texts of the tokens they mention, and the
    problems met while reading it (a damaged step is named there and left out; the others
    stay readable). ``left_out`` maps ``(step, request)`` of each record left out as damaged to
    the reader's reason, so a caller asking for that step can say why it is not there.

    ``metadata`` gains ``vocab_size`` (from the target's metadata) and ``top_m_logits`` (M of
    the stored logit rows; None when no step stores them) when they are missing.
    """

    metadata: dict
    steps: list[Step]
    token_texts: dict[int, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    left_out: dict[tuple[int, int], str] = field(default_factory=dict)

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

    @property
    def source(self) -> str:
        return str(self.metadata.get("source") or (self.steps[0].source if self.steps else "lab trace"))

    def for_request(self, request: int) -> list[Step]:
        return [s for s in self.steps if s.request == request]

    def find_step(self, step: int, request: int) -> Step:
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
