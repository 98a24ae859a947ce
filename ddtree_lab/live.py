"""The live step's machinery beside :class:`ddtree_lab.LiveSession`: its stage clock, and the sync-free step.

The sync-free step (``LiveSession(verify_backend="torch-batched")``, levels ``off`` and ``light``;
issue 36): the draft top-k by :func:`ddtree_lab.draft.draft_topk_device`, the tree on the device, the buffers compiled with
the depth bound (:func:`ddtree_lab.compile_retrieve` ``max_depth``), the forward checked against
the host's prefix lengths, the walk of the whole batch by
:func:`ddtree_lab.verify.batched.verify_batched`: nothing is read back until the commit, which
reads the step's result and every check's flag in one copy (``benchmarks/host_syncs.py``
counts it). A flag set there puts the KV cache and the coin generators back as they were
before the step and raises the error the host checks name. At level ``light`` the walk also
returns its log as tensors (:class:`ddtree_lab.verify.batched.BatchedLog`); after the commit
it is copied to the host (into pinned buffers, without waiting, on a GPU) and a writer
thread turns it into the step's :class:`Step` s -- the decision log, the bonus record and the
rows the walk read, equal to what the per-request walks record -- while the next step runs.
So its records arrive one step late: :meth:`~ddtree_lab.LiveSession.step` returns the *previous* step's
:class:`Step` s (the first call returns none; the call that finds no active request returns
the last ones), :meth:`~ddtree_lab.LiveSession.generate` yields them in the same rhythm, and
:meth:`~ddtree_lab.LiveSession.trace`, :meth:`~ddtree_lab.LiveSession.run` and the end of ``generate`` wait for every
pending one. A record that fails to be written leaves its step decoded and committed, warns,
and is listed in the run's ``metadata["missing_records"]``. Level ``full`` (every row) and
``record_to`` (the crash-safe file, which writes each step's inputs before its verify) keep
the per-request walks.

Here: :class:`StepClock` (both steps' stage timings), :class:`SyncFreeStep` (the sync-free
step's methods, which :class:`~ddtree_lab.LiveSession` inherits) and :class:`StepWriter` (the
writer thread).
"""

from __future__ import annotations

import atexit
import dataclasses
import time
import warnings
import weakref
from typing import Any, Callable

import torch

from .buffers import compile_retrieve
from .draft import draft_topk_device, draft_topk_from_logits
from .models.drafter import DraftContext
from .record import TOP_M_LOGITS, record_step
from .step import STAGES, DraftTopK, Step
from .verify import VerifyOutput, draw_coins, is_lossy
from .verify.batched import BatchedVerifyOutput, raise_batched_problems, verify_batched

__all__ = ["StepClock", "StepWriter", "SyncFreeStep"]


