"""Summary of a run without target rows (DDTree reference traces, engine summaries): text, HTML, figure.

What such a run has is shown; what it lacks is listed with the lab features it therefore
cannot feed. τ is always accepted draft tokens + 1 (the bonus).

* :func:`reference_stats` -- from trees and accepted paths: τ per round, acceptance by depth
  (offered = rounds whose accepted node at depth d-1 has a child; the definition of
  ``ddtree_lab.analysis.acceptance_by_depth``, printed as ``OFFERED_DEFINITION``), acceptance by sibling rank (which child of its
  parent the accepted node was, 0 = first), stage times (the reference's per-request totals).
* :func:`summary_stats` -- from engine counts: per request τ mean, the accept-length histogram,
  per-position acceptance rates (accepted at position i / verify steps, vLLM's definition) and
  the engine's own accept length with its definition.
* :func:`run_summary_text` / :func:`run_summary_html` -- both, plus the missing list.
* :func:`serving_vs_lab` / :func:`serving_vs_lab_figure` -- a serving run's τ distribution
  beside a lab run's, per lab setting, for the greedy-vs-sampling comparison.
  A reference run beside a lab run also gets the stopping-rule note, measured on the rounds
  both loops ran (:func:`ddtree_lab.views.compare.reference_vs_lab`).
* :func:`round_tree_text` / :func:`round_tree_dot` -- one round's tree and accepted path
  (token, depth, sibling rank) as plain text / DOT; :func:`ddtree_lab.views.step_view` draws the
  same rounds with the lab's renderings, saying what they do not record.

Inputs: a :class:`~ddtree_lab.step.Run` (``ddtree_lab.io.load`` of either source, or any lab
trace), or the readers' own records (``ReferenceTraces``, ``AcceptanceSummaries``).
"""

from __future__ import annotations

import html
from typing import Sequence

from ..analysis.stats import OFFERED_DEFINITION
from ..io.acceptance import SUMMARY_CANNOT, AcceptanceSummaries
from ..io.ddtree_reference import STAGE_NAMES, ReferenceTraces, sibling_ranks_of
from ..io.ddtree_reference_run import REFERENCE_CANNOT
from .compare import STOPPING_RULE, reference_vs_lab
from ..labels import token_label

__all__ = ["reference_stats", "summary_stats", "missing_report", "run_summary_text", "run_summary_html",
           "serving_vs_lab", "serving_vs_lab_figure", "round_tree_text", "round_tree_dot"]

TAU_DEFINITION = "τ = accepted draft tokens + 1 (the bonus token)"



def _rounds(source) -> tuple[list[dict], list[dict]]:
    """``[{request, request_id, step, parents, depths, path}]`` and per-request info."""
    if isinstance(source, ReferenceTraces):
        rounds = [{"request": q.request, "request_id": str(q.request), "step": r.round, "parents": list(r.parents),
                   "depths": [0, *r.node_depths], "path": list(r.accepted_indices), "tau": r.tau,
                   "seconds": r.round_seconds}
                  for q in source.requests for r in q.rounds]
        info = [{"request_id": str(q.request), "stage_times": q.stage_times, "missing": q.missing} for q in source.requests]
        return rounds, info
    rounds = []
    for s in source.steps:
        if getattr(s, "tree", None) is None or getattr(s, "output", None) is None:
            continue
        rounds.append({"request": s.request, "request_id": s.request_id, "step": s.step,
                       "parents": [int(p) for p in s.parents.tolist()], "depths": [int(d) for d in s.depths.tolist()],
                       "path": list(s.accepted_path), "tau": int(s.output.tau()[0]),  # no bonus if support ran out
                       "seconds": (s.timings or {}).get("round")})
    return rounds, list(source.metadata.get("requests") or [])


