"""The top-k / top-p / budget tuner: re-analyse a recorded run under other parameters.

Sliders for temperature, top-k, top-p, min-p and the budget ``B' <= B`` drive
:meth:`ddtree_lab.analysis.TunerData.analyse` on a recorded run (trace format v2): per step and
on average the exact expected tau (accepted draft tokens + bonus) under the target-only rule,
the target mass the tree covers at each depth, and the selected step's tree with each node's
target probability and reach probability -- all from the trace, no model. Where the trace's
top-M logits do not determine a value, the interval the stored data allow is shown.

A "run live" button calls a function the notebook passes in (``live(params, budget) ->
Run | list of Step``); the widget never touches a model. It then shows the observed
tau of the new run beside the tau predicted from the recording.

The selected step is chosen as in the verify stepper: a ``request`` dropdown, then a ``step``
slider over that request's recorded steps (its value is the step's position in the request).
The per-step chart marks the selected step in red and separates the requests; its y axis is
fixed at the largest possible τ (deepest tree + 1), so bars compare across settings.

Discoverable for browser tests: slider descriptions ``temperature``, ``top-k``, ``top-p``,
``min-p``, ``budget B'``, ``step`` (CSS classes ``ddtree-tuner-<name>``, the dropdown
``ddtree-tuner-request``); the per-step chart's SVG has class ``ddtree-tuner-per-step`` and
names the selected packed step in ``data-selected``; the mean expected tau is the text of an ``HTML`` widget with
CSS class ``ddtree-expected-tau``, equal to :func:`expected_tau_text` for the same settings.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Callable

from .. import analysis
from ..analysis import TunerData, TunerResult
from ..sampling import SamplingParams
from ..step import Run
from .layout import slider_kwargs, wrap_row

__all__ = ["TunerState", "Tuner", "expected_tau_text", "params_from_controls", "reach_tree_dot", "bars_svg",
           "CHART_FONT_PX"]

EXPECTED_TAU_CLASS = "ddtree-expected-tau"
#: the box the selected step's tree scrolls in (its own scrollbars, at most 720 px high).
TREE_CLASS = "ddtree-tuner-tree"


def params_from_controls(temperature: float, top_k: int, top_p: float, min_p: float) -> SamplingParams:
    """The :class:`SamplingParams` a slider position means (``top_k = 0`` and ``min_p = 0``: off)."""
    return SamplingParams(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p),
                          min_p=float(min_p) if min_p else None)


def _interval_text(lo: float, hi: float, digits: int = 3) -> str:
    """``x`` when the interval is a point at ``digits`` decimals, else ``mid ± half``."""
    mid, half = (lo + hi) / 2, (hi - lo) / 2
    if half < 0.5 * 10 ** -digits:
        return f"{mid:.{digits}f}"
    return f"{mid:.{digits}f} ± {half:.{digits}f}"


def _prob_text(lo: float, hi: float) -> str:
    """A probability to 3 significant digits, or the interval ``[lo, hi]`` when its ends differ
    at 3 significant digits."""
    a, b = f"{lo:.3g}", f"{hi:.3g}"
    return a if a == b else f"[{a}, {b}]"


def expected_tau_text(result_or_data: TunerResult | TunerData | Run, params: SamplingParams | None = None,
                      budget: int | None = None) -> str:
    """The mean expected tau over the packed steps as the tuner displays it: ``"2.345"``, or
    ``"2.345 ± 0.012"`` where the stored top-M logits do not determine it (the midpoint and
    half-width of the rigorous interval).

    Args:
        result_or_data: a :class:`TunerResult`, or :class:`TunerData` (or the recorded
            :class:`Run`) with ``params`` and ``budget`` (None: the recorded budget) to
            analyse. A browser test reading the widget's ``ddtree-expected-tau`` text compares
            it with ``expected_tau_text(run, params_from_controls(T, k, p, min_p), budget)``.
    """
    if isinstance(result_or_data, Run):
        result_or_data = TunerData.from_run(result_or_data)
    if isinstance(result_or_data, TunerData):
        if params is None:
            raise ValueError("params are required with TunerData")
        result_or_data = result_or_data.analyse(params, budget)
    lo, hi = result_or_data.mean_tau
    return _interval_text(lo, hi)


#: the font size in px of the tuner's charts (issue 34.8: 10 px SVG text read as ~8 px)
CHART_FONT_PX = 12


def bars_svg(values_lo, values_hi, labels, title: str, width: int = 640, height: int = 160, ymax: float | None = None,
             highlight: int | None = None, css_class: str = "", groups: list[tuple[int, int, str]] | None = None,
             x_title: str = "", ymin: float = 0.0, selected: int | None = None) -> str:
    """A small bar chart as inline SVG: bars at the interval midpoints, whiskers where
    ``hi > lo``; ``highlight`` marks one bar (red, with a ``data-selected`` attribute naming
    ``selected``, default ``highlight``). ``ymax``: a fixed top of the y axis (None: the
    largest value), so charts of different settings compare by eye. ``groups``: ``(first, end, label)`` bar ranges (e.g. one
    per request) separated by vertical lines and labelled under the axis; without groups every
    bar is labelled when there are at most 20, else every ``n // 10``-th."""
    lo, hi = [float(v) for v in values_lo], [float(v) for v in values_hi]
    n = max(len(lo), 1)
    top = ymax if ymax is not None else max(hi + [1e-9])
    pad_l, pad_b, pad_t = 44, 36 if (groups or x_title) else 22, 22
    w = (width - pad_l - 4) / n
    h = height - pad_b - pad_t
    span = max(top - ymin, 1e-12)

    def y(v: float) -> float:
        return pad_t + h - h * min(max((v - ymin) / span, 0.0), 1.0)

    selected = highlight if selected is None else selected
    sel = f' data-selected="{int(selected)}"' if selected is not None else ""
    parts = [f'<svg class="{css_class}"{sel} width="{width}" height="{height}" xmlns="http://www.w3.org/2000/svg" '
             f'style="font:{CHART_FONT_PX}px sans-serif">', f'<text x="{pad_l}" y="14">{html.escape(title)}</text>',
             f'<text x="2" y="{pad_t + 10}">{top:.3g}</text><text x="2" y="{pad_t + h}">{ymin:.3g}</text>',
             f'<line x1="{pad_l}" y1="{pad_t + h}" x2="{width - 4}" y2="{pad_t + h}" stroke="#999"/>']
    for k, (a, b) in enumerate(zip(lo, hi)):
        mid = (a + b) / 2
        x = pad_l + k * w
        bh = pad_t + h - y(mid)
        color = "#b3261e" if k == highlight else "#1f77b4"
        mark = ' class="ddtree-selected-bar"' if k == highlight else ""
        parts.append(f'<rect{mark} x="{x + 0.1 * w:.1f}" y="{y(mid):.1f}" width="{max(0.8 * w, 1):.1f}" '
                     f'height="{bh:.1f}" fill="{color}"><title>{html.escape(str(labels[k]))}: '
                     f'{html.escape(_interval_text(a, b))}</title></rect>')
        if b - a > 1e-9:
            parts.append(f'<line x1="{x + 0.5 * w:.1f}" y1="{y(a):.1f}" x2="{x + 0.5 * w:.1f}" y2="{y(b):.1f}" '
                         f'stroke="#000" stroke-width="1"/>')
    if groups:
        for first, end, lab in groups:
            x0, x1 = pad_l + first * w, pad_l + end * w
            if first:
                parts.append(f'<line x1="{x0:.1f}" y1="{pad_t}" x2="{x0:.1f}" y2="{pad_t + h + 4}" stroke="#616161" '
                             'stroke-dasharray="3,2"/>')
            parts.append(f'<text x="{(x0 + x1) / 2:.1f}" y="{height - 19}" text-anchor="middle">'
                         f"{html.escape(lab)}</text>")
    else:
        every = 1 if n <= 20 else max(n // 10, 1)
        for k, lab in enumerate(labels):
            if k % every == 0:
                parts.append(f'<text x="{pad_l + (k + 0.5) * w:.1f}" y="{pad_t + h + 15}" text-anchor="middle">'
                             f"{html.escape(str(lab))}</text>")
    if x_title:
        parts.append(f'<text x="{pad_l + (width - pad_l) / 2:.1f}" y="{height - 3}" text-anchor="middle" '
                     f'fill="#616161">{html.escape(x_title)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _short_prob(lo: float, hi: float) -> str:
    """A node label's probability at 2 significant digits: ``0.12``, or ``0.12±0.01`` where the
    stored top-M logits leave an interval wider than that rounding (the tooltip has both ends)."""
    a, b = f"{lo:.2g}", f"{hi:.2g}"
    return a if a == b else f"{(lo + hi) / 2:.2g}±{(hi - lo) / 2:.1g}"


def reach_tree_dot(data: TunerData, result: TunerResult, k: int, texts=None, max_children: int | None = 12) -> str:
    """DOT source of packed step ``k``'s tree of budget ``B'``, drawn as every other view draws
    a tree (:mod:`ddtree_lab.views.dot`: left to right, ``#index 'token'``, the same fonts,
    colours and edges): each node's target p in its parent's row and its reach probability
    (the chance the walk accepts it) under the analysed parameters, at 2 significant digits
    (``mid±half`` where the trace's top-M logits leave an interval; both ends in the tooltip);
    fill darkness follows the reach probability; nodes beyond ``B'`` are left out. A parent
    draws at most ``max_children`` children (None: all); the rest and their subtrees become one
    grey note with their count and total reach."""
    from .dot import STATUS_STYLE
    from ..labels import shared_text_ids, token_label
    from .model import text_lookup

    def esc(text: str) -> str:
        return text.replace("&", "&amp;").replace("\\", "\\\\").replace('"', '\\"')

    def attrs(style: dict) -> str:
        return ", ".join(f'{a}="{v}"' for a, v in style.items())

    lookup = text_lookup(texts)
    step = data.steps[k]
    sl = data.step_nodes(k)
    n = min(step.num_nodes, result.budget + 1)
    tokens = [int(t) for t in step.node_token_ids[:n]]
    shared = shared_text_ids(tokens, lookup)
    tau = _interval_text(float(result.expected_lo[k]) + 1, float(result.expected_hi[k]) + 1)
    title = (f"step {step.step} · request {step.request_id} · {analysis.setting_label(result.params)} · "
             f"B'={n - 1} · expected τ = {tau}")
    legend = "#: node index · p: target p under these parameters · reach: the chance the walk accepts the node"
    lines = ["digraph reach {",
             '  graph [rankdir=LR, ordering=out, nodesep=0.04, ranksep=0.22, fontname="Helvetica",',
             f'         label="{esc(title)}\\n{esc(legend)}", labelloc=t, labeljust=l, fontsize=11];',
             '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10, margin="0.04,0.02", '
             'height=0.3];',
             "  edge [arrowsize=0.5];"]
    shown = set(range(n))
    notes = []  # (parent, hidden count, reach lo, reach hi)
    if max_children is not None:
        kids: dict[int, list[int]] = {}
        for i in range(1, n):
            kids.setdefault(int(step.parents[i]), []).append(i)
        for parent in sorted(kids):
            extra = kids[parent][max_children:]
            if parent not in shown or not extra:
                continue
            hidden, stack = [], list(extra)
            while stack:
                j = stack.pop()
                hidden.append(j)
                stack.extend(kids.get(j, []))
            shown -= set(hidden)
            notes.append((parent, len(hidden), sum(float(result.reach_lo[sl.start + j]) for j in hidden),
                          sum(float(result.reach_hi[sl.start + j]) for j in hidden)))
    for i in sorted(shown):
        g = sl.start + i
        head = esc(f"#{i} {token_label(lookup(tokens[i]), tokens[i], shared=tokens[i] in shared)}")
        if i == 0:
            lines.append(f'  n0 [label="{head}\\nroot", tooltip="node 0 (root / anchor)", '
                         f'{attrs(STATUS_STYLE["root"])}];')
            continue
        rlo, rhi = float(result.reach_lo[g]), float(result.reach_hi[g])
        plo, phi = float(result.node_lo[g]), float(result.node_hi[g])
        shade = int(245 - 150 * min(max((rlo + rhi) / 2, 0.0), 1.0))
        style = dict(STATUS_STYLE["unvisited"], style="rounded,filled", fillcolor=f"#{shade:02x}{min(shade + 10, 255):02x}{shade:02x}")
        if shade < 170:
            style["fontcolor"] = "#212121"
        tip = (f"node {i} · depth {int(step.depths[i])} · target p in [{plo:.4g}, {phi:.4g}] · "
               f"reach in [{rlo:.4g}, {rhi:.4g}]")
        lines.append(f'  n{i} [label="{head}\\np={_short_prob(plo, phi)} reach={_short_prob(rlo, rhi)}", '
                     f'tooltip="{esc(tip)}", {attrs(style)}];')
    for i in sorted(shown - {0}):
        lines.append(f'  n{int(step.parents[i])} -> n{i} [color="#bdbdbd"];')
    for m, (parent, count, rlo, rhi) in enumerate(notes, 1):
        lines.append(f'  c{m} [label="+{count} more\\ntotal reach={_short_prob(rlo, rhi)}", '
                     f'{attrs(STATUS_STYLE["collapsed"])}, style="filled"];')
        lines.append(f'  n{parent} -> c{m} [color="#bdbdbd"];')
    lines.append("}")
    return "\n".join(lines) + "\n"


@dataclass
class TunerState:
    """The tuner's state without widgets: packed data, the chosen parameters and step.

    Attributes:
        data: :class:`TunerData` of the recorded run.
        temperature, top_k, top_p, min_p, budget, step: the controls (``top_k = 0``,
            ``min_p = 0``: off; ``step``: packed step index, set through :meth:`select`).
    """

    data: TunerData
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    budget: int
    step: int = 0

    @classmethod
    def from_run(cls, run: Run) -> "TunerState":
        """Start from the run's first step's recorded parameters and its largest budget."""
        data = TunerData.from_run(run)
        p = data.steps[0].params
        return cls(data, p.temperature, p.top_k, p.top_p, p.min_p or 0.0, int(data.recorded_budget.max()))

    @property
    def params(self) -> SamplingParams:
        return params_from_controls(self.temperature, self.top_k, self.top_p, self.min_p)

    @property
    def requests(self) -> list[int]:
        """The recorded requests (batch indices), ascending."""
        return sorted({int(s.request) for s in self.data.steps})

    def steps_of(self, request: int) -> list[int]:
        """The packed indices of ``request``'s steps, in recorded order. Raises ``ValueError``
        naming the recorded requests when it has none."""
        out = [k for k, s in enumerate(self.data.steps) if int(s.request) == int(request)]
        if not out:
            raise ValueError(f"request {request} has no recorded steps (requests: {self.requests})")
        return out

    @property
    def request(self) -> int:
        """The selected step's request."""
        return int(self.data.steps[self.step].request)

    @property
    def position(self) -> int:
        """The selected step's position among its request's recorded steps."""
        return self.steps_of(self.request).index(self.step)

    def select(self, request: int, position: int) -> None:
        """Select ``request``'s ``position``-th recorded step (the stepper's request + step
        controls). Raises ``ValueError`` naming the valid range."""
        ks = self.steps_of(request)
        if not 0 <= position < len(ks):
            raise ValueError(f"step position {position} is outside 0..{len(ks) - 1} (request {request})")
        self.step = ks[position]

    def chart_order(self) -> list[int]:
        """The packed step indices request by request (each request's steps in recorded order):
        the per-step chart's x order, so each request is one run of bars."""
        return [k for r in self.requests for k in self.steps_of(r)]

    def groups(self) -> list[tuple[int, int, str]]:
        """``(first, end, "req ID")``: each request's run of bars in :meth:`chart_order`."""
        out, first = [], 0
        for r in self.requests:
            ks = self.steps_of(r)
            out.append((first, first + len(ks), f"req {self.data.steps[ks[0]].request_id}"))
            first += len(ks)
        return out

    def result(self) -> TunerResult:
        return self.data.analyse(self.params, self.budget)

    def expected_tau_text(self) -> str:
        return expected_tau_text(self.result())


class Tuner:
    """The ipywidgets tuner over a recorded run (module docstring).

    Args:
        run: a :class:`Run` in trace format v2.
        live: optional ``live(params, budget) -> Run | list[Step]`` behind the "run
            live" button.

    Attributes:
        temperature, top_k, top_p, min_p, budget: the sliders; request, step: the request
            dropdown and the slider over its recorded steps; expected_tau: the HTML
        widget (class ``ddtree-expected-tau``); widget: the whole view (a VBox).

    Raises:
        ValueError: the run is not trace format v2.
    """

    def __init__(self, run: Run, live: Callable | None = None):
        import ipywidgets as w

        self.run = run
        self.state = TunerState.from_run(run)
        self.live = live
        st, data = self.state, self.state.data
        # every slider keeps a track a mouse can drag (a fixed width that never shrinks: views.layout)
        cu = {"continuous_update": False, **slider_kwargs("420px", "90px")}
        self.temperature = w.FloatSlider(value=st.temperature, min=0.0, max=2.0, step=0.05, description="temperature",
                                         readout_format=".2f", **cu)
        self.top_k = w.IntSlider(value=st.top_k, min=0, max=max(200, st.top_k), description="top-k", **cu)
        self.top_p = w.FloatSlider(value=st.top_p, min=0.05, max=1.0, step=0.05, description="top-p",
                                   readout_format=".2f", **cu)
        self.min_p = w.FloatSlider(value=st.min_p, min=0.0, max=0.5, step=0.01, description="min-p",
                                   readout_format=".2f", **cu)
        self.budget = w.IntSlider(value=st.budget, min=0, max=int(data.recorded_budget.max()), description="budget B'",
                                  **cu)
        # the stepper's controls: a request, then a step among that request's recorded steps
        self.request = w.Dropdown(options=[(f"request {data.steps[st.steps_of(r)[0]].request_id}", r)
                                           for r in st.requests], value=st.request, description="request",
                                  style=cu["style"], layout={"width": "420px"})
        self.step = w.IntSlider(value=st.position, min=0, max=len(st.steps_of(st.request)) - 1, description="step",
                                **cu)
        for s, cls in ((self.temperature, "temperature"), (self.top_k, "top-k"), (self.top_p, "top-p"),
                       (self.min_p, "min-p"), (self.budget, "budget"), (self.step, "step"),
                       (self.request, "request")):
            s.add_class(f"ddtree-tuner-{cls}")
        self.expected_tau = w.HTML()
        self.expected_tau.add_class(EXPECTED_TAU_CLASS)
        self.summary = w.HTML()
        self.per_step = w.HTML()
        self.cover = w.HTML()
        self.step_cover = w.HTML()
        # the tree scrolls in its own box (both ways), so a wide or deep tree never widens the tuner
        self.tree = w.HTML(layout=w.Layout(width="100%"))
        self.params_note = w.HTML()
        self.params_note.add_class("ddtree-tuner-params-note")
        self.live_button = w.Button(description="run live with these parameters", disabled=live is None,
                                    layout={"width": "260px"})
        self.live_button.add_class("ddtree-tuner-live")
        self.live_out = w.HTML()
        self.live_out.add_class("ddtree-tuner-live-result")
        for s in (self.temperature, self.top_k, self.top_p, self.min_p, self.budget):
            s.observe(self._on_params, names="value")
        self.step.observe(self._on_step, names="value")
        self.request.observe(self._on_request, names="value")
        self.live_button.on_click(self._on_live)
        self.result: TunerResult | None = None
        self._update()
        head = w.HTML("<b>expected τ (mean over the recorded steps, target-only rule):</b>&nbsp;")
        self.widget = w.VBox([
            w.HBox([w.VBox([self.temperature, self.top_k, self.top_p, self.min_p, self.params_note]),
                    w.VBox([self.budget, self.request, self.step])], layout=wrap_row()),
            w.HBox([head, self.expected_tau]), self.summary, self.per_step, self.cover, self.step_cover,
            self.tree,
            w.HBox([self.live_button]), self.live_out])

    def _ipython_display_(self):  # pragma: no cover - notebook display
        from IPython.display import display

        display(self.widget)

    def _sync(self) -> None:
        st = self.state
        st.temperature, st.top_k, st.top_p = self.temperature.value, self.top_k.value, self.top_p.value
        st.min_p, st.budget = self.min_p.value, self.budget.value
        request = self.request.value
        assert request is not None  # the dropdown always has one of its options selected
        st.select(request, self.step.value)

    def _on_params(self, change=None) -> None:
        self._update()

    def _on_step(self, change=None) -> None:
        if getattr(self, "_moving", False):
            return
        self._sync()
        self._draw_step()

    def _on_request(self, change=None) -> None:
        self._moving = True  # one redraw: the step slider's range and value change with the request
        try:
            request = self.request.value
            assert request is not None  # the dropdown always has one of its options selected
            self.step.max = len(self.state.steps_of(request)) - 1
            self.step.value = 0
        finally:
            self._moving = False
        self._on_step()

    def _update(self) -> None:
        self._sync()
        self._disable_idle_sliders()
        st = self.state
        self.result = res = st.result()
        self.expected_tau.value = expected_tau_text(res)
        lo, hi = res.mean_expected
        exact = res.max_error < 5e-4
        recorded = [s.params for s in st.data.steps]
        observed = float(st.data.observed.double().mean()) + 1
        self.summary.value = (
            f"<div>{html.escape(analysis.setting_label(res.params))}, B' = {res.budget}: mean expected accepted draft "
            f"tokens {html.escape(_interval_text(lo, hi))} over {st.data.num_steps} steps; "
            + ("exact (the stored top-M logits determine it)" if exact else
               f"<span style='color:#b3261e'>bounded: the largest per-step interval is ±{res.max_error:.3f} "
               "(the value depends on logits outside the stored top-M)</span>")
            + f". Recorded run: {html.escape(analysis.setting_label(recorded[0]))}, observed mean τ {observed:.3f}.</div>")
        clo, chi = res.mean_cover
        self.cover.value = bars_svg(clo.tolist(), chi.tolist(), [str(d + 1) for d in range(clo.shape[0])],
                                    "target mass the tree covers at each depth (mean over steps)", ymax=1.0,
                                    css_class="ddtree-tuner-cover")
        self._draw_step()

    def _disable_idle_sliders(self) -> None:
        """Sliders that change nothing are off, with the reason beside them (and as their
        tooltip): at temperature 0 (greedy: the argmax) top-k, top-p and min-p; at top-k = 1 at
        a temperature above 0 (only the argmax survives the cut) temperature, top-p and min-p."""
        greedy = self.temperature.value == 0
        one_token = not greedy and self.top_k.value == 1
        if greedy:
            idle, why = (self.top_k, self.top_p, self.min_p), "temperature 0 is greedy (the argmax)"
        elif one_token:
            idle, why = (self.temperature, self.top_p, self.min_p), "top-k = 1 keeps only the argmax"
        else:
            idle, why = (), ""
        names = {self.temperature: "temperature", self.top_k: "top-k", self.top_p: "top-p", self.min_p: "min-p"}
        for s in names:
            s.disabled = s in idle
            s.tooltip = f"no effect: {why}" if s in idle else None
        self.params_note.value = ("" if not idle else
                                  f'<span style="color:#616161;font-size:12px">{html.escape(why)}: '
                                  f"{', '.join(names[s] for s in idle)} change nothing (off)</span>")

    def _draw_step(self) -> None:
        from .dot import render_svg

        st = self.state
        k = st.step
        res = self.result
        assert res is not None  # __init__ ran _update
        s = st.data.steps[k]
        order = st.chart_order()
        labels = [f"step {st.data.steps[j].step} / req {st.data.steps[j].request_id}" for j in order]
        lo, hi = (res.expected_lo + 1).tolist(), (res.expected_hi + 1).tolist()
        # the y axis is fixed at the deepest tree + 1 (the largest possible τ) so bars compare across settings
        self.per_step.value = bars_svg([lo[j] for j in order], [hi[j] for j in order], labels,
                                       f"expected τ per recorded step (red: step {s.step} of request {s.request_id})",
                                       ymax=float(st.data.max_depth + 1), highlight=order.index(k), selected=k,
                                       groups=st.groups(), x_title="recorded steps, request by request",
                                       css_class="ddtree-tuner-per-step")
        self.step_cover.value = bars_svg(res.cover_lo[k].tolist(), res.cover_hi[k].tolist(),
                                         [str(d + 1) for d in range(res.cover_lo.shape[1])],
                                         f"step {s.step} / request {s.request_id}: target mass covered at each depth",
                                         ymax=1.0, css_class="ddtree-tuner-step-cover")
        svg = render_svg(reach_tree_dot(self.state.data, res, k, self.run))
        svg = svg.replace("<svg ", '<svg style="max-width:none" ', 1)  # never shrunk to fit: its box scrolls
        self.tree.value = (f'<div class="{TREE_CLASS}" style="overflow:auto;max-width:100%;max-height:720px;'
                           f'border:1px solid #ddd">{svg}</div>')

    def _on_live(self, button=None) -> None:
        if self.live is None:
            return
        params, budget = self.state.params, self.state.budget
        self.live_out.value = "running live…"
        try:
            got = self.live(params, budget)
        except Exception as exc:  # shown to the user, not swallowed
            self.live_out.value = f"<span style='color:#b3261e'>live run failed: {html.escape(repr(exc))}</span>"
            raise
        steps = list(got.steps if isinstance(got, Run) else got)
        assert self.result is not None  # __init__ ran _update
        self.live_out.value = live_comparison_html(steps, self.result)


def live_comparison_html(steps, predicted: TunerResult) -> str:
    """Observed mean tau of a live run beside the tau predicted from the recording."""
    if not steps:
        return "live run produced no steps"
    obs = sum(analysis.tau(s) for s in steps) / len(steps)
    exact = sum(analysis.expected_accept_length(s) for s in steps) / len(steps) + 1
    lo, hi = predicted.mean_tau
    return (f'<div class="ddtree-tuner-live-text">live run ({len(steps)} steps, '
            f"{html.escape(analysis.setting_label(predicted.params))}, B' = {predicted.budget}): observed mean τ "
            f"<b>{obs:.3f}</b>, its trees' exact expected τ {exact:.3f}; predicted from the recording "
            f"<b>{html.escape(_interval_text(lo, hi))}</b></div>")
