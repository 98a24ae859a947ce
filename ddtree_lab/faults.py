"""Planted faults: named switches on :class:`~ddtree_lab.LiveSession` that reproduce bugs engines ship.

Each fault is one small hook at the stage where the real bug lives; the session calls the
hooks of its :class:`Faults` (``LiveSession(..., faults=Faults("mask-parent-only"))`` or
``faults=["mask-parent-only"]``). With no faults (the default, :data:`NO_FAULTS`) every hook
is the identity, so a normal run cannot reach one by accident: the CLI has no flag for them,
and a session with faults writes their names into the trace's metadata
(``planted_faults``, which :func:`ddtree_lab.diagnose` never reads).

The kinds (:data:`FAULT_KINDS`), each after a class of public bug reports (issue 16):

* target forward (the tree forward's mask and positions; the recorded buffers stay right,
  as an engine's buggy mask kernel leaves them): ``mask-ancestors-hidden`` (a node sees only
  itself in the tree), ``mask-parent-only`` (itself and its parent), ``mask-siblings-visible``
  (also its earlier siblings), ``positions-node-index`` (position = prefix + node index),
  ``positions-no-depth`` (every node at the root's position, as a frozen graph capture),
  ``batch-mask-other-request`` / ``batch-positions-other-request`` (every request after the
  first gets request 0's tree mask / depths: right only for the first request);
* KV commit: ``kv-commit-wrong-rows`` (keeps the first ``k`` tree rows, an integer rewind,
  instead of the accepted nodes' rows);
* drafter input: ``drafter-wrong-anchor`` (the token before the anchor), ``drafter-mask-slot``
  (position ``k``'s logits read from slot ``k - 1``), ``drafter-features-zero`` (never given the
  target's hidden states), ``drafter-features-stale`` (every committed token gets the step
  root's features);
* sampling plumbing (the verifier's rows; the trace still states the request's parameters):
  ``sampling-greedy`` (T > 0 served greedily), ``sampling-temperature-1``,
  ``sampling-other-order`` (top-p before top-k), ``sampling-top-p-dropped``,
  ``sampling-min-p-dropped`` (one filter never reaches the verifier's rows),
  ``sampling-banned-token-kept`` (the request's banned tokens stay in the rows, as when the
  logits processors skip the verify rows);
* verifier rule: ``verifier-p-over-q`` (``u < min(1, p/q)`` with the drafter's marginal ``q``
  of each node on a top-k tree), ``verifier-threshold`` (SGLang's lossy ``threshold_acc = 0.5``
  not reported), ``verifier-bonus-row`` (the bonus drawn from the row of the final node's
  parent), ``verifier-final-coin-reuse`` (the final coin is the final node's walk coin, and
  is recorded as such); and four variants outside :mod:`ddtree_lab.diagnosis.verifier`'s
  catalogue, which only rule inference (:mod:`ddtree_lab.diagnosis.inference`) names, each a
  :class:`RuleVariant` whose recorded rows stay the request's (the verifier computes its own):
  ``verifier-temperature-1`` (the verifier's rows at temperature 1), ``verifier-greedy``
  (argmax decisions on a sampled request: one-hot rows inside the verifier),
  ``verifier-p-over-q-own-coin`` (``min(1, p/q)`` with each child's own coin) and
  ``verifier-root-coin`` (the root's coin decides every level).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np
import torch

from .buffers import DDTreeVerifyInput
from .sampling import SamplingParams
from .verify import BonusDraw, Decision, VerifyOutput, verify_sampled
from .verify.rules import residual_draw
from .verify.walking import walk_batch

__all__ = ["Faults", "NO_FAULTS", "FAULT_KINDS", "FORWARD_FAULTS", "COMMIT_FAULTS", "DRAFTER_FAULTS",
           "SAMPLING_FAULTS", "VERIFIER_FAULTS", "as_faults", "forward_input", "kept_rows", "sampling_params",
           "PQRule", "verify_p_over_q", "LOSSY_THRESHOLD_ACC", "RuleVariant", "ROW_VARIANTS", "variant_params",
           "variant_rows", "verify_variant", "VARIANT_FAULTS"]

FORWARD_FAULTS = {
    "mask-ancestors-hidden": "the tree mask hides every ancestor (a node sees only itself and the prefix)",
    "mask-parent-only": "the tree mask shows only the parent (ancestors above it hidden)",
    "mask-siblings-visible": "the tree mask also shows each node's earlier siblings",
    "positions-node-index": "RoPE positions are prefix + node index instead of prefix + depth",
    "positions-no-depth": "RoPE positions ignore depth (every node at the root's position)",
    "batch-mask-other-request": "in a batch, requests after the first get request 0's tree mask",
    "batch-positions-other-request": "in a batch, requests after the first get request 0's depths as positions",
}
COMMIT_FAULTS = {
    "kv-commit-wrong-rows": "after verify the KV cache keeps the first k tree rows (an integer rewind), not the "
                            "accepted nodes' rows",
}
DRAFTER_FAULTS = {
    "drafter-wrong-anchor": "the drafter is given the token before the anchor as its anchor",
    "drafter-mask-slot": "the drafter's position k is read from mask slot k-1 (off by one)",
    "drafter-features-zero": "the drafter never gets the target's hidden states (zeros)",
    "drafter-features-stale": "every committed token hands the drafter the step root's features (stale)",
}
SAMPLING_FAULTS = {
    "sampling-greedy": "a request with T > 0 is verified greedily (sampling parameters dropped)",
    "sampling-temperature-1": "the verifier's rows use temperature 1 instead of the request's",
    "sampling-other-order": "the verifier's rows apply top-p before top-k (the other filtering order)",
    "sampling-top-p-dropped": "the verifier's rows drop the request's top-p (only temperature and top-k applied)",
    "sampling-min-p-dropped": "the verifier's rows drop the request's min-p",
    "sampling-banned-token-kept": "the verifier's rows keep the tokens the request bans (logits processors skipped)",
}
VERIFIER_FAULTS = {
    "verifier-p-over-q": "min(1, p/q) with the drafter's marginals on a top-k tree instead of the target-only rule",
    "verifier-threshold": "a lossy acceptance threshold (threshold_acc 0.5) the output does not report",
    "verifier-bonus-row": "the bonus is drawn from the final node's parent's row",
    "verifier-final-coin-reuse": "the final coin reuses the final node's walk coin",
    "verifier-temperature-1": "the verifier decides on its own rows at temperature 1 (the recorded rows are the "
                              "request's)",
    "verifier-greedy": "a sampled request's decisions are taken greedily (one-hot rows inside the verifier)",
    "verifier-p-over-q-own-coin": "min(1, p/q) with the drafter's marginals, each child judged with its own coin",
    "verifier-root-coin": "the root's coin decides every level (a coin reused across levels)",
}
#: Every planted fault: name -> what it does.
FAULT_KINDS: dict[str, str] = {**FORWARD_FAULTS, **COMMIT_FAULTS, **DRAFTER_FAULTS, **SAMPLING_FAULTS,
                               **VERIFIER_FAULTS}

#: The threshold ``verifier-threshold`` runs with.
LOSSY_THRESHOLD_ACC = 0.5


# -- target forward -------------------------------------------------------------------------


def forward_input(vi: DDTreeVerifyInput, parents: torch.Tensor, name: str) -> DDTreeVerifyInput:
    """The buffers the target forward reads under forward fault ``name`` (batch ``[bs, N]``).

    Args:
        vi: the right buffers (:func:`ddtree_lab.compile_retrieve`).
        parents: ``[bs, N]`` int64 parents (root and padding -1).
        name: one of :data:`FORWARD_FAULTS`.

    Returns:
        a copy of ``vi`` with ``tree_mask`` ``[bs, N, N]`` bool or ``positions`` ``[bs, N]``
        int64 changed; the root's position and every other field are left as they are.
    """
    if name not in FORWARD_FAULTS:
        raise ValueError(f"unknown forward fault {name!r}; known: {', '.join(FORWARD_FAULTS)}")
    bs, n = vi.node_token_ids.shape
    mask, pos = vi.tree_mask.clone(), vi.positions.clone()
    eye = torch.eye(n, dtype=torch.bool, device=mask.device).expand(bs, n, n)
    if name == "mask-ancestors-hidden":
        mask = eye.clone()
    elif name == "mask-parent-only":
        mask = eye.clone()
        b, i = (parents >= 0).nonzero(as_tuple=True)
        mask[b, i, parents[b, i]] = True
    elif name == "mask-siblings-visible":
        same = (parents[:, :, None] == parents[:, None, :]) & (parents[:, :, None] >= 0)
        earlier = torch.ones(n, n, dtype=torch.bool, device=mask.device).tril(-1)
        mask = mask | (same & earlier)
    elif name == "positions-node-index":
        real = torch.arange(n)[None, :] < vi.num_nodes[:, None]
        pos = torch.where(real, pos[:, :1] + torch.arange(n)[None, :], pos)
    elif name == "positions-no-depth":
        pos = pos[:, :1].expand(bs, n).clone()
    elif name == "batch-mask-other-request":
        mask[1:] = vi.tree_mask[:1]
    elif name == "batch-positions-other-request":
        pos[1:] = pos[1:, :1] + (vi.positions[:1] - vi.positions[:1, :1])
    return dataclasses.replace(vi, tree_mask=mask, positions=pos)


# -- KV commit ------------------------------------------------------------------------------


def kept_rows(paths: Sequence[Sequence[int]], name: str | None) -> list[list[int]]:
    """The tree rows a KV commit keeps: the accepted paths, or under ``kv-commit-wrong-rows`` the
    first ``len(path)`` rows ``0 .. k`` (an integer rewind that assumes the path is the spine)."""
    if name is None:
        return [list(p) for p in paths]
    if name != "kv-commit-wrong-rows":
        raise ValueError(f"unknown commit fault {name!r}")
    return [list(range(len(p))) for p in paths]


# -- sampling plumbing -----------------------------------------------------------------------


def sampling_params(params: SamplingParams, name: str) -> SamplingParams:
    """The parameters the verifier's rows are made with under sampling fault ``name`` (greedy
    requests are left as they are, except that their bans go too under
    ``sampling-banned-token-kept``)."""
    if name not in SAMPLING_FAULTS:
        raise ValueError(f"unknown sampling fault {name!r}; known: {', '.join(SAMPLING_FAULTS)}")
    if name == "sampling-banned-token-kept":
        return dataclasses.replace(params, banned_token_ids=())
    if params.is_greedy:
        return params
    if name == "sampling-greedy":
        return dataclasses.replace(params, temperature=0.0)
    if name == "sampling-temperature-1":
        return dataclasses.replace(params, temperature=1.0)
    if name == "sampling-top-p-dropped":
        return dataclasses.replace(params, top_p=1.0)
    if name == "sampling-min-p-dropped":
        return dataclasses.replace(params, min_p=None)
    other = "top_p_then_top_k" if params.order == "top_k_then_top_p" else "top_k_then_top_p"
    return dataclasses.replace(params, order=other)


# -- verifier rules ------------------------------------------------------------------------


class PQRule:
    """``min(1, p/q)`` per sibling with one coin per node, ``q`` the drafter's marginal of the
    child's token at its depth (``exp(logw_child - logw_parent)``), bonus from the target row
    with the rejected siblings zeroed: the speculative-sampling rule of chain drafts applied to
    a top-k tree, which is biased there (issue 16). Same interface as the verify rules
    (:mod:`ddtree_lab.verify.rules`): ``decide`` and ``bonus``. ``coin="child"`` judges each
    child with its own coin (``coins[child]``) instead of the parent's; ``q="one-hot"`` takes
    ``q = 1`` (a drafter taken as deterministic), i.e. ``u < p``."""

    def __init__(self, request: int, tokens: list[int], logws: list[float], row_of, coins: list[float],
                 final_coin: float, final_mass: float | None = None, coin: str = "parent", q: str = "drafter"):
        if coin not in ("parent", "child") or q not in ("drafter", "one-hot"):
            raise ValueError(f"PQRule: coin must be 'parent' or 'child', q 'drafter' or 'one-hot'; got {coin!r}, {q!r}")
        self.request, self.tokens, self.logws, self.row_of = request, tokens, logws, row_of
        self.coins, self.final_coin, self.final_mass = coins, final_coin, final_mass
        self.coin, self.q = coin, q

    def decide(self, node, depth, children):
        u, row, mass, out = self.coins[node], self.row_of(node), 0.0, []
        for child in children:
            if self.coin == "child":
                u = self.coins[child]
            p = float(row[self.tokens[child]])
            q = 1.0 if self.q == "one-hot" else math.exp(float(self.logws[child]) - float(self.logws[node]))
            mass = float(np.float32(mass + p))
            ok = p > 0.0 and u < min(1.0, p / q if q > 0 else math.inf)
            out.append(Decision(self.request, depth, node, child, self.tokens[child], p, mass, u,
                                "accept" if ok else "reject"))
            if ok:
                break
        return out

    def bonus(self, node, children, rejected):
        token, mass, token_p = residual_draw(self.row_of(node), [self.tokens[c] for c in rejected], self.final_coin,
                                             self.final_mass)
        kind = "exhausted" if token < 0 else ("residual" if rejected else "leaf")
        return BonusDraw(self.request, node, token, kind, mass, self.final_coin, token_p)


def verify_p_over_q(vi: DDTreeVerifyInput, row_of, node_logws: torch.Tensor, coins: torch.Tensor,
                    final_coins: torch.Tensor, final_masses: Sequence[float | None] | None = None) -> VerifyOutput:
    """The walk under :class:`PQRule` for a batch.

    Args:
        vi: buffers ``[bs, N]``; row_of(b, i): node ``i``'s float32 row ``[V]`` of request ``b``.
        node_logws: ``[bs, N]`` float32 path log-weights of the tree (root 0).
        coins ``[bs, N]``, final_coins ``[bs]``: float32 in [0, 1).
        final_masses: per request, the bonus residual mass when the rows are prefixes (replay).
    """
    tokens, logws = vi.node_token_ids.tolist(), node_logws.tolist()
    c, f = coins.tolist(), final_coins.tolist()
    return walk_batch(vi, lambda b: PQRule(b, tokens[b], logws[b], lambda i: row_of(b, i), c[b], f[b],
                                           None if final_masses is None else final_masses[b]), "reference")


def _bonus_from_parent_row(vi, probs, out: VerifyOutput) -> VerifyOutput:
    parents = _parents_of(vi)
    bonus_tokens, emitted, draws = out.bonus_token.clone(), out.emitted_tokens.clone(), list(out.bonus)
    for b, draw in enumerate(out.bonus):
        node = draw.node
        if node <= 0 or draw.token < 0:
            continue
        rejected = [d.token for d in out.decisions[b] if d.parent == node and d.verdict == "reject"]
        assert draw.coin is not None  # a sampled verify's bonus draw carries its final coin
        token, mass, token_p = residual_draw(probs[b, parents[b][node]], rejected, float(draw.coin))
        if token < 0:
            continue
        draws[b] = dataclasses.replace(draw, token=token, residual_mass=mass, token_prob=token_p)
        bonus_tokens[b] = token
        emitted[b, int(out.accept_length[b])] = token
    return dataclasses.replace(out, bonus_token=bonus_tokens, emitted_tokens=emitted, bonus=draws)


def _parents_of(vi) -> list[list[int]]:
    from .buffers import decode_retrieve

    parents, _ = decode_retrieve(vi.retrieve_next_token, vi.retrieve_next_sibling, vi.num_nodes)
    return parents.tolist()


# -- rule variants: one departure from the target-only rule (the families rule inference fits) --

#: What a variant does to the verifier's rows (the request's parameters otherwise). ``top-k`` and
#: ``min-p`` applied twice are the same as once (both are idempotent), so only ``top-p-twice``.
ROW_VARIANTS = ("request", "temperature", "greedy", "other-order", "top-k-dropped", "top-p-dropped",
                "min-p-dropped", "top-p-twice")


@dataclass(frozen=True)
class RuleVariant:
    """A verifier that departs from the target-only rule along one axis.

    Attributes:
        rows: one of :data:`ROW_VARIANTS` (the rows the verifier computes for itself from the
            raw logits; the recorded rows stay the request's).
        temperature: the temperature of ``rows="temperature"``.
        accept: ``"cumulative"`` (``u < S_k``, the target-only test), ``"threshold"``
            (SGLang's ``u <= S_k / threshold_acc``), ``"p-over-q"`` (``u < min(1, p/q)``, ``q``
            the drafter's marginal) or ``"p-over-one-hot"`` (``q = 1``: ``u < p``).
        threshold_acc: the threshold of ``accept="threshold"``.
        coin: which coin judges a child: ``"parent"`` (the rule), ``"child"`` (each child its
            own; the per-child tests only) or ``"root"`` (the root's coin at every level).
        bonus: ``"node"`` (the rule: the final node's residual with the final coin),
            ``"walk-coin"`` (with the final node's walk coin) or ``"parent-row"`` (the final
            node's parent's row).
    """

    rows: str = "request"
    temperature: float | None = None
    accept: str = "cumulative"
    threshold_acc: float = 1.0
    coin: str = "parent"
    bonus: str = "node"

    def __post_init__(self):
        if self.rows not in ROW_VARIANTS:
            raise ValueError(f"RuleVariant.rows must be one of {ROW_VARIANTS}, got {self.rows!r}")
        if (self.rows == "temperature") != (self.temperature is not None) or (
                self.temperature is not None and not self.temperature > 0):
            raise ValueError(f"RuleVariant: temperature > 0 goes with rows='temperature' only, got rows={self.rows!r}, "
                             f"temperature={self.temperature!r}")
        if self.accept not in ("cumulative", "threshold", "p-over-q", "p-over-one-hot"):
            raise ValueError(f"RuleVariant.accept: unknown test {self.accept!r}")
        if self.coin not in ("parent", "child", "root") or (self.coin == "child" and not self.accept.startswith("p-")):
            raise ValueError(f"RuleVariant.coin {self.coin!r} with accept {self.accept!r}: 'child' goes with the "
                             "per-child tests only")
        if self.bonus not in ("node", "walk-coin", "parent-row"):
            raise ValueError(f"RuleVariant.bonus: unknown draw {self.bonus!r}")


def variant_params(p: SamplingParams, variant: RuleVariant) -> SamplingParams:
    """The parameters of the verifier's own rows under ``variant`` (``top-p-twice``: the
    request's; :func:`variant_rows` applies the second cut). Greedy requests stay greedy."""
    if p.is_greedy or variant.rows in ("request", "top-p-twice"):
        return p
    if variant.rows == "temperature":
        assert variant.temperature is not None  # RuleVariant checks it
        return dataclasses.replace(p, temperature=float(variant.temperature))
    if variant.rows == "greedy":
        return dataclasses.replace(p, temperature=0.0)
    if variant.rows == "other-order":
        return dataclasses.replace(p, order="top_p_then_top_k" if p.order == "top_k_then_top_p" else "top_k_then_top_p")
    if variant.rows == "top-k-dropped":
        return dataclasses.replace(p, top_k=0)
    if variant.rows == "top-p-dropped":
        return dataclasses.replace(p, top_p=1.0)
    return dataclasses.replace(p, min_p=None)


def variant_rows(logits: torch.Tensor, params: Sequence[SamplingParams], variant: RuleVariant,
                 num_nodes: torch.Tensor | None = None) -> torch.Tensor:
    """The verifier's own rows ``[bs, N, V]`` float32 under ``variant`` from raw ``logits
    [bs, N, V]`` (:func:`ddtree_lab.target_probs` of :func:`variant_params`; ``top-p-twice``
    applies the request's top-p cut a second time to the renormalised rows)."""
    from .sampling import top_p_mask, target_probs

    rows = target_probs(logits, [variant_params(p, variant) for p in params], num_nodes=num_nodes)
    if variant.rows == "top-p-twice":
        for b, p in enumerate(params):
            if not p.is_greedy and p.top_p < 1.0:
                again = rows[b] * top_p_mask(rows[b], p.top_p)
                rows[b] = again / again.sum(-1, keepdim=True).clamp(min=1e-30)
    return rows


def verify_variant(vi: DDTreeVerifyInput, logits: torch.Tensor, params: Sequence[SamplingParams],
                   coins: torch.Tensor, final_coins: torch.Tensor, node_logws: torch.Tensor,
                   variant: RuleVariant) -> VerifyOutput:
    """The walk of a verifier departing from the target-only rule as ``variant`` says.

    Args:
        vi: buffers ``[bs, N]``; logits: ``[bs, N, V]`` raw target logits of the tree nodes.
        params: the requests' :class:`SamplingParams` (one per request).
        coins ``[bs, N]``, final_coins ``[bs]``: float32 in [0, 1).
        node_logws: ``[bs, N]`` float32 path log-weights (the drafter's marginals for ``p/q``).
        variant: the :class:`RuleVariant`.

    Returns:
        the :class:`VerifyOutput` (its decision log holds the verifier's own numbers: its
        rows' probabilities, its coins), reported as lossless.
    """
    rows = variant_rows(logits.float(), params, variant, num_nodes=vi.num_nodes)
    c = coins.float().clone()
    if variant.coin == "root":
        c[:] = c[:, :1]
    if variant.accept.startswith("p-"):
        tokens, logws, cl, fl = vi.node_token_ids.tolist(), node_logws.tolist(), c.tolist(), final_coins.tolist()
        q = "one-hot" if variant.accept == "p-over-one-hot" else "drafter"
        coin = "child" if variant.coin == "child" else "parent"
        out = walk_batch(vi, lambda b: PQRule(b, tokens[b], logws[b], lambda i: rows[b, i], cl[b], fl[b], coin=coin,
                                              q=q), "reference")
    else:
        out = verify_sampled(vi, rows, c, final_coins, threshold_acc=variant.threshold_acc)
        out = dataclasses.replace(out, thresholds=(1.0, 1.0), lossy=False)
    if variant.bonus == "parent-row":
        out = _bonus_from_parent_row(vi, rows, out)
    elif variant.bonus == "walk-coin":
        last = torch.tensor([[i for i in row if i >= 0][-1] for row in out.accept_index.tolist()])
        reused = coins[torch.arange(vi.batch_size), last].contiguous()
        # the caller records the fresh final coin: only the draw used the walk coin
        out = verify_variant(vi, logits, params, coins, reused, node_logws, dataclasses.replace(variant, bonus="node"))
    return out


#: The named planted faults that are rule variants (outside the verifier check's catalogue).
VARIANT_FAULTS: dict[str, RuleVariant] = {
    "verifier-temperature-1": RuleVariant(rows="temperature", temperature=1.0),
    "verifier-greedy": RuleVariant(rows="greedy"),
    "verifier-p-over-q-own-coin": RuleVariant(accept="p-over-q", coin="child"),
    "verifier-root-coin": RuleVariant(coin="root"),
}


# -- the switches ---------------------------------------------------------------------------


@dataclass(frozen=True, init=False)
class Faults:
    """The planted faults of one session (none by default); the session calls each hook at its
    stage, and every hook is the identity for the faults not planted.

    Args:
        names: fault names from :data:`FAULT_KINDS` (at most one per stage).

    Raises:
        ValueError: an unknown name, or two faults of one stage (naming them).
    """

    names: tuple[str, ...] = ()

    def __init__(self, *names: str):
        flat = tuple(n for item in names for n in ([item] if isinstance(item, str) else item))
        for n in flat:
            if n not in FAULT_KINDS:
                raise ValueError(f"unknown fault {n!r}; known: {', '.join(FAULT_KINDS)}")
        for stage in (FORWARD_FAULTS, COMMIT_FAULTS, DRAFTER_FAULTS, SAMPLING_FAULTS, VERIFIER_FAULTS):
            mine = [n for n in flat if n in stage]
            if len(mine) > 1:
                raise ValueError(f"faults {mine} act on the same stage: plant one at a time")
        object.__setattr__(self, "names", flat)

    def __bool__(self) -> bool:
        return bool(self.names)

    def _one(self, stage: dict) -> str | None:
        return next((n for n in self.names if n in stage), None)

    # hooks, in the order of a step
    def draft_context(self, context):
        """The drafter's :class:`~ddtree_lab.models.drafter.DraftContext` (wrong anchor)."""
        if self._one(DRAFTER_FAULTS) != "drafter-wrong-anchor":
            return context
        anchors = torch.tensor([ids[-2] if len(ids) > 1 else ids[-1] for ids in context.committed_ids],
                               dtype=torch.int64)
        return dataclasses.replace(context, anchor_token_ids=anchors)

    def draft_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The drafter's ``[bs, L-1, V]`` logits as the tree builder reads them (mask slot)."""
        if self._one(DRAFTER_FAULTS) != "drafter-mask-slot":
            return logits
        out = logits.clone()
        out[:, 1:] = logits[:, :-1]
        return out

    def drafter_features(self, features: torch.Tensor, prefill: bool = False) -> torch.Tensor:
        """The ``[n_new, k*H]`` features handed to ``Drafter.commit`` (zero or stale)."""
        name = self._one(DRAFTER_FAULTS)
        if name == "drafter-features-zero":
            return torch.zeros_like(features)
        if name == "drafter-features-stale" and not prefill and features.shape[0]:
            return features[:1].expand_as(features).clone()
        return features

    def forward_input(self, vi: DDTreeVerifyInput, parents: torch.Tensor) -> DDTreeVerifyInput:
        """The buffers the target's tree forward reads (:func:`forward_input`)."""
        name = self._one(FORWARD_FAULTS)
        return vi if name is None else forward_input(vi, parents, name)

    def verify_params(self, params: list[SamplingParams]) -> list[SamplingParams]:
        """The parameters the verifier's rows are made with (:func:`sampling_params`)."""
        name = self._one(SAMPLING_FAULTS)
        return params if name is None else [sampling_params(p, name) for p in params]

    @property
    def sampling(self) -> str | None:
        """The planted sampling fault, if any (the verifier's rows are then made with
        :meth:`verify_params`)."""
        return self._one(SAMPLING_FAULTS)

    @property
    def verifier(self) -> str | None:
        """The planted verifier fault, if any (the session then verifies with :meth:`verify`)."""
        return self._one(VERIFIER_FAULTS)

    def verify(self, vi: DDTreeVerifyInput, probs: torch.Tensor, coins: torch.Tensor, final: torch.Tensor,
               node_logws: torch.Tensor, logits: torch.Tensor | None = None,
               params: Sequence[SamplingParams] | None = None) -> tuple[VerifyOutput, torch.Tensor]:
        """The planted verifier on full rows ``probs [bs, N, V]``: ``(output, final coins used)``.
        The variants of :data:`VARIANT_FAULTS` compute their own rows from the raw ``logits
        [bs, N, V]`` under the requests' ``params``.

        Raises:
            ValueError: no verifier fault planted, or a variant without ``logits`` / ``params``.
        """
        name = self.verifier
        if name in VARIANT_FAULTS:
            if logits is None or params is None:
                raise ValueError(f"planted fault {name}: the verifier's own rows need the raw logits and the "
                                 "requests' sampling parameters")
            return verify_variant(vi, logits, params, coins, final, node_logws, VARIANT_FAULTS[name]), final
        if name == "verifier-p-over-q":
            return verify_p_over_q(vi, lambda b, i: probs[b, i], node_logws, coins, final), final
        if name == "verifier-threshold":
            out = verify_sampled(vi, probs, coins, final, threshold_acc=LOSSY_THRESHOLD_ACC)
            return dataclasses.replace(out, thresholds=(1.0, 1.0), lossy=False), final
        if name == "verifier-bonus-row":
            return _bonus_from_parent_row(vi, probs, verify_sampled(vi, probs, coins, final)), final
        if name == "verifier-final-coin-reuse":
            first = verify_sampled(vi, probs, coins, final)
            last = torch.tensor([[i for i in row if i >= 0][-1] for row in first.accept_index.tolist()])
            reused = coins[torch.arange(vi.batch_size), last].contiguous()
            return verify_sampled(vi, probs, coins, reused), reused
        raise ValueError("no verifier fault planted")

    def kept_rows(self, paths: list[list[int]]) -> list[list[int]]:
        """The tree rows the target's KV commit keeps (:func:`kept_rows`)."""
        return kept_rows(paths, self._one(COMMIT_FAULTS))


#: No planted fault: every hook is the identity.
NO_FAULTS = Faults()


def as_faults(faults: "Faults | Iterable[str] | str | None") -> Faults:
    """``None`` -> :data:`NO_FAULTS`; a name or names -> :class:`Faults`."""
    if faults is None:
        return NO_FAULTS
    if isinstance(faults, Faults):
        return faults
    if isinstance(faults, str):
        return Faults(faults)
    return Faults(*list(faults))
