"""Shared Triton device functions of the tree verifiers (keys, row max, radix select, row transform, residuals).

Order-preserving float keys, the row max / argmax / softmax normaliser, the top-k radix select,
the fused temperature / top-k / top-p / min-p transform and the residual sums; the contract is
in :mod:`ddtree_lab.kernels.tree_verify`.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Order-preserving unsigned keys of float32 (as int64 in [0, 2**32)).
U_NEG_INF = 0x007FFFFF  # key of -inf
U_POS_INF = 0xFF800000  # key of +inf


@triton.jit
def key_of(x):
    """float32 -> order-preserving key, int64 in [0, 2**32) (-0.0 just below +0.0)."""
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return key.to(tl.int64) + 2147483648


@triton.jit
def value_of(u):
    """Inverse of :func:`key_of`, clamped: keys below -inf give -inf, above +inf give +inf."""
    key = (u - 2147483648).to(tl.int32)
    bits = tl.where(key >= 0, key, key ^ 0x7FFFFFFF)
    x = bits.to(tl.float32, bitcast=True)
    x = tl.where(u < 0x007FFFFF, float("-inf"), x)
    return tl.where(u > 0xFF800000, float("inf"), x)


@triton.jit
def lattice(h, LOW: tl.constexpr):
    """The key with high part ``h`` that an upcast logit can have (low bits fixed)."""
    u = h << LOW
    if LOW > 0:
        # a negative value's key has its low bits inverted: all ones for an upcast half
        u = tl.where(u < 2147483648,
                     u | ((1 << LOW) - 1),  # pyright: ignore[reportOperatorIssue]  # LOW is an int at jit time
                     u)
    return u


@triton.jit
def row_max(row_ptr, V, WITH_Z: tl.constexpr, BLOCK: tl.constexpr):
    """One pass: (max, argmax lowest id, online softmax normaliser or 0, error code)."""
    offs0 = tl.arange(0, BLOCK)
    m = tl.full([], float("-inf"), tl.float32)
    amax = tl.full([], 0, tl.int32)
    z = tl.full([], 0.0, tl.float32)
    nan = tl.full([], 0, tl.int32)
    pinf = tl.full([], 0, tl.int32)
    for start in range(0, V, BLOCK):
        offs = start + offs0
        x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        nan += tl.sum((x != x).to(tl.int32), 0)
        pinf += tl.sum((x == float("inf")).to(tl.int32), 0)
        x = tl.where(x != x, float("-inf"), x)
        bmax = tl.max(x, 0)
        bidx = tl.min(tl.where(x == bmax, offs, V), 0)
        new_m = tl.maximum(m, bmax)
        amax = tl.where(bmax > m, bidx, amax)
        if WITH_Z:
            scale = tl.where(new_m == float("-inf"), 0.0, tl.exp(m - new_m))
            e = tl.where(x == float("-inf"), 0.0, tl.exp(x - new_m))
            z = z * scale + tl.sum(e, 0)
        m = new_m
    err = tl.where(nan > 0, 1, tl.where(pinf > 0, 2, tl.where(m == float("-inf"), 3, 0)))
    return m, amax, z, err


@triton.jit
def kth_largest_key(row_ptr, V, K, LOW: tl.constexpr, BLOCK: tl.constexpr):
    """High part ``H = key >> LOW`` of the K-th largest logit: a radix select, one pass per
    8-bit digit of ``H`` from the top (2 passes for bfloat16, 3 for float16, 4 for float32).

    Each pass histograms the next digit of the logits whose higher digits equal the prefix
    found so far, and keeps the largest digit ``d`` with ``count(digit >= d) >= K_rem``.
    Integer counting only: the result is exact.
    """
    NB: tl.constexpr = 32 - LOW  # significant key bits
    PAD: tl.constexpr = (8 - NB % 8) % 8  # pad to whole 8-bit digits (zeros at the bottom)
    NBP: tl.constexpr = NB + PAD
    offs0 = tl.arange(0, BLOCK)
    bins = tl.arange(0, 256)
    prefix = tl.zeros([], tl.int64)
    k_rem = K + tl.zeros([], tl.int32)
    for j in tl.static_range(NBP // 8):  # pyright: ignore[reportGeneralTypeIssues]  # unrolled by the jit compiler
        hist = tl.zeros([256], tl.int32)
        for start in range(0, V, BLOCK):
            offs = start + offs0
            x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
            h = (key_of(x) >> LOW) << PAD
            match = ((h >> (NBP - 8 * j)) == prefix) & (offs < V)
            digit = ((h >> (NBP - 8 * j - 8)) & 255).to(tl.int32)
            hist += tl.histogram(digit, 256, mask=match)
        at_least = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # count(digit >= d)
        d = tl.max(tl.where(at_least >= k_rem, bins, -1), 0)
        above = tl.sum(tl.where(bins > d, hist, 0), 0)
        k_rem = k_rem - above
        prefix = (prefix << 8) | d.to(tl.int64)  # pyright: ignore[reportAttributeAccessIssue]  # tl.max: a tensor here
    prefix = prefix >> PAD
    return prefix


@triton.jit
def p_top_k(x, T, ms, kth_s, z1):
    """Softmax probability after temperature and top-k (0 for cut tokens)."""
    s = tl.math.div_rn(x, T)
    # s <= ms for every logit of the row; the clamp only bounds the threshold probes of the
    # top-p search above the row's maximum (still > max p there, so the search is unchanged)
    p = tl.math.div_rn(tl.exp(tl.minimum(s - ms, 1.0)), z1)
    return tl.where(s >= kth_s, p, 0.0)


@triton.jit
def p_final(x, T, ms, kth_s, z1, cut, z2, mthr, z3):
    """The row's final probability (top-p keeps ``p1 > cut``, min-p keeps ``p2 >= mthr``)."""
    p1 = p_top_k(x, T, ms, kth_s, z1)
    p2 = tl.where(p1 > cut, tl.math.div_rn(p1, z2), 0.0)
    return tl.where(p2 >= mthr, tl.math.div_rn(p2, z3), 0.0)


