"""HTML renderings of a :class:`StepView`: the decision table, the children of the node the
walk stands on, the cumulative-mass bar with the coin, the bonus draw, and a request's
committed text. Every token text is HTML-escaped; whitespace is made visible."""

from __future__ import annotations

import html
import math

import numpy as np

from ..step import Run
from .model import LOSSY_COLOR, StepView
from ..labels import mass_label
from ..labels import number_label

__all__ = ["decisions_table_html", "children_html", "mass_bar_svg", "bonus_html", "committed_html", "segments",
           "missing_note_html"]

_TABLE = 'style="border-collapse:collapse;font-family:monospace;font-size:12px"'
_CELL = 'style="padding:1px 6px;border-bottom:1px solid #ddd;text-align:right"'
_STATUS_BG = {"accepted": "#d9f2e1", "rejected": "#fbe3e1", "pending": "#ffffff", "unvisited": "#f5f5f5"}


def _e(text) -> str:
    return html.escape(str(text), quote=True)


def _tok(view: StepView, token: int) -> str:
    return _e(view.label(token))


def _p(value: float | None, upper: bool) -> str:
    return "?" if value is None else f"{'<' if upper else ''}{number_label(value)}"


def _table(head: list[str], rows: list[list[str]], row_styles: list[str] | None = None, cls: str = "") -> str:
    th = "".join(f"<th {_CELL}>{h}</th>" for h in head)
    body = []
    for k, r in enumerate(rows):
        style = f' style="background:{row_styles[k]}"' if row_styles and row_styles[k] else ""
        body.append(f"<tr{style}>" + "".join(f"<td {_CELL}>{c}</td>" for c in r) + "</tr>")
    klass = f' class="{cls}"' if cls else ""
    return f"<table{klass} {_TABLE}><tr>{th}</tr>{''.join(body)}</table>"


def decisions_table_html(view: StepView) -> str:
    """The step's decision log as an HTML table, then the bonus line.

    Sampled steps: target p, ``S_k`` and the coin the verifier compared (accept the first
    child with ``u < S_k`` and ``p > 0``). Greedy steps: target p (softmax of the raw logits)
    and whether the token is the target's argmax (no coin). A lossy step (thresholds other
    than 1) gets its ``LOSSY: ...`` mark in red above the table. A step without a decision log
    (the DDTree reference's dumps) gets no table: a sentence with its recorded outcome and
    the note naming what is not recorded (class ``ddtree-missing``)."""
    if not view.events:
        return missing_note_html(view) + _no_log_html(view)
    greedy = view.greedy
    if greedy:
        head = ["#", "depth", "parent", "node", "token", "target p", "= argmax?", "verdict"]
    else:
        head = ["#", "depth", "parent", "node", "token", "target p", "S_k", "coin", "verdict"]
    rows, styles = [], []
    for d in view.decisions:
        common = [str(d.order), str(d.depth), str(d.parent), str(d.node), _tok(view, d.token), _p(d.target_p, d.target_p_upper)]
        rows.append(common + (["yes" if d.verdict == "accept" else "no"] if greedy else [mass_label(d.mass), number_label(d.coin)])
                    + [d.verdict])
        styles.append(_STATUS_BG["accepted" if d.verdict == "accept" else "rejected"])
    warn = (f'<p class="ddtree-lossy" style="color:{LOSSY_COLOR};font-weight:bold">{html.escape(view.lossy_mark)} '
            "(the emitted law is not the target's)</p>" if view.lossy else "")
    return warn + _table(head, rows, styles, "ddtree-decisions") + f"<p>{_bonus_sentence(view)}</p>"


def missing_note_html(view: StepView) -> str:
    """The note naming what the step does not record (:attr:`StepView.missing_note`) as a
    ``<p class="ddtree-missing">``; ``""`` for a step that records everything."""
    if not view.missing_note:
        return ""
    return ('<p class="ddtree-missing" style="background:#fff3cd;color:#8a4b00;padding:3px 6px;'
            f'font-family:monospace;font-size:12px">{_e(view.missing_note)}</p>')


