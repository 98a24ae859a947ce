"""Views of recorded steps: one view model, rendered to DOT/SVG (graphviz) and to text.

A step becomes a :class:`StepView` (nodes, edges, styles, labels) -- the single intermediate
form (the treescope idea: lower once, render many ways). :func:`to_dot` renders it for
graphviz, :func:`to_text` as an indented plain-text tree (golden tests compare these), and
:func:`step_svg` lays it out with ``dot``. :func:`committed_html` shows a request's text with
each step's tokens coloured. Views read :class:`ddtree_lab.trace.StepTrace` records only.

Node labels: the token text, then ``d`` depth / ``r`` rank, ``logw`` (node log-weight under
the drafter) and ``p`` (the target probability of the token in its parent's row: exact for
sampled requests; for greedy requests, whose verify rows are one-hot, the softmax of the raw
logits from the stored top-M row, shown as ``p<x`` when the token is outside it). Children
are drawn left to right in sibling order (descending log-weight). Styles: accepted path
green and bold, visited-and-rejected siblings red, nodes the walk never reached grey; the
bonus token is a blue box hanging off the last accepted node.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field

from .trace import RunTrace, StepTrace

__all__ = ["NodeView", "StepView", "step_view", "to_dot", "to_text", "step_svg", "committed_html", "token_label"]

STATUS_STYLE = {
    "root": {"color": "#1f4e79", "fillcolor": "#dbe9f6", "penwidth": "2"},
    "accepted": {"color": "#1b7f3b", "fillcolor": "#d9f2e1", "penwidth": "2.5"},
    "rejected": {"color": "#b3261e", "fillcolor": "#fbe3e1", "penwidth": "1.5"},
    "unvisited": {"color": "#9e9e9e", "fillcolor": "#f5f5f5", "penwidth": "1", "fontcolor": "#616161"},
    "bonus": {"color": "#1565c0", "fillcolor": "#e3f0ff", "penwidth": "2", "shape": "box"},
    "collapsed": {"color": "#bdbdbd", "fillcolor": "#fafafa", "penwidth": "1", "fontcolor": "#757575",
                  "shape": "note"},
}


def token_label(text: str) -> str:
    """A token's text made visible: spaces as '␣', newlines as '⏎', tabs as '⇥', quoted."""
    shown = text.replace(" ", "␣").replace("\n", "⏎").replace("\t", "⇥")
    return f"'{shown}'" if shown else "''"


@dataclass
class NodeView:
    """One drawn node. ``index`` is the tree node index (bonus: ``-1``)."""

    index: int
    token: int
    text: str
    status: str  # root | accepted | rejected | unvisited | bonus
    depth: int
    rank: int
    logw: float
    prob: float | None
    children: list[int] = field(default_factory=list)
    below: bool = False  # prob is an upper bound (token outside the stored top-M of the row)

    def prob_text(self, digits: int = 3) -> str:
        if self.prob is None:
            return ""
        return f"p{'<' if self.below else '='}{self.prob:.{digits}g}"

    def lines(self) -> list[str]:
        if self.status == "collapsed":
            return [self.text, f"best: logw={self.logw:.2f}"]
        head = token_label(self.text)
        if self.status == "root":
            return [head, "anchor (root)"]
        if self.status == "bonus":
            return [head, f"bonus {self.prob_text()}".rstrip()]
        return [head, f"d{self.depth} r{self.rank} logw={self.logw:.2f}", self.prob_text()]


@dataclass
class StepView:
    """The view model of one step: nodes by index (bonus last) and a title."""

    title: str
    nodes: dict[int, NodeView]
    bonus: NodeView | None
    bonus_parent: int


