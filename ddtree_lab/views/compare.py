"""Greedy against temperature sampling: figures over the steps of one (mixed-parameter) batch.

Every figure reads :class:`ddtree_lab.step.Step` records only (live or loaded) and
groups them by *setting*, the request's sampling parameters as text
(:func:`ddtree_lab.analysis.setting_label`). The numbers come from :mod:`ddtree_lab.analysis`:

* :func:`tau_figure` / :func:`tau_distribution_figure` -- tau (accepted draft tokens + bonus)
  per step and its distribution;
* :func:`calibration_figure` -- per step the observed accept length, the exact expected one
  under the target-only rule (no lossless verifier beats it on that tree) and the drafter's
  own estimate;
* :func:`acceptance_figure` -- acceptance rate by depth; :func:`sibling_rank_figure` -- which
  sibling was accepted at each depth; :func:`throughput_figure` -- tokens/s;
* :func:`sibling_quality_figure` -- the drafter's top-1 hit rate after a rank-0 or a lower
  sibling;
* :func:`trees_html` -- one step's trees side by side; :func:`looks_greedy_html` -- the
  looks-greedy flag; :func:`summary_html` -- one row per setting;
* :func:`reference_vs_lab` / :func:`reference_vs_lab_text` -- the DDTree reference's rounds
  beside a lab run's steps on the same prompts: rounds both ran, how many are identical, mean τ
  over the common rounds and over all, the rounds one loop ran past the other and why
  (:data:`STOPPING_RULE`: the two loops count ``max_new_tokens`` differently).

Figures are ``plotly.graph_objects.Figure`` objects (no pandas needed).
"""

from __future__ import annotations

import html
import statistics
from typing import Sequence

from .. import analysis
from ..step import Run

__all__ = ["settings_of", "tau_figure", "tau_distribution_figure", "calibration_figure", "acceptance_figure",
           "sibling_rank_figure", "throughput_figure", "sibling_quality_figure", "trees_html", "looks_greedy_html",
           "summary_rows", "summary_html", "OBSERVED", "EXPECTED", "DRAFTER", "STOPPING_RULE", "reference_vs_lab",
           "reference_vs_lab_text", "round_agreement", "TIE_TOLERANCE"]

#: hover boxes show whole trace names (plotly cuts them at 15 characters by default).
HOVER = {"namelength": -1, "align": "left"}
#: how the reference's loop and the lab's count ``max_new_tokens`` (ddtree.py ``ddtree_generate``:
#: ``while start < max_length``, ``start`` the committed length; ``LiveSession._commit``: stop once
#: ``len(generated) >= max_new_tokens``, ``generated`` holding the first token and every bonus).
STOPPING_RULE = ("stopping rule: the DDTree reference runs rounds while its committed tokens (Σ τ over its rounds; "
                 "the last round's pending bonus not counted) are fewer than max_new_tokens; the lab's "
                 "LiveSession stops once 1 + Σ τ >= max_new_tokens (it counts the pending bonus). On the same "
                 "prompts the reference therefore runs one more round whenever the lab's rounds end at exactly "
                 "max_new_tokens - 1 committed tokens, so compare mean τ over the rounds both loops ran")
COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2"]


def _steps(run_or_steps) -> list:
    return list(run_or_steps.steps if isinstance(run_or_steps, Run) else run_or_steps)


def settings_of(steps: Sequence) -> list[str]:
    """The settings present, in order of first request."""
    seen: list[str] = []
    for s in sorted(steps, key=lambda s: s.request):
        label = analysis.setting_label(s.params)
        if label not in seen:
            seen.append(label)
    return seen


def _by_setting(steps) -> dict[str, list]:
    out: dict[str, list] = {label: [] for label in settings_of(steps)}
    for s in steps:
        out[analysis.setting_label(s.params)].append(s)
    return out


def _color(k: int) -> str:
    return COLORS[k % len(COLORS)]


