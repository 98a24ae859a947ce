"""Greedy or sampled, for a run whose steps record no sampling parameters (the DDTree reference's traces, engines' summaries).

The lab's own runs record each request's :class:`~ddtree_lab.sampling.SamplingParams` on every
step. A run it did not record knows its temperature only where the file says so; the adapter
puts it in the run's ``metadata["requests"]`` entries as ``temperature`` (float, or None: not
recorded) and ``temperature_from`` (where it came from, e.g. :data:`FROM_ARGS`). Otherwise the
user states it (:func:`state_temperature`, ``--temperature`` on the command line); nothing here
guesses. T = 0 is greedy, T > 0 (T = 1 included) sampled.
"""

from __future__ import annotations

import math

from ..step import Run

__all__ = ["FROM_ARGS", "FROM_RECORD", "FROM_OPTION", "NOT_RECORDED", "records_parameters", "temperature_value",
           "request_temperatures", "mode_of", "state_temperature", "mode_text"]

#: Where a temperature came from: the benchmark layout's run arguments, a request's own field,
#: the command line.
FROM_ARGS = "from the file (args.temperature)"
FROM_RECORD = "from the file (the request's temperature field)"
FROM_OPTION = "from --temperature"
NOT_RECORDED = "not recorded"


def records_parameters(run: Run) -> bool:
    """Whether any step of ``run`` records its sampling parameters (then its mode is known)."""
    return any(s.params is not None for s in run.steps)


def temperature_value(value) -> float | None:
    """``value`` as a temperature (a finite number >= 0), or None when it is not one (a bool, a
    string, NaN, a negative number): never coerced."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    t = float(value)
    return t if math.isfinite(t) and t >= 0 else None


def request_temperatures(run: Run) -> list[tuple[int, float | None, str]]:
    """``(request, temperature or None, where from)`` for every entry of
    ``run.metadata["requests"]`` (a request without ``"request"``: its index there)."""
    out = []
    for i, r in enumerate(run.metadata.get("requests") or []):
        t = r.get("temperature")
        where = (r.get("temperature_from") or NOT_RECORDED) if t is not None else NOT_RECORDED
        out.append((int(r.get("request", i)), t, where))
    return out


def mode_of(temperature: float | None) -> str:
    """``"greedy"`` (T = 0), ``"sampled"`` (T > 0) or ``"unknown"`` (None)."""
    if temperature is None:
        return "unknown"
    return "greedy" if temperature == 0 else "sampled"


def state_temperature(run: Run, temperature: float, origin: str = FROM_OPTION) -> None:
    """State the temperature of every request of ``run`` whose file does not record one (in
    place: ``temperature`` and ``temperature_from`` = ``origin`` in its requests' metadata).

    Raises:
        ValueError: ``temperature`` is not a finite number >= 0; the run's steps record their
            sampling parameters (a lab run: nothing to state); the run names no requests; or a
            request's file temperature differs from ``temperature`` (both named).
    """
    t = temperature_value(temperature)
    if t is None:
        raise ValueError(f"--temperature {temperature!r}: must be a finite number >= 0 (0: greedy, > 0: sampled)")
    if records_parameters(run):
        s, params = next((s, s.params) for s in run.steps if s.params is not None)
        raise ValueError(f"--temperature: this {run.source} records each request's sampling parameters "
                         f"(step {s.step}, request {s.request}: temperature {params.temperature:g}); "
                         "--temperature states the mode of a run that does not record it")
    requests = run.metadata.get("requests") or []
    if not requests:
        raise ValueError(f"--temperature: this {run.source} names no requests to state it for")
    for req, known, where in request_temperatures(run):
        if known is not None and known != t:
            raise ValueError(f"--temperature {t:g}: request {req}'s temperature is {known:g} ({where}); "
                             "leave --temperature out or give that value")
    for r in requests:
        if r.get("temperature") is None:
            r["temperature"], r["temperature_from"] = t, origin


def mode_text(run: Run) -> str:
    """One line: the run's temperature, its mode and where it came from, per group of requests
    that share them (e.g. ``temperature 0 (greedy), from the file (args.temperature)``), or
    ``temperature not recorded: greedy or sampled is unknown (state it: --temperature T)``."""
    groups: dict[tuple[float | None, str], list[int]] = {}
    for req, t, where in request_temperatures(run):
        groups.setdefault((t, where), []).append(req)
    if not groups:
        return "temperature: not recorded (the run names no requests)"
    parts = []
    for (t, where), reqs in groups.items():
        who = "" if len(groups) == 1 else f"request{'s' if len(reqs) > 1 else ''} {', '.join(map(str, reqs))}: "
        if t is None:
            parts.append(f"{who}not recorded: greedy or sampled is unknown (state it: --temperature T, 0 = greedy)")
        else:
            parts.append(f"{who}{t:g} ({mode_of(t)}), {where}")
    return "temperature: " + "; ".join(parts)
