"""vLLM's own chain verifier (``vllm.v1.sample.rejection_sampler.RejectionSampler``) as a lab
verifier, so :func:`ddtree_lab.audit.audit` judges its law like any other.

vLLM lives in its own venv (``scripts/setup_vllm.sh`` makes ``.venv-vllm``: vllm 0.33.0 with
``--no-deps`` beside torch 2.13.0+cpu and triton 3.9.0); this module never imports it. It
starts :mod:`ddtree_lab.engines.vllm_worker` with that venv's python once per
:class:`VLLMWorker` and exchanges JSON lines and safetensors files with it (no pickle).

What runs: ``RejectionSampler.forward`` -- vLLM's temperature and top-k/top-p transforms of the
target rows (its PyTorch route on a CPU), its greedy kernel, its random kernel and its
recovered-token kernel, and its ``Sampler`` for the bonus token -- on a lab chain case
(``draft_probs=None``: the target-only rule; or real draft probabilities). vLLM draws its own
randomness: each request's ``torch.Generator`` is seeded from the lab's coins of that draw
(vLLM's per-request seed path), so an audit is reproducible for a seed but not coin-for-coin
comparable with the lab's verifiers: the audit is distributional.

:meth:`VLLMWorker.rule` runs the new model runner's DFlash 2 walk and ``rejection_sample`` end to
end in the same worker (:mod:`ddtree_lab.engines.vllm_rules`).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import IO

import torch

from ..buffers import DDTreeVerifyInput
from ..sampling import SamplingParams
from ..verify import VerifyOutput
from .common import check_chain, engine_inputs, fault_params, output_from_rows

__all__ = ["VLLM_VENV_ENV", "vllm_python", "vllm_unavailable_reason", "VLLMWorker", "VLLMVerifier", "verifier",
           "seeds_from_coins"]

#: Environment variable naming the vLLM venv (default: ``.venv-vllm`` at the repository root).
VLLM_VENV_ENV = "DDTREE_LAB_VLLM_VENV"
_WORKER = Path(__file__).with_name("vllm_worker.py")


def vllm_python() -> Path:
    """The vLLM venv's python: ``$DDTREE_LAB_VLLM_VENV/bin/python``, default the repository's
    ``.venv-vllm`` (made by ``scripts/setup_vllm.sh``). It may not exist."""
    venv = os.environ.get(VLLM_VENV_ENV) or str(Path(__file__).resolve().parents[2] / ".venv-vllm")
    return Path(venv) / "bin" / "python"


def vllm_unavailable_reason() -> str | None:
    """Why vLLM's sampler cannot run here (no venv), or None. Starts no process."""
    py = vllm_python()
    if not py.exists():
        return f"no vLLM venv at {py.parent.parent} (run `bash scripts/setup_vllm.sh`, or set {VLLM_VENV_ENV})"
    return None


