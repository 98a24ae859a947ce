"""Tree policies compared: the figures and tree drawings of issue #27 ("Does a tree pay here?").

Everything here reads results, never a model: :class:`ddtree_lab.analysis.counterfactual.
PolicyResult` lists (what :func:`~ddtree_lab.analysis.counterfactual.step_counterfactuals`
returned, computed before) or the rows ``benchmarks/tree_policies.py`` writes
(``benchmarks/tree_policies.json``).

* :func:`tokens_per_second_figure`: expected tokens/s against the budget per policy, with plain
  decoding and the chain's best budget as horizontal lines, one panel per temperature;
* :func:`tau_by_depth_figure`: the exact ``P(accepted >= d)`` by depth ``d`` per policy;
* :func:`policy_tree_dot`: one policy's tree of one step, drawn as every other tree of the lab
  (:mod:`ddtree_lab.views.dot` styles), each node with its reach probability.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from .layout import slider_kwargs, wrap_row

__all__ = ["load_policy_records", "tokens_per_second_figure", "tau_by_depth_figure", "policy_tree_dot", "PolicyPicker",
           "policy_trees_html", "mean_accept_by_depth", "readable_fonts", "FONT_PX", "nodes_note",
           "draft_positions"]

#: the smallest font size in px of the figures here (axis ticks, legend, subplot titles): issue 34.8
FONT_PX = 13


def readable_fonts(fig, size: int = FONT_PX):
    """Set every text of a plotly figure to at least ``size`` px: the figure's font, each
    axis's ticks and title, the legend, the subplot titles (annotations) and the title (larger).
    Returns the figure."""
    fig.update_layout(font=dict(size=size), legend=dict(font=dict(size=size)),
                      title=dict(font=dict(size=size + 4)))
    fig.update_xaxes(tickfont=dict(size=size), title_font=dict(size=size))
    fig.update_yaxes(tickfont=dict(size=size), title_font=dict(size=size))
    fig.update_annotations(font=dict(size=size + 1))
    return fig


PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"]


def load_policy_records(path: str | Path) -> tuple[dict, list[dict]]:
    """``(meta, rows)`` of ``benchmarks/tree_policies.json``: each row ``{"temperature",
    "policy", "budget", "nodes", "cf_tau", "live_tau", "bias", "expected_tok_s", ...}``; meta
    holds ``plain_tok_s`` and the cost model.

    Raises:
        FileNotFoundError: no such file. ValueError: a row lacks one of those fields, or no
            ``plain_tok_s``.
    """
    data = json.loads(Path(path).read_text())
    need = {"temperature", "policy", "budget", "cf_tau", "expected_tok_s"}
    for i, r in enumerate(data.get("rows", [])):
        if not need <= set(r):
            raise ValueError(f"row {i} of {path} lacks {sorted(need - set(r))}")
    if "plain_tok_s" not in data.get("meta", {}):
        raise ValueError(f"{path}: meta has no plain_tok_s")
    return data["meta"], data["rows"]


def tokens_per_second_figure(rows: Sequence[dict], plain_tok_s: float,
                             title: str = "Does a tree pay here? Expected tokens/s against budget"):
    """A plotly figure, one panel per temperature: each policy's expected tokens/s (exact
    counterfactual E[tau] over the measured round cost) against the budget (log-2 axis), solid;
    where a live run was made, the live tau over the same cost as open markers; plain decoding
    (dashed) and the chain's best budget (dotted) as horizontal lines.

    Args:
        rows: dicts with ``temperature``, ``policy``, ``budget``, ``expected_tok_s`` (None: not
            scored) and optionally ``live_tau_tok_s``. plain_tok_s: plain decoding's tokens/s.

    Returns:
        ``plotly.graph_objects.Figure``.

    Raises:
        ValueError: no rows with a value.
    """
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    rows = [r for r in rows if r.get("expected_tok_s") is not None]
    if not rows:
        raise ValueError("no rows with expected tokens/s to plot")
    temps = sorted({float(r["temperature"]) for r in rows})
    budgets = sorted({int(r["budget"]) for r in rows})
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    fig = make_subplots(rows=1, cols=len(temps), shared_yaxes=True,
                        subplot_titles=[f"T = {t:g}" for t in temps])
    for c, temp in enumerate(temps, start=1):
        mine = [r for r in rows if float(r["temperature"]) == temp]
        for i, name in enumerate(policies):
            pts = sorted((int(r["budget"]), r) for r in mine if r["policy"] == name)
            if not pts:
                continue
            color = PALETTE[i % len(PALETTE)]
            fig.add_trace(go.Scatter(x=[b for b, _ in pts], y=[r["expected_tok_s"] for _, r in pts],
                                     mode="lines+markers", name=name, legendgroup=name, showlegend=c == 1,
                                     line=dict(color=color)), row=1, col=c)
            lv = [(b, r["live_tau_tok_s"]) for b, r in pts if r.get("live_tau_tok_s") is not None]
            if lv:
                fig.add_trace(go.Scatter(x=[b for b, _ in lv], y=[v for _, v in lv], mode="markers",
                                         name=f"{name} (live τ)", legendgroup=name, showlegend=False,
                                         marker=dict(color=color, symbol="circle-open", size=10)), row=1, col=c)
        chain = [r["expected_tok_s"] for r in mine if r["policy"] == "chain"]
        lines = [("plain decoding", plain_tok_s, "dash")] + ([("chain (best budget)", max(chain), "dot")] if chain else [])
        for label, y, dash in lines:
            fig.add_trace(go.Scatter(x=[budgets[0], budgets[-1]], y=[y, y], mode="lines", name=label,
                                     legendgroup=label, showlegend=c == 1, line=dict(color="#424242", dash=dash)),
                          row=1, col=c)
        fig.update_xaxes(type="log", tickvals=budgets, ticktext=[str(b) for b in budgets],
                         title_text="budget B (draft nodes asked)", row=1, col=c)
    fig.update_yaxes(title_text="tokens/s per request (expected)", row=1, col=1)
    fig.update_layout(title=title, template="plotly_white", height=430)
    return readable_fonts(fig)


def mean_accept_by_depth(results: Sequence) -> dict[tuple[str, int], list[float]]:
    """Per ``(policy, budget)``: the mean over steps of ``PolicyResult.accept_by_depth``
    (``P(accepted >= d)``, d = 1..), shorter trees padded with 0. Groups with an unscored step
    are left out (a mean over a subset of the steps would not compare)."""
    groups: dict[tuple[str, int], list] = {}
    for r in results:
        groups.setdefault((r.policy, r.budget), []).append(r)
    out = {}
    for key, rs in groups.items():
        if any(r.accept_by_depth is None for r in rs):
            continue
        depth = max((len(r.accept_by_depth) for r in rs), default=0)
        out[key] = [sum((r.accept_by_depth[d] if d < len(r.accept_by_depth) else 0.0) for r in rs) / len(rs)
                    for d in range(depth)]
    return out


def tau_by_depth_figure(results: Sequence, budget: int, title: str | None = None):
    """A plotly bar figure: per policy at ``budget``, the exact ``P(accepted draft tokens >=
    d)`` averaged over the steps (:func:`mean_accept_by_depth`; their sum is E[tau] - 1).

    Raises:
        ValueError: no scored result at ``budget``.
    """
    import plotly.graph_objects as go

    by = {k: v for k, v in mean_accept_by_depth(results).items() if k[1] == budget}
    if not by:
        raise ValueError(f"no scored policy results at budget {budget}")
    depth = max(len(v) for v in by.values())
    fig = go.Figure()
    for i, ((name, _), vals) in enumerate(by.items()):
        fig.add_trace(go.Bar(x=list(range(1, len(vals) + 1)), y=vals, name=f"{name}: E[τ] {1 + sum(vals):.3f}",
                             marker_color=PALETTE[i % len(PALETTE)]))
    fig.update_layout(title=title or f"Exact P(accepted ≥ d) by depth, budget {budget}", barmode="group",
                      xaxis_title="depth d", yaxis_title="P(accepted draft tokens ≥ d)", template="plotly_white",
                      height=360, xaxis=dict(range=[0.5, min(depth, 8) + 0.5]))
    return readable_fonts(fig)


def draft_positions(results: Sequence, texts=None) -> int | None:
    """How many positions the drafter predicts after the anchor (``L - 1`` of a block of ``L``):
    from the recorded run's first draft when ``texts`` is a :class:`Run` with one, else the
    deepest tree among ``results`` (a chain at a budget of at least ``L - 1`` is that deep);
    None without either."""
    steps = getattr(texts, "steps", None)
    draft = getattr(steps[0], "draft", None) if steps else None
    if draft is not None:
        return int(draft.token_ids.shape[0])
    depths = [int(r.tree.depths[0, :int(r.tree.num_nodes[0])].max()) for r in results if int(r.tree.num_nodes[0]) > 0]
    return max(depths) if depths else None


def nodes_note(policy: str, budget: int, mean_nodes: float, positions: int | None) -> str:
    """Why a policy's trees have fewer nodes than the budget ``B`` asked, or ``""`` when they
    have ``B``. The chain places one node per drafted position, so it stops at ``L - 1`` nodes
    (:func:`ddtree_lab.analysis.policies.chain_policy`: ``min(budget, L-1)``): a block drafter
    of ``L = 16`` predicts 15 tokens after the anchor, and a chain at ``B = 16`` has 15 nodes.
    Other policies stop short where every node the draft allows is placed (a beam of width
    ``k`` holds at most ``k`` nodes per depth, a tree is at most ``L - 1`` deep) or where the
    draft has zero-probability tokens."""
    if mean_nodes >= budget - 1e-9:
        return ""
    depth = f"L-1 = {positions}" if positions is not None else "L-1"
    block = f"L = {positions + 1}" if positions is not None else "L"
    if policy == "chain":
        return (f"a chain has one node per drafted position: the drafter's block of {block} predicts {depth} "
                f"tokens after the anchor, so a chain has at most {positions if positions is not None else 'L-1'} "
                f"nodes whatever B (here B = {budget})")
    return (f"fewer nodes than B = {budget}: a tree is at most {depth} deep (the drafter's block of {block} "
            "predicts that many positions after the anchor), so a policy that limits the nodes per depth, or a draft "
            "with zero-probability tokens, places fewer")


def policy_tree_dot(result, texts=None) -> str:
    """DOT source of one :class:`PolicyResult`'s tree, in the lab's tree style (left to right,
    ``#index 'token'``, :data:`ddtree_lab.views.dot.STATUS_STYLE`): each draft node with its
    exact reach probability under the step's sampling rule (fill darkness follows it; "not
    scored" where the result has none). ``texts``: a :class:`Run`, a ``{id: text}`` mapping or
    None (ids shown)."""
    from .dot import STATUS_STYLE
    from ..labels import token_label
    from .model import text_lookup

    def esc(text: str) -> str:
        return text.replace("&", "&amp;").replace("\\", "\\\\").replace('"', '\\"')

    def attrs(style: dict) -> str:
        return ", ".join(f'{a}="{v}"' for a, v in style.items())

    lookup = text_lookup(texts)
    tree = result.tree
    n = int(tree.num_nodes[0])
    tok, par = tree.node_token_ids[0, :n].tolist(), tree.parents[0, :n].tolist()
    tau = "not scored" if result.tau_sampled is None else f"{result.tau_sampled:.3f}"
    why = " (one per drafted position: at most L-1)" if result.policy == "chain" and n - 1 < result.budget else ""
    title = f"{result.policy} · B={result.budget} · {n - 1} nodes{why} · step {result.step} · E[τ] = {tau}"
    lines = ["digraph policy {",
             '  graph [rankdir=LR, ordering=out, nodesep=0.04, ranksep=0.22, fontname="Helvetica",',
             f'         label="{esc(title)}", labelloc=t, labeljust=l, fontsize=11];',
             '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10, margin="0.04,0.02", '
             'height=0.3];',
             "  edge [arrowsize=0.5];",
             f'  n0 [label="{esc(f"#0 {token_label(lookup(tok[0]))}")}\\nroot", {attrs(STATUS_STYLE["root"])}];']
    for i in range(1, n):
        head = esc(f"#{i} {token_label(lookup(tok[i]))}")
        style = dict(STATUS_STYLE["unvisited"])
        if result.reach is None:
            label = f"{head}\\nnot scored"
        else:
            r = float(result.reach[i])
            shade = int(245 - 150 * min(max(r, 0.0), 1.0))
            style["fillcolor"] = f"#{shade:02x}{min(shade + 10, 255):02x}{shade:02x}"
            label = f"{head}\\nreach={r:.2g}"
        lines.append(f'  n{i} [label="{label}", {attrs(style)}];')
        lines.append(f'  n{par[i]} -> n{i} [color="#bdbdbd"];')
    lines.append("}")
    return "\n".join(lines) + "\n"


def policy_trees_html(results: Sequence, texts=None) -> str:
    """The trees of ``results`` (one step's :class:`PolicyResult`s) side by side: an HTML row of
    SVGs drawn by graphviz from :func:`policy_tree_dot` (or the DOT source in a ``<pre>`` where
    graphviz's ``dot`` program is missing, said in the cell)."""
    import html

    from .dot import render_svg

    cells = []
    for r in results:
        src = policy_tree_dot(r, texts)
        try:
            body = render_svg(src)
        except (RuntimeError, OSError) as exc:
            body = f"<p>graphviz could not draw it ({html.escape(str(exc))}); its DOT:</p><pre>{html.escape(src)}</pre>"
        body = body.replace("<svg ", '<svg style="max-width:none" ', 1)  # at its own size: its cell scrolls
        cells.append(f'<div class="ddtree-policy-tree" style="flex:0 0 auto; max-width:100%; overflow-x:auto">{body}</div>')
    # each tree at its own size, side by side while they fit, else on the next row (issue 34.8: a chain squeezed
    # into a third of the row was clipped, with the DDTree tree's height empty below it)
    return (f'<div class="ddtree-policy-trees" style="display:flex; flex-wrap:wrap; gap:12px; align-items:flex-start">'
            f'{"".join(cells)}</div>')


class PolicyPicker:
    """The policy picker of the tuner notebook: a policy dropdown (the policies of
    ``results``), a budget slider and a step slider over precomputed results; it reads them and
    never a model.

    Shows: the exact ``P(accepted >= d)`` by depth of every policy at the chosen budget
    (:func:`tau_by_depth_figure`), the chosen step's trees side by side (the chosen policy, DDTree
    and the chain at the chosen budget, :func:`policy_trees_html`) and, given benchmark rows,
    expected tokens/s against the budget with plain decoding and the chain as horizontal lines
    (:func:`tokens_per_second_figure`).

    Args:
        results: :class:`PolicyResult`s (:func:`~ddtree_lab.analysis.counterfactual.
            run_counterfactuals` or ``step_counterfactuals``, computed before).
        texts: token texts for the trees (a :class:`Run` or mapping).
        rows, plain_tok_s: ``benchmarks/tree_policies.json`` rows and plain decoding's tokens/s
            (:func:`load_policy_records`), or None (no tokens/s panel).

    Raises:
        ValueError: no results.
    """

    def __init__(self, results: Sequence, texts=None, rows: Sequence[dict] | None = None,
                 plain_tok_s: float | None = None):
        import ipywidgets as w

        if not results:
            raise ValueError("PolicyPicker needs policy results (run the counterfactuals first)")
        self.results, self.texts = list(results), texts
        self.policies = list(dict.fromkeys(r.policy for r in self.results))
        self.budgets = sorted({r.budget for r in self.results})
        self.steps = list(dict.fromkeys((r.step, r.request) for r in self.results))
        self.positions = draft_positions(self.results, texts)
        self.policy = w.Dropdown(options=self.policies, value=self.policies[0], description="policy",
                                 layout={"width": "220px", "flex": "0 0 auto"}, style={"description_width": "60px"})
        self.budget = w.SelectionSlider(options=self.budgets, value=self.budgets[-1], description="budget B",
                                        continuous_update=False, **slider_kwargs("360px", "70px"))
        self.step = w.IntSlider(value=0, min=0, max=len(self.steps) - 1, description="step #",
                                continuous_update=False, **slider_kwargs("360px", "70px"))
        for c, name in ((self.policy, "policy"), (self.budget, "budget"), (self.step, "step")):
            c.add_class(f"ddtree-policy-{name}")
        self.depth_out, self.trees_out, self.speed_out = w.Output(), w.HTML(), w.Output()
        self.summary = w.HTML()
        # the controls wrap onto a second line in a narrow column (none is cut at the right: issue 34.8)
        self.widget = w.VBox([w.HBox([self.policy, self.budget, self.step], layout=wrap_row()), self.summary, self.depth_out,
                              self.trees_out, self.speed_out])
        self.widget.add_class("ddtree-policy-picker")
        if rows is not None and plain_tok_s is not None:
            with self.speed_out:
                from IPython.display import display

                display(tokens_per_second_figure(rows, plain_tok_s))
        for c in (self.policy, self.budget, self.step):
            c.observe(lambda _change: self.update(), names="value")
        self.update()

    def chosen(self) -> list:
        """The results drawn side by side: the chosen policy, then DDTree and the chain (where
        computed and not the chosen one), at the chosen budget and step."""
        key = self.steps[self.step.value]
        names = [self.policy.value] + [n for n in ("ddtree", "chain") if n != self.policy.value and n in self.policies]
        by = {(r.policy, r.budget, r.step, r.request): r for r in self.results}
        return [by[k] for k in ((n, self.budget.value) + key for n in names) if k in by]

    def summary_html(self) -> str:
        """One line: the chosen policy's mean E[tau] at the chosen budget over the steps."""
        import html

        rs = [r for r in self.results if r.policy == self.policy.value and r.budget == self.budget.value]
        ok = [r.tau_sampled for r in rs if r.tau_sampled is not None]
        mean = f"{sum(ok) / len(ok):.3f}" if len(ok) == len(rs) else f"not scored on {len(rs) - len(ok)} of {len(rs)} steps"
        nodes = sum(r.num_nodes for r in rs) / max(len(rs), 1)
        note = nodes_note(str(self.policy.value), int(self.budget.value), nodes, self.positions)
        note = f'<br><span class="ddtree-nodes-note" style="color:#616161">{html.escape(note)}</span>' if note else ""
        return (f"<div>{html.escape(str(self.policy.value))} at B = {self.budget.value}: mean exact E[τ] {mean} over "
                f"{len(rs)} steps (mean {nodes:.1f} nodes){note}</div>")

    def update(self) -> None:
        from IPython.display import display

        self.summary.value = self.summary_html()
        self.trees_out.value = policy_trees_html(self.chosen(), self.texts)
        self.depth_out.clear_output(wait=True)
        with self.depth_out:
            try:
                display(tau_by_depth_figure(self.results, self.budget.value))
            except ValueError as exc:  # nothing scored at this budget: say so
                print(exc)

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget)
