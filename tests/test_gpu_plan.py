"""Issue 36's first device call (scripts/gpu_check.sh, call 1; benchmarks/gpu_plan.py) in its
dry mode on the CPU: every step runs with tiny shapes and reports, the plan fits 8 minutes."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STEPS = ("env", "greedy-equivalence", "step-split-smollm", "step-split-qwen3-8b", "verify-floor",
         "tree-build-floor", "host-syncs")
GOALS = {"step-split-smollm": "smollm bs 8 light", "step-split-qwen3-8b": "qwen3-8b bs 8 light",
         "verify-floor": "sampled verify bs 32 N 64 V 151936", "tree-build-floor": "tree build bs 32 B 64",
         "host-syncs": "host syncs per live step"}


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_the_first_call_runs_every_step_on_the_cpu_and_each_reports(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHON=sys.executable, OUT_DIR=str(tmp_path / "out"), DDTREE_LAB_THREADS="1", OMP_NUM_THREADS="1")
    res = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run"], capture_output=True,
                         text=True, env=env, timeout=600, cwd=ROOT)
    out = res.stdout
    assert res.returncode == 0 and out.splitlines()[-1] == "dry-run: ok", out[-3000:] + res.stderr[-2000:]
    rows = [line.split(None, 2) for line in out.splitlines()[1:] if re.match(r"^\S+\s+\d+s\s", line)]
    assert [r[0] for r in rows] == list(STEPS)
    assert sum(int(r[1][:-1]) for r in rows) <= 480  # the first call: 8 minutes
    for name in STEPS:
        assert re.search(rf"^dry-run: {name}: ran on the CPU \(tiny shapes\): ", out, re.M), name
    for name, goal in GOALS.items():
        line = next(x for x in out.splitlines() if x.startswith(f"dry-run: {name}: "))
        assert f"GOAL {goal}" in line and "not judged (dry run)" in line, line
    assert "greedy-equivalence: ran on the CPU (tiny shapes): STEP greedy-equivalence: 2/2 requests equal" in out
    assert "FAIL" not in out and "PASS" not in out  # a dry run never counts as passing


def test_a_step_reports_its_goal_and_never_judges_it_in_a_dry_run():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DDTREE_LAB_THREADS": "1", "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    res = subprocess.run([sys.executable, "benchmarks/gpu_plan.py", "--step", "tree-build-floor", "--dry-run"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    assert re.search(r"^GOAL tree build bs 32 B 64, build / floor: \S+x \(goal <= 10x\): not judged \(dry run\)$",
                     res.stdout, re.M)
    assert re.search(r"^STEP tree-build-floor done in ", res.stdout, re.M)
    listed = subprocess.run([sys.executable, "benchmarks/gpu_plan.py", "--list"], capture_output=True, text=True,
                            timeout=60, cwd=ROOT, env=env).stdout.split()
    assert [listed[i] for i in range(0, len(listed), 3)] == list(STEPS)
    assert sum(float(listed[i]) for i in range(1, len(listed), 3)) <= 8
