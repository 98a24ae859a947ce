#!/usr/bin/env bash
# Every GPU check of tests/GPU_ONLY.md that runs unattended, plus the GPU benchmarks, in one go
# on one CUDA GPU (budget: 8 minutes on an H100-class GPU); prints one summary table.
#
#   bash scripts/gpu_check.sh            # after `make setup` on a GPU machine
#   bash scripts/gpu_check.sh --dry-run  # print the checks and their time limits, run nothing
#
# Each check runs under its own time limit (cut to what is left of the total budget); its
# output goes to $OUT_DIR/<name>.log (default gpu_check_out/). Exit status: 0 when every check
# passed or was skipped for a stated reason, 1 otherwise. Checks that need a model download or
# a server (the SGLang end-to-end recorder) stay manual: see tests/GPU_ONLY.md.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
[[ "${1:-}" == "--dry-run" ]] && DRY=1
PY=${PYTHON:-}
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
OUT_DIR=${OUT_DIR:-gpu_check_out}
BUDGET=${GPU_CHECK_BUDGET_S:-470}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# name | limit in seconds | command
CHECKS=(
  "triton-verify|90|$PY -m pytest -q -x tests/test_verify_triton.py"
  "audit-triton|35|$PY -m pytest -q -x tests/test_audit.py -k triton"
  "session-gpu|65|$PY -m pytest -q -x -s tests/test_session_gpu.py"
  "sglang-kernels|50|$PY -m pytest -q -x tests/test_sglang_gpu.py"
  "tree-build-cuda|40|$PY benchmarks/tree_build.py --device cuda --repeat 3 --skip-builders"
  "live-step-cuda|80|$PY benchmarks/live_step.py --device cuda --skip-threads"
  "verify-bench|110|$PY benchmarks/verify.py"
)

if [[ $DRY == 1 ]]; then
  printf '%-16s %6s  %s\n' check limit command
  for c in "${CHECKS[@]}"; do IFS='|' read -r name limit cmd <<<"$c"; printf '%-16s %5ss  %s\n' "$name" "$limit" "$cmd"; done
  total=0; for c in "${CHECKS[@]}"; do IFS='|' read -r _ limit _ <<<"$c"; total=$((total + limit)); done
  echo "total limit ${total}s (budget ${BUDGET}s)"
  exit 0
fi

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_check: no CUDA device visible to $PY (torch.cuda.is_available() is false)" >&2
  exit 1
fi
mkdir -p "$OUT_DIR"
"$PY" -c "import torch; print('gpu_check:', torch.cuda.get_device_name(0), 'torch', torch.__version__)"
start=$(date +%s)
declare -a ROWS
fail=0
for c in "${CHECKS[@]}"; do
  IFS='|' read -r name limit cmd <<<"$c"
  left=$((BUDGET - ($(date +%s) - start)))
  (( limit > left )) && limit=$left
  if (( limit < 10 )); then
    ROWS+=("$name|NOT RUN|0|total budget spent"); fail=1; continue
  fi
  t0=$(date +%s)
  timeout --kill-after=5 "$limit" bash -c "$cmd" >"$OUT_DIR/$name.log" 2>&1
  rc=$?
  dt=$(( $(date +%s) - t0 ))
  last=$(grep -v '^\s*$' "$OUT_DIR/$name.log" | tail -n 1 | cut -c1-90)
  if [[ $rc == 0 ]]; then
    status=PASS
    grep -qE '(^| )[0-9]+ skipped' "$OUT_DIR/$name.log" && ! grep -qE ' passed' "$OUT_DIR/$name.log" && status=SKIPPED
  elif [[ $rc == 124 || $rc == 137 ]]; then
    status=TIMEOUT; fail=1
  else
    status="FAIL($rc)"; fail=1
  fi
  ROWS+=("$name|$status|$dt|$last")
done
echo
printf '%-16s %-9s %5s  %s\n' check status secs "last line of $OUT_DIR/<check>.log"
for r in "${ROWS[@]}"; do IFS='|' read -r a b c d <<<"$r"; printf '%-16s %-9s %5s  %s\n' "$a" "$b" "$c" "$d"; done
echo "total $(( $(date +%s) - start ))s"
for n in tree-build-cuda live-step-cuda verify-bench; do
  [[ -s "$OUT_DIR/$n.log" ]] && { echo; echo "== $n"; grep -v '^Loading' "$OUT_DIR/$n.log" | tail -n 25; }
done
exit $fail
