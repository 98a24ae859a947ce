"""Notebook helpers: the calls the notebooks in ``labs/`` make (no logic lives in cells).

Everything here reads :class:`ddtree_lab.step.Run` records; model loading lives in
:mod:`ddtree_lab.models.loading` (:func:`load_default` is re-exported for the notebooks).
"""

from __future__ import annotations

import html

from .models.loading import DEFAULT_DRAFTER, drafter_exists, load_default, load_drafter
from .step import Run, Step
from .verify.types import VerifyOutput
from .views import committed_html, decisions_table_html, step_svg, step_view, to_text

__all__ = ["DEFAULT_DRAFTER", "drafter_exists", "load_default", "load_drafter", "show_step", "show_steps", "show_text", "step_browser",
           "decisions_html", "summary", "summary_html", "params_text", "table_html", "step_text", "verify_stepper", "live_more", "fixture_trace"]


def _display(obj) -> None:
    from IPython.display import display

    display(obj)


def show_step(run: Run, step_index: int, collapse_unvisited: bool = True) -> None:
    """Display one recorded step's tree (SVG) in a notebook (unvisited subtrees collapsed, at
    most ``views.pick.WIDE_FAN`` children drawn per parent)."""
    from IPython.display import SVG

    from .views.pick import WIDE_FAN

    _display(SVG(step_svg(run.steps[step_index], run, collapse_unvisited, max_children=WIDE_FAN)))


def show_steps(run: Run, request: int = 0, limit: int | None = None, collapse_unvisited: bool = True) -> None:
    """Display the trees of a request's steps, in order (the first ``limit`` when given; at
    most ``views.pick.WIDE_FAN`` children drawn per parent)."""
    from IPython.display import SVG

    from .views.pick import WIDE_FAN

    for s in run.for_request(request)[:limit]:
        _display(SVG(step_svg(s, run, collapse_unvisited, max_children=WIDE_FAN)))


def show_text(run: Run, request: int = 0) -> None:
    """Display the request's generated text coloured by step (bonus tokens underlined)."""
    from IPython.display import HTML

    _display(HTML(committed_html(run, request)))


def step_browser(run: Run, request: int = 0, position: int | None = None):
    """An ipywidgets slider over a request's steps showing each tree (at most
    ``views.pick.WIDE_FAN`` children per parent) and its decision log; it opens on
    ``position`` (None: the request's most informative step, :func:`ddtree_lab.views.informative_step`)."""
    import ipywidgets as widgets

    from .views.pick import WIDE_FAN, informative_step

    steps = run.for_request(request)
    if not steps:
        raise ValueError(f"request {request} has no recorded steps")
    if position is None:
        position = steps.index(informative_step(run, request))
    if not 0 <= position < len(steps):
        raise ValueError(f"step position {position} is outside 0..{len(steps) - 1} (request {request})")
    from .views.layout import slider_kwargs

    slider = widgets.IntSlider(value=position, min=0, max=len(steps) - 1, description="step", continuous_update=False,
                               **slider_kwargs("480px", "50px"))
    picture = widgets.HTML()
    log = widgets.HTML()

    def draw(change=None) -> None:
        s = steps[slider.value]
        picture.value = step_svg(s, run, collapse_unvisited=True, max_children=WIDE_FAN)
        log.value = decisions_html(run, s)

    slider.observe(draw, names="value")
    draw()
    return widgets.VBox([slider, picture, log])


def decisions_html(run: Run, step) -> str:
    """A step's decision log as an HTML table (:func:`ddtree_lab.views.decisions_table_html`
    of its :class:`ddtree_lab.views.StepView`): sampled steps show target p, ``S_k`` and the
    coin; greedy steps target p (softmax of the raw logits) and the argmax comparison."""
    return decisions_table_html(step_view(step, run))


def _output(s: Step) -> VerifyOutput:
    if s.output is None:
        raise ValueError(f"step {s.step}, request {s.request}: no recorded output (did not return?): no tau")
    return s.output


def summary(run: Run) -> list[dict]:
    """Per request: steps, generated tokens, mean accept length τ (accepted draft + bonus)."""
    rows = []
    for r in run.metadata["requests"]:
        steps = run.for_request(r["request"])
        accepted = [s.accept_length for s in steps]
        tau = [a + (0 if bool(_output(s).support_exhausted[0]) else 1) for a, s in zip(accepted, steps)]
        rows.append({"request": r["request_id"], "params": r["params"], "steps": len(steps),
                     "generated": len(r["generated_token_ids"]), "finish": r["finish_reason"],
                     "mean_tau": round(sum(tau) / len(tau), 3) if tau else None})
    return rows


