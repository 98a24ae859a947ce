"""The Triton backend: launch the kernels in ddtree_lab.kernels and expand their outputs into walk events."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from ..buffers import DDTreeVerifyInput
from ..sampling import SamplingParams
from .rules import SGLANG_MIN_THRESHOLD_ACC
from .types import BonusDraw, Decision, VerifyOutput, is_lossy
from .walking import walk_batch

__all__ = ["KERNEL_ORDER", "PROB_ATOL", "PROB_RTOL", "COMPACT_CAP", "triton_kernels", "triton_usable", "launch_options",
           "sampled_launcher", "greedy_launcher", "verify_triton_sampled", "verify_triton_greedy"]

#: The filtering order the Triton kernel fuses (``SamplingParams.order``).
KERNEL_ORDER = "top_k_then_top_p"

#: Tolerance of every probability the Triton backend reports (decision ``target_prob`` and
#: ``cumulative_mass``, bonus ``residual_mass`` and ``token_prob``) against the reference.
PROB_ATOL = 2e-6
PROB_RTOL = 2e-5


#: Top-k rows with at most this many survivors are gathered into a scratch row and finished
#: there (power of two; 0 turns the gather off and every step reads the full row).
COMPACT_CAP = 256


_KIND_NAMES = {0: "argmax", 1: "residual", 2: "leaf", 3: "exhausted"}


_ROW_ERRORS = {1: "NaN", 2: "+inf", 3: "every entry -inf"}


def triton_kernels():
    """(module, interpreted) or (None, reason)."""
    try:
        from ..kernels import tree_verify
    except ImportError as exc:  # triton missing
        return None, f"triton is not importable ({exc})"
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover - layout of older tritons
        InterpretedFunction = ()
    return tree_verify, isinstance(tree_verify.sampled_verify_kernel, InterpretedFunction)


def launch_options(module, interpreted: bool, compact: bool = True) -> dict:
    """The kernels' pinned launch options (``module.launch_options``: fusion off, 8 warps, 4
    without the survivor gather); the interpreter gets the same ``enable_fp_fusion`` (it has
    no warps)."""
    if interpreted:
        return {"enable_fp_fusion": module.FP_FUSION}
    return module.launch_options(compact)


def _params_tensors(items: Sequence[SamplingParams], vocab: int, device):
    temperature = torch.tensor([p.temperature for p in items], dtype=torch.float32, device=device)
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else 0 for p in items], dtype=torch.int32, device=device)
    top_p = torch.tensor([p.top_p for p in items], dtype=torch.float32, device=device)
    min_p = torch.tensor([p.min_p or 0.0 for p in items], dtype=torch.float32, device=device)
    return temperature, top_k, top_p, min_p


def _block(vocab: int, device) -> int:
    return min(4096 if device.type == "cuda" else 1024, _next_pow2(vocab))


def _next_pow2(n: int) -> int:
    return 1 << max(4, (int(n) - 1).bit_length())


def _compact_buffers(bs: int, n: int, device):
    i32: dict[str, Any] = dict(dtype=torch.int32, device=device)
    f32: dict[str, Any] = dict(dtype=torch.float32, device=device)
    return dict(
        path=torch.full((bs, n), -1, **i32), plen=torch.zeros(bs, **i32),
        dnode=torch.full((bs, n), -1, **i32), dprob=torch.zeros(bs, n, **f32), dmass=torch.zeros(bs, n, **f32),
        dcount=torch.zeros(bs, **i32), btok=torch.full((bs,), -1, **i32), bkind=torch.zeros(bs, **i32),
        bmass=torch.zeros(bs, dtype=torch.float64, device=device),
        bprob=torch.zeros(bs, dtype=torch.float64, device=device), err=torch.zeros(bs, **i32),
        errnode=torch.zeros(bs, **i32),
    )


def _tree_buffers(vi: DDTreeVerifyInput, device):
    return [getattr(vi, f).to(device=device, dtype=torch.int64).contiguous()
            for f in ("node_token_ids", "retrieve_next_token", "retrieve_next_sibling", "num_nodes")]


def _low_bits(dtype: torch.dtype) -> int:
    return {torch.bfloat16: 16, torch.float16: 13, torch.float32: 0}[dtype]


def raise_kernel_error(out: dict) -> None:
    err = out["err"].tolist()
    for b, code in enumerate(err):
        if code:
            node = int(out["errnode"][b])
            if code in _ROW_ERRORS:
                raise ValueError(f"target logits, request {b}, node {node}: row has {_ROW_ERRORS[code]}")
            if code == 4:
                raise ValueError(f"request {b}, node {node}: sibling chain longer than the tree "
                                 "(a cycle in retrieve_next_sibling)")
            if code == 6:
                raise ValueError(f"request {b}, node {node}: the walk reaches more nodes than the tree has "
                                 "(retrieve buffers are not a tree)")
            raise ValueError(f"request {b}, node {node}: a retrieve buffer or token index is out of range")


class _KernelRule:
    """The verdicts a kernel wrote into its compact arrays, replayed through the one walk.

    ``dnode/dprob/dmass[j]`` are the kernel's visited siblings in walk order and ``path`` its
    accepted path; the walk checks that they follow the buffers' sibling chains."""

    def __init__(self, request, tokens, host, coins, final):
        self.request, self.tokens, self.coins, self.final = request, tokens, coins, final
        self.path = host["path"][request][: host["plen"][request]]
        self.dnode = host["dnode"][request][: host["dcount"][request]]
        self.dprob, self.dmass = host["dprob"][request], host["dmass"][request]
        self.host, self.j = host, 0

    def decide(self, node, depth, children):
        out = []
        u = None if self.coins is None else self.coins[node]
        for _child in children:
            if self.j >= len(self.dnode):
                break
            j = self.j
            self.j += 1
            accept = depth < len(self.path) and self.path[depth] == self.dnode[j]
            out.append(Decision(self.request, depth, node, self.dnode[j], self.tokens[self.dnode[j]], self.dprob[j],
                                self.dmass[j], u, "accept" if accept else "reject"))
            if accept:
                break
        return out

    def bonus(self, node, children, rejected):
        b = self.request
        if self.j != len(self.dnode) or node != self.path[-1]:
            raise ValueError(f"request {b}: the kernel's output does not follow the buffers (its walk ended at node "
                             f"{self.path[-1]} after {len(self.dnode)} decisions, the buffers' at node {node} after "
                             f"{self.j})")
        token = self.host["btok"][b]
        if self.coins is None:
            return BonusDraw(b, node, token, "argmax", 1.0, None, self.host["bprob"][b])
        return BonusDraw(b, node, token, _KIND_NAMES[self.host["bkind"][b]], self.host["bmass"][b], self.final[b],
                         self.host["bprob"][b])


