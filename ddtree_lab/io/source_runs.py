"""Turn DDTree reference tree traces and engine acceptance summaries into lab Runs.

A reference round becomes a :class:`~ddtree_lab.step.Step` with a tree and an output and
nothing else (no draft top-k, buffers, sampling parameters, coins or target rows); an engine
summary becomes one Step per verify step that holds only its accept length, and only when the
engine reported per-step counts (vLLM ``detailed``). A request with only a histogram or totals
gives no Steps: its counts stay in ``run.metadata["requests"]``. What a source lacks is None or
listed under ``missing`` (``step.extra["missing"]``, ``run.metadata["missing"]``), never
filled in; the two tensor fields a tree must have and the reference does not record are NaN
(``node_logws``) and -1 (the root token, when the file has no ``output_ids``), each named there.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .acceptance import AcceptanceSummaries, read_acceptance_summaries
from .ddtree_reference import ReferenceRequest, ReferenceRound, ReferenceTraces, read_reference_traces

__all__ = ["REFERENCE_CANNOT", "SUMMARY_CANNOT", "reference_round_step", "reference_run", "summary_run",
           "load_reference_run", "load_summary_run", "sniff_source"]

#: Lab features a run from each source cannot feed, and why (shown by the run summary view).
REFERENCE_CANNOT = {
    "verify replay": "no target rows (child probabilities, bonus row) and no coins",
    "audit (exact laws, statistical tests)": "no target rows and no sampling parameters",
    "what-if / tuner re-analysis": "no target rows or top-M raw logits",
    "drafter calibration (expected vs drafter estimate)": "no draft top-k or node log-weights",
    "buffer checks (retrieve_next_token / retrieve_next_sibling)": "no verify buffers recorded "
                                                                  "(they could be derived from the tree)",
    "decision log / coin view": "the reference records no per-sibling decisions or coins",
}
SUMMARY_CANNOT = {
    "tree views (trees, accepted paths)": "no trees",
    "acceptance by sibling rank": "no trees",
    "verify replay, audit, what-if": "no trees, target rows, coins or sampling parameters",
    "acceptance by depth from trees": "only from per-position counts (accepted at position i), not offered/accepted per node",
    "stage times": "the engines' summaries carry no stage timings",
}


def _tree_and_output(rnd: ReferenceRound):
    from .. import DDTreeBuildResult, VerifyOutput

    n1 = rnd.num_nodes
    root = -1 if rnd.root_token is None else rnd.root_token
    tokens = torch.tensor([[root, *rnd.node_token_ids]], dtype=torch.int64)
    depths = torch.tensor([[0, *rnd.node_depths]], dtype=torch.int64)
    tree = DDTreeBuildResult(node_token_ids=tokens, parents=torch.tensor([rnd.parents], dtype=torch.int64),
                             depths=depths, ranks=torch.tensor([rnd.sibling_ranks], dtype=torch.int64),
                             node_logws=torch.full((1, n1), float("nan"), dtype=torch.float32),
                             num_nodes=torch.tensor([n1], dtype=torch.int64))
    width = max(rnd.node_depths, default=0) + 1
    path = list(rnd.accepted_indices)
    index = torch.full((1, width), -1, dtype=torch.int64)
    index[0, :len(path)] = torch.tensor(path)
    bonus = -1 if rnd.bonus_token is None else rnd.bonus_token
    emitted = torch.full((1, width + 1), -1, dtype=torch.int64)
    accepted_tokens = [rnd.node_token_ids[i - 1] for i in path[1:]]
    emitted[0, :len(accepted_tokens) + 1] = torch.tensor(accepted_tokens + [bonus])
    output = VerifyOutput(accept_index=index, accept_length=torch.tensor([rnd.accept_length]),
                          emitted_tokens=emitted[:, :width], bonus_token=torch.tensor([bonus]),
                          support_exhausted=torch.tensor([False]), backend="ddtree reference")
    return tree, output


def reference_round_step(req: ReferenceRequest, rnd: ReferenceRound, request_id: str):
    """The :class:`~ddtree_lab.step.Step` of one reference round (module docstring).

    ``tree``: tokens (root = the anchor from ``output_ids``, else -1), parents, depths, ranks =
    sibling ranks (equal to the drafter ranks for the reference's heap), ``node_logws`` NaN (not
    recorded). ``output``: ``accept_index`` = ``accepted_indices``, ``accept_length`` = τ - 1,
    the bonus from ``output_ids`` (else -1, with ``support_exhausted`` False: the reference
    always emits one). ``timings``: ``{"round": seconds}`` from ``round_timestamps`` when present.
    """
    from ..step import Step

    tree, output = _tree_and_output(rnd)
    missing = ["draft top-k", "verify buffers", "sampling parameters", "coins", "target rows",
               "decision log", "node_logws (NaN)"]
    if rnd.root_token is None:
        missing.append("root token (-1)")
    if rnd.bonus_token is None:
        missing.append("bonus token (-1)")
    if rnd.prefix_len is None:
        missing.append("prefix_len")
    if rnd.round_seconds is None:
        missing.append("round time")
    return Step(step=rnd.round, request=req.request, request_id=request_id, prefix_len=rnd.prefix_len, params=None,
                output=output, tree=tree, timings={} if rnd.round_seconds is None else {"round": rnd.round_seconds},
                backend="ddtree reference", source="ddtree reference",
                extra={"missing": missing, "tau": rnd.tau,
                       "ranks": "sibling rank (the reference heap's children are in draft-rank order)"})


def _request_id(req: ReferenceRequest) -> str:
    if "method" in req.meta:
        return f"{req.meta.get('response', req.request)}:{req.meta['method']}"
    if "dataset" in req.meta:
        return f"{req.meta['dataset']}:{req.meta.get('sample', req.request)}"
    return str(req.request)


def reference_run(traces: ReferenceTraces):
    """A :class:`~ddtree_lab.step.Run` of every round of every request in ``traces``.

    ``metadata``: ``source`` ``"ddtree reference"``, ``path``, ``container``, the file's run
    fields (``block_size``, ``args``), ``requests`` (per request: ``request_id``,
    ``stage_times`` (seconds over the whole request), ``acceptance_lengths``, the prompt
    length, ``generated_token_ids`` (None without ``output_ids``), ``missing``) and
    ``cannot`` (:data:`REFERENCE_CANNOT`). ``problems``: the damaged rounds (``strict=False``).
    """
    from ..step import Run

    steps, requests = [], []
    for req in traces.requests:
        rid = _request_id(req)
        steps.extend(reference_round_step(req, rnd, rid) for rnd in req.rounds)
        generated = None
        if req.output_ids is not None and req.num_input_tokens is not None:
            generated = req.output_ids[req.num_input_tokens:]
        requests.append({"request_id": rid, "stage_times": req.stage_times, "acceptance_lengths": req.acceptance_lengths,
                         "num_input_tokens": req.num_input_tokens, "generated_token_ids": generated,
                         "time_to_first_token": req.time_to_first_token,
                         "time_per_output_token": req.time_per_output_token, "missing": list(req.missing),
                         **{k: v for k, v in req.meta.items() if k not in ("request_id",)}})
    meta = {**traces.metadata, "source": "ddtree reference", "path": traces.path, "container": traces.container,
            "requests": requests, "cannot": dict(REFERENCE_CANNOT),
            "missing": ["target rows", "sampling parameters", "coins", "draft top-k", "verify buffers"]}
    return Run(metadata=meta, steps=steps, token_texts={}, problems=[str(p) for p in traces.problems])


def summary_run(summaries: AcceptanceSummaries):
    """A :class:`~ddtree_lab.step.Run` from engine summaries: one accept-length-only Step per
    verify step of each request with ``per_step_accepted``; every request's counts in
    ``metadata["requests"]`` (``tau_mean`` = 1 + accepted / steps, the histogram, the engine's
    own accept length and its definition, ``missing``)."""
    from ..step import Run, Step

    steps, requests = [], []
    for rec in summaries.requests:
        rid = rec.request_id if rec.request_id is not None else str(rec.request)
        if rec.per_step_accepted is not None:
            drafted = rec.per_step_drafted
            for k, a in enumerate(rec.per_step_accepted):
                steps.append(Step(step=k, request=rec.request, request_id=rid, prefix_len=None, params=None, output=None,
                                  stored_accept_length=a, level="off", source="engine summary", backend=rec.engine,
                                  extra={"engine": rec.engine, "drafted": None if drafted is None else drafted[k],
                                         "missing": ["tree", "output", "params", "coins", "rows", "timings"]}))
        requests.append({"request_id": rid, "engine": rec.engine, "level": rec.level, "num_steps": rec.num_steps,
                         "num_spec_tokens": rec.num_spec_tokens,
                         "num_accepted_draft_tokens": rec.num_accepted_draft_tokens,
                         "num_draft_tokens": rec.num_draft_tokens, "accept_histogram": rec.accept_histogram,
                         "accepted_per_position": rec.accepted_per_position, "tau_mean": rec.tau_mean(),
                         "reported_accept_length": rec.reported_accept_length,
                         "reported_accept_length_definition": rec.reported_accept_length_definition,
                         "completion_tokens": rec.completion_tokens, "generated_token_ids": None,
                         "has_steps": rec.per_step_accepted is not None, "source_fields": dict(rec.source_fields),
                         "missing": list(rec.missing)})
    meta = {**summaries.metadata, "source": "engine summary", "engine": summaries.engine, "path": summaries.path,
            "requests": requests, "cannot": dict(SUMMARY_CANNOT),
            "missing": ["trees", "target rows", "sampling parameters", "coins", "stage times"]}
    return Run(metadata=meta, steps=steps, token_texts={}, problems=[])


def load_reference_run(path, strict: bool = False):
    """:func:`reference_run` of :func:`~ddtree_lab.io.ddtree_reference.read_reference_traces`
    (``strict=False``: damaged rounds are named in ``run.problems`` and the rest load)."""
    return reference_run(read_reference_traces(path, strict=strict))


def load_summary_run(path, engine: str | None = None):
    """:func:`summary_run` of :func:`~ddtree_lab.io.acceptance.read_acceptance_summaries`."""
    return summary_run(read_acceptance_summaries(path, engine=engine))


def _kind_of(obj) -> str | None:
    if isinstance(obj, list):
        return _kind_of(obj[0]) if obj else None
    if not isinstance(obj, dict):
        return None
    if "round_trees" in obj or "responses" in obj:
        return "ddtree reference"
    if isinstance(obj.get("name"), str) and obj["name"].startswith("vllm:"):
        return "engine summary"
    keys = set(obj)
    if keys & {"metrics", "spec_decode_metrics", "num_spec_steps", "meta_info", "spec_verify_ct"}:
        return "engine summary"
    choices = obj.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict) and "meta_info" in choices[0]:
        return "engine summary"
    return None


def sniff_source(path) -> str | None:
    """Which of the two sources a file holds, from its name and first record, without
    validating it: ``"ddtree reference"``, ``"engine summary"`` or None (neither; e.g. a lab
    container). ``.pt`` / ``.pth`` files are taken as reference traces (the lab writes none);
    ``.prom`` as vLLM ``/metrics`` text. Reads JSON only (a JSONL file: its first line)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix in (".pt", ".pth"):
        return "ddtree reference"
    if suffix == ".prom":
        return "engine summary"
    if suffix not in (".json", ".jsonl", ".txt") or not path.is_file():
        return None
    try:
        with path.open() as f:
            if suffix == ".json":
                return _kind_of(json.load(f))
            for line in f:
                if line.strip():
                    return _kind_of(json.loads(line))
            return None
    except (json.JSONDecodeError, UnicodeDecodeError):
        if suffix == ".txt" and "vllm:spec_decode_" in path.read_text(errors="replace"):
            return "engine summary"
        return None