def tau_figure(run_or_steps):
    """tau per decoding step, one line per request, coloured by setting."""
    import plotly.graph_objects as go

    steps = _steps(run_or_steps)
    settings = settings_of(steps)
    fig = go.Figure()
    for r in sorted({s.request for s in steps}):
        mine = sorted((s for s in steps if s.request == r), key=lambda s: s.step)
        label = analysis.setting_label(mine[0].params)
        fig.add_trace(go.Scatter(x=[s.step for s in mine], y=[analysis.tau(s) for s in mine], mode="lines+markers",
                                 name=f"request {mine[0].request_id} · {label}",
                                 line={"color": _color(settings.index(label))}))
    fig.update_layout(hoverlabel=HOVER, title="τ per step (accepted draft tokens + bonus)", xaxis_title="decoding step",
                      yaxis_title="τ", height=320, margin={"t": 40, "b": 40})
    return fig


def tau_distribution_figure(run_or_steps):
    """Histogram of tau per setting (bars side by side, each normalised to a fraction of its
    setting's steps; not overlaid, so no colours mix)."""
    import plotly.graph_objects as go

    steps = _steps(run_or_steps)
    fig = go.Figure()
    for k, (label, mine) in enumerate(_by_setting(steps).items()):
        taus = [analysis.tau(s) for s in mine]
        fig.add_trace(go.Histogram(x=taus, name=f"{label} (mean {statistics.mean(taus):.2f})", histnorm="probability",
                                   xbins={"size": 1}, marker_color=_color(k)))
    fig.update_layout(hoverlabel=HOVER, barmode="group", bargap=0.15, title="distribution of τ per setting", xaxis_title="τ",
                      yaxis_title="fraction of steps", height=300, margin={"t": 40, "b": 40})
    return fig