def _no_log_html(view: StepView) -> str:
    path = ", ".join(f"#{i} {_tok(view, view.nodes[i].token)}" for i in view.accepted_path[1:] if i in view.nodes) or "none"
    return (f'<p class="ddtree-no-log">no decision log recorded ({_e(view.source)}): which children the verifier '
            f"judged, and with what target p, S_k and coin, is not known. Accepted path (root first): "
            f"{_e(' → '.join(map(str, view.accepted_path)))}; accepted draft tokens: {path}.</p>"
            f"<p>{_bonus_sentence(view)}</p>")


def _bonus_sentence(view: StepView) -> str:
    b = view.bonus
    if b is None:
        return "bonus token: not recorded"
    if b.kind == "recorded":
        return (f"bonus {_tok(view, b.token)} after node {b.node}: the token the run emitted (its target p and how it was "
                "drawn are not recorded)")
    if b.token < 0:
        return (f"no bonus: the residual at node {b.node} is empty (mass {mass_label(b.residual_mass)}, coin "
                f"{number_label(b.coin)}): support exhausted")
    if view.greedy:
        return f"bonus {_tok(view, b.token)}: the target's argmax at node {b.node} (target p {_p(b.target_p, b.target_p_upper)})"
    where = "the target row (a leaf)" if b.kind == "leaf" else "the residual (rejected siblings zeroed, renormalised)"
    return (f"bonus {_tok(view, b.token)} drawn at node {b.node} from {where}: residual mass {mass_label(b.residual_mass)}, coin "
            f"{number_label(b.coin)}; target p {_p(b.target_p, b.target_p_upper)}, residual p {number_label(b.residual_p)}")


def segments(view: StepView, node: int) -> list[tuple[int, float, float]]:
    """``(child, S_{k-1}, S_k)`` for the drawn children of ``node`` (float32 running sums, as
    the verifier accumulates them; sampled steps only)."""
    out, mass = [], 0.0
    for c in view.nodes[node].children:
        child = view.nodes[c]
        if c < 0 or child.accept_p is None:
            continue
        hi = float(np.float32(mass + child.accept_p))
        out.append((c, mass, hi))
        mass = hi
    return out


def children_html(view: StepView, limit: int = 12) -> str:
    """The children of the node the walk stands on (the view's cursor; the root without one),
    in sibling order: target p, their segment of the cumulative mass, the exact probability
    that the walk accepts each once here (``accept p``) and from the root (``path p``), and
    the status so far. Greedy: the argmax comparison instead of segments. Rows past the first
    ``limit`` that are not judged yet are summed up in one line: the sums of their target p,
    accept p and path p, each under its own column. A step without target rows: depth, rank and
    node log-weight instead of probabilities (:func:`missing_note_html` says why)."""
    cur = view.cursor
    node = 0 if cur is None else cur.current
    if not view.rows_known:
        return _children_no_rows(view, node, limit)
    status_of = view.status
    seg = {c: (lo, hi) for c, lo, hi in ([] if view.greedy else segments(view, node))}
    if view.greedy:
        head = ["node", "token", "target p", "= argmax?", "accept p", "path p", "status"]
    else:
        head = ["node", "token", "target p", "segment [S_k-1, S_k)", "accept p", "path p", "status"]
    rows, styles = [], []
    kids = view.nodes[node].children
    rest = [c for c in kids[limit:] if c >= 0 and status_of(c) in ("pending", "unvisited")]
    for c in kids:
        child = view.nodes[c]
        st = status_of(c)
        if c in rest:
            continue
        if c < 0:
            rows.append(["…", _e(child.text), "-", "-", "-", "-", "hidden"])
            styles.append("")
            continue
        if view.greedy:
            third = {"accepted": "yes", "rejected": "no"}.get(st, "?")
        else:
            lo, hi = seg[c]
            third = f"[{mass_label(lo)}, {mass_label(hi)})"
        rows.append([f"#{c}", _tok(view, child.token), _p(child.target_p, child.target_p_upper), third,
                     number_label(child.accept_p), number_label(child.path_p), st])
        styles.append(_STATUS_BG.get(st, ""))
    if rest:
        rows.append(["…", f"{len(rest)} more children", *_rest_sums([view.nodes[c] for c in rest]), "pending"])
        styles.append("")
    if not rows:
        return f"<p>node {node} is a leaf: no children to judge.</p>"
    return _table(head, rows, styles, "ddtree-children")


