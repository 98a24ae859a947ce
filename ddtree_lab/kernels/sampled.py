"""The sampled tree-verify Triton kernel, one program per request.

The contract (walk, rules, numerics, error codes) is in :mod:`ddtree_lab.kernels.tree_verify`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .row_ops import (advance, child_token, compact_residual, log_decision, p_final, residual_block,
                      residual_total, row_state, store_walk, walk_start)


@triton.jit
def sampled_verify_kernel(
    logits_ptr, stride_b, stride_n, V, N,
    tok_ptr, nt_ptr, ns_ptr, nn_ptr,
    temp_ptr, topk_ptr, topp_ptr, minp_ptr,
    coin_ptr, fcoin_ptr, thr_ptr,
    path_ptr, plen_ptr, dnode_ptr, dprob_ptr, dmass_ptr, dcount_ptr,
    btok_ptr, bkind_ptr, bmass_ptr, bprob_ptr, err_ptr, errnode_ptr, sx_ptr, si_ptr,
    LOW: tl.constexpr, BLOCK: tl.constexpr, KCAP: tl.constexpr, COMPACT: tl.constexpr,
):
    """Sampled tree verify of request ``program_id(0)`` (module docstring). ``sx``/``si``:
    float32 / int32 scratch ``[bs, KCAP]`` for the gathered top-k survivors (used when
    COMPACT). ``thr``: float64 ``[3]``, threshold_single and ``max(threshold_acc, 1e-9)`` as
    float32 values, then 1.0 for SGLang's lossy rule or 0.0 for the lossless one. Launch with
    ``tree_verify.LAUNCH_OPTIONS`` (fusion off, see ``tree_verify.FP_FUSION``)."""
    b = tl.program_id(0).to(tl.int64)
    offs0 = tl.arange(0, BLOCK)
    base = b * N
    sx_ptr += b * KCAP
    si_ptr += b * KCAP
    compact = tl.zeros([], tl.int32)
    count = tl.zeros([], tl.int32)
    n = tl.load(nn_ptr + b)
    T = tl.load(temp_ptr + b)
    K = tl.load(topk_ptr + b)
    P = tl.load(topp_ptr + b)
    MINP = tl.load(minp_ptr + b)
    # thresholds: [threshold_single, SGLang's floored threshold_acc (float32 values), lossy flag]
    t_single = tl.load(thr_ptr).to(tl.float32)
    t_acc = tl.load(thr_ptr + 1).to(tl.float32)
    lossy = tl.load(thr_ptr + 2) > 0.5
    cur, plen, dcount, err, going = walk_start(path_ptr, base)
    # state of the last visited row (used by the bonus draw)
    amax = tl.zeros([], tl.int32)
    ms = tl.zeros([], tl.float32)
    kth_s = tl.zeros([], tl.float32)
    z1 = tl.full([], 1.0, tl.float32)
    cut = tl.zeros([], tl.float32)
    z2 = tl.full([], 1.0, tl.float32)
    mthr = tl.zeros([], tl.float32)
    z3 = tl.full([], 1.0, tl.float32)
    first_child = tl.full([], -1, tl.int64)
    total = tl.zeros([], tl.float64)
    have_total = tl.zeros([], tl.int32)
    while going != 0:
        row_ptr = logits_ptr + b * stride_b + cur * stride_n
        amax, rerr, ms, kth_s, z1, cut, z2, mthr, z3, compact, count = row_state(
            row_ptr, V, T, K, P, MINP, sx_ptr, si_ptr, LOW, BLOCK, KCAP, COMPACT)
        err = rerr
        u = tl.load(coin_ptr + base + cur)
        first_child = tl.load(nt_ptr + base + cur)
        child = first_child
        mass = tl.zeros([], tl.float32)
        acc = tl.full([], -1, tl.int64)
        steps = tl.zeros([], tl.int64)
        last_j = tl.full([], -1, tl.int32)  # decision slot and node of the last child with p > 0
        last_c = tl.full([], -1, tl.int64)
        have_total = tl.zeros([], tl.int32)
        while (child >= 0) & (acc < 0) & (err == 0):
            err, tok = child_token(tok_ptr, base, child, steps, dcount, n, N, V)
            if err == 0:
                x = tl.load(row_ptr + tok).to(tl.float32)
                if T > 0:
                    p = p_final(x, T, ms, kth_s, z1, cut, z2, mthr, z3)
                else:
                    p = tl.where(tok == amax, 1.0, 0.0)
                mass = mass + p
                # lossless: p > 0 and (u < S or p >= threshold_single); lossy: SGLang's rule,
                # u <= S / threshold_acc or p >= threshold_single in float32, no p > 0 guard
                ok_exact = (p > 0.0) & ((u < mass) | (p >= t_single))
                ok_sglang = (u <= tl.math.div_rn(mass, t_acc)) | (p >= t_single)
                ok = tl.where(lossy, ok_sglang, ok_exact)
                last_j = tl.where(p > 0.0, dcount, last_j)
                last_c = tl.where(p > 0.0, child, last_c)
                log_decision(dnode_ptr, dprob_ptr, dmass_ptr, base + dcount, child, p, mass)
                dcount += 1
                steps += 1
                acc = tl.where(ok, child, acc)
                child = tl.where(ok, child, tl.load(ns_ptr + base + child))
        if (err == 0) & (acc < 0) & (last_j >= 0) & (T > 0) & (lossy == 0):
            # every child rejected on float32 sums: if they hold the whole row, exact arithmetic
            # has S_K = 1 > u and takes the last child with p > 0 (the reference's rule; the
            # lossy SGLang rule has none)
            total = residual_total(row_ptr, V, T, ms, kth_s, z1, cut, z2, mthr, z3, tok_ptr, ns_ptr, base,
                                   first_child, n, sx_ptr, si_ptr, count, compact, BLOCK, KCAP, COMPACT)
            have_total = tl.full([], 1, tl.int32)
            if total == 0.0:
                dcount = last_j + 1
                tl.store(dmass_ptr + base + last_j, 1.0)
                acc = last_c
        going, cur, plen = advance(err, acc, cur, plen, path_ptr, base)
    store_walk(plen_ptr, dcount_ptr, err_ptr, errnode_ptr, b, plen, dcount, err, cur)
    # ---- bonus draw at `cur`
    if err == 0:
        fcoin = tl.load(fcoin_ptr + b)
        kind = tl.where(first_child >= 0, 1, 2)
        if (T > 0) & (compact == 0):
            row_ptr = logits_ptr + b * stride_b + cur * stride_n
            if have_total == 0:  # (the FP-edge test above already summed this residual)
                total = tl.zeros([], tl.float64)
                for start in range(0, V, BLOCK):
                    offs = start + offs0
                    p = residual_block(row_ptr, offs, V, T, ms, kth_s, z1, cut, z2, mthr, z3,
                                       tok_ptr, ns_ptr, base, first_child, n)
                    total += tl.sum(p.to(tl.float64), 0)
            if total > 0.0:  # pyright: ignore[reportOperatorIssue]  # stubs: tl.sum may be a tuple
                target = fcoin.to(tl.float64) * total
                found = tl.full([], -1, tl.int32)
                last_pos = tl.full([], -1, tl.int32)
                running = tl.zeros([], tl.float64)
                start = tl.zeros([], tl.int32)
                while (start < V) & (found < 0):
                    offs = start + offs0
                    p = residual_block(row_ptr, offs, V, T, ms, kth_s, z1, cut, z2, mthr, z3,
                                       tok_ptr, ns_ptr, base, first_child, n)
                    cs = running + tl.cumsum(p.to(tl.float64), 0)
                    hit = tl.min(tl.where((cs > target) & (offs < V), offs, V), 0)
                    found = tl.where(hit < V, hit, found)
                    last_pos = tl.maximum(last_pos, tl.max(tl.where(p > 0.0, offs, -1), 0))
                    running = tl.max(cs, 0)
                    start += BLOCK
                if found < 0:
                    # rounding left coin * mass at or past the total: the last positive token
                    # (it lies in a block already scanned, since the scan then reached the end)
                    found = last_pos
                x = tl.load(row_ptr + found).to(tl.float32)
                pf = p_final(x, T, ms, kth_s, z1, cut, z2, mthr, z3)
                tl.store(btok_ptr + b, found)
                tl.store(bkind_ptr + b, kind)
                tl.store(bmass_ptr + b, total)
                tl.store(bprob_ptr + b, pf.to(tl.float64) / total)
            else:
                tl.store(btok_ptr + b, -1)
                tl.store(bkind_ptr + b, 3)
                tl.store(bmass_ptr + b, 0.0)
                tl.store(bprob_ptr + b, 0.0)
        elif T > 0:
            if COMPACT:
                # the residual lives on the gathered survivors (ids ascending)
                p, ids, lane = compact_residual(sx_ptr, si_ptr, count, T, ms, kth_s, z1, cut, z2, mthr, z3,
                                                tok_ptr, ns_ptr, base, first_child, n, KCAP)
                p64 = p.to(tl.float64)
                total = tl.sum(p64, 0)
                if total > 0.0:  # pyright: ignore[reportOperatorIssue]  # stubs: tl.sum may be a tuple
                    cs = tl.cumsum(p64, 0)
                    hit = tl.min(tl.where(cs > fcoin.to(tl.float64) * total, lane, KCAP), 0)
                    # rounding left coin * mass at or past the total: the last positive token
                    hit = tl.where(hit < KCAP, hit, tl.max(tl.where(p > 0.0, lane, -1), 0))
                    tl.store(btok_ptr + b, tl.sum(tl.where(lane == hit, ids, 0), 0))
                    tl.store(bkind_ptr + b, kind)
                    tl.store(bmass_ptr + b, total)
                    token_p = tl.sum(tl.where(lane == hit, p64, 0.0), 0)
                    tl.store(bprob_ptr + b, token_p / total)  # pyright: ignore[reportOperatorIssue]  # tl.sum: a tensor
                else:
                    tl.store(btok_ptr + b, -1)
                    tl.store(bkind_ptr + b, 3)
                    tl.store(bmass_ptr + b, 0.0)
                    tl.store(bprob_ptr + b, 0.0)
        else:
            # one-hot row: the residual is the argmax alone unless a rejected child carries it
            # (a lossy rule can reject it: threshold_acc > 1 and threshold_single > 1)
            child = first_child
            steps = tl.zeros([], tl.int64)
            taken = tl.zeros([], tl.int32)
            while (child >= 0) & (steps < n):
                taken = tl.where(tl.load(tok_ptr + base + child) == amax, 1, taken)
                child = tl.load(ns_ptr + base + child)
                steps += 1
            if taken != 0:
                tl.store(btok_ptr + b, -1)
                tl.store(bkind_ptr + b, 3)
                tl.store(bmass_ptr + b, 0.0)
                tl.store(bprob_ptr + b, 0.0)
            else:
                tl.store(btok_ptr + b, amax)
                tl.store(bkind_ptr + b, kind)
                tl.store(bmass_ptr + b, 1.0)
                tl.store(bprob_ptr + b, 1.0)
