"""Replaying: re-run a verifier on a recorded step and compare its output with the recorded one (the front door's ``ddtree_lab.replay`` is this module's :func:`replay`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .step import Step
from .verify import VerifyOutput, verify_sampled

__all__ = ["replay", "replay_differences", "compare_outputs", "stored_rows", "Difference", "ReplayMismatch",
           "BY_DESIGN", "by_design_line"]

#: The one wording of a documented by-design difference between an engine's verifier and the
#: lab's (docs/SGLANG.md, "Replaying a recording"): every verb prints it through
#: :func:`by_design_line`, and none counts it as a finding or a problem (exit status 0).
BY_DESIGN = "differs by design"


def by_design_line(where: str, explanation: str) -> str:
    """The line every verb prints for a by-design difference at ``where`` (e.g. ``"step 2,
    request 4"``): ``"step 2, request 4: differs by design (not a finding): <explanation>"``."""
    return f"{where}: {BY_DESIGN} (not a finding): {explanation}"


class ReplayMismatch(AssertionError):
    """Replaying a step gave a different output than the one recorded (``.differences``)."""

    def __init__(self, message: str, differences: Sequence["Difference"] = ()):
        super().__init__(message)
        self.differences = list(differences)


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
                    present = w if w is not None else g
                    assert present is not None  # k < max(len(got), len(want)): one of them has decision k
                    out.append(Difference(b, f"decision {k}", None if w is None else (w.node, w.token, w.verdict),
                                          None if g is None else (g.node, g.token, g.verdict), k,
                                          present.node))
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


def stored_rows(step: Step, vocab: int) -> torch.Tensor:
    """A ``[1, n, V]`` float32 row tensor holding exactly what a step stores: each node's token
    probability in its parent's row (NaN, "not read", left 0), and the bonus row's prefix (when
    the step has a bonus draw). Every other entry is 0."""
    child_probs, parents, tokens = step.child_probs, step.parents, step.node_token_ids
    if child_probs is None or parents is None or tokens is None:
        raise ValueError(f"step {step.step}, request {step.request}: no "
                         f"{'tree' if parents is None or tokens is None else 'child_probs'} stored: no rows to rebuild")
    n = step.num_nodes
    rows = torch.zeros(1, n, vocab, dtype=torch.float32)
    prefix = step.final_row_prefix
    bonus = step.bonus
    if prefix is not None and prefix.numel() and bonus is not None:
        rows[0, bonus.node, : prefix.shape[0]] = prefix
    known = ~torch.isnan(child_probs)
    known[0] = False
    idx = known.nonzero()[:, 0]
    rows[0, parents[idx], tokens[idx]] = child_probs[idx]
    return rows


def _tolerance(step: Step):
    if not step.backend.startswith("triton"):
        return None
    from .verify import PROB_ATOL, PROB_RTOL

    return (PROB_ATOL, PROB_RTOL)


#: engine (a step's ``extra["source"]``, kept through bundles) -> its own replay, for engines that
#: draw the token after the walk with noise of their own (vLLM): ``replay(step) -> (output,
#: differences)``; an engine registers itself where its steps are made
#: (:mod:`ddtree_lab.vllm.recording`), so replay needs no import of it
ENGINE_REPLAYS: dict[str, Callable[[Step], tuple[VerifyOutput, list[Difference]]]] = {}


def replay_differences(step: Step, vocab_size: int | None = None,
                       backend: str = "reference") -> tuple[VerifyOutput, list[Difference]]:
    """Re-run the reference verifier on a stored step: ``(replayed output, differences)``
    (:func:`compare_outputs` against the recorded output; Triton steps compare probabilities
    within the kernel's tolerance, everything else bit for bit). A step whose source registered
    a replay of its own (:data:`ENGINE_REPLAYS`: vLLM's recordings) is replayed by it.

    Raises:
        ValueError: the step stores no rows to replay (level ``off``), or its buffers are
            broken (naming step, request and the problem).
    """
    where = f"step {step.step}, request {step.request}"
    own = ENGINE_REPLAYS.get(str(step.extra.get("source")))
    if own is not None and backend == "reference":
        return own(step)
    if step.output is None or step.buffers is None:
        raise ValueError(f"{where}: recorded at level {step.level!r} ({step.source}): nothing to replay: it records no "
                         f"{' and no '.join(n for n in ('verify output', 'buffers') if getattr(step, 'output' if n == 'verify output' else 'buffers') is None)}")
    if step.rows is None or step.rows.cannot("replay") or step.coins is None:
        raise ValueError(f"{where}: recorded at level {step.level!r}: no verify rows to replay")
    if backend != "reference":
        other = ("or replay the SGLang recording it was converted from, whose rows every backend reads"
                 if step.extra.get("source") == "sglang" else
                 f"or audit backend {backend!r} on it with the target recomputing the whole rows "
                 f"(ddtree-lab audit TRACE --step {step.step} --request {step.request} --model default "
                 f"--verifier {backend})")
        raise ValueError(f"{where}: backend {backend!r} needs the whole target rows, and this step keeps "
                         f"{(step.rows.cannot('full rows') or '').split(' keep ', 1)[-1]}; "
                         f"replay it with backend 'reference' (bit-exact), {other}")
    tokens, prefix = step.node_token_ids, step.final_row_prefix
    assert prefix is not None  # rows.cannot("replay") is None: child_probs and final_row_prefix are kept
    if tokens is None:
        raise ValueError(f"{where}: no tree stored: nothing to replay")
    tops = [int(tokens.max()), prefix.shape[0] - 1]
    vocab = vocab_size or max(tops) + 1
    if max(tops) >= vocab:
        raise ValueError(f"{where}: token id {max(tops)} is outside the vocabulary of {vocab}")
    from .buffers import find_retrieve_problem

    vi, rows = step.verify_input(), stored_rows(step, vocab)
    problem = find_retrieve_problem(vi.retrieve_next_token, vi.retrieve_next_sibling, vi.num_nodes,
                                    retrieve_index=vi.retrieve_index, depths=vi.depths)
    if problem is not None:
        raise ReplayMismatch(f"{where}: recorded buffers are broken: {problem}")
    coins = step.coins[None]
    final = torch.tensor([0.0 if step.final_coin is None else step.final_coin], dtype=torch.float32)
    tol = _tolerance(step)
    mass = step.final_mass if prefix.numel() else None
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


def replay(step: Step, backend: str = "reference", vocab_size: int | None = None, check: bool = True) -> VerifyOutput:
    """Re-run a verifier on a stored step (any source :func:`ddtree_lab.io.load` opens: lab
    traces, bundles, converted SGLang recordings).

    Only ``backend="reference"`` runs on the stored rows (they hold what the verifier read,
    not whole rows); another backend is refused with a message that says so.

    Steps recorded with the Triton backend compare indices, tokens, coins and verdicts bit for
    bit and probabilities within the kernel's stated tolerance; every other backend bit for
    bit. (Traces store probabilities, not logits, so replay runs the reference verifier.)

    Greedy requests are verified with one-hot rows, as the live session does (the rule then
    accepts exactly the argmax child). With ``check`` (default), raise
    :class:`ReplayMismatch` naming the first difference (all of them in ``.differences``).

    Raises:
        ReplayMismatch: (``check``) the replay differs, or the recorded buffers are broken.
        ValueError: the step stores nothing to replay (level ``off``, or a source without
            rows), or a backend other than the reference.
    """
    out, diffs = replay_differences(step, vocab_size, backend)
    if check and diffs:
        more = f" (and {len(diffs) - 1} more)" if len(diffs) > 1 else ""
        raise ReplayMismatch(f"step {step.step}, request {step.request}: {diffs[0]}{more}", diffs)
    return out
