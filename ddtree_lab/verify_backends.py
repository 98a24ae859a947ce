"""Verify from raw target logits with a chosen backend, recording which one ran.

Two entry points with the reference verifiers' meaning:

* :func:`verify_tree` -- sampled verify (greedy requests, ``temperature == 0``, ride along as
  one-hot rows): the same result as
  ``verify_sampled(vi, target_probs(logits, params, vi.num_nodes), coins, final_coins)``.
* :func:`verify_tree_greedy` -- greedy verify: the same result as
  ``verify_greedy(vi, logits)``.

Backends (``VerifyOutput.backend`` says which one ran; nothing falls back silently):

* ``"reference"`` -- the reference verifiers over the full ``[bs, N, V]`` probability tensor.
* ``"torch-lazy"`` -- the reference walk, computing each row's distribution only when the
  walk reaches it (bit-identical to the reference; the CPU benchmark's lazy algorithm).
* ``"triton"`` -- the kernels in :mod:`ddtree_lab.kernels.tree_verify` on a CUDA device;
  recorded as ``"triton-interpret"`` when the kernels were imported under
  ``TRITON_INTERPRET=1`` and run on the CPU.
* ``"auto"`` -- ``"triton"`` when it can run on the logits' device (a CUDA tensor and
  Triton installed, or the interpreter active), else ``"reference"``.

Exactness of the Triton backend against the reference: tokens, indices, verdicts, bonus kind
and ``support_exhausted`` bit for bit; probabilities in the decision log and bonus record
within :data:`PROB_ATOL` + :data:`PROB_RTOL` x value. The one exception is a coin lying
within that tolerance of a decision boundary (or a top-p / min-p cut landing within it), where
either verdict is a correct rounding of the rule (probability ~1e-6 per decision).

Invalid input: shapes, buffer ranges, token ids, coins and parameters are checked on the
host before launch with the reference's messages. A NaN, ``+inf`` or all ``-inf`` logit row
is reported as in the reference when the walk reaches it; the lazy backends do not read (or
check) rows the walk never reaches.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ._checks import check_tensor
from .sampling import SamplingParams, filtered_probs, normalize_params, target_probs
from .verify import (
    SGLANG_MIN_THRESHOLD_ACC,
    BonusDraw,
    Decision,
    VerifyOutput,
    _check_coins,
    _check_thresholds,
    _check_verify_input,
    is_lossy,
    walk_batch,
    walk_sampled_batch,
    verify_greedy,
    verify_sampled,
)
from .retrieve import DDTreeVerifyInput, check_verify_buffers

__all__ = ["verify_tree", "verify_tree_greedy", "select_backend", "sampled_launcher", "greedy_launcher",
           "lazy_row_probs",
           "PROB_ATOL", "PROB_RTOL", "BACKENDS"]

BACKENDS = ("auto", "reference", "torch-lazy", "triton")

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


def _triton_kernels():
    """(module, interpreted) or (None, reason)."""
    try:
        from .kernels import tree_verify
    except ImportError as exc:  # triton missing
        return None, f"triton is not importable ({exc})"
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover - layout of older tritons
        InterpretedFunction = ()
    return tree_verify, isinstance(tree_verify.sampled_verify_kernel, InterpretedFunction)


def _launch_options(module, interpreted: bool, compact: bool = True) -> dict:
    """The kernels' pinned launch options (``module.launch_options``: fusion off, 8 warps, 4
    without the survivor gather); the interpreter gets the same ``enable_fp_fusion`` (it has
    no warps)."""
    if interpreted:
        return {"enable_fp_fusion": module.FP_FUSION}
    return module.launch_options(compact)


def select_backend(backend: str, device: torch.device | str) -> tuple[str, str]:
    """Resolve ``backend`` for tensors on ``device``: ``(name, why)``.

    ``name`` is ``"reference"``, ``"torch-lazy"``, ``"triton"`` or ``"triton-interpret"``.

    Raises:
        ValueError: unknown backend name.
        RuntimeError: ``backend="triton"`` where the kernels cannot run (the reason named).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend in ("reference", "torch-lazy"):
        return backend, "requested"
    device = torch.device(device)
    module, info = _triton_kernels()
    if module is None:
        usable, name, why = False, "", info
    elif info:  # interpreted kernels run on host memory
        usable, name, why = True, "triton-interpret", "kernels imported under TRITON_INTERPRET=1"
    elif device.type == "cuda":
        usable, name, why = True, "triton", "CUDA tensors"
    else:
        usable, name, why = False, "", (f"tensors on {device.type} and TRITON_INTERPRET was not 1 when "
                                        "ddtree_lab.kernels was imported")
    if backend == "triton":
        if not usable:
            raise RuntimeError(f"backend 'triton' cannot run: {why}")
        return name, why
    return (name, why) if usable else ("reference", f"auto: {why}")


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
    i32 = dict(dtype=torch.int32, device=device)
    f32 = dict(dtype=torch.float32, device=device)
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


def _raise_kernel_error(out: dict) -> None:
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
        for child in children:
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


