"""The check only a recording from inside vLLM allows: the sampling parameters its sampler applied.

vLLM expands each request's temperature, top-k and top-p to one value per draft position
(``rejection_sampler.expand_batch_to_tokens``) before it processes the target rows; the recorder
keeps those values as the sampler used them (``extra["vllm"]["params_applied"]``). Each must be
the request's own: the temperature (``1`` for a greedy request in a batch that is not all
greedy: vLLM's ``replace_to``), top-k (off: ``<= 0`` or the vocabulary), top-p. A value that is
not is a finding with the step, the request, the position and both numbers; a wrong value
there changes every row the verifier reads, whatever the verifier does with them.
"""

from __future__ import annotations

import math

from ..diagnosis.common import CheckResult, Finding, group_findings, next_command
from ..step import Run, Step

__all__ = ["check_engine_parameters", "KIND"]

KIND = "the sampling parameters vLLM's sampler applied are not the request's"


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
    result.findings = group_findings(found)
    fixes = run.metadata.get("fixes") or {}
    if fixes:
        result.note = "recorded with the engine fixed: " + ", ".join(fixes)
    return result