class SyncFreeStep:
    """The sync-free step's methods (module docstring), a part of :class:`~ddtree_lab.LiveSession`.

    They read the session's stages and state (declared below for the type checker) and are
    called by :meth:`~ddtree_lab.LiveSession.step` when ``verify_backend == "torch-batched"``.
    """

    target: Any
    drafter: Any
    record: str
    top_m: int
    threshold_single: float
    threshold_acc: float
    request_budgets: Any
    num_steps: int
    steps: list[Step]
    missing_records: list[dict]
    layer_ids: "list[int] | None"
    _batch: Any
    _writer: "StepWriter"
    _build: Callable[..., Any]
    _builds_on_host: Callable[..., bool]
    _commit: Callable[..., list[bool]]
    _count: Callable[..., dict]

    def _step_batched(self, active: list[Any], max_new_tokens: int) -> None:
        """The sync-free step (module docstring): the same stages, one host read, at the commit."""
        clock = StepClock(self.target.device)
        prefix_list = [r.prefix_len for r in active]
        anchors = torch.tensor([r.anchor for r in active], dtype=torch.int64)
        prefix = torch.tensor(prefix_list, dtype=torch.int64)
        context = DraftContext([r.request for r in active], anchors, prefix.clone(), [r.committed_ids for r in active])
        draft_logits = self.drafter.draft_logits(context).float()
        budgets = [self.request_budgets[r.request] for r in active]
        k = min(max(budgets + [1]), draft_logits.shape[-1])
        ids, lps, draft_bad = draft_topk_device(draft_logits, k)
        if self._builds_on_host(ids) and bool(draft_bad.any()):  # the host build reads the top-k anyway
            draft_topk_from_logits(draft_logits, k=k)  # raises, naming the request and depth
        clock.mark("draft")
        tree = self._build(ids, lps, anchors, budgets)
        clock.mark("build")
        depth = ids.shape[1]  # the trees' depth bound: the draft's L - 1 positions
        vi = compile_retrieve(tree, prefix, max_depth=depth, validate=False)
        clock.mark("compile")
        fwd = self.target.tree_forward_batch(self._batch, vi, self.layer_ids, root_positions=prefix_list)
        clock.mark("target")
        gens = [r.generator for r in active]
        assert all(g is not None for g in gens)  # start() gives every request its generator
        gen_states = [g.get_state() for g in gens if g is not None]
        coins, final = draw_coins([g for g in gens if g is not None], vi.num_rows)
        params = [r.params for r in active]
        out = verify_batched(vi, fwd.logits, params, coins, final, max_depth=depth, max_children=k,
                             threshold_single=self.threshold_single, threshold_acc=self.threshold_acc, check=False,
                             log=self.record == "light")
        clock.mark("verify")
        pending = self._copy_for_record(out, tree, vi, ids, lps) if self.record == "light" else None
        clock.mark("record")
        flags = self._commit(active, out, fwd.hidden, vi.num_rows, max_new_tokens,
                             checks=torch.cat([draft_bad.any()[None].to(out.flags.device), out.flags]))
        if any(flags):  # nothing was committed: put the cache and the coins back, then name the problem
            self.target.keep_paths(self._batch, [[] for _ in active], vi.num_rows)
            for g, state in zip(gens, gen_states):
                if g is not None:
                    g.set_state(state)
            if flags[0]:
                draft_topk_from_logits(draft_logits, k=k)  # raises, naming the request and depth
            raise_batched_problems(flags[1:], vi, fwd.logits, params, coins, final,
                                   self.threshold_single, self.threshold_acc)
            raise AssertionError(f"a check flagged {flags} and its host check found nothing")  # pragma: no cover
        clock.mark("commit")
        timings = self._count(clock)
        if pending is not None:
            step_no = self.num_steps - 1
            rows = [(r.request, r.request_id, prefix_list[b], r.params, final[b], coins[b]) for b, r in
                    enumerate(active)]
            self._writer.submit(step_no, lambda: self._write_light(step_no, rows, pending, timings))

    def _copy_for_record(self, out: BatchedVerifyOutput, tree, vi, ids, lps) -> dict:
        """What level ``light`` keeps, copied to the host without waiting (pinned buffers on a
        GPU; the tensors themselves on the CPU), with the event the writer waits for."""
        assert out.log is not None
        parts = {f.name: getattr(out.log, f.name) for f in dataclasses.fields(out.log)}
        parts.update({f"out_{n}": getattr(out, n) for n in ("accept_index", "accept_length", "emitted_tokens",
                                                           "bonus_token", "support_exhausted")})
        parts.update({f"tree_{f.name}": getattr(tree, f.name) for f in dataclasses.fields(tree)})
        parts.update({f"vi_{f.name}": getattr(vi, f.name) for f in dataclasses.fields(vi)})
        parts.update(draft_ids=ids, draft_lps=lps)
        moved = False
        for name, t in parts.items():
            if t.device.type != "cpu":
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t, non_blocking=True)
                parts[name] = host
                moved = True
        event = None
        if moved:  # the writer waits for this event, the step does not
            event = torch.cuda.Event()
            event.record()
        parts["_event"] = event
        return parts

    def _write_light(self, step_no: int, rows: list, parts: dict, timings: dict) -> list[Step]:
        """The level-``light`` :class:`Step` s of one sync-free step (the writer thread runs this)."""
        from .build import DDTreeBuildResult
        from .buffers import DDTreeVerifyInput
        from .step import TargetRows
        from .verify.batched import BatchedLog, decisions_from_log

        if parts["_event"] is not None:
            parts["_event"].synchronize()
        log = BatchedLog(**{f.name: parts[f.name] for f in dataclasses.fields(BatchedLog)})
        tree = DDTreeBuildResult(**{f.name: parts["tree_" + f.name] for f in dataclasses.fields(DDTreeBuildResult)})
        vi = DDTreeVerifyInput(**{f.name: parts["vi_" + f.name] for f in dataclasses.fields(DDTreeVerifyInput)})
        width = max(int(tree.depths.max()) + 1 if tree.depths.numel() else 1,
                    int(parts["out_accept_length"].max()) + 1)  # as the per-request walks' outputs
        tokens_all = vi.node_token_ids.tolist()
        steps = []
        for b, (request, request_id, prefix_len, params, final_coin, coins) in enumerate(rows):
            final_coin = float(final_coin)
            bonus_token = int(parts["out_bonus_token"][b])
            decisions, bonus = decisions_from_log(log, b, 0, tokens_all[b], bonus_token, final_coin)
            output = VerifyOutput(
                accept_index=parts["out_accept_index"][b:b + 1, :width].clone(),
                accept_length=parts["out_accept_length"][b:b + 1].clone(),
                emitted_tokens=parts["out_emitted_tokens"][b:b + 1, :width].clone(),
                bonus_token=parts["out_bonus_token"][b:b + 1].clone(),
                support_exhausted=parts["out_support_exhausted"][b:b + 1].clone(),
                decisions=[decisions], bonus=[bonus], backend="torch-batched",
                thresholds=(self.threshold_single, self.threshold_acc), lossy=is_lossy(self.threshold_single,
                                                                                        self.threshold_acc))
            n = int(tree.num_nodes[b])
            child = torch.full((n,), float("nan"))
            child[0] = 0.0
            for d, node in enumerate(log.node[b].tolist()):
                if node < 0:
                    break
                kids = log.children[b, d]
                real = (kids >= 0) & (kids < n)
                child[kids[real]] = log.child_probs[b, d][real]
            prefix = log.final_probs[b, : bonus_token + 1].clone() if bonus_token >= 0 else torch.zeros(0)
            kept = TargetRows(kind="read", child_probs=child, final_row_prefix=prefix.float(),
                              final_mass=float(bonus.residual_mass))
            step = record_step(step=step_no, request=request, request_id=request_id, prefix_len=prefix_len,
                               params=params, tree=tree.request(b), buffers=vi.request(b), output=output,
                               coins=coins, final_coin=final_coin,
                               draft=DraftTopK(parts["draft_ids"][b], parts["draft_lps"][b]), level="light",
                               top_m=self.top_m, top_m_logits=TOP_M_LOGITS, backend="torch-batched", rows=kept)
            step.timings = dict(timings)
            steps.append(step)
        return steps

    def _written(self, wait: bool = False, upto: int | None = None) -> list[Step]:
        """The steps the writer has finished (all pending ones with ``wait``, those of steps
        ``<= upto`` with ``upto``), added to :attr:`steps`; a step whose records could not be
        written is added to :attr:`missing_records` with a warning."""
        done, failed = self._writer.collect(wait=wait, upto=upto)
        self.steps.extend(done)
        for step, why in failed:
            self.missing_records.append({"step": step, "error": why})
            warnings.warn(f"LiveSession: the records of step {step} could not be written ({why}); the step was "
                          "decoded and committed; the run's metadata lists it under 'missing_records'",
                          RuntimeWarning, stacklevel=3)
        return done

    # -- the build and verify stages (one of each is chosen in __init__) ----------------------

    tree_build: str = "auto"