@triton.jit
def sum_over(src_ptr, limit, WHAT: tl.constexpr, T, ms, kth_s, z1, c, cut, z2, mthr, BLK: tl.constexpr):
    """One reduction over ``src[0:limit]`` (a logit row, or the gathered survivors):
    WHAT 0: sum exp(s - M) over the top-k survivors (Z1); 1: sum of p1 over p1 > c (A(c));
    2: sum of p2 over p2 >= mthr (Z3)."""
    offs0 = tl.arange(0, BLK)
    acc = tl.zeros([], tl.float32)
    for start in range(0, limit, BLK):
        offs = start + offs0
        x = tl.load(src_ptr + offs, mask=offs < limit, other=float("-inf")).to(tl.float32)
        if WHAT == 0:
            s = tl.math.div_rn(x, T)
            acc += tl.sum(tl.where(s >= kth_s, tl.exp(tl.minimum(s - ms, 0.0)), 0.0), 0)
        elif WHAT == 1:
            p = p_top_k(x, T, ms, kth_s, z1)
            acc += tl.sum(tl.where(p > c, p, 0.0), 0)
        else:
            p1 = p_top_k(x, T, ms, kth_s, z1)
            p2 = tl.where(p1 > cut, tl.math.div_rn(p1, z2), 0.0)
            acc += tl.sum(tl.where(p2 >= mthr, p2, 0.0), 0)
    return acc


@triton.jit
def top_p_cut(src_ptr, limit, T, ms, kth_s, z1, P, LOW: tl.constexpr, BLK: tl.constexpr):
    """(cut, Z2): keep p1 > cut; the bitwise search over the logit key (module docstring)."""
    zero64 = tl.zeros([], tl.int64)
    a0 = sum_over(src_ptr, limit, 1,  # pyright: ignore[reportArgumentType]  # WHAT: a tl.constexpr takes a plain int
                  T, ms, kth_s, z1, -1.0, -1.0, 1.0, 0.0, BLK)
    z2 = a0
    cut = tl.full([], -1.0, tl.float32)
    if a0 >= P:
        h = zero64
        for i in range(0, 32 - LOW):
            cand = h | (zero64 + 1) << (zero64 + (31 - LOW - i))
            c = p_top_k(value_of(lattice(cand, LOW)), T, ms, float("-inf"), z1)
            a = sum_over(src_ptr, limit, 1,  # pyright: ignore[reportArgumentType]  # WHAT: a tl.constexpr takes an int
                         T, ms, kth_s, z1, c, -1.0, 1.0, 0.0, BLK)
            ok = a >= P
            h = tl.where(ok, cand, h)
            z2 = tl.where(ok, a, z2)
        cut = p_top_k(value_of(lattice(h, LOW)), T, ms, float("-inf"), z1)
    return cut, z2


