"""The fast invariants of a recorded Step (buffers, tree, rows, coins, outputs), every one at once."""

from __future__ import annotations

import dataclasses
import math

import torch

from ..buffers import decode_retrieve, find_retrieve_problems
from ..problems import Problem
from ..step import Step

__all__ = ["check", "MASS_SLACK"]

#: float32 rounding allowed on a cumulative mass (the kernels sum in float32).
MASS_SLACK = 1e-5


def check(step: Step) -> list[Problem]:
    """Every broken invariant of ``step``, all of them (an empty list: the step is consistent).

    Checked where the step holds the stage (what it lacks is not a problem; use
    :meth:`Step.missing_stages`):

    * buffers: every :func:`ddtree_lab.buffers.find_retrieve_problems` finding (links,
      cycles, depths, positions, tree mask, repeated sibling tokens, sibling order by
      log-weight), the root at the prefix length, and the recorded parents equal to the parents
      the links encode;
    * coins: walk coins and the final coin in ``[0, 1)``;
    * rows: child probabilities in ``[0, 1]`` (NaN only where unread), a node's children summing
      to at most 1, the bonus row prefix in ``[0, 1]``;
    * output: the accepted path starts at the root and follows parent links, emitted tokens are
      the path's tokens then the bonus, ``accept_length`` = path length - 1, every accepted node
      was judged "accept" in the decision log, and the bonus was drawn at the path's last node.

    Returns:
        :class:`~ddtree_lab.problems.Problem` s with ``step``, ``request``, ``part`` (the stage:
        ``buffers``, ``tree``, ``rows``, ``coins`` or ``output``), ``node`` (None for the step as
        a whole), ``kind`` and ``field``; ``value`` / ``limit`` where the invariant is a bound.
        A buffers problem keeps the validator's ``kind``, ``field``, ``nodes``, ``value`` and
        ``limit`` (its message led by the field).
    """
    out: list[Problem] = []

    def bad(part: str, kind: str, field: str, node: int | None, message: str, value=None, limit=None) -> None:
        out.append(Problem(kind, step.step, step.request, node, field, value, limit, message, part))

    if step.buffers is not None:
        _check_buffers(step, bad, out)
    if step.coins is not None:
        for i in (~((step.coins >= 0) & (step.coins < 1))).nonzero().flatten().tolist():
            u = float(step.coins[i])
            bad("coins", "coin_range", "coins", i, f"coin {u} is not in [0, 1)", u, 1.0)
    if step.final_coin is not None and not 0.0 <= float(step.final_coin) < 1.0:
        bad("coins", "coin_range", "final_coin", None, f"final coin {step.final_coin} is not in [0, 1)",
            float(step.final_coin), 1.0)
    if step.rows is not None and step.tree is not None:
        _check_rows(step, bad)
    if step.output is not None and step.tree is not None:
        _check_output(step, bad)
    return out


def _check_buffers(step: Step, bad, out: list[Problem]) -> None:
    vi = step.buffers
    assert vi is not None  # check() calls this only for a step with buffers
    logws = step.node_logws
    logws = logws[None] if logws is not None and not torch.isnan(logws).any() else None
    if step.prefix_len is not None and int(vi.positions[0, 0]) != step.prefix_len:
        bad("buffers", "root_position", "positions", 0,
            f"position {int(vi.positions[0, 0])} != prefix length {step.prefix_len}", int(vi.positions[0, 0]),
            step.prefix_len)
    found = find_retrieve_problems(vi, node_logws=logws)
    for p in found:  # the validator's fields, placed in the step
        out.append(dataclasses.replace(p, step=step.step, request=step.request, part="buffers",
                                       message=f"{p.field}: {p.message}"))
    if found or step.tree is None:
        return
    n = step.num_nodes
    recorded = step.parents
    assert recorded is not None  # the step has a tree (checked just above)
    parents, _ = decode_retrieve(vi.retrieve_next_token, vi.retrieve_next_sibling, vi.num_nodes)
    for i in (parents[0, :n] != recorded).nonzero().flatten().tolist():
        bad("tree", "parent", "parents", i,
            f"recorded parent {int(recorded[i])} but the buffers link it under {int(parents[0, i])}",
            int(recorded[i]), int(parents[0, i]))


def _check_rows(step: Step, bad) -> None:
    cp = step.child_probs
    if cp is not None:
        parents = step.parents
        assert parents is not None  # check() calls this only for a step with a tree
        known = ~torch.isnan(cp)
        for i in (known & ((cp < 0) | (cp > 1))).nonzero().flatten().tolist():
            bad("rows", "prob_range", "child_probs", i, f"child probability {float(cp[i])} is not in [0, 1]",
                float(cp[i]), 1.0)
        sums: dict[int, float] = {}
        for i in range(1, step.num_nodes):
            if bool(known[i]):
                sums[int(parents[i])] = sums.get(int(parents[i]), 0.0) + float(cp[i])
        for node, total in sorted(sums.items()):
            if total > 1.0 + MASS_SLACK:
                bad("rows", "children_mass", "child_probs", node,
                    f"its children's target probabilities sum to {total:.6f} > 1", total, 1.0)
    prefix = step.final_row_prefix
    if prefix is not None and prefix.numel() and bool(((prefix < 0) | (prefix > 1) | torch.isnan(prefix)).any()):
        bad("rows", "prob_range", "final_row_prefix", None, "the bonus row prefix has a value outside [0, 1]")
    mass = step.final_mass
    if mass is not None and not (math.isfinite(mass) and 0.0 <= mass <= 1.0 + MASS_SLACK):
        bad("rows", "residual_mass", "final_mass", None, f"residual mass {mass} is not in [0, 1]", mass, 1.0)


def _check_output(step: Step, bad) -> None:
    n = step.num_nodes
    path = step.accepted_path
    node_token_ids, node_parents = step.node_token_ids, step.parents
    assert node_token_ids is not None and node_parents is not None  # check() calls this only for a step with a tree
    tokens, parents = node_token_ids.tolist(), node_parents.tolist()
    if not path or path[0] != 0:
        bad("output", "path_root", "accepted_path", None, f"the accepted path {path} does not start at the root")
        return
    for a, b in zip(path, path[1:]):
        if not 0 <= b < n or parents[b] != a:
            bad("output", "path_parent", "accepted_path", b, f"accepted after node {a}, but its parent is "
                f"{parents[b] if 0 <= b < n else 'out of range'}")
            return
    if step.accept_length != len(path) - 1:
        bad("output", "accept_length", "accept_length", None,
            f"accept_length {step.accept_length} != {len(path) - 1} accepted draft nodes", step.accept_length,
            len(path) - 1)
    want = [tokens[i] for i in path[1:]] + ([step.bonus_token] if step.bonus_token >= 0 else [])
    if step.emitted != want:
        bad("output", "emitted", "emitted", None,
            f"emitted tokens {step.emitted} are not the accepted tokens then the bonus {want}")
    accepted = {d.node for d in step.decisions if d.verdict == "accept"}
    if step.decisions:
        for i in path[1:]:
            if i not in accepted:
                bad("output", "path_not_accepted", "decisions", i, "on the accepted path but no decision accepted it")
        for d in step.decisions:
            if d.verdict == "accept" and d.node not in path:
                bad("output", "accepted_off_path", "decisions", d.node,
                    "accepted in the decision log but not on the accepted path")
    if step.bonus is not None and step.bonus.node != path[-1]:
        bad("output", "bonus_node", "bonus", step.bonus.node,
            f"the bonus was drawn at node {step.bonus.node}, not at the path's end {path[-1]}", step.bonus.node,
            path[-1])