def reference_stats(source) -> dict:
    """Statistics of the trees and accepted paths of a run (or ``ReferenceTraces``).

    Returns:
        ``{"rounds", "tau": [per round], "tau_mean", "by_request": {request_id: {"rounds",
        "tau_mean"}}, "by_depth": {"depth", "offered", "accepted", "rate"}, "by_sibling_rank":
        {depth: {rank: accepted count}}, "rank_totals": {rank: count}, "stage_times": {stage:
        seconds summed over requests} or None, "stage_requests": requests with stage times,
        "round_seconds_mean": mean wall seconds per round or None}``.

    Raises:
        ValueError: no round has a tree and an output.
    """
    rounds, info = _rounds(source)
    if not rounds:
        raise ValueError("no step with a tree and a verify output: nothing to summarise from trees")
    max_d = max(max(r["depths"]) for r in rounds)
    offered = [0] * (max_d + 1)
    accepted = [0] * (max_d + 1)
    by_rank: dict[int, dict[int, int]] = {}
    totals: dict[int, int] = {}
    taus, by_req = [], {}
    for r in rounds:
        has_child = set(r["parents"][1:])
        sib = sibling_ranks_of(r["parents"])
        for d, node in enumerate(r["path"]):
            if d >= 1:
                accepted[d] += 1
                rank = sib[node]
                by_rank.setdefault(d, {}).setdefault(rank, 0)
                by_rank[d][rank] += 1
                totals[rank] = totals.get(rank, 0) + 1
            if node in has_child and d + 1 <= max_d:
                offered[d + 1] += 1
        taus.append(r["tau"])
        by_req.setdefault(r["request_id"], []).append(r["tau"])
    stage, n_stage = None, 0
    for q in info:
        st = q.get("stage_times")
        if st:
            stage = stage or {}
            n_stage += 1
            for k, v in st.items():
                stage[k] = stage.get(k, 0.0) + float(v)
    secs = [r["seconds"] for r in rounds if r["seconds"] is not None]
    return {"rounds": len(rounds), "tau": taus, "tau_mean": sum(taus) / len(taus),
            "by_request": {k: {"rounds": len(v), "tau_mean": sum(v) / len(v)} for k, v in by_req.items()},
            "by_depth": {"depth": list(range(1, max_d + 1)), "offered": offered[1:], "accepted": accepted[1:],
                         "rate": [a / o if o else None for a, o in zip(accepted[1:], offered[1:])]},
            "by_sibling_rank": {d: dict(sorted(v.items())) for d, v in sorted(by_rank.items())},
            "rank_totals": dict(sorted(totals.items())), "stage_times": stage, "stage_requests": n_stage,
            "round_seconds_mean": sum(secs) / len(secs) if secs else None}


def _summary_requests(source) -> list[dict]:
    if isinstance(source, AcceptanceSummaries):
        return [{"request_id": r.request_id if r.request_id is not None else str(r.request), "engine": r.engine,
                 "level": r.level, "num_steps": r.num_steps, "accept_histogram": r.accept_histogram,
                 "accepted_per_position": r.accepted_per_position, "tau_mean": r.tau_mean(),
                 "num_accepted_draft_tokens": r.num_accepted_draft_tokens, "num_draft_tokens": r.num_draft_tokens,
                 "reported_accept_length": r.reported_accept_length,
                 "reported_accept_length_definition": r.reported_accept_length_definition,
                 "has_steps": r.per_step_accepted is not None, "missing": list(r.missing)} for r in source.requests]
    return [q for q in (source.metadata.get("requests") or []) if "accept_histogram" in q]


