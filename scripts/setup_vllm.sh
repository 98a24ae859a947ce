#!/usr/bin/env bash
# Creates .venv-vllm: vLLM's own venv, for the vLLM engine adapter (ddtree_lab/engines/vllm.py)
# and its tests. Optional: the lab itself never imports vllm; only the adapter's worker runs here.
#  - torch 2.13.0+cpu and triton 3.9.0, kept by a constraints file: vllm's declared dependencies
#    would replace them with a CUDA torch and ~30 CUDA packages.
#  - vllm==0.33.0 with --no-deps, then the pure-Python packages its import chain needs to import
#    vllm.v1.sample.rejection_sampler (and vllm.platforms) on a CPU.
#  - this repository on the venv's path (a .pth file), so the worker imports ddtree_lab.
# Safe to run again: when the venv already imports everything, it says so and does nothing.
# torch's CPU wheel must be reachable by pip (a local wheel directory, or PyTorch's CPU index
# given as PIP_EXTRA_INDEX_URL); VLLM_VENV overrides the venv's place.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-python3}
VENV=${VLLM_VENV:-.venv-vllm}
VLLM_VERSION=0.33.0
TORCH_VERSION=2.13.0+cpu
TRITON_VERSION=3.9.0
# What vllm's import chain asks for (vllm.v1.sample.rejection_sampler, vllm.platforms), found by
# importing it and adding one package at a time; all pure Python or small wheels. The versions
# are the ones seen working together (vllm's own pins, e.g. transformers<5.21, are not needed by
# the sampler).
DEPS=(numpy==2.4.6 safetensors==0.8.0 pydantic==2.14.4 regex==2026.11.19 cbor2==6.3.0 psutil==7.2.2
      pyzmq==27.3.0 transformers==5.24.0 aiohttp==3.14.5 requests==2.34.2 openai==3.57.0
      openai-harmony==0.0.8 pillow==13.0.0 pybase64==1.5.1 cachetools==8.0.2 msgspec==0.23.0
      cloudpickle==3.1.3 uvloop==0.23.0 py-cpuinfo==9.0.0 prometheus_client==0.26.0 xgrammar==0.2.9
      fastapi==0.165.0 partial-json-parser==0.2.1.1.post7 llguidance==1.9.1 tqdm==4.70.1)
CHECK='import os; os.environ["CUDA_VISIBLE_DEVICES"] = ""; os.environ["TRITON_INTERPRET"] = "1"
import torch, triton, vllm, ddtree_lab
import vllm.v1.sample.rejection_sampler
assert torch.__version__ == "'$TORCH_VERSION'", torch.__version__
assert triton.__version__ == "'$TRITON_VERSION'", triton.__version__
assert vllm.__version__ == "'$VLLM_VERSION'", vllm.__version__
assert os.path.realpath(os.path.dirname(ddtree_lab.__file__)) == os.path.realpath("'$ROOT'/ddtree_lab"), ddtree_lab.__file__'

start=$(date +%s)
if [[ -x $VENV/bin/python ]] && "$VENV/bin/python" -c "$CHECK" >/dev/null 2>&1; then
  echo "[setup_vllm] $VENV is ready (vllm $VLLM_VERSION, torch $TORCH_VERSION, triton $TRITON_VERSION): nothing to do"
  exit 0
fi

if [[ ! -x $VENV/bin/python ]]; then
  echo "[setup_vllm] creating $VENV"
  "$PY" -m venv "$VENV"
fi
VPY=$VENV/bin/python
"$VPY" -m pip install -q --upgrade pip >/dev/null

CONSTRAINTS=$VENV/constraints.txt
printf 'torch==%s\ntriton==%s\n' "$TORCH_VERSION" "$TRITON_VERSION" > "$CONSTRAINTS"

echo "[setup_vllm] installing torch==$TORCH_VERSION triton==$TRITON_VERSION"
"$VPY" -m pip install -q -c "$CONSTRAINTS" "torch==$TORCH_VERSION" "triton==$TRITON_VERSION"
echo "[setup_vllm] installing vllm==$VLLM_VERSION (--no-deps: its declared torch is a CUDA build)"
echo "[setup_vllm] (pip's resolver then lists vllm requirements it does not install: expected with --no-deps;"
echo "[setup_vllm]  only vllm.v1.sample's rejection sampler is used here)"
"$VPY" -m pip install -q --no-deps "vllm==$VLLM_VERSION"
echo "[setup_vllm] installing what vllm's sampler import chain needs: ${DEPS[*]}"
"$VPY" -m pip install -q -c "$CONSTRAINTS" "${DEPS[@]}"

# this repository, importable from the venv without installing its dependencies again
SITE=$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$ROOT" > "$SITE/ddtree_lab_repo.pth"
echo "[setup_vllm] $SITE/ddtree_lab_repo.pth -> $ROOT (ddtree_lab importable)"

if ! "$VPY" -c "$CHECK" 2>"$VENV/check.log"; then
  cat "$VENV/check.log" >&2
  echo "[setup_vllm] error: $VENV does not import vllm.v1.sample.rejection_sampler with the pinned torch/triton (above)" >&2
  exit 1
fi
echo "[setup_vllm] installed into $VENV:"
"$VPY" -m pip list --format=freeze 2>/dev/null | grep -i -E "^(torch|triton|vllm|transformers|numpy|safetensors|pydantic)==" | sed 's/^/[setup_vllm]   /'
echo "[setup_vllm] ready in $(( $(date +%s) - start )) s"
