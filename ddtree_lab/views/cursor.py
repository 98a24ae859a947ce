"""The decision cursor of a step's view: :class:`Cursor`, the walk after its first ``k`` events
(:meth:`ddtree_lab.views.model.StepView.at`), with the stepper's verdict sentence for the last one.

The walk is a list of events (``ddtree_lab.verify.events_of``: ``consider`` a child, ``move``
to an accepted child, the final ``bonus`` draw); :func:`cursor_at` replays the first ``k`` and
says where the walk stands, what it judged there, each node's status so far, and in one
sentence what the last event did.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Protocol

from ..labels import mass_label, number_label
from .nodes import NodeView

__all__ = ["Cursor", "cursor_at", "WalkView"]


class WalkView(Protocol):
    """What the cursor reads of a step's view (:class:`ddtree_lab.views.model.StepView`, which
    imports this module)."""

    events: list
    accepted_path: list[int]
    nodes: dict[int, NodeView]
    bonus: Any  # BonusView | None
    greedy: bool
    source: str

    def label(self, token: int) -> str: ...


@dataclass
class Cursor:
    """The walk after its first ``k`` events (of ``total``).

    ``current``: the node the walk stands on. ``path``: root and the nodes moved to so far.
    ``considered``: the children of ``current`` judged so far, in sibling order. ``focus``:
    the node of the last event (the one to highlight), ``-1`` for the bonus, ``None`` at the
    start. ``status``: node index -> status as of this cursor (nodes not judged yet are
    ``pending``; the root ``root``). ``bonus_done``: the bonus has been drawn. ``verdict``:
    one sentence saying what the last event did. ``event``: the last event's kind. A view
    without walk events (no decision log) has one cursor, ``k = 0``, standing at the end of the
    recorded accepted path with the final statuses (and ``bonus_done`` when a bonus is recorded).
    """

    k: int
    total: int
    current: int
    path: list[int]
    considered: list[int]
    focus: int | None
    status: dict[int, str]
    bonus_done: bool
    verdict: str
    event: str | None

    def to_dict(self) -> dict:
        return asdict(self)


def cursor_at(view: WalkView, k: int) -> Cursor:
    """The :class:`Cursor` of ``view`` after its first ``k`` events (:meth:`StepView.at` checks ``k``)."""
    if not view.events:  # no decision log: nothing to step through, the recorded outcome stands
        path = list(view.accepted_path)
        return Cursor(0, 0, path[-1], path, [], None, {i: n.status for i, n in view.nodes.items()},
                      view.bonus is not None, _verdict(view, None, path[-1], 0), None)
    status = {i: ("root" if i == 0 else "pending") for i in view.nodes if i >= 0}
    current, path, focus, bonus_done, last = 0, [0], None, False, None
    for e in view.events[:k]:
        last = e
        if e.kind == "consider":
            d = e.decision
            if d.node in status:
                status[d.node] = "accepted" if d.verdict == "accept" else "rejected"
            focus = d.node
        elif e.kind == "move":
            current = int(e.node)
            path.append(current)
            focus = current
        elif e.kind == "bonus":
            bonus_done, focus = True, -1
    for i, node in view.nodes.items():
        if i < 0:
            status[i] = node.status
    considered = [c for c in view.nodes[current].children
                  if c >= 0 and status.get(c) in ("accepted", "rejected")] if current in view.nodes else []
    return Cursor(k, len(view.events), current, path, considered, focus, status, bonus_done,
                  _verdict(view, last, current, k), None if last is None else last.kind)


def _fmt(x: float | None) -> str:
    return number_label(x, missing="?")


def _mass(x: float | None) -> str:
    return mass_label(x, missing="?")


def _verdict(view: WalkView, event, current: int, k: int) -> str:
    """One sentence for the last event (the stepper's verdict line)."""
    if event is None and not view.events:
        path = " → ".join(map(str, view.accepted_path))
        return (f"no decision log recorded ({view.source}): the walk cannot be stepped; the accepted path "
                f"{path} is the one the run recorded")
    if event is None:
        kids = [c for c in view.nodes[0].children if c >= 0]
        rule = "follow the target's argmax" if view.greedy else "one coin per node, accept the first child with u < S_k"
        return f"start at the root (node 0) with {len(kids)} children to judge; rule: {rule}"
    if event.kind == "consider":
        d = event.decision
        node = view.nodes.get(d.node)
        tok = view.label(d.token)
        if view.greedy:
            if d.verdict == "accept":
                return f"node {d.node} {tok} is the target's argmax at node {d.parent}: accept"
            return f"node {d.node} {tok} is not the target's argmax at node {d.parent}: reject"
        lo = node.mass_before if node and node.mass_before is not None else None
        if d.verdict == "accept":
            return (f"node {d.node} {tok}: coin u={_fmt(d.coin)} < S_k={_mass(d.cumulative_mass)} "
                    f"(segment [{_mass(lo)}, {_mass(d.cumulative_mass)})), p={_fmt(d.target_prob)} > 0: accept")
        why = "p = 0" if d.target_prob <= 0.0 else f"u={_fmt(d.coin)} ≥ S_k={_mass(d.cumulative_mass)}"
        return f"node {d.node} {tok}: {why}: reject"
    if event.kind == "move":
        node = view.nodes.get(int(event.node))
        depth = node.depth if node else "?"
        kids = len([c for c in node.children if c >= 0]) if node else 0
        tail = f"{kids} children to judge" if kids else "a leaf: the bonus comes next"
        return f"move to node {int(event.node)} (depth {depth}); {tail}"
    b = view.bonus
    assert b is not None  # a bonus event comes from a recorded bonus draw
    if b.token < 0:
        return (f"bonus at node {b.node}: the residual is empty (mass {_mass(b.residual_mass)}): "
                "support exhausted, no bonus token")
    tok = view.label(b.token)
    if view.greedy:
        return f"bonus at node {b.node}: the target's argmax {tok}"
    if b.kind == "leaf":
        return (f"bonus at node {b.node} (a leaf): drawn from the target row with the final coin u={_fmt(b.coin)} "
                f"(the bonus draw's own coin; node {b.node}'s coin decides nothing at a leaf): {tok}")
    return (f"bonus at node {b.node}: drawn from the residual (mass {_mass(b.residual_mass)}, {len(b.rejected)} "
            f"rejected siblings zeroed) with the final coin u={_fmt(b.coin)}: {tok}, residual p={_fmt(b.residual_p)}")
