import os

# Keep a shared CI machine responsive: the lab picks torch's thread count from the cores it may
# use and their load (ddtree_lab.threads; DDTREE_LAB_THREADS=N overrides).
from ddtree_lab.threads import configure_threads  # noqa: E402

configure_threads()

from model_fixtures import drafter, target  # noqa: E402,F401  (real-model fixtures)