def calibration_figure(run_or_steps):
    """Per step: observed accept length, exact expected (sum of target path products) and the
    drafter's estimate (sum of drafter path probabilities); one panel per setting."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    steps = _steps(run_or_steps)
    groups = _by_setting(steps)
    fig = make_subplots(rows=len(groups), cols=1, shared_xaxes=False, subplot_titles=list(groups), vertical_spacing=0.12)
    for k, (_label, mine) in enumerate(groups.items()):
        table = analysis.step_table(sorted(mine, key=lambda s: (s.step, s.request)))
        x = [f"{r['step']}/{r['request_id']}" for r in table]
        for name, key, style in (("observed", "observed", {"color": "#222222"}),
                                 ("exact expected", "expected", {"color": "#1b7f3b", "dash": "dot"}),
                                 ("drafter estimate", "drafter", {"color": "#b3261e", "dash": "dash"})):
            fig.add_trace(go.Scatter(x=x, y=[r[key] for r in table], mode="lines+markers", name=name, line=style,
                                     legendgroup=name, showlegend=k == 0), row=k + 1, col=1)
    fig.update_layout(hoverlabel=HOVER, title="accept length per step: observed, exact expected (target-only rule), drafter estimate",
                      height=260 * len(groups) + 60, margin={"t": 60, "b": 40})
    fig.update_xaxes(title_text="step / request", type="category")
    fig.update_yaxes(title_text="accepted draft tokens")
    return fig


def acceptance_figure(run_or_steps):
    """Acceptance rate at each depth (accepted / offered) per setting; the definition of offered
    (:data:`ddtree_lab.analysis.OFFERED_DEFINITION`: the steps whose walk reached depth d − 1 at
    a node with children) is printed under the axis. The depth axis ends at the deepest depth any
    step was offered (trees may be deeper: a depth the walk never reached has no rate, and the
    title says how deep the trees went)."""
    import plotly.graph_objects as go

    steps = _steps(run_or_steps)
    fig = go.Figure()
    deepest_offered, deepest_tree = 0, 0
    for k, (label, mine) in enumerate(_by_setting(steps).items()):
        a = analysis.acceptance_by_depth(mine)
        depth = [d for d, o in zip(a["depth"], a["offered"]) if o]
        deepest_offered = max([deepest_offered, *depth])
        deepest_tree = max([deepest_tree, *a["depth"]])
        keep = [i for i, o in enumerate(a["offered"]) if o]
        fig.add_trace(go.Scatter(x=depth, y=[a["rate"][i] for i in keep], mode="lines+markers", name=label,
                                 customdata=[(a["accepted"][i], a["offered"][i]) for i in keep],
                                 hovertemplate="depth %{x}: %{customdata[0]} accepted of %{customdata[1]} offered<extra></extra>",
                                 line={"color": _color(k)}))
    deeper = (f"; the trees reach depth {deepest_tree}, the walk never stood where depth {deepest_offered + 1} was "
              "offered" if deepest_tree > deepest_offered else "")
    fig.add_annotation(text=analysis.OFFERED_DEFINITION, xref="paper", yref="paper", x=0, y=-0.3, showarrow=False,
                       font={"size": 11}, align="left", xanchor="left")
    fig.update_layout(hoverlabel=HOVER, title=f"acceptance by depth (accepted / offered{deeper})", xaxis_title="depth",
                      xaxis={"range": [0.5, max(deepest_offered, 1) + 0.5], "dtick": 1},
                      yaxis_title="acceptance rate", yaxis_range=[0, 1.05], height=330, margin={"t": 40, "b": 80})
    return fig


def sibling_rank_figure(run_or_steps, max_rank: int = 4):
    """Which sibling was accepted at each depth: stacked counts of the accepted node's sibling
    rank (0 = first child, ``max_rank``+ pooled), one panel per setting."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    steps = _steps(run_or_steps)
    groups = _by_setting(steps)
    fig = make_subplots(rows=1, cols=len(groups), subplot_titles=list(groups), shared_yaxes=True)
    shades = ["#1b7f3b", "#7fbf7b", "#fdb863", "#e66101", "#b2182b"]
    for k, (_label, mine) in enumerate(groups.items()):
        rows = analysis.accepted_sibling_ranks(mine)
        depths = sorted({r["depth"] for r in rows}) or [1]
        for rank in range(max_rank + 1):
            counts = [sum(1 for r in rows if r["depth"] == d and min(r["sibling_rank"], max_rank) == rank) for d in depths]
            fig.add_trace(go.Bar(x=depths, y=counts, name=f"sibling {rank}{'+' if rank == max_rank else ''}",
                                 marker_color=shades[rank % len(shades)], legendgroup=str(rank), showlegend=k == 0),
                          row=1, col=k + 1)
    fig.update_layout(hoverlabel=HOVER, barmode="stack", title="accepted sibling rank by depth", height=300, margin={"t": 60, "b": 40})
    fig.update_xaxes(title_text="depth")
    fig.update_yaxes(title_text="accepted nodes", col=1)
    return fig


def throughput_figure(run_or_steps):
    """Tokens per second per request (its emitted tokens over its steps' recorded time)."""
    import plotly.graph_objects as go

    steps = _steps(run_or_steps)
    t = analysis.throughput(steps)
    settings = settings_of(steps)
    fig = go.Figure(go.Bar(x=[f"request {r['request']} · {r['setting']}" for r in t["per_request"]],
                           y=[r["tokens_per_s"] or 0.0 for r in t["per_request"]],
                           marker_color=[_color(settings.index(r["setting"])) for r in t["per_request"]],
                           text=[f"{r['tokens']} tok / {r['seconds']:.1f} s" for r in t["per_request"]]))
    batch = t["batch_tokens_per_s"]
    fig.update_layout(hoverlabel=HOVER, title=f"tokens/s per request (batch: {batch:.2f} tokens/s)" if batch else "tokens/s",
                      yaxis_title="tokens / s", height=300, margin={"t": 40, "b": 40})
    return fig


