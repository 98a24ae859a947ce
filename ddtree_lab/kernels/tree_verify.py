"""Triton tree verifiers: sampled (temperature / top-k / top-p / min-p fused) and greedy.

Both kernels run one program per request. The program walks the tree exactly as the
reference verifiers in :mod:`ddtree_lab.verify` do and touches only the logit rows the walk
reaches (at most ``depth + 1`` rows per request); the ``[bs, N, V]`` probability tensor is
never written. Logits are read in their own dtype (float32, float16, bfloat16) and converted
to float32 in registers.

Row transform (sampled rows, ``temperature > 0``), the rules of :mod:`ddtree_lab.sampling`:

* ``s = x / T`` in IEEE float32 (``div_rn``), ``M = max(s) = max(x) / T``.
* **top-k** (``0 < k < V``): the k-th largest raw logit ``x_k`` is found by a radix select
  over the order-preserving integer key of the logits (8-bit digit histograms from the top:
  2 passes for bfloat16, 3 for float16, 4 for float32, since the low bits of an upcast half
  are fixed) -- integer counting, so exact.
  Survivors are ``s >= x_k / T`` -- every token tied with the k-th value is kept (the
  reference's tie rule; with ``T > 1`` this includes logits that round onto the same scaled
  value).
* softmax over the survivors: ``p1 = exp(s - M) / Z1`` with ``Z1`` the float32 sum.
* **top-p** (``top_p < 1``): keep ``t`` iff ``A(p1_t) < top_p`` where
  ``A(c) = sum of p1_v over p1_v > c`` (the mass strictly above ``t``; ties at the cut all
  kept). ``A`` is non-increasing, so the cut is a bitwise search over the logit key ``r``
  for the largest ``r`` with ``A(p1(r)) >= top_p`` (one evaluation of ``A`` per key bit:
  16 for bfloat16), then ``p2 = p1 / Z2`` over the kept tokens.
* **min-p**: keep ``p2 >= min_p * max p2``, ``p3 = p2 / Z3``.
* ``temperature == 0`` rows are one-hot at the argmax (lowest id on ties).

Passes over a reached row (each a read of ``V`` logits; only the first must come from DRAM,
the row is 300 KB at V = 151,936 bf16 and the rest hit L2):

* greedy kernel: 1 (argmax and the softmax normaliser together);
* sampled, top-k on with at most ``KCAP`` (256) survivors: 1 (max) + 2 (radix select, bf16)
  + 1 (gather the survivors, ids ascending, into a scratch row); the softmax normaliser,
  top-p search, min-p and the bonus draw then run on the gathered survivors in registers;
* sampled, otherwise (no top-k, or more survivors than ``KCAP`` from ties): 1 (max)
  [+ 2 radix + 1 gather attempt] + 1 (normaliser) [+ 1 + 16 top-p evaluations]
  [+ 1 min-p] + 2 for the bonus draw at the last row.

One program per request walks its rows one after another, so a launch keeps at most ``bs``
SMs busy; the threshold passes re-read the row from L2. This is the simple, exact design;
splitting a row over several programs is the next step for small batches (not done).

Walk (per request, from the root): load the current row's coin ``u``; for each child in
sibling order ``S += p(child)`` (float32) and accept the first child with ``p > 0`` and
``u < S / threshold_acc or p >= threshold_single`` (float64 compare, as the reference;
``threshold_acc = 0`` arrives as a flag and means ``S / 0 = +inf`` for ``S > 0``). When every
child is rejected but the children hold all of the row's positive mass (the residual's float64
sum is exactly 0), exact arithmetic has ``S_K = 1 > u``: the last child with ``p > 0`` is
accepted, its logged ``S`` set to 1 (the reference's rule, :mod:`ddtree_lab.verify`).
Without an accepted child, the bonus is an inverse-CDF draw from the row with the rejected
siblings' tokens zeroed: ``mass`` = float64 sum of that residual; the first index whose
running float64 sum exceeds ``final_coin * mass`` (float64 as in the reference, so rows
with exact structure -- ties, uniform rows -- draw exactly the reference's token); if
rounding leaves none, the last token with positive residual; ``mass == 0`` is ``support_exhausted`` (token -1).

Numerics against the reference (float32 torch ops, float64 residual cumsum): the sets of
tokens with ``p > 0`` after top-k are identical (no arithmetic besides the IEEE division);
probabilities, ``S_k`` and masses agree to a few float32 ulps (the library states the
tolerance). Tokens and indices therefore agree bit for bit except when a coin lies within
that tolerance of a decision boundary (``u`` vs ``S_k``, ``coin * mass`` vs a CDF step) or a
top-p / min-p cut lands within it -- events of probability ~1e-6 per decision.

Outputs are compact per-request arrays; :mod:`ddtree_lab.verify` expands them into
a :class:`ddtree_lab.VerifyOutput` with the decision log.

Error codes written per request (the walk stops, the launcher raises): 1 NaN in a walked
row, 2 ``+inf`` in a walked row, 3 a walked row entirely ``-inf``, 4 a sibling chain longer
than the tree (cycle), 5 a buffer index out of range, 6 the walk reaching more nodes than
the tree has (a node reached twice).
"""

