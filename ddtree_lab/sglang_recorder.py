"""Record SGLang's verify calls, replay them with the lab's verifiers, draw them.

**What is recorded.** SGLang verifies a batch by calling one of three kernels with flat
buffers (``ddtree_lab.sglang_bridge``, module docstring): ``verify_tree_greedy_func``
(greedy), ``tree_speculative_sampling_target_only`` (sampled; EAGLE and the DFlash sampling
verify) and ``chain_speculative_sampling_triton`` (EAGLE's rejection sampler).
:class:`SGLangRecorder` wraps those callables; each call becomes one *recorded step*, a plain
dict of tensors and scalars holding, for every kept batch row: the candidates, the three
``retrive_*`` buffers, the target rows the kernel read (greedy: ``target_predict``; sampled:
the ``target_probs`` rows of the accepted path, which are the only rows the kernel reads, or
every row with ``prob_rows="all"``), the coins, the thresholds, and the kernel's outputs;
plus SGLang's request ids and sampling parameters when the batch context is known.

**Cost and bounds.** Nothing is patched unless :meth:`SGLangRecorder.install` (or
:func:`install_from_env`) is called: off means SGLang's own functions, untouched. When on,
a call outside the filter (:class:`RecordFilter`: rank, call range, request ids, rows per
call, total calls) costs one Python check. A recorder error never reaches SGLang: it is kept
in ``recorder.errors`` and the kernel runs as usual.

**Tensor parallelism.** Every TP rank runs the verify kernel; SGLang broadcasts rank 0's
sampled outputs to the others, so rank 0's record is what was committed. The recorder keeps
only calls on ``RecordFilter.rank`` (default 0; the rank is ``torch.distributed.get_rank()``
when a process group exists, else 0) and writes it into every step.

**In a server or offline engine.** SGLang runs its model in scheduler subprocesses, so the
recorder is switched on by environment variables that every subprocess inherits, and a
``sitecustomize`` hook directory put on ``PYTHONPATH``::

    DDTREE_LAB_SGLANG_RECORD=/tmp/rec \\
    PYTHONPATH=$(python -m ddtree_lab.sglang_recorder hook-dir):$PYTHONPATH \\
    python -m sglang.launch_server --model-path ... --speculative-algorithm EAGLE ...

Each recording process writes ``/tmp/rec/sglang-rank{R}-pid{P}.json`` + ``.safetensors``
(every ``DDTREE_LAB_SGLANG_RECORD_FLUSH`` steps, at the step limit and at exit). Other
variables: ``..._RANK`` (default 0), ``..._MAX_STEPS`` (64), ``..._CALLS`` (``start:stop``),
``..._REQUESTS`` (comma-separated request ids), ``..._ROWS`` (rows per call, 8),
``..._PROB_ROWS`` (``path`` or ``all``), ``..._TARGETS`` (override the patch points, see
:data:`PATCH_POINTS`).

**Files** are JSON (metadata and scalars) + safetensors (tensors); loading never runs code
from them. :meth:`SGLangRecorder.to_trace` is the hook to the lab's trace format (issue 3).
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import html
import importlib.abc
import importlib.machinery
import inspect
import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

from .retrieve import DDTreeVerifyInput
from .sglang_bridge import compare_verify_outputs, lab_verifiers, verify_input_from_retrieve, verify_output_from_sglang
from .verify import VerifyOutput

__all__ = [
    "PATCH_POINTS",
    "RecordFilter",
    "SGLangRecorder",
    "Recording",
    "ReplayResult",
    "save_recording",
    "load_recording",
    "replay_recording",
    "replay_step",
    "step_verify_input",
    "step_parts",
    "install_from_env",
    "hook_dir",
    "draw_recorded_tree",
    "decisions_html",
    "replay_table_html",
    "record_cpu_demo",
]

FORMAT = "ddtree-lab/sglang-recording"
VERSION = 1
KINDS = ("greedy", "target_only", "chain")

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
    except Exception:  # noqa: BLE001
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
        self.errors: list[str] = []
        self.calls_seen = 0
        self.on_step = on_step
        self._context = threading.local()
        self._patched: list[tuple[Any, str, Any]] = []
        self._finder: _PatchFinder | None = None
        self._lock = threading.Lock()

    # -- context --------------------------------------------------------------------------
    def set_context(self, request_ids: Sequence[str] | None = None, seq_lens: torch.Tensor | None = None,
                    sampling: dict[str, list] | None = None) -> None:
        """The batch the next verify calls belong to: request ids per row, ``seq_lens``, sampling."""
        self._context.value = {"request_ids": None if request_ids is None else [str(r) for r in request_ids],
                               "seq_lens": None if seq_lens is None else _cpu(seq_lens).to(torch.int64),
                               "sampling": sampling}

    def clear_context(self) -> None:
        self._context.value = None

    def _get_context(self) -> dict | None:
        return getattr(self._context, "value", None)

    # -- wrapping -------------------------------------------------------------------------
    def wants_call(self, index: int | None = None) -> bool:
        """Whether verify call ``index`` (default: the next one) is recorded (rank, call range, step limit)."""
        f = self.filter
        index = self.calls_seen if index is None else index
        if len(self.steps) >= f.max_steps:
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
            except Exception as err:  # noqa: BLE001 -- never break SGLang
                recorder.errors.append(f"call {index}: could not read the arguments: {type(err).__name__}: {err}")
            result = fn(*args, **kwargs)
            if before is not None:
                try:
                    recorder._after(before, kind, index, getattr(fn, "__name__", str(fn)))
                except Exception as err:  # noqa: BLE001
                    recorder.errors.append(f"call {index}: could not record: {type(err).__name__}: {err}")
            return result

        recorded.__ddtree_lab_original__ = fn
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
                recorder.set_context([r.rid for r in batch.reqs], getattr(batch, "seq_lens", None), sampling)
            except Exception as err:  # noqa: BLE001
                recorder.errors.append(f"context: {type(err).__name__}: {err}")
            try:
                return fn(verify_input, batch, *args, **kwargs)
            finally:
                recorder.clear_context()

        with_context.__ddtree_lab_original__ = fn
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
        ctx = self._get_context()
        step = {
            "kind": kind,
            "call": index,
            "rank": _current_rank(),
            "kernel": kernel,
            "rows": rows,
            "request_ids": [keep["request_ids"][b] for b in rows] if keep["request_ids"] else [f"row{b}" for b in rows],
            "draft_token_num": n,
            "num_speculative_tokens": s,
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
        with self._lock:
            self.steps.append(step)
        if self.on_step is not None:
            self.on_step(self)

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
    def save(self, path: str | os.PathLike, metadata: dict | None = None) -> tuple[Path, Path]:
        """Write the steps to ``path.json`` + ``path.safetensors`` (:func:`save_recording`)."""
        meta = _default_metadata()
        meta.update({"filter": _filter_dict(self.filter), "errors": list(self.errors), "calls_seen": self.calls_seen})
        meta.update(metadata or {})
        return save_recording(self.steps, path, meta)

    def recording(self, metadata: dict | None = None) -> "Recording":
        meta = _default_metadata()
        meta.update(metadata or {})
        return Recording(meta, list(self.steps))

    def to_trace(self, metadata: dict | None = None, top_m: int = 16):
        """The recorded steps as a lab :class:`ddtree_lab.trace.RunTrace` (see
        :func:`recording_to_trace`)."""
        return recording_to_trace(self.recording(metadata), top_m=top_m)


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
    except Exception:  # noqa: BLE001
        meta["sglang"] = None
    meta["triton_interpret"] = os.environ.get("TRITON_INTERPRET") == "1"
    return meta


# ---- files -----------------------------------------------------------------------------------


@dataclass
class Recording:
    """Recorded SGLang verify steps plus run metadata (``steps``: plain dicts, module docstring)."""

    metadata: dict
    steps: list[dict] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.steps)


def _paths(path: str | os.PathLike) -> tuple[Path, Path]:
    p = Path(path)
    if p.suffix in (".json", ".safetensors"):
        p = p.with_suffix("")
    return p.with_name(p.name + ".json"), p.with_name(p.name + ".safetensors")


def save_recording(steps: Sequence[dict], path: str | os.PathLike, metadata: dict | None = None) -> tuple[Path, Path]:
    """Write steps as ``path.json`` (format, version, metadata, per-step scalars and tensor names)
    and ``path.safetensors`` (tensors under ``"{step}/{name}"``). Returns both paths."""
    from safetensors.torch import save_file

    json_path, st_path = _paths(path)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    tensors, entries = {}, []
    for i, step in enumerate(steps):
        entry = {k: v for k, v in step.items() if k != "tensors"}
        entry["tensors"] = sorted(step["tensors"])
        for name, value in step["tensors"].items():
            tensors[f"{i}/{name}"] = value.contiguous()
        entries.append(entry)
    doc = {"format": FORMAT, "version": VERSION, "metadata": metadata or {}, "steps": entries}
    tmp_json, tmp_st = json_path.with_suffix(".json.tmp"), st_path.with_suffix(".safetensors.tmp")
    save_file(tensors, str(tmp_st))
    tmp_json.write_text(json.dumps(doc, indent=1, sort_keys=True))
    os.replace(tmp_st, st_path)
    os.replace(tmp_json, json_path)
    return json_path, st_path


def load_recording(path: str | os.PathLike) -> Recording:
    """Read a recording written by :func:`save_recording` (no code from the file runs).

    Raises:
        ValueError: not this format, or a newer version.
    """
    from safetensors.torch import load_file

    json_path, st_path = _paths(path)
    doc = json.loads(json_path.read_text())
    if doc.get("format") != FORMAT:
        raise ValueError(f"{json_path}: not a {FORMAT} file (format {doc.get('format')!r})")
    if int(doc.get("version", 0)) > VERSION:
        raise ValueError(f"{json_path}: version {doc['version']} is newer than this reader ({VERSION})")
    tensors = load_file(str(st_path))
    steps = []
    for i, entry in enumerate(doc["steps"]):
        step = {k: v for k, v in entry.items() if k != "tensors"}
        step["tensors"] = {name: tensors[f"{i}/{name}"] for name in entry["tensors"]}
        steps.append(step)
    return Recording(doc.get("metadata", {}), steps)


# ---- replay ----------------------------------------------------------------------------------


@dataclass
class ReplayResult:
    """One recorded row replayed: SGLang's output and the lab's, and how they differ.

    ``differences`` are :func:`~ddtree_lab.sglang_bridge.compare_verify_outputs` lines;
    ``explanation`` names a known by-design difference when one accounts for them (else
    empty); ``replayable`` is False (with ``explanation``) when the lab's verifiers do not
    implement what SGLang ran (a chain with real draft probabilities, block verification).
    """

    step: int
    row: int
    request_id: str
    kind: str
    verify_input: DDTreeVerifyInput
    sglang: VerifyOutput
    lab: VerifyOutput | None
    differences: list[str]
    explanation: str = ""
    replayable: bool = True

    @property
    def agrees(self) -> bool:
        return self.replayable and not self.differences


def step_verify_input(step: dict, row: int) -> DDTreeVerifyInput:
    """The lab verify input of recorded row ``row`` (a batch of one)."""
    t = step["tensors"]
    seq = t["seq_lens"][row : row + 1] if "seq_lens" in t else 0
    return verify_input_from_retrieve(t["candidates"][row : row + 1], t["retrive_next_token"][row : row + 1],
                                      t["retrive_next_sibling"][row : row + 1], t["retrive_index"][row : row + 1], seq)


def _sglang_output(step: dict, row: int, vi: DDTreeVerifyInput) -> VerifyOutput:
    t = step["tensors"]
    return verify_output_from_sglang(vi, t["predicts"][row], t["accept_index"][row : row + 1],
                                     t["accept_token_num"][row : row + 1], backend=f"sglang-{step['kind']}")


def _prob_rows(step: dict, row: int, n: int) -> torch.Tensor:
    t = step["tensors"]
    rows, nodes = t["target_prob_rows"][row], t["target_prob_nodes"][row]
    probs = torch.zeros(1, n, rows.shape[-1], dtype=torch.float32)
    valid = nodes >= 0
    probs[0, nodes[valid]] = rows[valid]
    return probs


def _one_hot_chain(step: dict, row: int) -> bool:
    q = step["tensors"]["draft_probs"][row]
    cand = step["tensors"]["candidates"][row]
    n = cand.shape[0]
    for i in range(n - 1):
        want = torch.zeros(q.shape[-1])
        want[int(cand[i + 1])] = 1.0
        if not torch.equal(q[i], want):
            return False
    return True


def step_parts(step: dict, row: int) -> dict:
    """Everything a lab StepTrace needs from recorded row ``row`` of ``step``, as lab objects.

    Keys: ``request_id``, ``kind``, ``kernel``, ``rank``, ``call``, ``verify_input``
    (:class:`DDTreeVerifyInput`, batch of one), ``target_probs`` (``[1, N, V]``, rows the
    kernel did not read are zero; None for greedy), ``target_predict`` (``[1, N]``, greedy
    only), ``coins`` / ``final_coins`` (None for greedy), ``draft_probs`` (chain only),
    ``thresholds``, ``sampling`` (per-request values when recorded), ``sglang_output``
    (:class:`VerifyOutput`). :meth:`SGLangRecorder.to_trace` is to map these onto StepTrace.
    """
    vi = step_verify_input(step, row)
    t = step["tensors"]
    sampled = step["kind"] != "greedy"
    return {
        "request_id": step["request_ids"][row],
        "kind": step["kind"],
        "kernel": step["kernel"],
        "rank": step["rank"],
        "call": step["call"],
        "verify_input": vi,
        "target_probs": _prob_rows(step, row, vi.num_rows) if sampled else None,
        "target_predict": None if sampled else t["target_predict"][row : row + 1],
        "coins": t["uniform_samples"][row : row + 1] if sampled else None,
        "final_coins": t["uniform_samples_final"][row : row + 1] if sampled else None,
        "draft_probs": t["draft_probs"][row : row + 1] if "draft_probs" in t else None,
        "thresholds": (step.get("threshold_single", 1.0), step.get("threshold_acc", 1.0)),
        "sampling": {k: v[row] for k, v in step.get("sampling", {}).items()},
        "sglang_output": _sglang_output(step, row, vi),
    }


def _explain(step: dict, lab: VerifyOutput, sgl: VerifyOutput, vocab: int | None) -> str:
    for d in lab.decisions[0]:
        siblings = [s.target_prob for s in lab.decisions[0] if s.parent == d.parent]
        if d.verdict == "accept" and d.cumulative_mass == 1.0 and d.coin is not None and d.coin >= sum(siblings):
            # the lab's exact-arithmetic step (ddtree_lab.verify, "Floating-point edge")
            return (f"node {d.parent}'s children hold its whole row and the coin {d.coin:.8g} lies above their "
                    f"float32 sum: the lab takes node {d.node} (exact arithmetic: S = 1 > u), SGLang rejects on "
                    f"the float sum and emits {int(sgl.bonus_token[0])} (by design); the row past it was not recorded, so "
                    "the lab reports support_exhausted there")
    if lab.support_exhausted.any() and vocab is not None:
        b = int(sgl.bonus_token[0])
        same_path = torch.equal(lab.accept_length, sgl.accept_length)
        if same_path:
            rule = "token V-1" if step["kind"] == "chain" else "the last positive token, else V-1"
            return (f"empty residual after the rejections: SGLang emits {rule} (here {b}); "
                    "the lab emits no bonus and reports support_exhausted (by design)")
    return ""


def _row_lines(lines: list[str]) -> list[str]:
    """Drop the ``request 0: `` prefix of a batch-of-one comparison (the row is named elsewhere)."""
    return [line.removeprefix("request 0: ") for line in lines]


def replay_step(step: dict, row: int, backend: str = "reference", step_index: int = 0) -> ReplayResult:
    """Replay one recorded row with the lab's verifier ``backend`` (see :func:`lab_verifiers`)."""
    greedy, sampled = lab_verifiers()[backend]
    vi = step_verify_input(step, row)
    sgl = _sglang_output(step, row, vi)
    kind = step["kind"]
    rid = step["request_ids"][row]
    t = step["tensors"]
    if kind == "greedy":
        predict = t["target_predict"][row : row + 1]
        vocab = int(max(int(predict.max()), int(vi.node_token_ids.max()))) + 1
        logits = torch.full((1, vi.num_rows, vocab), -torch.inf)  # one-hot target: p = 1 at the argmax
        logits.scatter_(-1, predict[..., None], 0.0)
        lab = greedy(vi, logits)
        return ReplayResult(step_index, row, rid, kind, vi, sgl, lab, _row_lines(compare_verify_outputs(lab, sgl)))
    if kind == "chain" and (step.get("block_verification") or not _one_hot_chain(step, row)):
        why = ("block verification" if step.get("block_verification") else
               "a chain with real draft probabilities (rejection sampling p/q)")
        return ReplayResult(step_index, row, rid, kind, vi, sgl, None, [],
                            f"not replayable: the lab's verifiers implement the target-only rule, SGLang ran {why}", False)
    probs = _prob_rows(step, row, vi.num_rows)
    coins = t["uniform_samples"][row : row + 1].float()
    final = t["uniform_samples_final"][row : row + 1].float()
    try:
        lab = sampled(vi, probs, coins, final, threshold_single=step.get("threshold_single", 1.0),
                      threshold_acc=step.get("threshold_acc", 1.0))
    except ValueError as exc:
        if backend == "reference":
            raise
        # the logit-based backends cannot read a row the kernel never read (stored as zeros)
        return ReplayResult(step_index, row, rid, kind, vi, sgl, None, [],
                            f"not replayable with {backend}: {exc}", False)
    diffs = _row_lines(compare_verify_outputs(lab, sgl))
    return ReplayResult(step_index, row, rid, kind, vi, sgl, lab, diffs,
                        _explain(step, lab, sgl, probs.shape[-1]) if diffs else "")


