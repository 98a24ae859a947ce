#!/usr/bin/env bash
# Every GPU check of tests/GPU_ONLY.md that runs unattended, plus the GPU benchmarks, in one go
# on one CUDA GPU (budget: 8 minutes on an H100-class GPU); prints one summary table.
#
#   bash scripts/gpu_check.sh            # after `make setup` on a GPU machine
#   bash scripts/gpu_check.sh --dry-run  # on any machine: the plan, its budget, imports, each
#                                        # command's arguments, its files, the summary's columns
#   bash scripts/gpu_check.sh --only triton-verify,verify-bench   # a subset (either mode)
#   bash scripts/gpu_check.sh --call 2   # which device call of issue 36's plan (default 1)
#
# Issue 36's plan (a device session has 15 minutes in all, the machine's start included):
#   call 1 (default, <= 8 min): benchmarks/gpu_plan.py's steps, random weights only --
#     env, greedy-equivalence, step-split-smollm, step-split-qwen3-8b, verify-floor,
#     tree-build-floor, host-syncs (what each measures and its goal: that file's docstring).
#     --dry-run RUNS every step on the CPU with tiny shapes (`--dry-run` of gpu_plan.py) and
#     checks that each reports (tests/test_gpu_plan.py runs it); GPU_CHECK_QWEN_LAYERS=N gives the Qwen3-8B-shaped target N
#     layers instead of 36.
#   call 2: the engines' CUDA-only kernels through the audit's own entry points (SGLang's
#     selector_walk_triton, accept_sampling_triton, MarkovSampleStep.triton,
#     blockwise_rejection_triton: tests/test_sglang_gpu.py -k cuda_kernels; vLLM's Triton
#     rejection-sampler kernels compiled: benchmarks/engine_audit.py --rules vllm:*, which needs
#     a CUDA build of .venv-vllm), then the Triton verifiers' differential tests and audit.
#   call 3: the checks of issue 11 / 27 (session-gpu, tree-build-cuda, live-step-cuda,
#     verify-bench, tree-cost-cuda).
#
# Each check runs under its own time limit (cut to what is left of the total budget); its
# output goes to $OUT_DIR/<name>.log (default gpu_check_out/), the summary to
# $OUT_DIR/summary.tsv (columns: check status secs last_line). Exit status: 0 when every check
# passed or was skipped for a stated reason, 1 otherwise. Checks that need a model download or
# a server (the SGLang end-to-end recorder) stay manual: see tests/GPU_ONLY.md.
# sglang-kernels includes SGLang's CUDA-only sampled-verify rules end to end (issue 24:
# selector_walk_triton, accept_sampling_triton, MarkovSampleStep.triton,
# blockwise_rejection_triton; `-k cuda_kernels`): docs/ENGINES.md lists them "not audited here"
# until this has run on a GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
ONLY=""
CALL=1
while (( $# )); do
  case "$1" in
    --dry-run) DRY=1 ;;
    --call)
      [[ "${2:-}" =~ ^[123]$ ]] || { echo "gpu_check: --call needs 1, 2 or 3" >&2; exit 2; }
      CALL=$2; shift ;;
    --only)
      if [[ -z "${2:-}" || "$2" == --* ]]; then echo "gpu_check: --only needs a comma-separated list of check names" >&2; exit 2; fi
      ONLY=$2; shift ;;
    --only=*) ONLY=${1#--only=}; [[ -n "$ONLY" ]] || { echo "gpu_check: --only= needs check names" >&2; exit 2; } ;;
    *) echo "gpu_check: unknown argument '$1' (use --dry-run, --call 1|2|3, --only NAME[,NAME...])" >&2; exit 2 ;;
  esac
  shift
