"""A real engine's recording beside another: what vLLM's sampler applied, what each run wrote,
what the lab's diagnosis says (notebook ``labs/09_vllm_engine.ipynb``).

Reads :class:`~ddtree_lab.step.Run` records of vLLM recordings (``ddtree_lab.io.load(DIR)``,
:mod:`ddtree_lab.vllm.recording`): each step's ``extra["vllm"]`` holds ``params_requested`` (the
request's sampling parameters) and ``params_applied`` (per draft position, the temperature /
top-k / top-p vLLM's sampler used, as the recorder read them from the sampler's own tensors).

* :func:`requested_value` -- what vLLM should apply for a parameter (``1`` as the temperature of
  a greedy request in a batch that is not all greedy: vLLM's ``replace_to``);
* :func:`applied_parameters` / :func:`applied_parameters_figure` -- one step's applied values
  per draft position against the requested one, of one run or of several runs on one plotly
  figure (a log y axis where the values span more than :data:`LOG_SPAN`);
* :func:`generated_texts` / :func:`generated_texts_html` -- each request's generated text, the
  runs side by side;
* :func:`side_by_side_html` -- HTML fragments in columns (e.g. two run summaries);
* :func:`diagnosis_html` -- a :class:`~ddtree_lab.diagnosis.Diagnosis` as two tables: the
  findings, then every check (ran and what it compared, or why not).

Views read recordings only; nothing here runs an engine or a model.
"""

from __future__ import annotations

import html
import math
from typing import Mapping

from ..step import Run, Step
from .compare import COLORS, HOVER

__all__ = ["LOG_SPAN", "requested_value", "applied_parameters", "applied_parameters_figure", "generated_texts",
           "generated_texts_html", "side_by_side_html", "diagnosis_html"]

#: a y axis turns logarithmic when its drawable values span more than this factor
LOG_SPAN = 100.0
#: the parameters vLLM's sampler expands per draft position, in the order they are drawn
PARAMETERS = ("temperature", "top_k", "top_p")


def requested_value(name: str, params: Mapping | None, greedy: bool) -> float | None:
    """What vLLM's sampler should apply for ``name`` (``temperature``, ``top_k``, ``top_p``) on
    a request with ``params`` (its ``params_requested``): the temperature (``1.0`` for a greedy
    request: vLLM's ``replace_to`` in a batch that is not all greedy), top-p (``1.0`` when not
    set), top-k (None when off: ``<= 0`` or not set; vLLM then applies ``<= 0`` or the vocabulary).

    Raises:
        ValueError: another parameter name.
    """
    params = params or {}
    if name == "temperature":
        return 1.0 if greedy else float(params.get("temperature") or 0.0)
    if name == "top_p":
        return float(params.get("top_p") or 1.0)
    if name == "top_k":
        k = int(params.get("top_k") or 0)
        return float(k) if k > 0 else None
    raise ValueError(f"unknown sampler parameter {name!r} (known: {', '.join(PARAMETERS)})")


def _find(run: Run, step: int, request: int) -> Step:
    s = run.find_step(step, request)  # KeyError naming the steps the request has
    if (s.extra.get("vllm") or {}).get("params_requested") is None:
        raise ValueError(f"step {step}, request {request}: no sampler parameters recorded (not a vLLM recording)")
    return s


def applied_parameters(run: Run, step: int, request: int) -> dict[str, dict]:
    """The per-position parameters vLLM's sampler applied at one recorded step and request.

    Returns:
        ``{name: {"requested": float | None (off), "applied": [float per draft position],
        "greedy": bool}}`` for each parameter the step records, in :data:`PARAMETERS` order;
        empty when the batch was all greedy (vLLM applies none: argmax of the raw rows) or the
        step drafted nothing.

    Raises:
        KeyError: no such step / request in ``run``.
        ValueError: the step records no sampler parameters (not a vLLM recording).
    """
    s = _find(run, step, request)
    v = s.extra["vllm"]
    applied, greedy = v.get("params_applied") or {}, bool(v.get("greedy"))
    names = [n for n in PARAMETERS if applied.get(n)] + sorted(n for n in applied if n not in PARAMETERS and applied[n])
    return {n: {"requested": requested_value(n, v["params_requested"], greedy),
                "applied": [float(x) for x in applied[n]], "greedy": greedy} for n in names}