def replay_recording(recording: Recording | Iterable[dict], backend: str = "reference") -> list[ReplayResult]:
    """Replay every recorded row with the lab's verifier ``backend``."""
    steps = recording.steps if isinstance(recording, Recording) else list(recording)
    return [replay_step(step, r, backend, i) for i, step in enumerate(steps) for r in range(len(step["rows"]))]


# ---- switching on from the environment -------------------------------------------------------

ENV_PREFIX = "DDTREE_LAB_SGLANG_RECORD"
_ENV_RECORDER: SGLangRecorder | None = None


def _parse_targets(text: str) -> dict[str, dict[str, str]]:
    targets: dict[str, dict[str, str]] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        where, _, kind = item.partition("=")
        module, _, attr = where.partition(":")
        if not (module and attr and kind):
            raise ValueError(f"{ENV_PREFIX}_TARGETS entry {item!r} is not module:attr=kind")
        targets.setdefault(module, {})[attr] = kind
    return targets


def install_from_env(environ: dict | None = None) -> SGLangRecorder | None:
    """Install a recorder configured by ``DDTREE_LAB_SGLANG_RECORD*`` (module docstring); None when unset.

    The recorder saves to ``$DDTREE_LAB_SGLANG_RECORD/sglang-rank{R}-pid{P}`` every
    ``..._FLUSH`` (8) steps, when it reaches ``..._MAX_STEPS``, and at exit.
    """
    global _ENV_RECORDER
    env = os.environ if environ is None else environ
    out_dir = env.get(ENV_PREFIX)
    if not out_dir:
        return None
    if _ENV_RECORDER is not None:
        return _ENV_RECORDER
    calls = env.get(f"{ENV_PREFIX}_CALLS")
    requests = env.get(f"{ENV_PREFIX}_REQUESTS")
    f = RecordFilter(
        rank=int(env.get(f"{ENV_PREFIX}_RANK", 0)),
        max_steps=int(env.get(f"{ENV_PREFIX}_MAX_STEPS", 64)),
        calls=tuple(int(v) for v in calls.split(":")) if calls else None,
        requests=frozenset(r.strip() for r in requests.split(",") if r.strip()) if requests else None,
        max_rows=int(env.get(f"{ENV_PREFIX}_ROWS", 8)),
        prob_rows=env.get(f"{ENV_PREFIX}_PROB_ROWS", "path"),
    )
    flush = max(1, int(env.get(f"{ENV_PREFIX}_FLUSH", 8)))
    targets = _parse_targets(env[f"{ENV_PREFIX}_TARGETS"]) if env.get(f"{ENV_PREFIX}_TARGETS") else None
    saved = {"count": 0}

    def path() -> Path:
        return Path(out_dir) / f"sglang-rank{f.rank}-pid{os.getpid()}"

    def save(rec: SGLangRecorder) -> None:
        if rec.steps and len(rec.steps) != saved["count"]:
            rec.save(path(), {"source": "install_from_env"})
            saved["count"] = len(rec.steps)

    def on_step(rec: SGLangRecorder) -> None:
        if len(rec.steps) % flush == 0 or len(rec.steps) >= f.max_steps:
            save(rec)

    rec = SGLangRecorder(f, on_step=on_step)
    rec.install(targets)
    atexit.register(save, rec)
    _ENV_RECORDER = rec
    return rec


