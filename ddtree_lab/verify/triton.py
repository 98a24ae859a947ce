"""The Triton backend: launch the kernels in ddtree_lab.kernels and expand their outputs into walk events."""

from __future__ import annotations

import functools
import math
import threading
from collections import OrderedDict
from typing import Sequence

import numpy as np
import torch

from ..buffers import DDTreeVerifyInput
from ..sampling import SamplingParams
from .rules import SGLANG_MIN_THRESHOLD_ACC
from .types import BonusDraw, Decision, VerifyOutput, is_lossy
from .walking import host_tree_from, walk_batch

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


#: Parameter tensors of recent launches (read-only for the kernel), keyed by their values and
#: device: a live session launches with the same parameters every step.
_PARAMS_CACHE: "OrderedDict[tuple, tuple]" = OrderedDict()
_PARAMS_CACHE_SIZE = 16


def _params_tensors(items: Sequence[SamplingParams], vocab: int, device, thresholds: tuple):
    """``(temperature, top_k, top_p, min_p, thresholds)`` device tensors of a launch, from a
    small cache keyed by the values (one host-to-device copy on a miss, none on a hit)."""
    key = (torch.device(device), tuple((p.temperature, p.top_k if 0 < p.top_k < vocab else 0, p.top_p,
                                        p.min_p or 0.0) for p in items), thresholds)
    hit = _PARAMS_CACHE.get(key)
    if hit is not None:
        _PARAMS_CACHE.move_to_end(key)
        return hit
    bs = len(items)
    # float64 holds every value exactly; the casts on the device round as torch.tensor(list, dtype) does
    packed = torch.tensor([v for row in key[1] for v in row] + list(thresholds), dtype=torch.float64)
    packed = packed.to(device)
    cols = packed[:4 * bs].view(bs, 4)
    made = (cols[:, 0].to(torch.float32).contiguous(), cols[:, 1].to(torch.int32).contiguous(),
            cols[:, 2].to(torch.float32).contiguous(), cols[:, 3].to(torch.float32).contiguous(),
            packed[4 * bs:].contiguous())
    _PARAMS_CACHE[key] = made
    while len(_PARAMS_CACHE) > _PARAMS_CACHE_SIZE:
        _PARAMS_CACHE.popitem(last=False)
    return made


def _block(vocab: int, device) -> int:
    return min(4096 if device.type == "cuda" else 1024, _next_pow2(vocab))


def _next_pow2(n: int) -> int:
    return 1 << max(4, (int(n) - 1).bit_length())


# The compact outputs, a copy of the tree buffers and the coins share one byte buffer (the
# "arena"): one allocation per launch, and one device-to-host copy reads everything back.
# (name, dtype, shape as a function of bs and n); sections in falling element size keep every
# view aligned.
_ARENA = (
    ("bmass", torch.float64, lambda bs, n: (bs,)), ("bprob", torch.float64, lambda bs, n: (bs,)),
    ("tok", torch.int64, lambda bs, n: (bs, n)), ("nt", torch.int64, lambda bs, n: (bs, n)),
    ("ns", torch.int64, lambda bs, n: (bs, n)), ("nn", torch.int64, lambda bs, n: (bs,)),
    ("max_path", torch.int64, lambda bs, n: (1,)),
    ("dprob", torch.float32, lambda bs, n: (bs, n)), ("dmass", torch.float32, lambda bs, n: (bs, n)),
    ("coins", torch.float32, lambda bs, n: (bs, n)), ("fcoins", torch.float32, lambda bs, n: (bs,)),
    ("path", torch.int32, lambda bs, n: (bs, n)), ("dnode", torch.int32, lambda bs, n: (bs, n)),
    ("btok", torch.int32, lambda bs, n: (bs,)), ("plen", torch.int32, lambda bs, n: (bs,)),
    ("dcount", torch.int32, lambda bs, n: (bs,)), ("bkind", torch.int32, lambda bs, n: (bs,)),
    ("err", torch.int32, lambda bs, n: (bs,)), ("errnode", torch.int32, lambda bs, n: (bs,)),
)
_OUTPUTS = ("path", "plen", "dnode", "dprob", "dmass", "dcount", "btok", "bkind", "bmass", "bprob", "err", "errnode")
_NP = {torch.float64: np.float64, torch.int64: np.int64, torch.float32: np.float32, torch.int32: np.int32}


