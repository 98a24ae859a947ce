"""Host synchronisations counted: every place the host waits for a tensor's value.

On a GPU, reading a tensor's value on the host (``.item()``, ``.tolist()``, ``.cpu()``,
``bool(t)`` in an ``if``, ...) waits for every kernel queued before it: a *host
synchronisation*. A live step that makes many of them runs at the host's pace, not the GPU's
(issue 36). On a CPU the same calls cost nothing, but they are the same calls: counting them
on the CPU counts what the GPU would wait for, so a CPU test can hold the count down.

:class:`HostSyncCounter` is a context manager (a :class:`torch.overrides.TorchFunctionMode`)
that counts, while active, each call on a tensor in :data:`SYNC_CALLS`, grouped by call site
(the innermost frame outside torch and this module)::

    with HostSyncCounter() as syncs:
        session.step(64)
    print(syncs.total, syncs.by_site())

What it sees (checked on torch 2.13 by ``tests/test_host_syncs.py``): Tensor methods and
dunders go through ``__torch_function__``, so ``item``, ``tolist``, ``cpu``, ``numpy``,
``__array__`` (``np.asarray(t)``), ``__bool__`` (``if t:``, ``bool(t)``, ``and`` / ``or``),
``__int__``, ``__float__``, ``__index__`` (``range(t)``, ``list[t]``), ``__complex__``,
``__format__`` of a one-element tensor, and the torch functions that read values to size their
output (``nonzero``, ``argwhere``, ``masked_select``, ``unique``, ``equal``, boolean-mask
indexing, ``repeat_interleave`` without ``output_size``) are counted. A ``.to(...)`` or
``copy_`` counts when it moves data between two devices, in either direction (a plain
host-to-device copy from pageable memory also synchronises the stream), unless it is
``non_blocking`` with its host side in pinned memory (:func:`to_device` makes such copies). On
a CPU-only run no copy crosses devices, so the CPU count cannot see host-to-device copies:
the live step routes each one through :func:`to_device`, and the GPU plan checks them with
``torch.cuda.set_sync_debug_mode`` (``benchmarks/gpu_plan.py``, step ``host-syncs``). Not seen: code that reads a tensor's storage outside torch's Python API (C
extensions, ``tensor.data_ptr()`` arithmetic), and calls made while another torch-function
mode handles a call (torch disables modes inside their own handler, so a call is counted once,
at the outermost level).
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["SYNC_CALLS", "HostSync", "HostSyncCounter", "to_device"]

_ALWAYS = {
    "item", "tolist", "cpu", "numpy", "__array__", "__bool__", "__int__", "__float__", "__index__",
    "__complex__", "nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "equal", "allclose",
}
# Calls that wait only in some forms (decided by _waits).
_SOMETIMES = {"__format__", "__getitem__", "repeat_interleave", "to", "copy_"}
SYNC_CALLS = frozenset(_ALWAYS | _SOMETIMES)
"""Names of the tensor calls that may wait for a value (see the module docstring)."""

_TORCH_DIR = os.path.dirname(torch.__file__)
_HERE = os.path.abspath(__file__)


@dataclass(frozen=True)
class HostSync:
    """One counted call: ``call`` (e.g. ``"item"``), ``site`` (``file:line in function`` of the
    innermost frame outside torch and this module)."""

    call: str
    site: str


def _is_bool_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def _device_of(value) -> torch.device | None:
    if isinstance(value, torch.Tensor):
        return value.device
    if isinstance(value, (str, torch.device)):
        try:
            return torch.device(value)
        except (RuntimeError, TypeError):
            return None
    return None


def _waits(name: str, args, kwargs) -> bool:
    if name in _ALWAYS:
        return True
    if name == "__format__":
        return isinstance(args[0], torch.Tensor) and args[0].numel() == 1
    if name == "__getitem__":
        return len(args) > 1 and _is_bool_index(args[1])
    if name == "repeat_interleave":
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        return isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None
    source = args[0] if args and isinstance(args[0], torch.Tensor) else None
    non_blocking = bool(kwargs.get("non_blocking", False))
    if name == "to":
        target = kwargs.get("device")
        for a in args[1:]:
            target = target or _device_of(a)
            non_blocking = non_blocking or (isinstance(a, bool) and a)
        target = _device_of(target)
        if source is None or target is None or target.type == source.device.type:
            return False
        return not (non_blocking and source.device.type == "cpu" and source.is_pinned())
    if name == "copy_":
        other = args[1] if len(args) > 1 else kwargs.get("src")
        non_blocking = non_blocking or (len(args) > 2 and bool(args[2]))
        if source is None or not isinstance(other, torch.Tensor) or source.device.type == other.device.type:
            return False
        host = source if source.device.type == "cpu" else other
        return not (non_blocking and host.is_pinned())
    return False


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """``t`` on ``device`` without making the host wait (issue 36).

    A host tensor bound for a CUDA device is copied through pinned memory with
    ``non_blocking=True``: a plain ``t.to("cuda")`` from pageable memory synchronises the
    stream, waiting for every kernel queued before it. Anything else is ``t.to(device)``.
    """
    device = torch.device(device)
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _call_site() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if path != _HERE and not path.startswith(_TORCH_DIR):
            return f"{_short(path)}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "<unknown>"


def _short(path: str) -> str:
    parts = path.split(os.sep)
    for anchor in ("ddtree_lab", "transformers", "tests", "benchmarks", "scripts"):
        if anchor in parts:
            return "/".join(parts[len(parts) - 1 - parts[::-1].index(anchor):])
    return path


class HostSyncCounter(TorchFunctionMode):
    """Count host synchronisations (module docstring) while the ``with`` block runs.

    Attributes:
        syncs: list of :class:`HostSync`, in call order.

    Properties and methods: ``total`` (``len(syncs)``), ``by_site()`` and ``by_call()``
    (:class:`collections.Counter` s), ``table()`` (the sites as text, most frequent first).

    The counter costs a Python frame walk per counted call and a dict lookup per torch call;
    it is a test and measurement tool, not for production runs.
    """

    def __init__(self):
        super().__init__()
        self.syncs: list[HostSync] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in SYNC_CALLS and _waits(name, args, kwargs):
            self.syncs.append(HostSync(name, _call_site()))
        return func(*args, **kwargs)

    @property
    def total(self) -> int:
        """How many synchronisations were counted."""
        return len(self.syncs)

    def by_site(self) -> Counter:
        """``Counter`` of ``(site, call)`` pairs."""
        return Counter((s.site, s.call) for s in self.syncs)

    def by_call(self) -> Counter:
        """``Counter`` of call names."""
        return Counter(s.call for s in self.syncs)

    def table(self, limit: int | None = None) -> str:
        """The sites, most frequent first: ``count  call  site`` lines."""
        rows = self.by_site().most_common(limit)
        return "\n".join(f"{n:6d}  {call:<12} {site}" for (site, call), n in rows)
