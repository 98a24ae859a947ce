"""Triton kernels of ddtree-lab, imported as ``ddtree_lab.kernels``.

* :mod:`ddtree_lab.kernels.tree_verify` -- the sampled (temperature / top-k / top-p / min-p
  fused) and greedy tree verifiers (code in ``sampled``, ``greedy``, ``row_ops``; contract and
  launch options here); launch them through :func:`ddtree_lab.verify_tree` and
  :func:`ddtree_lab.verify_tree_greedy` (``backend="triton"`` or ``"auto"``).
* :mod:`ddtree_lab.kernels.resources` -- compile every kernel configuration for sm_80 / sm_90 /
  sm_100 without a GPU and read registers, spills and shared memory from the cubin.

Importing this package does not import Triton; importing a kernel module does. To run the
kernels on CPU tensors, set ``TRITON_INTERPRET=1`` before that import (Triton decides
interpreted or compiled when the kernels are defined).
"""
