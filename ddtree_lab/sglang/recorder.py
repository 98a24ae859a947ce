"""Recording SGLang's verify calls: wrapping its kernels, and the import hook that patches them.

**What is recorded.** SGLang verifies a batch by calling one of three kernels with flat
buffers (:mod:`ddtree_lab.sglang.buffers`): ``verify_tree_greedy_func`` (greedy),
``tree_speculative_sampling_target_only`` (sampled; EAGLE and the DFlash sampling verify) and
``chain_speculative_sampling_triton`` (EAGLE's rejection sampler). :class:`SGLangRecorder`
wraps those callables; each call becomes one *recorded step*
(:mod:`ddtree_lab.sglang.recording` gives its fields): for every kept batch row the
candidates, the three ``retrive_*`` buffers, the target rows the kernel read (greedy:
``target_predict``; sampled: the ``target_probs`` rows of the accepted path, the only rows the
kernel reads, or every row with ``prob_rows="all"``), the coins, the thresholds and the
kernel's outputs; plus SGLang's request ids and sampling parameters when the batch is known.

**Cost and bounds.** Nothing is patched unless :meth:`SGLangRecorder.install` (or
:func:`~ddtree_lab.sglang.environment.install_from_env`) is called: off means SGLang's own functions, untouched. When on,
a call outside the filter (:class:`RecordFilter`: rank, call range, request ids, rows per
call, total calls) costs one Python check. A recorder error never reaches SGLang: it is kept
in ``recorder.errors`` and the kernel runs as usual.

**Tensor parallelism.** Every TP rank runs the verify kernel; SGLang broadcasts rank 0's
sampled outputs to the others, so rank 0's record is what was committed. The recorder keeps
only calls on ``RecordFilter.rank`` (default 0; the rank is ``torch.distributed.get_rank()``
when a process group exists, else 0) and writes it into every step.

**In a server or offline engine** SGLang runs its model in scheduler subprocesses: the
environment switch (:mod:`ddtree_lab.sglang.environment`: :func:`~ddtree_lab.sglang.environment.install_from_env`,
:func:`~ddtree_lab.sglang.environment.hook_dir`) installs a recorder in each.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.abc
import importlib.machinery
import inspect
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from .recording import KINDS, Recording, save_recording

if TYPE_CHECKING:  # imported where the append-only layout is chosen
    from .append import AppendSink

__all__ = ["PATCH_POINTS", "RecordFilter", "SGLangRecorder"]

PATCH_POINTS: dict[str, dict[str, str]] = {
    # where the kernels are defined (consumers imported after install() get the wrapped ones)
    "sglang.kernels.ops.speculative.spec_tree": {"verify_tree_greedy_func": "greedy"},
    "sglang.kernels.ops.speculative.verify_sampling": {
        "tree_speculative_sampling_target_only": "target_only",
        "chain_speculative_sampling_triton": "chain",
    },
    # the consumers, which import them by name (needed when they were imported before install())
    "sglang.srt.speculative.eagle_utils": {
        "eagle_sample": "context",
        "verify_tree_greedy_func": "greedy",
        "tree_speculative_sampling_target_only": "target_only",
        "chain_speculative_sampling_triton": "chain",
    },
    "sglang.srt.speculative.eagle_worker_common": {"eagle_sample": "context"},
    "sglang.srt.speculative.ngram_worker": {"eagle_sample": "context"},
    "sglang.srt.speculative.dflash_utils": {"tree_speculative_sampling_target_only": "target_only"},
    "sglang.srt.speculative.uno_utils": {"chain_speculative_sampling_triton": "chain"},
}
"""Where SGLang 0.5.23 defines and looks up its verify kernels (module -> attribute -> kind).