done
PY=${PYTHON:-}
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
OUT_DIR=${OUT_DIR:-gpu_check_out}
BUDGET=${GPU_CHECK_BUDGET_S:-480}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# tree-cost-cuda (issue 27's GPU cost model, read by benchmarks/tree_policies.py --cost-model):
# with GPU_CHECK_MODEL_DIR set (a directory with the default target's config.json and tokenizer
# files) it times the architecture with random weights, for a device the 98 MB GGUF cannot reach.
COST_WEIGHTS=""
[[ -n "${GPU_CHECK_MODEL_DIR:-}" ]] && COST_WEIGHTS="--weights random --model-dir $(printf '%q' "$GPU_CHECK_MODEL_DIR")"
# triton-verify leaves out the sm80/sm90/sm100 compile test: it compiles on the host with ptxas
# (minutes, no device needed) and CI runs it; on an H200 it alone outran the check's limit.
# name | limit in seconds | command
# call 1: issue 36's most informative checks, random weights, limits summing to <= 480 s
QWEN=""; [[ -n "${GPU_CHECK_QWEN_LAYERS:-}" ]] && QWEN="--qwen-layers $(printf '%q' "$GPU_CHECK_QWEN_LAYERS")"
CALL1=(
  "env|20|$PY benchmarks/gpu_plan.py --step env"
  "greedy-equivalence|50|$PY benchmarks/gpu_plan.py --step greedy-equivalence"
  "step-split-smollm|100|$PY benchmarks/gpu_plan.py --step step-split-smollm"
  "step-split-qwen3-8b|150|$PY benchmarks/gpu_plan.py --step step-split-qwen3-8b $QWEN"
  "verify-floor|60|$PY benchmarks/gpu_plan.py --step verify-floor"
  "tree-build-floor|40|$PY benchmarks/gpu_plan.py --step tree-build-floor"
  "host-syncs|50|$PY benchmarks/gpu_plan.py --step host-syncs"
)
# call 2: the engines' CUDA-only kernels (their audit entry points), then the Triton verifiers
CALL2=(
  "sglang-kernels|90|$PY -m pytest -q -x tests/test_sglang_gpu.py"
  "vllm-kernels|150|$PY benchmarks/engine_audit.py --rules vllm:dflash2,vllm:dflash2-block,vllm:onehot,vllm:onehot-block,vllm:rejection-sampler --seeds 5"
  "triton-verify|120|$PY -m pytest -q -x tests/test_verify_triton.py --deselect tests/test_verify_triton.py::test_every_kernel_configuration_compiles_for_sm80_sm90_sm100_without_spills"
  "audit-triton|35|$PY -m pytest -q -x tests/test_audit.py -k triton"
)
# call 3: issue 11 / 27's checks
CALL3=(
  "session-gpu|55|$PY -m pytest -q -x -s tests/test_session_gpu.py"
  "tree-build-cuda|35|$PY benchmarks/tree_build.py --device cuda --repeat 3 --skip-builders"
  "live-step-cuda|60|$PY benchmarks/live_step.py --device cuda --skip-threads"
  "verify-bench|55|$PY benchmarks/verify.py"
  "tree-cost-cuda|70|$PY benchmarks/tree_cost.py --device cuda --repeats 20 --rounds --round-tokens 16 --json $OUT_DIR/tree_cost_cuda.json $COST_WEIGHTS"
)

case $CALL in
  1) CHECKS=("${CALL1[@]}") ;;
  2) CHECKS=("${CALL2[@]}") ;;
  3) CHECKS=("${CALL3[@]}") ;;
esac

# --only: keep the named checks (a device that lacks what the others need, e.g. the model's
# weights or SGLang's CUDA build, runs the rest); an unknown name is an error, not a silent skip
if [[ -n "$ONLY" ]]; then
  kept=()
  IFS=',' read -r -a wanted <<<"$ONLY"
  for w in "${wanted[@]}"; do
    found=0
    for c in "${CHECKS[@]}"; do IFS='|' read -r name _ _ <<<"$c"; [[ "$name" == "$w" ]] && { kept+=("$c"); found=1; }; done
    (( found )) || { echo "gpu_check: --only names no check '$w' (checks: $(for c in "${CHECKS[@]}"; do printf '%s ' "${c%%|*}"; done))" >&2; exit 2; }
  done
  CHECKS=("${kept[@]}")
fi

# the summary table: one header, used by the real run and checked by the dry run
SUMMARY_COLUMNS="check status secs last_line"
summary_header() { printf '%-16s %-9s %5s  %s\n' check status secs "last line of $OUT_DIR/<check>.log"; }
# every file the real run writes (under $OUT_DIR)
written_files() { for c in "${CHECKS[@]}"; do IFS='|' read -r name _ _ <<<"$c"; echo "$OUT_DIR/$name.log"; done
                  echo "$OUT_DIR/summary.tsv"; echo "$OUT_DIR/tree_cost_cuda.json"; }