def summary_stats(source) -> dict:
    """Statistics of engine acceptance summaries (a summary Run or ``AcceptanceSummaries``).

    Returns:
        ``{"requests": [{"request_id", "engine", "level", "num_steps", "tau_mean",
        "tau_histogram": {τ: steps} or None, "position_rate": [accepted at position i / steps]
        or None, "reported_accept_length", "reported_accept_length_definition"}], "pooled":
        {"steps", "tau_mean", "tau_histogram"}}`` (pooled over per-request records only).

    Raises:
        ValueError: the source holds no summary records.
    """
    reqs = _summary_requests(source)
    if not reqs:
        raise ValueError("no engine summary records")
    out, pooled, steps, acc = [], {}, 0, 0
    for q in reqs:
        h = q.get("accept_histogram")
        n = q.get("num_steps")
        pos = q.get("accepted_per_position")
        out.append({"request_id": q["request_id"], "engine": q.get("engine"), "level": q.get("level"), "num_steps": n,
                    "tau_mean": q.get("tau_mean"),
                    "tau_histogram": None if h is None else {j + 1: c for j, c in enumerate(h)},
                    "position_rate": None if pos is None or not n else [p / n for p in pos],
                    "reported_accept_length": q.get("reported_accept_length"),
                    "reported_accept_length_definition": q.get("reported_accept_length_definition")})
        if q.get("level") == "per request" and h is not None:
            for j, c in enumerate(h):
                pooled[j + 1] = pooled.get(j + 1, 0) + c
            steps += sum(h)
            acc += sum(j * c for j, c in enumerate(h))
    return {"requests": out, "pooled": {"steps": steps, "tau_mean": 1 + acc / steps if steps else None,
                                        "tau_histogram": dict(sorted(pooled.items()))}}


def _kind(source) -> str:
    if isinstance(source, ReferenceTraces):
        return "ddtree reference"
    if isinstance(source, AcceptanceSummaries):
        return "engine summary"
    return str(source.metadata.get("source") or "lab trace")


def missing_report(source) -> dict:
    """``{"source", "missing": [what the run lacks], "cannot": {feature: why}}``."""
    kind = _kind(source)
    if kind == "ddtree reference":
        missing = ["target rows", "sampling parameters", "coins", "draft top-k", "verify buffers",
                   "node log-weights", "decision log"]
        info = _rounds(source)[1]
        extra = sorted({m for q in info for m in (q.get("missing") or [])})
        return {"source": kind, "missing": missing + extra, "cannot": dict(REFERENCE_CANNOT)}
    if kind == "engine summary":
        missing = ["trees", "accepted paths", "target rows", "sampling parameters", "coins", "stage times"]
        reqs = _summary_requests(source)
        if not any(q.get("has_steps") for q in reqs):
            missing.append("per-step accept lengths (histograms and totals only: no step order)")
        return {"source": kind, "missing": missing, "cannot": dict(SUMMARY_CANNOT)}
    return {"source": kind, "missing": list(source.metadata.get("missing") or []),
            "cannot": dict(source.metadata.get("cannot") or {})}


def _fmt(v, nd=3) -> str:
    if v is None:
        return "—"
    return f"{v:.{nd}f}" if isinstance(v, float) else str(v)


def _text_hist(h: dict[int, int]) -> str:
    return "  ".join(f"{k}:{v}" for k, v in h.items())