def hook_dir() -> str:
    """The directory to put on ``PYTHONPATH`` so every Python process (SGLang's schedulers
    included) runs :func:`install_from_env` at start-up (a ``sitecustomize`` module that also
    runs the ``sitecustomize`` it shadows)."""
    return str(Path(__file__).resolve().parent / "_sglang_hook")


# ---- views -----------------------------------------------------------------------------------


def draw_recorded_tree(result: ReplayResult, max_nodes: int = 200):
    """A ``graphviz.Digraph`` of a replayed row: node ``i: token`` with the target probability
    under its parent (when the lab replay logged it); SGLang's accepted path in green, the
    lab's in blue where it differs; rejected siblings the lab visited in red, dashed."""
    import graphviz

    vi = result.verify_input
    n = int(vi.num_nodes[0])
    tokens = vi.node_token_ids[0].tolist()
    sgl_path = {v for v in result.sglang.accept_index[0].tolist() if v >= 0}
    lab_path = {v for v in result.lab.accept_index[0].tolist() if v >= 0} if result.lab is not None else set()
    decided = {d.node: d for d in (result.lab.decisions[0] if result.lab is not None and result.lab.decisions else [])}
    g = graphviz.Digraph(name=f"step{result.step}_row{result.row}", graph_attr={"rankdir": "LR", "fontsize": "10"},
                         node_attr={"shape": "box", "fontsize": "10", "style": "rounded"})
    nt, ns = vi.retrieve_next_token[0].tolist(), vi.retrieve_next_sibling[0].tolist()
    shown = min(n, max_nodes)
    for i in range(shown):
        label = f"{i}: {tokens[i]}"
        d = decided.get(i)
        if d is not None:
            label += f"\\np={_short(d.target_prob)} S={_short(d.cumulative_mass)}"
            if d.coin is not None:
                label += f"\\nu={_short(d.coin)}"
        attrs = {}
        if i in sgl_path:
            attrs = {"color": "darkgreen", "penwidth": "2.5", "style": "rounded,bold"}
        elif i in lab_path:
            attrs = {"color": "blue", "penwidth": "2.5", "style": "rounded,bold"}
        elif d is not None and d.verdict == "reject":
            attrs = {"color": "red", "style": "rounded,dashed"}
        g.node(str(i), label, **attrs)
    for p in range(shown):
        c = nt[p]
        while c != -1:
            if c < shown:
                g.edge(str(p), str(c))
            c = ns[c]
    bonus = int(result.sglang.bonus_token[0])
    last = [v for v in result.sglang.accept_index[0].tolist() if v >= 0][-1]
    g.node("bonus", f"SGLang bonus {bonus}", shape="ellipse", color="darkgreen")
    g.edge(str(last), "bonus", style="dotted")
    if result.lab is not None and (int(result.lab.bonus_token[0]) != bonus
                                   or not torch.equal(result.lab.accept_length, result.sglang.accept_length)):
        lab_last = [v for v in result.lab.accept_index[0].tolist() if v >= 0][-1]
        lab_bonus = int(result.lab.bonus_token[0])
        text = "lab: no bonus\\n(support exhausted)" if bool(result.lab.support_exhausted[0]) else f"lab bonus {lab_bonus}"
        g.node("lab_bonus", text, shape="ellipse", color="blue")
        g.edge(str(lab_last), "lab_bonus", style="dotted", color="blue")
    return g


