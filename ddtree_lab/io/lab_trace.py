"""The lab trace file (format v1 / v2): save and load a Run of Steps, every tensor checksummed.

A :class:`Step` holds the drafter's top-k, the tree, the verify buffers, the sampling
parameters, the coins, the target rows the verifier read, the verify output with its
decision log, and stage timings. A :class:`Run` is a list of them plus run metadata.
:func:`ddtree_lab.record.record_step` builds a live step from the stage objects (live sessions,
SGLang recordings); :func:`compare_outputs` is the one comparator of a recorded and a replayed output.

**Recording levels** (``Step.level``): ``"full"`` stores everything below;
``"light"`` stores the tree, buffers, coins, outputs, decisions and the rows the verifier
read (``child_probs`` of the children of the visited nodes, the bonus row prefix), no top-M
rows; ``"off"`` stores the outputs only. A field a level does not store is ``None``
(:meth:`Step.missing` lists them); in ``light`` steps, ``child_probs`` of nodes whose
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
  :meth:`Step.truncation_bound` returns the mass outside them.

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
from pathlib import Path
from typing import Sequence

import torch

from ..sampling import SamplingParams
from ..step import LEVELS, Run, Step, normalize_timings
from ..verify import BonusDraw, Decision, VerifyOutput, is_lossy
from ..store.container import TraceFormatError, container_format, read_container, write_container

__all__ = ["save_trace", "read_trace_file", "looks_like_trace_file", "check_step_tensors", "step_from_json", "step_tensors", "step_json",
           "TraceFormatError", "FORMAT", "VERSION", "TENSOR_FIELDS", "BUNDLE_FORMAT"]

FORMAT = "ddtree-lab-trace"
VERSION = 2
#: The format of a bug-report bundle's document (:mod:`.bundle`, one step in this module's
#: encoding): the one container document of this package that is not a lab trace.
BUNDLE_FORMAT = "ddtree-lab-bundle"

# Tensor fields of a Step: name -> dtype. Output tensors (accept_index, emitted_tokens)
# live in Step.output and are stored under these names too.
TENSOR_FIELDS = {
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
_V1_FIELDS = [k for k in TENSOR_FIELDS if k not in ("row_logit_ids", "row_logits", "row_logsumexp", "node_logits")]
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


# -- the one constructor ----------------------------------------------------------------------


# -- the one output comparator ------------------------------------------------------------------


# -- save / load ----------------------------------------------------------------------------


#: the largest tensor of a step's ``extra`` written into its JSON (as a list); larger ones (an
#: engine's whole rows) are left out and named in ``extra["left_out"]``
EXTRA_TENSOR_LIMIT = 4096


def jsonable_extra(extra: dict) -> dict:
    """``extra`` as JSON: tensors up to :data:`EXTRA_TENSOR_LIMIT` elements as (nested) lists, larger
    ones left out and their names listed in ``"left_out"``; dicts walked."""
    left: list[str] = []

    def walk(value, name: str) -> object:
        if isinstance(value, torch.Tensor):
            return value.tolist()
        if isinstance(value, dict):
            out = {}
            for k, v in value.items():
                key = f"{name}.{k}" if name else str(k)
                if isinstance(v, torch.Tensor) and v.numel() > EXTRA_TENSOR_LIMIT:
                    left.append(key)
                else:
                    out[k] = walk(v, key)
            return out
        if isinstance(value, (list, tuple)):
            return [walk(v, name) for v in value]
        return value

    out = walk(extra, "")
    assert isinstance(out, dict)  # walk keeps a dict a dict
    if left:
        out["left_out"] = sorted(set(out.get("left_out") or []) | set(left))
    return out


def step_json(s: Step) -> dict:
    bonus, params, out = s.bonus, s.params, s.output
    if params is None or out is None:
        raise ValueError(f"step {s.step}, request {s.request}: no {'sampling parameters' if params is None else 'output'}"
                         " recorded: a lab trace stores both")
    return {
        "step": s.step, "request": s.request, "request_id": s.request_id, "prefix_len": s.prefix_len,
        "level": s.level, "num_nodes": s.num_nodes if (s.node_token_ids is not None or s.stored_num_nodes is not None)
        else None,
        "params": params.to_dict(), "final_coin": s.final_coin, "final_mass": s.final_mass,
        "accept_length": s.accept_length, "bonus_token": s.bonus_token,
        "support_exhausted": bool(out.support_exhausted[0]),
        "decisions": [[d.depth, d.parent, d.node, d.token, d.target_prob, d.cumulative_mass, d.coin, d.verdict]
                      for d in s.decisions],
        "bonus": None if bonus is None else bonus.to_dict(), "timings": s.timings, "backend": s.backend,
        "extra": jsonable_extra(s.extra), "thresholds": [float(t) for t in out.thresholds], "lossy": bool(out.lossy),
    }


def step_tensors(s: Step, prefix: str) -> dict[str, torch.Tensor]:
    """The stored tensors of a step, named ``prefix + field`` (fields that are None are left out)."""
    out = {}
    for name, dtype in TENSOR_FIELDS.items():
        value = getattr(s.output, name)[0] if name in _OUTPUT_FIELDS else getattr(s, name)
        if value is not None:
            out[prefix + name] = value.detach().to("cpu", dtype).contiguous()
    return out


def save_trace(run: Run, path: str | Path) -> Path:
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
           "steps": [step_json(s) for s in run.steps]}
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
        if name not in TENSOR_FIELDS:
            raise TraceFormatError(f"{where}: unknown tensor field {name!r}")
        if value.dtype != TENSOR_FIELDS[name]:
            raise TraceFormatError(f"{where}: field {name!r} has dtype {value.dtype}, expected {TENSOR_FIELDS[name]}")

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


def looks_like_trace_file(path: str | Path) -> bool:
    """Whether ``path`` is a one-document lab trace: a safetensors file whose ``"ddtree_lab"``
    document is not a bundle's (reads the header only; a damaged document counts, so that
    :func:`read_trace_file` names the problem). Source ``"lab trace"`` of
    :func:`ddtree_lab.io.load`."""
    fmt = container_format(path)
    return fmt is not None and fmt != BUNDLE_FORMAT


def read_trace_file(path: str | Path, keep_going: bool = False) -> Run:
    """Read a one-document trace file written by :func:`save_trace` (version 2, or version 1).
    Never executes code from the file. :func:`ddtree_lab.io.load_trace` (the public one) reads
    either layout and calls this for this one.

    ``keep_going``: a step whose tensors or record are damaged is left out and named in
    ``Run.problems`` (one line each: file, step, field) instead of refusing the file; the
    undamaged steps load as usual. The JSON document itself must be intact. An append-only
    file (``LiveSession(record_to=...)``, ``ddtree-lab record``) is read by
    :func:`~ddtree_lab.io.append_trace.load_append_trace`: a cut tail is named in
    ``Run.problems`` whatever ``keep_going`` says.

    Raises:
        FileNotFoundError: no such file.
        IsADirectoryError: ``path`` is a directory.
        TraceFormatError: not a ddtree-lab trace, an unknown version, a checksum that fails,
            or a missing / badly typed / badly shaped field (one line: file, step, field).
    """
    path = Path(path)
    damaged: dict | None = {} if keep_going else None
    doc, tensors = read_container(path, FORMAT, (1, VERSION), damaged=damaged)
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
    bad_steps: dict[int, str] = {}
    for key, message in (damaged or {}).items():
        k = key.partition(".")[0]
        if k.isdigit():
            bad_steps.setdefault(int(k), message)
    steps, problems, left_out = [], [], {}
    for k, js in enumerate(doc["steps"]):
        named = (f"record {k} = step {js.get('step')}, request {js.get('request')}" if isinstance(js, dict)
                 else f"record {k}")
        key = ((js["step"], js["request"]) if isinstance(js, dict) and isinstance(js.get("step"), int)
               and isinstance(js.get("request"), int) else None)
        if k in bad_steps:
            problems.append(f"{bad_steps[k]} ({named} left out)")
            if key is not None:
                left_out[key] = bad_steps[k]
            continue
        try:
            steps.append(_read_step(path, k, js, by_step.get(k, {}), vocab, version))
        except TraceFormatError as exc:
            if not keep_going:
                raise
            problems.append(f"{exc} ({named} left out)")
            if key is not None:
                left_out[key] = str(exc)
    try:
        texts = {int(k): str(v) for k, v in doc.get("token_texts", {}).items()}
    except (AttributeError, TypeError, ValueError) as exc:
        raise TraceFormatError(f"{path}: token_texts must map token ids to strings ({exc})") from exc
    return Run(metadata=metadata, steps=steps, token_texts=texts, problems=problems, left_out=left_out)


def _read_step(path: Path, k: int, js: dict, got: dict, vocab: int | None, version: int) -> Step:
    where = f"{path}: step {k}"
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
    assert step.params is not None  # step_from_json always sets it (checked above)
    why = step.params.problem()
    if why is not None:
        raise TraceFormatError(f"{where}: params: {why}")
    if step.step < 0 or step.request < 0:
        raise TraceFormatError(f"{where}: negative step or request number")
    return step


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


def step_from_json(js: dict, t: dict, where: str = "") -> Step:
    """A :class:`Step` from its JSON record and its (checked) tensors; ``where`` (e.g.
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
    fields_ = {name: t.get(name) for name in TENSOR_FIELDS if name not in _OUTPUT_FIELDS}
    final_coin, final_mass = js.get("final_coin"), js.get("final_mass")
    level = str(js.get("level", "full"))
    return Step.from_fields(step=int(js["step"]), request=int(js["request"]), request_id=str(js["request_id"]),
                     prefix_len=int(js["prefix_len"]), params=SamplingParams.from_dict(js["params"]),
                     final_coin=None if final_coin is None else float(final_coin),
                     final_mass=None if final_mass is None else float(final_mass), output=output,
                     timings=normalize_timings(js.get("timings")), backend=str(js.get("backend", "reference")),
                     extra=dict(js.get("extra") or {}), level=level, rows_kind="full" if level == "full" else "read",
                     stored_num_nodes=None if js.get("num_nodes") is None else int(js["num_nodes"]), **fields_)


# -- replay ---------------------------------------------------------------------------------