from __future__ import annotations

import triton
import triton.language as tl

ERR_NAN = 1
ERR_POS_INF = 2
ERR_ALL_NEG_INF = 3
ERR_CYCLE = 4
ERR_RANGE = 5
ERR_REVISIT = 6

BONUS_ARGMAX = 0
BONUS_RESIDUAL = 1
BONUS_LEAF = 2
BONUS_EXHAUSTED = 3

# Order-preserving unsigned keys of float32 (as int64 in [0, 2**32)).
_U_NEG_INF = 0x007FFFFF  # key of -inf
_U_POS_INF = 0xFF800000  # key of +inf


@triton.jit
def _key_of(x):
    """float32 -> order-preserving key, int64 in [0, 2**32) (-0.0 just below +0.0)."""
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return key.to(tl.int64) + 2147483648


@triton.jit
def _value_of(u):
    """Inverse of :func:`_key_of`, clamped: keys below -inf give -inf, above +inf give +inf."""
    key = (u - 2147483648).to(tl.int32)
    bits = tl.where(key >= 0, key, key ^ 0x7FFFFFFF)
    x = bits.to(tl.float32, bitcast=True)
    x = tl.where(u < 0x007FFFFF, float("-inf"), x)
    return tl.where(u > 0xFF800000, float("inf"), x)


@triton.jit
def _lattice(h, LOW: tl.constexpr):
    """The key with high part ``h`` that an upcast logit can have (low bits fixed)."""
    u = h << LOW
    if LOW > 0:
        # a negative value's key has its low bits inverted: all ones for an upcast half
        u = tl.where(u < 2147483648, u | ((1 << LOW) - 1), u)
    return u


