"""scripts/gpu_check.sh: what can be checked without a GPU (syntax, the plan, its files)."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_check_parses_and_its_plan_fits_the_budget():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    out = subprocess.run(["bash", str(SCRIPT), "--dry-run"], check=True, capture_output=True, text=True).stdout
    rows = [line.split(None, 2) for line in out.splitlines()[1:] if re.match(r"^\S+\s+\d+s\s", line)]
    names = [r[0] for r in rows]
    assert {"triton-verify", "audit-triton", "session-gpu", "sglang-kernels", "tree-build-cuda", "live-step-cuda",
            "verify-bench"} == set(names)
    assert sum(int(r[1][:-1]) for r in rows) <= 480  # 8 minutes
    for _, _, cmd in rows:
        for path in re.findall(r"(?:tests|benchmarks)/\S+\.py", cmd):
            assert (ROOT / path).exists(), path
    assert "--device cuda" in out and "benchmarks/verify.py" in out


def test_every_gpu_only_section_names_a_check_the_script_runs_or_says_manual():
    text = (ROOT / "tests" / "GPU_ONLY.md").read_text()
    script = SCRIPT.read_text()
    for test_file in set(re.findall(r"tests/test_\w+\.py", text)):
        assert test_file in script, f"{test_file} is in tests/GPU_ONLY.md but not in scripts/gpu_check.sh"
    assert "manual" in script