def sibling_quality_figure(run_or_steps):
    """The drafter's top-1 hit rate at depth d+1 after the root, a rank-0 or a lower-ranked
    accepted node at depth d (:func:`ddtree_lab.analysis.sibling_conditioned_quality`)."""
    import plotly.graph_objects as go

    steps = _steps(run_or_steps)
    rows = [r for r in analysis.sibling_conditioned_quality(steps) if r["depth"] == "all"]
    fig = go.Figure()
    cats = ("root", "rank 0", "rank > 0")
    empty = []
    for k, label in enumerate(settings_of(steps)):
        mine = {r["after"]: r for r in rows if r["setting"] == label and r["total"]}
        fig.add_trace(go.Bar(x=[f"after {c}" for c in cats], y=[mine[c]["rate"] if c in mine else 0.0 for c in cats],
                             name=label, marker_color=_color(k),
                             text=[f"{mine[c]['hits']}/{mine[c]['total']}" if c in mine else "no data" for c in cats],
                             textposition="outside"))
        empty += [(c, label) for c in cats if c not in mine]
    if empty:  # say which groups are empty instead of leaving a gap
        fig.add_annotation(text="no data (no such accepted node): " + "; ".join(f"after {c} · {lab}" for c, lab in empty),
                           xref="paper", yref="paper", x=0, y=-0.28, showarrow=False, font={"size": 11},
                           align="left", xanchor="left")
    fig.update_layout(hoverlabel=HOVER, barmode="group",
                      title="drafter top-1 = the target's next token, by what was accepted before", yaxis_title="hit rate", yaxis_range=[0, 1.15], height=340, margin={"t": 40, "b": 80})
    return fig


def trees_html(run: Run, step: int, collapse_unvisited: bool = True) -> str:
    """The trees of decoding step ``step`` of every request, one under another at their own
    size (text as in every other tree picture), each in a box that scrolls sideways when the
    tree is wider than the page. Steps without target rows are drawn with their note
    (:func:`ddtree_lab.views.step_view`).

    Raises:
        ValueError: no request has that step, or one of its steps stores no tree.
    """
    from .dot import step_svg

    chosen = sorted((s for s in run.steps if s.step == step), key=lambda s: s.request)
    if not chosen:
        raise ValueError(f"no request has decoding step {step} (steps {min(s.step for s in run.steps)}.."
                         f"{max(s.step for s in run.steps)})")
    cells = []
    for s in chosen:  # a step without parameters (the reference's dumps) is drawn too, labelled so
        setting = analysis.setting_label(s.params) if s.params is not None else "sampling parameters not recorded"
        label = html.escape(f"request {s.request_id} · {setting} · τ = {analysis.tau(s)}")
        svg = step_svg(s, run, collapse_unvisited=collapse_unvisited)
        svg = svg.replace("<svg ", '<svg style="max-width:none" ', 1)  # never shrunk to fit: it scrolls
        cells.append(f'<div style="overflow-x:scroll;border:1px solid #ddd;padding:4px;margin-bottom:8px">'
                     f"<b>{label}</b><br>{svg}</div>")
    return f'<div class="ddtree-trees">{"".join(cells)}</div>'


def looks_greedy_html(run_or_steps, min_tokens: int = 16, alpha: float = 1e-3) -> str:
    """The looks-greedy check of every request (:func:`ddtree_lab.analysis.looks_greedy`),
    flagged requests in red."""
    flags = analysis.looks_greedy(_steps(run_or_steps), min_tokens=min_tokens, alpha=alpha)
    rows = []
    for f in flags:
        style = ' style="background:#fbe3e1;color:#b3261e;font-weight:bold"' if f.flagged else ""
        verdict = "LOOKS GREEDY" if f.flagged else "ok"
        rows.append(f"<tr{style}><td>{f.request}</td><td>{html.escape(f.setting)}</td><td>{f.tokens}</td>"
                    f"<td>{f.argmax_tokens}</td><td>{'n/a (greedy)' if f.setting == 'greedy' else f'{f.log10_p:.1f}'}</td>"
                    f"<td>{verdict}</td></tr>")
    return ('<table class="ddtree-looks-greedy"><tr><th>request</th><th>setting</th><th>tokens</th>'
            "<th>argmax tokens</th><th>log10 P(all argmax | lossless)</th><th>verdict</th></tr>"
            f"{''.join(rows)}</table>")


