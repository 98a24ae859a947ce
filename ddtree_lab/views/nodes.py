"""The drawn node of a step's view (NodeView) and the statuses a node can have."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

__all__ = ["NodeView", "STATUSES"]


#: node statuses: root, accepted (on the accepted path), rejected (visited and rejected),
#: unvisited (never reached), pending (cursor views: not judged yet), collapsed (a summary).
STATUSES = ("root", "accepted", "rejected", "unvisited", "pending", "collapsed", "bonus")


@dataclass
class NodeView:
    """One drawn node.

    ``index`` is the tree node index (the bonus: ``-1``; collapsed summaries: ``-2, -3, ...``).
    Probabilities follow the module docstring; ``None`` where they do not apply or are
    unknown. ``target_p_upper``: ``target_p`` is an upper bound (token outside the stored
    top-M). ``hidden``: for a summary node, how many tree nodes it stands for. Decision
    fields (``order``, ``coin``, ``mass_before``, ``mass``) are set on visited siblings:
    ``order`` is the position of the node's decision in the walk (0-based), ``mass`` the
    verifier's ``S_k``. ``child_coin``: the coin that decides among this node's children
    (sampled only).
    """

    index: int
    token: int
    text: str
    status: str
    depth: int
    rank: int
    logw: float
    parent: int = -1
    target_p: float | None = None
    target_p_upper: bool = False
    drafter_q: float | None = None
    accept_p: float | None = None
    path_p: float | None = None
    residual_p: float | None = None
    children: list[int] = field(default_factory=list)
    hidden: int = 0
    order: int | None = None
    coin: float | None = None
    mass_before: float | None = None
    mass: float | None = None
    child_coin: float | None = None

    def target_p_text(self, digits: int = 3) -> str:
        """``p=0.123`` / ``p<1e-05`` (upper bound) / ``p=?`` (not recorded)."""
        if self.target_p is None:
            return "p=?"
        return f"p{'<' if self.target_p_upper else '='}{self.target_p:.{digits}g}"

    def drafter_q_text(self, digits: int = 2) -> str:
        return "" if self.drafter_q is None or math.isnan(self.drafter_q) else f"q={self.drafter_q:.{digits}g}"

    def to_dict(self) -> dict:
        return asdict(self)