def step_view(step: StepTrace, texts: dict[int, str] | RunTrace, collapse_unvisited: bool = False) -> StepView:
    """Lower a recorded step to its :class:`StepView`.

    Args:
        step: the recorded step.
        texts: token id -> text (a :class:`RunTrace` works too).
        collapse_unvisited: draw the children the walk never reached, with their subtrees,
            as one grey node per parent (``+N unvisited``) -- keeps wide trees readable.
    """
    lookup = texts.text if isinstance(texts, RunTrace) else (lambda t: texts.get(int(t), f"<{int(t)}>"))
    n = step.num_nodes
    accepted = set(step.accepted_path)
    rejected = {d.node for d in step.decisions if d.verdict == "reject"}
    greedy = step.params.is_greedy
    nodes = {}
    for i in range(n):
        status = "root" if i == 0 else "accepted" if i in accepted else "rejected" if i in rejected else "unvisited"
        tok = int(step.node_token_ids[i])
        prob, below = (None, False) if i == 0 else _prob(step, int(step.parents[i]), tok, greedy)
        if i and not greedy:
            prob, below = float(step.child_probs[i]), False  # exact for sampled requests
        nodes[i] = NodeView(i, tok, lookup(tok), status, int(step.depths[i]), int(step.ranks[i]),
                            float(step.node_logws[i]), prob, below=below)
    for i in range(1, n):  # ascending index = sibling order
        nodes[int(step.parents[i])].children.append(i)
    if collapse_unvisited:
        _collapse(nodes)
    bonus = None
    if step.bonus_token >= 0:
        prob, below = _prob(step, step.bonus.node, step.bonus_token, greedy)
        if not greedy:
            prob, below = step.bonus.token_prob, False  # its probability in the residual
        bonus = NodeView(-1, step.bonus_token, lookup(step.bonus_token), "bonus", -1, -1, 0.0, prob, below=below)
    p = step.params
    mode = "greedy" if p.is_greedy else f"T={p.temperature:g} top_k={p.top_k} top_p={p.top_p:g}"
    title = (f"step {step.step} · request {step.request_id} · {mode} · {n - 1} draft nodes · "
             f"accepted {step.accept_length} + bonus")
    return StepView(title, nodes, bonus, step.bonus.node)


def _collapse(nodes: dict[int, NodeView]) -> None:
    """Replace each parent's unvisited children (and their subtrees) by one summary node."""
    def subtree(i: int) -> list[int]:
        out = [i]
        for c in nodes[i].children:
            out += subtree(c)
        return out

    next_id = -2
    for i in list(nodes):
        node = nodes.get(i)
        if node is None:
            continue
        hidden = [c for c in node.children if nodes[c].status == "unvisited"]
        if not hidden:
            continue
        count = sum(len(subtree(c)) for c in hidden)
        best = nodes[hidden[0]]
        for c in hidden:
            for j in subtree(c):
                nodes.pop(j, None)
        node.children = [c for c in node.children if c not in hidden] + [next_id]
        nodes[next_id] = NodeView(next_id, -1, f"+{count} unvisited", "collapsed", best.depth, best.rank, best.logw, None)
        next_id -= 1


def _prob(step: StepTrace, row: int, token: int, greedy: bool) -> tuple[float, bool]:
    """Display probability of ``token`` in node ``row``'s stored top-M row: ``(p, False)``, or
    ``(smallest stored p, True)`` as an upper bound when the token is outside the top-M.
    Greedy steps read it from the softmax of the raw logits (their verify rows are one-hot)."""
    ids = step.top_token_ids[row].tolist()
    if token in ids:
        return float(step.top_probs[row, ids.index(token)]), False
    bound = float(step.top_probs[row, -1])
    return bound, bound > 0.0  # a zero bound is exact: the token has probability 0


def _dot_id(i: int) -> str:
    return f"n{i}" if i >= 0 else f"c{-i}"  # collapsed summary nodes have negative ids


def _dot_escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


