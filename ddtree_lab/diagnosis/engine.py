"""The checks only a recording from inside an engine (vLLM) allows: its sampler's own inputs, held to three laws.

* **parameters**: vLLM expands each request's temperature, top-k and top-p to one value per draft
  position (``rejection_sampler.expand_batch_to_tokens``) before it processes the target rows;
  the recorder keeps those values as the sampler used them (``extra["vllm"]["params_applied"]``).
  Each must be the request's own: the temperature (``1`` for a greedy request in a batch that is
  not all greedy: vLLM's ``replace_to``), top-k (off: ``<= 0`` or the vocabulary), top-p;
* **rows**: temperature, top-k and top-p keep a row's argmax, so the row the verifier read at
  draft position ``j`` has the argmax of the raw row ``j`` the model produced (ties excepted); a
  row whose argmax is another position's names rows read at the wrong position;
* **residual**: the token vLLM draws after rejecting draft ``j`` comes from the residual, whose
  probability of that draft is 0: it is never the rejected draft itself.

A departure is a finding with the step, the request, the position and the numbers.
"""

from __future__ import annotations

import math

from .common import CheckResult, Finding, group_findings, next_command
from ..step import Run, Step

__all__ = ["check_engine_parameters", "KIND", "KIND_ROWS", "KIND_RESIDUAL"]

KIND = "the sampling parameters vLLM's sampler applied are not the request's"
KIND_ROWS = "the verifier read target rows of another draft position"
KIND_RESIDUAL = "the token drawn after a rejection is the rejected draft (no residual)"


def _expected(name: str, params: dict, greedy: bool, vocab: int | None):
    """What vLLM should apply for ``name``: a value, or a predicate for top-k's off values."""
    if name == "temperature":
        return 1.0 if greedy else float(params.get("temperature") or 0.0)
    if name == "top_p":
        return float(params.get("top_p") or 1.0)
    k = int(params.get("top_k") or 0)
    return (lambda v: v <= 0 or (vocab is not None and v >= vocab)) if k <= 0 else float(k)


def _same(want, got: float) -> bool:
    if callable(want):
        return bool(want(got))
    return math.isfinite(got) and abs(got - want) <= 1e-6 * max(1.0, abs(want))


def check_engine_parameters(run: Run, steps: list[Step] | None = None) -> CheckResult:
    """Every recorded per-position parameter of vLLM's sampler against the request's (module
    docstring). Runs on vLLM recordings only; says why not elsewhere."""
    steps = run.steps if steps is None else steps
    mine = [s for s in steps if (s.extra.get("vllm") or {}).get("params_requested") is not None]
    result = CheckResult("engine-parameters", ran=False)
    if not mine:
        result.why = "no step records the parameters vLLM's sampler applied (not a vLLM recording)"
        return result
    result.ran = True
    found = []
    for s in mine:
        v = s.extra["vllm"]
        applied = v.get("params_applied") or {}
        params, greedy = v["params_requested"], bool(v.get("greedy"))
        if not applied:  # an all-greedy batch: vLLM applies no parameter (argmax of the raw rows)
            result.checked += 1
            continue
        for name, values in applied.items():
            want = _expected(name, params, greedy, run.vocab_size)
            result.checked += len(values)
            bad = [j for j, x in enumerate(values) if not _same(want, float(x))]
            if not bad:
                continue
            j = bad[0]
            asked = "greedy (vLLM applies 1)" if greedy and name == "temperature" else \
                f"{params.get(name)!r}" + (" (off)" if callable(want) else "")
            found.append(Finding("engine-parameters", KIND, None, s.step, s.request, j + 1,
                                 f"draft position {j}: vLLM's sampler applied {name} {float(values[j]):.6g} where the "
                                 f"request asked {asked}; {len(bad)} of {len(values)} positions of this step differ "
                                 f"({name} applied: {', '.join(f'{float(x):.3g}' for x in values[:4])}"
                                 f"{', ...' if len(values) > 4 else ''})", "high",
                                 next_command("engine-parameters", s.step, s.request)))
            break
    wrong = {(f.step, f.request) for f in found}
    result.per_step = {key: KIND for key in wrong}
    for s in mine:
        if (s.step, s.request) not in wrong:  # wrong parameters break both laws: a consequence, not a second bug
            found += _rows(s) + _residual(s)
    result.findings = group_findings(found)
    notes = []
    if wrong:
        notes.append(f"{len(wrong)} step(s) with wrong parameters not judged on the rows and residual laws "
                     "(their rows follow from those parameters)")
    fixes = run.metadata.get("fixes") or {}
    if fixes:
        notes.append("recorded with the engine fixed: " + ", ".join(fixes))
    result.note = "; ".join(notes)
    return result


def _rows(s: Step) -> list[Finding]:
    """The rows law (module docstring) on one step."""
    v, rows = s.extra["vllm"], s.rows
    if rows is None or rows.row_logit_ids is None or rows.row_logits is None or "processed_ids" not in v:
        return []
    import torch

    proc_logits = torch.as_tensor(v["processed_logits"])
    raw_ids, raw_logits, proc = rows.row_logit_ids, rows.row_logits, torch.as_tensor(v["processed_ids"])[:, 0]
    n = min(len(proc), len(raw_ids))
    for j in range(n):
        got = int(proc[j])
        if got == int(raw_ids[j, 0]) or not bool(proc_logits[j, 0].isfinite()):
            continue
        hit = (raw_ids[j] == got).nonzero()
        if len(hit) and float(raw_logits[j, int(hit[0, 0])]) >= float(raw_logits[j, 0]) - 1e-6:
            continue  # a tie in the raw row
        other = [i for i in range(n) if i != j and int(raw_ids[i, 0]) == got]
        where = (f"it is the raw argmax of position {other[0]} ({'next' if other[0] == j + 1 else 'another'} "
                 "position)") if other else "no position's raw row has it"
        return [Finding("engine-parameters", KIND_ROWS, None, s.step, s.request, j,
                        f"position {j}: the row the sampler read has argmax {got}, the raw row of that position "
                        f"{int(raw_ids[j, 0])} (temperature, top-k and top-p keep the argmax); {where}", "high",
                        next_command("engine-parameters", s.step, s.request))]
    return []


def _residual(s: Step) -> list[Finding]:
    """The residual law (module docstring) on one step."""
    v = s.extra["vllm"]
    if v.get("greedy") or s.output is None or s.node_token_ids is None or s.coins is None:
        return []
    j = int(s.output.accept_length[0])
    if j >= s.num_nodes - 1:
        return []
    draft, drawn = int(s.node_token_ids[j + 1]), int(s.output.bonus_token[0])
    if drawn != draft:
        return []
    return [Finding("engine-parameters", KIND_RESIDUAL, None, s.step, s.request, j + 1,
                    f"draft position {j}: vLLM rejected draft {draft} (coin {float(s.coins[j]):.4g} against p "
                    f"{float(s.child_probs[j + 1]) if s.child_probs is not None else float('nan'):.4g}) and then drew "
                    f"{drawn}, the same token; the residual gives it probability 0", "high",
                    next_command("engine-parameters", s.step, s.request))]