def _expand(vi: DDTreeVerifyInput, out: dict, coins: list | None, final: list | None, backend: str,
            thresholds=(1.0, 1.0)) -> VerifyOutput:
    """The kernels' compact arrays as a :class:`VerifyOutput`, through :func:`ddtree_lab.verify.walk`."""
    host = {k: v.cpu().tolist() for k, v in out.items()}
    tokens = vi.node_token_ids.tolist()
    return walk_batch(vi, lambda b: _KernelRule(b, tokens[b], host, None if coins is None else coins[b], final),
                      backend, thresholds)


def _launch_inputs(verify_input, target_logits):
    """What both launchers start from: the kernels, row-contiguous logits, the compact output
    buffers and the tree buffers on the logits' device (raises where the kernels cannot run)."""
    _require_triton(target_logits.device)
    module, interpreted = triton_kernels()
    assert module is not None and isinstance(interpreted, bool)  # _require_triton raised otherwise
    bs, n, _vocab = target_logits.shape
    logits = target_logits if target_logits.stride(-1) == 1 else target_logits.contiguous()
    return (module, interpreted, logits, _compact_buffers(bs, n, logits.device),
            _tree_buffers(verify_input, logits.device))


def sampled_launcher(verify_input, target_logits, items, coins, final_coins, *, threshold_single=1.0, threshold_acc=1.0):
    """``(launch, out)``: a no-argument function that runs the sampled kernel once into the
    compact buffers ``out`` (no checks, no expansion; for benchmarks and custom pipelines).
    Arguments as :func:`verify_tree` with ``items`` one :class:`SamplingParams` per request."""
    module, interpreted, logits, out, (tok, nt, ns, nn) = _launch_inputs(verify_input, target_logits)
    device = logits.device
    bs, n, vocab = logits.shape
    temperature, top_k, top_p, min_p = _params_tensors(items, vocab, device)
    # [threshold_single, max(threshold_acc, 1e-9)] as float32 values (SGLang's kernel arithmetic),
    # then the rule: 1.0 = SGLang's lossy rule, 0.0 = the lossless one (ddtree_lab.verify.rules)
    single32 = float(np.float32(threshold_single))
    acc32 = float(max(np.float32(threshold_acc), np.float32(SGLANG_MIN_THRESHOLD_ACC)))
    thresholds = torch.tensor([single32, acc32, 1.0 if is_lossy(threshold_single, threshold_acc) else 0.0],
                              dtype=torch.float64, device=device)
    coins, final_coins = coins.to(device).contiguous(), final_coins.to(device).contiguous()
    extra = launch_options(module, interpreted, COMPACT_CAP > 0)
    kcap = max(16, COMPACT_CAP)
    scratch_x = torch.empty(bs, kcap, dtype=torch.float32, device=device)
    scratch_i = torch.empty(bs, kcap, dtype=torch.int32, device=device)

    def launch():
        module.sampled_verify_kernel[(bs,)](
            logits, logits.stride(0), logits.stride(1), vocab, n,
            tok, nt, ns, nn, temperature, top_k, top_p, min_p, coins, final_coins, thresholds,
            out["path"], out["plen"], out["dnode"], out["dprob"], out["dmass"], out["dcount"],
            out["btok"], out["bkind"], out["bmass"], out["bprob"], out["err"], out["errnode"], scratch_x, scratch_i,
            LOW=_low_bits(logits.dtype), BLOCK=_block(vocab, device), KCAP=kcap, COMPACT=COMPACT_CAP > 0, **extra,
        )

    return launch, out