@functools.lru_cache(maxsize=64)
def _layout(bs: int, n: int) -> tuple[list[tuple[str, torch.dtype, tuple, int]], int]:
    """``([(name, dtype, shape, byte offset)], total bytes)`` of the arena."""
    out, offset = [], 0
    for name, dtype, shape_of in _ARENA:
        shape = shape_of(bs, n)
        out.append((name, dtype, shape, offset))
        offset += math.prod(shape) * dtype.itemsize
    return out, offset


#: Arenas of :func:`verify_triton_sampled` / :func:`verify_triton_greedy`, per thread, keyed by
#: ``(bs, n, device)`` (a launch's arena is read back before the call returns, so the next
#: call on the same thread -- ordered after it on the device's stream -- may reuse it).
_REUSED = threading.local()
_REUSED_SIZE = 4


def _new_arena(bs: int, n: int, device):
    """``(arena, views, offsets)``: an uninitialised arena and its typed views by section."""
    layout, size = _layout(bs, n)
    arena = torch.empty(size, dtype=torch.uint8, device=device)
    views = {name: arena[off:off + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
             for name, dtype, shape, off in layout}
    return arena, views, {name: off for name, _d, _s, off in layout}


def _arena(vi: DDTreeVerifyInput, bs: int, n: int, device, coins=None, final_coins=None, reuse: bool = False):
    """``(arena, views)``: the arena on ``device`` (five device operations, no host read) with
    the tree buffers (int64) and the coins copied in and the outputs initialised as the
    separate buffers were (path / dnode / btok ``-1``, the rest 0). ``views`` maps each
    section's name to its typed view. ``reuse``: this thread's arena of the same shape and
    device when there is one (only for callers that read it back before returning)."""
    if reuse:
        cache = getattr(_REUSED, "arenas", None)
        if cache is None:
            cache = _REUSED.arenas = OrderedDict()
        key = (bs, n, torch.device(device))
        made = cache.get(key)
        if made is None:
            made = cache[key] = _new_arena(bs, n, device)
            while len(cache) > _REUSED_SIZE:
                cache.popitem(last=False)
        cache.move_to_end(key)
    else:
        made = _new_arena(bs, n, device)
    arena, views, offsets = made
    arena.zero_()
    # path, dnode, btok: adjacent int32 sections, one fill
    arena[offsets["path"]:offsets["plen"]].view(torch.int32).fill_(-1)
    # tok, nt, ns, nn: adjacent int64 sections, one copy
    tree = arena[offsets["tok"]:offsets["max_path"]].view(torch.int64)
    _cat_into(tree, [vi.node_token_ids, vi.retrieve_next_token, vi.retrieve_next_sibling, vi.num_nodes])
    if vi.depths.numel():
        torch.add(vi.depths.max(), 1, out=views["max_path"][0])
    else:
        views["max_path"].fill_(1)
    if coins is not None and final_coins is not None:  # coins, fcoins: adjacent float32 sections
        _cat_into(arena[offsets["coins"]:offsets["path"]].view(torch.float32), [coins, final_coins])
    return arena, views


def _cat_into(dst: torch.Tensor, parts: list[torch.Tensor]) -> None:
    """``dst`` (flat) = the flattened ``parts`` concatenated: one operation when they are on
    ``dst``'s device with its dtype, else a concatenation where they are and one copy."""
    flat = [p.reshape(-1) for p in parts]
    if all(p.device == dst.device and p.dtype == dst.dtype for p in flat):
        torch.cat(flat, out=dst)
    else:
        dst.copy_(torch.cat([p.to(dst.dtype) for p in flat]))


def _read_arena(arena: torch.Tensor, bs: int, n: int) -> dict:
    """The arena on the host as numpy arrays by section (one device-to-host copy)."""
    host = arena.numpy() if arena.device.type == "cpu" else arena.to("cpu").numpy()
    layout, _size = _layout(bs, n)
    return {name: host[off:off + math.prod(shape) * dtype.itemsize].view(_NP[dtype]).reshape(shape)
            for name, dtype, shape, off in layout}


def _low_bits(dtype: torch.dtype) -> int:
    return {torch.bfloat16: 16, torch.float16: 13, torch.float32: 0}[dtype]


def raise_kernel_error(out: dict) -> None:
    """Raise the first error code the kernel wrote into ``out["err"]`` / ``out["errnode"]``
    (tensors or host arrays; one host read of the codes), naming request and node.

    Raises:
        ValueError: a walked row with NaN / +inf / only -inf, a sibling cycle, a walk that
            revisits nodes, or a buffer index or token out of range.
    """
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


def _expand(vi: DDTreeVerifyInput, host: dict, sampled: bool, backend: str, thresholds=(1.0, 1.0)) -> VerifyOutput:
    """The kernels' compact arrays (``host``: the arena read by :func:`_read_arena`) as a
    :class:`VerifyOutput`, through :func:`ddtree_lab.verify.walk`; the tree and the coins come
    from the same read."""
    bs, n = host["path"].shape
    lists = {k: host[k].tolist() for k in _OUTPUTS}
    flat = np.concatenate([host["nt"].reshape(-1), host["ns"].reshape(-1), host["tok"].reshape(-1),
                           host["nn"], host["max_path"]]).tolist()
    tree = host_tree_from(flat, bs, n)
    coins = host["coins"].tolist() if sampled else None
    final = host["fcoins"].tolist() if sampled else None
    return walk_batch(vi, lambda b: _KernelRule(b, tree.tokens[b], lists, None if coins is None else coins[b], final),
                      backend, thresholds, tree)


def _launch_inputs(verify_input, target_logits, coins=None, final_coins=None, reuse=False):
    """What both launchers start from: the kernels, row-contiguous logits and the arena (the
    compact output buffers, the tree buffers and the coins on the logits' device; raises where
    the kernels cannot run)."""
    _require_triton(target_logits.device)
    module, interpreted = triton_kernels()
    assert module is not None and isinstance(interpreted, bool)  # _require_triton raised otherwise
    bs, n, _vocab = target_logits.shape
    logits = target_logits if target_logits.stride(-1) == 1 else target_logits.contiguous()
    arena, views = _arena(verify_input, bs, n, logits.device, coins, final_coins, reuse)
    return module, interpreted, logits, arena, views


def _launcher(verify_input, target_logits, items, coins, final_coins, threshold_single, threshold_acc, reuse=False):
    """``(launch, arena, views)`` of the sampled kernel (:func:`sampled_launcher`)."""
    module, interpreted, logits, arena, v = _launch_inputs(verify_input, target_logits, coins, final_coins, reuse)
    device = logits.device
    bs, n, vocab = logits.shape
    # [threshold_single, max(threshold_acc, 1e-9)] as float32 values (SGLang's kernel arithmetic),
    # then the rule: 1.0 = SGLang's lossy rule, 0.0 = the lossless one (ddtree_lab.verify.rules)
    single32 = float(np.float32(threshold_single))
    acc32 = float(max(np.float32(threshold_acc), np.float32(SGLANG_MIN_THRESHOLD_ACC)))
    lossy = 1.0 if is_lossy(threshold_single, threshold_acc) else 0.0
    temperature, top_k, top_p, min_p, thresholds = _params_tensors(items, vocab, device, (single32, acc32, lossy))
    extra = launch_options(module, interpreted, COMPACT_CAP > 0)
    kcap = max(16, COMPACT_CAP)
    # scratch of the survivor gather: written before it is read, never initialised
    scratch_x = torch.empty(bs, kcap, dtype=torch.float32, device=device)
    scratch_i = torch.empty(bs, kcap, dtype=torch.int32, device=device)
    meta = dict(LOW=_low_bits(logits.dtype), BLOCK=_block(vocab, device), KCAP=kcap, COMPACT=COMPACT_CAP > 0, **extra)
    kernel = module.sampled_verify_kernel[(bs,)]
    args = (logits, logits.stride(0), logits.stride(1), vocab, n,
            v["tok"], v["nt"], v["ns"], v["nn"], temperature, top_k, top_p, min_p, v["coins"], v["fcoins"], thresholds,
            v["path"], v["plen"], v["dnode"], v["dprob"], v["dmass"], v["dcount"],
            v["btok"], v["bkind"], v["bmass"], v["bprob"], v["err"], v["errnode"], scratch_x, scratch_i)

    def launch():
        kernel(*args, **meta)

    return launch, arena, v


def sampled_launcher(verify_input, target_logits, items, coins, final_coins, *, threshold_single=1.0, threshold_acc=1.0):
    """``(launch, out)``: a no-argument function that runs the sampled kernel once into the
    compact buffers ``out`` (no checks, no expansion; for benchmarks and custom pipelines).
    Arguments as :func:`verify_tree` with ``items`` one :class:`SamplingParams` per request.

    ``out`` maps ``path``, ``plen``, ``dnode``, ``dprob``, ``dmass``, ``dcount``, ``btok``,
    ``bkind``, ``bmass``, ``bprob``, ``err``, ``errnode`` to views of one device buffer (with
    the tree buffers and coins the kernel reads): one allocation per call, and the launch
    itself allocates nothing and reads nothing on the host.
    """
    launch, _arena_buf, views = _launcher(verify_input, target_logits, items, coins, final_coins,
                                          threshold_single, threshold_acc)
    return launch, {k: views[k] for k in _OUTPUTS}


def greedy_launcher(verify_input, target_logits):
    """``(launch, out)`` for the greedy kernel, as :func:`sampled_launcher`."""
    launch, _arena_buf, views = _greedy(verify_input, target_logits)
    return launch, {k: views[k] for k in _OUTPUTS}


def _greedy(verify_input, target_logits, reuse=False):
    """``(launch, arena, views)`` of the greedy kernel (:func:`greedy_launcher`)."""
    module, interpreted, logits, arena, v = _launch_inputs(verify_input, target_logits, reuse=reuse)
    device = logits.device
    bs, n, vocab = logits.shape
    extra = launch_options(module, interpreted)
    kernel = module.greedy_verify_kernel[(bs,)]
    args = (logits, logits.stride(0), logits.stride(1), vocab, n, v["tok"], v["nt"], v["ns"], v["nn"],
            v["path"], v["plen"], v["dnode"], v["dprob"], v["dmass"], v["dcount"],
            v["btok"], v["bprob"], v["err"], v["errnode"])
    block = _block(vocab, device)

    def launch():
        kernel(*args, BLOCK=block, **extra)

    return launch, arena, v


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
    The outputs, the tree and the coins come back in one device-to-host copy.

    Raises:
        ValueError: a walked row has NaN / +inf / only -inf logits (naming request and node).
    """
    launch, arena, _views = _launcher(vi, logits, items, coins, final_coins, threshold_single, threshold_acc,
                                      reuse=True)
    launch()
    host = _read_arena(arena, *logits.shape[:2])
    raise_kernel_error(host)
    return _expand(vi, host, True, name, (threshold_single, threshold_acc))


def verify_triton_greedy(vi: DDTreeVerifyInput, logits: torch.Tensor, name: str) -> VerifyOutput:
    """Run the greedy kernel once on checked inputs and expand its output (as
    :func:`ddtree_lab.verify_tree_greedy`), read back in one device-to-host copy."""
    launch, arena, _views = _greedy(vi, logits, reuse=True)
    launch()
    host = _read_arena(arena, *logits.shape[:2])
    raise_kernel_error(host)
    return _expand(vi, host, False, name)
