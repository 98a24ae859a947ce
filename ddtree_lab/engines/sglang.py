"""SGLang's own verify kernels as lab verifiers (the same adapter shape as
:mod:`ddtree_lab.engines.vllm`), so :func:`ddtree_lab.audit.audit` judges their law.

Kernels (run through :mod:`ddtree_lab.sglang.kernels`; on a CPU its Triton kernels run in
Triton's interpreter):

* ``"chain"``: ``reject_sampling.chain_speculative_sampling_triton`` on chains -- with one-hot
  draft rows (its target-only form, :func:`ddtree_lab.sglang.kernels.chain_draft_probs`) or real
  draft probabilities;
* ``"greedy"``: ``spec_tree.verify_tree_greedy_triton`` on any tree (greedy requests);
* ``"target-only"``: the CUDA-only ``tree_speculative_sampling_target_only`` on any tree (needs
  a CUDA GPU: tests/GPU_ONLY.md);
* ``"auto"``: greedy for greedy requests, else target-only where CUDA is, else chain.

SGLang's kernels take target *probabilities*; its temperature / top-k / top-p transforms are
CUDA ops (sgl-kernel), so the adapter computes the rows with the lab's transforms
(:func:`ddtree_lab.target_probs`, the same order as SGLang's) and the audit covers SGLang's
walk, acceptance and final draw, not those transforms. The kernels use the lab's coins as
SGLang lays them out (``coins[b, i]`` decides node ``i+1``), coin for coin.
"""

from __future__ import annotations

import torch

from ..buffers import DDTreeVerifyInput
from ..sampling import SamplingParams
from ..sglang.kernels import sglang_unavailable_reason  # re-exported: open_engine asks it per kernel
from ..verify import VerifyOutput
from .common import check_chain, engine_inputs, fault_params, lab_rows

__all__ = ["KERNELS", "SGLangVerifier", "verifier", "sglang_unavailable_reason"]

KERNELS = ("auto", "chain", "greedy", "target-only")


class SGLangVerifier:
    """A lab verifier (``(verify_input, target_logits, params, coins, final_coins) -> VerifyOutput``)
    running one of SGLang's kernels.

    Args:
        kernel: one of :data:`KERNELS`.
        draft_probs: ``[K, V]`` float32 real draft probabilities for the chain kernel (shared by
            every request), or None (one-hot rows: the target-only rule on a chain).
        target: ``(logits [N, V], params)`` to verify instead of what the caller passes (the
            real-draft audit judges a derived case).
        fault: a planted fault of :data:`ddtree_lab.engines.common.ENGINE_FAULTS`, or None.

    Raises (when called):
        ValueError: unknown kernel; a sampled request for ``"greedy"``; a non-chain for
            ``"chain"``; real draft probabilities for another kernel.
        RuntimeError: ``"target-only"`` without CUDA.
    """

    def __init__(self, kernel: str = "auto", draft_probs: torch.Tensor | None = None, target=None,
                 fault: str | None = None):
        if kernel not in KERNELS:
            raise ValueError(f"SGLang kernel must be one of {KERNELS}, got {kernel!r}")
        fault_params(SamplingParams(), fault)
        self.kernel, self.draft_probs, self.target, self.fault = kernel, draft_probs, target, fault
        self.__name__ = f"sglang:{kernel}" + ("" if draft_probs is None else " (real draft probs)") + \
            (f" + fault {fault}" if fault else "")

    def _which(self, items: list[SamplingParams]) -> str:
        if self.kernel != "auto":
            return self.kernel
        if all(p.is_greedy for p in items):
            return "greedy"
        if self.draft_probs is None and torch.cuda.is_available() and sglang_unavailable_reason("target-only") is None:
            return "target-only"
        return "chain"

    def __call__(self, vi: DDTreeVerifyInput, logits: torch.Tensor, params, coins: torch.Tensor,
                 final_coins: torch.Tensor) -> VerifyOutput:
        from ..sglang import kernels as sk

        bs = vi.batch_size
        logits, items = engine_inputs(logits, params, bs, self.target)
        kernel = self._which(items)
        if kernel == "greedy":
            bad = [b for b, p in enumerate(items) if not p.is_greedy]
            if bad:
                raise ValueError(f"request {bad[0]}: SGLang's greedy kernel verifies greedy requests only "
                                 f"(temperature {items[bad[0]].temperature})")
            out = sk.sglang_verify_greedy(vi, logits.contiguous()).output
            out.backend = self.__name__
            return out
        sent = [fault_params(p, self.fault) for p in items]
        rows = lab_rows(logits, sent, vi.num_nodes)
        if kernel == "chain":
            k = check_chain(vi, "SGLang's chain sampler")
            q = None
            if self.draft_probs is not None:
                q = torch.zeros(bs, k + 1, rows.shape[-1], dtype=torch.float32)
                q[:, :k] = self.draft_probs
            out = sk.sglang_verify_chain(vi, rows, coins, final_coins, draft_probs=q).output
        else:
            if self.draft_probs is not None:
                raise ValueError("real draft probabilities go to SGLang's chain kernel only (kernel='chain')")
            out = sk.sglang_verify_target_only(vi, rows, coins, final_coins).output
        out.backend = self.__name__
        return out


def verifier(kernel: str = "auto", fault: str | None = None):
    """The ``make_verifier`` factory :func:`ddtree_lab.engines.common.audit_engine` takes, for SGLang."""

    def make(draft_probs, case):
        return SGLangVerifier(kernel, draft_probs, None if draft_probs is None else (case.logits, case.params), fault)

    return make
