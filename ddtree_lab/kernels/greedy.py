"""The greedy tree-verify Triton kernel, one program per request.

The contract (walk, rules, numerics, error codes) is in :mod:`ddtree_lab.kernels.tree_verify`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .row_ops import advance, child_token, log_decision, row_max, store_walk, walk_start


@triton.jit
def greedy_verify_kernel(
    logits_ptr, stride_b, stride_n, V, N,
    tok_ptr, nt_ptr, ns_ptr, nn_ptr,
    path_ptr, plen_ptr, dnode_ptr, dprob_ptr, dmass_ptr, dcount_ptr,
    btok_ptr, bprob_ptr, err_ptr, errnode_ptr,
    BLOCK: tl.constexpr,
):
    """Greedy tree verify of request ``program_id(0)``: one pass per walked row (argmax and
    the softmax normaliser for the logged probabilities). Launch with ``tree_verify.LAUNCH_OPTIONS``
    (fusion off, see ``tree_verify.FP_FUSION``)."""
    b = tl.program_id(0).to(tl.int64)
    base = b * N
    n = tl.load(nn_ptr + b)
    cur, plen, dcount, err, going = walk_start(path_ptr, base)
    m = tl.zeros([], tl.float32)
    amax = tl.zeros([], tl.int32)
    z = tl.full([], 1.0, tl.float32)
    while going != 0:
        row_ptr = logits_ptr + b * stride_b + cur * stride_n
        m, amax, z, err = row_max(row_ptr, V, True, BLOCK)  # pyright: ignore[reportArgumentType]  # WITH_Z: constexpr
        child = tl.load(nt_ptr + base + cur)
        mass = tl.zeros([], tl.float32)
        acc = tl.full([], -1, tl.int64)
        steps = tl.zeros([], tl.int64)
        while (child >= 0) & (acc < 0) & (err == 0):
            err, tok = child_token(tok_ptr, base, child, steps, dcount, n, N, V)
            if err == 0:
                x = tl.load(row_ptr + tok).to(tl.float32)
                p = tl.math.div_rn(tl.exp(x - m), z)
                mass = mass + p
                ok = tok == amax
                log_decision(dnode_ptr, dprob_ptr, dmass_ptr, base + dcount, child, p, mass)
                dcount += 1
                steps += 1
                acc = tl.where(ok, child, acc)
                child = tl.where(ok, child, tl.load(ns_ptr + base + child))
        going, cur, plen = advance(err, acc, cur, plen, path_ptr, base)
    store_walk(plen_ptr, dcount_ptr, err_ptr, errnode_ptr, b, plen, dcount, err, cur)
    tl.store(btok_ptr + b, amax)
    tl.store(bprob_ptr + b, tl.math.div_rn(1.0, z))
