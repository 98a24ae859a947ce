"""Read the DDTree reference implementation's tree traces into per-round records (no pickle).

The source: Ringel & Romano's reference code (GitHub ``liranringel/ddtree``). Its
``ddtree.py:ddtree_generate(..., save_tree_traces=True)`` returns a ``types.SimpleNamespace``
whose ``round_trees`` is a list with one plain dict per decoding round::

    {"accepted_indices": [0, 3, 7],            # tree-local indices, root (0) first
     "tree": {"node_token_ids": [...],         # [n] int, draft nodes only (root NOT stored)
              "node_depths":    [...],         # [n] int, depth of draft node i (1..L-1)
              "parents":        [-1, ...]}}    # [n + 1] int, tree-local parent; parents[0] = -1

Tree-local index ``i >= 1`` is draft node ``i - 1`` of ``node_token_ids`` / ``node_depths``;
nodes are in the best-first pop order, so parents come before children and a parent's
children appear in descending log-weight order (which, for the reference's heap, is also the
rank of their tokens in the drafter's top-k at that depth). The same namespace carries
``acceptance_lengths`` (one int per round, ``len(accepted_indices)`` = accepted draft tokens +
1, i.e. τ), ``stage_times`` (seconds summed over the whole request, keys ``draft``,
``tree_build``, ``tree_compile``, ``verify``, ``commit``, ``tree_build_copy``,
``tree_build_heap``, ``tree_build_visibility``; the first round's draft is not counted),
``round_timestamps`` (seconds since the decode clock started, one per round, end of round),
``output_ids`` (``[1, T]`` int64 tensor: prompt then output), ``num_input_tokens``,
``num_output_tokens``, ``time_to_first_token``, ``time_per_output_token``, ``decode_rounds``.

Containers read here:

* JSON / JSONL, the form research forks write (``json.dump`` of ``{"dataset", "sample",
  "tree_budget", "acceptance_lengths", "round_trees"}``, or of every field of the namespace
  with ``output_ids`` as a nested list): one object = one request; a list of objects or one
  object per JSONL line = several requests.
* The reference's own benchmark layout (``benchmark.py`` saves ``{"responses": [{method_key:
  result}], "block_size", "args", ...}`` with ``torch.save``): read with
  ``torch.load(weights_only=True)``, the restricted loader that accepts tensors and plain
  containers only. The reference's file holds ``SimpleNamespace`` objects, which that loader
  refuses; the error then says how to convert (``vars(result)`` per response, or JSON). A
  ``.pt`` that holds plain dicts and lists loads directly. No file is ever unpickled with
  arbitrary classes.

Every bad field raises :class:`ReferenceTraceError` naming the request, the round and the field;
``strict=False`` collects those per round instead and keeps the undamaged rounds. The records
as a lab :class:`~ddtree_lab.step.Run`: :mod:`.ddtree_reference_run`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .json_records import first_json_record, read_json_document

__all__ = ["STAGE_NAMES", "ReferenceTraceError", "ReferenceRound", "ReferenceRequest",
           "ReferenceTraces", "read_reference_traces", "parse_reference_object", "sibling_ranks_of",
           "looks_like_reference"]

#: ``ddtree.py``'s ``DDTREE_STAGE_ORDER + DDTREE_TREE_BUILD_STAGE_ORDER``.
STAGE_NAMES = ("draft", "tree_build", "tree_compile", "verify", "commit",
               "tree_build_copy", "tree_build_heap", "tree_build_visibility")

_RESULT_SCALARS = ("num_input_tokens", "num_output_tokens", "decode_rounds")
_RESULT_FLOATS = ("time_to_first_token", "time_per_output_token")


class ReferenceTraceError(ValueError):
    """A reference tree trace that is not one or has a bad field.

    Attributes:
        request: index of the request in the file (None when the file itself is bad).
        round: decoding round (None when the field is per request).
        field: the field, dotted (``"tree.parents"``, ``"acceptance_lengths"``, ...).
    """

    def __init__(self, message: str, request: int | None = None, round: int | None = None,
                 field: str | None = None):
        where = []
        if request is not None:
            where.append(f"request {request}")
        if round is not None:
            where.append(f"round {round}")
        if field is not None:
            where.append(f"field {field!r}")
        super().__init__(f"{', '.join(where)}: {message}" if where else message)
        self.request, self.round, self.field = request, round, field


@dataclass(frozen=True)
class ReferenceRound:
    """One decoding round of one request, as the reference recorded it plus what follows from it.

    Attributes:
        round: round index within the request (0-based).
        accepted_indices: tree-local indices of the accepted path, root (0) first.
        node_token_ids: ``[n]`` draft-node tokens (root excluded, as stored).
        node_depths: ``[n]`` draft-node depths (1..).
        parents: ``[n + 1]`` tree-local parents, ``parents[0] == -1``.
        sibling_ranks: ``[n + 1]`` derived: position among the parent's children (root -1).
        root_token: the anchor token, from ``output_ids`` (None when the file has none).
        bonus_token: the token the target emitted after the path, from ``output_ids`` (None when
            absent or cut off by the end of the output).
        prefix_len: committed tokens before the round (prompt included), from
            ``num_input_tokens`` + earlier τ (None without ``num_input_tokens``).
        round_seconds: wall seconds of the round from ``round_timestamps`` (None without them;
            round 0 includes the drafter's prefill).
    """

    round: int
    accepted_indices: tuple[int, ...]
    node_token_ids: tuple[int, ...]
    node_depths: tuple[int, ...]
    parents: tuple[int, ...]
    sibling_ranks: tuple[int, ...]
    root_token: int | None = None
    bonus_token: int | None = None
    prefix_len: int | None = None
    round_seconds: float | None = None

    @property
    def tau(self) -> int:
        """τ of the round: accepted draft tokens + 1 (the bonus) = ``len(accepted_indices)``."""
        return len(self.accepted_indices)

    @property
    def accept_length(self) -> int:
        """Accepted draft tokens (bonus excluded)."""
        return len(self.accepted_indices) - 1

    @property
    def num_nodes(self) -> int:
        """Tree rows, root included (``1 + n``)."""
        return len(self.parents)


@dataclass
class ReferenceRequest:
    """The rounds of one ``ddtree_generate`` call and its per-request fields.

    ``missing`` names every field the reference can write that this file lacks; those
    attributes are None, never filled in.
    """

    request: int
    rounds: list[ReferenceRound]
    acceptance_lengths: list[int] | None = None
    stage_times: dict[str, float] | None = None
    round_timestamps: list[float] | None = None
    output_ids: list[int] | None = None
    num_input_tokens: int | None = None
    num_output_tokens: int | None = None
    time_to_first_token: float | None = None
    time_per_output_token: float | None = None
    meta: dict = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)


@dataclass
class ReferenceTraces:
    """Everything read from one file: the requests, run-level metadata, and (``strict=False``)
    the problems found, one :class:`ReferenceTraceError` per damaged round or request."""

    path: str
    container: str
    requests: list[ReferenceRequest]
    metadata: dict = field(default_factory=dict)
    problems: list[ReferenceTraceError] = field(default_factory=list)


def sibling_ranks_of(parents: tuple[int, ...] | list[int]) -> tuple[int, ...]:
    """Each node's position among its parent's children in index order (0 = first child; root
    -1). For the reference's best-first heap this equals the drafter rank of the node's token
    (the heap pushes sibling rank r + 1 only when rank r is popped)."""
    seen: dict[int, int] = {}
    out = [-1]
    for p in parents[1:]:
        out.append(seen.get(p, 0))
        seen[p] = out[-1] + 1
    return tuple(out)


def _int_list(value, req, rnd, name, shape_hint: str) -> list[int]:
    """A list of Python ints (or a 1-D integer tensor); anything else names the field."""
    if isinstance(value, torch.Tensor):
        if value.dtype.is_floating_point or value.dtype == torch.bool or value.dtype.is_complex:
            raise ReferenceTraceError(f"dtype {value.dtype}, expected an integer tensor", req, rnd, name)
        if value.dim() != 1:
            raise ReferenceTraceError(f"shape {list(value.shape)}, expected {shape_hint}", req, rnd, name)
        return [int(v) for v in value.tolist()]
    if not isinstance(value, list):
        raise ReferenceTraceError(f"expected a list of ints ({shape_hint}), got {type(value).__name__}", req, rnd, name)
    for k, v in enumerate(value):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ReferenceTraceError(f"entry {k} is {v!r} ({type(v).__name__}), expected int", req, rnd, name)
    return list(value)


def _parse_round(obj, req: int, rnd: int) -> tuple[list[int], list[int], list[int], list[int]]:
    if not isinstance(obj, dict):
        raise ReferenceTraceError(f"a round is a dict, got {type(obj).__name__}", req, rnd, "round_trees")
    for key in ("accepted_indices", "tree"):
        if key not in obj:
            raise ReferenceTraceError("missing", req, rnd, key)
    tree = obj["tree"]
    if not isinstance(tree, dict):
        raise ReferenceTraceError(f"expected a dict, got {type(tree).__name__}", req, rnd, "tree")
    for key in ("node_token_ids", "node_depths", "parents"):
        if key not in tree:
            raise ReferenceTraceError("missing", req, rnd, f"tree.{key}")
    tokens = _int_list(tree["node_token_ids"], req, rnd, "tree.node_token_ids", "[n]")
    depths = _int_list(tree["node_depths"], req, rnd, "tree.node_depths", "[n]")
    parents = _int_list(tree["parents"], req, rnd, "tree.parents", "[n + 1]")
    accepted = _int_list(obj["accepted_indices"], req, rnd, "accepted_indices", "[tau]")
    n = len(tokens)
    if len(depths) != n:
        raise ReferenceTraceError(f"length {len(depths)}, node_token_ids has {n}", req, rnd, "tree.node_depths")
    if len(parents) != n + 1:
        raise ReferenceTraceError(f"length {len(parents)}, expected {n + 1} (root + {n} draft nodes)",
                                  req, rnd, "tree.parents")
    if parents[0] != -1:
        raise ReferenceTraceError(f"parents[0] is {parents[0]}, the root's parent must be -1", req, rnd, "tree.parents")
    for i in range(1, n + 1):
        p = parents[i]
        if not 0 <= p < i:
            raise ReferenceTraceError(f"node {i} has parent {p}: a parent must come before its child (0 <= parent < {i})",
                                      req, rnd, "tree.parents")
        want = 1 if p == 0 else depths[p - 1] + 1
        if depths[i - 1] != want:
            raise ReferenceTraceError(f"node {i} has depth {depths[i - 1]} but its parent {p} has depth {want - 1}",
                                      req, rnd, "tree.node_depths")
        if tokens[i - 1] < 0:
            raise ReferenceTraceError(f"node {i} has token {tokens[i - 1]} (< 0)", req, rnd, "tree.node_token_ids")
    seen: dict[tuple[int, int], int] = {}
    for i in range(1, n + 1):
        key = (parents[i], tokens[i - 1])
        if key in seen:
            raise ReferenceTraceError(f"nodes {seen[key]} and {i} are siblings with the same token {tokens[i - 1]}",
                                      req, rnd, "tree.node_token_ids")
        seen[key] = i
    if not accepted or accepted[0] != 0:
        raise ReferenceTraceError(f"{accepted!r}: the accepted path starts at the root (0)", req, rnd, "accepted_indices")
    for k in range(1, len(accepted)):
        a = accepted[k]
        if not 0 < a <= n or parents[a] != accepted[k - 1]:
            raise ReferenceTraceError(f"entry {k} ({a}) is not a child of entry {k - 1} ({accepted[k - 1]})",
                                      req, rnd, "accepted_indices")
    return accepted, tokens, depths, parents


def _opt_float(obj: dict, key: str, req: int) -> float | None:
    if key not in obj or obj[key] is None:
        return None
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ReferenceTraceError(f"{v!r} is not a finite number", req, None, key)
    return float(v)


def _opt_int(obj: dict, key: str, req: int) -> int | None:
    if key not in obj or obj[key] is None:
        return None
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ReferenceTraceError(f"{v!r} is not a non-negative int", req, None, key)
    return int(v)


def _output_ids(value, req: int) -> list[int]:
    if isinstance(value, torch.Tensor):
        if value.dtype.is_floating_point or value.dtype == torch.bool:
            raise ReferenceTraceError(f"dtype {value.dtype}, expected int64", req, None, "output_ids")
        if value.dim() != 2 or value.shape[0] != 1:
            raise ReferenceTraceError(f"shape {list(value.shape)}, expected [1, T]", req, None, "output_ids")
        return [int(v) for v in value[0].tolist()]
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], list):
        value = value[0]  # [1, T] written with .tolist()
    return _int_list(value, req, None, "output_ids", "[1, T]")


def parse_reference_object(obj, request: int = 0, strict: bool = True) -> tuple[ReferenceRequest, list[ReferenceTraceError]]:
    """One request from one result object (``vars(ddtree_generate(...))`` or a fork's dump).

    Args:
        obj: a dict with ``round_trees`` and optionally the other result fields (module docstring).
        request: the request's index, used in errors.
        strict: raise on the first bad field; else skip a bad round and report it.

    Returns:
        ``(ReferenceRequest, problems)``.

    Raises:
        ReferenceTraceError: naming request, round and field (always for a bad per-request
            field; for a bad round only when ``strict``).
    """
    if not isinstance(obj, dict):
        raise ReferenceTraceError(f"a request is a dict of ddtree_generate's fields, got {type(obj).__name__}", request)
    if "round_trees" not in obj:
        raise ReferenceTraceError("missing (was ddtree_generate called with save_tree_traces=True?)",
                                  request, None, "round_trees")
    trees = obj["round_trees"]
    if not isinstance(trees, list):
        raise ReferenceTraceError(f"expected a list of rounds, got {type(trees).__name__}", request, None, "round_trees")
    lengths = None
    if obj.get("acceptance_lengths") is not None:
        lengths = _int_list(obj["acceptance_lengths"], request, None, "acceptance_lengths", "[rounds]")
        if len(lengths) != len(trees):
            raise ReferenceTraceError(f"{len(lengths)} entries for {len(trees)} rounds", request, None, "acceptance_lengths")
    stamps = None
    if obj.get("round_timestamps") is not None:
        stamps = obj["round_timestamps"]
        if not isinstance(stamps, list) or len(stamps) != len(trees):
            raise ReferenceTraceError(f"expected a list of {len(trees)} numbers", request, None, "round_timestamps")
        for k, v in enumerate(stamps):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ReferenceTraceError(f"entry {k} is {v!r}, expected seconds >= 0", request, k, "round_timestamps")
            if k and v < stamps[k - 1]:
                raise ReferenceTraceError(f"entry {k} ({v}) is before entry {k - 1} ({stamps[k - 1]})",
                                          request, k, "round_timestamps")
        stamps = [float(v) for v in stamps]
    stage_times = None
    if obj.get("stage_times") is not None:
        st = obj["stage_times"]
        if not isinstance(st, dict):
            raise ReferenceTraceError(f"expected a dict of stage -> seconds, got {type(st).__name__}", request, None,
                                      "stage_times")
        for k, v in st.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ReferenceTraceError(f"stage {k!r} is {v!r}, expected seconds >= 0", request, None, "stage_times")
        stage_times = {str(k): float(v) for k, v in st.items()}
    output_ids = _output_ids(obj["output_ids"], request) if obj.get("output_ids") is not None else None
    scalars = {k: _opt_int(obj, k, request) for k in _RESULT_SCALARS}
    floats = {k: _opt_float(obj, k, request) for k in _RESULT_FLOATS}
    n_in = scalars["num_input_tokens"]
    if scalars["decode_rounds"] is not None and scalars["decode_rounds"] != len(trees):
        raise ReferenceTraceError(f"{scalars['decode_rounds']} but round_trees has {len(trees)} rounds",
                                  request, None, "decode_rounds")
    rounds: list[ReferenceRound] = []
    problems: list[ReferenceTraceError] = []
    start = n_in
    for r, tr in enumerate(trees):
        try:
            accepted, tokens, depths, parents = _parse_round(tr, request, r)
            if lengths is not None and lengths[r] != len(accepted):
                raise ReferenceTraceError(f"{lengths[r]} but accepted_indices has {len(accepted)} entries "
                                          "(the reference appends len(accepted_indices))", request, r, "acceptance_lengths")
            root = bonus = None
            if output_ids is not None and start is not None:
                path_tokens = [None] + [tokens[a - 1] for a in accepted[1:]]
                for k, tok in enumerate(path_tokens):
                    pos = start + k
                    if pos >= len(output_ids):
                        break
                    if k == 0:
                        root = output_ids[pos]
                    elif output_ids[pos] != tok:
                        raise ReferenceTraceError(f"position {pos} holds {output_ids[pos]} but the accepted node "
                                                  f"{accepted[k]} has token {tok}", request, r, "output_ids")
                if start + len(accepted) < len(output_ids):
                    bonus = output_ids[start + len(accepted)]
            seconds = None
            if stamps is not None:
                seconds = stamps[r] - (stamps[r - 1] if r else 0.0)
            rounds.append(ReferenceRound(r, tuple(accepted), tuple(tokens), tuple(depths), tuple(parents),
                                         sibling_ranks_of(parents), root, bonus, start, seconds))
        except ReferenceTraceError as e:
            if strict:
                raise
            problems.append(e)
            # the next round starts after this one's tau: from acceptance_lengths unless that is what is wrong
            if start is not None:
                start = start + lengths[r] if lengths is not None and e.field != "acceptance_lengths" else None
            continue
        if start is not None:
            start += rounds[-1].tau
    known = {"round_trees", "acceptance_lengths", "stage_times", "round_timestamps", "output_ids",
             *_RESULT_SCALARS, *_RESULT_FLOATS}
    meta = {k: v for k, v in obj.items() if k not in known and _is_plain(v)}
    missing = [k for k in ("acceptance_lengths", "stage_times", "round_timestamps", "output_ids", "num_input_tokens")
               if obj.get(k) is None]
    if output_ids is None or n_in is None:
        missing.append("root and bonus tokens (need output_ids and num_input_tokens)")
    return ReferenceRequest(request, rounds, lengths, stage_times, stamps, output_ids, n_in,
                            scalars["num_output_tokens"], floats["time_to_first_token"],
                            floats["time_per_output_token"], meta, missing), problems


def _is_plain(v) -> bool:
    if v is None or isinstance(v, (bool, int, float, str)):
        return True
    if isinstance(v, list):
        return all(_is_plain(x) for x in v)
    if isinstance(v, dict):
        return all(isinstance(k, str) and _is_plain(x) for k, x in v.items())
    return False


def _results_of(doc, path: str) -> tuple[list[tuple[dict, dict]], dict]:
    """``[(result, meta)]`` and run metadata from any accepted top-level layout."""
    if isinstance(doc, list):
        return [(d, {}) for d in doc], {}
    if not isinstance(doc, dict):
        raise ReferenceTraceError(f"{path}: top level is {type(doc).__name__}, expected a result dict, a list of them, "
                                  "or benchmark.py's {'responses': [...]}")
    if "round_trees" in doc or "acceptance_lengths" in doc:  # one result (without trees: parse says why)
        return [(doc, {})], {}
    if "responses" in doc:
        responses = doc["responses"]
        if not isinstance(responses, list):
            raise ReferenceTraceError(f"{path}: 'responses' is {type(responses).__name__}, expected a list")
        out, skipped = [], []
        for i, resp in enumerate(responses):
            if not isinstance(resp, dict):
                raise ReferenceTraceError(f"{path}: responses[{i}] is {type(resp).__name__}, expected "
                                          "{method_key: result}")
            for method, result in resp.items():
                if not isinstance(result, dict):
                    raise ReferenceTraceError(f"{path}: responses[{i}][{method!r}] is {type(result).__name__}; "
                                              "convert each result with vars(result) first")
                if result.get("round_trees") is None:
                    skipped.append(f"{i}:{method}")
                    continue
                out.append((result, {"response": i, "method": method}))
        run_meta = {k: v for k, v in doc.items() if k != "responses" and _is_plain(v)}
        run_meta["results_without_round_trees"] = skipped
        return out, run_meta
    raise ReferenceTraceError(f"{path}: no 'round_trees' and no 'responses' key (keys: {sorted(doc)[:12]})")


def _torch_doc(path: Path):
    import pickle

    try:
        return torch.load(str(path), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        m = re.search(r"GLOBAL ([\w.]+)", str(e))
        what = m.group(1) if m else "an object the restricted loader refuses"
        raise ReferenceTraceError(
            f"{path}: holds {what}, which torch.load(weights_only=True) refuses (the lab never unpickles arbitrary "
            "objects). Convert it where you trust the file: load it there, replace each ddtree_generate result by "
            "vars(result) with output_ids.tolist(), and json.dump it (or torch.save the plain dicts)") from None
    except (RuntimeError, EOFError, OSError) as e:
        raise ReferenceTraceError(f"{path}: not a readable torch.save file ({e})") from None


def read_reference_traces(path: str | Path, strict: bool = True) -> ReferenceTraces:
    """Read a file of DDTree reference tree traces (layouts: module docstring).

    Args:
        path: ``.json`` (one result, a list, or the benchmark layout), ``.jsonl`` (one result per
            line) or ``.pt`` / ``.pth`` (``torch.save`` of plain containers).
        strict: raise on the first bad field; with False, damaged rounds are skipped and listed in
            ``problems`` (a bad per-request field still drops that whole request, listed too).

    Returns:
        :class:`ReferenceTraces`.

    Raises:
        FileNotFoundError: no such file.
        ReferenceTraceError: bad container or (``strict``) bad field, naming request/round/field.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    if path.suffix.lower() in (".pt", ".pth", ".bin"):
        container, doc = "torch", _torch_doc(path)
    else:
        container = "jsonl" if path.suffix.lower() == ".jsonl" else "json"
        try:
            doc = read_json_document(path)
        except ValueError as e:
            raise ReferenceTraceError(f"{e}; .pt files are read with torch.load(weights_only=True)") from None
    results, run_meta = _results_of(doc, str(path))
    requests, problems = [], []
    for i, (result, meta) in enumerate(results):
        try:
            req, probs = parse_reference_object(result, i, strict)
        except ReferenceTraceError as e:
            if strict:
                raise
            problems.append(e)
            continue
        req.meta.update(meta)
        requests.append(req)
        problems.extend(probs)
    return ReferenceTraces(str(path), container, requests, {"source": "ddtree reference", **run_meta}, problems)


def looks_like_reference(path: str | Path) -> bool:
    """Whether ``path`` looks like reference tree traces (a ``.pt``/``.pth`` file, or JSON /
    JSONL whose first record has ``round_trees`` or is the benchmark's ``responses`` layout);
    a quick look for telling sources apart, not a validation."""
    path = Path(path)
    if path.suffix.lower() in (".pt", ".pth"):
        return path.is_file()
    rec = first_json_record(path)
    return isinstance(rec, dict) and ("round_trees" in rec or isinstance(rec.get("responses"), list))
