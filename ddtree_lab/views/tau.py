"""τ against budget: the plotly figure of ``benchmarks/live_tau.py``'s measurements.

Reads the benchmark's records (``benchmarks/live_tau.json``), never a model.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["tau_budget_figure", "load_tau_records"]


def load_tau_records(path: str | Path) -> list[dict]:
    """The rows ``benchmarks/live_tau.py`` wrote: each ``{"drafter", "temperature", "config"
    ("chain" | "ddtree"), "budget", "tau", "steps", "tok_s", "by_depth"}``.

    Raises:
        FileNotFoundError: no such file. ValueError: a row lacks one of those fields.
    """
    rows = json.loads(Path(path).read_text())["rows"]
    need = {"drafter", "temperature", "config", "budget", "tau"}
    for i, r in enumerate(rows):
        if not need <= set(r):
            raise ValueError(f"row {i} of {path} lacks {sorted(need - set(r))}")
    return rows


def tau_budget_figure(rows: list[dict], title: str = "Accept length τ against budget B"):
    """A plotly figure: one line per (drafter, temperature) of DDTree's τ over the budget
    (log-2 axis), and the chain's τ (the drafter's argmax block) as a dotted level line.

    Args:
        rows: :func:`load_tau_records` rows.

    Returns:
        ``plotly.graph_objects.Figure``.

    Raises:
        ValueError: no DDTree rows.
    """
    import plotly.graph_objects as go

    tree = [r for r in rows if r["config"] == "ddtree"]
    if not tree:
        raise ValueError("no DDTree rows to plot")
    budgets = sorted({int(r["budget"]) for r in tree})
    fig = go.Figure()
    palette = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]
    keys = sorted({(r["drafter"], float(r["temperature"])) for r in tree})
    for i, (drafter, temp) in enumerate(keys):
        color = palette[i % len(palette)]
        pts = sorted((int(r["budget"]), r["tau"]) for r in tree if (r["drafter"], float(r["temperature"])) == (drafter, temp))
        fig.add_trace(go.Scatter(x=[b for b, _ in pts], y=[t for _, t in pts], mode="lines+markers",
                                 name=f"{drafter}, T={temp:g}: DDTree", line=dict(color=color)))
        chain = [r["tau"] for r in rows if r["config"] == "chain" and r["drafter"] == drafter
                 and float(r["temperature"]) == temp]
        if chain:
            fig.add_trace(go.Scatter(x=[budgets[0], budgets[-1]], y=[chain[0]] * 2, mode="lines",
                                     name=f"{drafter}, T={temp:g}: chain", line=dict(color=color, dash="dot")))
    fig.update_layout(title=title, xaxis_title="budget B (draft nodes)", yaxis_title="τ (accepted + 1 per step)",
                      template="plotly_white", height=420, legend=dict(font=dict(size=11)))
    fig.update_xaxes(type="log", tickvals=budgets, ticktext=[str(b) for b in budgets])
    return fig
