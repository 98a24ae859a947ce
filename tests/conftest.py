import os

import torch

# The Triton kernels (the lab's and SGLang's) run under the interpreter on a machine without
# CUDA. Triton reads this when a kernel is defined, so it is set once here, before any test
# module imports a kernel: results never depend on collection order. On a GPU the same tests
# run natively.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Keep a shared CI machine responsive: the lab picks torch's thread count from the cores it may
# use and their load (ddtree_lab.threads; DDTREE_LAB_THREADS=N overrides).
from ddtree_lab.threads import configure_threads  # noqa: E402

configure_threads()

from model_fixtures import drafter, target  # noqa: E402,F401  (real-model fixtures)
