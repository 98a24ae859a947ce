"""The view model of one recorded step: :class:`StepView`, the only intermediate form.

Every rendering (DOT/SVG picture, text tree, decision tables as text and HTML, the verify
stepper widget, plots through :meth:`StepView.to_dict`) reads a :class:`StepView`; none reads
a :class:`ddtree_lab.step.Step` directly. Lower once, render many ways.

**One meaning per number** (docs/DESIGN.md, "Words"):

* ``target p`` -- the target's probability of a node's token in its parent's row under the
  request's sampling parameters. Sampled requests: ``Step.child_probs`` (exact).
  Greedy requests verify with one-hot rows, so their ``target p`` is the softmax of the raw
  logits at temperature 1, read from the stored display rows (``top_probs``); a token
  outside the stored top-M shows the smallest stored value as an upper bound (``p<x``).
  SGLang greedy recordings store the argmax only: their ``target p`` is unknown (``None``).
* ``residual p`` -- the bonus token's probability in the residual (rejected siblings zeroed,
  renormalised): ``BonusDraw.token_prob``. At a leaf the residual is the row unchanged.
* ``drafter q`` -- the drafter's probability of the node's token at its depth,
  ``exp(draft_logprobs[d-1, rank])``.
* ``accept p`` -- the exact probability that the walk accepts the node once it stands at
  the node's parent: the verify row's value (sampled: ``target p``; greedy: 1 for the
  argmax, 0 otherwise). ``path p`` is the product along the path: the probability that the
  walk reaches and accepts the node; its sum over the tree is the exact expected number of
  accepted draft tokens.

**Decision cursor.** The walk is a list of events (``ddtree_lab.verify.events_of``:
``consider`` a child, ``move`` to an accepted child, the final ``bonus`` draw).
:meth:`StepView.at` gives the :class:`Cursor` (:mod:`.cursor`) after the first ``k`` events: the node the
walk stands on, the siblings it has judged there, the verdict text, and each node's status
so far. The stepper moves ``k``.

**Steps without target rows** (the DDTree reference's dumps, an SGLang greedy recording, a
light trace's unread rows): the view draws what the step stores -- the tree, depths, ranks,
node log-weights where known, the accepted path and the bonus token the run emitted -- and
leaves every unknown number ``None`` (never a stand-in). :attr:`StepView.missing` names what
is not recorded and :attr:`StepView.missing_note` is the sentence every rendering shows. With no
decision log the walk has no events; the children of accepted-path nodes that were not accepted
are ``rejected`` (the walk stood at their parent and did not take them; which of them a rule
judged is not known).

**Collapse** (readable big trees): :func:`step_view` hides nodes by depth, by target p, by
drafter q, or every unvisited node, and can cap a wide fan at ``max_children``; the root and
the accepted path always stay (and every visited sibling unless the fan is capped). A parent's
hidden children become one summary node that counts every hidden
node below it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Mapping

import torch

from ..io.decoding_mode import mode_of, request_temperatures
from ..sampling import SamplingParams
from ..step import Run, Step
from ..verify import BonusDraw, WalkEvent, events_of
from .collapse import collapse_nodes
from .cursor import Cursor, cursor_at
from .nodes import STATUSES, NodeView
from ..labels import LOSSY_COLOR, lossy_mark, mass_label, number_label, shared_text_ids, token_label

__all__ = ["NodeView", "DecisionRow", "BonusView", "Cursor", "StepView", "WalkEvent", "step_view", "token_label",
           "lossy_mark", "walk_events", "STATUSES", "number_label", "mass_label",
           "LOSSY_COLOR", "ROWS_MISSING"]

#: the entry of :attr:`StepView.missing` for a step that stores no target rows.
ROWS_MISSING = "target rows"


@dataclass
class DecisionRow:
    """One row of the decision table: the verdict on ``node`` (a child of ``parent``).

    ``target_p`` is the node's target p (module docstring). ``verify_p`` is what the verifier
    compared: the sampled rule's ``p`` (equal to ``target_p``), and for greedy rows 1.0 when
    the token is the argmax (one-hot rows). ``mass`` is ``S_k`` (sampled only), ``coin`` the
    node-level coin (sampled only).
    """

    order: int
    depth: int
    parent: int
    node: int
    token: int
    text: str
    target_p: float | None
    target_p_upper: bool
    verify_p: float
    mass: float | None
    coin: float | None
    verdict: str

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class BonusView:
    """The bonus draw: at ``node``, ``kind`` (argmax | residual | leaf | exhausted | recorded).

    ``recorded``: the step stores the bonus token the run emitted but not its draw (no target
    rows: every probability and the coin are ``None``). ``token`` is ``-1`` when the support
    was exhausted. ``target_p``: the token's target p in
    the node's row (greedy: softmax). ``residual_p``: its probability in the residual
    (sampled only). ``residual_mass``: the mass left after zeroing the rejected siblings.
    ``rejected``: the rejected siblings' tokens (zeroed in the residual). ``top``: the row's
    stored top tokens as ``(token, text, target p, residual p or None if struck out)``.
    """

    node: int
    token: int
    text: str
    kind: str
    target_p: float | None
    target_p_upper: bool
    residual_p: float | None
    residual_mass: float | None
    coin: float | None
    rejected: list[int] = field(default_factory=list)
    top: list[tuple[int, str, float, float | None]] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def walk_events(decisions, bonus) -> list[WalkEvent]:
    """The walk's events from a recorded decision log (:func:`ddtree_lab.verify.events_of`:
    consider / move / bonus, in walk order)."""
    return list(events_of(decisions, bonus))


@dataclass
class StepView:
    """The view model of one step (module docstring).

    Attributes:
        title: one line naming step, request, sampling mode, size and outcome.
        step, request, request_id: where the step comes from.
        greedy: greedy verification (argmax comparison, no coins).
        mode: ``greedy`` or the sampling parameters as text.
        nodes: node index -> :class:`NodeView` (tree nodes and collapsed summaries; children
            lists hold the drawn children in sibling order).
        bonus: the :class:`BonusView` (``None`` when the step records no bonus token);
            ``bonus_parent``: the node it hangs off (the accepted path's last node).
        decisions: the decision table rows in walk order.
        events: the walk events (see :func:`walk_events`).
        accepted_path: root first.
        hidden: tree nodes hidden by the collapse options.
        expected_accept: the sum of ``path p`` over the draft nodes (exact expected number of
            accepted draft tokens of this tree under the target-only rule).
        cursor: the :class:`Cursor` when the view was made with one (:meth:`at`), else ``None``.
        thresholds: ``(threshold_single, threshold_acc)`` the step was verified with.
        lossy: the thresholds break exactness (:func:`ddtree_lab.verify.is_lossy`); the title
            then ends with :attr:`lossy_mark`.
        token_labels: token id -> its label (:func:`ddtree_lab.views.token_label`) for every
            token the view shows (nodes, decisions, the bonus and its row's top tokens): the id
            beside any text that is ambiguous or that two of these ids share. Read it with
            :meth:`label`.
        missing: what the step does not record that a full lab step has, as short phrases
            (empty for a full lab step); :attr:`missing_note` is the sentence views show.
        rows_known: the step stores target rows (False: no node has a target p, accept p or
            path p, and the renderings leave those columns out).
        source: where the step came from (``Step.source``).
    """

    title: str
    step: int
    request: int
    request_id: str
    greedy: bool
    mode: str
    nodes: dict[int, NodeView]
    bonus: BonusView | None
    bonus_parent: int
    decisions: list[DecisionRow]
    events: list
    accepted_path: list[int]
    num_nodes: int
    hidden: int = 0
    expected_accept: float | None = None
    cursor: Cursor | None = None
    thresholds: tuple[float, float] = (1.0, 1.0)
    lossy: bool = False
    token_labels: dict[int, str] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    rows_known: bool = True
    source: str = "lab trace"

    def label(self, token: int) -> str:
        """The label of ``token`` in this view (:attr:`token_labels`; a token the view does
        not show: its ``<id>`` placeholder, quoted)."""
        return self.token_labels.get(int(token)) or token_label(f"<{int(token)}>")

    @property
    def missing_note(self) -> str:
        """One sentence naming what the step does not record (``""`` when nothing is missing):
        ``"no target rows recorded: target probabilities, coins and the bonus draw are not
        known; also not recorded: ..."``. Every rendering shows it in the picture or table."""
        if not self.missing:
            return ""
        rest = [m for m in self.missing if m != ROWS_MISSING]
        head = (f"no target rows recorded ({self.source}): target probabilities, coins and the bonus draw are "
                "not known" if ROWS_MISSING in self.missing else f"not fully recorded ({self.source})")
        if not rest:
            return head
        return head + ("; also not recorded: " if ROWS_MISSING in self.missing else ": ") + "; ".join(rest)

    @property
    def lossy_mark(self) -> str:
        """``"LOSSY: threshold_acc=0.5"`` (the thresholds that differ from 1), or ``""``."""
        return lossy_mark(self.thresholds) if self.lossy else ""

    @property
    def num_events(self) -> int:
        return len(self.events)

    def at(self, k: int) -> "StepView":
        """This view with its decision cursor after the first ``k`` events (``0 <= k <=
        num_events``). Raises ``ValueError`` naming the range when ``k`` is outside it."""
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= len(self.events):
            raise ValueError(f"cursor k={k!r} is outside 0..{len(self.events)} (the step has {len(self.events)} walk events)")
        return replace(self, cursor=cursor_at(self, k))

    def children_of(self, node: int) -> list[NodeView]:
        """The drawn children of ``node`` in sibling order (summaries included)."""
        return [self.nodes[c] for c in self.nodes[node].children]

    def status(self, index: int) -> str:
        """A node's status as of the cursor (the final status without one)."""
        if self.cursor is not None and index in self.cursor.status:
            return self.cursor.status[index]
        return self.nodes[index].status

    def to_dict(self) -> dict:
        """Everything above as JSON-able plain data (for widgets and plots)."""
        return {
            "title": self.title, "step": self.step, "request": self.request, "request_id": self.request_id,
            "greedy": self.greedy, "mode": self.mode, "num_nodes": self.num_nodes, "hidden": self.hidden,
            "expected_accept": self.expected_accept, "accepted_path": list(self.accepted_path),
            "bonus_parent": self.bonus_parent,
            "nodes": [n.to_dict() for n in self.nodes.values()],
            "bonus": None if self.bonus is None else self.bonus.to_dict(),
            "decisions": [d.to_dict() for d in self.decisions],
            "events": [{"kind": e.kind, "node": int(e.node)} for e in self.events],
            "cursor": None if self.cursor is None else self.cursor.to_dict(),
            "thresholds": list(self.thresholds), "lossy": self.lossy,
            "token_labels": {str(t): lab for t, lab in self.token_labels.items()},
            "missing": list(self.missing), "missing_note": self.missing_note, "rows_known": self.rows_known,
            "source": self.source,
        }


# -- lowering -----------------------------------------------------------------------------------


def text_lookup(texts) -> Callable[[int], str]:
    if isinstance(texts, Run):
        return texts.text
    if texts is None:
        return lambda t: f"<{int(t)}>"
    if isinstance(texts, Mapping):
        return lambda t: texts.get(int(t), f"<{int(t)}>")
    raise TypeError(f"texts must be a Run, a dict token id -> text, or None; got {type(texts).__name__}")


def _display_p(step: Step, row: int, token: int) -> tuple[float | None, bool]:
    """The token's temperature-1 probability in node ``row``'s row (greedy steps' target p).

    Exact from trace format v2's raw logits when the token is among the row's stored top-M
    logits; else from the stored display row: exact when stored, else the smallest stored
    value as an upper bound (a zero bound is exact)."""
    ids_m, logits, lse = step.row_logit_ids, step.row_logits, step.row_logsumexp
    if ids_m is not None and logits is not None and lse is not None and ids_m.numel():
        hit = (ids_m[row] == token).nonzero()
        if hit.numel():
            return math.exp(float(logits[row, int(hit[0, 0])]) - float(lse[row])), False
    return _stored_p(step, row, token)


def _stored_p(step: Step, row: int, token: int) -> tuple[float | None, bool]:
    """The token's probability in node ``row``'s stored display row (``top_probs``: greedy
    steps the temperature-1 softmax, sampled steps the target under the request's
    parameters): exact when stored, else the smallest stored value as an upper bound."""
    top_ids, top_probs = step.top_token_ids, step.top_probs
    if top_ids is None or top_probs is None or top_ids.numel() == 0:
        return None, False
    ids = top_ids[row].tolist()
    if token in ids:
        return float(top_probs[row, ids.index(token)]), False
    bound = float(top_probs[row, -1])
    return bound, bound > 0.0


def _node_p(step: Step, i: int, parent: int, token: int) -> tuple[float | None, bool]:
    """Greedy target p of node ``i``: exact from v2's ``node_logits`` and the parent row's
    log-sum-exp, else :func:`_display_p`."""
    if step.node_logits is not None and step.row_logsumexp is not None:
        x = float(step.node_logits[i])
        if not math.isnan(x):
            return math.exp(x - float(step.row_logsumexp[parent])), False
    return _display_p(step, parent, token)


def _finite(x: float) -> float | None:
    return None if x is None or math.isnan(x) else x


def _greedy_p_known(step: Step, params: SamplingParams) -> bool:
    # SGLang greedy recordings store the target's argmax only (their display rows are one-hot).
    return not (params.is_greedy and step.extra.get("source") == "sglang")


def _mode(params: SamplingParams) -> str:
    return params.label(" ")


def step_view(step: Step, texts: Run | Mapping[int, str] | None = None, collapse_unvisited: bool = False,
              *, max_depth: int | None = None, min_target_p: float | None = None,
              min_drafter_q: float | None = None, cursor: int | None = None, keep=None,
              max_children: int | None = None) -> StepView:
    """Lower a recorded step to its :class:`StepView`.

    Args:
        step: the recorded step.
        texts: token id -> text (a :class:`Run` works too; ``None`` shows ``<id>``).
        collapse_unvisited: hide every node the walk never reached.
        max_depth: hide nodes deeper than this.
        min_target_p, min_drafter_q: hide nodes whose target p (its upper bound when the token
            is outside the stored top-M) or drafter q is below the value.
        cursor: set the decision cursor after this many walk events (see :meth:`StepView.at`).
        keep: node indices never hidden, with their ancestors (e.g. a what-if path).
        max_children: draw at most this many children per parent (wide fans such as a first
            step's 32 root children): the accepted child always, then the first in sibling
            order; the rest, rejected ones included, become the summary node.

    The root and the accepted path are never hidden, nor (without ``max_children``) any
    visited sibling; a hidden node hides its subtree; each parent's hidden children become one summary node counting all
    the nodes it hides.

    A step without target rows, coins, parameters or a decision log (module docstring) is drawn
    from its tree and recorded output; :attr:`StepView.missing` names what it lacks.

    Raises:
        ValueError: a collapse option of the wrong type or range, a cursor out of range, or a
            step that stores no tree or no verify output (an engine summary's step, a lab trace
            at level ``off``): the message names the step, its source and what it does store.
        TypeError: ``texts`` of the wrong type.
    """
    if max_depth is not None and (isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < 0):
        raise ValueError(f"max_depth must be None or an int >= 0, got {max_depth!r}")
    if max_children is not None and (isinstance(max_children, bool) or not isinstance(max_children, int)
                                     or max_children < 1):
        raise ValueError(f"max_children must be None or an int >= 1, got {max_children!r}")
    for name, v in (("min_target_p", min_target_p), ("min_drafter_q", min_drafter_q)):
        if v is not None and not (isinstance(v, (int, float)) and 0.0 <= v <= 1.0):
            raise ValueError(f"{name} must be None or a number in [0, 1], got {v!r}")
    lookup = text_lookup(texts)
    tree, child_probs_t, draw, params = step.tree, step.child_probs, step.bonus, step.params
    if tree is None or step.output is None:
        raise ValueError(_no_tree_message(step))
    n = step.num_nodes
    greedy = params is not None and params.is_greedy
    p_known = params is not None and _greedy_p_known(step, params)
    parents = tree.parents[0].tolist()  # the Step accessors parents, node_token_ids, ... read these rows
    tokens = tree.node_token_ids[0].tolist()
    depths = tree.depths[0].tolist()
    ranks = tree.ranks[0].tolist()
    logws = tree.node_logws[0].tolist()
    child_probs = child_probs_t.tolist() if child_probs_t is not None else [float("nan")] * n
    accepted = set(step.accepted_path)
    decided = {d.node: (k, d) for k, d in enumerate(step.decisions)}
    has_log = bool(step.decisions) or draw is not None
    lp = step.draft_logprobs if step.draft_logprobs is not None else torch.zeros(0, 0)
    coins = step.coins.tolist() if step.coins is not None else []

    nodes: dict[int, NodeView] = {}
    for i in range(n):
        status = ("root" if i == 0 else "accepted" if i in accepted else
                  "rejected" if i in decided or (not has_log and parents[i] in accepted) else "unvisited")
        node = NodeView(i, tokens[i], lookup(tokens[i]) if tokens[i] >= 0 else "(not recorded)", status, depths[i],
                        ranks[i], logws[i], parent=parents[i],
                        child_coin=None if greedy or i >= len(coins) else coins[i])
        if i:
            if greedy:
                node.target_p, node.target_p_upper = (_node_p(step, i, parents[i], tokens[i]) if p_known
                                                       else (None, False))
            else:
                node.target_p = _finite(child_probs[i])  # light traces: NaN where the parent was not visited
            node.accept_p = _finite(child_probs[i])
            up = nodes[parents[i]].path_p if parents[i] else 1.0
            node.path_p = None if node.accept_p is None or up is None else node.accept_p * up
            d, r = depths[i], ranks[i]
            if lp.numel() and 0 < d <= lp.shape[0] and 0 <= r < lp.shape[1]:
                node.drafter_q = math.exp(float(lp[d - 1, r]))
        if i in decided:
            k, dec = decided[i]
            node.order, node.mass = k, dec.cumulative_mass
            node.coin = None if greedy else dec.coin
        nodes[i] = node
    for i in range(1, n):  # ascending index = sibling order (children in descending log-weight)
        nodes[parents[i]].children.append(i)
    for node in nodes.values():
        before = 0.0
        for c in node.children:
            child = nodes[c]
            if child.order is not None:
                child.mass_before = before
                before = child.mass if child.mass is not None else before
    paths = [nodes[i].path_p for i in range(1, n)]
    known = [p for p in paths if p is not None]
    expected = sum(known) if len(known) == len(paths) else None

    rows = []
    for k, d in enumerate(step.decisions):
        node = nodes.get(d.node)
        rows.append(DecisionRow(k, d.depth, d.parent, d.node, d.token, lookup(d.token),
                                node.target_p if node else None, node.target_p_upper if node else False,
                                d.target_prob, None if greedy else d.cumulative_mass,
                                None if greedy else d.coin, d.verdict))
    path = list(step.accepted_path)
    bonus_parent = draw.node if draw is not None else path[-1]
    bonus = (_bonus_view(step, draw, lookup, greedy, p_known) if draw is not None
             else _recorded_bonus(step, bonus_parent, lookup))
    hidden = collapse_nodes(nodes, collapse_unvisited, max_depth, min_target_p, min_drafter_q, keep, max_children)
    stated = _file_temperature(step, texts) if params is None else None
    mode = _mode(params) if params is not None else (
        "sampling parameters not recorded" if stated is None else f"T={stated[0]:g} ({mode_of(stated[0])}, {stated[1]})")
    if bonus is None:
        outcome = f"accepted {step.accept_length}, bonus token not recorded"
    elif bonus.token >= 0:
        outcome = f"accepted {step.accept_length} + bonus"
    else:
        outcome = f"accepted {step.accept_length}, support exhausted (no bonus)"
    shown = f" ({hidden} hidden)" if hidden else ""
    title = (f"step {step.step} · request {step.request_id} · {mode} · {n - 1} draft nodes{shown} · {outcome}")
    if step.lossy:
        title += f" · {lossy_mark(step.thresholds)}"
    threshold_single, threshold_acc = step.thresholds
    missing = _missing(step, params, p_known, has_log, bonus, tokens, ranks, logws, child_probs, stated)
    on_show = {t for t in tokens if t >= 0} | {d.token for d in step.decisions}
    if bonus is not None:
        on_show |= {t for t, *_ in bonus.top} | ({bonus.token} if bonus.token >= 0 else set())
    shared = shared_text_ids(on_show, lookup)
    labels = {t: token_label(lookup(t), t, shared=t in shared) for t in sorted(on_show)}
    view = StepView(title, step.step, step.request, step.request_id, greedy, mode, nodes, bonus, bonus_parent,
                    rows, walk_events(step.decisions, draw), path, n, hidden, expected,
                    thresholds=(threshold_single, threshold_acc), lossy=bool(step.lossy), token_labels=labels,
                    missing=missing, rows_known=step.rows is not None, source=step.source)
    return view if cursor is None else view.at(cursor)


def _no_tree_message(step: Step) -> str:
    """Why a step cannot be drawn: it stores no tree or no verify output (its source said)."""
    where = f"step {step.step}, request {step.request} ({step.source})"
    if step.source == "engine summary":
        drafted = step.extra.get("drafted")
        return (f"{where}: an engine summary stores no tree, only the step's accept length "
                f"({step.stored_accept_length} accepted draft tokens" + (f" of {drafted} drafted" if drafted else "")
                + "); there is nothing to draw (`ddtree-lab info` summarises the run)")
    if step.extra.get("did_not_return"):  # the process stopped before the verifier returned: not the level's doing
        why = step.extra.get("why") or "did not finish: the process stopped before its verifier returned"
        return (f"{where}: {why}; its verify inputs are on disk, no output to draw (`ddtree-lab doctor` checks the "
                "inputs; ddtree_lab.io.append_trace.replay_inputs verifies them)")
    what = "no tree" if step.tree is None else "no verify output (accepted path)"
    hint = (" (record with level 'full' or 'light' to keep the tree)" if step.source == "lab trace" and step.level == "off"
            else "")
    return f"{where}: recorded at level {step.level!r}, it stores {what} to draw{hint}"


def _recorded_bonus(step: Step, node: int, lookup) -> BonusView | None:
    """The bonus of a step without a bonus draw: the token its output records (kind
    ``recorded``, every probability unknown), ``exhausted`` when the output says so, or None
    when the output records no bonus token."""
    out = step.output
    assert out is not None  # step_view refused a step without an output
    if bool(out.support_exhausted[0]):
        return BonusView(node, -1, "", "exhausted", None, False, None, None, None)
    token = step.bonus_token
    if token < 0:
        return None
    return BonusView(node, token, lookup(token), "recorded", None, False, None, None, None)


def _file_temperature(step: Step, texts) -> tuple[float, str] | None:
    """The temperature a run that records no sampling parameters states for ``step``'s request
    in its metadata, and where from (:mod:`ddtree_lab.io.decoding_mode`; ``info`` prints the
    same), or None: not stated, or ``texts`` is not the step's :class:`Run`."""
    if not isinstance(texts, Run):
        return None
    for request, t, where in request_temperatures(texts):
        if request == step.request and t is not None:
            return t, where
    return None


def _missing(step: Step, params, p_known: bool, has_log: bool, bonus: BonusView | None, tokens, ranks, logws,
             child_probs, stated: tuple[float, str] | None = None) -> list[str]:
    """What the view cannot show because the step does not record it (StepView.missing)."""
    out = []
    if step.rows is None:
        out.append(ROWS_MISSING)
    elif params is not None and params.is_greedy and not p_known:
        out.append("target p (the recording stores the target's argmax only)")
    elif any(math.isnan(p) for p in child_probs[1:]):
        unread = sum(1 for p in child_probs[1:] if math.isnan(p))
        out.append(f"target p of {unread} nodes whose parent's row the walk never read (level {step.level!r})")
    if params is None:
        out.append("sampling parameters (greedy or sampled is not known)" if stated is None
                   else f"sampling parameters other than the temperature (T={stated[0]:g} {stated[1]})")
    elif not params.is_greedy and step.coins is None:
        out.append("coins")
    if not has_log:
        out.append("decision log (which children the verifier judged, S_k; the walk cannot be stepped)")
    if bonus is None:
        out.append("the bonus token")
    if step.draft is None or not step.draft.logprobs.numel():
        out.append("draft top-k (drafter q)")
    if logws and all(math.isnan(x) for x in logws[1:]):
        out.append("node log-weights")
    if len(ranks) > 1 and all(r < 0 for r in ranks[1:]):
        out.append("draft ranks")
    if tokens and tokens[0] < 0:
        out.append("the root token")
    return out


def _bonus_view(step: Step, b: BonusDraw, lookup, greedy: bool, p_known: bool) -> BonusView:
    rejected = [d.token for d in step.decisions if d.parent == b.node and d.verdict == "reject"]
    if b.token >= 0 and greedy and p_known:
        tp, upper = _display_p(step, b.node, b.token)
    elif b.token >= 0 and not greedy:  # under the request's parameters: the stored bonus row prefix
        prefix = step.final_row_prefix
        if prefix is not None and b.token < prefix.shape[0]:
            tp, upper = float(prefix[b.token]), False
        else:
            tp, upper = _stored_p(step, b.node, b.token)
    else:
        tp, upper = None, False
    top = []
    top_ids, top_probs = step.top_token_ids, step.top_probs
    if top_ids is not None and top_probs is not None and top_ids.numel() and (p_known or not greedy):
        mass = b.residual_mass
        for t, p in zip(top_ids[b.node].tolist(), top_probs[b.node].tolist()):
            if p <= 0.0:
                continue
            struck = t in rejected
            top.append((t, lookup(t), p, None if struck or greedy or not mass else p / mass))
    return BonusView(b.node, b.token, lookup(b.token) if b.token >= 0 else "", b.kind, tp, upper,
                     None if greedy else (b.token_prob if b.token >= 0 else None),
                     None if greedy else b.residual_mass, None if greedy else b.coin, rejected, top)