@triton.jit
def normalisers(src_ptr, limit, T, ms, kth_s, P, MINP, cut, z2, mthr, z3, LOW: tl.constexpr, BLK: tl.constexpr):
    """The top-k, top-p and min-p normalisers of the rows at ``src_ptr[:limit]`` (the gathered
    survivors or the whole row): ``(z1, cut, z2, mthr, z3)``, the given ``cut`` .. ``z3`` kept
    where top-p / min-p are off."""
    z1 = sum_over(src_ptr, limit, 0,  # pyright: ignore[reportArgumentType]  # WHAT: a tl.constexpr takes a plain int
                  T, ms, kth_s, 1.0, -1.0, -1.0, 1.0, 0.0, BLK)
    if P < 1.0:
        cut, z2 = top_p_cut(src_ptr, limit, T, ms, kth_s, z1, P, LOW, BLK)
    if MINP > 0.0:
        mthr = MINP * tl.math.div_rn(tl.math.div_rn(1.0, z1), z2)
        z3 = sum_over(src_ptr, limit, 2,  # pyright: ignore[reportArgumentType]  # WHAT: a tl.constexpr takes an int
                      T, ms, kth_s, z1, -1.0, cut, z2, mthr, BLK)
    return z1, cut, z2, mthr, z3


@triton.jit
def walk_start(path_ptr, base):
    """A request's walk before its first step: at the root (path ``[0]``), no decisions, no error.
    ``(cur, plen, dcount, err, going)``."""
    tl.store(path_ptr + base, 0)
    return (tl.zeros([], tl.int64), tl.full([], 1, tl.int32), tl.zeros([], tl.int32), tl.zeros([], tl.int32),
            tl.full([], 1, tl.int32))


@triton.jit
def advance(err, acc, cur, plen, path_ptr, base):
    """After one node's children were judged: move to the accepted child (appending it to the
    path) or stop the walk. ``(going, cur, plen)``."""
    going = tl.zeros([], tl.int32)
    if err == 0:
        if acc >= 0:
            cur = acc
            tl.store(path_ptr + base + plen, cur.to(tl.int32))
            plen += 1
            going = tl.full([], 1, tl.int32)
    return going, cur, plen


@triton.jit
def store_walk(plen_ptr, dcount_ptr, err_ptr, errnode_ptr, b, plen, dcount, err, cur):
    """A request's walk outputs: path length, decision count, error code and the node it ended at."""
    tl.store(plen_ptr + b, plen)
    tl.store(dcount_ptr + b, dcount)
    tl.store(err_ptr + b, err)
    tl.store(errnode_ptr + b, cur.to(tl.int32))


@triton.jit
def row_state(row_ptr, V, T, K, P, MINP, sx_ptr, si_ptr,
              LOW: tl.constexpr, BLOCK: tl.constexpr, KCAP: tl.constexpr, COMPACT: tl.constexpr):
    """Everything the sampled transform of one row needs; greedy rows stop after the max.

    With top-k on and at most KCAP survivors, the survivors (logit, token id, in id order)
    are gathered into the request's scratch row ``sx/si[0:count]`` and every later step reads
    only them (``compact`` = 1); otherwise each step is a pass over the row.
    """
    offs0 = tl.arange(0, BLOCK)
    m, amax, _z, err = row_max(row_ptr, V, False, BLOCK)  # pyright: ignore[reportArgumentType]  # WITH_Z: constexpr
    ms = tl.full([], 0.0, tl.float32)
    kth_s = tl.full([], float("-inf"), tl.float32)
    z1 = tl.full([], 1.0, tl.float32)
    cut = tl.full([], -1.0, tl.float32)
    z2 = tl.full([], 1.0, tl.float32)
    mthr = tl.full([], 0.0, tl.float32)
    z3 = tl.full([], 1.0, tl.float32)
    compact = tl.zeros([], tl.int32)
    count = tl.zeros([], tl.int32)
    if (T > 0) & (err == 0):
        ms = tl.math.div_rn(m, T)
        # ---- top-k: the k-th largest logit by a bitwise search over its key
        if (K > 0) & (K < V):
            kth_s = tl.math.div_rn(value_of(lattice(kth_largest_key(row_ptr, V, K, LOW, BLOCK), LOW)), T)
            if COMPACT:
                # gather the survivors (s >= kth_s, ties and rounding collisions included)
                tl.debug_barrier()
                for start in range(0, V, BLOCK):
                    offs = start + offs0
                    x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
                    keep = (tl.math.div_rn(x, T) >= kth_s) & (offs < V)
                    pos = count + tl.cumsum(keep.to(tl.int32), 0) - 1
                    ok = keep & (pos < KCAP)
                    tl.store(sx_ptr + pos, x, mask=ok)
                    tl.store(si_ptr + pos, offs, mask=ok)
                    count += tl.sum(keep.to(tl.int32), 0)
                tl.debug_barrier()
                compact = (count <= KCAP).to(tl.int32)
        if compact != 0:
            z1, cut, z2, mthr, z3 = normalisers(sx_ptr, count, T, ms, kth_s, P, MINP, cut, z2, mthr, z3, LOW, KCAP)
        else:
            z1, cut, z2, mthr, z3 = normalisers(row_ptr, V, T, ms, kth_s, P, MINP, cut, z2, mthr, z3, LOW, BLOCK)
    return amax, err, ms, kth_s, z1, cut, z2, mthr, z3, compact, count


