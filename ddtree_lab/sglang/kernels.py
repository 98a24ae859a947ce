"""Runners for SGLang's own verify and tree-build kernels on lab inputs, and the lab's verifiers
by backend, so the two can be compared (tests/test_sglang_kernels.py).

Importing this module does not import sglang; :func:`sglang_kernels` does, once. Without a
CUDA GPU SGLang's Triton kernels run in Triton's interpreter (``TRITON_INTERPRET=1``); its
sampled tree verifier ``tree_speculative_sampling_target_only`` is CUDA only.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Callable

import torch

from ..buffers import DDTreeVerifyInput
from ..verify import VerifyOutput, verify_greedy, verify_sampled
from .buffers import SGLangVerifyBuffers, TreeMaskMode, eagle_tree_inputs, verify_output_from_sglang

__all__ = [
    "sglang_kernels",
    "sglang_unavailable_reason",
    "SGLangVerifyResult",
    "sglang_verify_greedy",
    "sglang_verify_chain",
    "sglang_verify_target_only",
    "chain_draft_probs",
    "sglang_build_tree",
    "lab_verifiers",
]

_KERNELS: dict | None = None


def sglang_unavailable_reason(kernel: str = "auto") -> str | None:
    """Why SGLang's kernels (``kernel``: one of ``ddtree_lab.engines.sglang.KERNELS``; ``"auto"``:
    any) cannot run here, or None when they can (imports them once).

    Reasons: triton imported before ``TRITON_INTERPRET=1`` on a machine without CUDA; sglang
    missing or its kernels failing to import (the exception's type and message);
    ``"target-only"`` without its CUDA kernel.
    """
    if not torch.cuda.is_available() and "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        # triton's own @jit helpers (tl.cumsum, ...) are made when triton is imported: SGLang's
        # interpreted kernels then fail with "Cannot call @triton.jit'd outside of the scope of a kernel"
        return ("triton was imported before TRITON_INTERPRET=1 was set, and there is no CUDA GPU: set "
                "os.environ['TRITON_INTERPRET'] = '1' before anything imports triton (first line or cell)")
    try:
        kernels = sglang_kernels()
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    if kernel == "target-only" and kernels["tree_speculative_sampling_target_only"] is None:
        return "tree_speculative_sampling_target_only is CUDA only (no CUDA GPU or its JIT dependencies here)"
    return None


def sglang_kernels() -> dict:
    """SGLang's verify kernels: ``{"verify_tree_greedy_triton", "chain_speculative_sampling_triton",
    "tree_speculative_sampling_target_only" (None without CUDA), "version", "interpreted"}``.

    Without a CUDA GPU the Triton kernels run in Triton's interpreter: ``TRITON_INTERPRET=1``
    is set in this process before SGLang's kernel modules are imported (the variable is read
    when a ``@triton.jit`` function is defined). If they were already imported without it
    on a machine without CUDA, this raises instead of returning kernels that cannot launch.

    Raises:
        ImportError: sglang is not installed (``pip install --no-deps sglang`` plus the light
            packages of the ``sglang-cpu`` extra, README "Using the lab with SGLang").
        RuntimeError: imported earlier without the interpreter on a CPU-only machine.
    """
    global _KERNELS
    if _KERNELS is not None:
        return _KERNELS
    import sys

    cuda = torch.cuda.is_available()
    if not cuda:
        already = [m for m in ("sglang.kernels.ops.speculative.spec_tree", "sglang.kernels.ops.speculative.reject_sampling") if m in sys.modules]
        if already and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(
                f"{already[0]} was imported without TRITON_INTERPRET=1 and there is no CUDA GPU: its Triton kernels "
                "cannot launch; set TRITON_INTERPRET=1 before anything imports sglang's kernels"
            )
        os.environ["TRITON_INTERPRET"] = "1"
    import sglang
    from sglang.kernels.ops.speculative import reject_sampling, spec_tree

    target_only = None
    if cuda:
        try:
            from sglang.kernels.ops.speculative.sampling import tree_speculative_sampling_target_only as target_only
        except Exception:
            target_only = None
    _KERNELS = {
        "verify_tree_greedy_triton": spec_tree.verify_tree_greedy_triton,
        "chain_speculative_sampling_triton": reject_sampling.chain_speculative_sampling_triton,
        "tree_speculative_sampling_target_only": target_only,
        "version": getattr(sglang, "__version__", "unknown"),
        "interpreted": os.environ.get("TRITON_INTERPRET") == "1",
    }
    return _KERNELS


@dataclass
class SGLangVerifyResult:
    """What an SGLang kernel returned, raw and as a lab :class:`VerifyOutput`."""

    output: VerifyOutput
    predicts: torch.Tensor
    accept_index: torch.Tensor
    accept_token_num: torch.Tensor
    kernel: str


def _num_spec_tokens(vi: DDTreeVerifyInput, num_speculative_tokens: int | None) -> int:
    if num_speculative_tokens is not None:
        return int(num_speculative_tokens)
    return int(vi.depths.max()) + 1 if vi.depths.numel() else 1


def _alloc_outputs(bs: int, n: int, s: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # As eagle_utils.eagle_sample allocates them.
    return (
        torch.zeros(bs * n, dtype=torch.int32, device=device),
        torch.full((bs, s), -1, dtype=torch.int32, device=device),
        torch.empty(bs, dtype=torch.int32, device=device),
    )


def _sglang_retrieve(vi: DDTreeVerifyInput) -> torch.Tensor:
    """``retrive_index`` with padding rows at ``b*N + i`` too (SGLang never sees -1 there)."""
    bs, n = vi.node_token_ids.shape
    full = torch.arange(bs * n, dtype=torch.int64, device=vi.retrieve_index.device).view(bs, n)
    return torch.where(vi.retrieve_index >= 0, vi.retrieve_index, full)


def sglang_verify_greedy(
    verify_input: DDTreeVerifyInput,
    target_logits: torch.Tensor,
    num_speculative_tokens: int | None = None,
    kernel: Callable | None = None,
) -> SGLangVerifyResult:
    """Run SGLang's greedy tree verifier on a lab batch.

    ``target_predict`` is ``target_logits.argmax(-1)`` as in ``eagle_utils.eagle_sample``.

    Args:
        verify_input: lab buffers.
        target_logits: ``[bs, N, V]`` floating.
        num_speculative_tokens: ``S`` (default: max depth + 1, the longest path).
        kernel: a callable with ``verify_tree_greedy_func``'s signature; default SGLang's
            Triton ``spec_tree.verify_tree_greedy_triton``.
    """
    fn = kernel or sglang_kernels()["verify_tree_greedy_triton"]
    bs, n = verify_input.node_token_ids.shape
    s = _num_spec_tokens(verify_input, num_speculative_tokens)
    predicts, accept_index, accept_num = _alloc_outputs(bs, n, s, target_logits.device)
    target_predict = target_logits.argmax(-1).to(torch.int64)
    fn(
        predicts,
        accept_index,
        accept_num,
        verify_input.node_token_ids.contiguous(),
        _sglang_retrieve(verify_input).contiguous(),
        verify_input.retrieve_next_token.contiguous(),
        verify_input.retrieve_next_sibling.contiguous(),
        target_predict.contiguous(),
    )
    out = verify_output_from_sglang(verify_input, predicts, accept_index, accept_num, backend="sglang-greedy")
    return SGLangVerifyResult(out, predicts, accept_index, accept_num, getattr(fn, "__name__", str(fn)))


def chain_draft_probs(verify_input: DDTreeVerifyInput, vocab_size: int) -> torch.Tensor:
    """One-hot draft probabilities of a chain: ``[bs, N, V]`` float32, row ``i`` one-hot at node ``i+1``'s token.

    The last row is zero (no node after it). With these, SGLang's chain rejection sampler
    accepts node ``i+1`` iff ``coin < p_i(token)``: the target-only rule on a chain.
    """
    bs, n = verify_input.node_token_ids.shape
    q = torch.zeros(bs, n, vocab_size, dtype=torch.float32)
    nxt = verify_input.node_token_ids[:, 1:]
    valid = nxt >= 0
    b_idx, i_idx = valid.nonzero(as_tuple=True)
    q[b_idx, i_idx, nxt[b_idx, i_idx]] = 1.0
    return q


def _check_chain(vi: DDTreeVerifyInput) -> None:
    bs, n = vi.node_token_ids.shape
    for b in range(bs):
        if int(vi.num_nodes[b]) != n:
            raise ValueError(f"request {b}: SGLang's chain sampler needs a full chain of N = {n} nodes, got {int(vi.num_nodes[b])}")
        nt, ns = vi.retrieve_next_token[b].tolist(), vi.retrieve_next_sibling[b].tolist()
        want = list(range(1, n)) + [-1]
        if nt != want or any(v != -1 for v in ns):
            raise ValueError(f"request {b}: not a chain 0 -> 1 -> ... -> N-1 (retrieve_next_token {nt})")


def sglang_verify_chain(
    verify_input: DDTreeVerifyInput,
    target_probs: torch.Tensor,
    coins: torch.Tensor,
    final_coins: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    kernel: Callable | None = None,
) -> SGLangVerifyResult:
    """Run SGLang's Triton chain rejection sampler (``chain_speculative_sampling_triton``).

    Args:
        verify_input: a chain (node ``i``'s child is ``i+1``; every request full).
        target_probs: ``[bs, N, V]`` float32.
        coins: ``[bs, N]`` float32; ``coins[b, i]`` decides node ``i+1`` (the lab's layout).
        final_coins: ``[bs]`` float32.
        draft_probs: ``[bs, N, V]``; default :func:`chain_draft_probs` (one-hot), which makes
            the sampler the target-only rule.

    Raises:
        ValueError: not a full chain.
    """
    _check_chain(verify_input)
    fn = kernel or sglang_kernels()["chain_speculative_sampling_triton"]
    bs, n, vocab = target_probs.shape
    q = chain_draft_probs(verify_input, vocab) if draft_probs is None else draft_probs
    predicts, accept_index, accept_num = _alloc_outputs(bs, n, n, target_probs.device)
    fn(
        predicts=predicts,
        accept_index=accept_index,
        accept_token_num=accept_num,
        candidates=verify_input.node_token_ids.contiguous(),
        retrive_index=_sglang_retrieve(verify_input).contiguous(),
        retrive_next_token=verify_input.retrieve_next_token.contiguous(),
        retrive_next_sibling=verify_input.retrieve_next_sibling.contiguous(),
        uniform_samples=coins.contiguous(),
        uniform_samples_for_final_sampling=final_coins.contiguous(),
        target_probs=target_probs.contiguous(),
        draft_probs=q.contiguous(),
        threshold_single=1.0,
        threshold_acc=1.0,
        deterministic=True,
    )
    out = verify_output_from_sglang(verify_input, predicts, accept_index, accept_num, backend="sglang-chain")
    return SGLangVerifyResult(out, predicts, accept_index, accept_num, getattr(fn, "__name__", str(fn)))


def sglang_verify_target_only(
    verify_input: DDTreeVerifyInput,
    target_probs: torch.Tensor,
    coins: torch.Tensor,
    final_coins: torch.Tensor,
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
    num_speculative_tokens: int | None = None,
    kernel: Callable | None = None,
) -> SGLangVerifyResult:
    """Run SGLang's CUDA ``tree_speculative_sampling_target_only`` (needs a CUDA GPU).

    Tensors are moved to CUDA; ``draft_probs`` is zeros, as in ``eagle_sample`` (the kernel
    writes the rejected siblings' target mass into it).

    Raises:
        RuntimeError: no CUDA kernel here.
    """
    fn = kernel or sglang_kernels()["tree_speculative_sampling_target_only"]
    if fn is None:
        raise RuntimeError("tree_speculative_sampling_target_only is CUDA only: no CUDA GPU (or its JIT dependencies) here")
    device = "cuda" if kernel is None else target_probs.device
    bs, n = verify_input.node_token_ids.shape
    s = _num_spec_tokens(verify_input, num_speculative_tokens)
    predicts, accept_index, accept_num = _alloc_outputs(bs, n, s, device)
    probs = target_probs.to(device).contiguous()
    fn(
        predicts=predicts,
        accept_index=accept_index,
        accept_token_num=accept_num,
        candidates=verify_input.node_token_ids.to(device).contiguous(),
        retrive_index=_sglang_retrieve(verify_input).to(device).contiguous(),
        retrive_next_token=verify_input.retrieve_next_token.to(device).contiguous(),
        retrive_next_sibling=verify_input.retrieve_next_sibling.to(device).contiguous(),
        uniform_samples=coins.to(device).contiguous(),
        uniform_samples_for_final_sampling=final_coins.to(device).contiguous(),
        target_probs=probs,
        draft_probs=torch.zeros_like(probs),
        threshold_single=threshold_single,
        threshold_acc=threshold_acc,
        deterministic=True,
    )
    predicts, accept_index, accept_num = (t.cpu() for t in (predicts, accept_index, accept_num))
    out = verify_output_from_sglang(verify_input, predicts, accept_index, accept_num, backend="sglang-target-only")
    return SGLangVerifyResult(out, predicts, accept_index, accept_num, getattr(fn, "__name__", str(fn)))



def sglang_build_tree(
    verify_input: DDTreeVerifyInput, tree_mask_mode: TreeMaskMode | int = TreeMaskMode.FULL_MASK, seq_lens: torch.Tensor | None = None
) -> SGLangVerifyBuffers:
    """Run SGLang's Triton tree builder (``spec_tree.sgl_build_tree_kernel_triton``) on lab trees.

    The tree goes in as EAGLE inputs (:func:`eagle_tree_inputs`); the mask buffer is
    allocated as ``eagle_utils.build_tree_kernel_efficient`` does (all True). Returns what
    SGLang built, to compare with :func:`to_sglang_buffers`. The Triton builder has no
    ``QLEN_ONLY_BITPACKING`` (SGLang raises NotImplementedError; the CUDA builder has it).
    """
    mode = TreeMaskMode(int(tree_mask_mode))
    sglang_kernels()  # first: sets TRITON_INTERPRET=1 on a CPU-only machine
    from sglang.kernels.ops.speculative import spec_tree
    bs, n = verify_input.node_token_ids.shape
    if seq_lens is None:
        seq_lens = verify_input.positions[:, 0].clone()
    parent_list, selected, topk, depth = eagle_tree_inputs(verify_input)
    if mode == TreeMaskMode.FULL_MASK:
        mask = torch.ones(int(seq_lens.sum()) * n + n * n * bs, dtype=torch.bool)
    elif mode == TreeMaskMode.QLEN_ONLY:
        mask = torch.ones(n * n * bs, dtype=torch.bool)
    else:
        raise NotImplementedError("SGLang's Triton tree builder has no QLEN_ONLY_BITPACKING (CUDA only)")
    ri, nt, ns = torch.full((3, bs, n), -1, dtype=torch.int64)
    ri, nt, ns = ri.clone(), nt.clone(), ns.clone()
    positions = torch.empty(bs * n, dtype=torch.int64)
    spec_tree.sgl_build_tree_kernel_triton(parent_list, selected, seq_lens.clone(), mask, positions, ri, nt, ns,
                                           topk, depth, n, spec_tree.TreeMaskMode(int(mode)))
    return SGLangVerifyBuffers(
        draft_token=verify_input.node_token_ids.reshape(-1).clone(), retrive_index=ri, retrive_next_token=nt,
        retrive_next_sibling=ns, positions=positions, tree_mask=mask, tree_mask_mode=mode, seq_lens=seq_lens.clone(),
        draft_token_num=n,
    )


# ---- the lab's verifiers, by backend ----------------------------------------------------------


def lab_verifiers() -> dict[str, tuple[Callable, Callable]]:
    """The lab's verify backends usable here: ``{name: (greedy, sampled)}`` with the
    reference signatures ``greedy(vi, logits)`` and ``sampled(vi, probs, coins, final_coins,
    threshold_single=, threshold_acc=)``.

    Always ``"reference"`` (:func:`verify_greedy`, :func:`verify_sampled`) and
    ``"torch-lazy"``; ``"triton"`` where :func:`ddtree_lab.verify.select_backend`
    says the kernels can run (CUDA, or imported under ``TRITON_INTERPRET=1``). The lazy and
    Triton backends verify from logits, so their ``sampled`` adapter passes ``log(probs)``
    with temperature 1 (no top-k / top-p): the kernel recomputes the same distribution up to
    float32 rounding of the softmax. The differential tests are parametrised over this dict.
    """
    from ..sampling import SamplingParams
    from ..verify import select_backend, verify_tree, verify_tree_greedy

    def adapters(backend: str) -> tuple[Callable, Callable]:
        def greedy(vi, logits):
            return verify_tree_greedy(vi, logits, backend=backend)

        def sampled(vi, probs, coins, final_coins, threshold_single=1.0, threshold_acc=1.0):
            return verify_tree(vi, probs.log(), SamplingParams(temperature=1.0), coins, final_coins,
                               backend=backend, threshold_single=threshold_single, threshold_acc=threshold_acc)

        return greedy, sampled

    backends = {"reference": (verify_greedy, verify_sampled), "torch-lazy": adapters("torch-lazy")}
    try:
        select_backend("triton", "cpu" if not torch.cuda.is_available() else "cuda")
    except (RuntimeError, ImportError):
        return backends
    backends["triton"] = adapters("triton")
    return backends
