"""vLLM 0.33.0's new model runner's speculative sampling end to end on a CPU: its DFlash 2 walk
draws the chain and the sparse draft logits, its ``rejection_sample`` verifies them
(:mod:`ddtree_lab.engines.end_to_end` judges the law).

Rules (:data:`RULES`), each run in the vLLM worker (:func:`ddtree_lab.engines.vllm_worker.run_rule_request`):

* ``dflash2``: ``v1/worker/gpu/spec_decode/dflash2/speculator.py:CandidateSampler.sample`` --
  ``_selector_walk_kernel`` (Gumbel-max over the ``K`` candidates' lattice scores at the
  request's temperature, keyed by the request seed, the step and the position, the argmax at
  temperature 0) and ``_cache_draft_logits_kernel`` (the realized scores written into a
  ``-inf`` filled ``[reqs, gamma, V]`` draft logits buffer, pre-temperature) -- then
  ``rejection_sampler_utils.rejection_sample(draft_logits, use_block_verification=False)``, which
  divides the draft logits by the temperature itself; judged against the token-wise law.
* ``dflash2-block``: the same with ``use_block_verification=True``; judged against the block law.
* ``onehot``: ``rejection_sample(draft_logits=None)`` (one-hot drafts, as the runner verifies a
  drafter without draft logits) on the argmax chain of a per-step draft; token-wise law with
  one-hot ``q``.
* ``onehot-block``: the same with block verification (its closed-form one-hot residual mass);
  block law, which for one-hot ``q`` equals the token-wise one.

The target rows go through vLLM's own ``apply_temperature`` kernel and ``apply_top_k_top_p`` (its
PyTorch route) before the verify, in the order ``Sampler.apply_sampling_params`` applies them.
Randomness is vLLM's own: per request, a 62-bit seed drawn from the trial seed; the walk's and the
verify's noise are counter-based hashes of (seed, step, position).

What the lab writes, and so is not under the audit: the Markov target's rows after each drafted
prefix, the batch metadata (``cu_num_logits``, positions, index maps) that the runner's
``InputBatch`` would hold, and the lattice scores (a model's). ``RejectionSampler.__call__``
itself needs the runner's ``InputBatch`` and ``Sampler`` states and is not run
(docs/ENGINES.md).
"""

from __future__ import annotations

import torch

from ..sampling import SamplingParams
from .end_to_end import LogitsDraft, Rule, RuleCase, SelectorDraft, draft_paths

__all__ = ["RULES", "RULE_FAULTS", "Rule", "run_rule", "standard_case", "vllm_rules_unavailable_reason"]


RULES = {
    "dflash2": Rule("dflash2", "CandidateSampler.sample (_selector_walk_kernel, _cache_draft_logits_kernel)",
                    "rejection_sample(draft_logits, use_block_verification=False)", "token-wise",
                    ("q-temperature-1", "q-other-slot")),
    "dflash2-block": Rule("dflash2-block", "CandidateSampler.sample", "rejection_sample(draft_logits, "
                          "use_block_verification=True)", "block", ("q-temperature-1", "token-wise-verify")),
    "onehot": Rule("onehot", "argmax chain (given)", "rejection_sample(draft_logits=None)", "token-wise",
                   ("draft-logits-q",)),
    "onehot-block": Rule("onehot-block", "argmax chain (given)",
                         "rejection_sample(draft_logits=None, use_block_verification=True)", "block",
                         ("draft-logits-q",)),
}

#: Planted faults: what the lab changes between vLLM's draft side and its verify.
RULE_FAULTS = {
    "q-temperature-1": "the cached draft logits multiplied by T, so the verify (which divides by T) reads the "
                       "temperature-1 softmax of the scores while the walk sampled at T",
    "q-other-slot": "each step's draft logits row replaced by the next step's (the last keeps its own)",
    "token-wise-verify": "block mode configured, rejection_sample run with use_block_verification=False",
    "draft-logits-q": "the verify handed the drafter's step logits while the drafts were their argmax",
}


def vllm_rules_unavailable_reason() -> str | None:
    """Why the vLLM rules cannot run here (no vLLM venv), or None. Starts no process."""
    from .vllm import vllm_unavailable_reason

    return vllm_unavailable_reason()


def _rows(case: RuleCase, copies: int) -> list:
    for p in case.requests:
        if p.min_p:
            raise ValueError(f"{case.name}: min_p is not a parameter of these rules")
        if p.order != "top_k_then_top_p":
            raise ValueError(f"{case.name}: order {p.order!r}: vLLM applies top-k then top-p only")
    return [p for p in case.requests for _ in range(copies)]