@triton.jit
def child_token(tok_ptr, base, child, steps, dcount, n, N, V):
    """Guards of one sibling-walk step, then the child's token: ``(err, tok)`` with ``err`` 4 (the
    walk ran past ``n`` hops: a cycle), 6 (more decisions than ``N``), 5 (a child index or token
    outside its range), 0 when the child can be judged."""
    err = tl.zeros([], tl.int32)
    tok = tl.full([], -1, tl.int64)
    if steps >= n:
        err = tl.full([], 4, tl.int32)
    elif dcount >= N:
        err = tl.full([], 6, tl.int32)
    elif child >= n:
        err = tl.full([], 5, tl.int32)
    else:
        tok = tl.load(tok_ptr + base + child)
        if (tok < 0) | (tok >= V):
            err = tl.full([], 5, tl.int32)
    return err, tok


@triton.jit
def log_decision(dnode_ptr, dprob_ptr, dmass_ptr, slot, child, p, mass):
    """One judged sibling into the decision log: its node, target probability and ``S_k``."""
    tl.store(dnode_ptr + slot, child.to(tl.int32))
    tl.store(dprob_ptr + slot, p)
    tl.store(dmass_ptr + slot, mass)


@triton.jit
def zero_siblings(p, ids, tok_ptr, ns_ptr, base, first_child, n):
    """``p`` with the tokens of ``first_child`` and its next siblings zeroed (``ids``: the token
    of each lane), at most ``n`` hops."""
    child = first_child
    steps = tl.zeros([], tl.int64)
    while (child >= 0) & (steps < n):
        tok = tl.load(tok_ptr + base + child)
        p = tl.where(ids == tok, 0.0, p)
        child = tl.load(ns_ptr + base + child)
        steps += 1
    return p


@triton.jit
def compact_residual(sx_ptr, si_ptr, count, T, ms, kth_s, z1, cut, z2, mthr, z3, tok_ptr, ns_ptr, base,
                     first_child, n, KCAP: tl.constexpr):
    """The residual on the gathered top-k survivors (ids ascending): ``(p, ids, lane)`` with the
    rejected siblings' tokens zeroed."""
    lane = tl.arange(0, KCAP)
    xs = tl.load(sx_ptr + lane, mask=lane < count, other=float("-inf"))
    ids = tl.load(si_ptr + lane, mask=lane < count, other=-1)
    p = tl.where(lane < count, p_final(xs, T, ms, kth_s, z1, cut, z2, mthr, z3), 0.0)
    return zero_siblings(p, ids, tok_ptr, ns_ptr, base, first_child, n), ids, lane


@triton.jit
def residual_block(row_ptr, offs, V, T, ms, kth_s, z1, cut, z2, mthr, z3,
                   tok_ptr, ns_ptr, base, first_child, n):
    """Final probabilities of one block with the rejected siblings' tokens zeroed."""
    x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    p = p_final(x, T, ms, kth_s, z1, cut, z2, mthr, z3)
    p = tl.where(offs < V, p, 0.0)
    return zero_siblings(p, offs, tok_ptr, ns_ptr, base, first_child, n)


@triton.jit
def residual_total(row_ptr, V, T, ms, kth_s, z1, cut, z2, mthr, z3, tok_ptr, ns_ptr, base, first_child, n,
                   sx_ptr, si_ptr, count, compact, BLOCK: tl.constexpr, KCAP: tl.constexpr, COMPACT: tl.constexpr):
    """float64 mass of the row with every child of ``first_child``'s chain zeroed (0 exactly
    iff the children hold all of the row's positive mass)."""
    total = tl.zeros([], tl.float64)
    if COMPACT:
        if compact != 0:
            p, _ids, _lane = compact_residual(sx_ptr, si_ptr, count, T, ms, kth_s, z1, cut, z2, mthr, z3, tok_ptr,
                                              ns_ptr, base, first_child, n, KCAP)
            total = tl.sum(p.to(tl.float64), 0)
    if compact == 0:
        offs0 = tl.arange(0, BLOCK)
        for start in range(0, V, BLOCK):
            offs = start + offs0
            p = residual_block(row_ptr, offs, V, T, ms, kth_s, z1, cut, z2, mthr, z3,
                               tok_ptr, ns_ptr, base, first_child, n)
            total += tl.sum(p.to(tl.float64), 0)
    return total