def params_text(params) -> str:
    """A request's sampling parameters as the lab writes them (issue 34.8: not a raw dict):
    :meth:`SamplingParams.label` (``"greedy"``, ``"T=0.8 top-p=0.9"``, filters that are off left
    out) and the seed, e.g. ``"T=0.8 · seed 7"``. ``params``: a :class:`SamplingParams`, its
    ``to_dict()`` (as a trace's metadata holds it) or None (``"not recorded"``).

    Raises:
        ValueError: a dict :meth:`SamplingParams.from_dict` does not read (naming the key).
    """
    from .sampling import SamplingParams, param_is_off

    if params is None:
        return "not recorded"
    if isinstance(params, dict):
        params = SamplingParams.from_dict(params)
    text = params.label()
    if params.seed is not None and not params.is_greedy:  # a greedy request draws no coin: its seed is unused
        text += f" · seed {params.seed}"
    if not params.is_greedy and not param_is_off("order", params.order):
        text += f" · order {params.order}"
    return text


def summary_html(run: Run) -> str:
    """:func:`summary` as an HTML table; the parameters as :func:`params_text` writes them."""
    rows = summary(run)
    head = "".join(f"<th>{k}</th>" for k in rows[0]) if rows else ""
    body = "".join("<tr>" + "".join(f"<td>{html.escape(params_text(v) if k == 'params' else str(v))}</td>"
                                    for k, v in r.items()) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def table_html(head: list[str], rows: list[list], css_class: str = "ddtree-table") -> str:
    """A table as HTML whose rows never wrap: cells stay on one line and the box scrolls
    sideways when the table is wider than the page. Every cell is HTML-escaped.

    Raises:
        ValueError: a row whose length differs from ``head``'s (naming the row).
    """
    for k, r in enumerate(rows):
        if len(r) != len(head):
            raise ValueError(f"row {k} has {len(r)} cells for {len(head)} columns")
    cell = 'style="padding:1px 8px;white-space:nowrap;text-align:left;font-family:monospace"'
    th = "".join(f"<th {cell}>{html.escape(str(h))}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td {cell}>{html.escape(str(v))}</td>" for v in r) + "</tr>" for r in rows)
    return (f'<div style="overflow-x:auto;max-width:100%"><table class="{html.escape(css_class)}" '
            f'style="border-collapse:collapse;width:max-content"><tr>{th}</tr>{body}</table></div>')


def step_text(run: Run, step_index: int) -> str:
    """The plain-text tree of one recorded step."""
    return to_text(step_view(run.steps[step_index], run))


def fixture_trace(name: str = "smollm2_t08_b32") -> Run:
    """A recorded run shipped in ``fixtures/traces/`` (``smollm2_greedy_b32``, ``smollm2_t08_b32``).

    Raises:
        FileNotFoundError: no such fixture (the message lists the ones there are).
    """
    from pathlib import Path

    from .io import load_trace

    folder = Path(__file__).resolve().parent.parent / "fixtures" / "traces"
    path = folder / f"{name}.ddtrace.safetensors"
    if not path.exists():
        have = sorted(p.name.removesuffix(".ddtrace.safetensors") for p in folder.glob("*.ddtrace.safetensors"))
        raise FileNotFoundError(f"no fixture trace {name!r} in {folder} (there are: {have})")
    return load_trace(path)


def live_more(session, max_new_tokens: int):
    """A callable for :func:`verify_stepper`'s live button: one more step of ``session`` (a
    started :class:`ddtree_lab.LiveSession`) up to ``max_new_tokens`` per request, then the
    run so far. The stepper calls it; the stepper itself never touches the model."""
    def more() -> Run:
        session.step(max_new_tokens)
        return session.trace()

    return more


def verify_stepper(run: Run, request: int | None = None, step: int = 0, more=None,
                   collapse_unvisited: bool = True):
    """The verify stepper widget (:class:`ddtree_lab.views.VerifyStepper`) on ``run``; display
    it as a cell's last value. ``more``: see :func:`live_more`."""
    from .views import VerifyStepper

    return VerifyStepper(run, request=request, step=step, more=more, collapse_unvisited=collapse_unvisited)