def run_summary_text(source) -> str:
    """A plain-text summary: what the run has (τ, acceptance by depth and sibling rank, stage
    times, per-request histograms) and what it lacks, with the features that cannot run."""
    kind = _kind(source)
    lines = [f"source: {kind}", TAU_DEFINITION]
    if kind != "engine summary":
        st = reference_stats(source)
        lines.append(f"rounds: {st['rounds']}   τ mean: {st['tau_mean']:.3f}")
        if kind == "ddtree reference":
            lines.append(STOPPING_RULE + " (ddtree_lab.views.compare.reference_vs_lab).")
        for rid, v in st["by_request"].items():
            lines.append(f"  request {rid}: {v['rounds']} rounds, τ mean {v['tau_mean']:.3f}")
        lines.append("acceptance by depth (accepted / offered):")
        lines.append(f"  ({OFFERED_DEFINITION})")
        d = st["by_depth"]
        for depth, a, o, r in zip(d["depth"], d["accepted"], d["offered"], d["rate"]):
            lines.append(f"  depth {depth:2d}: {a:4d} / {o:4d}  {_fmt(r)}")
        lines.append("accepted nodes by sibling rank (0 = first child), per depth:")
        for depth, ranks in st["by_sibling_rank"].items():
            lines.append(f"  depth {depth:2d}: " + _text_hist(ranks))
        lines.append("  all depths: " + _text_hist(st["rank_totals"]))
        if st["stage_times"]:
            total = sum(st["stage_times"][k] for k in STAGE_NAMES[:5] if k in st["stage_times"])
            lines.append(f"stage times (seconds, summed over {st['stage_requests']} request(s); the reference does "
                         "not count the first round's draft):")
            for k, v in st["stage_times"].items():
                share = f"  {100 * v / total:5.1f}%" if total and k in STAGE_NAMES[:5] else ""
                lines.append(f"  {k:22s} {v:.6f}{share}")
        else:
            lines.append("stage times: missing")
        if st["round_seconds_mean"] is not None:
            lines.append(f"mean round time: {1000 * st['round_seconds_mean']:.2f} ms")
    else:
        ss = summary_stats(source)
        for q in ss["requests"]:
            lines.append(f"request {q['request_id']} ({q['engine']}, {q['level']}): {_fmt(q['num_steps'])} verify steps, "
                         f"τ mean {_fmt(q['tau_mean'])}")
            if q["reported_accept_length"] is not None:
                lines.append(f"  engine's accept length {q['reported_accept_length']:.3f} = "
                             f"{q['reported_accept_length_definition']}")
            lines.append("  τ histogram (τ:steps): " + (_text_hist(q["tau_histogram"]) if q["tau_histogram"]
                                                       else "missing"))
            if q["position_rate"] is not None:
                lines.append("  acceptance at draft position 1..k: " + " ".join(f"{r:.2f}" for r in q["position_rate"]))
        p = ss["pooled"]
        if p["steps"]:
            lines.append(f"pooled over per-request records: {p['steps']} steps, τ mean {p['tau_mean']:.3f}")
    rep = missing_report(source)
    lines.append("missing: " + ", ".join(rep["missing"]))
    lines.append("lab features that cannot run on this run:")
    for feat, why in rep["cannot"].items():
        lines.append(f"  - {feat}: {why}")
    return "\n".join(lines)


def _table(header: Sequence[str], rows: Sequence[Sequence]) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table class='ddtree-run-summary'><tr>{head}</tr>{body}</table>"


def run_summary_html(source) -> str:
    """The same summary as :func:`run_summary_text`, as an HTML fragment (tables, escaped text)."""
    kind = _kind(source)
    parts = [f"<div class='ddtree-run-summary'><h3>{html.escape(kind)} run</h3><p>{html.escape(TAU_DEFINITION)}</p>"]
    if kind != "engine summary":
        st = reference_stats(source)
        parts.append(f"<p>{st['rounds']} rounds, τ mean {st['tau_mean']:.3f}</p>")
        if kind == "ddtree reference":
            parts.append(f"<p class='ddtree-stopping-rule'>{html.escape(STOPPING_RULE)}.</p>")
        parts.append(_table(["request", "rounds", "τ mean"],
                            [[k, v["rounds"], v["tau_mean"]] for k, v in st["by_request"].items()]))
        d = st["by_depth"]
        parts.append("<h4>acceptance by depth</h4>"
                     f"<p class='ddtree-definition'>{html.escape(OFFERED_DEFINITION)}</p>" + _table(["depth", "accepted", "offered", "rate"],
                                                              list(zip(d["depth"], d["accepted"], d["offered"], d["rate"]))))
        ranks = sorted(st["rank_totals"])
        parts.append("<h4>accepted nodes by sibling rank</h4>" + _table(
            ["depth", *[f"rank {r}" for r in ranks]],
            [[depth, *[v.get(r, 0) for r in ranks]] for depth, v in st["by_sibling_rank"].items()]))
        if st["stage_times"]:
            parts.append("<h4>stage times (s, summed per request)</h4>" + _table(["stage", "seconds"],
                                                                               list(st["stage_times"].items())))
        else:
            parts.append("<p>stage times: missing</p>")
    else:
        ss = summary_stats(source)
        parts.append(_table(["request", "engine", "level", "steps", "τ mean", "engine's accept length", "τ histogram"],
                            [[q["request_id"], q["engine"], q["level"], q["num_steps"], q["tau_mean"],
                              q["reported_accept_length"], _text_hist(q["tau_histogram"]) if q["tau_histogram"] else None]
                             for q in ss["requests"]]))
        defs = sorted({q["reported_accept_length_definition"] for q in ss["requests"]
                       if q["reported_accept_length_definition"]})
        parts.extend(f"<p>engine's accept length: {html.escape(x)}</p>" for x in defs)
    rep = missing_report(source)
    parts.append("<h4>missing</h4><p>" + html.escape(", ".join(rep["missing"])) + "</p>")
    parts.append("<h4>cannot run on this run</h4><ul>" + "".join(
        f"<li><b>{html.escape(k)}</b>: {html.escape(v)}</li>" for k, v in rep["cannot"].items()) + "</ul></div>")
    return "".join(parts)


