"""Check: the recorded outputs across steps against the exact law of a lossless verifier, bonus token included.

A lossless tree verifier emits the target's own autoregressive samples: at every node its
walk reaches, the next emitted token follows that node's target row ``p`` (under the
request's parameters). Seen from the tree, the walk at node ``n`` with children
``c_1 .. c_m`` (the buffers' sibling order) moves to ``c_i`` with probability ``p(c_i)`` (the
recorded ``child_probs``) and leaves the tree with ``1 - sum p(c_i)``; leaving it, the bonus
token follows ``p`` restricted to the other tokens, renormalised. This check tests that law
on what the steps recorded -- the accepted path and the bonus token against the recorded rows
(for an SGLang recording, SGLang's own output, not the lab's walk) -- and reads no coin and no
decision log: it tests the verifier that ran as a black box, so it
also sees a verifier whose recorded coins are not the ones it used.

Per observation a randomised probability integral transform (PIT) ``u = F(o-) + v p(o)``
(``o`` the outcome in the order ``c_1 .. c_m``, out; ``v`` uniform) is uniform on [0, 1) under
the law, and the observations of a run are independent uniforms given the past (each is
uniform conditionally on everything before it). Four tests at fixed levels, each at
:data:`LAW_ALPHA`: a Kolmogorov-Smirnov test of the walk's PITs, a z-test of how often the
walk moved into a child against the expected count (a lossy or ``p/q`` rule accepts too often
or too seldom), and KS tests of the bonus PITs after the walk rejected every child of its
node (a bonus drawn from another row, or with the walk's coin, which is conditioned there)
and at leaves (another row). An outcome the law gives probability 0 (a child with ``p = 0`` accepted, a
bonus that is a child's token or has zero residual probability) is an impossible event and a
finding on its own. Greedy steps (a deterministic law: :mod:`.greedy`) and steps that report
lossy thresholds are left out. The PIT's ``v`` comes from a generator seeded by the step and
request, so the same run gives the same figures.

Source: the losslessness of sequential multi-draft rejection on a tree (SpecInfer, Miao et
al. 2024, Sec. 4; DDTree's target-only rule), the randomised PIT for discrete laws
(Brockwell 2007).

When the law is rejected, the findings say which rule family's law fits the outputs best
(:mod:`.lawfit`: rule inference's families, fitted to the outputs alone), or that none does.
"""

from __future__ import annotations

import dataclasses

import torch

from ..replaying import BY_DESIGN
from ..step import Run, Step
from .common import CheckResult, Finding, engine_by_design, group_findings, next_command
from .lawfit import fit_output_law
from .lawsample import LAW_ALPHA, MIN_DRAWS, P_ZERO, LawSample, law_observations, law_tests

__all__ = ["check_law", "check_law_with_model", "steps_with_model_rows", "law_observations", "LawSample", "LAW_ALPHA", "MIN_DRAWS", "P_ZERO"]

_KINDS = {
    "walk": "the accepted paths do not follow the target's rows (statistical: the verifier is not lossless)",
    "accepts": "the verifier accepts draft tokens more or less often than the target's rows allow (a lossy or "
               "p/q acceptance rule; statistical)",
    "bonus": "the bonus tokens do not follow the residual of their node's row (drawn from another row, or with a "
             "coin the walk used; statistical)",
    "leaf-bonus": "the bonus tokens at leaves do not follow their node's row (drawn from another row; statistical)",
}