The consumers import the kernels (and ``eagle_sample``) by name, so the names are patched both
where they are defined and in every consumer; a name already wrapped is left alone.
``eagle_sample`` (kind ``context``) is wrapped only to learn the batch's request ids,
``seq_lens`` and sampling parameters. DFlash's sampling verify
(``compute_dflash_sampling_correct_drafts_and_bonus``) has no batch in scope: its steps carry
batch rows (``row0``...), not request ids."""


# ---- filter and recorder ---------------------------------------------------------------------


@dataclass
class RecordFilter:
    """Which verify calls and rows a :class:`SGLangRecorder` keeps.

    Attributes:
        rank: the only tensor-parallel rank that records.
        max_steps: calls recorded at most (then the recorder stops looking).
        calls: ``(start, stop)`` range of call indices (counted per process from 0, every
            verify call, recorded or not), or None for all.
        requests: request ids to keep (SGLang ``rid``); None keeps every row. Needs the
            batch context (EAGLE path); without it no row matches a request filter.
        max_rows: rows kept per call (the first ones that pass ``requests``).
        prob_rows: ``"path"`` keeps the target-probability rows of the accepted path (all
            a sampled kernel reads; exact replay), ``"all"`` every row.
        kinds: kernel kinds to record.
    """

    rank: int = 0
    max_steps: int = 64
    calls: tuple[int, int] | None = None
    requests: frozenset[str] | None = None
    max_rows: int = 8
    prob_rows: str = "path"
    kinds: tuple[str, ...] = KINDS

    def __post_init__(self):
        if self.prob_rows not in ("path", "all"):
            raise ValueError(f"prob_rows must be 'path' or 'all', got {self.prob_rows!r}")
        bad = [k for k in self.kinds if k not in KINDS]
        if bad:
            raise ValueError(f"unknown kinds {bad}; known: {KINDS}")
        if self.requests is not None:
            self.requests = frozenset(str(r) for r in self.requests)


def _current_rank() -> int:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
    except Exception:
        pass
    return 0


_ALIASES = {"retrieve_index": "retrive_index", "retrieve_next_token": "retrive_next_token",
            "retrieve_next_sibling": "retrive_next_sibling"}


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").clone()


class SGLangRecorder:
    """Wraps SGLang's verify kernels and keeps each call as a plain dict (module docstring).

    Use :meth:`wrap` on a kernel callable, or :meth:`install` to patch SGLang's modules
    (:data:`PATCH_POINTS`); :meth:`uninstall` (or leaving the ``with`` block) restores them.
    ``steps`` is the list of recorded steps; :meth:`save` writes them.
    """

    def __init__(self, record_filter: RecordFilter | None = None, *, on_step: Callable[["SGLangRecorder"], None] | None = None):
        self.filter = record_filter or RecordFilter()
        self.steps: list[dict] = []
        self.prompts: dict[str, dict] = {}  # request id -> {"prompt", "prompt_token_ids"}, where known
        self.errors: list[str] = []
        self.calls_seen = 0
        self.calls_recorded = 0
        self.on_step = on_step
        self._context = threading.local()
        self._patched: list[tuple[Any, str, Any]] = []
        self._finder: _PatchFinder | None = None
        self._lock = threading.Lock()
        self.sink: AppendSink | None = None  # an append-only file (:class:`AppendSink`), or None

    # -- context --------------------------------------------------------------------------
    def set_context(self, request_ids: Sequence[str] | None = None, seq_lens: torch.Tensor | None = None,
                    sampling: dict[str, list] | None = None, reqs: Sequence[Any] | None = None) -> None:
        """The batch the next verify calls belong to: request ids per row, ``seq_lens``, sampling,
        and SGLang's ``Req`` objects (their prompt text / token ids are kept once per recorded request)."""
        self._context.value = {"request_ids": None if request_ids is None else [str(r) for r in request_ids],
                               "seq_lens": None if seq_lens is None else _cpu(seq_lens).to(torch.int64),
                               "sampling": sampling, "reqs": reqs}

    def clear_context(self) -> None:
        self._context.value = None

    def _get_context(self) -> dict | None:
        return getattr(self._context, "value", None)

    # -- wrapping -------------------------------------------------------------------------
    def wants_call(self, index: int | None = None) -> bool:
        """Whether verify call ``index`` (default: the next one) is recorded (rank, call range, step limit)."""
        f = self.filter
        index = self.calls_seen if index is None else index
        if self.calls_recorded >= f.max_steps:
            return False
        if f.calls is not None and not f.calls[0] <= index < f.calls[1]:
            return False
        return _current_rank() == f.rank

    def wrap(self, fn: Callable, kind: str) -> Callable:
        """``fn`` wrapped so that each call is recorded as a step of ``kind`` (greedy,
        target_only, chain) or, for kind ``context``, sets the batch context (``eagle_sample``)."""
        if kind == "context":
            return self._wrap_context(fn)
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS + ('context',)}, got {kind!r}")
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):
            signature = None
        recorder = self

        @functools.wraps(fn)
        def recorded(*args, **kwargs):
            index = recorder.calls_seen
            recorder.calls_seen += 1
            if kind not in recorder.filter.kinds or not recorder.wants_call(index):
                return fn(*args, **kwargs)
            before = None
            try:
                bound = signature.bind(*args, **kwargs) if signature is not None else None
                before = recorder._before(bound, kind) if bound is not None else None
            except Exception as err:
                recorder.errors.append(f"call {index}: could not read the arguments: {type(err).__name__}: {err}")
            if before is not None and recorder.sink is not None:
                recorder._write_inputs(before, kind, index, getattr(fn, "__name__", str(fn)))  # before the kernel
            result = fn(*args, **kwargs)
            if before is not None:
                try:
                    recorder._after(before, kind, index, getattr(fn, "__name__", str(fn)))
                except Exception as err:
                    recorder.errors.append(f"call {index}: could not record: {type(err).__name__}: {err}")
            return result

        setattr(recorded, "__ddtree_lab_original__", fn)  # ad-hoc: marks the wrapper (read back with getattr)
        return recorded

    def _wrap_context(self, fn: Callable) -> Callable:
        recorder = self

        @functools.wraps(fn)
        def with_context(verify_input, batch, *args, **kwargs):
            try:
                info = getattr(batch, "sampling_info", None)
                sampling = None
                if info is not None:
                    sampling = {}
                    for name, attr in (("temperature", "temperatures"), ("top_k", "top_ks"), ("top_p", "top_ps")):
                        value = getattr(info, attr, None)
                        if isinstance(value, torch.Tensor):
                            sampling[name] = value.detach().float().reshape(-1).cpu().tolist()
                recorder.set_context([r.rid for r in batch.reqs], getattr(batch, "seq_lens", None), sampling,
                                     batch.reqs)
            except Exception as err:
                recorder.errors.append(f"context: {type(err).__name__}: {err}")
            try:
                return fn(verify_input, batch, *args, **kwargs)
            finally:
                recorder.clear_context()

        setattr(with_context, "__ddtree_lab_original__", fn)  # ad-hoc: marks the wrapper (read back with getattr)
        return with_context

    def _rows(self, bs: int) -> tuple[list[int], list[str] | None]:
        ctx = self._get_context()
        ids = ctx["request_ids"] if ctx and ctx["request_ids"] is not None and len(ctx["request_ids"]) == bs else None
        rows = list(range(bs))
        if self.filter.requests is not None:
            rows = [b for b in rows if ids is not None and ids[b] in self.filter.requests]
        return rows[: self.filter.max_rows], ids

    def _before(self, bound: inspect.BoundArguments, kind: str) -> dict | None:
        a = {_ALIASES.get(k, k): v for k, v in bound.arguments.items()}
        cand = a["candidates"]
        bs, n = cand.shape
        rows, ids = self._rows(bs)
        if not rows:
            return None
        sel = torch.tensor(rows, dtype=torch.long, device=cand.device)
        t = {
            "candidates": _cpu(cand.index_select(0, sel)).to(torch.int64),
            "retrive_next_token": _cpu(a["retrive_next_token"].index_select(0, sel)).to(torch.int64),
            "retrive_next_sibling": _cpu(a["retrive_next_sibling"].index_select(0, sel)).to(torch.int64),
        }
        ri = _cpu(a["retrive_index"].index_select(0, sel)).to(torch.int64)
        t["retrive_index"] = torch.where(ri >= 0, ri - (sel.cpu() * n)[:, None], -1)  # local rows
        keep = {"rows": rows, "sel": sel, "bs": bs, "n": n, "t": t, "args": a, "request_ids": ids}
        if kind == "greedy":
            t["target_predict"] = _cpu(a["target_predict"].reshape(bs, n).index_select(0, sel)).to(torch.int64)
        else:
            keep["target_probs"] = a["target_probs"]  # read after the call, only the rows used
            t["uniform_samples"] = _cpu(a["uniform_samples"].index_select(0, sel)).float()
            t["uniform_samples_final"] = _cpu(a["uniform_samples_for_final_sampling"].index_select(0, sel)).float()
            if kind == "chain":  # the Triton chain kernel does not write draft_probs; the CUDA tree kernel does
                t["draft_probs"] = _cpu(a["draft_probs"].index_select(0, sel)).float()
            keep["thresholds"] = (float(a.get("threshold_single", 1.0)), float(a.get("threshold_acc", 1.0)))
            keep["block_verification"] = bool(a.get("block_verification", False))
        return keep

    def _after(self, keep: dict, kind: str, index: int, kernel: str) -> None:
        a, sel, n, rows = keep["args"], keep["sel"], keep["n"], keep["rows"]
        t = keep["t"]
        s = int(a["accept_index"].shape[1])
        accept_global = _cpu(a["accept_index"].index_select(0, sel)).to(torch.int64)
        base = (sel.cpu() * n)[:, None]
        t["accept_index"] = torch.where(accept_global >= 0, accept_global - base, -1)  # local nodes
        t["accept_token_num"] = _cpu(a["accept_token_num"].index_select(0, sel)).to(torch.int64)
        pred = a["predicts"].reshape(keep["bs"], n)
        t["predicts"] = _cpu(pred.index_select(0, sel)).to(torch.int64)
        if kind != "greedy":
            probs = keep["target_probs"]
            vocab = int(probs.shape[-1])
            probs = probs.reshape(keep["bs"], n, vocab)
            if self.filter.prob_rows == "all":
                nodes = torch.arange(n).expand(len(rows), n).clone()
            else:
                nodes = t["accept_index"].clone()  # -1 padded
            gathered = torch.zeros(nodes.shape[0], nodes.shape[1], vocab, dtype=torch.float32)
            for r, b in enumerate(rows):
                valid = nodes[r] >= 0
                idx = nodes[r][valid].to(probs.device)
                gathered[r, : int(valid.sum())] = probs[b].index_select(0, idx).float().cpu()
            t["target_prob_rows"] = gathered
            t["target_prob_nodes"] = nodes
        step = self._fields(keep, kind, index, kernel)
        step["num_speculative_tokens"] = s
        with self._lock:
            self.steps.append(step)
            self.calls_recorded += 1
        if self.sink is not None:
            out = {k: v for k, v in t.items() if self.filter.prob_rows == "path" or not k.startswith("target_prob_")}
            if not self.sink.outputs(index, s, out):
                self._sink_stopped()
        if self.on_step is not None:
            self.on_step(self)

    def _fields(self, keep: dict, kind: str, index: int, kernel: str) -> dict:
        """A recorded step's fields known before the kernel runs (its tensors: ``keep["t"]``)."""
        t, sel, n, rows = keep["t"], keep["sel"], keep["n"], keep["rows"]
        ctx = self._get_context()
        step = {
            "kind": kind,
            "call": index,
            "rank": _current_rank(),
            "kernel": kernel,
            "rows": rows,
            "request_ids": [keep["request_ids"][b] for b in rows] if keep["request_ids"] else [f"row{b}" for b in rows],
            "draft_token_num": n,
            "time": time.time(),
            "tensors": t,
        }
        if kind != "greedy":
            step["threshold_single"], step["threshold_acc"] = keep["thresholds"]
            step["block_verification"] = keep["block_verification"]
        if ctx is not None:
            if ctx["seq_lens"] is not None and ctx["seq_lens"].numel() == keep["bs"]:
                t["seq_lens"] = ctx["seq_lens"][sel.cpu()]
            if ctx["sampling"]:
                step["sampling"] = {k: [v[b] for b in rows] for k, v in ctx["sampling"].items() if len(v) == keep["bs"]}
            reqs = ctx.get("reqs")
            if reqs is not None and len(reqs) == keep["bs"]:
                for b in rows:
                    self._keep_prompt(reqs[b])
        return step

    def _write_inputs(self, keep: dict, kind: str, index: int, kernel: str) -> None:
        """Write a call's inputs to :attr:`sink` before its kernel runs (never raises)."""
        try:
            step = self._fields(keep, kind, index, kernel)
            step["tensors"] = dict(step["tensors"])
            if kind != "greedy" and self.filter.prob_rows == "all":  # every row the kernel could read
                probs = keep["target_probs"].reshape(keep["bs"], keep["n"], int(keep["target_probs"].shape[-1]))
                step["tensors"]["target_prob_rows"] = _cpu(probs.index_select(0, keep["sel"])).float()
                step["tensors"]["target_prob_nodes"] = torch.arange(keep["n"]).expand(len(keep["rows"]), -1).clone()
            assert self.sink is not None  # the wrapper writes inputs only to a sink
            if not self.sink.inputs(step):
                self._sink_stopped()
        except Exception as err:
            self.errors.append(f"call {index}: could not write the inputs: {type(err).__name__}: {err}")

    def _sink_stopped(self) -> None:
        stopped = self.sink.stopped if self.sink is not None else None
        if stopped and stopped not in self.errors:
            self.errors.append(stopped)
            print(f"[ddtree-lab] SGLang recorder {stopped}; SGLang goes on", file=sys.stderr)

    def _keep_prompt(self, req: Any) -> None:
        rid = str(getattr(req, "rid", ""))
        if not rid or rid in self.prompts:
            return
        text = getattr(req, "origin_input_text", None)
        ids = getattr(req, "origin_input_ids", None)
        self.prompts[rid] = {"prompt": text if isinstance(text, str) else None,
                             "prompt_token_ids": None if ids is None else [int(t) for t in ids]}

    # -- patching SGLang ------------------------------------------------------------------
    def install(self, targets: dict[str, dict[str, str]] | None = None) -> "SGLangRecorder":
        """Patch the verify kernels where SGLang looks them up (default :data:`PATCH_POINTS`).

        Modules already imported are patched now; the others when they are imported.
        """
        targets = PATCH_POINTS if targets is None else targets
        pending = {}
        for module_name, attrs in targets.items():
            module = sys.modules.get(module_name)
            if module is not None:
                self._patch_module(module, attrs)
            else:
                pending[module_name] = attrs
        if pending:
            self._finder = _PatchFinder(pending, self._patch_module)
            sys.meta_path.insert(0, self._finder)
        return self

    def _patch_module(self, module, attrs: dict[str, str]) -> None:
        for attr, kind in attrs.items():
            fn = getattr(module, attr, None)
            if fn is None or getattr(fn, "__ddtree_lab_original__", None) is not None:
                continue
            self._patched.append((module, attr, fn))
            setattr(module, attr, self.wrap(fn, kind))

    def uninstall(self) -> None:
        """Restore every patched attribute and remove the import hook."""
        for module, attr, fn in reversed(self._patched):
            setattr(module, attr, fn)
        self._patched.clear()
        if self._finder is not None and self._finder in sys.meta_path:
            sys.meta_path.remove(self._finder)
        self._finder = None

    @property
    def installed(self) -> list[str]:
        """``module.attr`` names patched now."""
        return [f"{m.__name__}.{a}" for m, a, _ in self._patched]

    def __enter__(self) -> "SGLangRecorder":
        """``with recorder.install(targets):`` or ``with recorder:`` (installs :data:`PATCH_POINTS`)."""
        if not self._patched and self._finder is None:
            self.install()
        return self

    def __exit__(self, *exc) -> None:
        self.uninstall()

    # -- output ---------------------------------------------------------------------------
    def drop_steps(self) -> None:
        """Forget the steps kept in memory (an append-only sink has them on disk already)."""
        with self._lock:
            self.steps.clear()

    def run_metadata(self, metadata: dict | None = None) -> dict:
        """The recording's metadata now: versions, filter, errors, calls seen, prompts, plus ``metadata``."""
        meta = _default_metadata()
        meta.update({"filter": _filter_dict(self.filter), "errors": list(self.errors), "calls_seen": self.calls_seen,
                     "prompts": dict(self.prompts)})
        meta.update(metadata or {})
        return meta

    def save(self, path: str | os.PathLike, metadata: dict | None = None) -> tuple[Path, Path]:
        """Write the steps to ``path.json`` + ``path.safetensors`` (:func:`save_recording`)."""
        return save_recording(self.steps, path, self.run_metadata(metadata))

    def recording(self, metadata: dict | None = None) -> Recording:
        """The steps recorded so far as a :class:`~ddtree_lab.sglang.recording.Recording`."""
        meta = _default_metadata()
        meta["prompts"] = dict(self.prompts)
        meta.update(metadata or {})
        return Recording(meta, list(self.steps))

    def to_trace(self, metadata: dict | None = None):
        """The recorded steps as a lab :class:`ddtree_lab.step.Run`
        (:func:`ddtree_lab.sglang.replay.recording_to_trace`)."""
        from .replay import recording_to_trace

        return recording_to_trace(self.recording(metadata))


class _PatchFinder(importlib.abc.MetaPathFinder):
    """Patches a module's attributes right after the module is first imported."""

    def __init__(self, pending: dict[str, dict[str, str]], patch: Callable):
        self.pending = dict(pending)
        self.patch = patch

    def find_spec(self, name, path=None, target=None):
        if name not in self.pending:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        attrs = self.pending.pop(name)
        loader, patch = spec.loader, self.patch
        exec_module = loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            patch(module, attrs)

        loader.exec_module = exec_and_patch
        return spec


def _filter_dict(f: RecordFilter) -> dict:
    d = dataclasses.asdict(f)
    d["requests"] = None if f.requests is None else sorted(f.requests)
    d["kinds"] = list(f.kinds)
    return d


def _default_metadata() -> dict:
    meta = {"torch": torch.__version__, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "pid": os.getpid(), "cuda": torch.cuda.is_available()}
    try:
        import sglang

        meta["sglang"] = getattr(sglang, "__version__", "unknown")
    except Exception:
        meta["sglang"] = None
    meta["triton_interpret"] = os.environ.get("TRITON_INTERPRET") == "1"
    return meta
