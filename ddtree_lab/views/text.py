"""Plain-text renderings of a :class:`StepView`: the indented tree and the decision table
(golden tests compare both; the CLI prints them)."""

from __future__ import annotations

from .model import StepView, token_label
from .labels import mass_label
from .labels import number_label

__all__ = ["to_text", "decisions_text", "decisions_markdown"]

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
        lines.append(f"{pad}★ bonus {token_label(b.text)} ({b.kind}) {p}{extra}")

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
        lines.append(f"{pad}{MARKS[status]} [{i}] {token_label(node.text)}{info}")
        if view.bonus is not None and i == view.bonus_parent and (view.cursor is None or view.cursor.bonus_done):
            bonus_line(indent + 1)
        for c in reversed(node.children):
            stack.append((c, indent + 1))
    return "\n".join(lines) + "\n"


def _decision_table(view: StepView) -> tuple[list[str], list[list[str]], str]:
    """(header, one row of cells per decision, the bonus line) of the decision table, shared by
    :func:`decisions_text` and :func:`decisions_markdown`."""
    greedy = view.greedy
    head = (["#", "depth", "parent", "node", "token", "target p", "= argmax?", "verdict"] if greedy else
            ["#", "depth", "parent", "node", "token", "target p", "S_k", "coin", "verdict"])
    rows = []
    for d in view.decisions:
        p = "?" if d.target_p is None else f"{'<' if d.target_p_upper else ''}{d.target_p:.4g}"
        common = [str(d.order), str(d.depth), str(d.parent), str(d.node), token_label(d.text), p]
        if greedy:
            rows.append(common + ["yes" if d.verdict == "accept" else "no", d.verdict])
        else:
            rows.append(common + [mass_label(d.mass), number_label(d.coin), d.verdict])
    b = view.bonus
    if b.token < 0:
        bonus = (f"bonus: none (support exhausted at node {b.node}, residual mass {mass_label(b.residual_mass)}, "
                 f"coin {number_label(b.coin)})")
    elif greedy:
        bonus = f"bonus {token_label(b.text)}: the target's argmax at node {b.node}"
    else:
        p = "?" if b.target_p is None else f"{'<' if b.target_p_upper else ''}{b.target_p:.4g}"
        bonus = (f"bonus {token_label(b.text)} at node {b.node} ({b.kind}): target p {p}, residual p "
                 f"{number_label(b.residual_p)}, residual mass {mass_label(b.residual_mass)}, coin {number_label(b.coin)}")
    return head, rows, bonus


def decisions_text(view: StepView) -> str:
    """The decision table as fixed-width text (greedy: target p and the argmax comparison;
    sampled: target p, S_k, coin, verdict), then the bonus line; a lossy step's
    ``LOSSY: ...`` mark comes first."""
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
    Token cells are code spans, so spaces and markup in a token show as they are."""
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