def _short(x: float) -> str:
    """3 significant digits, or 9 where 3 would print a value that is not exactly 0 or 1 as 0 or 1."""
    text = f"{x:.3g}"
    return f"{x:.9g}" if text in ("0", "1") and x not in (0.0, 1.0) else text


def decisions_html(result: ReplayResult) -> str:
    """The lab replay's decision log for one row as an HTML table (static, no widgets)."""
    if result.lab is None:
        return f"<p>{html.escape(result.explanation)}</p>"
    head = "<tr><th>depth</th><th>parent</th><th>node</th><th>token</th><th>p</th><th>S_k</th><th>coin</th><th>verdict</th></tr>"
    body = []
    for d in result.lab.decisions[0]:
        coin = "" if d.coin is None else f"{d.coin:.9g}"
        body.append(f"<tr><td>{d.depth}</td><td>{d.parent}</td><td>{d.node}</td><td>{d.token}</td>"
                    f"<td>{d.target_prob:.9g}</td><td>{d.cumulative_mass:.9g}</td><td>{coin}</td><td>{d.verdict}</td></tr>")
    bonus = result.lab.bonus[0] if result.lab.bonus else None
    tail = ""
    if bonus is not None:
        coin = "" if bonus.coin is None else f", coin {bonus.coin:.6g}"
        tail = (f"<p>bonus at node {bonus.node}: token {bonus.token} ({bonus.kind}, residual mass "
                f"{bonus.residual_mass:.6g}{coin})</p>")
    return f"<table>{head}{''.join(body)}</table>{tail}"


