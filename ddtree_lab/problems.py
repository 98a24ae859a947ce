"""Problem: one broken invariant of a recorded step, as fields (the bottom of the layers).

Every check of a step returns these: the buffer validator
(:func:`ddtree_lab.buffers.find_retrieve_problems`), the fast invariants
(:func:`ddtree_lab.check`), the doctor's model checks (:func:`ddtree_lab.doctor`). Callers read
the fields, never the message: the message is for people.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["Problem"]


@dataclass(frozen=True)
class Problem:
    """One broken invariant.

    Attributes:
        kind: a short stable identifier of the invariant (``cycle``, ``unreachable``,
            ``mask_missing_ancestor``, ``coin_range``, ``children_mass``, ``emitted``, ...).
        step, request, node: where (None where it does not apply; ``request`` is the batch row
            for raw buffers; ``node`` a local node index; for a sibling cycle, the parent whose
            chain loops).
        field: the recorded field at fault (``retrieve_next_token``, ``positions``,
            ``tree_mask``, ``coins``, ``child_probs``, ``final_mass``, ``emitted``, ...).
        value: the number found, where the invariant is about one (e.g. a mass 1.00002).
        limit: the bound or the expected value it broke (e.g. 1.0, or the expected position).
        message: one line for people, without the ``step .., request .., node ..:`` prefix.
        part: the stage concerned in a step check (``buffers``, ``tree``, ``rows``, ``coins``,
            ``output``, ``model``), or None (raw buffers).
        nodes: the nodes involved (a cycle's nodes in link order, the mask's wrong columns, ...).
    """

    kind: str
    step: int | None = None
    request: int | None = None
    node: int | None = None
    field: str | None = None
    value: float | None = None
    limit: float | None = None
    message: str = ""
    part: str | None = None
    nodes: tuple[int, ...] = ()

    def __str__(self) -> str:
        where = ", ".join(f"{name} {v}" for name, v in (("step", self.step), ("request", self.request),
                                                         ("node", self.node)) if v is not None)
        what = f"{self.part}: " if self.part else ""
        return f"{where}: {what}{self.message}" if where else f"{what}{self.message}"

    def to_dict(self) -> dict:
        """The fields as plain JSON values (``nodes`` a list)."""
        out = asdict(self)
        out["nodes"] = list(self.nodes)
        return out
