"""Calls an append-only SGLang recording holds that did not return: their steps (no output), their replay, and the Run of such a file."""

from __future__ import annotations

from pathlib import Path

import torch

from .recording import load_append_recording, step_verify_input

__all__ = ["pending_steps", "replay_pending", "load_append_recording_run"]


def _params(step: dict, row: int):
    from ..sampling import SamplingParams

    s = {k: v[row] for k, v in (step.get("sampling") or {}).items()}
    if step["kind"] == "greedy" or float(s.get("temperature", 1.0)) == 0.0:
        return SamplingParams(temperature=0.0)
    top_k = int(s.get("top_k", 0))
    return SamplingParams(temperature=float(s.get("temperature", 1.0)), top_k=max(top_k, 0),
                          top_p=float(s.get("top_p", 1.0)))


def pending_steps(step: dict, index: int, request_of: dict[str, int]) -> list:
    """The lab steps of a call that did not return, one per recorded row: buffers, tree,
    coins, parameters, no output (``extra["did_not_return"]``); ``request_of`` maps request ids
    to request numbers (new ids are added)."""
    from ..buffers import decode_retrieve
    from ..step import Step

    out = []
    for row, rid in enumerate(step["request_ids"]):
        vi = step_verify_input(step, row)
        n = int(vi.num_nodes[0])
        parents, depths = decode_retrieve(vi.retrieve_next_token, vi.retrieve_next_sibling, vi.num_nodes)
        t = step["tensors"]
        sampled = step["kind"] != "greedy"
        s = Step.from_fields(
            step=index, request=request_of.setdefault(str(rid), len(request_of)), request_id=str(rid),
            prefix_len=int(vi.positions[0, 0]), params=_params(step, row), output=None,
            node_token_ids=vi.node_token_ids[0, :n], parents=parents[0, :n], depths=depths[0, :n],
            ranks=torch.full((n,), -1, dtype=torch.int64), node_logws=torch.full((n,), float("nan")),
            retrieve_index=vi.retrieve_index[0, :n], retrieve_next_token=vi.retrieve_next_token[0, :n],
            retrieve_next_sibling=vi.retrieve_next_sibling[0, :n], positions=vi.positions[0, :n],
            coins=t["uniform_samples"][row, :n].float() if sampled else torch.zeros(n),
            final_coin=float(t["uniform_samples_final"][row]) if sampled else 0.0,
            level="light", backend=f"sglang-{step['kind']}", source="sglang recording (append-only)",
            extra={"did_not_return": True, "kind": step["kind"], "kernel": step["kernel"], "call": step["call"],
                   "row": row, "rows_stored": "target_prob_rows" in t or not sampled,
                   "why": "its inputs were written before the kernel ran and its outputs never were"})
        # the recorded call, for replay_pending: an ad-hoc attribute (no Step field), read back with getattr
        setattr(s, "stored_inputs", {"step": step, "row": row})
        out.append(s)
    return out


def replay_pending(step, backend: str = "reference"):
    """Verify a row of a call that did not return with a lab backend, from its stored inputs:
    greedy rows on one-hot logits at SGLang's ``target_predict``
    (:func:`ddtree_lab.verify.verify_tree_greedy`); sampled rows on the log of the stored
    probability rows at temperature 1 (:func:`ddtree_lab.verify.verify_tree`), as
    :func:`ddtree_lab.sglang.replay.replay_step` replays a call that returned.

    Returns:
        the lab's :class:`~ddtree_lab.verify.VerifyOutput` (a batch of one).

    Raises:
        ValueError: not such a step, or a sampled call recorded with ``prob_rows="path"`` (its
            rows are read only after the kernel returns).
    """
    from ..sampling import SamplingParams
    from ..verify import verify_tree, verify_tree_greedy

    stored = getattr(step, "stored_inputs", None)
    where = f"step {step.step}, request {step.request}"
    if not step.extra.get("did_not_return") or stored is None:
        raise ValueError(f"{where}: not a call that did not return (replay it with ddtree_lab.sglang.replay_step)")
    call, row = stored["step"], stored["row"]
    t, vi = call["tensors"], step_verify_input(call, row)
    if call["kind"] == "greedy":
        pred = t["target_predict"][row : row + 1]
        width = max(int(pred.max()), int(vi.node_token_ids.max())) + 1  # covers every id the verifier reads
        logits = torch.zeros(1, pred.shape[1], width)
        logits.scatter_(-1, pred[..., None].clamp(min=0), 1.0)
        return verify_tree_greedy(vi, logits, backend=backend)
    if "target_prob_rows" not in t:
        raise ValueError(f"{where}: a sampled call recorded with prob_rows='path': its target rows are read after "
                         "the kernel returns, so none are on disk (record with prob_rows='all'); check() runs on its "
                         "buffers and coins")
    probs = t["target_prob_rows"][row : row + 1].double()
    ts, ta = float(call.get("threshold_single", 1.0)), float(call.get("threshold_acc", 1.0))
    return verify_tree(vi, probs.log().float(), SamplingParams(temperature=1.0),
                       t["uniform_samples"][row : row + 1].float(), t["uniform_samples_final"][row : row + 1].float(),
                       backend=backend, threshold_single=ts, threshold_acc=ta)


def load_append_recording_run(path: str | Path):
    """The lab :class:`~ddtree_lab.step.Run` of an append-only recording: completed calls as
    :func:`~ddtree_lab.sglang.replay.recording_to_trace` converts them, then one step per row
    of each call that did not return (:func:`pending_steps`; their calls in
    ``run.metadata["did_not_return"]``); ``run.problems`` names a cut tail.

    Raises:
        as :func:`load_append_recording`.
    """
    from .replay import recording_to_trace

    recording, pending, problems = load_append_recording(path)
    run = recording_to_trace(recording)
    for s in run.steps:
        s.source = "sglang recording (append-only)"
    request_of = {r["request_id"]: r["request"] for r in run.metadata["requests"]}
    base = len(recording.steps)
    for k, call in enumerate(pending):
        run.steps.extend(pending_steps(call, base + k, request_of))
    known = {r["request_id"] for r in run.metadata["requests"]}
    for rid, q in request_of.items():
        if rid not in known:
            run.metadata["requests"].append({"request": q, "request_id": rid, "prompt": None, "prompt_token_ids": None,
                                             "params": None, "generated_token_ids": [], "finish_reason": None})
    run.problems.extend(problems)
    run.metadata["source"] = "sglang recording (append-only)"
    run.metadata["did_not_return"] = [c["call"] for c in pending]  # their rows: steps with extra["did_not_return"]
    return run