def _drawable(x: float, log: bool) -> bool:
    return math.isfinite(x) and (x > 0 or not log)


def _axis_is_log(values: list[float]) -> bool:
    """Log where the positive finite values span more than :data:`LOG_SPAN` (a linear axis
    would squash all but the largest onto 0)."""
    pos = [abs(x) for x in values if math.isfinite(x) and x != 0]
    return bool(pos) and max(pos) / min(pos) > LOG_SPAN


def applied_parameters_figure(runs: Run | Mapping[str, Run], step: int, request: int,
                              parameters: tuple[str, ...] | None = None, title: str | None = None):
    """Per draft position, the parameters vLLM's sampler applied at ``(step, request)`` against
    the request's, one panel per parameter, each run's applied values a coloured series and the
    requested value a dashed black line (vLLM's value for a greedy request's temperature: 1).

    ``runs``: one run, or ``{label: run}`` (each must record that step and request: the same
    batch recorded twice, e.g. as shipped and fixed). ``parameters``: the panels (default every
    parameter the step records). A panel whose values span more than :data:`LOG_SPAN` has a log
    y axis; a value it cannot draw (``<= 0`` there, NaN, inf) is a cross at the panel's floor,
    its number in the hover. Hover on any point gives the exact applied value.

    Returns:
        a ``plotly.graph_objects.Figure``; each series' ``customdata`` holds the exact applied
        values (``meta``: ``{"run", "parameter", "requested"}``).

    Raises:
        KeyError / ValueError: as :func:`applied_parameters`; ValueError also when no run applied
            any parameter there (an all-greedy batch) or a parameter asked for is not recorded.
    """
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    labelled = {"": runs} if isinstance(runs, Run) else dict(runs)
    data = {label: applied_parameters(run, step, request) for label, run in labelled.items()}
    recorded = [n for n in PARAMETERS if any(n in d for d in data.values())]
    recorded += sorted({n for d in data.values() for n in d} - set(recorded))
    names = list(parameters) if parameters is not None else recorded
    if not names:
        raise ValueError(f"step {step}, request {request}: vLLM's sampler applied no parameter there "
                         "(an all-greedy batch, or no draft)")
    missing = [n for n in names if n not in recorded]
    if missing:
        raise ValueError(f"step {step}, request {request}: {', '.join(missing)} not recorded (recorded: {recorded})")
    fig = make_subplots(rows=len(names), cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        subplot_titles=[n.replace("_", "-") for n in names])
    request_id = next(iter(labelled.values())).find_step(step, request).request_id
    legends: set[str] = set()  # each legend entry once, on the first panel that has it
    for row, name in enumerate(names, start=1):
        series = {label: d[name] for label, d in data.items() if name in d}
        values = [x for p in series.values() for x in p["applied"]]
        wanted = sorted({p["requested"] for p in series.values() if p["requested"] is not None})
        log = _axis_is_log(values + wanted)
        shown = [abs(x) for x in values + wanted if _drawable(x, log)]
        floor = (min(shown) / 10 if log else min(0.0, *shown)) if shown else (1e-3 if log else 0.0)
        for k, (label, p) in enumerate(series.items()):
            ys = p["applied"]
            xs = list(range(len(ys)))
            color = COLORS[k % len(COLORS)]
            legend = f"applied · {label}" if label else "applied"
            fig.add_trace(go.Scatter(
                x=xs, y=[y if _drawable(y, log) else None for y in ys], mode="lines+markers", name=legend,
                legendgroup=legend, showlegend=row == 1, line={"color": color}, customdata=ys,
                meta={"run": label, "parameter": name, "requested": p["requested"]},
                hovertemplate=f"{legend}<br>position %{{x}}: {name} %{{customdata:.6g}}<extra></extra>"), row=row, col=1)
            bad = [j for j, y in enumerate(ys) if not _drawable(y, log)]
            if bad:
                note = "≤ 0 or not finite (a log axis cannot draw it)" if log else "not finite"
                entry = f"{legend}: {'≤ 0 or not finite' if log else 'not finite'}, drawn at the floor"
                fig.add_trace(go.Scatter(
                    x=bad, y=[floor] * len(bad), mode="markers", name=entry, legendgroup=legend,
                    showlegend=entry not in legends,
                    marker={"symbol": "x", "size": 10, "color": color}, customdata=[ys[j] for j in bad],
                    meta={"run": label, "parameter": name, "undrawable": True},
                    hovertemplate=f"{legend}<br>position %{{x}}: {name} %{{customdata:.6g}} ({note})<extra></extra>"),
                    row=row, col=1)
                legends.add(entry)
        positions = max((len(p["applied"]) for p in series.values()), default=1)
        for k, want in enumerate(wanted):
            fig.add_trace(go.Scatter(
                x=[-0.3, positions - 0.7], y=[want, want], mode="lines", name="requested",
                legendgroup="requested", showlegend=row == 1 and k == 0, line={"color": "black", "dash": "dash"},
                meta={"parameter": name, "requested": want},
                hovertemplate=f"requested {name} {want:.6g}<extra></extra>"), row=row, col=1)
        if not wanted:
            fig.add_annotation(text="requested: off", showarrow=False, xref="x domain", yref="y domain", x=1, y=1,
                               row=row, col=1)
        fig.update_yaxes(type="log" if log else "linear", title_text=name + (" (log)" if log else ""),
                         exponentformat="power" if log else "none", row=row, col=1)
    fig.update_xaxes(title_text="draft position", dtick=1, row=len(names), col=1)
    greedy = next(iter(data.values())).get(names[0], {}).get("greedy")
    fig.update_layout(
        title=title or f"step {step}, request {request_id}{' (greedy)' if greedy else ''}: the parameters "
                       "vLLM's sampler applied per draft position",
        height=260 + 260 * len(names), hoverlabel=HOVER, legend={"orientation": "h", "y": -0.12})
    return fig


