"""Plain-text renderings of a :class:`StepView`: the indented tree and the decision table
(golden tests compare both; the CLI prints them)."""

from __future__ import annotations

import math

from ..labels import mass_label, number_label
from .model import StepView

__all__ = ["to_text", "decisions_text", "decisions_markdown"]

MARKS = {"root": "◆", "accepted": "✔", "rejected": "✘", "unvisited": "·", "pending": "?", "collapsed": "…"}


def _logw(x: float) -> str:
    return "?" if math.isnan(x) else f"{x:.3f}"


def to_text(view: StepView) -> str:
    """One line per node, children indented under their parent in sibling order:
    ``mark [index] 'token'  d r logw p q``; the bonus a ``★`` line under its parent. A step
    without target rows prints ``d r logw`` (``?`` where not recorded) and, under the title,
    the line naming what it does not record (:attr:`StepView.missing_note`)."""
    if view.rows_known:
        legend = ("p: target p · q: drafter q · residual p: the bonus in the residual · "
                  f"expected accepted draft tokens (sum of path p): {number_label(view.expected_accept)}")
    else:
        legend = ("d: depth · r: rank among the drafter's top-k (sibling rank) · logw: node log-weight · "
                  "✘: a child of an accepted-path node, not accepted")
    lines = [view.title, legend] + ([f"NOTE: {view.missing_note}"] if view.missing_note else [])

    def bonus_line(indent: int) -> None:
        b = view.bonus
        assert b is not None  # bonus_line runs only when the view has a bonus
        pad = "  " * indent
        if b.kind == "recorded":
            lines.append(f"{pad}★ bonus {view.label(b.token)} (as recorded; its target p and draw are not known)")
            return
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
            lines.append(f"{pad}… {node.text} (best logw={_logw(node.logw)}{best})")
            continue
        info = ""
        if status != "root":
            q = f" {node.drafter_q_text(4)}" if node.drafter_q_text(4) else ""
            p = f" {node.target_p_text(4)}" if view.rows_known else ""
            rank = node.rank if node.rank >= 0 else "?"
            info = f"  d{node.depth} r{rank} logw={_logw(node.logw)}{p}{q}"
        text = view.label(node.token) if node.token >= 0 else node.text
        lines.append(f"{pad}{MARKS[status]} [{i}] {text}{info}")
        if view.bonus is not None and i == view.bonus_parent and (view.cursor is None or view.cursor.bonus_done):
            bonus_line(indent + 1)
        for c in reversed(node.children):
            stack.append((c, indent + 1))
    return "\n".join(lines) + "\n"


def _decision_table(view: StepView) -> tuple[list[str], list[list[str]], str]:
    """(header, one row of cells per decision, the bonus line) of the decision table of a step
    with a decision log, shared by :func:`decisions_text` and :func:`decisions_markdown`."""
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
    b = view.bonus
    assert b is not None  # a step with walk events has a bonus draw
    if b.token < 0:
        bonus = (f"bonus: none (support exhausted at node {b.node}, residual mass {mass_label(b.residual_mass)}, "
                 f"coin {number_label(b.coin)})")
    elif greedy:
        bonus = f"bonus {view.label(b.token)}: the target's argmax at node {b.node}"
    else:
        p = "?" if b.target_p is None else f"{'<' if b.target_p_upper else ''}{b.target_p:.4g}"
        bonus = (f"bonus {view.label(b.token)} at node {b.node} ({b.kind}): target p {p}, residual p "
                 f"{number_label(b.residual_p)}, residual mass {mass_label(b.residual_mass)}, coin {number_label(b.coin)}")
    return head, rows, bonus


def decisions_text(view: StepView) -> str:
    """The decision table as fixed-width text (greedy: target p and the argmax comparison;
    sampled: target p, S_k, coin, verdict), then the bonus line; a lossy step's
    ``LOSSY: ...`` mark comes first. A step without a decision log says so (and what else it
    does not record) instead of printing an empty table."""
    if not view.events:
        return "\n".join(_no_log_lines(view)) + "\n"
    head, rows, bonus = _decision_table(view)
    widths = [max(len(r[c]) for r in [head] + rows) for c in range(len(head))]
    out = ([view.lossy_mark] if view.lossy else []) + [
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in [head] + rows]
    out.append(bonus)
    return "\n".join(out) + "\n"


def _md_cell(text: str) -> str:
    """A Markdown table cell: ``|`` escaped (GitHub reads ``\\|`` as a pipe inside code spans
    too), line breaks as ``<br>``."""
    return text.replace("|", "\\|").replace("\n", "<br>")


def _code_span(text: str) -> str:
    """``text`` as a Markdown code span, its fence one backtick longer than any run inside it."""
    import re

    fence = "`" * (max((len(m) for m in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def decisions_markdown(view: StepView) -> str:
    """The decision table of :func:`decisions_text` as a GitHub-flavoured Markdown table (the same
    columns and cells, ``|`` escaped), then the bonus line; a lossy step's ``LOSSY: ...`` mark first.
    Token cells are code spans, so spaces and markup in a token show as they are. A step without
    a decision log: the lines of :func:`decisions_text` for it, as paragraphs."""
    if not view.events:
        return "\n\n".join(_md_cell(line) for line in _no_log_lines(view)) + "\n"
    head, rows, bonus = _decision_table(view)
    token = head.index("token")

    def cells(r: list[str], header: bool) -> str:
        shown = [c if header or k != token else _code_span(c) for k, c in enumerate(r)]
        return "| " + " | ".join(_md_cell(c) for c in shown) + " |"

    out = ([f"**{view.lossy_mark}**", ""] if view.lossy else []) + [cells(head, True),
                                                                       "|" + "---|" * len(head)]
    out += [cells(r, False) for r in rows]
    out += ["", _md_cell(bonus)]
    return "\n".join(out) + "\n"


def _no_log_lines(view: StepView) -> list[str]:
    """The decision table's place for a step without a decision log: the recorded outcome
    (accepted path with its tokens, the bonus token) and what is not recorded."""
    path = [f"{i} {view.label(view.nodes[i].token)}" for i in view.accepted_path[1:] if i in view.nodes]
    b = view.bonus
    bonus = ("not recorded" if b is None else "none (support exhausted)" if b.token < 0 else
             f"{view.label(b.token)} at node {b.node} (as recorded; its draw is not known)")
    return [f"no decision log recorded ({view.source}): which children the verifier judged, and with what "
            "target p, S_k and coin, is not known",
            f"accepted path (root first): {' → '.join(map(str, view.accepted_path))}; accepted draft tokens: "
            + (", ".join(path) if path else "none"),
            f"bonus: {bonus}"] + ([f"NOTE: {view.missing_note}"] if view.missing_note else [])
