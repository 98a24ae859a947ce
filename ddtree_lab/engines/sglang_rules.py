"""SGLang's sampled-verify rules end to end on a CPU: its draft-side sampler draws the chain and
``q``, its verify consumes them (:mod:`ddtree_lab.engines.end_to_end` judges the law).

Rules (:data:`RULES`), each a path the installed sglang 0.5.23 takes on a CPU:

* ``dflash2-dspark``: DFlash 2's selector walk ``CandidateSelector.sample_path`` (its torch
  path: inverse CDF over ``softmax(scores / T)``, greedy rows the argmax, ``q_rows`` the rows
  it sampled from) on the lattice scores, ``q_rows`` scattered into a dense ``[bs, gamma, V]``
  row as ``DFlashWorkerV2._selector_sampling_accept`` does, then DSpark's
  ``dspark_accept.accept_sampling`` (target rows by ``SoftmaxTemp`` or
  ``build_speculative_verify_target_probs`` with top-k / top-p, then
  ``chain_speculative_sampling_triton`` with the real ``q``, in Triton's interpreter); judged
  against the token-wise law.
* ``dflash2-dspark-block``: the same with ``block_verification=True`` (the kernel's Algorithm 2
  branch); judged against the block law.
* ``blockwise-rejection``: DSpark's draft step ``MarkovSampleStep.torch`` (Gumbel-max over the
  step logits at the draft temperature, Philox noise) step by step with a bias by the previous
  token, its step logits kept, then ``blockwise_rejection_torch`` with those draft logits at
  the draft temperature; judged against the token-wise law.
* ``blockwise-rejection-onehot``: the argmax draft (``MarkovSampleStep`` with no sampled rows)
  and ``blockwise_rejection_torch(draft_logits=None)``; token-wise law with one-hot ``q``.

Randomness is the engine's own: the selector's uniforms from ``torch.rand`` and
``accept_sampling``'s coins from the global torch generator (seeded per trial with
``torch.manual_seed``), DSpark's Philox draft noise keyed per trial, and the block-wise
rejection's generator from ``make_rejection_noise(trial seed)``.

Where the installed module cannot be imported here (``sglang.srt.models.dflash``,
``dspark_accept``: their imports reach torchvision / tvm_ffi), its file is run statement by
statement by :mod:`ddtree_lab.engines.source`; the failing imports are named in
:func:`rule_sources`. Sampling parameters are handed over as SGLang's ``SamplingBatchInfo``
holds them: greedy requests as temperature 1 and top-k 1, top-k off as ``1 << 30``.

What the lab writes itself, and so is not under audit: the Markov target's logits for each
row (a function of the drafted prefix), the loop over draft steps around ``MarkovSampleStep``
(``draft_markov_block`` imports the scheduler), and the dense-``q`` scatter (three lines of
``_selector_sampling_accept``, a method of a worker that cannot be built here).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from types import SimpleNamespace

import torch

from .end_to_end import LogitsDraft, Rule, RuleCase, SelectorDraft

__all__ = ["RULES", "RULE_FAULTS", "Rule", "rule_sources", "sglang_rules_unavailable_reason", "run_rule", "standard_case"]

#: SGLang's top-k "off" value (``sampling_params.TOP_K_ALL``).
TOP_K_ALL = 1 << 30


RULES = {
    "dflash2-dspark": Rule("dflash2-dspark", "CandidateSelector.sample_path (torch path)",
                           "dspark_accept.accept_sampling -> chain_speculative_sampling_triton", "token-wise",
                           ("q-temperature-1", "q-other-slot")),
    "dflash2-dspark-block": Rule("dflash2-dspark-block", "CandidateSelector.sample_path (torch path)",
                                 "accept_sampling(block_verification=True)", "block",
                                 ("q-temperature-1", "token-wise-verify")),
    "blockwise-rejection": Rule("blockwise-rejection", "MarkovSampleStep.torch at the draft temperature",
                                "blockwise_rejection_torch (draft logits)", "token-wise",
                                ("draft-temperature-1", "one-hot-q")),
    "blockwise-rejection-onehot": Rule("blockwise-rejection-onehot", "MarkovSampleStep.torch argmax",
                                       "blockwise_rejection_torch (draft_logits=None)", "token-wise",
                                       ("draft-logits-q",)),
}

#: Planted faults: what the lab changes between the engine's draft side and its verify.
RULE_FAULTS = {
    "q-temperature-1": "q_rows from the walk at temperature 1 while the tokens were walked at the request's",
    "q-other-slot": "each slot's q row replaced by the next slot's (the last keeps its own)",
    "token-wise-verify": "block mode configured, the token-wise kernel branch run (block_verification=False)",
    "draft-temperature-1": "the verify told draft temperature 1 while the draft sampled at the request's",
    "one-hot-q": "the verify told the draft was one-hot (draft_logits=None) while it was sampled",
    "draft-logits-q": "the verify handed the draft logits while the draft was their argmax",
}

_ENTRY: dict = {}


def _entry_points(group: str) -> dict:
    """SGLang's functions the rules of ``group`` call (``"dspark"``: the block-wise rejection and
    the Markov draft step, plain imports; ``"dflash2"``: the selector and ``accept_sampling``, run
    from their installed files), loaded once."""
    if group in _ENTRY:
        return _ENTRY[group]
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if group == "dspark":
        from sglang.kernels.ops.speculative.dspark import blockwise_rejection, markov_sample

        _ENTRY[group] = {"MarkovSampleStep": markov_sample.MarkovSampleStep,
                         "blockwise_rejection_torch": blockwise_rejection.blockwise_rejection_torch,
                         "BlockwiseRejection": blockwise_rejection.BlockwiseRejection,
                         "make_rejection_noise": blockwise_rejection.make_rejection_noise, "sources": []}
        return _ENTRY[group]
    from .source import load_module_source

    models = load_module_source("sglang.srt.models.dflash")
    sampler = load_module_source("sglang.srt.layers.sampler")
    utils = load_module_source("sglang.srt.speculative.dflash_utils",
                               provide={"top_p_normalize_probs_torch": sampler["top_p_normalize_probs_torch"]})
    accept = load_module_source("sglang.kernels.ops.speculative.dspark.dspark_accept", provide={
        "build_speculative_verify_target_probs": utils["build_speculative_verify_target_probs"],
        "_get_or_create_chain_verify_buffers": utils["_get_or_create_chain_verify_buffers"]})
    _ENTRY[group] = {"CandidateSelector": models["CandidateSelector"], "accept_sampling": accept["accept_sampling"],
                     "AcceptSampling": accept["AcceptSampling"],
                     "sources": [models, sampler, utils, accept]}
    return _ENTRY[group]


def _group(rule: str) -> str:
    return "dflash2" if rule.startswith("dflash2") else "dspark"


def sglang_rules_unavailable_reason(rule: str = "dflash2-dspark") -> str | None:
    """Why SGLang rule ``rule`` cannot run here (sglang missing, an entry point gone), or None."""
    try:
        _entry_points(_group(rule))
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return None


def rule_sources() -> list[str]:
    """One line per installed file run by :mod:`ddtree_lab.engines.source`: its path, SHA-256,
    the imports cut and the changes."""
    out = []
    for s in _entry_points("dflash2")["sources"]:
        cut = sorted({line.split(" import ")[0].removeprefix("from ") for _, line, _ in s.skipped if "import" in line})
        out.append(f"{s.module} ({s.path.name}, sha256 {s.sha256[:12]}): {len(s.skipped)} statements skipped "
                   f"(imports of {', '.join(cut) or 'nothing'}); {'; '.join(s.changes) or 'no changes'}")
    return out


def _sglang_params(case: RuleCase, copies: int):
    temps, top_ks, top_ps = [], [], []
    for p in case.requests:
        if p.min_p:
            raise ValueError(f"{case.name}: min_p is not a parameter of these rules")
        temps.append(1.0 if p.is_greedy else float(p.temperature))
        top_ks.append(1 if p.is_greedy else (int(p.top_k) if p.top_k > 0 else TOP_K_ALL))
        top_ps.append(1.0 if p.is_greedy else float(p.top_p))
    rep = lambda xs, dt: torch.tensor(xs, dtype=dt).repeat_interleave(copies)  # noqa: E731
    return rep(temps, torch.float32), rep(top_ks, torch.int32), rep(top_ps, torch.float32)


def _target_logits(case: RuleCase, candidates: torch.Tensor) -> torch.Tensor:
    """``[bs * (gamma + 1), V]``: row ``i`` of request ``r`` after its drafted prefix."""
    g = case.gamma
    rows = case.target_logits.to(candidates.device)[torch.arange(g + 1, device=candidates.device)[None, :],
                                                    candidates[:, : g + 1]]
    return rows.reshape(-1, case.vocab_size).float().contiguous()


def _split(out: list, case: RuleCase, copies: int) -> list:
    return [out[b * copies:(b + 1) * copies] for b in range(len(case.requests))]


@contextlib.contextmanager
def _no_overflow_checks():
    """Triton's interpreter without its int32 overflow checks (a debugging aid that does not change
    results; about 1.5x faster here), restored afterwards. Does nothing on CUDA."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        yield
        return
    builder = interpreter.interpreter_builder
    old = builder.options
    builder.options = dataclasses.replace(old, sanitize_overflow=False)
    try:
        yield
    finally:
        builder.options = old