def _row_problem(row: torch.Tensor) -> str | None:
    if torch.isnan(row).any():
        return "NaN"
    if torch.isneginf(row).all():
        return "every entry -inf"
    if torch.isposinf(row).any():
        return "+inf"
    return None


def verify_tree(
    verify_input: DDTreeVerifyInput,
    target_logits: torch.Tensor,
    params: SamplingParams | Sequence[SamplingParams],
    coins: torch.Tensor,
    final_coins: torch.Tensor,
    *,
    backend: str = "auto",
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
    validate: bool = True,
) -> VerifyOutput:
    """Sampled tree verify from raw logits (mixed greedy / sampled requests in one call).

    Args:
        verify_input: buffers from :func:`ddtree_lab.compile_retrieve`.
        target_logits: ``[bs, N, V]`` float32 / float16 / bfloat16 target logits, read as given.
        params: one :class:`SamplingParams` or one per request (``temperature == 0``: greedy,
            as one-hot rows).
        coins: ``[bs, N]`` float32 in [0, 1); final_coins: ``[bs]`` float32 in [0, 1).
        backend: ``"auto"``, ``"reference"``, ``"torch-lazy"`` or ``"triton"`` (module docstring).
        threshold_single, threshold_acc: 1.0 for the exact rule; any finite value >= 0 (0
            included, as SGLang) marks the output ``lossy`` (see :func:`verify_sampled`).
        validate: check the buffers first (:func:`ddtree_lab.check_verify_buffers`, O(N) per
            request); ``False`` only for timing.

    Returns:
        :class:`VerifyOutput` equal to ``verify_sampled(verify_input, target_probs(...), coins,
        final_coins)`` (tolerance in the module docstring), ``backend`` naming what ran.

    Raises:
        ValueError / TypeError: as the reference (shapes, ranges, broken buffers, coins,
            parameters, a bad logit row -- only rows the walk reaches for the lazy backends);
            ``backend="triton"`` for a request whose ``order`` is not ``"top_k_then_top_p"``
            (the kernel fuses that order only; ``"auto"`` then runs the reference).
        RuntimeError: ``backend="triton"`` where it cannot run.
    """
    check_tensor("target_logits", target_logits, dtype=(torch.float32, torch.float16, torch.bfloat16), ndim=3)
    _check_verify_input(verify_input, target_logits, "target_logits")
    bs, n, vocab = target_logits.shape
    items = normalize_params(params, bs, vocab)
    _check_coins(coins, final_coins, bs, n)
    _check_thresholds(threshold_single, threshold_acc)
    if validate:
        check_verify_buffers(verify_input)
    name, _why = select_backend(backend, target_logits.device)
    other_order = [b for b, p in enumerate(items) if p.order != KERNEL_ORDER]
    if other_order and name.startswith("triton"):
        if backend == "triton":
            b = other_order[0]
            raise ValueError(f"request {b}: order {items[b].order!r}: the Triton kernel fuses {KERNEL_ORDER!r} only "
                             "(use backend='reference' or 'torch-lazy')")
        name = "reference"
    if name == "reference":
        probs = target_probs(target_logits, items, verify_input.num_nodes.to(target_logits.device))
        return verify_sampled(verify_input, probs, coins, final_coins,
                              threshold_single=threshold_single, threshold_acc=threshold_acc, validate=False)
    if name == "torch-lazy":
        return _verify_lazy(verify_input, target_logits, items, coins, final_coins, threshold_single, threshold_acc)
    launch, out = sampled_launcher(verify_input, target_logits, items, coins, final_coins,
                                   threshold_single=threshold_single, threshold_acc=threshold_acc)
    launch()
    _raise_kernel_error(out)
    return _expand(verify_input, out, coins.tolist(), final_coins.tolist(), name, (threshold_single, threshold_acc))


def sampled_launcher(verify_input, target_logits, items, coins, final_coins, *, threshold_single=1.0, threshold_acc=1.0):
    """``(launch, out)``: a no-argument function that runs the sampled kernel once into the
    compact buffers ``out`` (no checks, no expansion; for benchmarks and custom pipelines).
    Arguments as :func:`verify_tree` with ``items`` one :class:`SamplingParams` per request."""
    select_backend("triton", target_logits.device)  # raises where the kernels cannot run
    module, interpreted = _triton_kernels()
    device = target_logits.device
    bs, n, vocab = target_logits.shape
    logits = target_logits if target_logits.stride(-1) == 1 else target_logits.contiguous()
    out = _compact_buffers(bs, n, device)
    tok, nt, ns, nn = _tree_buffers(verify_input, device)
    temperature, top_k, top_p, min_p = _params_tensors(items, vocab, device)
    # [threshold_single, max(threshold_acc, 1e-9)] as float32 values (SGLang's kernel arithmetic),
    # then the rule: 1.0 = SGLang's lossy rule, 0.0 = the lossless one (ddtree_lab.verify)
    single32 = float(np.float32(threshold_single))
    acc32 = float(max(np.float32(threshold_acc), np.float32(SGLANG_MIN_THRESHOLD_ACC)))
    thresholds = torch.tensor([single32, acc32, 1.0 if is_lossy(threshold_single, threshold_acc) else 0.0],
                              dtype=torch.float64, device=device)
    coins, final_coins = coins.to(device).contiguous(), final_coins.to(device).contiguous()
    extra = _launch_options(module, interpreted, COMPACT_CAP > 0)
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