def _sum_text(values: list[float | None], upper: bool = False) -> str:
    """``sum 0.0087`` of the values (``sum <0.0087`` when one is an upper bound; ``?`` when one
    is unknown)."""
    if any(v is None for v in values):
        return "?"
    return f"sum {'<' if upper else ''}{number_label(sum(v for v in values if v is not None))}"


def _rest_sums(rest) -> list[str]:
    """The summary row of children not listed one by one, under the table's columns: the sum of
    their target p (their share of the current node's target row), nothing under "= argmax?" /
    the segment column (one verdict or segment per child), and the sums of their accept p (the
    chance the walk accepts one of them once here) and path p."""
    return [_sum_text([n.target_p for n in rest], any(n.target_p_upper for n in rest)), "-",
            _sum_text([n.accept_p for n in rest]), _sum_text([n.path_p for n in rest])]
def _children_no_rows(view: StepView, node: int, limit: int) -> str:
    kids = list(view.nodes[node].children)
    if not kids:
        return f"<p>node {node} is a leaf: no children.</p>"
    rows, styles = [], []
    for c in kids[:limit]:
        child = view.nodes[c]
        if c < 0:
            rows.append(["…", _e(child.text), "-", "-", "-", "hidden"])
            styles.append("")
            continue
        st = view.status(c)
        rows.append([f"#{c}", _tok(view, child.token), str(child.depth), str(child.rank) if child.rank >= 0 else "?",
                     "?" if math.isnan(child.logw) else number_label(child.logw), st])
        styles.append(_STATUS_BG.get(st, ""))
    if len(kids) > limit:
        rows.append(["…", f"{len(kids) - limit} more children", "-", "-", "-", "-"])
        styles.append("")
    return _table(["node", "token", "depth", "rank", "logw", "status"], rows, styles, "ddtree-children")


def mass_bar_svg(view: StepView, width: int = 640, coin: float | None = None) -> str:
    """The cumulative-mass bar 0..1 of the current node's children (sampled steps): one
    segment per child in sibling order (coloured by status so far, labelled ``#index``), the
    residual after them grey, and the current node's coin ``u`` drawn as a line. ``coin``
    overrides the recorded coin (what-if). At a leaf (no children: its coin decides nothing)
    a sentence naming the final coin the bonus uses instead. Greedy steps and steps without
    target rows: an empty string."""
    if view.greedy or not view.rows_known:
        return ""
    cur = view.cursor
    node = 0 if cur is None else cur.current
    if not view.nodes[node].children:  # a leaf: its recorded coin decides nothing, so it is not drawn
        b = view.bonus
        final = "" if b is None or b.coin is None else f" u={number_label(b.coin)}"
        return (f'<p class="ddtree-massbar-leaf" style="font-family:monospace;font-size:12px">node #{node} is a leaf: '
                "no coin decides among children (its own coin is unused); the bonus is drawn from the target row "
                f"with the final coin{final}.</p>")
    u = view.nodes[node].child_coin if coin is None else coin
    h, top = 34, 14
    colors = {"accepted": "#43a047", "rejected": "#e57373", "pending": "#b0bec5", "unvisited": "#cfd8dc"}
    parts = [f'<svg class="ddtree-massbar" xmlns="http://www.w3.org/2000/svg" width="{width + 20}" height="{h + 26}">',
             f'<rect x="10" y="{top}" width="{width}" height="{h}" fill="#eeeeee" stroke="#9e9e9e"/>']
    for c, lo, hi in segments(view, node):
        x, w = 10 + lo * width, max((hi - lo) * width, 0.0)
        st = view.status(c)
        parts.append(f'<rect x="{x:.2f}" y="{top}" width="{w:.2f}" height="{h}" fill="{colors.get(st, "#cfd8dc")}" '
                     f'stroke="#ffffff" stroke-width="0.5"><title>#{c} {_tok(view, view.nodes[c].token)}: '
                     f'[{mass_label(lo)}, {mass_label(hi)})</title></rect>')
        if w >= 22:
            parts.append(f'<text x="{x + w / 2:.2f}" y="{top + h / 2 + 4}" font-size="10" text-anchor="middle" '
                         f'font-family="monospace">#{c}</text>')
    parts.append(f'<text x="10" y="{top + h + 12}" font-size="10" font-family="monospace">0</text>')
    parts.append(f'<text x="{10 + width}" y="{top + h + 12}" font-size="10" text-anchor="end" '
                 f'font-family="monospace">1</text>')
    if u is not None and not math.isnan(u):
        x = 10 + u * width
        parts.append(f'<line class="ddtree-coin" x1="{x:.2f}" y1="4" x2="{x:.2f}" y2="{top + h + 4}" '
                     f'stroke="#e65100" stroke-width="2.5"/>')
        anchor = "start" if u < 0.5 else "end"  # the label runs away from the near edge, never cut
        parts.append(f'<text x="{x:.2f}" y="11" font-size="10" text-anchor="{anchor}" '
                     f'font-family="monospace" fill="#e65100">u={number_label(u)} (node #{node}\'s coin)</text>')
    parts.append("</svg>")
    return "".join(parts)