@triton.jit
def _row_max(row_ptr, V, WITH_Z: tl.constexpr, BLOCK: tl.constexpr):
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
def _kth_largest_key(row_ptr, V, K, LOW: tl.constexpr, BLOCK: tl.constexpr):
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
    for j in tl.static_range(NBP // 8):
        hist = tl.zeros([256], tl.int32)
        for start in range(0, V, BLOCK):
            offs = start + offs0
            x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
            h = (_key_of(x) >> LOW) << PAD
            match = ((h >> (NBP - 8 * j)) == prefix) & (offs < V)
            digit = ((h >> (NBP - 8 * j - 8)) & 255).to(tl.int32)
            hist += tl.histogram(digit, 256, mask=match)
        at_least = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # count(digit >= d)
        d = tl.max(tl.where(at_least >= k_rem, bins, -1), 0)
        above = tl.sum(tl.where(bins > d, hist, 0), 0)
        k_rem = k_rem - above
        prefix = (prefix << 8) | d.to(tl.int64)
    prefix = prefix >> PAD
    return prefix


@triton.jit
def _p1(x, T, ms, kth_s, z1):
    """Softmax probability after temperature and top-k (0 for cut tokens)."""
    s = tl.math.div_rn(x, T)
    # s <= ms for every logit of the row; the clamp only bounds the threshold probes of the
    # top-p search above the row's maximum (still > max p there, so the search is unchanged)
    p = tl.math.div_rn(tl.exp(tl.minimum(s - ms, 1.0)), z1)
    return tl.where(s >= kth_s, p, 0.0)


@triton.jit
def _p_final(x, T, ms, kth_s, z1, cut, z2, mthr, z3):
    """The row's final probability (top-p keeps ``p1 > cut``, min-p keeps ``p2 >= mthr``)."""
    p1 = _p1(x, T, ms, kth_s, z1)
    p2 = tl.where(p1 > cut, tl.math.div_rn(p1, z2), 0.0)
    return tl.where(p2 >= mthr, tl.math.div_rn(p2, z3), 0.0)


@triton.jit
def _sum_over(src_ptr, limit, WHAT: tl.constexpr, T, ms, kth_s, z1, c, cut, z2, mthr, BLK: tl.constexpr):
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
            p = _p1(x, T, ms, kth_s, z1)
            acc += tl.sum(tl.where(p > c, p, 0.0), 0)
        else:
            p1 = _p1(x, T, ms, kth_s, z1)
            p2 = tl.where(p1 > cut, tl.math.div_rn(p1, z2), 0.0)
            acc += tl.sum(tl.where(p2 >= mthr, p2, 0.0), 0)
    return acc


@triton.jit
def _top_p_cut(src_ptr, limit, T, ms, kth_s, z1, P, LOW: tl.constexpr, BLK: tl.constexpr):
    """(cut, Z2): keep p1 > cut; the bitwise search over the logit key (module docstring)."""
    zero64 = tl.zeros([], tl.int64)
    a0 = _sum_over(src_ptr, limit, 1, T, ms, kth_s, z1, -1.0, -1.0, 1.0, 0.0, BLK)
    z2 = a0
    cut = tl.full([], -1.0, tl.float32)
    if a0 >= P:
        h = zero64
        for i in range(0, 32 - LOW):
            cand = h | (zero64 + 1) << (zero64 + (31 - LOW - i))
            c = _p1(_value_of(_lattice(cand, LOW)), T, ms, float("-inf"), z1)
            a = _sum_over(src_ptr, limit, 1, T, ms, kth_s, z1, c, -1.0, 1.0, 0.0, BLK)
            ok = a >= P
            h = tl.where(ok, cand, h)
            z2 = tl.where(ok, a, z2)
        cut = _p1(_value_of(_lattice(h, LOW)), T, ms, float("-inf"), z1)
    return cut, z2


@triton.jit
def _row_state(row_ptr, V, T, K, P, MINP, sx_ptr, si_ptr,
               LOW: tl.constexpr, BLOCK: tl.constexpr, KCAP: tl.constexpr, COMPACT: tl.constexpr):
    """Everything the sampled transform of one row needs; greedy rows stop after the max.

    With top-k on and at most KCAP survivors, the survivors (logit, token id, in id order)
    are gathered into the request's scratch row ``sx/si[0:count]`` and every later step reads
    only them (``compact`` = 1); otherwise each step is a pass over the row.
    """
    offs0 = tl.arange(0, BLOCK)
    m, amax, _z, err = _row_max(row_ptr, V, False, BLOCK)
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
            kth_s = tl.math.div_rn(_value_of(_lattice(_kth_largest_key(row_ptr, V, K, LOW, BLOCK), LOW)), T)
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
            z1 = _sum_over(sx_ptr, count, 0, T, ms, kth_s, 1.0, -1.0, -1.0, 1.0, 0.0, KCAP)
            if P < 1.0:
                cut, z2 = _top_p_cut(sx_ptr, count, T, ms, kth_s, z1, P, LOW, KCAP)
            if MINP > 0.0:
                mthr = MINP * tl.math.div_rn(tl.math.div_rn(1.0, z1), z2)
                z3 = _sum_over(sx_ptr, count, 2, T, ms, kth_s, z1, -1.0, cut, z2, mthr, KCAP)
        else:
            z1 = _sum_over(row_ptr, V, 0, T, ms, kth_s, 1.0, -1.0, -1.0, 1.0, 0.0, BLOCK)
            if P < 1.0:
                cut, z2 = _top_p_cut(row_ptr, V, T, ms, kth_s, z1, P, LOW, BLOCK)
            if MINP > 0.0:
                mthr = MINP * tl.math.div_rn(tl.math.div_rn(1.0, z1), z2)
                z3 = _sum_over(row_ptr, V, 2, T, ms, kth_s, z1, -1.0, cut, z2, mthr, BLOCK)
    return amax, err, ms, kth_s, z1, cut, z2, mthr, z3, compact, count


@triton.jit
def _residual_block(row_ptr, offs, V, T, ms, kth_s, z1, cut, z2, mthr, z3,
                    tok_ptr, ns_ptr, base, first_child, n):
    """Final probabilities of one block with the rejected siblings' tokens zeroed."""
    x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    p = _p_final(x, T, ms, kth_s, z1, cut, z2, mthr, z3)
    p = tl.where(offs < V, p, 0.0)
    child = first_child
    steps = tl.zeros([], tl.int64)
    while (child >= 0) & (steps < n):
        tok = tl.load(tok_ptr + base + child)
        p = tl.where(offs == tok, 0.0, p)
        child = tl.load(ns_ptr + base + child)
        steps += 1
    return p


@triton.jit
def _residual_total(row_ptr, V, T, ms, kth_s, z1, cut, z2, mthr, z3, tok_ptr, ns_ptr, base, first_child, n,
                    sx_ptr, si_ptr, count, compact, BLOCK: tl.constexpr, KCAP: tl.constexpr, COMPACT: tl.constexpr):
    """float64 mass of the row with every child of ``first_child``'s chain zeroed (0 exactly
    iff the children hold all of the row's positive mass)."""
    total = tl.zeros([], tl.float64)
    if COMPACT:
        if compact != 0:
            lane = tl.arange(0, KCAP)
            xs = tl.load(sx_ptr + lane, mask=lane < count, other=float("-inf"))
            ids = tl.load(si_ptr + lane, mask=lane < count, other=-1)
            p = tl.where(lane < count, _p_final(xs, T, ms, kth_s, z1, cut, z2, mthr, z3), 0.0)
            child = first_child
            steps = tl.zeros([], tl.int64)
            while (child >= 0) & (steps < n):
                tok = tl.load(tok_ptr + base + child)
                p = tl.where(ids == tok, 0.0, p)
                child = tl.load(ns_ptr + base + child)
                steps += 1
            total = tl.sum(p.to(tl.float64), 0)
    if compact == 0:
        offs0 = tl.arange(0, BLOCK)
        for start in range(0, V, BLOCK):
            offs = start + offs0
            p = _residual_block(row_ptr, offs, V, T, ms, kth_s, z1, cut, z2, mthr, z3,
                                tok_ptr, ns_ptr, base, first_child, n)
            total += tl.sum(p.to(tl.float64), 0)
    return total


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
    COMPACT)."""
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
    t_single = tl.load(thr_ptr)
    t_acc = tl.load(thr_ptr + 1)  # 1.0 when threshold_acc is 0 (flag below)
    t_acc_zero = tl.load(thr_ptr + 2) > 0.5
    cur = tl.zeros([], tl.int64)
    plen = tl.full([], 1, tl.int32)
    dcount = tl.zeros([], tl.int32)
    err = tl.zeros([], tl.int32)
    going = tl.full([], 1, tl.int32)
    tl.store(path_ptr + base, 0)
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
        amax, rerr, ms, kth_s, z1, cut, z2, mthr, z3, compact, count = _row_state(
            row_ptr, V, T, K, P, MINP, sx_ptr, si_ptr, LOW, BLOCK, KCAP, COMPACT)
        err = rerr
        u = tl.load(coin_ptr + base + cur)
        first_child = tl.load(nt_ptr + base + cur)
        child = first_child
        mass = tl.zeros([], tl.float32)
        acc = tl.full([], -1, tl.int64)
        steps = tl.zeros([], tl.int64)
        last_j = tl.full([], -1, tl.int32)  # decision slot, node and p of the last child with p > 0
        last_c = tl.full([], -1, tl.int64)
        last_p = tl.zeros([], tl.float32)
        have_total = tl.zeros([], tl.int32)
        while (child >= 0) & (acc < 0) & (err == 0):
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
                else:
                    x = tl.load(row_ptr + tok).to(tl.float32)
                    if T > 0:
                        p = _p_final(x, T, ms, kth_s, z1, cut, z2, mthr, z3)
                    else:
                        p = tl.where(tok == amax, 1.0, 0.0)
                    mass = mass + p
                    acc_ok = tl.where(t_acc_zero, mass > 0.0, u.to(tl.float64) < mass.to(tl.float64) / t_acc)
                    ok = (p > 0.0) & (acc_ok | (p.to(tl.float64) >= t_single))
                    last_j = tl.where(p > 0.0, dcount, last_j)
                    last_c = tl.where(p > 0.0, child, last_c)
                    last_p = tl.where(p > 0.0, p, last_p)
                    tl.store(dnode_ptr + base + dcount, child.to(tl.int32))
                    tl.store(dprob_ptr + base + dcount, p)
                    tl.store(dmass_ptr + base + dcount, mass)
                    dcount += 1
                    steps += 1
                    acc = tl.where(ok, child, acc)
                    child = tl.where(ok, child, tl.load(ns_ptr + base + child))
        if (err == 0) & (acc < 0) & (last_j >= 0) & (T > 0):
            # every child rejected on float32 sums: if they hold the whole row, exact arithmetic
            # has S_K = 1 > u and takes the last child with p > 0 (the reference's rule)
            total = _residual_total(row_ptr, V, T, ms, kth_s, z1, cut, z2, mthr, z3, tok_ptr, ns_ptr, base,
                                    first_child, n, sx_ptr, si_ptr, count, compact, BLOCK, KCAP, COMPACT)
            have_total = tl.full([], 1, tl.int32)
            if total == 0.0:
                if t_acc_zero | (u.to(tl.float64) < 1.0 / t_acc) | (last_p.to(tl.float64) >= t_single):
                    dcount = last_j + 1
                    tl.store(dmass_ptr + base + last_j, 1.0)
                    acc = last_c
        if err != 0:
            going = tl.zeros([], tl.int32)
        elif acc >= 0:
            cur = acc
            tl.store(path_ptr + base + plen, cur.to(tl.int32))
            plen += 1
        else:
            going = tl.zeros([], tl.int32)
    tl.store(plen_ptr + b, plen)
    tl.store(dcount_ptr + b, dcount)
    tl.store(err_ptr + b, err)
    tl.store(errnode_ptr + b, cur.to(tl.int32))
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
                    p = _residual_block(row_ptr, offs, V, T, ms, kth_s, z1, cut, z2, mthr, z3,
                                        tok_ptr, ns_ptr, base, first_child, n)
                    total += tl.sum(p.to(tl.float64), 0)
            if total > 0.0:
                target = fcoin.to(tl.float64) * total
                found = tl.full([], -1, tl.int32)
                last_pos = tl.full([], -1, tl.int32)
                running = tl.zeros([], tl.float64)
                start = tl.zeros([], tl.int32)
                while (start < V) & (found < 0):
                    offs = start + offs0
                    p = _residual_block(row_ptr, offs, V, T, ms, kth_s, z1, cut, z2, mthr, z3,
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
                pf = _p_final(x, T, ms, kth_s, z1, cut, z2, mthr, z3)
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
                lane = tl.arange(0, KCAP)
                xs = tl.load(sx_ptr + lane, mask=lane < count, other=float("-inf"))
                ids = tl.load(si_ptr + lane, mask=lane < count, other=-1)
                p = tl.where(lane < count, _p_final(xs, T, ms, kth_s, z1, cut, z2, mthr, z3), 0.0)
                child = first_child
                steps = tl.zeros([], tl.int64)
                while (child >= 0) & (steps < n):
                    tok = tl.load(tok_ptr + base + child)
                    p = tl.where(ids == tok, 0.0, p)
                    child = tl.load(ns_ptr + base + child)
                    steps += 1
                p64 = p.to(tl.float64)
                total = tl.sum(p64, 0)
                if total > 0.0:
                    cs = tl.cumsum(p64, 0)
                    hit = tl.min(tl.where(cs > fcoin.to(tl.float64) * total, lane, KCAP), 0)
                    # rounding left coin * mass at or past the total: the last positive token
                    hit = tl.where(hit < KCAP, hit, tl.max(tl.where(p > 0.0, lane, -1), 0))
                    tl.store(btok_ptr + b, tl.sum(tl.where(lane == hit, ids, 0), 0))
                    tl.store(bkind_ptr + b, kind)
                    tl.store(bmass_ptr + b, total)
                    tl.store(bprob_ptr + b, tl.sum(tl.where(lane == hit, p64, 0.0), 0) / total)
                else:
                    tl.store(btok_ptr + b, -1)
                    tl.store(bkind_ptr + b, 3)
                    tl.store(bmass_ptr + b, 0.0)
                    tl.store(bprob_ptr + b, 0.0)
        else:
            # one-hot row: the argmax child, if present, was accepted (S = 1 > u), so the
            # residual is the argmax alone
            tl.store(btok_ptr + b, amax)
            tl.store(bkind_ptr + b, kind)
            tl.store(bmass_ptr + b, 1.0)
            tl.store(bprob_ptr + b, 1.0)


@triton.jit
def greedy_verify_kernel(
    logits_ptr, stride_b, stride_n, V, N,
    tok_ptr, nt_ptr, ns_ptr, nn_ptr,
    path_ptr, plen_ptr, dnode_ptr, dprob_ptr, dmass_ptr, dcount_ptr,
    btok_ptr, bprob_ptr, err_ptr, errnode_ptr,
    BLOCK: tl.constexpr,
):
    """Greedy tree verify of request ``program_id(0)``: one pass per walked row (argmax and
    the softmax normaliser for the logged probabilities)."""
    b = tl.program_id(0).to(tl.int64)
    base = b * N
    n = tl.load(nn_ptr + b)
    cur = tl.zeros([], tl.int64)
    plen = tl.full([], 1, tl.int32)
    dcount = tl.zeros([], tl.int32)
    err = tl.zeros([], tl.int32)
    going = tl.full([], 1, tl.int32)
    tl.store(path_ptr + base, 0)
    m = tl.zeros([], tl.float32)
    amax = tl.zeros([], tl.int32)
    z = tl.full([], 1.0, tl.float32)
    while going != 0:
        row_ptr = logits_ptr + b * stride_b + cur * stride_n
        m, amax, z, err = _row_max(row_ptr, V, True, BLOCK)
        child = tl.load(nt_ptr + base + cur)
        mass = tl.zeros([], tl.float32)
        acc = tl.full([], -1, tl.int64)
        steps = tl.zeros([], tl.int64)
        while (child >= 0) & (acc < 0) & (err == 0):
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
                else:
                    x = tl.load(row_ptr + tok).to(tl.float32)
                    p = tl.math.div_rn(tl.exp(x - m), z)
                    mass = mass + p
                    ok = tok == amax
                    tl.store(dnode_ptr + base + dcount, child.to(tl.int32))
                    tl.store(dprob_ptr + base + dcount, p)
                    tl.store(dmass_ptr + base + dcount, mass)
                    dcount += 1
                    steps += 1
                    acc = tl.where(ok, child, acc)
                    child = tl.where(ok, child, tl.load(ns_ptr + base + child))
        if err != 0:
            going = tl.zeros([], tl.int32)
        elif acc >= 0:
            cur = acc
            tl.store(path_ptr + base + plen, cur.to(tl.int32))
            plen += 1
        else:
            going = tl.zeros([], tl.int32)
    tl.store(plen_ptr + b, plen)
    tl.store(dcount_ptr + b, dcount)
    tl.store(err_ptr + b, err)
    tl.store(errnode_ptr + b, cur.to(tl.int32))
    tl.store(btok_ptr + b, amax)
    tl.store(bprob_ptr + b, tl.math.div_rn(1.0, z))