def greedy_launcher(verify_input, target_logits):
    """``(launch, out)`` for the greedy kernel, as :func:`sampled_launcher`."""
    module, interpreted, logits, out, (tok, nt, ns, nn) = _launch_inputs(verify_input, target_logits)
    device = logits.device
    bs, n, vocab = logits.shape
    extra = launch_options(module, interpreted)

    def launch():
        module.greedy_verify_kernel[(bs,)](
            logits, logits.stride(0), logits.stride(1), vocab, n, tok, nt, ns, nn,
            out["path"], out["plen"], out["dnode"], out["dprob"], out["dmass"], out["dcount"],
            out["btok"], out["bprob"], out["err"], out["errnode"],
            BLOCK=_block(vocab, device), **extra,
        )

    return launch, out


def triton_usable(device: torch.device | str) -> tuple[bool, str, str]:
    """``(usable, name, why)``: whether the kernels can run on tensors on ``device``; ``name``
    is ``"triton"`` (CUDA) or ``"triton-interpret"`` (kernels imported under ``TRITON_INTERPRET=1``)."""
    device = torch.device(device)
    kernels = triton_kernels()
    if kernels[0] is None:
        return False, "", kernels[1]
    if kernels[1]:  # interpreted kernels run on host memory
        return True, "triton-interpret", "kernels imported under TRITON_INTERPRET=1"
    if device.type == "cuda":
        return True, "triton", "CUDA tensors"
    return False, "", f"tensors on {device.type} and TRITON_INTERPRET was not 1 when ddtree_lab.kernels was imported"


def _require_triton(device) -> None:
    usable, _name, why = triton_usable(device)
    if not usable:
        raise RuntimeError(f"backend 'triton' cannot run: {why}")


def verify_triton_sampled(vi: DDTreeVerifyInput, logits: torch.Tensor, items: Sequence[SamplingParams],
                          coins: torch.Tensor, final_coins: torch.Tensor, name: str,
                          threshold_single: float = 1.0, threshold_acc: float = 1.0) -> VerifyOutput:
    """Run the sampled kernel once on checked inputs and expand its output into a
    :class:`VerifyOutput` recorded as backend ``name`` (arguments as
    :func:`ddtree_lab.verify_tree`; ``items`` one :class:`SamplingParams` per request).

    Raises:
        ValueError: a walked row has NaN / +inf / only -inf logits (naming request and node).
    """
    launch, out = sampled_launcher(vi, logits, items, coins, final_coins,
                                   threshold_single=threshold_single, threshold_acc=threshold_acc)
    launch()
    raise_kernel_error(out)
    return _expand(vi, out, coins.tolist(), final_coins.tolist(), name, (threshold_single, threshold_acc))


def verify_triton_greedy(vi: DDTreeVerifyInput, logits: torch.Tensor, name: str) -> VerifyOutput:
    """Run the greedy kernel once on checked inputs and expand its output (as
    :func:`ddtree_lab.verify_tree_greedy`)."""
    launch, out = greedy_launcher(vi, logits)
    launch()
    raise_kernel_error(out)
    return _expand(vi, out, None, None, name)
