"""The output law's observations and tests, shared by the output-law check (:mod:`.law`) and the
rule-family fit (:mod:`.lawfit`).

:class:`LawSample` holds the randomised PITs of some steps (the walk's moves, the bonus tokens
after the walk rejected every child and at leaves), the (moved into a child, its probability)
pairs and the impossible events; :func:`law_observations` adds one step's; :func:`law_tests`
runs the four tests at fixed levels (:data:`LAW_ALPHA`, :data:`MIN_DRAWS`). The law and its
sources: :mod:`.law`'s docstring.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..step import Step
from ..verify.walking import children_of
from .common import engine_by_design, outcome

__all__ = ["LawSample", "law_observations", "law_tests", "LAW_ALPHA", "MIN_DRAWS", "P_ZERO"]

#: Each of the four tests flags at p-value below this (fixed; four tests per run).
LAW_ALPHA = 1e-5
#: Fewest observations for a statistical test to run (fewer: it says so).
MIN_DRAWS = 20
#: A recorded probability at or below this is zero (float32 rows).
P_ZERO = 1e-12


@dataclass
class LawSample:
    """The law's observations of some steps: walk PITs, (moved into a child, its probability)
    pairs, bonus PITs after the walk rejected every child (``bonus``) and at a leaf
    (``leaf_bonus``), impossible events ``(step, request, node, evidence)`` and counts."""

    walk: list[float] = field(default_factory=list)
    moves: list[tuple[bool, float]] = field(default_factory=list)
    bonus: list[float] = field(default_factory=list)
    leaf_bonus: list[float] = field(default_factory=list)
    impossible: list[tuple[int, int, int | None, str]] = field(default_factory=list)
    steps: int = 0
    undecided: int = 0


def law_observations(step: Step, sample: LawSample) -> bool:
    """Add one step's observations to ``sample`` (module docstring); False when the step is not
    one the law covers (greedy, lossy, no output / rows / buffers, support exhausted).

    Raises:
        ValueError: a cycle in the step's sibling links.
    """
    out = step.output
    if (out is None or step.params is None or step.params.is_greedy or out.lossy or step.buffers is None
            or step.child_probs is None or bool(out.support_exhausted[0])):
        return False
    next_token, next_sibling, node_token_ids = step.retrieve_next_token, step.retrieve_next_sibling, step.node_token_ids
    assert next_token is not None and next_sibling is not None  # the step has buffers (checked above)
    if node_token_ids is None:
        raise ValueError(f"step {step.step}, request {step.request}: verify buffers recorded without a tree")
    nt, ns = next_token.tolist(), next_sibling.tolist()
    cp, tokens = step.child_probs.double().tolist(), node_token_ids.tolist()
    if engine_by_design(step):  # the engine's documented edge (e.g. SGLang's float32 u < S): not its law
        return False
    got = outcome(step)
    if got is None:
        return False
    path, bonus_token = got
    g = torch.Generator().manual_seed(1_000_003 * int(step.step) + int(step.request))
    v = torch.rand(len(path) + 1, generator=g, dtype=torch.float64).tolist()  # one per move, one for the bonus
    sample.steps += 1
    where = (int(step.step), int(step.request))
    residual_out: tuple[int, list[int], float] | None = None
    for j, n in enumerate(path):
        kids = children_of(step.request, nt, ns, n, step.num_nodes)
        probs = [cp[c] for c in kids]
        nxt = path[j + 1] if j + 1 < len(path) else None
        if any(math.isnan(p) for p in probs) or (nxt is not None and nxt not in kids):
            sample.undecided += 1
            return True
        p_out = max(0.0, 1.0 - sum(probs))
        o = kids.index(nxt) if nxt is not None else len(kids)
        p_o = probs[o] if nxt is not None else p_out
        if p_o <= P_ZERO:
            what = (f"the walk moved to node {nxt} (token {tokens[nxt]}) whose target p is {p_o:.3g}" if nxt is not None
                    else f"the walk left the tree at node {n} whose children hold all of its row's mass")
            sample.impossible.append((*where, nxt if nxt is not None else n, what))
            return True
        if kids:  # a leaf's outcome is certain: no information
            sample.walk.append(min(sum(probs[:o]) + v[j] * p_o, 1.0))
            sample.moves.append((nxt is not None, 1.0 - p_out))
        residual_out = (n, kids, p_out)
    assert residual_out is not None  # the path holds at least the root, and every exit above returned
    n, kids, mass = residual_out
    b, prefix = bonus_token, step.final_row_prefix
    if b < 0 or prefix is None or prefix.shape[0] != b + 1 or step.bonus is None or step.bonus.node != n:
        return True  # the stored bonus row prefix is another node's (an engine's output left the lab's walk)
    kid_tokens = {tokens[c] for c in kids}
    if b in kid_tokens:
        sample.impossible.append((*where, n, f"the bonus {b} at node {n} is the token of one of its children"))
        return True
    r = prefix.double().clone()
    for t in kid_tokens:
        if t <= b:
            r[t] = 0.0
    p_b = float(r[b])
    if p_b <= P_ZERO or mass <= P_ZERO:
        sample.impossible.append((*where, n, f"the bonus {b} at node {n} has target p {p_b:.3g} in that node's row "
                                             f"(residual mass {mass:.3g})"))
        return True
    (sample.bonus if kids else sample.leaf_bonus).append(min((float(r[:b].sum()) + v[len(path)] * p_b) / mass, 1.0))
    return True


def law_tests(sample: LawSample) -> list[tuple[str, float, str]]:
    """``(test, p-value, evidence)`` of each test with enough observations (:data:`MIN_DRAWS`)."""
    from scipy import stats  # not at import: the vLLM venv imports the package without scipy

    got = []
    if len(sample.walk) >= MIN_DRAWS:
        ks = stats.kstest(sample.walk, "uniform")
        got.append(("walk", float(ks.pvalue), f"the walk's {len(sample.walk)} moves: KS D = {ks.statistic:.3f}"))
    if len(sample.moves) >= MIN_DRAWS:
        seen = sum(m for m, _ in sample.moves)
        want = sum(p for _, p in sample.moves)
        var = sum(p * (1 - p) for _, p in sample.moves)
        if var > 0:
            z = (seen - want) / math.sqrt(var)
            got.append(("accepts", float(2 * stats.norm.sf(abs(z))),
                        f"moved into a child {seen} of {len(sample.moves)} times, {want:.1f} expected (z = {z:+.2f})"))
    for name, draws, where in (("bonus", sample.bonus, "after the walk rejected every child"),
                               ("leaf-bonus", sample.leaf_bonus, "at a leaf")):
        if len(draws) >= MIN_DRAWS:
            ks = stats.kstest(draws, "uniform")
            got.append((name, float(ks.pvalue), f"{len(draws)} bonus tokens {where}: KS D = {ks.statistic:.3f}"))
    return got