def _setting(params) -> str:
    if params is None:
        return "parameters not recorded"
    t = float(getattr(params, "temperature", 0.0))
    if t == 0:
        return "greedy (T=0)"
    bits = [f"T={t:g}"]
    k, p = getattr(params, "top_k", 0), getattr(params, "top_p", 1.0)
    if k and k > 0:
        bits.append(f"top-k {k}")
    if p is not None and p < 1:
        bits.append(f"top-p {p:g}")
    return ", ".join(bits)


def _lab_taus(lab) -> dict[str, list[int]]:
    if isinstance(lab, dict):
        return {str(k): [int(x) for x in v] for k, v in lab.items()}
    if isinstance(lab, (list, tuple)):
        return {"lab": [int(x) for x in lab]}
    out: dict[str, list[int]] = {}
    for s in lab.steps:
        if getattr(s, "output", None) is not None:
            tau = int(s.output.tau()[0])
        elif getattr(s, "stored_accept_length", None) is not None:
            tau = int(s.stored_accept_length) + 1
        else:
            continue
        out.setdefault(_setting(getattr(s, "params", None)), []).append(tau)
    return out


def _dist(taus_or_hist, label: str, definition: str) -> dict:
    counts = dict(taus_or_hist) if isinstance(taus_or_hist, dict) else {}
    if not isinstance(taus_or_hist, dict):
        for t in taus_or_hist:
            counts[t] = counts.get(t, 0) + 1
    n = sum(counts.values())
    mean = sum(t * c for t, c in counts.items()) / n if n else None
    counts = dict(sorted(counts.items()))
    return {"label": label, "steps": n, "tau_mean": mean, "tau": list(counts),
            "count": list(counts.values()), "fraction": [c / n for c in counts.values()] if n else [],
            "definition": definition}