class VLLMWorker:
    """One worker process running vLLM's sampler (import ~5-11 s once; then one request per call).

    Use as a context manager, or call :meth:`close`. Not thread-safe.

    Raises:
        RuntimeError: no venv, or the worker could not import vLLM (its message and stderr tail).
    """

    def __init__(self, python: str | os.PathLike | None = None, timeout: float = 300.0):
        py = Path(python) if python is not None else vllm_python()
        if not py.exists():
            raise RuntimeError(vllm_unavailable_reason() or f"no python at {py}")
        self._dir = tempfile.TemporaryDirectory(prefix="ddtree-vllm-")
        self._err = open(Path(self._dir.name) / "stderr.txt", "w+")
        self.timeout = timeout
        self._proc = subprocess.Popen([str(py), str(_WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=self._err, text=True, cwd=self._dir.name)
        assert self._proc.stdin is not None and self._proc.stdout is not None  # both are pipes (above)
        self._stdin: IO[str] = self._proc.stdin
        self._stdout: IO[str] = self._proc.stdout
        self._calls = 0
        hello = self._read()
        if not hello.get("ready"):
            self.close()
            raise RuntimeError(f"vLLM worker did not start: {hello.get('error')}")
        self.version, self.route, self.import_seconds = hello["vllm"], hello["route"], hello["import_seconds"]
        self.seconds = 0.0  # time spent inside vLLM's sampler (worker-side)

    def _stderr_tail(self) -> str:
        self._err.flush()
        self._err.seek(0)
        return self._err.read()[-2000:]

    def _read(self) -> dict:
        box: list = []
        th = threading.Thread(target=lambda: box.append(self._stdout.readline()), daemon=True)
        th.start()
        th.join(self.timeout)
        if not box:
            self._proc.kill()
            raise RuntimeError(f"vLLM worker gave no answer in {self.timeout:g} s; stderr:\n{self._stderr_tail()}")
        if not box[0]:
            raise RuntimeError(f"vLLM worker exited (code {self._proc.poll()}); stderr:\n{self._stderr_tail()}")
        return json.loads(box[0])

    def sample(self, logits: torch.Tensor, draft_token_ids: torch.Tensor, params: list[SamplingParams],
               seeds: torch.Tensor, draft_probs: torch.Tensor | None = None, broadcast: bool = False) -> torch.Tensor:
        """vLLM's ``output_token_ids`` for ``R = len(seeds)`` chain requests.

        Args:
            logits: ``[B, K+1, V]`` float32 target logits (rows ``0..K-1`` score the drafts,
                row ``K`` is the bonus row); ``B == 1`` with ``broadcast`` (shared by all R).
            draft_token_ids: ``[B, K]`` int64.
            params: ``R`` :class:`SamplingParams` (temperature, top_k, top_p used).
            seeds: ``[R]`` int64, one generator seed per request.
            draft_probs: ``[B, K, V]`` float32 or None (vLLM's ``draft_probs=None`` rule).

        Returns:
            ``[R, K+1]`` int32.

        Raises:
            RuntimeError: the worker failed (its error message).
        """
        from safetensors.torch import load_file, save_file

        self._calls += 1
        base = Path(self._dir.name) / f"call{self._calls}"
        tensors = {"logits": logits.float().contiguous(), "draft_token_ids": draft_token_ids.long().contiguous(),
                   "seeds": seeds.long().contiguous()}
        if draft_probs is not None:
            tensors["draft_probs"] = draft_probs.float().contiguous()
        save_file(tensors, f"{base}-in.safetensors")
        req = {"inputs": f"{base}-in.safetensors", "output": f"{base}-out.safetensors", "broadcast": broadcast,
               "temperature": [p.temperature for p in params], "top_k": [p.top_k for p in params],
               "top_p": [p.top_p for p in params]}
        self._stdin.write(json.dumps(req) + "\n")
        self._stdin.flush()
        reply = self._read()
        if not reply.get("ok"):
            raise RuntimeError(f"vLLM's sampler failed: {reply.get('error')}")
        self.seconds += reply["seconds"]
        out = load_file(f"{base}-out.safetensors")["output_token_ids"]
        for suffix in ("-in", "-out"):
            Path(f"{base}{suffix}.safetensors").unlink(missing_ok=True)
        return out

    def rule(self, rule: str, block: bool, tensors: dict, params: list[SamplingParams], seed: int,
             fault: str | None = None, base_pos: int = 16) -> dict:
        """Run the new model runner's speculative sampling end to end on ``R = len(params)`` rows
        (:func:`ddtree_lab.engines.vllm_worker.run_rule_request`: DFlash 2's ``CandidateSampler``
        walk or given one-hot drafts, then ``rejection_sample`` with ``use_block_verification=block``).

        Args:
            rule: ``"dflash2"`` or ``"onehot"``.
            tensors: ``target_logits [gamma+1, V, V]`` float32, ``root [1]`` int64, and
                ``candidate_ids [gamma, K]`` int64 + ``scores [gamma, K, K]`` float32 (dflash2) or
                ``draft_tokens [gamma]`` int64 (+ ``fault_draft_logits [gamma, V]``) (onehot).
            params: one :class:`SamplingParams` per row (temperature, top_k, top_p).
            seed: the trial seed (vLLM's per-request seeds are drawn from it in the worker).
            fault: a planted fault of ``vllm_worker.RULE_FAULTS``, or None.

        Returns:
            ``{"sampled": [R, gamma+1] int64, "num_sampled": [R] int32, "draft_tokens": [R, gamma]
            int64, "about": what the worker ran (the speculator file's SHA-256, skipped
            statements, interpreter shims)}``.

        Raises:
            RuntimeError: the worker failed (its error message).
        """
        from safetensors.torch import load_file, save_file

        self._calls += 1
        base = Path(self._dir.name) / f"call{self._calls}"
        save_file({k: v.contiguous() for k, v in tensors.items()}, f"{base}-in.safetensors")
        req = {"op": "rule", "inputs": f"{base}-in.safetensors", "output": f"{base}-out.safetensors", "rule": rule,
               "block": bool(block), "fault": fault, "seed": int(seed), "base_pos": int(base_pos),
               "temperature": [0.0 if p.is_greedy else float(p.temperature) for p in params],
               "top_k": [int(p.top_k) for p in params], "top_p": [float(p.top_p) for p in params]}
        self._stdin.write(json.dumps(req) + "\n")
        self._stdin.flush()
        reply = self._read()
        if not reply.get("ok"):
            raise RuntimeError(f"vLLM's new model runner sampling failed: {reply.get('error')}")
        self.seconds += reply["seconds"]
        out: dict = dict(load_file(f"{base}-out.safetensors"))
        for suffix in ("-in", "-out"):
            Path(f"{base}{suffix}.safetensors").unlink(missing_ok=True)
        out["about"] = reply.get("about")
        return out

    def close(self) -> None:
        """Stop the worker and remove its files."""
        if self._proc.poll() is None:
            try:
                self._stdin.write("\n")
                self._stdin.close()
                self._proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()
        self._err.close()
        self._dir.cleanup()

    def __enter__(self) -> "VLLMWorker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def seeds_from_coins(coins: torch.Tensor, final_coins: torch.Tensor) -> torch.Tensor:
    """``[bs]`` int64 generator seeds from the lab's coins of each draw: the first node coin
    and the final coin, 24 bits each (float32 coins carry 24 bits)."""
    hi = (coins[:, 0].double() * 2**24).long()
    lo = (final_coins.double() * 2**24).long()
    return hi * 2**24 + lo


class VLLMVerifier:
    """A lab verifier (``(verify_input, target_logits, params, coins, final_coins) -> VerifyOutput``)
    that runs vLLM's ``RejectionSampler`` on chains.

    Args:
        worker: a :class:`VLLMWorker` (not closed by this object).
        draft_probs: ``[K, V]`` float32 real draft probabilities shared by every request, or
            None for vLLM's ``draft_probs=None`` (target-only) rule.
        target: ``(logits [N, V], params)`` to verify instead of what the caller passes (the
            real-draft audit judges a derived case; see :func:`ddtree_lab.engines.common.real_draft_case`).
        fault: a planted fault of :data:`ddtree_lab.engines.common.ENGINE_FAULTS`, or None.

    Raises (when called):
        ValueError: not a full chain, ``min_p`` set (vLLM's rejection sampler applies no
            min-p to draft positions), or the other filtering order (vLLM has one:
            top-k then top-p).
        RuntimeError: the worker failed.
    """

    def __init__(self, worker: VLLMWorker, draft_probs: torch.Tensor | None = None, target=None,
                 fault: str | None = None):
        fault_params(SamplingParams(), fault)  # unknown fault -> ValueError now
        self.worker, self.draft_probs, self.target, self.fault = worker, draft_probs, target, fault
        self.__name__ = "vllm:RejectionSampler" + ("" if draft_probs is None else " (real draft probs)") + \
            (f" + fault {fault}" if fault else "")

    def __call__(self, vi: DDTreeVerifyInput, logits: torch.Tensor, params, coins: torch.Tensor,
                 final_coins: torch.Tensor) -> VerifyOutput:
        k = check_chain(vi, "vLLM's RejectionSampler")
        bs = vi.batch_size
        logits, items = engine_inputs(logits, params, bs, self.target)
        for b, p in enumerate(items):
            if p.min_p:
                raise ValueError(f"request {b}: min_p = {p.min_p}: vLLM's rejection sampler applies no min-p to "
                                 "draft positions; audit without it")
            if p.order != "top_k_then_top_p":
                raise ValueError(f"request {b}: order {p.order!r}: vLLM applies top-k then top-p only")
        sent = [fault_params(p, self.fault) for p in items]
        same = logits.stride(0) == 0 and all(p == sent[0] for p in sent) and bool((vi.node_token_ids == vi.node_token_ids[:1]).all())
        drafts = vi.node_token_ids[:, 1:]
        q = None if self.draft_probs is None else self.draft_probs[None]
        if same:
            rows = self.worker.sample(logits[:1], drafts[:1], sent, seeds_from_coins(coins, final_coins), q, True)
        else:
            q = None if q is None else q.expand(bs, -1, -1)
            rows = self.worker.sample(logits, drafts, sent, seeds_from_coins(coins, final_coins), q)
        return output_from_rows(vi, rows[:, : k + 1], self.__name__)


def verifier(worker: VLLMWorker, fault: str | None = None):
    """The ``make_verifier`` factory :func:`ddtree_lab.engines.common.audit_engine` takes, for vLLM."""

    def make(draft_probs, case):
        return VLLMVerifier(worker, draft_probs, None if draft_probs is None else (case.logits, case.params), fault)

    return make