#: the summary table's accept-length columns: they count accepted draft tokens, τ − 1 (the
#: bonus token not counted), and their headers say so.
OBSERVED, EXPECTED, DRAFTER = ("observed accept length (τ − 1)", "exact expected accept length (τ − 1)",
                               "drafter estimate (τ − 1)")


def summary_rows(run_or_steps) -> list[dict]:
    """Per setting: steps, mean τ (accepted draft tokens + bonus), the mean observed / exact
    expected / drafter-estimated accept length (accepted draft tokens, τ − 1: the keys
    :data:`OBSERVED`, :data:`EXPECTED`, :data:`DRAFTER` say so), tokens/s."""
    steps = _steps(run_or_steps)
    out = []
    for label, mine in _by_setting(steps).items():
        table = analysis.step_table(mine)
        per = analysis.throughput(mine)["per_request"]
        tokens, seconds = sum(r["tokens"] for r in per), sum(r["seconds"] for r in per)
        out.append({"setting": label, "steps": len(mine),
                    "mean τ": round(statistics.mean(r["tau"] for r in table), 3),
                    OBSERVED: round(statistics.mean(r["observed"] for r in table), 3),
                    EXPECTED: round(statistics.mean(r["expected"] for r in table), 3),
                    DRAFTER: round(statistics.mean(r["drafter"] for r in table), 3),
                    "tokens/s": round(tokens / seconds, 2) if seconds > 0 else None})
    return out


def summary_html(run_or_steps) -> str:
    """:func:`summary_rows` as an HTML table."""
    rows = summary_rows(run_or_steps)
    head = "".join(f"<th>{html.escape(k)}</th>" for k in rows[0]) if rows else ""
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in r.values()) + "</tr>" for r in rows)
    return f'<table class="ddtree-compare-summary"><tr>{head}</tr>{body}</table>'


#: two log-weights closer than this (nats) are a tie: the float32 log-probs and their sums come
#: out of another machine's kernels (other BLAS, thread counts, vector widths) a few ulps apart,
#: so nodes this close may leave the best-first heap in either order there.
TIE_TOLERANCE = 1e-4


def _paths(step) -> list[tuple[int, ...]]:
    """Each node's token path from the root (root excluded: ``()``), in node order."""
    tokens, parents = step.node_token_ids.tolist(), step.parents.tolist()
    out: list[tuple[int, ...]] = []
    for i in range(step.num_nodes):
        out.append(() if i == 0 else out[parents[i]] + (tokens[i],))
    return out


def _path_logw(step, path: tuple[int, ...]) -> float | None:
    """The lab drafter's log-weight of a token path: its node's ``node_logws`` when the lab's
    tree holds it, else the sum of the step's draft top-k log-probs along it (None when a token
    is outside the recorded top-k or the step has no draft top-k)."""
    mine = _paths(step)
    if path in mine and step.node_logws is not None:
        return float(step.node_logws[mine.index(path)])
    if step.draft_token_ids is None or step.draft_logprobs is None or len(path) > step.draft_token_ids.shape[-2]:
        return None
    ids, lps = step.draft_token_ids.reshape(-1, step.draft_token_ids.shape[-1]), \
        step.draft_logprobs.reshape(-1, step.draft_logprobs.shape[-1])
    total = 0.0
    for depth, tok in enumerate(path):
        hit = (ids[depth] == tok).nonzero()
        if len(hit) == 0:
            return None
        total += float(lps[depth, int(hit[0, 0])])
    return total