def serving_vs_lab(serving, lab, serving_label: str | None = None) -> dict:
    """The τ distributions of a serving run and a lab run, side by side.

    Args:
        serving: a summary Run or ``AcceptanceSummaries`` (pooled over its per-request records;
            engine aggregates are used when there is no per-request record) or a reference run.
        lab: a lab :class:`~ddtree_lab.step.Run` (grouped by sampling setting), a list of τ, or
            ``{label: [τ, ...]}``.
        serving_label: legend name (default: the engine, or "ddtree reference").

    Returns:
        ``{"series": [{"label", "steps", "tau_mean", "tau", "count", "fraction",
        "definition"}], "definition": TAU_DEFINITION, "note", "reference_vs_lab"}``, serving
        first. A reference run's ``note`` is :data:`ddtree_lab.views.compare.STOPPING_RULE` with mean τ over the rounds
        both loops ran when ``lab`` is a Run of the same prompts (``reference_vs_lab``: that
        comparison, :func:`ddtree_lab.views.compare.reference_vs_lab`); engine summaries: ``None`` for both.

    Raises:
        ValueError: either side has no step.
    """
    kind = _kind(serving)
    note, rounds = None, None
    if kind == "engine summary":
        reqs = _summary_requests(serving)
        per = [q for q in reqs if q.get("level") == "per request" and q.get("accept_histogram") is not None]
        use = per or [q for q in reqs if q.get("accept_histogram") is not None]
        hist: dict[int, int] = {}
        for q in use:
            for j, c in enumerate(q["accept_histogram"]):
                hist[j + 1] = hist.get(j + 1, 0) + c
        engine = use[0].get("engine") if use else "engine"
        first = _dist(hist, serving_label or f"{engine} (serving)",
                      f"from the engine's acceptance histogram ({'per request' if per else 'engine aggregate'})")
    else:
        first = _dist(reference_stats(serving)["tau"], serving_label or kind, "len(accepted_indices) per round")
        if kind == "ddtree reference":  # the loops stop differently: say so, and measure it where it can be
            note, rounds = _stopping_note(serving, lab)
    if not first["steps"]:
        raise ValueError("the serving side has no verify step")
    series = [first]
    for label, taus in _lab_taus(lab).items():
        series.append(_dist(taus, f"lab: {label}", "accepted draft tokens + 1 per lab step"))
    if len(series) == 1:
        raise ValueError("the lab side has no step with an accept length")
    return {"series": series, "definition": TAU_DEFINITION, "note": note, "reference_vs_lab": rounds}


def _stopping_note(reference, lab) -> tuple[str, dict | None]:
    """The stopping rule (``compare.STOPPING_RULE``), measured on the rounds both loops ran when ``lab`` is a Run of
    the same prompts (else said why not)."""
    if not hasattr(lab, "steps"):
        return STOPPING_RULE + " (not compared round by round: the lab side is τ values, not a Run)", None
    try:
        rounds = reference_vs_lab(reference, lab)
    except ValueError as exc:
        return STOPPING_RULE + f" (not compared round by round: {exc})", None
    reqs = rounds["requests"]
    n = sum(q["common"] for q in reqs)
    ref_c = sum(q["tau_common"][0] * q["common"] for q in reqs) / n
    lab_c = sum(q["tau_common"][1] * q["common"] for q in reqs) / n
    more = sum(max(q["extra"], 0) for q in reqs)
    return (STOPPING_RULE + f". Mean τ over the {n} rounds both loops ran: {ref_c:.3f} (reference) vs {lab_c:.3f} "
            f"(lab), {sum(q['identical'] for q in reqs)} of {n} rounds identical up to ties; the reference ran {more} more "
            f"round{'' if more == 1 else 's'} because it stops on committed tokens"), rounds


def serving_vs_lab_figure(data: dict, title: str = "τ per verify step: serving run beside lab run"):
    """A plotly figure of :func:`serving_vs_lab`'s data: grouped bars of the fraction of steps
    at each τ, the mean of each series in its legend name, and the data's ``note`` (a reference
    run: how the loops stop, measured) under the axis."""
    import plotly.graph_objects as go

    fig = go.Figure()
    palette = ["#222222", "#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e"]
    for k, s in enumerate(data["series"]):
        fig.add_trace(go.Bar(x=s["tau"], y=s["fraction"], name=f"{s['label']} (mean {s['tau_mean']:.2f}, "
                                                                f"{s['steps']} steps)",
                             customdata=s["count"], hovertemplate="τ=%{x}: %{y:.1%} (%{customdata} steps)<extra></extra>",
                             marker_color=palette[k % len(palette)]))
    note = data.get("note")
    if note:  # the reference's loop stops differently: printed under the bars
        import textwrap

        fig.add_annotation(text="<br>".join(textwrap.wrap(note, 150)), xref="paper", yref="paper", x=0, y=-0.25,
                           showarrow=False, font={"size": 10}, align="left", xanchor="left", yanchor="top")
    fig.update_layout(barmode="group", title=title, xaxis_title=data["definition"], yaxis_title="fraction of steps",
                      template="plotly_white", height=460 if note else 360, margin={"t": 50, "b": 150 if note else 50})
    fig.update_xaxes(dtick=1)
    return fig


