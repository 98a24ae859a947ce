"""The verify stepper: walk a recorded step decision by decision (ipywidgets).

Controls: a request selector and a step slider (which recorded step), first / previous / next
/ last decision buttons and a decision slider (the cursor ``k``: the first ``k`` walk events
have happened, see :meth:`ddtree_lab.views.StepView.at`). At each cursor it shows the tree
(the node the walk stands on with an orange border, the node of the last event yellow, judged
siblings red or green, nodes not judged yet dotted), the verdict sentence, the children of
the current node in sibling order with their target p, cumulative-mass segment, exact accept
p and path p, the cumulative-mass bar with the coin, and at the end the bonus draw (the row's
top tokens with the rejected siblings struck out, residual mass, coin, chosen token). Greedy
steps show the argmax comparison instead of coins.

What-if: a coin slider for the current node re-runs the pure verifier on the step with that
coin (:func:`what_if`); the answer shows beside the slider and the what-if walk is drawn on
the tree in purple. The slider snaps to the current node's segments (one stop at the middle
of each child's segment ``[S_k-1, S_k)``, one in the residual, one at the recorded coin), so a
segment 0.0004 wide is one drag stop away; :meth:`VerifyStepper.set_coin` takes any coin. At
a leaf no coin decides anything (the bonus uses the final coin): the slider is disabled. Live: given ``more`` (a
callable the notebook builds around a :class:`ddtree_lab.LiveSession` that returns the
updated :class:`ddtree_lab.step.Run`), a button runs one more step and shows it. The
stepper itself never touches a model.

All state lives in :class:`VerifyStepper` (plain attributes and methods: ``next()``,
``set_step()``, ``set_coin()`` ...); the widgets call those methods, so tests drive the
state without a browser.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass
from typing import Callable

from ..step import Run, Step
from .dot import render_svg, to_dot
from .html import bonus_html, children_html, decisions_table_html, mass_bar_svg, missing_note_html, segments
from .layout import note_layout, slider_kwargs, wrap_row
from .model import Cursor, StepView, step_view

__all__ = ["VerifyStepper", "WhatIf", "what_if"]


@dataclass
class WhatIf:
    """The walk of a step re-run with one node's coin replaced.

    ``path``: root and accepted nodes; ``tokens``: the accepted draft tokens; ``bonus_node``:
    where the bonus would be drawn; ``same_path``: the path equals the recorded one (then the
    recorded bonus draw stands). The bonus token of a different path is not recomputed: the
    trace stores that node's row only as its top-M tokens.
    """

    node: int
    coin: float
    path: list[int]
    tokens: list[int]
    bonus_node: int
    same_path: bool


def what_if(step: Step, node: int, coin: float) -> WhatIf:
    """Re-run the reference verifier (:func:`ddtree_lab.verify_sampled`) on ``step`` with the
    coin of ``node`` (the coin deciding among its children) set to ``coin``.

    Exact for any coins: the walk reads only each child's target p in its parent's row, which
    the trace stores for every node (``child_probs``).

    Raises:
        ValueError: a greedy step (no coins), ``node`` not in the tree, or ``coin`` outside [0, 1).
    """
    from ..verify import walk_request

    params, stored_coins, tokens = step.params, step.coins, step.node_token_ids
    if params is None:
        raise ValueError(f"step {step.step}, request {step.request} ({step.source}): no sampling parameters recorded "
                         "(a greedy step has no coins)")
    if params.is_greedy:
        raise ValueError(f"step {step.step}, request {step.request}: greedy steps have no coins (the walk follows the argmax)")
    if not 0 <= node < step.num_nodes:
        raise ValueError(f"node {node} is not in the tree (nodes 0..{step.num_nodes - 1})")
    if not 0.0 <= coin < 1.0:
        raise ValueError(f"coin {coin} is not in [0, 1)")
    if stored_coins is None or tokens is None:
        raise ValueError(f"step {step.step}, request {step.request}: recorded at level {step.level!r} ({step.source}), "
                         "it stores no coins or tree to re-walk")
    coins = stored_coins.clone()[None]
    coins[0, node] = coin
    # the pure what-if walk over the stored child probabilities (ddtree_lab.walk_request)
    events = walk_request(step.retrieve_next_token, step.retrieve_next_sibling, tokens,
                          step.child_probs, coins[0], step.final_coin)
    path = [0] + [e.node for e in events if e.kind == "move"]
    return WhatIf(node, float(coins[0, node]), path, [int(tokens[i]) for i in path[1:]], path[-1],
                  path == step.accepted_path)


class VerifyStepper:
    """State and widgets of the verify stepper (module docstring).

    Args:
        run: the recorded run (loaded or live).
        request: the request to show first (its index in the batch).
        step: position of the first step to show among the request's steps.
        more: optional callable with no arguments returning the updated :class:`Run`
            after one more live step (``None``: no live button).
        collapse_unvisited: draw the never-reached subtrees as summary nodes (default).

    Raises:
        ValueError: the run has no steps, or the request has none.
    """

    def __init__(self, run: Run, request: int | None = None, step: int = 0,
                 more: Callable[[], Run] | None = None, collapse_unvisited: bool = True):
        if not run.steps:
            raise ValueError("the run has no recorded steps")
        self.run = run
        self.more = more
        self.collapse_unvisited = collapse_unvisited
        self.request = run.steps[0].request if request is None else request
        self._check_request(self.request)
        self.position = step
        self.k = 0
        self.coin: float | None = None  # what-if coin of the current node (None: the recorded one)
        self.message = ""
        self._widgets: dict | None = None
        self._select(step)

    # -- state ---------------------------------------------------------------------------------

    @property
    def requests(self) -> list[int]:
        return sorted({s.request for s in self.run.steps})

    @property
    def steps(self) -> list[Step]:
        return self.run.for_request(self.request)

    @property
    def trace(self) -> Step:
        """The recorded step on show."""
        return self.steps[self.position]

    @property
    def _greedy(self) -> bool:
        """The step on show has no coin to change: it verifies greedily, or it records no
        sampling parameters or no coins (the DDTree reference's dumps)."""
        params = self.trace.params
        return params is None or params.is_greedy or self.trace.coins is None

    @property
    def view(self) -> StepView:
        """The full view (nothing collapsed) at the cursor: tables, bar, verdict."""
        return self._full.at(self.k)

    @property
    def picture_view(self) -> StepView:
        """The drawn view at the cursor (collapsed per ``collapse_unvisited``; a what-if path
        is never hidden)."""
        w = self.what_if()
        if w is not None and self.collapse_unvisited and not w.same_path:
            return step_view(self.trace, self.run, True, keep=w.path).at(self.k)
        return self._drawn.at(self.k)

    @property
    def is_leaf(self) -> bool:
        """The walk stands on a node with no children (no coin decides anything there)."""
        return not self.view.nodes[self.current_node].children

    def coin_choices(self) -> list[tuple[str, float]]:
        """The what-if slider's stops for the current node as ``(label, u)``, ascending: the
        middle of each child's segment ``[S_k-1, S_k)`` (label ``#child``; zero-width segments,
        p = 0, have none), the middle of the residual ``[S_n, 1)`` (``reject all``) and the
        recorded coin (``recorded``). The labels are short so the slider's readout shows them
        whole; the answer beside the slider gives ``u``. Empty for greedy steps, steps without
        recorded coins and at a leaf."""
        v = self.view
        if self._greedy or self.is_leaf:
            return []
        out = []
        segs = segments(v, self.current_node)
        for c, lo, hi in segs:
            if hi > lo:
                out.append((f"#{c}", (lo + hi) / 2))
        end = segs[-1][2] if segs else 0.0
        if end < 1.0:
            out.append(("reject all", (end + 1.0) / 2))
        u = v.nodes[self.current_node].child_coin
        if u is not None and not math.isnan(u):
            out.append(("recorded", float(u)))
        return sorted(out, key=lambda x: x[1])

    @property
    def num_events(self) -> int:
        return self._full.num_events

    @property
    def _cursor(self) -> Cursor:
        cur = self.view.cursor
        assert cur is not None  # StepView.at always sets the cursor
        return cur

    @property
    def verdict(self) -> str:
        return self._cursor.verdict

    @property
    def current_node(self) -> int:
        return self._cursor.current

    @property
    def focus(self) -> int | None:
        return self._cursor.focus

    def _check_request(self, request: int) -> None:
        if request not in {s.request for s in self.run.steps}:
            raise ValueError(f"request {request} has no recorded steps (requests: {sorted({s.request for s in self.run.steps})})")

    def _select(self, position: int) -> None:
        steps = self.steps
        if not 0 <= position < len(steps):
            raise ValueError(f"step position {position} is outside 0..{len(steps) - 1} (request {self.request})")
        self.position = position
        s = steps[position]
        self._full = step_view(s, self.run)
        self._drawn = step_view(s, self.run, self.collapse_unvisited) if self.collapse_unvisited else self._full
        self.k, self.coin = 0, None
        self._refresh()

    def go(self, k: int) -> None:
        """Put the cursor after ``k`` events (clamped to ``0..num_events``)."""
        self.k = max(0, min(int(k), self.num_events))
        self.coin = None
        self._refresh()

    def first(self) -> None:
        self.go(0)

    def prev(self) -> None:
        self.go(self.k - 1)

    def next(self) -> None:
        self.go(self.k + 1)

    def last(self) -> None:
        self.go(self.num_events)

    def set_step(self, position: int) -> None:
        """Show the request's ``position``-th recorded step, cursor at its start."""
        self._select(position)

    def set_request(self, request: int) -> None:
        """Show ``request``'s first step."""
        self._check_request(request)
        self.request = request
        self._select(0)

    def set_coin(self, coin: float | None) -> WhatIf | None:
        """What-if: the current node's coin set to ``coin`` (``None``: the recorded coin).

        Raises:
            ValueError: a coin at a leaf (no coin decides anything there; the bonus draw uses
                the final coin) or outside [0, 1) (from :func:`what_if`).
        """
        if coin is not None and not self._greedy and self.is_leaf:
            raise ValueError(f"node {self.current_node} is a leaf: no coin decides among its children "
                             "(the bonus is drawn with the final coin)")
        if coin is not None and not self._greedy:
            what_if(self.trace, self.current_node, float(coin))  # check before keeping it
        self.coin = None if coin is None else float(coin)
        self._refresh()
        return self.what_if()

    def what_if(self) -> WhatIf | None:
        """The walk with the what-if coin (``None`` when no coin is set or the step is greedy)."""
        if self.coin is None or self._greedy:
            return None
        return what_if(self.trace, self.current_node, self.coin)

    def run_more(self) -> None:
        """Live: one more step through ``more``; shows the request's newest step."""
        if self.more is None:
            raise ValueError("this stepper has no live session (pass more=... to run more steps)")
        run = self.more()
        if not isinstance(run, Run):
            raise TypeError(f"more() must return a Run, got {type(run).__name__}")
        before = len(self.steps)
        self.run = run
        self.message = ("one more step recorded" if len(self.steps) > before
                        else "no new step for this request (finished)")
        self._select(len(self.steps) - 1)

    def more_reason(self) -> str:
        """What the "run one more live step" button does, or why it is off (the button's
        tooltip; with no live session also the note beside it)."""
        if self.more is None:
            return ("off: this stepper shows a recorded run (no live session); build it with "
                    "more=notebook.live_more(session, max_new_tokens=...) to add steps")
        return "runs the live session one more step and shows it"

    # -- renderings ----------------------------------------------------------------------------

    def picture_svg(self) -> str:
        """The tree at the cursor; with a what-if coin, the what-if walk from the current node
        in purple."""
        w = self.what_if()
        path = None if w is None else w.path[w.path.index(w.node):]
        return render_svg(to_dot(self.picture_view, what_if=path))

    def verdict_html(self) -> str:
        return (f'<div class="ddtree-verdict" style="font-family:monospace;font-size:13px;padding:4px;'
                f'background:#fff8e1">decision {self.k} / {self.num_events}: {html.escape(self.verdict)}</div>')

    def details_html(self) -> str:
        v = self.view
        cur = v.cursor
        assert cur is not None  # StepView.at always sets the cursor
        about = ("(accept p: the exact probability the walk accepts the child once here; path p: from the root)"
                 if v.rows_known else "(no target rows recorded: depth, rank and node log-weight only)")
        here = html.escape(v.label(v.nodes[cur.current].token))
        parts = [missing_note_html(v), f"<p><b>node {cur.current}</b> {here}: its children in sibling order {about}</p>",
                 children_html(v)]
        if not v.greedy:
            parts.append(mass_bar_svg(v, coin=self.coin))
        if cur.bonus_done:
            parts.append(bonus_html(v))
        return "".join(parts)

    def what_if_html(self) -> str:
        """The what-if answer shown beside the coin slider (class ``ddtree-whatif``)."""
        style = 'class="ddtree-whatif" style="font-family:monospace;font-size:12px;max-width:640px'
        if self._greedy:
            why = ("greedy step: no coins to change (the walk follows the argmax)"
                   if self.trace.params is not None and self.trace.params.is_greedy else
                   f"no coins recorded ({self.trace.source}): nothing to re-walk")
            return f'<div {style};color:#616161">{html.escape(why)}</div>'
        if self.is_leaf:
            return (f'<div {style};color:#616161">node {self.current_node} is a leaf: no coin decides among children '
                    "(the bonus is drawn with the final coin)</div>")
        w = self.what_if()
        if w is None:
            return (f'<div {style};color:#616161">what-if: move the slider (it stops in each child\'s segment) to '
                    f"re-run the verifier with another coin at node {self.current_node}</div>")
        toks = " ".join(html.escape(self.view.label(t)) for t in w.tokens) or "(none)"
        tail = ("the recorded path: the recorded bonus stands" if w.same_path else
                f"a different path (purple on the tree): the bonus would be drawn at node {w.bonus_node} (its row "
                "is stored only as its top tokens, so the bonus token is not recomputed)")
        return (f'<div {style}"><b>what-if u={w.coin:.4g} at node {w.node}</b>: accepted path '
                f"{' → '.join(map(str, w.path))} (tokens {toks}); {tail}</div>")

    # -- widgets -------------------------------------------------------------------------------

    @property
    def widget(self):
        """The ipywidgets box (built on first use)."""
        if self._widgets is None:
            self._build()
            self._refresh()
        assert self._widgets is not None  # _build made them
        return self._widgets["box"]

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget)

    def _build(self) -> None:
        import ipywidgets as w

        b = {}
        b["request"] = w.Dropdown(options=[(f"request {self.run.for_request(r)[0].request_id}", r) for r in self.requests],
                                  value=self.request, description="request",
                                  layout={"width": "220px", "flex": "0 0 auto"}, style={"description_width": "60px"})
        b["step"] = self._step_slider()
        b["first"] = w.Button(description="« first", tooltip="first decision")
        b["prev"] = w.Button(description="◀ previous", tooltip="previous decision")
        b["next"] = w.Button(description="next ▶", tooltip="next decision")
        b["last"] = w.Button(description="last »", tooltip="last decision")
        for name in ("first", "prev", "next", "last"):
            b[name].add_class(f"ddtree-{name}")
            b[name].layout = w.Layout(width="110px")
        b["decision"] = w.IntSlider(value=self.k, min=0, max=self.num_events, description="decision",
                                    continuous_update=False, **slider_kwargs("360px", "70px"))
        b["decision"].add_class("ddtree-decision")
        b["coin"] = w.SelectionSlider(options=["-"], description="what-if u", continuous_update=False,
                                      **slider_kwargs("400px", "110px"))
        b["coin"].add_class("ddtree-coin-slider")
        b["reset"] = w.Button(description="recorded coin", layout={"width": "150px"})
        b["whatif"] = w.HTML(layout=note_layout())
        b["verdict"] = w.HTML()
        b["verdict"].add_class("ddtree-verdict-box")
        b["picture"] = w.HTML()
        b["picture"].add_class("ddtree-picture")
        b["details"] = w.HTML()
        b["table"] = w.HTML()
        b["status"] = w.HTML()
        b["more"] = w.Button(description="run one more live step", disabled=self.more is None,
                             tooltip=self.more_reason(), layout={"width": "210px", "flex": "0 0 auto"})
        b["more"].add_class("ddtree-more")
        note = "" if self.more is not None else (f'<span class="ddtree-more-note" style="color:#616161;font-size:12px">'
                                                 f"{html.escape(self.more_reason())}</span>")
        b["more_note"] = w.HTML(note, layout=note_layout())

        b["request"].observe(lambda ch: self._on(self.set_request, ch["new"]), names="value")
        b["decision"].observe(lambda ch: self._on(self.go, ch["new"]), names="value")
        b["coin"].observe(lambda ch: self._on(self._coin_moved, ch["new"]), names="index")
        b["first"].on_click(lambda _: self._on(self.first))
        b["prev"].on_click(lambda _: self._on(self.prev))
        b["next"].on_click(lambda _: self._on(self.next))
        b["last"].on_click(lambda _: self._on(self.last))
        b["reset"].on_click(lambda _: self._on(self.set_coin, None))
        b["more"].on_click(lambda _: self._on(self.run_more))
        controls = w.VBox([w.HBox([b["request"], b["step"], b["more"], b["more_note"]], layout=wrap_row()),
                           w.HBox([b["first"], b["prev"], b["next"], b["last"], b["decision"]], layout=wrap_row()),
                           w.HBox([b["coin"], b["reset"], b["whatif"]], layout=wrap_row())])
        b["box"] = w.VBox([controls, b["verdict"], b["picture"], b["details"], b["status"], b["table"]])
        b["box"].add_class("ddtree-stepper")
        b["step_row"] = controls.children[0]
        self._widgets = b
        self._coin_values: list[float] = []

    def _step_slider(self):
        """A step slider for the request on show. A new one per request: the browser's slider
        then knows the request's range (Home / End go to its first / last step)."""
        import ipywidgets as w

        s = w.IntSlider(value=self.position, min=0, max=max(len(self.steps) - 1, 0), description="step",
                        continuous_update=False, **slider_kwargs("360px", "50px"))
        s.add_class("ddtree-step")
        s.observe(lambda ch: self._on(self.set_step, ch["new"]), names="value")
        self._step_request = self.request
        return s

    def _coin_moved(self, index) -> None:
        if index is None or not 0 <= index < len(self._coin_values):
            return
        self.set_coin(self._coin_values[index])

    def _on(self, fn, *args) -> None:
        if getattr(self, "_syncing", False):
            return
        try:
            fn(*args)
        except ValueError as exc:  # bad what-if coin, finished live session ...: say so, keep the state
            self.message = f"error: {exc}"
            self._refresh()

    def _refresh(self) -> None:
        b = self._widgets
        if b is None:
            return
        self._syncing = True
        try:
            b["request"].value = self.request
            if self._step_request != self.request:  # a new slider for the new request's range
                old = b["step"]
                b["step"] = self._step_slider()
                b["step_row"].children = tuple(b["step"] if c is old else c for c in b["step_row"].children)
                old.close()
            b["step"].max = max(len(self.steps) - 1, 0)
            b["step"].value = self.position
            b["decision"].max = self.num_events
            b["decision"].value = self.k
            greedy = self._greedy
            choices = self.coin_choices()
            # the what-if coin is the current node's (it decides among its children), never the final coin
            b["coin"].disabled = b["reset"].disabled = not choices
            b["coin"].description = f"what-if u #{self.current_node}"
            b["coin"].tooltip = ("no coins (greedy, or not recorded)" if greedy else
                                 f"node #{self.current_node} is a leaf: no coin decides anything (the bonus uses "
                                 "the final coin)" if not choices else
                                 f"coin of node #{self.current_node}: it decides among its children; the stops are "
                                 "the middles of its children's segments (the bonus draw's final coin is not changed)")
            if choices:
                values = [u for _, u in choices]
                if values != self._coin_values:
                    self._coin_values = values
                    b["coin"].options = [lab for lab, _ in choices]
                recorded = self.view.nodes[self.current_node].child_coin  # None (not stored) reads as NaN
                want = self.coin if self.coin is not None else float("nan" if recorded is None else recorded)
                b["coin"].index = min(range(len(values)), key=lambda j: abs(values[j] - want))
            else:
                self._coin_values = []
                b["coin"].options = ["-"]
            b["whatif"].value = self.what_if_html()
            b["verdict"].value = self.verdict_html()
            b["picture"].value = self.picture_svg()
            b["details"].value = self.details_html()
            b["table"].value = "<details><summary>the step's whole decision table</summary>" + \
                decisions_table_html(self.view) + "</details>"
            b["status"].value = f"<i>{html.escape(self.message)}</i>" if self.message else ""
        finally:
            self._syncing = False
