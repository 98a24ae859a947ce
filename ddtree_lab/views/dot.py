"""The picture of a :class:`StepView`: DOT source (deterministic, golden-tested) and SVG by
graphviz ``dot``.

Layout: left to right (``rankdir=LR``): depth grows to the right, siblings run top to bottom
in sibling order (descending log-weight), so a wide tree grows down the page, where a notebook
scrolls, instead of off its right edge. Each node shows ``#index`` (the decision table's node
column) and its token, then ``p`` (target p), ``q`` (drafter q) and ``r`` (rank); the tooltip
holds every number. Colours: accepted path green and bold, visited-and-rejected siblings red,
never reached grey, the bonus token a blue box, summaries of hidden nodes grey notes. With a
decision cursor: nodes not judged yet are dotted, the node the walk stands on has an orange
border and the node of the last event is filled yellow.
"""

from __future__ import annotations

import math
import re
import textwrap

from ..labels import LOSSY_COLOR, mass_label, token_label
from ..labels import number_label
from .model import StepView, step_view
from .nodes import NodeView

__all__ = ["to_dot", "step_svg", "render_svg", "svg_size", "STATUS_STYLE", "WHAT_IF_COLOR"]

STATUS_STYLE = {
    "root": {"color": "#1f4e79", "fillcolor": "#dbe9f6", "penwidth": "2"},
    "accepted": {"color": "#1b7f3b", "fillcolor": "#d9f2e1", "penwidth": "2.5"},
    "rejected": {"color": "#b3261e", "fillcolor": "#fbe3e1", "penwidth": "1.5"},
    "unvisited": {"color": "#9e9e9e", "fillcolor": "#f5f5f5", "penwidth": "1", "fontcolor": "#616161"},
    "pending": {"color": "#9e9e9e", "fillcolor": "#ffffff", "penwidth": "1", "fontcolor": "#616161",
                "style": "filled,dotted"},
    "collapsed": {"color": "#bdbdbd", "fillcolor": "#fafafa", "penwidth": "1", "fontcolor": "#757575",
                  "shape": "note"},
    "bonus": {"color": "#1565c0", "fillcolor": "#e3f0ff", "penwidth": "2", "shape": "box"},
}
EDGE_STYLE = {
    "accepted": 'color="#1b7f3b", penwidth=2.5',
    "rejected": 'color="#b3261e", style=dashed',
    "pending": 'color="#bdbdbd", style=dotted',
}
CURRENT_STYLE = {"color": "#e65100", "penwidth": "3.5"}
#: the what-if walk (stepper): its nodes' border and its edges.
WHAT_IF_COLOR = "#6a1b9a"
WHAT_IF_STYLE = {"color": WHAT_IF_COLOR, "penwidth": "3"}
FOCUS_STYLE = {"fillcolor": "#fff59d"}
#: the edges' styles (:data:`EDGE_STYLE`) in words: the legend's second line.
EDGE_LEGEND = "edges: green: accepted · red dashed: rejected · grey dotted: not decided yet"
LEGEND = "#: node index · p: target p · q: drafter q · r: rank among the drafter's top-k\n" + EDGE_LEGEND
#: the legend of a view without target rows (no p; depth and node log-weight instead).
LEGEND_NO_ROWS = ("#: node index · d: depth · r: rank among the drafter's top-k (sibling rank) · "
                  "logw: node log-weight · red: a child of an accepted-path node, not accepted\n" + EDGE_LEGEND)
#: the width (characters) the note naming what a step does not record wraps at.
NOTE_WIDTH = 120


def _esc(text: str) -> str:
    """A DOT double-quoted string body: backslashes and quotes escaped (so graphviz's own
    escapes such as ``\\N`` never fire on token text), and ``&`` as ``&amp;`` (graphviz decodes
    HTML entities in plain labels: ``&amp;`` in a token would otherwise render as ``&``)."""
    return text.replace("&", "&amp;").replace("\\", "\\\\").replace('"', '\\"')


def _dot_id(i: int) -> str:
    return f"n{i}" if i >= 0 else f"c{-i}"


