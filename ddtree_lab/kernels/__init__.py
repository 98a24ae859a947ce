"""Triton kernels of ddtree-lab, imported as ``ddtree_lab.kernels``."""