def round_agreement(ref, lab, tolerance: float = TIE_TOLERANCE) -> tuple[bool, list[dict]]:
    """Whether a reference round and a lab step agree, up to ties in the drafter's log-weights.

    The two agree when they accept the same tokens (path and bonus, where the reference records
    the bonus: its output ends at max_new_tokens, cutting the last one) and their trees are the
    same node for node, except that where node ``i`` holds another token path on each side, the
    two paths' log-weights (the lab's ``node_logws``, or its draft top-k for a path only the
    reference built) differ by at most ``tolerance`` nats: a tie that the two machines' float
    sums ordered differently (inside the tree, or at the budget's edge).

    Args:
        ref: a reference round (:class:`~ddtree_lab.step.Step`, ``node_logws`` may be NaN).
        lab: the lab's step of the same round (its ``node_logws`` and draft top-k are read).
        tolerance: the largest log-weight gap still called a tie, in nats.

    Returns:
        ``(agree, ties)``: ``ties`` lists each node index where the trees differ, as
        ``{"node", "reference_tokens", "lab_tokens", "gap"}`` (``gap`` in nats, None when the
        lab cannot weigh the reference's path); ``agree`` is False when a gap is over
        ``tolerance`` or unknown, or the trees' sizes or the accepted tokens differ.
    """
    if ref.tree is None or lab.tree is None or ref.output is None or lab.output is None:
        return False, []
    rt, lt = ref.node_token_ids.tolist(), lab.node_token_ids.tolist()
    if rt[0] >= 0 and rt[0] != lt[0] or ref.num_nodes != lab.num_nodes:
        return False, []
    rp, lp = _paths(ref), _paths(lab)
    ties, agree = [], True
    for i, (a, b) in enumerate(zip(rp, lp)):
        if a == b:
            continue
        wa, wb = _path_logw(lab, a), _path_logw(lab, b)
        gap = None if wa is None or wb is None else abs(wa - wb)
        ties.append({"node": i, "reference_tokens": list(a), "lab_tokens": list(b), "gap": gap})
        agree = agree and gap is not None and gap <= tolerance
    accepted_ref = [rp[i] for i in ref.accepted_path]
    accepted_lab = [lp[i] for i in lab.accepted_path]
    agree = agree and accepted_ref == accepted_lab and (ref.bonus_token < 0 or ref.bonus_token == lab.bonus_token)
    return agree, ties


def _same_round(ref, lab) -> bool:
    """A reference round and a lab step agree up to ties (:func:`round_agreement`)."""
    return round_agreement(ref, lab)[0]