def verify_tree_greedy(
    verify_input: DDTreeVerifyInput, target_logits: torch.Tensor, *, backend: str = "auto", validate: bool = True
) -> VerifyOutput:
    """Greedy tree verify with a chosen backend; the same result as :func:`verify_greedy`.

    The Triton kernel reads each walked row once (argmax, lowest id on ties, and the softmax
    normaliser for the logged probabilities). ``backend="torch-lazy"`` is the reference here
    (the reference greedy walk is already cheap); it is recorded as ``"reference"``.

    Args / Raises: as :func:`verify_tree` without the sampling arguments (``validate`` as there).
    """
    check_tensor("target_logits", target_logits, dtype=(torch.float32, torch.float16, torch.bfloat16), ndim=3)
    _check_verify_input(verify_input, target_logits, "target_logits")
    if validate:
        check_verify_buffers(verify_input)
    bs, n, vocab = target_logits.shape
    name, _why = select_backend(backend, target_logits.device)
    if name in ("reference", "torch-lazy"):
        return verify_greedy(verify_input, target_logits, validate=False)
    launch, out = greedy_launcher(verify_input, target_logits)
    launch()
    _raise_kernel_error(out)
    return _expand(verify_input, out, None, None, name)


def greedy_launcher(verify_input, target_logits):
    """``(launch, out)`` for the greedy kernel, as :func:`sampled_launcher`."""
    select_backend("triton", target_logits.device)  # raises where the kernels cannot run
    module, interpreted = _triton_kernels()
    device = target_logits.device
    bs, n, vocab = target_logits.shape
    logits = target_logits if target_logits.stride(-1) == 1 else target_logits.contiguous()
    out = _compact_buffers(bs, n, device)
    tok, nt, ns, nn = _tree_buffers(verify_input, device)
    extra = _launch_options(module, interpreted)

    def launch():
        module.greedy_verify_kernel[(bs,)](
            logits, logits.stride(0), logits.stride(1), vocab, n, tok, nt, ns, nn,
            out["path"], out["plen"], out["dnode"], out["dprob"], out["dmass"], out["dcount"],
            out["btok"], out["bprob"], out["err"], out["errnode"],
            BLOCK=_block(vocab, device), **extra,
        )

    return launch, out


def _verify_lazy(vi, logits, items, coins, final_coins, threshold_single, threshold_acc) -> VerifyOutput:
    """The reference walk; each row's distribution computed only when the walk reaches it."""

    def row_of(b: int, i: int) -> torch.Tensor:
        row = logits[b, i].float()
        what = _row_problem(row)
        if what is not None:
            raise ValueError(f"target logits, request {b}, node {i}: row has {what}")
        return lazy_row_probs(row, items[b])

    return walk_sampled_batch(vi, row_of, coins, final_coins, threshold_single, threshold_acc, None, "torch-lazy")


def lazy_row_probs(row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One row of :func:`ddtree_lab.target_probs`, bit for bit, with less work.

    ``row``: ``[V]`` float32 logits (already checked). The same torch ops as the reference,
    except that with top-k on, top-p sorts only the top-k survivors: the reference's sorted
    row is those survivors followed by zeros, its float32 running sum is the survivors'
    running sum followed by a constant, so the first position reaching ``top_p`` (or none,
    meaning keep all) is the same.
    """
    vocab = row.shape[-1]
    if params.is_greedy:
        return torch.zeros_like(row).scatter_(-1, row.argmax(-1, keepdim=True), 1.0)
    if params.order != KERNEL_ORDER:  # the reference's own row function
        return filtered_probs(row, params)
    scaled = row / torch.full_like(row[..., :1], params.temperature)
    survivors = None
    if 0 < params.top_k < vocab:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[..., -1:]
        survivors = scaled >= kth
        scaled = scaled.masked_fill(~survivors, -float("inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        candidates = probs if survivors is None else probs[survivors]
        sorted_p = torch.sort(candidates, dim=-1, descending=True).values
        cum = sorted_p.cumsum(-1)
        pos = int(torch.searchsorted(cum, torch.full_like(cum[..., :1], params.top_p)))
        if pos < sorted_p.shape[-1]:
            keep = probs >= sorted_p[pos]
        elif survivors is None or survivors.all():
            keep = probs >= sorted_p[-1]  # the reference clamps to the last sorted value
        else:
            keep = probs >= 0.0  # the reference's cut lands on a zero: keep all
        probs = probs * keep
        probs = probs / probs.sum(-1, keepdim=True)
    if params.min_p:
        probs = probs * (probs >= params.min_p * probs.max(-1, keepdim=True).values)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs
