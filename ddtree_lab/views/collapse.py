"""Collapse of a lowered step's tree: hidden nodes become one summary node per parent."""

from __future__ import annotations

__all__ = ["collapse_nodes"]


def collapse_nodes(nodes: dict, unvisited: bool, max_depth, min_target_p, min_drafter_q, keep=None,
                   max_children: int | None = None) -> int:
    """Hide nodes of a lowered step in place (:func:`ddtree_lab.views.step_view`'s collapse
    options); returns how many were hidden.

    ``nodes``: node index -> :class:`ddtree_lab.views.NodeView` (children lists in sibling
    order). Nodes whose status is not ``unvisited`` and the indices in ``keep`` (e.g. a
    what-if path) stay; a hidden node hides its subtree; each parent's hidden children become
    one summary node (``status="collapsed"``, indices -2, -3, ...) counting every node it hides.
    ``max_children``: draw at most this many children per parent (a wide fan): the accepted
    child and the ``keep`` nodes always, then the first ones in sibling order; the others, even
    visited and rejected ones, go into the summary, which says how many of them were rejected."""
    from .nodes import NodeView

    keep = set(keep or ())
    if not (unvisited or max_depth is not None or min_target_p is not None or min_drafter_q is not None
            or max_children is not None):
        return 0

    def stays(node) -> bool:
        if node.status != "unvisited" or node.index in keep:
            return True
        if unvisited:
            return False
        if max_depth is not None and node.depth > max_depth:
            return False
        if min_target_p is not None and (node.target_p is None or node.target_p < min_target_p):
            return False
        if min_drafter_q is not None and (node.drafter_q is None or node.drafter_q < min_drafter_q):
            return False
        return True

    def subtree(i: int) -> list[int]:
        out, stack = [], [i]
        while stack:
            j = stack.pop()
            out.append(j)
            stack.extend(nodes[j].children)
        return out

    total, next_id = 0, -2
    for i in sorted(k for k in nodes if k >= 0):
        node = nodes.get(i)
        if node is None:
            continue
        hide = [c for c in node.children if not stays(nodes[c])]
        if max_children is not None:
            shown = [c for c in node.children if c not in hide]
            must = [c for c in shown if nodes[c].status in ("accepted", "root") or c in keep]
            room = max(max_children - len(must), 0)
            extra = [c for c in shown if c not in must][room:]
            hide = [c for c in node.children if c in hide or c in extra]
        if not hide:
            continue
        rejected = sum(nodes[c].status == "rejected" for c in hide)
        best = nodes[hide[0]]
        probs = [nodes[c].target_p for c in hide if nodes[c].target_p is not None]
        count = 0
        for c in hide:
            for j in subtree(c):
                nodes.pop(j)
                count += 1
        total += count
        text = f"+{count} hidden" + (f" ({rejected} rejected)" if rejected else "")
        summary = NodeView(next_id, -1, text, "collapsed", best.depth, best.rank, best.logw,
                           parent=i, target_p=max(probs) if probs else None, hidden=count)
        summary.children = []
        node.children = [c for c in node.children if c not in hide] + [next_id]
        nodes[next_id] = summary
        next_id -= 1
    return total