class _Once(logging.Filter):
    """SGLang's ``CandidateSelector`` warns that flashinfer is unavailable (true on a CPU: its
    torch path runs) each time one is built, once per batch here: the warning is let through
    the first time only."""

    seen = False

    def filter(self, record: logging.LogRecord) -> bool:
        return not (self.seen and "flashinfer is unavailable" in record.getMessage())


_ONCE = _Once()
logging.getLogger("ddtree_lab_source.sglang.srt.models.dflash").addFilter(_ONCE)


def _run_dflash2(case: RuleCase, copies: int, seed: int, block: bool, fault: str | None, device: str = "cpu") -> list:
    ep = _entry_points("dflash2")
    d = case.draft
    if not isinstance(d, SelectorDraft):
        raise ValueError(f"{case.name}: the DFlash 2 rules need a SelectorDraft")
    if all(p.is_greedy for p in case.requests):
        raise ValueError(f"{case.name}: every request is greedy: SGLang's DFlash 2 worker then takes its greedy "
                         "path, not this rule; add a sampled request")
    temps, top_ks, top_ps = _sglang_params(case, copies)
    bs, g, k, v = temps.shape[0], case.gamma, d.candidate_ids.shape[1], case.vocab_size
    selector = ep["CandidateSelector"](hidden_size=1, vocab_size=v, state_rank=1, top_k=k)
    _ONCE.seen = True
    torch.manual_seed(seed)
    temps, top_ks, top_ps = temps.to(device), top_ks.to(device), top_ps.to(device)
    cand = d.candidate_ids[None].expand(bs, -1, -1).contiguous().to(device)
    scores = d.scores[None].expand(bs, -1, -1, -1).float().contiguous().to(device)
    temperatures = temps.clamp_min(1e-5)  # as _propose_selector_block
    greedy_mask = top_ks <= 1  # resolve_greedy_mask
    uniforms = torch.rand(bs, g, dtype=torch.float32, device=device)
    tokens, q_rows = selector.sample_path(candidate_ids=cand, scores=scores, uniforms=uniforms,
                                          temperatures=temperatures, greedy_mask=greedy_mask)
    if fault == "q-temperature-1":
        _, q_rows = selector.sample_path(candidate_ids=cand, scores=scores, uniforms=uniforms,
                                         temperatures=torch.ones_like(temperatures), greedy_mask=greedy_mask)
    elif fault == "q-other-slot":
        q_rows = torch.cat([q_rows[:, 1:], q_rows[:, -1:]], 1)
    candidates = torch.cat([torch.full((bs, 1), case.root_token, dtype=torch.int64, device=device), tokens.long()], 1)
    draft_probs = torch.zeros(bs, g, v, dtype=torch.float32, device=device).scatter_(-1, cand, q_rows.float())
    info = SimpleNamespace(temperatures=temps[:, None], top_ks=top_ks, top_ps=top_ps,
                           need_top_k_sampling=bool((top_ks != TOP_K_ALL).any()),
                           need_top_p_sampling=bool((top_ps < 1.0).any()), is_all_greedy=False)
    accept = ep["AcceptSampling"].execute if device != "cpu" else ep["accept_sampling"]  # CUDA: its Triton variant
    with _no_overflow_checks():
        accept_len, bonus, _ = accept(
            candidates=candidates, target_logits=_target_logits(case, candidates), draft_probs=draft_probs,
            sampling_info=info, draft_input=SimpleNamespace(max_top_k=None, uniform_top_k_value=None), gamma=g,
            verify_num_draft_tokens=g + 1, cutoff_verify_lens=None,
            block_verification=block and fault != "token-wise-verify")
    candidates, accept_len, bonus = candidates.cpu(), accept_len.cpu(), bonus.cpu()
    out = [tuple(candidates[r, 1:1 + int(accept_len[r])].tolist()) + (int(bonus[r]),) for r in range(bs)]
    return _split(out, case, copies)