def _label_lines(node: NodeView, status: str, label: str, rows_known: bool = True) -> list[str]:
    if status == "collapsed":
        best = "" if node.target_p is None else f"max p={node.target_p:.2g}"
        return [node.text, best] if best else [node.text]
    head = f"#{node.index} {label}"
    if status == "root":
        return [head, "root"]
    if not rows_known:  # no target p to show: depth, rank and log-weight (when recorded)
        logw = "" if math.isnan(node.logw) else f" logw={node.logw:.3g}"
        q = f" {node.drafter_q_text(2)}" if node.drafter_q_text(2) else ""
        return [head, f"d{node.depth}" + (f" r{node.rank}" if node.rank >= 0 else "") + logw + q]
    second = " ".join(x for x in (node.target_p_text(2), node.drafter_q_text(2), f"r{node.rank}" if node.rank >= 0 else "")
                      if x)
    return [head, second]


def _tooltip(node: NodeView) -> str:
    if node.status == "collapsed":
        return f"{node.hidden} hidden nodes below node {node.parent}"
    if node.index == 0:
        return f"node 0 (root / anchor) {token_label(node.text)}"
    parts = [f"node {node.index}", f"token {node.token} {token_label(node.text)}", f"depth {node.depth}",
             f"rank {node.rank if node.rank >= 0 else '?'}", f"logw {'?' if math.isnan(node.logw) else _fmt(node.logw)}",
             f"target {node.target_p_text(4)}"]
    if node.drafter_q is not None:
        parts.append(f"drafter {node.drafter_q_text(4)}")
    if node.accept_p is not None:
        parts.append(f"accept p {_fmt(node.accept_p)} (at its parent)")
    if node.path_p is not None:
        parts.append(f"path p {_fmt(node.path_p)}")
    if node.order is not None:
        parts.append(f"decision {node.order}" + (f", coin {_fmt(node.coin)}, S_k {mass_label(node.mass, missing='?')}"
                                                 if node.coin is not None else ""))
    return " · ".join(parts)


def _fmt(x) -> str:
    return number_label(x, missing="?")


def _attrs(style: dict) -> str:
    return ", ".join(f'{k}="{v}"' for k, v in style.items())