def replay_table_html(results: Sequence[ReplayResult]) -> str:
    """One HTML row per replayed row: request, kind, SGLang's and the lab's emitted tokens, verdict."""
    head = "<tr><th>step</th><th>row</th><th>request</th><th>kind</th><th>SGLang emitted</th><th>lab emitted</th><th>verdict</th></tr>"
    body = []
    for r in results:
        sgl = [v for v in r.sglang.emitted_tokens[0].tolist() if v >= 0]
        lab = [v for v in r.lab.emitted_tokens[0].tolist() if v >= 0] if r.lab is not None else "-"
        if not r.replayable:
            verdict = html.escape(r.explanation)
        elif not r.differences:
            verdict = "same"
        else:
            verdict = "<b>differs</b>: " + html.escape("; ".join(r.differences))
            if r.explanation:
                verdict += "<br><i>" + html.escape(r.explanation) + "</i>"
        body.append(f"<tr><td>{r.step}</td><td>{r.row}</td><td>{html.escape(r.request_id)}</td><td>{r.kind}</td>"
                    f"<td>{sgl}</td><td>{lab}</td><td>{verdict}</td></tr>")
    return f"<table>{head}{''.join(body)}</table>"


# ---- a small recording made on a CPU ------------------------------------------------------------


def record_cpu_demo(path: str | os.PathLike | None = None, seed: int = 0) -> Recording:
    """Drive SGLang's Triton kernels (interpreted on a CPU) through a recorder; the fixture's recipe.

    Steps: (0) greedy tree verify of three DDTree trees; (1) the chain sampler with one-hot
    draft probabilities (the target-only rule) at temperature 0.8, top-k 10; (2) the same
    sampler on a row whose drafted token holds all of the row's float32 mass ``1 - 2**-24``
    and a coin equal to it, where SGLang and the lab differ by design; (3) the chain sampler
    with real draft probabilities (rejection sampling), which the lab's verifiers do not
    implement. Request ids ``req-0..2``. Writes ``path.json`` / ``path.safetensors`` when given.
    """
    from . import build_tree, compile_retrieve, draft_topk_from_logits, target_probs
    from .sampling import SamplingParams
    from .sglang_bridge import chain_draft_probs, sglang_kernels, sglang_verify_chain, sglang_verify_greedy

    kernels = sglang_kernels()
    rec = SGLangRecorder(RecordFilter(max_rows=3))
    greedy = rec.wrap(kernels["verify_tree_greedy_triton"], "greedy")
    chain = rec.wrap(kernels["chain_speculative_sampling_triton"], "chain")
    g = torch.Generator().manual_seed(seed)
    bs, vocab, rids = 3, 40, ["req-0", "req-1", "req-2"]
    seq = torch.tensor([11, 17, 5])

    ids, lp = draft_topk_from_logits(torch.randn(bs, 4, vocab, generator=g) * 2.5, k=3)
    tree = build_tree(ids, lp, torch.randint(0, vocab, (bs,), generator=g), 12)
    vi = compile_retrieve(tree, seq)
    logits = torch.randn(bs, vi.num_rows, vocab, generator=g)
    for b in range(bs):
        for i in range(1, int(tree.num_nodes[b])):
            if torch.rand(1, generator=g) < 0.5:
                logits[b, int(tree.parents[b, i]), int(tree.node_token_ids[b, i])] += 4.0
    rec.set_context(rids, seq, {"temperature": [0.0] * bs, "top_k": [1] * bs, "top_p": [1.0] * bs})
    sglang_verify_greedy(vi, logits, kernel=greedy)

    def chain_batch(length):
        ids, lp = draft_topk_from_logits(torch.randn(bs, length - 1, vocab, generator=g) * 2.5, k=1)
        t = build_tree(ids, lp, torch.randint(0, vocab, (bs,), generator=g), length - 1)
        v = compile_retrieve(t, seq + 1)
        lg = torch.randn(bs, length, vocab, generator=g)
        for b in range(bs):
            for i in range(1, length):
                lg[b, i - 1, int(t.node_token_ids[b, i])] += 3.0
        return v, lg

    params = SamplingParams(0.8, top_k=10)
    v, lg = chain_batch(6)
    probs = target_probs(lg, params)
    rec.set_context(rids, seq + 1, {"temperature": [0.8] * bs, "top_k": [10] * bs, "top_p": [1.0] * bs})
    sglang_verify_chain(v, probs, torch.rand(bs, 6, generator=g), torch.rand(bs, generator=g), kernel=chain)

    v, lg = chain_batch(4)
    probs = target_probs(lg, params)
    coins = torch.rand(bs, 4, generator=g) * 0.5
    full = 1.0 - 2.0 ** -24
    tokens = v.node_token_ids.clone()
    tokens[1, 1] = 7  # a drafted token other than V - 1, so SGLang's fallback token is visibly different
    v = dataclasses.replace(v, node_token_ids=tokens)
    probs[1, 0] = 0.0
    probs[1, 0, 7] = full
    coins[1, 0] = full
    sglang_verify_chain(v, probs, coins, torch.rand(bs, generator=g), kernel=chain)

    v, lg = chain_batch(4)
    probs = target_probs(lg, params)
    draft = torch.softmax(torch.randn(bs, 4, vocab, generator=g), -1)
    draft = 0.5 * draft + 0.5 * chain_draft_probs(v, vocab)
    draft[:, -1] = 0.0
    sglang_verify_chain(v, probs, torch.rand(bs, 4, generator=g), torch.rand(bs, generator=g), draft_probs=draft, kernel=chain)
    rec.clear_context()
    if rec.errors:
        raise RuntimeError(f"recorder errors: {rec.errors}")
    meta = {"source": "ddtree_lab.sglang_recorder.record_cpu_demo", "seed": seed}
    if path is not None:
        rec.save(path, meta)
    return rec.recording(meta)


