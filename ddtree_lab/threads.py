"""How many CPU threads torch should use on this machine.

torch's default is one thread per core it sees. On a shared machine whose cores are busy
with other programs that oversubscribes the CPU: on a 2-core box under load, live decoding
of 24 tokens took 83 s with torch's default 2 threads and 5.3 s with 1 thread. The lab
therefore picks the count itself, from what this process may really use:

* the cores it may run on (``os.sched_getaffinity``; ``os.cpu_count()`` where that is missing);
* the cgroup CPU quota (``/sys/fs/cgroup/cpu.max``, cgroup v2: ``quota period``, ``max`` = none);
* the load of the rest of the machine (the 1-minute load average, ``os.getloadavg``).

``threads = max(1, min(cores, quota) - round(load))``, capped at the cores. Overrides, first
match wins:

1. ``DDTREE_LAB_THREADS=N`` (an int >= 1) or ``DDTREE_LAB_THREADS=torch`` (leave torch's own
   choice alone);
2. ``OMP_NUM_THREADS`` set in the environment: torch already obeys it, the lab leaves it.

:func:`configure_threads` applies the choice once per process; :class:`ddtree_lab.LiveSession`,
:func:`ddtree_lab.notebook.load_default`, the CLI and the benchmarks call it. A later explicit
``torch.set_num_threads`` by the user wins (the lab never calls it a second time).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Mapping

__all__ = ["ThreadChoice", "choose_threads", "configure_threads", "ENV_VAR"]

ENV_VAR = "DDTREE_LAB_THREADS"
_CPU_MAX = "/sys/fs/cgroup/cpu.max"


@dataclass(frozen=True)
class ThreadChoice:
    """The thread count and why: ``threads`` (None: leave torch alone) and ``reason``."""

    threads: int | None
    reason: str


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _quota(path: str = _CPU_MAX) -> float | None:
    """CPUs allowed by the cgroup v2 quota, or None when there is none (or no such file)."""
    try:
        with open(path) as f:
            quota, period = f.read().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    try:
        return float(quota) / float(period)
    except (ValueError, ZeroDivisionError):
        return None


def _load() -> float:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0


def choose_threads(env: Mapping[str, str] | None = None, cores: int | None = None, quota: float | None = -1.0,
                   load: float | None = None) -> ThreadChoice:
    """The thread count the lab would use (module docstring), without applying it.

    Args:
        env: the environment (default ``os.environ``).
        cores, quota, load: the machine's figures (default: read from this machine; ``quota``
            ``None`` means no cgroup quota). For tests and for explaining a choice.

    Raises:
        ValueError: ``DDTREE_LAB_THREADS`` is neither an int >= 1 nor ``torch``.
    """
    env = os.environ if env is None else env
    raw = env.get(ENV_VAR)
    if raw is not None and raw.strip() != "":
        raw = raw.strip()
        if raw == "torch":
            return ThreadChoice(None, f"{ENV_VAR}=torch: torch's own default")
        try:
            n = int(raw)
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"{ENV_VAR} must be an int >= 1 or 'torch', got {raw!r}")
        return ThreadChoice(n, f"{ENV_VAR}={n}")
    if env.get("OMP_NUM_THREADS"):
        return ThreadChoice(None, f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']} (torch obeys it)")
    cores = _cores() if cores is None else cores
    quota = _quota() if quota == -1.0 else quota
    load = _load() if load is None else load
    usable = cores if quota is None else max(1, min(cores, math.floor(quota)))
    n = max(1, min(usable, usable - int(round(load))))
    # load counts every runnable process, ours included when it is already busy
    return ThreadChoice(n, f"{cores} cores, quota {'none' if quota is None else f'{quota:g} CPUs'}, "
                           f"load {load:.1f}")


_applied: ThreadChoice | None = None


def configure_threads(force: bool = False) -> ThreadChoice:
    """Apply :func:`choose_threads` to torch once per process (again with ``force``).

    Returns:
        the choice (``threads`` None: torch's setting was left as it was).
    """
    global _applied
    if _applied is not None and not force:
        return _applied
    import torch

    choice = choose_threads()
    if choice.threads is not None and torch.get_num_threads() != choice.threads:
        torch.set_num_threads(choice.threads)
    _applied = choice
    return choice
