"""Plain-text renderings of a :class:`StepView`: the indented tree and the decision table
(golden tests compare both; the CLI prints them)."""

from __future__ import annotations

from .model import StepView
from .labels import mass_label
from .labels import number_label

__all__ = ["to_text", "decisions_text"]

MARKS = {"root": "◆", "accepted": "✔", "rejected": "✘", "unvisited": "·", "pending": "?", "collapsed": "…"}


def to_text(view: StepView) -> str:
    """One line per node, children indented under their parent in sibling order:
    ``mark [index] 'token'  d r logw p q``; the bonus a ``★`` line under its parent."""
    lines = [view.title, "p: target p · q: drafter q · residual p: the bonus in the residual · "
             f"expected accepted draft tokens (sum of path p): {number_label(view.expected_accept)}"]

    def bonus_line(indent: int) -> None:
        b = view.bonus
        pad = "  " * indent
        if b.token < 0:
            lines.append(f"{pad}★ no bonus: support exhausted at node {b.node} (residual mass {mass_label(b.residual_mass)})")
            return
        p = f"p{'<' if b.target_p_upper else '='}{number_label(b.target_p)}" if b.target_p is not None else "p=?"
        extra = f" residual p={number_label(b.residual_p)}" if b.residual_p is not None else ""
        lines.append(f"{pad}★ bonus {view.label(b.token)} ({b.kind}) {p}{extra}")

    stack = [(0, 0)]
    while stack:
        i, indent = stack.pop()
        node = view.nodes[i]
        status = view.status(i)
        pad = "  " * indent
        if status == "collapsed":
            best = "" if node.target_p is None else f", max p={number_label(node.target_p)}"
            lines.append(f"{pad}… {node.text} (best logw={node.logw:.3f}{best})")
            continue
        info = ""
        if status != "root":
            q = f" {node.drafter_q_text(4)}" if node.drafter_q_text(4) else ""
            info = f"  d{node.depth} r{node.rank} logw={node.logw:.3f} {node.target_p_text(4)}{q}"
        lines.append(f"{pad}{MARKS[status]} [{i}] {view.label(node.token)}{info}")
        if view.bonus is not None and i == view.bonus_parent and (view.cursor is None or view.cursor.bonus_done):
            bonus_line(indent + 1)
        for c in reversed(node.children):
            stack.append((c, indent + 1))
    return "\n".join(lines) + "\n"


def decisions_text(view: StepView) -> str:
    """The decision table as fixed-width text (greedy: target p and the argmax comparison;
    sampled: target p, S_k, coin, verdict), then the bonus line; a lossy step's
    ``LOSSY: ...`` mark comes first."""
    greedy = view.greedy
    head = (["#", "depth", "parent", "node", "token", "target p", "= argmax?", "verdict"] if greedy else
            ["#", "depth", "parent", "node", "token", "target p", "S_k", "coin", "verdict"])
    rows = []
    for d in view.decisions:
        p = "?" if d.target_p is None else f"{'<' if d.target_p_upper else ''}{d.target_p:.4g}"
        common = [str(d.order), str(d.depth), str(d.parent), str(d.node), view.label(d.token), p]
        if greedy:
            rows.append(common + ["yes" if d.verdict == "accept" else "no", d.verdict])
        else:
            rows.append(common + [mass_label(d.mass), number_label(d.coin), d.verdict])
    widths = [max(len(r[c]) for r in [head] + rows) for c in range(len(head))]
    out = ([view.lossy_mark] if view.lossy else []) + [
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in [head] + rows]
    b = view.bonus
    if b.token < 0:
        out.append(f"bonus: none (support exhausted at node {b.node}, residual mass {mass_label(b.residual_mass)}, "
                   f"coin {number_label(b.coin)})")
    elif greedy:
        out.append(f"bonus {view.label(b.token)}: the target's argmax at node {b.node}")
    else:
        p = "?" if b.target_p is None else f"{'<' if b.target_p_upper else ''}{b.target_p:.4g}"
        out.append(f"bonus {view.label(b.token)} at node {b.node} ({b.kind}): target p {p}, residual p "
                   f"{number_label(b.residual_p)}, residual mass {mass_label(b.residual_mass)}, coin {number_label(b.coin)}")
    return "\n".join(out) + "\n"