def _run_blockwise(case: RuleCase, copies: int, seed: int, onehot: bool, fault: str | None,
                   device: str = "cpu") -> list:
    ep = _entry_points("dspark")
    d = case.draft
    if not isinstance(d, LogitsDraft) or d.greedy != onehot:
        raise ValueError(f"{case.name}: this rule needs a LogitsDraft with greedy={onehot}")
    if any(p.is_greedy for p in case.requests):
        raise ValueError(f"{case.name}: a greedy request: DSpark's accept_draft_tokens routes greedy rows to "
                         "AcceptGreedy, not to the block-wise rejection")
    if any(p.top_k or p.top_p < 1 for p in case.requests):
        raise ValueError(f"{case.name}: top-k / top-p: DSpark uses the block-wise rejection only without them "
                         "(_blockwise_rejection_applies)")
    temps, _, _ = _sglang_params(case, copies)
    bs, g, v = temps.shape[0], case.gamma, case.vocab_size
    cuda = device != "cpu"
    temperatures = temps.clamp_min(1e-5).contiguous().to(device)
    step_temps = torch.zeros_like(temperatures) if onehot else temperatures
    key = (seed * 0x9E3779B1 + 0x2D2A9C317E44B1F3) & 0x7FFFFFFFFFFFFFFF
    offset = torch.zeros(1, dtype=torch.int64, device=device)
    logits_out = None if onehot else torch.empty(bs, g, v, dtype=torch.float32, device=device)
    prev = torch.full((bs,), case.root_token, dtype=torch.int64, device=device)
    base_all, bias_all = d.base_logits.to(device), d.bias.to(device)
    step_fn = ep["MarkovSampleStep"].triton if cuda else ep["MarkovSampleStep"].torch
    drafts = []
    for s in range(g):
        base = base_all[s][None].expand(bs, -1).float().contiguous()
        bias = bias_all[s][prev].float().contiguous()
        prev = step_fn(
            base_logits=base, bias=bias, temperatures=step_temps, key=key, offset=offset, step=s,
            step_dtype=torch.float32, logits_out=None if logits_out is None else logits_out[:, s],
            has_sampled_rows=False if onehot else None).long()
        drafts.append(prev)
    if not onehot:
        offset.add_(1)
    candidates = torch.cat([torch.full((bs, 1), case.root_token, dtype=torch.int64, device=device),
                            torch.stack(drafts, 1)], 1)
    draft_logits = logits_out
    draft_temps = temperatures
    if fault == "draft-temperature-1":
        draft_temps = torch.ones_like(temperatures)
    elif fault == "one-hot-q":
        draft_logits = None
    elif fault == "draft-logits-q":
        draft_logits = torch.stack([base_all[s][None] + bias_all[s][candidates[:, s]] for s in range(g)], 1).contiguous()
    verify = ep["BlockwiseRejection"].execute if cuda else ep["blockwise_rejection_torch"]  # CUDA: its Triton kernels
    correct, bonus, _ = verify(
        candidates=candidates, target_logits=_target_logits(case, candidates), draft_logits=draft_logits,
        target_temperatures=temperatures, draft_temperatures=draft_temps, noise=ep["make_rejection_noise"](seed, device))
    candidates, correct, bonus = candidates.cpu(), correct.cpu(), bonus.cpu()
    out = [tuple(candidates[r, 1:1 + int(correct[r])].tolist()) + (int(bonus[r]),) for r in range(bs)]
    return _split(out, case, copies)


