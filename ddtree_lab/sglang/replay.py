"""Replaying SGLang recordings with the lab's verifiers, and converting them to lab traces.

**One input path for every backend.** A sampled row is replayed from the target rows the
kernel read: every backend (reference, torch-lazy, Triton) gets their logarithms at
temperature 1 through :func:`ddtree_lab.verify.verify_tree`, so all verify the same
distribution (the recorded row renormalised; exact arithmetic's reading of a float32 row that
sums to ``1 - 2**-24``) and differ only in their implementation. Greedy rows are replayed with
one-hot logits at SGLang's ``target_predict`` through
:func:`~ddtree_lab.verify.verify_tree_greedy`. (The reference used to read the rows
as given and the other backends their renormalised logarithms: on a row whose drafted token
holds a float32 mass of ``1 - 2**-24`` and a coin equal to it, the reference rejected and the
others accepted, then reached a row the kernel never read.)

**Rows the kernel never read.** A sampled kernel reads the rows of its accepted path, and the
recorder keeps only those by default (``prob_rows="path"``). A target-only walk reads the rows
of the nodes it accepts, so where the lab accepts a node whose row was not recorded, the
recording does not determine what the lab does next: the replay compares the walk up to that
node, names it, and shows no lab bonus. Every backend gets the same placeholder (a uniform
row) there and the same treatment, so all backends classify a row alike.

**Verdicts.** Each replayed row is ``"agrees"``, ``"differs"`` (with ``explanation`` when a
by-design difference accounts for it: ``by_design``, printed by every verb in the one wording of
:func:`ddtree_lab.replaying.by_design_line` and never counted as a finding) or
``"not replayable"`` (SGLang ran something the lab does not implement: rejection sampling with
real draft probabilities, block verification).

Plain functions for the command line: :func:`replay_recording` (a recording or its path, a
backend -> results), :func:`replay_report` (the lines to print); :func:`ddtree_lab.io.convert` turns a recording
into a lab trace file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from ..buffers import DDTreeVerifyInput
from ..sampling import SamplingParams, target_probs
from ..verify import Decision, VerifyOutput, verify_sampled
from .recording import Recording, is_one_hot_chain, load_recording, step_parts

__all__ = [
    "ReplayResult",
    "replay_step",
    "replay_recording",
    "replay_report",
    "count_verdicts",
    "recording_to_trace",
    "output_differences",
]

VERDICTS = ("agrees", "differs", "not replayable")


@dataclass
class ReplayResult:
    """One recorded row replayed: SGLang's output and the lab's, and how they differ.

    Attributes:
        step: index of the verify call in the recording; row: the row in that call.
        request_id, kind: SGLang's request id and the kernel kind.
        backend: the lab backend that replayed it.
        verify_input: the row's buffers (batch of one).
        sglang: SGLang's output; lab: the lab's (None when not replayable), cut after
            ``unrecorded_node`` when the lab's walk reached a row the recording lacks.
        differences: one line per differing field (:func:`output_differences`).
        explanation: a known by-design difference that accounts for them, or why the row is
            not replayable (else empty).
        replayable: False when the lab does not implement what SGLang ran.
        unrecorded_node: the first node the lab accepted whose target row was not recorded
            (its walk after it is not compared), or None.
    """

    step: int
    row: int
    request_id: str
    kind: str
    backend: str
    verify_input: DDTreeVerifyInput
    sglang: VerifyOutput
    lab: VerifyOutput | None
    differences: list[str]
    explanation: str = ""
    replayable: bool = True
    unrecorded_node: int | None = None

    @property
    def agrees(self) -> bool:
        return self.replayable and not self.differences

    @property
    def verdict(self) -> str:
        """``"agrees"``, ``"differs"`` or ``"not replayable"``."""
        return "not replayable" if not self.replayable else "differs" if self.differences else "agrees"

    @property
    def by_design(self) -> bool:
        """A difference that a by-design explanation accounts for."""
        return self.verdict == "differs" and bool(self.explanation)


# ---- comparison ----------------------------------------------------------------------------------


def output_differences(sglang: VerifyOutput, lab: VerifyOutput, compare_bonus: bool = True) -> list[str]:
    """SGLang's output against the lab's, one line per differing field
    (:func:`ddtree_lab.replaying.compare_outputs`, the lab's one comparator, without decision logs:
    SGLang's kernels keep none), e.g. ``"accept_index: recorded [0] != replayed [0, 1]"``
    (recorded: SGLang; replayed: the lab). ``compare_bonus=False`` keeps only the accepted path
    and its length (the lab's bonus is not known)."""
    from ..replaying import compare_outputs

    lines = []
    for d in compare_outputs(sglang, lab, decisions=False):
        if compare_bonus or d.field in ("accept_index", "accept_length"):
            lines.append(str(d).removeprefix("request 0: "))
    return lines


# ---- replay --------------------------------------------------------------------------------------


def _greedy_logits(parts: dict, vi: DDTreeVerifyInput) -> torch.Tensor:
    predict = parts["target_predict"].long()
    vocab = int(max(int(predict.max()), int(vi.node_token_ids.max()))) + 1
    logits = torch.full((1, vi.num_rows, vocab), -torch.inf)  # one-hot target: p = 1 at the argmax
    logits.scatter_(-1, predict[..., None].clamp(min=0), 0.0)
    return logits


def _sampled_logits(parts: dict) -> torch.Tensor:
    """``log`` of the recorded rows; rows not recorded get a uniform placeholder (logits 0)."""
    probs, recorded = parts["target_probs"], parts["recorded_rows"]
    logits = probs.log()
    logits[0, ~recorded] = 0.0
    return logits


def _cut(out: VerifyOutput, node: int) -> VerifyOutput:
    """``out`` up to accepted node ``node``: the walk after it and the bonus are dropped."""
    path = [v for v in out.accept_index[0].tolist() if v >= 0]
    path = path[: path.index(node) + 1]
    kept: list[Decision] = []
    for d in out.decisions[0]:
        kept.append(d)
        if d.node == node and d.verdict == "accept":
            break
    width = out.accept_index.shape[1]
    accept = torch.full((1, width), -1, dtype=torch.int64)
    accept[0, : len(path)] = torch.tensor(path)
    emitted = torch.full_like(out.emitted_tokens, -1)
    drafted = [d.token for d in kept if d.verdict == "accept"]
    emitted[0, : len(drafted)] = torch.tensor(drafted, dtype=torch.int64)
    return VerifyOutput(accept_index=accept, accept_length=torch.tensor([len(path) - 1]), emitted_tokens=emitted,
                        bonus_token=torch.tensor([-1]), support_exhausted=torch.tensor([False]),
                        decisions=[kept], bonus=[], backend=out.backend, thresholds=out.thresholds, lossy=out.lossy)


def _explain(parts: dict, lab: VerifyOutput, sgl: VerifyOutput, s: int) -> str:
    """The by-design difference that accounts for ``lab`` vs ``sgl``, or ``""``."""
    lab_path = [v for v in lab.accept_index[0].tolist() if v >= 0]
    sgl_path = [v for v in sgl.accept_index[0].tolist() if v >= 0]
    bonus = int(sgl.bonus_token[0])
    if lab_path[: len(sgl_path)] == sgl_path and len(lab_path) > len(sgl_path) and len(sgl_path) == s:
        return (f"SGLang walks at most num_speculative_tokens - 1 = {s - 1} draft tokens; "
                "the lab walks to the leaf")
    if parts["kind"] == "greedy":
        return ""
    probs = parts["target_probs"][0]
    if lab_path == sgl_path and bool(lab.support_exhausted[0]):
        rule = "token V-1" if parts["kind"] == "chain" else "the last positive token, else V-1"
        return (f"empty residual after the rejections: SGLang emits {rule} (here {bonus}); "
                "the lab emits no bonus and reports support_exhausted")
    # the first node the lab accepted and SGLang did not
    common = 0
    while common + 1 < min(len(lab_path), len(sgl_path)) and lab_path[common + 1] == sgl_path[common + 1]:
        common += 1
    if common + 1 >= len(lab_path) or len(sgl_path) != common + 1:
        return ""
    parent, child = lab_path[common], lab_path[common + 1]
    vi = parts["verify_input"]
    nt, ns = vi.retrieve_next_token[0].tolist(), vi.retrieve_next_sibling[0].tolist()
    tokens = vi.node_token_ids[0].tolist()
    children, c = [], nt[parent]
    while c != -1 and c not in children:
        children.append(c)
        c = ns[c]
    p = [float(probs[parent, tokens[c]]) for c in children]
    held, row_mass = sum(p), float(probs[parent].double().sum())
    upto = children.index(child) + 1 if child in children else len(children)
    s_float = float(torch.tensor(p[:upto], dtype=torch.float32).cumsum(0)[-1]) if p else 0.0
    coin = float(parts["coins"][0, parent])
    if row_mass > 0 and abs(held - row_mass) <= 1e-9 * row_mass and coin >= s_float:
        p_bonus = float(probs[parent, bonus]) if 0 <= bonus < probs.shape[-1] else 0.0
        return (f"node {parent}'s children hold all of its row's mass (float32 sum {row_mass:.9g}); SGLang rejects "
                f"node {child} because coin {coin:.9g} is not < S = {s_float:.9g}, then draws token {bonus} from the "
                f"empty residual (target probability {p_bonus:g}); in exact arithmetic S = 1 > coin and the lab "
                f"accepts node {child}")
    return ""


def replay_step(step: dict, row: int, backend: str = "reference", step_index: int = 0) -> ReplayResult:
    """Replay recorded row ``row`` of ``step`` with the lab's verifier ``backend``
    (``"reference"``, ``"torch-lazy"``, ``"triton"``; module docstring).

    Raises:
        ValueError: the recorded inputs are invalid for the lab's verifiers (bad buffers,
            coins outside [0, 1), ...), naming the request and node.
    """
    from ..verify import verify_tree, verify_tree_greedy

    parts = step_parts(step, row)
    vi, sgl, kind = parts["verify_input"], parts["sglang_output"], parts["kind"]
    s = int(step["num_speculative_tokens"])

    def result(lab, diffs, explanation="", replayable=True, node=None):
        return ReplayResult(step_index, row, str(parts["request_id"]), kind, backend, vi, sgl, lab, diffs,
                            explanation, replayable, node)

    if kind == "chain" and (step.get("block_verification") or not is_one_hot_chain(step, row)):
        why = "block verification" if step.get("block_verification") else \
            "a chain with real draft probabilities (rejection sampling p/q)"
        return result(None, [], f"the lab's verifiers implement the target-only rule, SGLang ran {why}",
                      replayable=False)
    if kind == "greedy":
        lab = verify_tree_greedy(vi, _greedy_logits(parts, vi), backend=backend)
        diffs = output_differences(sgl, lab)
        return result(lab, diffs, _explain(parts, lab, sgl, s) if diffs else "")
    if step.get("block_verification"):
        return result(None, [], "the lab's verifiers implement the target-only rule, SGLang ran block verification",
                      replayable=False)
    threshold_single, threshold_acc = parts["thresholds"]
    lab = verify_tree(vi, _sampled_logits(parts), SamplingParams(temperature=1.0), parts["coins"],
                      parts["final_coins"], backend=backend, threshold_single=threshold_single,
                      threshold_acc=threshold_acc)
    path = [v for v in lab.accept_index[0].tolist() if v >= 0]
    missing = [i for i in path if not bool(parts["recorded_rows"][i])]
    if missing:
        node = missing[0]
        lab = _cut(lab, node)
        diffs = output_differences(sgl, lab, compare_bonus=False)
        why = _explain(parts, lab, sgl, s)
        note = (f"the lab accepted node {node}, whose target row SGLang's kernel never read (not recorded): "
                f"the lab's walk after node {node} is not compared")
        return result(lab, diffs, f"{why}; {note}" if why else "", node=node)
    diffs = output_differences(sgl, lab)
    return result(lab, diffs, _explain(parts, lab, sgl, s) if diffs else "")


def replay_recording(recording: Recording | Iterable[dict] | str | os.PathLike,
                     backend: str = "reference") -> list[ReplayResult]:
    """Replay every recorded row with the lab's verifier ``backend`` (:func:`replay_step`).

    ``recording``: a :class:`Recording`, its steps (dicts), or the path of a recording file
    (``NAME``, ``NAME.json`` or ``NAME.safetensors``, read by :func:`load_recording`).

    Raises:
        as :func:`load_recording` (a path) and :func:`replay_step`.
    """
    if isinstance(recording, (str, os.PathLike)):
        recording = load_recording(recording)
    steps = recording.steps if isinstance(recording, Recording) else list(recording)
    return [replay_step(step, r, backend, i) for i, step in enumerate(steps) for r in range(len(step["rows"]))]


def count_verdicts(results: Sequence[ReplayResult]) -> dict[str, int]:
    """``{"agrees", "differs", "by design", "not replayable"}`` counts (``by design`` is a
    part of ``differs``)."""
    counts = {v: sum(r.verdict == v for r in results) for v in VERDICTS}
    counts["by design"] = sum(r.by_design for r in results)
    return counts


def replay_report(results: Sequence[ReplayResult]) -> list[str]:
    """One line per replayed row, then the counts, e.g.
    ``"12 rows: 8 agree, 1 differs (1 by design), 3 not replayable"``."""
    from ..replaying import by_design_line

    lines = []
    for r in results:
        where = f"step {r.step} row {r.row} {r.request_id} {r.kind}"
        if r.by_design:  # the one wording every verb gives it (not a finding)
            lines.append(by_design_line(where, r.explanation) + "; " + "; ".join(r.differences))
            continue
        head = f"{where}: {r.verdict}"
        if r.differences:
            head += ": " + "; ".join(r.differences)
        if r.explanation:
            head += f" ({r.explanation})"
        lines.append(head)
    c = count_verdicts(results)
    differ = "differs" if c["differs"] == 1 else "differ"
    lines.append(f"{len(results)} rows: {c['agrees']} agree, {c['differs']} {differ} ({c['by design']} by design), "
                 f"{c['not replayable']} not replayable")
    return lines


# ---- lab traces ----------------------------------------------------------------------------------


def _params(sampling: dict, kind: str) -> SamplingParams:
    if kind == "greedy" or float(sampling.get("temperature", 1.0)) == 0.0:
        return SamplingParams(temperature=0.0)
    top_k = int(sampling.get("top_k", 0))
    return SamplingParams(temperature=float(sampling.get("temperature", 1.0)), top_k=top_k if top_k > 0 else 0,
                          top_p=float(sampling.get("top_p", 1.0)))


def recording_to_trace(recording: Recording, top_m: int = 16):
    """An SGLang recording as a lab :class:`ddtree_lab.step.Run` that the views, the
    command line and :func:`ddtree_lab.replay` read.

    One :class:`~ddtree_lab.step.Step` per recorded row whose lab replay the recording
    determines: ``step`` is the verify call's index in the recording, ``request`` the index of
    its request in ``metadata["requests"]`` (one entry per SGLang request id: the parameters,
    the prompt text and token ids where the recorder saw SGLang's ``Req`` (else None), and as
    ``generated_token_ids`` the root token of the request's first converted row followed by the
    tokens SGLang emitted in its converted rows). The output and decision log are the lab's reference verifier on the recorded rows
    (greedy rows: one-hot rows at SGLang's ``target_predict`` and coins 0, as a lab greedy
    session verifies; sampled rows: the recorded rows renormalised, as :func:`replay_step`).
    SGLang's own output, the replay verdict and any difference are in ``step.extra``. Built by
    :func:`ddtree_lab.record.record_step` (level ``full``, from probabilities: SGLang hands
    its kernels no logits). What SGLang does not record is marked, not invented: draft top-k
    empty, ``node_logws`` NaN, ``ranks`` -1, target rows the kernel never read zero. Rows not replayable, or whose lab
    walk reaches a row that was not recorded, are listed in ``metadata["skipped_rows"]``.
    """
    from ..buffers import decode_retrieve
    from ..build import DDTreeBuildResult
    from ..record import record_step
    from ..step import Run

    requests: dict[str, dict] = {}
    prompts = recording.metadata.get("prompts") or {}
    steps, skipped, vocab = [], [], 0
    for k, step in enumerate(recording.steps):
        for row in range(len(step["rows"])):
            parts = step_parts(step, row)
            rid, kind = str(parts["request_id"]), parts["kind"]
            sgl = parts["sglang_output"]
            known = prompts.get(rid, {})
            entry = requests.setdefault(rid, {"request": len(requests), "request_id": rid, "prompt": known.get("prompt"),
                                              "prompt_token_ids": known.get("prompt_token_ids"),
                                              "params": _params(parts["sampling"], kind).to_dict(),
                                              "generated_token_ids": [], "finish_reason": None})
            result = replay_step(step, row, "reference", k)
            if not result.replayable or result.unrecorded_node is not None:
                why = result.explanation if not result.replayable else (
                    f"the lab's walk reaches node {result.unrecorded_node}, whose target row was not recorded")
                skipped.append({"step": k, "call": parts["call"], "row": row, "request_id": rid, "why": why})
                continue
            vi = parts["verify_input"]
            n = int(vi.num_nodes[0])
            if not entry["generated_token_ids"]:  # the token before the first step (its root)
                entry["generated_token_ids"].append(int(vi.node_token_ids[0, 0]))
            entry["generated_token_ids"] += [t for t in sgl.emitted_tokens[0].tolist() if t >= 0]
            if kind == "greedy":
                logits = _greedy_logits(parts, vi)
                rows = torch.zeros_like(logits).masked_fill(logits == 0.0, 1.0)
                coins, final = torch.zeros(1, vi.num_rows), torch.zeros(1)
            else:
                rows = target_probs(_sampled_logits(parts), SamplingParams(temperature=1.0))
                rows[0, ~parts["recorded_rows"]] = 0.0
                coins, final = parts["coins"], parts["final_coins"]
            threshold_single, threshold_acc = parts["thresholds"]
            out = verify_sampled(vi, rows, coins, final, threshold_single=threshold_single,
                                 threshold_acc=threshold_acc)
            parents, depths = decode_retrieve(vi.retrieve_next_token, vi.retrieve_next_sibling, vi.num_nodes)
            if kind != "greedy":  # greedy rows are sized by the largest token id, not by V
                vocab = max(vocab, int(rows.shape[-1]))
            # what SGLang does not record is marked: ranks -1, node log-weights NaN, no draft top-k
            tree = DDTreeBuildResult(node_token_ids=vi.node_token_ids[:, :n], parents=parents[:, :n],
                                     depths=depths[:, :n], ranks=torch.full((1, n), -1, dtype=torch.int64),
                                     node_logws=torch.full((1, n), float("nan")), num_nodes=vi.num_nodes)
            steps.append(record_step(
                step=k, request=entry["request"], request_id=rid, params=_params(parts["sampling"], kind), output=out,
                level="full", prefix_len=int(vi.positions[0, 0]), tree=tree, buffers=vi, coins=coins[0],
                final_coin=float(final[0]), probs=rows[0], top_m=top_m, backend="reference",
                extra={"source": "sglang", "kernel": parts["kernel"], "kind": kind, "rank": parts["rank"],
                       "call": parts["call"], "row": row, "verdict": result.verdict,
                       "sglang_emitted": [t for t in sgl.emitted_tokens[0].tolist() if t >= 0],
                       "sglang_accept_length": int(sgl.accept_length[0]), "differences": result.differences,
                       "explanation": result.explanation, "by_design": result.by_design}))
    meta = {"source": "sglang recording", "recording": recording.metadata, "skipped_rows": skipped,
            "requests": list(requests.values()),
            "target": {"name": str(recording.metadata.get("target", "unknown (SGLang)"))}, "vocab_size": vocab or None,
            "generated_from": "the first converted row's root token, then SGLang's emitted tokens per converted row"}
    return Run(metadata=meta, steps=steps, token_texts={})
