import os

# Keep the two-core CI machine responsive and results repeatable.
os.environ.setdefault("OMP_NUM_THREADS", "2")

from model_fixtures import drafter, target  # noqa: E402,F401  (real-model fixtures)