def run_rule(rule: str, fault: str | None = None, device: str = "cpu"):
    """The ``run(case, copies, trial_seed)`` callable :func:`ddtree_lab.engines.end_to_end.audit_rule`
    takes, for SGLang rule ``rule`` with an optional planted ``fault`` (:data:`RULE_FAULTS`).

    ``device="cuda"`` runs the same rule on CUDA tensors, where SGLang dispatches to its CUDA
    paths (``selector_walk_triton``, ``accept_sampling_triton``, ``MarkovSampleStep.triton``,
    ``blockwise_rejection_triton``): tests/test_sglang_gpu.py, never run on a CPU.

    Raises:
        ValueError: an unknown rule, or a fault the rule does not take.
        RuntimeError: SGLang's entry points cannot be loaded here (the reason).
    """
    if rule not in RULES:
        raise ValueError(f"unknown SGLang rule {rule!r}; known: {', '.join(RULES)}")
    if fault is not None and fault not in RULES[rule].faults:
        raise ValueError(f"rule {rule} takes the faults {', '.join(RULES[rule].faults)}, not {fault!r}")
    why = sglang_rules_unavailable_reason(rule)
    if why is not None:
        raise RuntimeError(f"SGLang's rules cannot run here: {why}")
    if rule.startswith("dflash2"):
        block = rule == "dflash2-dspark-block"
        return lambda case, copies, seed: _run_dflash2(case, copies, seed, block, fault, device)
    onehot = rule == "blockwise-rejection-onehot"
    return lambda case, copies, seed: _run_blockwise(case, copies, seed, onehot, fault, device)


