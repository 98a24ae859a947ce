"""The one walk over a tree's retrieve buffers, as events, shared by every verifier and replay."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

from ..buffers import DDTreeVerifyInput
from .types import BonusDraw, Decision, UndrawnBonus, VerifyOutput, WalkEvent, is_lossy

__all__ = ["walk", "walk_batch", "children_of", "finish_output", "HostTree", "host_tree", "host_tree_from"]


@dataclass(frozen=True)
class HostTree:
    """What the walk reads of a :class:`DDTreeVerifyInput`, as Python lists (one host read).

    Attributes:
        next_token, next_sibling, tokens: ``[bs][N]`` lists of ``retrieve_next_token``,
            ``retrieve_next_sibling`` and ``node_token_ids``.
        num_nodes: ``[bs]`` list. max_path: ``max(depths) + 1`` (1 for an empty tree).
    """

    next_token: list
    next_sibling: list
    tokens: list
    num_nodes: list
    max_path: int


def host_tree(vi: DDTreeVerifyInput) -> HostTree:
    """:class:`HostTree` of ``vi``: the four fields and the depth maximum packed into one int64
    tensor on their device and read with one ``tolist`` (one host synchronisation on a GPU,
    where reading them one by one took ``bs + 4``)."""
    bs, n = vi.node_token_ids.shape
    device = vi.node_token_ids.device
    depth = (vi.depths.max() + 1).reshape(1) if vi.depths.numel() else torch.ones(1, dtype=torch.int64, device=device)
    parts = [vi.retrieve_next_token, vi.retrieve_next_sibling, vi.node_token_ids, vi.num_nodes, depth]
    flat = torch.cat([p.to(device=device, dtype=torch.int64).reshape(-1) for p in parts]).tolist()
    return host_tree_from(flat, bs, n)


def host_tree_from(flat: list, bs: int, n: int) -> HostTree:
    """:class:`HostTree` from the flat list ``[next_token, next_sibling, tokens, num_nodes, max_path]``
    (each of the first three ``bs * n`` ints, row-major; ``num_nodes`` ``bs`` ints; ``max_path`` one int),
    as one host read gives it (:func:`host_tree`, the Triton verify's output arena)."""
    m = bs * n
    rows = [flat[k * m + b * n: k * m + (b + 1) * n] for k in range(3) for b in range(bs)]
    return HostTree(rows[:bs], rows[bs:2 * bs], rows[2 * bs:], flat[3 * m:3 * m + bs], int(flat[3 * m + bs]))


def children_of(request: int, next_token, next_sibling, node: int, limit: int) -> list[int]:
    """Node ``node``'s children in sibling order (at most ``limit`` hops: a defence for
    ``validate=False``; validated buffers never get near it)."""
    out = []
    child = next_token[node]
    while child != -1:
        if len(out) >= limit:
            raise ValueError(f"request {request}, node {node}: sibling chain longer than the tree "
                             "(a cycle in retrieve_next_sibling)")
        out.append(child)
        child = next_sibling[child]
    return out


def walk(request: int, num_nodes: int, next_token: Sequence[int], next_sibling: Sequence[int],
         rule) -> Iterator[WalkEvent]:
    """The walk of one request (module docstring): the only place that states it.

    From the root, the rule judges the current node's children in sibling order
    (``rule.decide(node, depth, children) -> list[Decision]``: the visited siblings, the last
    one accepted or all rejected); on an accept the walk moves to that child; otherwise (or at
    a leaf) ``rule.bonus(node, children, rejected_nodes)`` makes the final draw.

    Args:
        request: the request index written into every event.
        num_nodes: the request's node count (bounds the walk).
        next_token, next_sibling: the request's ``retrieve_next_token`` / ``retrieve_next_sibling``
            as Python lists (local indices, ``-1`` for none).
        rule: greedy, sampled, kernel-expansion or what-if rule (this module's ``_*Rule``).

    Yields:
        :class:`WalkEvent` s in order: ``consider`` per judged child, ``move`` per accepted
        child, one final ``bonus``.

    Raises:
        ValueError: a cycle (request and node named), or a rule whose verdicts do not follow
            the children in order.
    """
    cur, depth, visited = 0, 1, 1
    while True:
        children = children_of(request, next_token, next_sibling, cur, num_nodes)
        decisions = rule.decide(cur, depth, children) if children else []
        for k, d in enumerate(decisions):
            if k >= len(children) or d.node != children[k] or (d.verdict == "accept" and k != len(decisions) - 1):
                raise ValueError(f"request {request}, node {cur}: decision {k} ({d.node}, {d.verdict}) does not "
                                 f"follow the children {children} in sibling order")
            yield WalkEvent("consider", request, d.node, decision=d)
        if decisions and decisions[-1].verdict == "accept":
            cur = decisions[-1].node
            visited += 1
            if visited > num_nodes:
                raise ValueError(f"request {request}, node {cur}: the walk revisits nodes "
                                 "(a cycle in retrieve_next_token)")
            depth += 1
            yield WalkEvent("move", request, cur, decision=decisions[-1])
            continue
        yield WalkEvent("bonus", request, cur, bonus=rule.bonus(cur, children, [d.node for d in decisions]))
        return


def _collect(events) -> tuple[list[int], list[Decision], "BonusDraw | UndrawnBonus | None"]:
    """``(path, decisions, bonus)`` of one request's events."""
    path, log, bonus = [0], [], None
    for e in events:
        if e.kind == "consider":
            log.append(e.decision)
        elif e.kind == "move":
            path.append(e.node)
        else:
            bonus = e.bonus
    return path, log, bonus


def finish_output(vi, paths, bonus_tokens, exhausted, decisions, bonus, backend, thresholds=(1.0, 1.0),
                  tree: HostTree | None = None) -> VerifyOutput:
    """The :class:`VerifyOutput` of finished walks (``tree``: ``vi`` read by :func:`host_tree`,
    read here when None)."""
    bs = vi.batch_size
    tree = tree if tree is not None else host_tree(vi)
    width = max(tree.max_path, max((len(p) for p in paths), default=1))
    tokens = tree.tokens
    index_rows, emitted_rows = [], []
    for b, path in enumerate(paths):
        out = [tokens[b][i] for i in path[1:]] + ([] if exhausted[b] else [bonus_tokens[b]])
        index_rows.append(path + [-1] * (width - len(path)))
        emitted_rows.append(out + [-1] * (width - len(out)))
    return VerifyOutput(
        accept_index=torch.tensor(index_rows, dtype=torch.int64).reshape(bs, width),
        emitted_tokens=torch.tensor(emitted_rows, dtype=torch.int64).reshape(bs, width),
        accept_length=torch.tensor([len(p) - 1 for p in paths], dtype=torch.int64),
        bonus_token=torch.tensor(bonus_tokens, dtype=torch.int64),
        support_exhausted=torch.tensor(exhausted, dtype=torch.bool),
        decisions=decisions,
        bonus=bonus,
        backend=backend,
        thresholds=(float(thresholds[0]), float(thresholds[1])),
        lossy=is_lossy(*thresholds),
    )


def walk_batch(vi: DDTreeVerifyInput, rule_of: Callable[[int], object], backend: str,
               thresholds: tuple[float, float] = (1.0, 1.0), tree: HostTree | None = None) -> VerifyOutput:
    """Run :func:`walk` for every request of ``vi`` with ``rule_of(b)`` and assemble the
    :class:`VerifyOutput` (every verifier and backend ends here). ``tree``: ``vi`` already
    read by :func:`host_tree` (read here, in one host synchronisation, when None)."""
    tree = tree if tree is not None else host_tree(vi)
    nt, ns = tree.next_token, tree.next_sibling
    paths, bonus_tokens, exhausted, decisions, bonus = [], [], [], [], []
    for b in range(vi.batch_size):
        path, log, draw = _collect(walk(b, tree.num_nodes[b], nt[b], ns[b], rule_of(b)))
        assert draw is not None  # a walk always ends with its bonus event
        paths.append(path)
        bonus_tokens.append(draw.token)
        exhausted.append(draw.token < 0)
        decisions.append(log)
        bonus.append(draw)
    return finish_output(vi, paths, bonus_tokens, exhausted, decisions, bonus, backend, thresholds, tree)