if [[ $DRY == 1 ]]; then
  # Everything the real run needs except the device: the plan and its budget, imports, each
  # command's arguments, every file it writes, the summary's columns. Exit 1 on any miss.
  bad=0
  note() { echo "dry-run: $*"; }
  miss() { echo "dry-run: FAIL $*"; bad=1; }
  printf '%-16s %6s  %s\n' check limit command
  for c in "${CHECKS[@]}"; do IFS='|' read -r name limit cmd <<<"$c"; printf '%-16s %5ss  %s\n' "$name" "$limit" "$cmd"; done
  total=0; for c in "${CHECKS[@]}"; do IFS='|' read -r _ limit _ <<<"$c"; total=$((total + limit)); done
  echo "total limit ${total}s (budget ${BUDGET}s)"
  (( total <= BUDGET )) && note "budget: declared limits ${total}s <= ${BUDGET}s" || miss "budget: declared limits ${total}s > ${BUDGET}s"
  (( BUDGET <= 480 )) && note "budget: ${BUDGET}s fits 8 minutes" || miss "budget: ${BUDGET}s is over 8 minutes"
  # imports the checks need (the kernels under the interpreter: there is no device here)
  if TRITON_INTERPRET=1 "$PY" -c "import torch, triton, pytest, ddtree_lab, ddtree_lab.verify.backends, ddtree_lab.kernels.tree_verify, ddtree_lab.kernels.resources" 2>"${TMPDIR:-/tmp}/gpu_check_import.err"; then
    note "imports: torch triton pytest ddtree_lab (verify.backends, kernels) with $PY"
  else
    miss "imports with $PY: $(tail -n 1 "${TMPDIR:-/tmp}/gpu_check_import.err")"
  fi
  # each command's arguments: pytest collects its files (and -k), a benchmark's parser knows its flags
  for c in "${CHECKS[@]}"; do
    IFS='|' read -r name _ cmd <<<"$c"
    read -r -a words <<<"$cmd"
    if [[ "$cmd" == *"benchmarks/gpu_plan.py --step"* ]]; then
      # the step itself, on the CPU with tiny shapes: it must report and finish
      if out=$(DDTREE_LAB_THREADS=${DDTREE_LAB_THREADS:-1} OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} timeout 300 bash -c "$cmd --dry-run" 2>&1) \
          && grep -q "^STEP $name done" <<<"$out"; then
        note "$name: ran on the CPU (tiny shapes): $(grep -E '^(GOAL|STEP)' <<<"$out" | grep -v ' done in ' | tail -n 1 | cut -c1-200)"
      else
        miss "$name: the dry run of '$cmd' did not report: $(tail -n 1 <<<"$out")"
      fi
    elif [[ "$cmd" == *" -m pytest "* ]]; then
      files=(); kexpr=""; prev=""
      for w in "${words[@]}"; do [[ "$w" == tests/*.py ]] && files+=("$w"); [[ "$prev" == "-k" ]] && kexpr="$w"; prev="$w"; done
      if out=$(TRITON_INTERPRET=1 "$PY" -m pytest --collect-only -q "${files[@]}" ${kexpr:+-k "$kexpr"} 2>&1); then
        n=$(grep -cE '::' <<<"$out"); (( n > 0 )) && note "$name: pytest collects $n tests" || miss "$name: pytest collects no test"
      else
        miss "$name: pytest cannot collect ${files[*]}: $(tail -n 1 <<<"$out")"
      fi
    else
      script=""; for w in "${words[@]}"; do [[ "$w" == benchmarks/*.py ]] && script="$w"; done
      if [[ -z "$script" || ! -f "$script" ]]; then miss "$name: no benchmark script in '$cmd'"; continue; fi
      help=$("$PY" "$script" --help 2>&1) || { miss "$name: $script --help fails: $(tail -n 1 <<<"$help")"; continue; }
      flags_ok=1
      for w in "${words[@]}"; do
        if [[ "$w" == --* ]] && ! grep -qE -- "(^|[ ,\[])${w}([ =,]|\]|$)" <<<"$help"; then miss "$name: $script has no option $w"; flags_ok=0; fi
      done
      (( flags_ok )) && note "$name: $script parses its options"
    fi
  done
  if [[ -n "${GPU_CHECK_MODEL_DIR:-}" ]]; then
    [[ -f "$GPU_CHECK_MODEL_DIR/config.json" ]] && note "model dir: $GPU_CHECK_MODEL_DIR has a config.json (random weights for tree-cost-cuda)" \
      || miss "model dir: GPU_CHECK_MODEL_DIR=$GPU_CHECK_MODEL_DIR has no config.json"
  fi
  # every file it writes: the output folder and each file in it can be created
  dir_made=0; [[ -d "$OUT_DIR" ]] || dir_made=1
  if mkdir -p "$OUT_DIR" 2>/dev/null; then
    nfiles=0
    while read -r f; do
      if [[ -e "$f" ]]; then [[ -w "$f" ]] && nfiles=$((nfiles + 1)) || miss "cannot write $f"
      else : >"$f" 2>/dev/null && { rm -f "$f"; nfiles=$((nfiles + 1)); } || miss "cannot write $f"; fi
    done < <(written_files)
    note "files: $nfiles files under $OUT_DIR/ can be written"
    (( dir_made )) && rmdir "$OUT_DIR" 2>/dev/null
  else
    miss "cannot create $OUT_DIR"
  fi
  echo "summary columns: $SUMMARY_COLUMNS"
  summary_header
  (( bad == 0 )) && echo "dry-run: ok" || echo "dry-run: FAILED"
  exit $bad
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
summary_header
printf '%s\n' "${SUMMARY_COLUMNS// /$'\t'}" >"$OUT_DIR/summary.tsv"
for r in "${ROWS[@]}"; do
  IFS='|' read -r a b c d <<<"$r"; printf '%-16s %-9s %5s  %s\n' "$a" "$b" "$c" "$d"
  printf '%s\t%s\t%s\t%s\n' "$a" "$b" "$c" "$d" >>"$OUT_DIR/summary.tsv"
done
echo "total $(( $(date +%s) - start ))s"
grep -h '^GOAL' "$OUT_DIR"/*.log 2>/dev/null
for n in tree-build-cuda live-step-cuda verify-bench tree-cost-cuda; do  # call 3's tables
  [[ -s "$OUT_DIR/$n.log" ]] && { echo; echo "== $n"; grep -v '^Loading' "$OUT_DIR/$n.log" | tail -n 25; }
done
exit $fail