def to_dot(view: StepView, what_if: list[int] | None = None) -> str:
    """The DOT source of a step view (deterministic: golden tests compare it). A lossy step's
    title ends with its ``LOSSY: ...`` mark and the graph label is red.

    ``what_if``: a what-if walk's path from the node whose coin changed (the stepper passes
    :class:`ddtree_lab.views.WhatIf.path` from that node on): the nodes after the first get a
    purple border, the path's edges are purple and bold. The nodes must be in the view (lower
    it with ``keep=path``); a path node not in the view raises ``ValueError``."""
    cur = view.cursor
    red = f', fontcolor="{LOSSY_COLOR}"' if view.lossy else ""
    legend = (LEGEND if view.rows_known else LEGEND_NO_ROWS) + (" · purple: the what-if walk" if what_if else "")
    legend_dot = "\\n".join(_esc(line) for line in legend.split("\n"))  # one DOT line per legend line
    on_path = set(what_if or ())
    missing = sorted(on_path - set(view.nodes))
    if missing:
        raise ValueError(f"what-if path nodes {missing} are hidden in the view (lower it with keep=path)")
    path_edges = set(zip(what_if or (), (what_if or ())[1:]))
    path_start = what_if[0] if what_if else None
    # what the step does not record: its own lines under the legend, in every picture of the step
    note = "".join("\\n" + _esc(line) for line in textwrap.wrap("NOTE: " + view.missing_note, NOTE_WIDTH)) \
        if view.missing_note else ""
    out = ["digraph step {",
           '  graph [rankdir=LR, ordering=out, nodesep=0.04, ranksep=0.22, fontname="Helvetica",',
           f'         label="{_esc(view.title)}\\n{legend_dot}{note}", labelloc=t, labeljust=l, fontsize=11{red}];',
           '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10, margin="0.04,0.02", '
           'height=0.3];',
           "  edge [arrowsize=0.5];"]
    for i, node in view.nodes.items():
        status = view.status(i)
        style = dict(STATUS_STYLE[status])
        if status not in ("collapsed", "pending"):
            style.setdefault("style", "rounded,filled")
        if cur is not None and i == cur.current and not cur.bonus_done and view.events:  # no events: no walk
            style.update(CURRENT_STYLE)
        if i in on_path and i != path_start:
            style.update(WHAT_IF_STYLE)
        if cur is not None and i == cur.focus and i != 0:
            style.update(FOCUS_STYLE)
        token = view.label(node.token) if node.token >= 0 else node.text
        label = "\\n".join(_esc(line) for line in _label_lines(node, status, token, view.rows_known))
        out.append(f'  {_dot_id(i)} [label="{label}", tooltip="{_esc(_tooltip(node))}", {_attrs(style)}];')
    for i, node in view.nodes.items():
        for c in node.children:
            edge = EDGE_STYLE.get(view.status(c), 'color="#bdbdbd"')
            if (i, c) in path_edges:
                edge = f'color="{WHAT_IF_COLOR}", penwidth=3, style=bold'
            out.append(f"  {_dot_id(i)} -> {_dot_id(c)} [{edge}];")
    b = view.bonus
    if b is not None and (cur is None or cur.bonus_done):
        style = dict(STATUS_STYLE["bonus"])
        style["style"] = "filled"
        if cur is not None and cur.focus == -1:
            style.update(FOCUS_STYLE)
        if b.token < 0:
            lines = ["no bonus", "support exhausted"]
        elif b.kind == "recorded":
            lines = [f"bonus {view.label(b.token)}", "as recorded (p not known)"]
        elif view.greedy:
            lines = [f"bonus {view.label(b.token)}", f"argmax {_p(b)}"]
        else:
            res = "" if b.residual_p is None else f" residual p={b.residual_p:.2g}"
            lines = [f"bonus {view.label(b.token)}", f"{_p(b)}{res}"]
        label = "\\n".join(_esc(line) for line in lines)
        tip = (f"bonus at node {b.node}: the token the run emitted (its draw is not recorded)" if b.kind == "recorded"
               else f"bonus at node {b.node} ({b.kind})")
        out.append(f'  bonus [label="{label}", tooltip="{_esc(tip)}", {_attrs(style)}];')
        out.append(f'  n{view.bonus_parent} -> bonus [color="#1565c0", penwidth=2, style=bold];')
    out.append("}")
    return "\n".join(out) + "\n"


def _p(b) -> str:
    if b.target_p is None:
        return "p=?"
    return f"p{'<' if b.target_p_upper else '='}{b.target_p:.2g}"


def render_svg(dot_source: str) -> str:
    """Lay out DOT source with graphviz ``dot``; the SVG document as a string.

    Raises:
        RuntimeError: graphviz's ``dot`` binary is missing (install graphviz).
    """
    import graphviz

    try:
        return graphviz.Source(dot_source).pipe(format="svg").decode("utf-8")
    except graphviz.ExecutableNotFound as exc:
        raise RuntimeError("graphviz's `dot` binary is missing: apt-get install graphviz "
                           "(or conda install -c conda-forge graphviz)") from exc


def step_svg(step, texts=None, collapse_unvisited: bool = False, **options) -> str:
    """A step's tree as an SVG string: ``step`` is a :class:`ddtree_lab.step.Step`
    (lowered with :func:`ddtree_lab.views.step_view` and ``texts``, ``collapse_unvisited``
    and the collapse ``options``) or an already lowered :class:`StepView`.

    Raises:
        RuntimeError: graphviz's ``dot`` binary is missing.
    """
    view = step if isinstance(step, StepView) else step_view(step, texts, collapse_unvisited, **options)
    return render_svg(to_dot(view))


_SIZE = re.compile(r'<svg[^>]*?width="([0-9.]+)pt"[^>]*?height="([0-9.]+)pt"', re.S)


def svg_size(svg: str) -> tuple[float, float]:
    """``(width, height)`` in CSS pixels of an SVG written by graphviz (sizes in pt; 1 pt =
    4/3 px). Raises ``ValueError`` when the document has no pt width/height."""
    m = _SIZE.search(svg)
    if m is None:
        raise ValueError("the SVG has no width/height in pt (not written by graphviz dot?)")
    return float(m.group(1)) * 4 / 3, float(m.group(2)) * 4 / 3
