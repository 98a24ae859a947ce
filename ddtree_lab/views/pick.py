"""Which recorded step a view opens on: the informative one, not blindly the first."""

from __future__ import annotations

from ..step import Run, Step

__all__ = ["informative_step", "WIDE_FAN"]

#: children drawn per parent in the overview pictures (a first step's root has ``B`` children).
WIDE_FAN = 12


def informative_step(run: Run, request: int | None = None) -> Step:
    """The step with the longest accepted path (ties: the earliest recorded; among the
    request's steps when ``request`` is given), so a view opens on a step where the tree
    mattered rather than on step 0, whose root fans out over every first-level draft.

    Raises:
        ValueError: the run (or the request) has no recorded steps.
    """
    steps = run.steps if request is None else run.for_request(request)
    if not steps:
        where = "the run" if request is None else f"request {request}"
        raise ValueError(f"{where} has no recorded steps")
    return max(steps, key=lambda s: (s.accept_length, -steps.index(s)))
