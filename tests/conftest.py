import os

# Keep the two-core CI machine responsive and results repeatable.
os.environ.setdefault("OMP_NUM_THREADS", "2")