def generated_texts(run: Run) -> dict[str, str]:
    """Each request's generated text, keyed by the request's name (its prompt file ``id`` when
    the recording has one, else its request id); token texts as the run recorded them (``<ID>``
    where the tokenizer was not at hand when loading)."""
    from ..texts import join_texts

    out = {}
    for r in run.metadata.get("requests") or []:
        ids = r.get("generated_token_ids") or []
        out[str(r.get("id") or r["request_id"])] = join_texts(run.text(t) for t in ids)
    return out


def _setting(params: Mapping | None) -> str:
    p = params or {}
    if not p.get("temperature"):
        return "greedy"
    parts = [f"T {p['temperature']:g}"]
    if p.get("top_k"):
        parts.append(f"top-k {p['top_k']}")
    if p.get("top_p") not in (None, 1.0):
        parts.append(f"top-p {p['top_p']:g}")
    return ", ".join(parts)


def generated_texts_html(runs: Mapping[str, Run]) -> str:
    """One row per request (its name and sampling parameters, from the first run), one column
    per run with the text that run generated for it; cells wrap, newlines kept, HTML escaped."""
    if not runs:
        raise ValueError("no runs to show")
    texts = {label: generated_texts(run) for label, run in runs.items()}
    first = next(iter(runs.values()))
    params = {str(r.get("id") or r["request_id"]): r.get("params") for r in first.metadata.get("requests") or []}
    names = list(dict.fromkeys(n for t in texts.values() for n in t))
    cell = "padding:4px 8px;vertical-align:top;text-align:left;border-top:1px solid #ddd"
    head = f'<th style="{cell}">request</th>' + "".join(f'<th style="{cell}">{html.escape(label)}</th>' for label in texts)
    rows = []
    for n in names:
        tds = "".join(f'<td style="{cell};font-family:monospace;white-space:pre-wrap;word-break:break-word">'
                      f"{html.escape(t.get(n, '(not in this run)'))}</td>" for t in texts.values())
        rows.append(f'<tr><td style="{cell};white-space:nowrap"><b>{html.escape(n)}</b><br>'
                    f"{html.escape(_setting(params.get(n)))}</td>{tds}</tr>")
    width = max(20, 80 // len(texts))
    cols = '<col style="width:16%">' + "".join(f'<col style="width:{width}%">' for _ in texts)
    return (f'<table class="ddtree-generated" style="border-collapse:collapse;width:100%;table-layout:fixed">'
            f"<colgroup>{cols}</colgroup><tr>{head}</tr>{''.join(rows)}</table>")


def side_by_side_html(panels: Mapping[str, str]) -> str:
    """HTML fragments in columns, each under its label (the fragments are inserted as they are:
    pass HTML the lab's views made, e.g. :func:`ddtree_lab.views.run_summary.run_summary_html`)."""
    cols = "".join(f'<div style="flex:1 1 0;min-width:320px;overflow-x:auto"><h3>{html.escape(label)}</h3>{body}</div>'
                   for label, body in panels.items())
    return f'<div class="ddtree-side-by-side" style="display:flex;gap:24px;align-items:flex-start">{cols}</div>'


def diagnosis_html(diagnosis) -> str:
    """A :class:`~ddtree_lab.diagnosis.Diagnosis` as HTML: a findings table (check, what,
    where, evidence, how sure, the next command) or "no findings", then one row per check
    (passed / found / ran in part / could not run, items compared, the note or why not), and
    the count line of :meth:`~ddtree_lab.diagnosis.Diagnosis.text`."""
    cell = "padding:2px 8px;vertical-align:top;text-align:left;border-top:1px solid #ddd"

    one_line = {"check", "sure", "next", "result", "items"}  # names and commands: never wrapped

    def table(head: list[str], rows: list[list[str]], css: str) -> str:
        styles = [cell + (";white-space:nowrap" if h in one_line else "") for h in head]
        th = "".join(f'<th style="{cell}">{html.escape(h)}</th>' for h in head)
        body = "".join("<tr>" + "".join(f'<td style="{st}">{html.escape(str(c))}</td>' for st, c in zip(styles, r))
                       + "</tr>" for r in rows)
        return f'<table class="{css}" style="border-collapse:collapse"><tr>{th}</tr>{body}</table>'

    def where(f) -> str:
        bits = [f"{k} {v}" for k, v in (("step", f.step), ("request", f.request), ("node", f.node)) if v is not None]
        return ", ".join(bits) + (f" (and {f.steps - 1} more steps)" if f.steps > 1 else "")

    findings = diagnosis.findings
    parts = []
    if findings:
        parts.append(table(["check", "finding", "where", "evidence", "sure", "next"],
                           [[f.check, f.kind, where(f), f.evidence, f.sure, f.next] for f in findings],
                           "ddtree-findings"))
    else:
        parts.append('<p class="ddtree-findings" style="color:#1b7f3b"><b>no findings</b></p>')
    rows = []
    for r in diagnosis.results:
        state = ("could not run" if not r.ran else f"{len(r.findings)} finding(s)" if r.findings
                 else "ran in part" if r.not_run else "passed")
        said = r.why if not r.ran else "; ".join(x for x in (r.note, f"not run: {r.not_run}" if r.not_run else "") if x)
        rows.append([r.check, state, r.checked if r.ran else "", said])
    parts.append(table(["check", "result", "items", "note"], rows, "ddtree-checks"))
    n = len(findings)
    parts.append(f"<p>{n} finding{'s' if n != 1 else ''}; {sum(r.ran for r in diagnosis.results)} of "
                 f"{len(diagnosis.results)} checks ran ({diagnosis.seconds:.1f} s)</p>")
    return '<div class="ddtree-diagnosis">' + "".join(parts) + "</div>"