def to_dot(view: StepView) -> str:
    """The DOT source of a step view (deterministic: golden tests compare it)."""
    out = ["digraph step {", '  graph [rankdir=TB, ordering=out, nodesep=0.08, ranksep=0.3, fontname="Helvetica",',
           f'         label="{_dot_escape(view.title)}", labelloc=t, fontsize=12];',
           '  node [shape=ellipse, style=filled, fontname="Helvetica", fontsize=9, margin="0.05,0.03"];',
           '  edge [arrowsize=0.6];']
    for i, node in view.nodes.items():
        style = STATUS_STYLE[node.status]
        attrs = ", ".join(f'{k}="{v}"' for k, v in style.items())
        label = "\\n".join(_dot_escape(line) for line in node.lines())
        out.append(f'  {_dot_id(i)} [label="{label}", {attrs}];')
    for i, node in view.nodes.items():
        for c in node.children:
            child = view.nodes[c]
            if child.status == "accepted":
                edge = ' [color="#1b7f3b", penwidth=2.5]'
            elif child.status == "rejected":
                edge = ' [color="#b3261e", style=dashed]'
            else:
                edge = ' [color="#bdbdbd"]'
            out.append(f"  {_dot_id(i)} -> {_dot_id(c)}{edge};")
    if view.bonus is not None:
        style = STATUS_STYLE["bonus"]
        attrs = ", ".join(f'{k}="{v}"' for k, v in style.items())
        label = "\\n".join(_dot_escape(line) for line in view.bonus.lines())
        out.append(f'  bonus [label="{label}", {attrs}];')
        out.append(f'  n{view.bonus_parent} -> bonus [color="#1565c0", penwidth=2, style=bold];')
    out.append("}")
    return "\n".join(out) + "\n"


def to_text(view: StepView) -> str:
    """An indented plain-text rendering: one line per node, children in sibling order."""
    marks = {"root": "◆", "accepted": "✔", "rejected": "✘", "unvisited": "·", "collapsed": "…"}
    lines = [view.title]

    def walk(i: int, indent: int) -> None:
        node = view.nodes[i]
        if node.status == "collapsed":
            lines.append(f"{'  ' * indent}… {node.text} (best logw={node.logw:.3f})")
            return
        info = "" if node.status == "root" else f"  d{node.depth} r{node.rank} logw={node.logw:.3f} {node.prob_text(4)}"
        lines.append(f"{'  ' * indent}{marks[node.status]} [{i}] {token_label(node.text)}{info}")
        if view.bonus is not None and i == view.bonus_parent:
            p = " " + view.bonus.prob_text(4) if view.bonus.prob is not None else ""
            lines.append(f"{'  ' * (indent + 1)}★ bonus {token_label(view.bonus.text)}{p}")
        for c in node.children:
            walk(c, indent + 1)

    walk(0, 0)
    return "\n".join(lines) + "\n"


def step_svg(step: StepTrace, texts: dict[int, str] | RunTrace, collapse_unvisited: bool = False) -> str:
    """The step's tree laid out by graphviz ``dot`` as an SVG string.

    Raises:
        RuntimeError: graphviz's ``dot`` binary is missing (install graphviz).
    """
    import graphviz

    source = graphviz.Source(to_dot(step_view(step, texts, collapse_unvisited)))
    try:
        return source.pipe(format="svg").decode("utf-8")
    except graphviz.ExecutableNotFound as exc:
        raise RuntimeError("graphviz's `dot` binary is missing: apt-get install graphviz "
                           "(or conda install -c conda-forge graphviz)") from exc


_PALETTE = ["#fde2e4", "#e2ece9", "#dfe7fd", "#fff1c1", "#e8dff5", "#d8f3dc", "#ffe5d9", "#cddafd"]


def committed_html(run: RunTrace, request: int = 0) -> str:
    """The request's generated text, each step's tokens on its own colour; a step's bonus
    token is underlined. The prefill's first token is grey. Hover shows step and role."""
    meta = run.metadata["requests"][request]
    generated = list(meta["generated_token_ids"])
    parts = []
    if generated:
        parts.append(f'<span title="prefill" style="background:#eeeeee">{html.escape(run.text(generated[0]))}</span>')
    count = 1
    for s in run.for_request(request):
        color = _PALETTE[s.step % len(_PALETTE)]
        emitted = s.emitted
        for j, tok in enumerate(emitted):
            if count >= len(generated):
                break
            role = "bonus" if j == len(emitted) - 1 and not bool(s.output.support_exhausted[0]) else "accepted draft"
            deco = "text-decoration:underline;" if role == "bonus" else ""
            parts.append(f'<span title="step {s.step}: {role}" style="background:{color};{deco}">'
                         f"{html.escape(run.text(tok))}</span>")
            count += 1
    body = "".join(parts).replace("\n", "<br>")
    return (f'<div style="font-family:monospace;white-space:pre-wrap;line-height:1.6">'
            f"<b>{html.escape(meta['prompt'])}</b><br>{body}</div>")