def reference_vs_lab(reference, lab, max_new_tokens: int | None = None) -> dict:
    """The DDTree reference's rounds beside a lab run's steps on the same prompts.

    Request ``i`` of each side is paired (request index order); rounds are paired in order.

    Args:
        reference: a reference run (``ddtree_lab.io.load`` of its dump).
        lab: a lab :class:`~ddtree_lab.step.Run` of the same prompts (greedy: its trees and paths
            can then match round for round).
        max_new_tokens: the limit both loops ran with; given, each request's extra rounds are
            checked against :data:`STOPPING_RULE` (``explained``).

    Returns:
        ``{"requests": [{"request", "request_id", "reference_rounds", "lab_rounds", "common",
        "identical" (common rounds that agree up to ties, :func:`round_agreement`), "ties" (the
        nodes where agreeing rounds differ by a tie: ``{"round", "node", "reference_tokens",
        "lab_tokens", "gap"}``), "first_difference" (round
        index or None), "tau_common": (reference, lab) mean τ over the common rounds,
        "tau_all": (reference, lab) mean τ over all rounds, "committed": (reference, lab) Σ τ,
        "extra": reference rounds minus lab rounds, "explained": bool or None}], "identical":
        every common round of every request agrees, "max_new_tokens", "rule": STOPPING_RULE}``.
        ``explained``: the reference ran one more round exactly when the lab's rounds committed
        ``max_new_tokens - 1`` tokens and it did not stop on a stop token, else as many.

    Raises:
        ValueError: ``reference`` is not a reference run, the two have different request counts,
            or a request has no round on one side.
    """
    kind = str(getattr(reference, "metadata", {}).get("source") or type(reference).__name__)
    if kind != "ddtree reference":
        raise ValueError(f"reference must be a DDTree reference run (ddtree_lab.io.load of its dump), got a {kind} run")
    ref_reqs = sorted({s.request for s in reference.steps})
    lab_reqs = sorted({s.request for s in lab.steps if s.output is not None})
    if len(ref_reqs) != len(lab_reqs):
        raise ValueError(f"the reference run has {len(ref_reqs)} requests, the lab run {len(lab_reqs)}: "
                         "they are not the same prompts")
    finish = {int(r.get("request", i)): r.get("finish_reason") for i, r in enumerate(lab.metadata.get("requests") or [])}
    out, all_same = [], True
    for rq, lq in zip(ref_reqs, lab_reqs):
        ref = reference.for_request(rq)
        mine = [s for s in lab.for_request(lq) if s.output is not None]
        if not ref or not mine:
            raise ValueError(f"request {rq}: no round on the {'reference' if not ref else 'lab'} side")
        common = min(len(ref), len(mine))
        agreements = [round_agreement(a, b) for a, b in zip(ref, mine)]
        same = [ok for ok, _ in agreements]
        ties = [{"round": k, **t} for k, (ok, found) in enumerate(agreements) if ok for t in found]
        rt = [int(s.output.tau()[0]) for s in ref if s.output is not None]
        lt = [int(s.output.tau()[0]) for s in mine if s.output is not None]
        explained = None
        if max_new_tokens is not None:  # the rule: the reference runs one round more iff the lab ended at M - 1
            eos = finish.get(lq) == "eos"  # both loops stop on a stop token in the same round
            want = 1 if sum(lt) == max_new_tokens - 1 and not eos else 0
            explained = len(ref) - len(mine) == want
        all_same = all_same and all(same)
        out.append({"request": rq, "request_id": ref[0].request_id, "reference_rounds": len(ref),
                    "lab_rounds": len(mine), "common": common, "identical": sum(same),
                    "first_difference": next((k for k, ok in enumerate(same) if not ok), None),
                    "tau_common": (sum(rt[:common]) / common, sum(lt[:common]) / common),
                    "tau_all": (sum(rt) / len(rt), sum(lt) / len(lt)), "committed": (sum(rt), sum(lt)),
                    "extra": len(ref) - len(mine), "explained": explained, "ties": ties})
    return {"requests": out, "identical": all_same, "max_new_tokens": max_new_tokens, "rule": STOPPING_RULE}


def reference_vs_lab_text(data: dict) -> str:
    """:func:`reference_vs_lab`'s result as lines: per request the mean τ over the rounds both
    loops ran and over all rounds, the identical rounds, the extra rounds and why."""
    lines = [data["rule"] + "."]
    for q in data["requests"]:
        (rc, lc), (ra, la) = q["tau_common"], q["tau_all"]
        extra = q["extra"]
        why = ("the same number of rounds" if extra == 0 else
               f"the reference ran {extra} more round{'s' if extra > 1 else ''} because it stops on committed tokens"
               if extra > 0 else f"the lab ran {-extra} more round{'s' if extra < -1 else ''}")
        check = "" if q["explained"] is None else \
            ("; as the stopping rule predicts" if q["explained"] else "; NOT what the stopping rule predicts")
        ties = q.get("ties") or []
        tied = "" if not ties else " (" + "; ".join(
            f"round {t['round']} node {t['node']}: tokens {t['reference_tokens'][-1]} (reference) / "
            f"{t['lab_tokens'][-1]} (lab) tie, log-weights {t['gap']:.1e} nats apart" for t in ties) + ")"
        lines.append(f"request {q['request_id']}: mean τ over the {q['common']} rounds both loops ran: {rc:.3f} "
                     f"(reference) vs {lc:.3f} (lab), {q['identical']} of {q['common']} rounds identical up to "
                     f"ties{tied}; over all rounds {ra:.3f} ({q['reference_rounds']}) vs {la:.3f} "
                     f"({q['lab_rounds']}); {why}{check}")
    return "\n".join(lines)
