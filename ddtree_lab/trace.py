"""Step traces: everything one DDTree step did for one request, and the trace file format.

A :class:`StepTrace` holds the drafter's top-k, the tree, the verify buffers, the sampling
parameters, the coins, the target probabilities the verifier read, the verify output with its
decision log, and stage timings. A :class:`RunTrace` is a list of them plus run metadata.

**What is stored exactly and what is truncated** (the file must stay small: a target row is
``V`` floats, 196 kB for SmolLM2):

* exact: tree, buffers, draft top-k, coins, parameters, outputs, decisions;
* exact: ``child_probs[i] = p_parent(i)(token_i)``, the target probability of every node's
  token under its parent's row -- all a verifier reads while walking the tree, whatever the
  coins;
* exact: the bonus row *up to the drawn token* (``final_row_prefix``) and the residual mass
  (float64) -- all the inverse-CDF draw reads for the recorded coin (see
  :func:`ddtree_lab.verify.residual_draw`);
* truncated: for display and what-if analyses, each node's row as its top ``M`` tokens
  (``top_token_ids``, ``top_probs``; greedy requests: the softmax of the raw logits). The
  mass outside the top ``M`` is ``1 - sum(top_probs)``: :meth:`StepTrace.truncation_bound`
  returns it, and an analysis that reads a truncated row reports it as its error bound.

With these, :func:`replay` re-runs the reference verifier on a stored step and checks it
reproduces the recorded output bit for bit.

**File format** (``.ddtrace.safetensors``): one safetensors file. Tensors are named
``"{k}.{field}"`` for step ``k``; the safetensors metadata key ``"ddtree_lab"`` holds one JSON
document: ``format``, ``version``, run ``metadata`` (models, tokenizer, dtype, device,
versions), token texts, and each step's scalars, parameters and decision log. Loading reads
tensors and JSON only: no code from the file is ever executed (no pickle).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .sampling import SamplingParams
from .verify import BonusDraw, Decision, VerifyOutput, verify_sampled
from .retrieve import DDTreeVerifyInput, tree_attention_mask

__all__ = ["StepTrace", "RunTrace", "row_records", "save_trace", "load_trace", "replay", "ReplayMismatch", "TraceFormatError"]

FORMAT = "ddtree-lab-trace"
VERSION = 1

_TENSOR_FIELDS = {
    # name: dtype
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
    "accept_index": torch.int64,
    "emitted_tokens": torch.int64,
}


class TraceFormatError(ValueError):
    """A trace file that is not a ddtree-lab trace, or one with a missing or bad field."""


class ReplayMismatch(AssertionError):
    """Replaying a step gave a different output than the one recorded."""


@dataclass
class StepTrace:
    """One step of one request. Tensors are per request (``n`` = its number of tree nodes).

    Attributes:
        step, request: step number in the run (0-based) and request index in the batch.
        request_id: a user-facing id (e.g. an engine's request id), or ``str(request)``.
        prefix_len: tokens in the target KV cache before the root.
        draft_token_ids, draft_logprobs: ``[L-1, K]`` the drafter's top-k.
        node_token_ids, parents, depths, ranks: ``[n]`` int64; node_logws: ``[n]`` float32.
        retrieve_index, retrieve_next_token, retrieve_next_sibling, positions: ``[n]`` int64
            (as the verifier read them, request-local: ``retrieve_index[i] == i``).
        params: the request's :class:`SamplingParams`.
        coins: ``[n]`` float32; final_coin: the bonus coin (a float32 value).
        child_probs: ``[n]`` float32, ``p_parent(token_i)`` (root 0).
        top_token_ids, top_probs: ``[n, M]`` (truncated rows, see module docstring).
        final_row_prefix: ``[t + 1]`` float32, the bonus row up to the drawn token ``t``
            (empty when the support was exhausted).
        final_mass: float64, residual mass of the bonus draw.
        output: the recorded :class:`VerifyOutput` of this request (batch of one).
        timings: seconds per stage (``draft``, ``build``, ``retrieve``, ``target``, ``verify``).
        backend: which verifier ran.
        extra: JSON-able facts from the source (e.g. an SGLang recording: kernel, rank, call,
            SGLang's own output and any difference from the lab's verifier).
    """

    step: int
    request: int
    request_id: str
    prefix_len: int
    draft_token_ids: torch.Tensor
    draft_logprobs: torch.Tensor
    node_token_ids: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    ranks: torch.Tensor
    node_logws: torch.Tensor
    retrieve_index: torch.Tensor
    retrieve_next_token: torch.Tensor
    retrieve_next_sibling: torch.Tensor
    positions: torch.Tensor
    params: SamplingParams
    coins: torch.Tensor
    final_coin: float
    child_probs: torch.Tensor
    top_token_ids: torch.Tensor
    top_probs: torch.Tensor
    final_row_prefix: torch.Tensor
    final_mass: float
    output: VerifyOutput
    timings: dict = field(default_factory=dict)
    backend: str = "reference"
    extra: dict = field(default_factory=dict)

    @property
    def num_nodes(self) -> int:
        return int(self.node_token_ids.shape[0])

    @property
    def anchor_token_id(self) -> int:
        return int(self.node_token_ids[0])

    @property
    def accept_length(self) -> int:
        return int(self.output.accept_length[0])

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
        return self.output.decisions[0]

    @property
    def bonus(self) -> BonusDraw:
        return self.output.bonus[0]

    def truncation_bound(self) -> torch.Tensor:
        """``[n]``: probability mass outside the stored top-M of each row (an upper bound on
        the error of any probability read from the truncated rows)."""
        return (1.0 - self.top_probs.double().sum(-1)).clamp(min=0.0)

    def verify_input(self) -> DDTreeVerifyInput:
        """The recorded buffers as a batch of one (mask recomputed from the parents)."""
        n = self.num_nodes
        num = torch.tensor([n])
        return DDTreeVerifyInput(
            node_token_ids=self.node_token_ids[None], retrieve_index=self.retrieve_index[None],
            retrieve_next_token=self.retrieve_next_token[None], retrieve_next_sibling=self.retrieve_next_sibling[None],
            tree_mask=tree_attention_mask(self.parents[None], num), positions=self.positions[None],
            depths=self.depths[None], num_nodes=num)


@dataclass
class RunTrace:
    """A recorded run: metadata, steps, and the texts of the tokens they mention."""

    metadata: dict
    steps: list[StepTrace]
    token_texts: dict[int, str] = field(default_factory=dict)

    def for_request(self, request: int) -> list[StepTrace]:
        return [s for s in self.steps if s.request == request]

    def generated_tokens(self, request: int) -> list[int]:
        """The request's generated ids: the prefill's first token, then each step's emitted
        tokens (cut at EOS or the token limit)."""
        return list(self.metadata["requests"][request]["generated_token_ids"])

    def text(self, token_id: int) -> str:
        return self.token_texts.get(int(token_id), f"<{int(token_id)}>")


def row_records(parents: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor, display: torch.Tensor,
                bonus: BonusDraw, top_m: int) -> dict[str, torch.Tensor]:
    """The target-row fields of a :class:`StepTrace` for one request (module docstring).

    Args:
        parents, tokens: ``[n]`` int64 of the request's tree.
        rows: ``[n, V]`` float32, the rows the verifier compared against.
        display: ``[n, V]`` rows shown in views (``rows`` for sampled requests; greedy: the
            softmax of the raw logits).
        bonus: the request's :class:`BonusDraw`.
        top_m: tokens kept per display row.

    Returns:
        ``child_probs``, ``top_token_ids``, ``top_probs``, ``final_row_prefix``.
    """
    n = tokens.shape[0]
    child = torch.zeros(n)
    if n > 1:
        child[1:] = rows[parents[1:], tokens[1:]]
    top = display.topk(min(top_m, display.shape[-1]), -1)
    prefix = rows[bonus.node, : bonus.token + 1].clone() if bonus.token >= 0 else torch.zeros(0)
    return {"child_probs": child, "top_token_ids": top.indices.clone(), "top_probs": top.values.float().clone(),
            "final_row_prefix": prefix}


# -- save / load ----------------------------------------------------------------------------


def _step_json(s: StepTrace) -> dict:
    return {
        "step": s.step, "request": s.request, "request_id": s.request_id, "prefix_len": s.prefix_len,
        "params": s.params.to_dict(), "final_coin": s.final_coin, "final_mass": s.final_mass,
        "accept_length": s.accept_length, "bonus_token": s.bonus_token,
        "support_exhausted": bool(s.output.support_exhausted[0]),
        "decisions": [[d.depth, d.parent, d.node, d.token, d.target_prob, d.cumulative_mass, d.coin, d.verdict]
                      for d in s.decisions],
        "bonus": s.bonus.to_dict(), "timings": s.timings, "backend": s.backend, "extra": s.extra,
    }


def save_trace(run: RunTrace, path: str | Path) -> Path:
    """Write ``run`` to one safetensors file (module docstring); returns the path."""
    from safetensors.torch import save_file

    tensors = {}
    for k, s in enumerate(run.steps):
        for name, dtype in _TENSOR_FIELDS.items():
            if name in ("accept_index", "emitted_tokens"):
                value = getattr(s.output, name)[0]
            else:
                value = getattr(s, name)
            tensors[f"{k}.{name}"] = value.detach().to("cpu", dtype).contiguous()
    doc = {"format": FORMAT, "version": VERSION, "metadata": run.metadata,
           "token_texts": {str(k): v for k, v in run.token_texts.items()},
           "steps": [_step_json(s) for s in run.steps]}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"ddtree_lab": json.dumps(doc)})
    return path


def load_trace(path: str | Path) -> RunTrace:
    """Read a trace file written by :func:`save_trace`. Never executes code from the file.

    Raises:
        TraceFormatError: not a ddtree-lab trace, an unknown version, or a missing / badly
            typed field (the message names the step and field).
    """
    from safetensors import safe_open

    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            keys = set(f.keys())
            tensors = {k: f.get_tensor(k) for k in keys}
    except Exception as exc:  # safetensors raises its own error types
        raise TraceFormatError(f"{path}: not a safetensors file ({exc})") from exc
    if "ddtree_lab" not in meta:
        raise TraceFormatError(f"{path}: no 'ddtree_lab' metadata: not a ddtree-lab trace")
    try:
        doc = json.loads(meta["ddtree_lab"])
    except json.JSONDecodeError as exc:
        raise TraceFormatError(f"{path}: trace metadata is not valid JSON ({exc})") from exc
    if doc.get("format") != FORMAT:
        raise TraceFormatError(f"{path}: format {doc.get('format')!r} is not {FORMAT!r}")
    if doc.get("version") != VERSION:
        raise TraceFormatError(f"{path}: trace version {doc.get('version')!r}; this ddtree-lab reads version {VERSION}")
    if not isinstance(doc.get("steps"), list) or not isinstance(doc.get("metadata", {}), dict):
        raise TraceFormatError(f"{path}: 'steps' must be a list and 'metadata' an object")
    steps = []
    for k, js in enumerate(doc["steps"]):
        got = {}
        for name, dtype in _TENSOR_FIELDS.items():
            key = f"{k}.{name}"
            if key not in tensors:
                raise TraceFormatError(f"{path}: step {k}: tensor field {name!r} is missing")
            if tensors[key].dtype != dtype:
                raise TraceFormatError(f"{path}: step {k}: field {name!r} has dtype {tensors[key].dtype}, expected {dtype}")
            got[name] = tensors[key]
        try:
            SamplingParams.from_dict(js["params"])
        except (KeyError, TypeError, ValueError) as exc:
            raise TraceFormatError(f"{path}: step {k}: params: {str(exc).removeprefix('SamplingParams: ')}") from exc
        try:
            step = _step_from(js, got)
        except (KeyError, TypeError, ValueError) as exc:
            raise TraceFormatError(f"{path}: step {k}: bad field ({exc!r})") from exc
        why = step.params.problem()
        if why is not None:
            raise TraceFormatError(f"{path}: step {k}: params: {why}")
        if step.step < 0 or step.request < 0:
            raise TraceFormatError(f"{path}: step {k}: negative step or request number")
        steps.append(step)
    try:
        texts = {int(k): str(v) for k, v in doc.get("token_texts", {}).items()}
    except (AttributeError, TypeError, ValueError) as exc:
        raise TraceFormatError(f"{path}: token_texts must map token ids to strings ({exc})") from exc
    return RunTrace(metadata=doc.get("metadata", {}), steps=steps, token_texts=texts)


def _step_from(js: dict, t: dict) -> StepTrace:
    request = int(js["request"])
    decisions = [Decision(0, int(d[0]), int(d[1]), int(d[2]), int(d[3]), float(d[4]), float(d[5]),
                          None if d[6] is None else float(d[6]), str(d[7])) for d in js["decisions"]]
    bonus = dict(js["bonus"])
    bonus["request"] = 0
    output = VerifyOutput(
        accept_index=t["accept_index"][None], accept_length=torch.tensor([int(js["accept_length"])]),
        emitted_tokens=t["emitted_tokens"][None], bonus_token=torch.tensor([int(js["bonus_token"])]),
        support_exhausted=torch.tensor([bool(js["support_exhausted"])]), decisions=[decisions],
        bonus=[BonusDraw(**bonus)], backend=str(js.get("backend", "reference")))
    fields_ = {name: t[name] for name in _TENSOR_FIELDS if name not in ("accept_index", "emitted_tokens")}
    return StepTrace(step=int(js["step"]), request=request, request_id=str(js["request_id"]),
                     prefix_len=int(js["prefix_len"]), params=SamplingParams.from_dict(js["params"]),
                     final_coin=float(js["final_coin"]), final_mass=float(js["final_mass"]), output=output,
                     timings=dict(js.get("timings", {})), backend=str(js.get("backend", "reference")),
                     extra=dict(js.get("extra", {})), **fields_)


# -- replay ---------------------------------------------------------------------------------


def _replay_rows(step: StepTrace, vocab: int) -> torch.Tensor:
    """A ``[1, n, V]`` row tensor holding exactly what the trace stores: each node's token
    probability in its parent's row, and the bonus row's prefix."""
    n = step.num_nodes
    rows = torch.zeros(1, n, vocab, dtype=torch.float32)
    node = step.bonus.node
    prefix = step.final_row_prefix
    rows[0, node, : prefix.shape[0]] = prefix
    for i in range(1, n):
        rows[0, int(step.parents[i]), int(step.node_token_ids[i])] = step.child_probs[i]
    return rows


def replay(step: StepTrace, vocab_size: int | None = None, check: bool = True) -> VerifyOutput:
    """Re-run the reference verifier on a stored step.

    Steps recorded with the Triton backend compare indices, tokens, coins and verdicts bit for
    bit and probabilities within the kernel's stated tolerance; every other backend bit for
    bit. (Traces store probabilities, not logits, so replay runs the reference verifier.)

    Greedy requests are verified with one-hot rows, as the live session does (the rule then
    accepts exactly the argmax child). With ``check`` (default), compare every output field
    and the decision log with the recorded ones and raise :class:`ReplayMismatch` naming the
    first difference.
    """
    vocab = vocab_size or int(max(step.node_token_ids.max(), step.final_row_prefix.shape[0] - 1,
                                  step.top_token_ids.max() if step.top_token_ids.numel() else 0)) + 1
    from .retrieve import find_retrieve_problem

    vi, rows = step.verify_input(), _replay_rows(step, vocab)
    if check:
        problem = find_retrieve_problem(vi.retrieve_next_token, vi.retrieve_next_sibling, vi.num_nodes,
                                        retrieve_index=vi.retrieve_index, depths=vi.depths)
        if problem is not None:
            raise ReplayMismatch(f"step {step.step}, request {step.request}: recorded buffers are broken: {problem}")
    coins, final = step.coins[None], torch.tensor([step.final_coin], dtype=torch.float32)
    if check:  # the walk first: a different walk ends on a row whose bonus prefix is not stored
        walk = verify_sampled(vi, rows, coins, final)
        _compare_decisions(step, walk)
    out = verify_sampled(vi, rows, coins, final,
                         final_masses=[step.final_mass if step.final_row_prefix.numel() else None])
    if check:
        rec = step.output
        for name in ("accept_index", "accept_length", "emitted_tokens", "bonus_token", "support_exhausted"):
            a, b = getattr(out, name), getattr(rec, name)
            width = min(a.shape[-1], b.shape[-1]) if a.dim() > 1 else None
            same = torch.equal(a[..., :width], b[..., :width]) if width else torch.equal(a, b)
            if not same:
                raise ReplayMismatch(f"step {step.step}, request {step.request}: {name} replayed {a.tolist()} "
                                     f"!= recorded {b.tolist()}")
        _compare_decisions(step, out)
        mass_ok = (_close(out.bonus[0].residual_mass, rec.bonus[0].residual_mass) if step.backend.startswith("triton")
                   else out.bonus[0].residual_mass == rec.bonus[0].residual_mass)
        if out.bonus[0].token != rec.bonus[0].token or not mass_ok:
            raise ReplayMismatch(f"step {step.step}, request {step.request}: bonus draw replayed {out.bonus[0]} "
                                 f"!= recorded {rec.bonus[0]}")
    return out


def _close(a: float, b: float) -> bool:
    from .verify_backends import PROB_ATOL, PROB_RTOL

    return abs(a - b) <= PROB_ATOL + PROB_RTOL * abs(b)


def _compare_decisions(step: StepTrace, out: VerifyOutput) -> None:
    got = [(d.node, d.token, d.target_prob, d.cumulative_mass, d.coin, d.verdict) for d in out.decisions[0]]
    want = [(d.node, d.token, d.target_prob, d.cumulative_mass, d.coin, d.verdict) for d in step.output.decisions[0]]
    if step.backend.startswith("triton") and len(got) == len(want):
        # Triton steps: indices, tokens, coins and verdicts exact; probabilities within the
        # kernel's stated tolerance (ddtree_lab.verify_backends.PROB_ATOL / PROB_RTOL).
        same = all(g[0:2] == w[0:2] and g[4:] == w[4:] and _close(g[2], w[2]) and _close(g[3], w[3])
                   for g, w in zip(got, want))
        if same:
            return
    if got != want:
        first = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        raise ReplayMismatch(f"step {step.step}, request {step.request}: decision {first} replayed "
                             f"{got[first] if first < len(got) else None} != recorded "
                             f"{want[first] if first < len(want) else None}")