def check_law(run: Run, steps: list[Step] | None = None) -> CheckResult:
    """The exact-law tests (module docstring) over every sampled step with an output and its
    verify rows, pooled over the run; impossible events one finding per request."""
    steps = run.steps if steps is None else steps
    result = CheckResult("output-law", ran=False)
    sample = LawSample()
    lossy = sum(1 for s in steps if s.output is not None and s.output.lossy)
    for s in steps:
        try:
            if law_observations(s, sample):
                result.checked += 1
        except ValueError:  # a cycle in the sibling links (children_of): the record check names it
            continue
    if not result.checked:
        sampled = any(s.params is not None and not s.params.is_greedy for s in steps)
        result.why = (f"every sampled step reports lossy thresholds ({lossy}): the exact law does not apply" if lossy
                      else "no sampled step (T > 0, lossless) stores its output and verify rows (child probabilities)"
                      if sampled else "the run has no sampled step (greedy steps follow a point law: the greedy check)")
        return result
    result.ran = True
    found = [Finding("output-law", "the verifier emitted a token the target's row gives probability 0", None, st, rq,
                     node, what, "high", next_command("verifier", st, rq))
             for st, rq, node, what in sample.impossible]
    tests = law_tests(sample)
    notes = [f"{name} p = {p:.2g}" for name, p, _ in tests]
    short = [n for n, k in (("walk", sample.walk), ("accepts", sample.moves), ("bonus", sample.bonus),
                            ("leaf-bonus", sample.leaf_bonus)) if len(k) < MIN_DRAWS]
    if short:
        result.not_run = f"the {' / '.join(short)} test(s): not enough draws (need {MIN_DRAWS})"
    if lossy:
        notes.append(f"{lossy} step(s) report lossy thresholds: the exact law does not apply, not tested")
    if sample.undecided:
        notes.append(f"{sample.undecided} step(s) stop early (a row the walk read was not recorded)")
    design = sum(1 for s in steps if engine_by_design(s))
    if design:
        notes.append(f"{design} step(s) whose engine output {BY_DESIGN} (the verifier check says why) not tested")
    result.note = "; ".join(notes)
    for name, p, evidence in tests:
        if p < LAW_ALPHA:
            found.append(Finding("output-law", _KINDS[name], None, None, None, None,
                                 f"{evidence}, p = {p:.2g} < {LAW_ALPHA:g} over {sample.steps} sampled step(s)", "low",
                                 "ddtree-lab render RUN --step S --request R --format decisions  # one step's walk, decision by decision"))
    for st, rq, _, _ in sample.impossible:
        result.per_step[(st, rq)] = "unknown"
    if found:  # the law is rejected: which rule family's law the outputs fit instead (.lawfit)
        family = _family_sentence(run, steps)
        found = [dataclasses.replace(f, evidence=f"{f.evidence}; {family}") for f in found]
    result.findings = group_findings(found)
    return result


def _family_sentence(run: Run, steps: list[Step]) -> str:
    vocab = run.vocab_size or max((int(s.node_token_ids.max()) + 1 for s in steps if s.node_token_ids is not None),
                                  default=0)
    try:
        fit = fit_output_law(steps, vocab)
    except ValueError as exc:  # no step it can score: said, never a pass
        return f"rule families' laws not fitted ({exc})"
    return "rule families' laws: " + fit.sentence() + (f"; not tried: {'; '.join(fit.not_tried)}" if fit.not_tried
                                                       else "")