def bonus_html(view: StepView, limit: int = 12) -> str:
    """The bonus draw: the row's top tokens with target p and residual p (rejected siblings
    struck out), the residual mass, the final coin and the chosen token. Greedy: the argmax.
    A bonus only as recorded (no rows) or not recorded: the sentence alone."""
    b = view.bonus
    if b is None:
        return f"<p><b>{_bonus_sentence(view)}</b></p>"
    rows, styles = [], []
    for t, _text, p, rp in b.top[:limit]:
        struck = t in b.rejected
        tok = f"<s>{_tok(view, t)}</s>" if struck else _tok(view, t)
        chosen = t == b.token
        rows.append([str(t), tok, number_label(p), "struck out" if struck else number_label(rp), "◀ chosen" if chosen else ""])
        styles.append("#e3f0ff" if chosen else "#fbe3e1" if struck else "")
    head = ["token id", "token", "target p", "residual p" if not view.greedy else "-", ""]
    table = _table(head, rows, styles, "ddtree-bonus") if rows else ""
    shown = f"<p>top {min(limit, len(b.top))} stored tokens of node {b.node}'s row:</p>" if rows else ""
    return f"<p><b>{_bonus_sentence(view)}</b></p>{shown}{table}"


_PALETTE = ["#fde2e4", "#e2ece9", "#dfe7fd", "#fff1c1", "#e8dff5", "#d8f3dc", "#ffe5d9", "#cddafd"]


def committed_html(run: Run, request: int = 0) -> str:
    """The request's generated text, each step's tokens on its own colour; a step's bonus
    token is underlined. The prefill's first token is grey. Hover shows step, role and token id.
    A character whose bytes span several tokens (byte-level tokens of Japanese text, emoji)
    shows whole, on the token of its last byte (:func:`ddtree_lab.texts.token_pieces`)."""
    from ..texts import token_pieces

    meta = run.metadata["requests"][request]
    generated = list(meta["generated_token_ids"])
    spans = []  # (token, title, style)
    if generated:
        spans.append((generated[0], "prefill", "background:#eeeeee"))
    count = 1
    for s in run.for_request(request):
        color = _PALETTE[s.step % len(_PALETTE)]
        emitted = s.emitted
        assert s.output is not None  # s.emitted raised otherwise
        for j, tok in enumerate(emitted):
            if count >= len(generated):
                break
            role = "bonus" if j == len(emitted) - 1 and not bool(s.output.support_exhausted[0]) else "accepted draft"
            deco = "text-decoration:underline;" if role == "bonus" else ""
            spans.append((tok, f"step {s.step}: {role}", f"background:{color};{deco}"))
            count += 1
    pieces = token_pieces(run.text(tok) for tok, _, _ in spans)
    body = "".join(f'<span title="{html.escape(f"{title}, token {tok}")}" style="{style}">{html.escape(piece)}</span>'
                   for (tok, title, style), piece in zip(spans, pieces)).replace("\n", "<br>")
    return (f'<div style="font-family:monospace;white-space:pre-wrap;line-height:1.6">'
            f"<b>{html.escape(meta.get('prompt') or '(prompt not recorded)')}</b><br>{body}</div>")