def _main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m ddtree_lab.sglang_recorder",
                                     description="Record SGLang verify steps (see the module docstring).")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("hook-dir", help="print the directory to prepend to PYTHONPATH")
    rp = sub.add_parser("replay", help="replay a recording with the lab's verifiers and print the differences")
    rp.add_argument("path")
    rp.add_argument("--backend", default="reference")
    args = parser.parse_args(argv)
    if args.cmd == "hook-dir":
        print(hook_dir())
        return 0
    results = replay_recording(load_recording(args.path), args.backend)
    bad = 0
    for r in results:
        status = "same" if r.agrees else ("skipped: " + r.explanation if not r.replayable else "; ".join(r.differences))
        if r.replayable and r.differences and not r.explanation:
            bad += 1
        print(f"step {r.step} row {r.row} {r.request_id} {r.kind}: {status}" + (f" ({r.explanation})" if r.explanation and r.replayable else ""))
    print(f"{len(results)} rows, {bad} unexplained differences")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(_main())


def recording_to_trace(recording: Recording, top_m: int = 16):
    """Turn an SGLang recording into a lab :class:`ddtree_lab.trace.RunTrace` the views,
    notebooks, CLI and :func:`ddtree_lab.replay` read.

    One :class:`ddtree_lab.trace.StepTrace` per recorded row, ``step`` = the recorded call,
    ``request_id`` = SGLang's request id. The output and decision log are the lab's reference
    verifier on the recorded inputs (greedy rows: one-hot target rows built from SGLang's
    ``target_predict``, coins 0, exactly as a lab greedy session verifies); SGLang's own output
    and every difference from it are kept in ``step.extra``. What SGLang does not record is
    marked, not invented: draft top-k is empty, ``node_logws`` are NaN, ``ranks`` -1, and
    target rows the kernel never read are zero. Rows that the target-only rule cannot replay
    (chain rejection sampling with real draft probabilities, block verification) are skipped
    and listed in the metadata.
    """
    from .retrieve import decode_retrieve
    from .sampling import SamplingParams
    from .trace import RunTrace, StepTrace, row_records
    from .verify import verify_sampled

    steps, skipped, texts = [], [], {}
    for k, step in enumerate(recording.steps):
        for row in range(len(step["rows"])):
            parts = step_parts(step, row)
            kind = parts["kind"]
            if kind == "chain" and (step.get("block_verification") or not _one_hot_chain(step, row)):
                skipped.append({"call": step["call"], "row": row, "request_id": parts["request_id"],
                                "why": "not a target-only step (rejection sampling with draft probabilities)"})
                continue
            vi = parts["verify_input"]
            n = int(vi.num_nodes[0])
            if kind == "greedy":
                predict = parts["target_predict"].long()
                vocab = int(max(int(predict.max()), int(vi.node_token_ids.max()))) + 1
                rows = torch.zeros(1, vi.num_rows, vocab)
                rows.scatter_(-1, predict[..., None].clamp(min=0), 1.0)
                coins, final = torch.zeros(1, vi.num_rows), torch.zeros(1)
                params = SamplingParams(temperature=0.0)
            else:
                rows = parts["target_probs"].float()
                coins, final = parts["coins"].float(), parts["final_coins"].float()
                sp = parts["sampling"]
                params = SamplingParams(temperature=float(sp.get("temperature", 1.0)) or 1.0,
                                        top_k=int(sp.get("top_k", 0)) if int(sp.get("top_k", 0)) > 0 else 0,
                                        top_p=float(sp.get("top_p", 1.0)))
            threshold_single, threshold_acc = parts["thresholds"]
            out = verify_sampled(vi, rows, coins, final, threshold_single=threshold_single,
                                 threshold_acc=threshold_acc)
            sgl = parts["sglang_output"]
            diffs = _row_lines(compare_verify_outputs(out, sgl))
            parents, depths = decode_retrieve(vi.retrieve_next_token, vi.retrieve_next_sibling, vi.num_nodes)
            tokens = vi.node_token_ids[0, :n]
            bonus = out.bonus[0]
            records = row_records(parents[0, :n], tokens, rows[0, :n], rows[0, :n], bonus, top_m)
            steps.append(StepTrace(
                step=int(step["call"]), request=row, request_id=str(parts["request_id"]),
                prefix_len=int(vi.positions[0, 0]), draft_token_ids=torch.zeros(0, 0, dtype=torch.int64),
                draft_logprobs=torch.zeros(0, 0), node_token_ids=tokens.clone(), parents=parents[0, :n].clone(),
                depths=depths[0, :n].clone(), ranks=torch.full((n,), -1, dtype=torch.int64),
                node_logws=torch.full((n,), float("nan")), retrieve_index=torch.arange(n),
                retrieve_next_token=vi.retrieve_next_token[0, :n].clone(),
                retrieve_next_sibling=vi.retrieve_next_sibling[0, :n].clone(), positions=vi.positions[0, :n].clone(),
                params=params, coins=coins[0, :n].clone(), final_coin=float(final[0]), **records,
                final_mass=float(bonus.residual_mass), output=out, backend="reference",
                extra={"source": "sglang", "kernel": parts["kernel"], "kind": kind, "rank": parts["rank"],
                       "call": parts["call"], "sglang_emitted": [t for t in sgl.emitted_tokens[0].tolist() if t >= 0],
                       "sglang_accept_length": int(sgl.accept_length[0]), "differences": diffs}))
    meta = {"source": "sglang recording", "recording": recording.metadata, "skipped_rows": skipped,
            "requests": [], "target": {"name": str(recording.metadata.get("target", "unknown (SGLang)"))}}
    return RunTrace(metadata=meta, steps=steps, token_texts=texts)