def _finish_writers() -> None:
    """At interpreter exit: let every writer thread finish its jobs (a thread killed inside a
    torch call aborts the process)."""
    for writer in list(_WRITERS):
        writer._jobs.join()
        thread = writer._thread
        if thread is not None:
            thread.join(timeout=5.0)


_WRITERS: "weakref.WeakSet[StepWriter]" = weakref.WeakSet()
atexit.register(_finish_writers)


class StepWriter:
    """Runs record jobs (each returns one step's :class:`Step` s) in submission order in a
    background thread, off the live step's critical path. The thread starts with the first job
    and ends when idle. Jobs are independent: one that raises leaves its step's records missing
    (:meth:`collect` hands back ``(step, error)`` for it) and the next jobs run."""

    def __init__(self):
        import queue
        import threading

        _WRITERS.add(self)
        self._jobs: "queue.Queue" = queue.Queue()
        self._lock = threading.Lock()
        self._done: list[Step] = []
        self._failed: list[tuple[int, str]] = []
        self._finished: dict[int, threading.Event] = {}
        self._thread: "threading.Thread | None" = None

    def submit(self, step: int, job: Callable[[], list[Step]]) -> None:
        import threading

        done = threading.Event()
        with self._lock:
            self._finished[step] = done
        self._jobs.put((step, job, done))
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="ddtree-lab-step-writer", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        import queue

        while True:
            try:
                step, job, done = self._jobs.get(timeout=0.5)
            except queue.Empty:
                with self._lock:
                    if self._jobs.empty():
                        self._thread = None
                        return
                continue
            try:
                steps = job()
                with self._lock:
                    self._done.extend(steps)
            except Exception as exc:  # the step's records are missing; the session says so
                with self._lock:
                    self._failed.append((step, f"{type(exc).__name__}: {exc}"))
            finally:
                done.set()
                self._jobs.task_done()

    def collect(self, wait: bool = False, upto: int | None = None) -> tuple[list[Step], list[tuple[int, str]]]:
        """``(steps, failures)`` finished so far: with ``wait`` after every submitted job, with
        ``upto`` after the jobs of steps ``<= upto``."""
        if wait:
            self._jobs.join()
        elif upto is not None:
            with self._lock:
                events = [e for k, e in self._finished.items() if k <= upto]
            for e in events:
                e.wait()
        with self._lock:
            if upto is None:
                done, self._done = self._done, []
                failed, self._failed = self._failed, []
            else:  # exactly the steps <= upto, whatever else has finished meanwhile
                done, self._done = [x for x in self._done if x.step <= upto], [x for x in self._done if x.step > upto]
                failed = [x for x in self._failed if x[0] <= upto]
                self._failed = [x for x in self._failed if x[0] > upto]
            self._finished = {k: e for k, e in self._finished.items() if not e.is_set()}
        return done, failed


class StepClock:
    """Stage timings in seconds under the names of :data:`STAGES`.

    On the host: ``time.perf_counter`` at each mark. On CUDA: a CUDA event at each mark (no
    host synchronisation); :meth:`result` reads them after the step's commit, which has
    already read the verify output back (host-side stages show as the time between their
    events); reading them waits for the last event.
    """

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.marks: list[tuple[str, Any]] = [("", self._now())]  # perf_counter floats or CUDA events

    def _now(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def mark(self, name: str) -> None:
        self.marks.append((name, self._now()))

    def result(self) -> dict[str, float]:
        out: dict[str, float] = dict.fromkeys(STAGES, 0.0)
        if self.cuda:
            self.marks[-1][1].synchronize()
        for (_, a), (name, b) in zip(self.marks, self.marks[1:]):
            out[name] = a.elapsed_time(b) / 1e3 if self.cuda else b - a
        return out
