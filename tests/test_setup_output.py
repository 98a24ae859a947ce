"""scripts/setup.sh's output (issue 18.16): pip's complaints about sglang's requirements (it is
installed with --no-deps on purpose) are counted in one line, not printed one by one, and
every other pip message still shows; the README's set-up block is `make lab` and `make test`,
and both set up first."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _pip_install_function() -> str:
    text = (ROOT / "scripts" / "setup.sh").read_text()
    m = re.search(r"^pip_install\(\) \{\n.*?^\}\n", text, re.S | re.M)
    assert m, "scripts/setup.sh has no pip_install function"
    return m.group(0)


def test_sglang_requirement_lines_are_counted_once(tmp_path):
    fake = tmp_path / "python"
    lines = ["ERROR: pip's dependency resolver does not currently take into account all the packages that are "
             "installed. This behaviour is the source of the following dependency conflicts."]
    lines += [f"sglang 0.5.23 requires pkg{k}, which is not installed." for k in range(59)]
    lines += ["WARNING: something else worth seeing"]
    fake.write_text("#!/usr/bin/env bash\ncat >&2 <<'EOT'\n" + "\n".join(lines) + "\nEOT\n")
    fake.chmod(0o755)
    venv = tmp_path / "venv"
    venv.mkdir()
    script = f'set -euo pipefail\nVPY="{fake}"\nVENV="{venv}"\n' + _pip_install_function() + "pip_install -q x\n"
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    shown = r.stdout + r.stderr
    assert "requires pkg" not in shown and "dependency resolver" not in shown
    assert "WARNING: something else worth seeing" in shown
    assert "59 requirements of sglang" in shown and shown.count("[setup] note") == 1
    assert "requires pkg58" in (venv / "pip-sglang-requirements.log").read_text()


def test_a_failing_pip_shows_everything(tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/usr/bin/env bash\necho 'sglang 0.5.23 requires a, which is not installed.' >&2\n"
                    "echo 'ERROR: No matching distribution' >&2\nexit 1\n")
    fake.chmod(0o755)
    script = f'VPY="{fake}"\nVENV="{tmp_path}"\n' + _pip_install_function() + "pip_install -q x || echo FAILED\n"
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True)
    assert "FAILED" in r.stdout and "No matching distribution" in r.stderr and "requires a" in r.stderr


def test_readme_set_up_block_is_two_commands_that_each_set_up():
    """The README's set-up is two commands (open the lab, run the tests); each creates the venv
    on first use, so both Makefile rules depend on the set-up stamp."""
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Set-up (fresh machine)")[1].split("```bash")[1].split("```")[0]
    commands = [line.split("#")[0].strip() for line in block.splitlines() if line.split("#")[0].strip()]
    assert commands == ["make lab", "make test"], commands
    makefile = (ROOT / "Makefile").read_text()
    for rule in ("lab", "test"):
        assert re.search(rf"^{rule}: \$\(READY\)$", makefile, re.M), f"Makefile rule {rule} does not set up first"
    assert re.search(r"^\$\(READY\): .*scripts/setup.sh", makefile, re.M)
