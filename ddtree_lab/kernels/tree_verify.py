"""Triton tree verifiers (sampled, greedy): their contract, codes and launch options.

The kernels live in :mod:`.sampled` and :mod:`.greedy`, their shared device functions in
:mod:`.row_ops`; this module re-exports both kernels (``sampled_verify_kernel``,
``greedy_verify_kernel``) and is the one to import.

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
sibling order ``S += p(child)`` (float32) and accept the first child that passes the rule of
:mod:`ddtree_lab.verify`: lossless thresholds, ``p > 0`` and (``u < S`` or
``p >= threshold_single``); lossy ones, SGLang's ``u <= S / max(threshold_acc, 1e-9)`` or
``p >= threshold_single`` in float32 with no ``p > 0`` guard (the launcher passes the floored
float32 thresholds and a flag choosing the rule). Lossless only: when every child is
rejected but the children hold all of the row's positive mass (the residual's float64 sum is
exactly 0), exact arithmetic has ``S_K = 1 > u``: the last child with ``p > 0`` is accepted,
its logged ``S`` set to 1 (the reference's rule).
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

#: Floating-point contraction (``a * b + c`` into one FMA) is OFF for every launch and every
#: compile of these kernels (launch option ``enable_fp_fusion=False``; triton's default is on).
#: Why: the exactness contract above compares the kernels against the reference (torch float32
#: ops, no contraction) and against themselves under ``TRITON_INTERPRET=1`` (numpy, no
#: contraction); a fused multiply-add rounds once where they round twice (``z * scale + sum``
#: in the online softmax normaliser is such a site), so a probability could differ in its last
#: bit and move a coin across a decision boundary the reference does not cross. The cost: a
#: multiply and an add where the compiler would have emitted one FMA.
FP_FUSION = False

#: Options of every compiled launch (the interpreter ignores ``num_warps`` and runs numpy
#: arithmetic, which never contracts; the launchers pass it ``enable_fp_fusion`` all the same).
LAUNCH_OPTIONS = {"num_warps": 8, "enable_fp_fusion": FP_FUSION}

#: Warps of the sampled kernel without the survivor gather (``COMPACT`` off): at 8 warps ptxas
#: holds it to 128 registers and spills (20-44 bytes of spill stores on sm_80 / sm_90); at 4
#: warps it takes 248 registers and spills nothing (``ddtree_lab.kernels.resources``).
NO_GATHER_WARPS = 4


def launch_options(compact: bool = True) -> dict:
    """The compiled launch options of a kernel: :data:`LAUNCH_OPTIONS`, with
    :data:`NO_GATHER_WARPS` for the sampled kernel when ``compact`` is False."""
    return dict(LAUNCH_OPTIONS, **({} if compact else {"num_warps": NO_GATHER_WARPS}))

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

from .greedy import greedy_verify_kernel  # noqa: E402
from .sampled import sampled_verify_kernel  # noqa: E402

__all__ = ["sampled_verify_kernel", "greedy_verify_kernel", "FP_FUSION", "LAUNCH_OPTIONS",
           "NO_GATHER_WARPS", "launch_options"]
