"""The DDTree reference's tree traces (:mod:`.ddtree_reference`'s records) as a lab
:class:`~ddtree_lab.step.Run`: one :class:`~ddtree_lab.step.Step` per round with a tree and an
output only (:func:`reference_round_step`), the requests' prompts, generated ids and
temperatures in the metadata (:func:`reference_run`), and what such a run cannot feed
(:data:`REFERENCE_CANNOT`). Source ``"ddtree reference"`` of :func:`ddtree_lab.io.load`
(:func:`load_reference_run`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..build import DDTreeBuildResult
from ..step import Run, Step
from ..verify import VerifyOutput
from .ddtree_reference import ReferenceRequest, ReferenceRound, ReferenceTraces, read_reference_traces
from .decoding_mode import FROM_ARGS, FROM_RECORD, NOT_RECORDED, temperature_value

__all__ = ["REFERENCE_CANNOT", "reference_round_step", "reference_run", "load_reference_run"]

#: Lab features a run from reference traces cannot feed, and why (shown by the run summary).
REFERENCE_CANNOT = {
    "verify replay": "no target rows (child probabilities, bonus row) and no coins",
    "audit (exact laws, statistical tests)": "no target rows and no sampling parameters",
    "what-if / tuner re-analysis": "no target rows or top-M raw logits",
    "drafter calibration (expected vs drafter estimate)": "no draft top-k or node log-weights",
    "buffer checks (retrieve_next_token / retrieve_next_sibling)": "no verify buffers recorded "
                                                                  "(they could be derived from the tree)",
    "decision log / coin view": "the reference records no per-sibling decisions or coins",
}


def reference_round_step(req: ReferenceRequest, rnd: ReferenceRound, request_id: str):
    """One round as a :class:`~ddtree_lab.step.Step` with a tree and an output only (no draft
    top-k, buffers, parameters, coins or target rows; ``source`` ``"ddtree reference"``).

    ``tree`` (batch of one, ``N = n + 1``): root token from ``output_ids`` (else -1), parents,
    depths, ``ranks`` = sibling ranks (the drafter ranks, for the reference's heap),
    ``node_logws`` NaN (not recorded). ``output``: ``accept_index`` = ``accepted_indices``,
    ``accept_length`` = τ - 1, the bonus from ``output_ids`` (else -1; ``support_exhausted``
    False, the reference always emits one). ``timings``: ``{"round": seconds}`` when known.
    Every stand-in value is named in ``step.extra["missing"]``.
    """
    n1, width = rnd.num_nodes, max(rnd.node_depths, default=0) + 1
    root = -1 if rnd.root_token is None else rnd.root_token
    bonus = -1 if rnd.bonus_token is None else rnd.bonus_token
    tree = DDTreeBuildResult(node_token_ids=torch.tensor([[root, *rnd.node_token_ids]]),
                             parents=torch.tensor([rnd.parents]), depths=torch.tensor([[0, *rnd.node_depths]]),
                             ranks=torch.tensor([rnd.sibling_ranks]),
                             node_logws=torch.full((1, n1), float("nan"), dtype=torch.float32),
                             num_nodes=torch.tensor([n1]))
    path = list(rnd.accepted_indices)
    index = torch.full((1, width), -1, dtype=torch.int64)
    index[0, :len(path)] = torch.tensor(path)
    emitted = torch.full((1, width), -1, dtype=torch.int64)
    emitted[0, :len(path)] = torch.tensor([rnd.node_token_ids[i - 1] for i in path[1:]] + [bonus])
    output = VerifyOutput(accept_index=index, accept_length=torch.tensor([rnd.accept_length]), emitted_tokens=emitted,
                          bonus_token=torch.tensor([bonus]), support_exhausted=torch.tensor([False]),
                          backend="ddtree reference")
    missing = ["draft top-k", "verify buffers", "sampling parameters", "coins", "target rows", "decision log",
               "node_logws (NaN)"]
    missing += [name for name, absent in (("root token (-1)", rnd.root_token is None),
                                          ("bonus token (-1)", rnd.bonus_token is None),
                                          ("prefix_len", rnd.prefix_len is None),
                                          ("round time", rnd.round_seconds is None)) if absent]
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
    """A :class:`~ddtree_lab.step.Run` of every round of every request (:func:`reference_round_step`).

    ``metadata``: ``source``, ``path``, ``container``, the file's run fields (``block_size``,
    ``args``), ``requests`` (per request: ``request`` (index), ``request_id``, ``stage_times``
    (seconds over the request), ``acceptance_lengths``, ``num_input_tokens``,
    ``prompt_token_ids`` and ``generated_token_ids`` (None without ``output_ids`` and
    ``num_input_tokens``), ``temperature`` and ``temperature_from``
    (:mod:`ddtree_lab.io.decoding_mode`: the request's own ``temperature`` field, else the
    benchmark layout's ``args.temperature``, else None: not recorded), ``missing``), ``missing``
    and ``cannot`` (:data:`REFERENCE_CANNOT`). ``problems``: the damaged rounds and requests
    (read with ``strict=False``), and a temperature field that is not a number >= 0.
    """
    steps, requests = [], []
    problems = [str(p) for p in traces.problems]
    args = traces.metadata.get("args")
    run_t, run_from = None, NOT_RECORDED
    if isinstance(args, dict) and args.get("temperature") is not None:
        run_t = temperature_value(args["temperature"])
        if run_t is None:
            problems.append(f"{traces.path}: args.temperature is {args['temperature']!r}, not a temperature (a number "
                            ">= 0): greedy or sampled is not known")
        else:
            run_from = FROM_ARGS
    for req in traces.requests:
        rid = _request_id(req)
        steps.extend(reference_round_step(req, rnd, rid) for rnd in req.rounds)
        ids, n_in = req.output_ids, req.num_input_tokens
        generated = None if ids is None or n_in is None else ids[n_in:]
        prompt = None if ids is None or n_in is None else ids[:n_in]
        t, where = run_t, run_from
        if req.meta.get("temperature") is not None:
            own = temperature_value(req.meta["temperature"])
            if own is None:
                problems.append(f"request {req.request}: field 'temperature' is {req.meta['temperature']!r}, not a "
                                "temperature (a number >= 0): greedy or sampled is not known")
                t, where = None, NOT_RECORDED
            else:
                if run_t is not None and own != run_t:
                    problems.append(f"request {req.request}: field 'temperature' is {own:g} but args.temperature is "
                                    f"{run_t:g}: the request's own field is taken")
                t, where = own, FROM_RECORD
        requests.append({**req.meta, "request": req.request, "request_id": rid, "stage_times": req.stage_times,
                         "acceptance_lengths": req.acceptance_lengths, "num_input_tokens": req.num_input_tokens,
                         "prompt_token_ids": prompt, "generated_token_ids": generated,
                         "temperature": t, "temperature_from": where if t is not None else NOT_RECORDED,
                         "time_to_first_token": req.time_to_first_token,
                         "time_per_output_token": req.time_per_output_token, "missing": list(req.missing)})
    meta = {**traces.metadata, "source": "ddtree reference", "path": traces.path, "container": traces.container,
            "requests": requests, "cannot": dict(REFERENCE_CANNOT),
            "missing": ["target rows", "sampling parameters", "coins", "draft top-k", "verify buffers"]}
    from ..models.target import default_token_texts

    ids = {t for s in steps for t in s.token_ids()} | {t for q in requests for t in (q.get("generated_token_ids") or [])}
    texts = default_token_texts([(q.get("prompt"), q.get("prompt_token_ids") or []) for q in requests], ids)
    return Run(metadata=meta, steps=steps, token_texts=texts, problems=problems)


def load_reference_run(path: str | Path, strict: bool = False):
    """:func:`reference_run` of :func:`read_reference_traces` (``strict=False``: a damaged round
    is named in ``run.problems`` and left out, the others load).

    Raises:
        FileNotFoundError, ReferenceTraceError: as :func:`read_reference_traces`.
    """
    return reference_run(read_reference_traces(path, strict=strict))
