"""scripts/gpu_check.sh: what can be checked without a GPU (syntax, the plan, its files)."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def _dry_run(tmp_path, *args, **env):
    """``gpu_check.sh --dry-run ARGS`` with this interpreter and an output folder under ``tmp_path``
    (call 1, issue 36's plan, is tested in tests/test_gpu_plan.py)."""
    full = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    full.update({"PYTHON": sys.executable, "OUT_DIR": str(tmp_path / "gpu_out")}, **env)
    return subprocess.run(["bash", str(SCRIPT), "--dry-run", *args], capture_output=True, text=True, env=full, timeout=600)


@pytest.fixture(scope="module")
def dry(tmp_path_factory):
    """The dry runs of calls 2 and 3, one after the other."""
    out = ""
    for call in ("2", "3"):
        res = _dry_run(tmp_path_factory.mktemp("dry"), "--call", call)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
        out += res.stdout
    return out


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_check_parses_and_its_plan_fits_the_budget(dry):
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    out = dry
    rows = [line.split(None, 2) for line in out.splitlines()[1:] if re.match(r"^\S+\s+\d+s\s", line)]
    names = [r[0] for r in rows]
    assert {"triton-verify", "audit-triton", "session-gpu", "sglang-kernels", "vllm-kernels", "tree-build-cuda",
            "live-step-cuda", "verify-bench", "tree-cost-cuda"} == set(names)
    assert re.findall(r"total limit (\d+)s", out) and all(int(t) <= 480 for t in re.findall(r"total limit (\d+)s", out))
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


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_dry_run_checks_imports_arguments_files_and_the_summary_columns(dry):
    lines = dry.splitlines()
    assert lines[-1] == "dry-run: ok" and dry.count("dry-run: ok") == 2
    assert "FAIL" not in dry
    assert any(line.startswith("dry-run: imports: torch triton pytest ddtree_lab") for line in lines)
    for name in ("triton-verify", "audit-triton", "session-gpu", "sglang-kernels"):
        m = re.search(rf"^dry-run: {name}: pytest collects (\d+) tests$", dry, re.M)
        assert m and int(m.group(1)) > 0, name
    for name in ("tree-build-cuda", "live-step-cuda", "verify-bench", "tree-cost-cuda", "vllm-kernels"):
        assert re.search(rf"^dry-run: {name}: benchmarks/\S+\.py parses its options$", dry, re.M), name
    # call 2: 4 logs, call 3: 5 logs; each + summary.tsv + tree_cost_cuda.json
    assert re.search(r"^dry-run: files: 6 files under \S+/ can be written$", dry, re.M)
    assert re.search(r"^dry-run: files: 7 files under \S+/ can be written$", dry, re.M)
    # the summary the real run prints and writes (summary.tsv) has these columns, in this order
    assert "summary columns: check status secs last_line" in dry
    script = SCRIPT.read_text()
    assert 'SUMMARY_COLUMNS="check status secs last_line"' in script and script.count("summary_header") >= 3


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_dry_run_fails_on_an_over_budget_plan_a_bad_option_and_a_missing_python(tmp_path):
    # a copy of the script with a flag its benchmark does not have, run from a tree with the
    # project's files (the script cds to its parent folder), over a 100 s budget
    text = SCRIPT.read_text().replace("--skip-builders", "--no-such-flag")
    assert text != SCRIPT.read_text()
    (tmp_path / "scripts").mkdir()
    broken = tmp_path / "scripts" / "gpu_check.sh"
    broken.write_text(text)
    for part in ("ddtree_lab", "tests", "benchmarks", "fixtures"):
        (tmp_path / part).symlink_to(ROOT / part)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHON=sys.executable, OUT_DIR=str(tmp_path / "out"), GPU_CHECK_BUDGET_S="100")
    res = subprocess.run(["bash", str(broken), "--dry-run", "--call", "3"], capture_output=True, text=True, env=env,
                         timeout=600)
    assert res.returncode == 1 and res.stdout.splitlines()[-1] == "dry-run: FAILED"
    assert "dry-run: FAIL budget: declared limits 275s > 100s" in res.stdout
    assert "dry-run: FAIL tree-build-cuda: benchmarks/tree_build.py has no option --no-such-flag" in res.stdout
    assert "dry-run: live-step-cuda: benchmarks/live_step.py parses its options" in res.stdout  # the others pass
    res = _dry_run(tmp_path, "--call", "3", PYTHON=str(tmp_path / "no-python"))
    assert res.returncode == 1 and "dry-run: FAIL imports" in res.stdout


def test_the_tree_cost_step_does_not_pass_without_a_gpu():
    # what gpu_check.sh's tree-cost-cuda step runs: without CUDA it exits 1 and says it did not run
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible: the step runs for real in scripts/gpu_check.sh")
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "tree_cost.py"), "--device", "cuda"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert res.returncode == 1 and "NOT RUN" in res.stderr and "tree forward" not in res.stdout