def standard_case(rule: str, seed: int = 0, fault: str | None = None) -> RuleCase:
    """The case ``ddtree-lab audit --engine sglang:RULE`` and benchmarks/engine_audit.py audit
    ``rule`` on (with ``fault``: the case that fault is planted in, a temperature the fault
    changes something at): mixed greedy / sampled batches with top-k / top-p for DFlash 2, a
    mixed-temperature batch for the block-wise rejection, ``gamma = 3`` draft tokens over 6 tokens.

    Raises:
        ValueError: an unknown rule.
    """
    from ..sampling import SamplingParams as SP
    from .end_to_end import random_logits_case, random_selector_case

    if rule not in RULES:
        raise ValueError(f"unknown SGLang rule {rule!r}; known: {', '.join(RULES)}")
    if rule == "dflash2-dspark":
        reqs = [SP(temperature=0.5)] if fault else [SP(temperature=0.7, top_k=4, top_p=0.9), SP(temperature=0.0)]
        return random_selector_case(seed, reqs)
    if rule == "dflash2-dspark-block":
        reqs = [SP(temperature=1.0 if fault == "token-wise-verify" else 0.5)] if fault else \
            [SP(temperature=0.7), SP(temperature=0.0)]
        return random_selector_case(seed, reqs)
    if rule == "blockwise-rejection":
        return random_logits_case(seed, [SP(temperature=0.7), SP(temperature=1.3)])
    return random_logits_case(seed, [SP(temperature=0.8)], greedy_draft=True)
