"""The lab's rule on a recorded vLLM step, against the engine's own decisions.

vLLM verifies a chain with the target-only rule (``vllm/v1/sample/rejection_sampler.py``; the
draft probs are one-hot for ``dflash`` and ``ngram``): draft ``j`` is accepted when
``p_j(draft_j) >= u_j`` (the lab's walk: ``u < S``, the same but for ``u == p``), greedy requests
when the draft is the row's argmax. The token after the walk is drawn three ways, each replayed
from what the engine recorded, never from a new draw:

* **greedy**: the argmax of the row (the first of the row's recorded top-M ids);
* **recovered** (a sampled request rejected draft ``j``): vLLM's exponential race over the
  residual, ``argmax_v p_j(v) * inv_q(v)`` with the draft token's entry zeroed
  (``sample_recovered_tokens``), run by the lab on the engine's own ``p`` and ``inv_q`` at the
  race's recorded leading entrants (the whole row at the ``full`` level);
* **bonus** (a sampled request accepted every draft): vLLM's CPU sampler draws it with
  ``torch.ops._C.fused_gumbel_argmax`` (SplitMix64 Gumbel noise keyed by a recorded seed,
  compiled code the lab does not reimplement): not replayed; checked to lie in the row's support.

:func:`replay_differences` gives the lab's output on the step and every
:class:`~ddtree_lab.replaying.Difference` from the engine's, :func:`replay_run` a whole run.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from ..replaying import Difference, compare_outputs, stored_rows
from ..step import Run, Step
from ..verify import verify_sampled
from ..verify.types import BonusDraw, VerifyOutput
from .recording import row_probs

__all__ = ["RaceResult", "recovered_race", "replay_differences", "replay_run", "RunReplay"]


@dataclass(frozen=True)
class RaceResult:
    """The recovered-token race replayed at one row: ``token`` (the winner), ``score`` (its
    ``p * inv_q``), ``runner_up`` (the next entrant's token and score), ``entrants`` (how many
    were compared: R at the light level, V at the full level)."""

    token: int
    score: float
    runner_up: tuple[int, float]
    entrants: int


def recovered_race(step: Step, node: int) -> RaceResult:
    """vLLM's recovered-token race at row ``node`` of a recorded sampled step: the residual
    (the row with the draft token zeroed) times the engine's noise ``inv_q``, its argmax
    (``sample_recovered_tokens``). On the recorded entrants (the engine's ``p`` and ``inv_q`` at
    the R best scores), at the ``full`` level on the whole row.

    Raises:
        ValueError: the step records no race (a greedy or non-vLLM step), or ``node`` has no
            draft child.
    """
    v = step.extra.get("vllm") or {}
    where = f"step {step.step}, request {step.request}"
    if step.node_token_ids is None or node + 1 >= step.num_nodes:
        raise ValueError(f"{where}: node {node} has no draft child: no recovered token is drawn there")
    draft = int(step.node_token_ids[node + 1])
    if "inv_q" in v and "target_rows" in v:  # full level: the whole race
        row = torch.softmax(_t(v, "target_rows")[node].double(), -1)
        ids = torch.arange(row.shape[0])
        p, inv_q = row, _t(v, "inv_q").double()
    elif "race_ids" in v:
        ids, p, inv_q = _t(v, "race_ids")[node], _t(v, "race_p")[node].double(), _t(v, "race_inv_q")[node].double()
    else:
        raise ValueError(f"{where}: no recovered-token race recorded (a greedy request, or a recording without it)")
    score = torch.where(ids == draft, torch.zeros_like(p), p) * inv_q
    top = score.topk(min(2, score.shape[0]))
    runner = (int(ids[top.indices[1]]), float(top.values[1])) if score.shape[0] > 1 else (-1, float("nan"))
    return RaceResult(int(ids[top.indices[0]]), float(top.values[0]), runner, int(score.shape[0]))


def _t(v: dict, key: str) -> torch.Tensor:
    """A recorded value as a tensor (a loaded recording holds tensors, a bundle's JSON lists)."""
    x = v[key]
    return x if isinstance(x, torch.Tensor) else torch.as_tensor(x)


def _not_a_distribution(step: Step) -> Difference | None:
    """The first row the sampler read that is no distribution (NaN, or no finite logit), with
    the temperature the sampler applied there."""
    v = step.extra.get("vllm") or {}
    if v.get("processed_logits") is None or v.get("processed_lse") is None:
        return None
    logits, lse = _t(v, "processed_logits"), _t(v, "processed_lse")
    bad = torch.isnan(logits).any(-1) | ~torch.isfinite(lse)
    if not bad.any():
        return None
    node = int(bad.nonzero()[0, 0])
    applied = (v.get("params_applied") or {}).get("temperature") or []
    t = f"temperature {applied[node]:.6g} applied there" if node < len(applied) else "no applied temperature recorded"
    return Difference(0, "the row the sampler read", f"logsumexp {float(lse[node])}"
                      f"{', NaN logits' if bool(torch.isnan(logits[node]).any()) else ''} ({t})",
                      "a probability distribution (the walk cannot run on it)", node=node)


def replay_differences(step: Step) -> tuple[VerifyOutput, list[Difference]]:
    """The lab's rule on one recorded vLLM step: ``(lab output, differences from the engine's)``.

    The walk is the lab's reference verifier on the recorded verify rows and coins; the token
    after it is the engine's draw replayed (module docstring). A bonus draw the lab cannot
    replay (vLLM's Gumbel bonus) is taken from the engine when its token lies in the row's
    support, and a :class:`Difference` ``"bonus support"`` otherwise. A row the sampler read that
    is no distribution (NaN: e.g. a temperature of 0 applied to a sampled request) is the one
    :class:`Difference` ``"target row"`` (the walk cannot run on it).

    Raises:
        ValueError: not a vLLM step, or it stores nothing to replay.
    """
    where = f"step {step.step}, request {step.request}"
    v = step.extra.get("vllm")
    if v is None or step.output is None or step.coins is None:
        raise ValueError(f"{where}: not a recorded vLLM step with an output")
    vocab = int(_t(v, "processed_ids").max()) + 1 if v.get("processed_ids") is not None else 0
    assert step.node_token_ids is not None  # a recorded vLLM step always holds its chain
    vocab = max(vocab, int(step.node_token_ids.max()) + 1, step.bonus_token + 1)
    rows = stored_rows(step, vocab)
    broken = _not_a_distribution(step)
    if broken is not None:  # the walk cannot be replayed on such a row: the row is the finding
        return step.output, [broken]
    vi = step.verify_input()
    final = torch.zeros(1)
    walk = verify_sampled(vi, rows, step.coins[None], final)
    node = int(walk.bonus[0].node)
    engine = step.output
    engine_token = int(engine.bonus_token[0])
    diffs: list[Difference] = []
    greedy = bool(v.get("greedy"))
    k = step.num_nodes - 1
    recorded_bonus = engine.bonus[0]
    if greedy:  # the argmax of the row the engine read (greedy rows are not processed)
        token = int(_t(v, "processed_ids")[node, 0]) if v.get("processed_ids") is not None else engine_token
        draw = BonusDraw(step.request, node, token, recorded_bonus.kind, recorded_bonus.residual_mass,
                         recorded_bonus.coin, recorded_bonus.token_prob)
    elif node < k:
        token = recovered_race(step, node).token
        row = rows[0, node].double()
        mass = 1.0 - float(row[int(step.node_token_ids[node + 1])])
        draw = BonusDraw(step.request, node, token, "residual", mass, None,
                         _row_p(step, node, token) / mass if mass > 0 else float("nan"))
    else:
        p = _row_p(step, node, engine_token)
        if not p > 0.0:
            diffs.append(Difference(0, "bonus support", f"token {engine_token}", f"p = {p} in the row the sampler read",
                                    node=node))
        draw = BonusDraw(step.request, node, engine_token, "leaf", 1.0, None, p)
    emitted = walk.emitted_tokens.clone()
    emitted[0, int(walk.accept_length[0])] = draw.token
    lab = dataclasses.replace(walk, emitted_tokens=emitted, bonus_token=torch.tensor([draw.token]), bonus=[draw],
                              backend="reference (vLLM draws replayed)")
    return lab, diffs + compare_outputs(engine, lab)


def _row_p(step: Step, node: int, token: int) -> float:
    """``p_node(token)`` from the recorded rows (0 past the top-M; the sampler's own value for a
    draft token)."""
    if (step.node_token_ids is not None and node + 1 < step.num_nodes and int(step.node_token_ids[node + 1]) == token
            and step.child_probs is not None):
        return float(step.child_probs[node + 1])
    v = step.extra["vllm"]
    ids, logits, lse = _t(v, "processed_ids"), _t(v, "processed_logits"), _t(v, "processed_lse")
    hit = (ids[node] == token).nonzero()
    if len(hit) == 0:  # past the top-M: the recorder's own probability of the drawn token
        bonus = step.bonus
        return float(step.rows.final_row_prefix[token]) if (bonus is not None and bonus.node == node and step.rows
                                                             is not None and step.rows.final_row_prefix is not None
                                                             and token < step.rows.final_row_prefix.shape[0]) else 0.0
    return float(row_probs(logits[node], lse[node])[int(hit[0, 0])])


@dataclass
class RunReplay:
    """A whole recorded run replayed: ``steps`` replayed, ``agree`` (steps with no difference),
    ``differences`` (``(step, request, [Difference])`` of each other step), ``bonus_not_replayed``
    (Gumbel bonus draws checked for support only)."""

    steps: int = 0
    agree: int = 0
    differences: list[tuple[int, int, list[Difference]]] = field(default_factory=list)
    bonus_not_replayed: int = 0

    def text(self) -> str:
        lines = [f"{self.steps} steps of vLLM replayed with the lab's rule: {self.agree} agree with the engine, "
                 f"{len(self.differences)} differ"]
        if self.bonus_not_replayed:
            lines.append(f"{self.bonus_not_replayed} bonus draws by vLLM's Gumbel sampler checked for support only "
                         "(its compiled noise is not reimplemented)")
        for s, r, diffs in self.differences[:20]:
            lines.append(f"step {s}, request {r}: {diffs[0]}" + (f" (and {len(diffs) - 1} more)" if len(diffs) > 1 else ""))
        return "\n".join(lines)


def replay_run(run: Run) -> RunReplay:
    """:func:`replay_differences` on every step of a vLLM recording."""
    result = RunReplay()
    for s in run.steps:
        if s.extra.get("vllm") is None or s.output is None:
            continue
        _, diffs = replay_differences(s)
        result.steps += 1
        if not s.extra["vllm"].get("greedy") and int(s.output.accept_length[0]) == s.num_nodes - 1:
            result.bonus_not_replayed += 1
        if diffs:
            result.differences.append((s.step, s.request, diffs))
        else:
            result.agree += 1
    return result