def steps_with_model_rows(run: Run, target, steps: list[Step]) -> tuple[list[Step], list[str]]:
    """The sampled steps of a run that records no target rows (DDTree reference traces), each
    with its rows recomputed by the target: one prefill of the ids before the step's root (the
    request's prompt and generated ids, ``prefix_len`` of them) and one tree forward of the
    recorded tree, the rows under the request's temperature (:func:`ddtree_lab.target_probs`),
    the buffers compiled from the tree, and the bonus draw at the accepted path's last node.

    A request is sampled when its file states, or the user stated, a temperature above 0
    (:mod:`ddtree_lab.io.decoding_mode`); its parameters are that temperature alone (the
    reference's sampler applies no top-k / top-p). What could not be rebuilt is said, one
    line per request.

    Returns:
        ``(steps, notes)``: the rebuilt steps (for :func:`check_law`) and why others were left.
    """
    from ..buffers import compile_retrieve
    from ..io.decoding_mode import request_temperatures, temperature_value
    from ..sampling import SamplingParams, target_probs
    from ..step import TargetRows
    from ..verify import BonusDraw

    temps = {r: temperature_value(t) for r, t, _ in request_temperatures(run)}
    reqs = {int(r.get("request", i)): r for i, r in enumerate(run.metadata.get("requests") or [])}
    vocab = int(target.vocab_size)
    out, notes = [], []
    for r in sorted({s.request for s in steps}):
        t, meta = temps.get(r), reqs.get(r, {})
        if t is None or t == 0.0:
            continue
        seq = list(meta.get("prompt_token_ids") or []) + list(meta.get("generated_token_ids") or [])
        if not meta.get("prompt_token_ids"):
            notes.append(f"request {r}: no prompt token ids (rows not recomputed)")
            continue
        outside = next((x for x in seq if not 0 <= int(x) < vocab), None)
        if outside is not None:
            notes.append(f"request {r}: token id {outside} is outside the target's vocabulary: not a run of this target")
            continue
        params = SamplingParams(temperature=float(t))
        for s in sorted((s for s in steps if s.request == r), key=lambda s: s.step):
            tree, o = s.tree, s.output
            if tree is None or o is None or s.prefix_len is None or not 0 < s.prefix_len < len(seq):
                notes.append(f"step {s.step}, request {r}: no tree, output or prefix (rows not recomputed)")
                continue
            if int(tree.node_token_ids[0, 0]) != int(seq[s.prefix_len]):
                notes.append(f"step {s.step}, request {r}: the root token {int(tree.node_token_ids[0, 0])} is not the "
                             f"request's token at position {s.prefix_len} ({int(seq[s.prefix_len])})")
                continue
            n = int(tree.num_nodes[0])
            cache, _, _ = target.prefill([int(x) for x in seq[: s.prefix_len]])
            vi = compile_retrieve(tree, s.prefix_len)
            rows = target_probs(target.tree_forward(cache, vi).logits[:n].float().cpu()[None], params)[0]
            parents, tokens = tree.parents[0, :n], tree.node_token_ids[0, :n]
            child = torch.zeros(n, dtype=torch.float32)
            child[1:] = rows[parents[1:], tokens[1:]]
            path = [int(i) for i in o.accept_index[0].tolist() if i >= 0] or [0]
            bonus_token = int(o.bonus_token[0])
            node = path[-1]
            kids = (parents == node).nonzero().flatten().tolist()
            mass = max(0.0, 1.0 - float(child[kids].double().sum()))
            if bonus_token < 0:
                notes.append(f"step {s.step}, request {r}: no bonus token recorded")
                continue
            bonus = BonusDraw(r, node, bonus_token, "residual" if kids else "leaf", mass, None,
                              float(rows[node, bonus_token]) / mass if mass > 0 else float("nan"))
            out.append(s.replace(params=params, buffers=vi.compact(),
                                 output=dataclasses.replace(o, bonus=[bonus]),
                                 rows=TargetRows(kind="full", child_probs=child,
                                                 final_row_prefix=rows[node, : bonus_token + 1].clone(), final_mass=mass)))
    return out, notes


def check_law_with_model(run: Run, target, steps: list[Step]) -> CheckResult | None:
    """:func:`check_law` on :func:`steps_with_model_rows`, for a run whose steps record no rows
    and no sampling parameters (DDTree reference traces); None for any other run (the
    recorded rows are the ones to test)."""
    if any(s.params is not None or s.child_probs is not None for s in steps):
        return None
    rebuilt, notes = steps_with_model_rows(run, target, steps)
    if not rebuilt:
        return None if not notes else CheckResult("output-law", ran=False, why="with the model: " + "; ".join(notes))
    result = check_law(run, rebuilt)
    said = (f"rows recomputed by the target for {len(rebuilt)} sampled step(s) (a tree forward at each step's "
            "prefix; the reference records none)")
    result.note = "; ".join(x for x in (said, result.note, *notes) if x)
    return result
