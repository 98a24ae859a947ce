"""Check: greedy requests: each verdict takes the argmax of the recorded raw logits, and greedy DDTree equals plain greedy decoding.

Without a model: in every greedy step stored at level ``full``, an accepted child's token must
be the argmax of its parent's stored raw logits (lowest id on ties; the request's banned tokens
left out), no rejected child may be
that argmax, the bonus is the final node's argmax, and the support is never exhausted.
With a model: the request's generated tokens against plain greedy decoding of its prompt
(:meth:`ddtree_lab.models.TargetModel.greedy_decode`); the first token where they differ is
named, unless plain decoding's top two logits there are within float noise
(:data:`TIE_MARGIN`), which is said and not counted.
"""

from __future__ import annotations

from ..faults import SAMPLING_FAULTS
from ..step import Run, Step
from .common import CheckResult, Finding, group_findings, next_command

__all__ = ["check_greedy", "greedy_step", "check_greedy_decoding", "TIE_MARGIN"]

#: A divergence from plain greedy decoding where its top two logits are closer than this is
#: float noise between two forwards (tree vs causal), not a bug.
TIE_MARGIN = 1e-3


def greedy_step(step: Step) -> tuple[int | None, str] | None:
    """The first broken greedy invariant of one step ``(node, evidence)``, or None."""
    if step.params is None:
        raise ValueError(f"step {step.step}, request {step.request}: no sampling parameters recorded")
    if step.row_logit_ids is None:
        raise ValueError(f"step {step.step}, request {step.request}: no raw logits recorded (row_logit_ids, "
                         "level full)")
    banned = set(step.params.banned_token_ids)
    argmax = [next((t for t in row if t not in banned), -1) for row in step.row_logit_ids.tolist()]
    for d in step.decisions:
        best = argmax[d.parent]
        if d.verdict == "accept" and d.token != best:
            return d.node, f"accepted token {d.token} at node {d.node}, but its parent's argmax is {best}"
        if d.verdict == "reject" and d.token == best:
            return d.node, f"rejected node {d.node} whose token {d.token} is its parent's argmax"
    if step.output is not None and bool(step.output.support_exhausted[0]):
        return None, "a greedy request ended with an exhausted support"
    b = step.bonus
    if b is not None and b.token != argmax[b.node]:
        return b.node, f"bonus {b.token} at node {b.node}, but that node's argmax is {argmax[b.node]}"
    return None


def check_greedy(run: Run, steps: list[Step] | None = None) -> CheckResult:
    """:func:`greedy_step` on every greedy step stored at level ``full``."""
    steps = run.steps if steps is None else steps
    result = CheckResult("greedy", ran=False)
    found = []
    for s in steps:
        if s.params is None or not s.params.is_greedy or s.row_logit_ids is None or s.output is None:
            continue
        result.checked += 1
        got = greedy_step(s)
        if got is None:
            continue
        node, evidence = got
        banned = set(s.params.banned_token_ids) & set(s.emitted)
        fault = "sampling-banned-token-kept" if banned else None
        kind = SAMPLING_FAULTS[fault] if fault else "greedy verify did not take the target's argmax"
        if banned:
            evidence += f" (the request bans {sorted(banned)[0]}, emitted here)"
        result.per_step[(s.step, s.request)] = fault or "unknown"
        found.append(Finding("greedy", kind, fault, s.step, s.request, node, evidence, "high",
                             next_command("greedy", s.step, s.request)))
    result.ran = result.checked > 0
    if not result.ran:
        result.why = ("the run has no greedy step" if not any(s.params is not None and s.params.is_greedy for s in steps)
                      else "no greedy step stores its raw logits (level full)")
    result.findings = group_findings(found)
    return result


def check_greedy_decoding(run: Run, target, max_tokens: int = 256) -> CheckResult:
    """Every greedy request's generated tokens against plain greedy decoding of its prompt.

    A request is greedy when its recorded parameters say temperature 0 or, in a run whose steps
    record none (DDTree reference traces), when its file records, or the user stated,
    temperature 0 (:mod:`ddtree_lab.io.decoding_mode`); a request whose mode is unknown is not
    compared, and said so. The finding names the request, the first differing token (its index
    among the generated tokens and its position in the sequence, prompt included), the recorded
    token id and the target's argmax there, both decoded.

    Args:
        run: a run whose metadata holds each request's prompt and generated token ids.
        target: the :class:`ddtree_lab.models.TargetModel` it was recorded with.
        max_tokens: compare at most this many tokens per request.
    """
    import torch

    result = CheckResult("greedy-decoding", ran=False)
    reqs = run.metadata.get("requests") or []
    notes = []
    vocab = int(target.vocab_size)

    def text(token: int) -> str:
        return run.token_texts.get(int(token)) or target.token_text(token)

    for i, r in enumerate(reqs):
        req = int(r.get("request", i))
        params = r.get("params") or {}
        temperature = params.get("temperature") if r.get("params") else r.get("temperature")
        if not r.get("generated_token_ids"):
            continue
        if temperature is None:
            notes.append(f"request {req}: greedy or sampled is unknown (not compared; state it: --temperature T)")
            continue
        if float(temperature) != 0.0:
            continue
        if params.get("banned_token_ids"):
            notes.append(f"request {req}: bans tokens; plain greedy decoding applies no bans, not compared")
            continue
        if not r.get("prompt_token_ids"):
            notes.append(f"request {req}: the run has no prompt token ids (not compared)")
            continue
        got = list(r["generated_token_ids"])[:max_tokens]
        prompt = list(r["prompt_token_ids"])
        outside = next((t for t in prompt + got if not 0 <= int(t) < vocab), None)
        if outside is not None:
            notes.append(f"request {req}: token id {outside} is outside the target's vocabulary ({vocab} ids): not a "
                         "run of this target (not compared)")
            continue
        want = target.greedy_decode(prompt, len(got), stop_at_eos=False)
        result.checked += 1
        k = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if k is None:
            continue
        _, _, logits = target.prefill(prompt + got[:k])
        top = torch.topk(logits[-1].float(), 2).values
        margin = float(top[0] - top[1])
        if margin < TIE_MARGIN:
            notes.append(f"request {req}: token {k} differs at a float tie (margin {margin:.2g})")
            continue
        step = _step_of(run, req, len(prompt) + k)
        found = Finding("greedy-decoding", "greedy DDTree differs from plain greedy decoding", None, step,
                        req, None,
                        f"generated token {k} (position {len(prompt) + k}, prompt included) is {got[k]} "
                        f"({text(got[k])!r}), the target's argmax there is {want[k]} ({text(want[k])!r}; "
                        f"margin {margin:.3g})", "high", next_command("greedy", step, req))
        result.findings.append(found)
    result.ran = result.checked > 0
    result.note = "; ".join(notes)
    if not result.ran:
        result.why = result.note or "no greedy request with generated tokens in the run's metadata"
    return result


def _step_of(run: Run, request: int, position: int) -> int | None:
    """The step whose emitted tokens hold the committed position ``position`` (None: the
    prefill's first token)."""
    for s in sorted(run.for_request(request), key=lambda s: s.step):
        if s.prefix_len is not None and s.prefix_len + 1 <= position <= s.prefix_len + len(s.emitted):
            return s.step
    return None