def _one_round(source, step: int, request: int) -> dict:
    rounds, _ = _rounds(source)
    for r in rounds:
        if r["step"] == step and r["request"] == request:
            if isinstance(source, ReferenceTraces):
                rnd = next(q for q in source.requests if q.request == request).rounds
                got = next(x for x in rnd if x.round == step)
                r["tokens"] = [got.root_token if got.root_token is not None else -1, *got.node_token_ids]
            else:
                r["tokens"] = [int(t) for t in source.find_step(step, request).node_token_ids.tolist()]
            return r
    have = sorted({(r["request"], r["step"]) for r in rounds})
    raise KeyError(f"no round {step} of request {request} with a tree (have {len(have)}: "
                   f"{have[:6]}{' ...' if len(have) > 6 else ''})")


def _token(tok: int, texts) -> str:
    """``id 'text'`` (the label of :func:`ddtree_lab.views.token_label`, the id always first)."""
    if tok < 0:
        return "(not recorded)"
    return f"{tok} {token_label(texts[tok])}" if texts and tok in texts else str(tok)


def round_tree_text(source, step: int = 0, request: int = 0, texts: dict[int, str] | None = None) -> str:
    """One round's tree as indented text: each node's index, token, depth ``d`` and sibling
    rank ``r``; accepted nodes marked ``✓``.

    Raises:
        KeyError: no such round with a tree (the message lists some that exist).
    """
    r = _one_round(source, step, request)
    parents, tokens, path = r["parents"], r["tokens"], set(r["path"])
    sib = sibling_ranks_of(parents)
    children: dict[int, list[int]] = {}
    for i in range(1, len(parents)):
        children.setdefault(parents[i], []).append(i)
    lines = [f"round {step}, request {r['request_id']}: {len(parents) - 1} draft nodes, τ = {r['tau']} "
             f"(✓ accepted)", f"[0] root {_token(tokens[0], texts)}"]

    def walk(node: int, prefix: str) -> None:
        kids = children.get(node, [])
        for k, c in enumerate(kids):
            last = k == len(kids) - 1
            mark = "✓ " if c in path else ""
            lines.append(f"{prefix}{'└─' if last else '├─'} {mark}[{c}] {_token(tokens[c], texts)}  "
                         f"d{r['depths'][c]} r{sib[c]}")
            walk(c, prefix + ("   " if last else "│  "))

    walk(0, "")
    return "\n".join(lines)


def round_tree_dot(source, step: int = 0, request: int = 0, texts: dict[int, str] | None = None) -> str:
    """One round's tree as Graphviz DOT (accepted path filled green, edges labelled with the
    sibling rank); render with :func:`ddtree_lab.views.render_svg`.

    Raises:
        KeyError: no such round with a tree.
    """
    r = _one_round(source, step, request)
    parents, tokens, path = r["parents"], r["tokens"], set(r["path"])
    sib = sibling_ranks_of(parents)

    def label(i: int) -> str:
        return _token(tokens[i], texts).replace("\\", "\\\\").replace('"', '\\"')

    out = ["digraph round {", "  rankdir=LR; node [shape=box, fontname=monospace, fontsize=10];"]
    for i in range(len(parents)):
        style = ', style=filled, fillcolor="#c8e6c9"' if i in path else ""
        out.append(f'  n{i} [label="[{i}] {label(i)}\\nd{r["depths"][i]}"{style}];')
    for i in range(1, len(parents)):
        bold = ", penwidth=2" if i in path else ""
        out.append(f'  n{parents[i]} -> n{i} [label="r{sib[i]}"{bold}];')
    out.append("}")
    return "\n".join(out)