def _tensors(rule: str, case: RuleCase, fault: str | None) -> dict:
    t = {"target_logits": case.target_logits.float(), "root": torch.tensor([case.root_token], dtype=torch.int64)}
    d = case.draft
    if rule.startswith("dflash2"):
        if not isinstance(d, SelectorDraft):
            raise ValueError(f"{case.name}: the DFlash 2 rules need a SelectorDraft")
        if all(p.is_greedy for p in case.requests):
            raise ValueError(f"{case.name}: every request is greedy: vLLM then keeps no draft logits and this rule "
                             "is not the path taken; add a sampled request")
        t["candidate_ids"], t["scores"] = d.candidate_ids.long(), d.scores.float()
        return t
    if not isinstance(d, LogitsDraft) or not d.greedy:
        raise ValueError(f"{case.name}: the one-hot rules need a LogitsDraft with greedy=True")
    (_, tokens, _), = draft_paths(case, case.requests[0])  # the argmax chain: one path
    t["draft_tokens"] = torch.tensor(tokens, dtype=torch.int64)
    if fault == "draft-logits-q":
        prev = [case.root_token] + tokens[:-1]
        t["fault_draft_logits"] = torch.stack([d.step_logits(s, prev[s]) for s in range(case.gamma)]).float()
    return t


def _run(worker, rule: str, fault: str | None, case: RuleCase, copies: int, seed: int) -> list:
    rows = _rows(case, copies)
    out = worker.rule("dflash2" if rule.startswith("dflash2") else "onehot", rule.endswith("block"),
                      _tensors(rule, case, fault), rows, seed, fault)
    sampled, n = out["sampled"], out["num_sampled"]
    got = [tuple(sampled[r, : int(n[r])].tolist()) for r in range(len(rows))]
    return [got[b * copies:(b + 1) * copies] for b in range(len(case.requests))]


def run_rule(rule: str, worker, fault: str | None = None):
    """The ``run(case, copies, trial_seed)`` callable :func:`ddtree_lab.engines.end_to_end.audit_rule`
    takes, for vLLM rule ``rule`` run by ``worker`` (a :class:`ddtree_lab.engines.vllm.VLLMWorker`),
    with an optional planted ``fault`` (:data:`RULE_FAULTS`).

    Raises:
        ValueError: an unknown rule, or a fault the rule does not take (when called: a case the
            rule cannot take).
    """
    if rule not in RULES:
        raise ValueError(f"unknown vLLM rule {rule!r}; known: {', '.join(RULES)}")
    if fault is not None and fault not in RULES[rule].faults:
        raise ValueError(f"rule {rule} takes the faults {', '.join(RULES[rule].faults)}, not {fault!r}")
    return lambda case, copies, seed: _run(worker, rule, fault, case, copies, seed)


def standard_case(rule: str, seed: int = 0, fault: str | None = None) -> RuleCase:
    """The case ``ddtree-lab audit --engine vllm:RULE`` and benchmarks/engine_audit.py audit
    ``rule`` on (with ``fault``: the case that fault is planted in): ``gamma = 3`` drafts over 6
    tokens; DFlash 2 with ``K = 3`` candidates, a sampled request (top-k / top-p for the
    token-wise rule) and a greedy one in one batch; one-hot drafts at two temperatures.

    Raises:
        ValueError: an unknown rule.
    """
    from .end_to_end import random_logits_case, random_selector_case

    sp = SamplingParams
    if rule not in RULES:
        raise ValueError(f"unknown vLLM rule {rule!r}; known: {', '.join(RULES)}")
    if rule == "dflash2":
        reqs = [sp(temperature=0.5)] if fault else [sp(temperature=0.7, top_k=4, top_p=0.9), sp(temperature=0.0)]
        return random_selector_case(seed, reqs)
    if rule == "dflash2-block":
        reqs = [sp(temperature=1.0 if fault == "token-wise-verify" else 0.5)] if fault else \
            [sp(temperature=1.3, top_p=0.9), sp(temperature=0.0)]
        return random_selector_case(seed, reqs)
    reqs = [sp(temperature=0.8)] if fault else [sp(temperature=0.8, top_k=4), sp(temperature=1.3)]
    return random_logits_case(seed, reqs, greedy_draft=True)
