#!/usr/bin/env bash
# The GPU test routine: the CUDA op and runtime tests, then compute-sanitizer's memcheck,
# racecheck and synccheck over the CUDA op tests. Fails (exit 1) on a failing test or on any
# sanitizer report. Needs a CUDA build of the library (ORT_OPS_LIBRARY, or the installed package)
# and, for the CUDA EP tests, onnxruntime-gpu on PYTHONPATH.
#
#   tools/gpu-check.sh            tests + sanitizers over the kernel subsets (about 5 minutes on an H200)
#   tools/gpu-check.sh --full     sanitizers over every CUDA op test (much longer: racecheck is slow)
#   tools/gpu-check.sh --sanitize-only
#
# Logs go to $GPU_CHECK_LOGS (default /tmp/gpu-check); the summary lines are printed.
set -u
cd "$(dirname "$0")/.."
logs=${GPU_CHECK_LOGS:-/tmp/gpu-check}
mkdir -p "$logs"
full=0 tests=1
for a in "$@"; do
  case "$a" in
    --full) full=1 ;;
    --sanitize-only) tests=0 ;;
    *) echo "gpu-check: unknown option '$a' (--full, --sanitize-only)" >&2; exit 2 ;;
  esac
done
command -v compute-sanitizer >/dev/null || { echo "gpu-check: compute-sanitizer not on PATH" >&2; exit 2; }
status=0
pytest_q() { python3 -m pytest -q -p no:cacheprovider "$@"; }

if [ "$tests" = 1 ]; then
  pytest_q tests/ops tests/test_runtime_cuda.py tests/test_runtime_device.py tests/test_cli_device.py \
    > "$logs/tests.log" 2>&1 || status=1
  echo "tests: $(tail -1 "$logs/tests.log")"
fi

pa=tests/ops/test_paged_attention_int8_cuda.py
moe="tests/ops/test_moe_cuda.py tests/ops/test_moe_kmajor_cuda.py tests/ops/test_moe_wgmma_cuda.py"
if [ "$full" = 1 ]; then
  sel_pa=() sel_moe=()
else
  # Every kernel at least once: decode (warp and partition kernels, splits, shared 64-key stages),
  # prefill, QuantizeKVCache, the MoE GEMMs (mma.sync, stream, wgmma) and routing.
  sel_pa=(-k "decode_matches_reference or prefill_kernel_matches_reference or quantize_kv_cache or many_splits or shared_stages")
  sel_moe=(-k "routing or chain or gmsq or gmd or wgmma or stream")
fi

# One sanitizer run; fails on a test failure or a nonzero error / hazard count in its summary.
sanitize() {
  local tool=$1 name=$2; shift 2
  local log="$logs/$tool-$name.log"
  compute-sanitizer --tool "$tool" --error-exitcode 99 python3 -m pytest -q -p no:cacheprovider "$@" > "$log" 2>&1
  local rc=$?
  local summary
  summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$log" | tail -1)
  local result
  result=$(grep -E "passed|failed|error" "$log" | grep -v SUMMARY | tail -1)
  echo "$tool $name: $result / ${summary:-no summary}"
  if [ $rc -ne 0 ] || ! echo "$summary" | grep -qE "(ERROR SUMMARY: 0 errors|0 hazards displayed \(0 errors, 0 warnings\))"; then
    status=1
  fi
}
sanitize memcheck attention $pa "${sel_pa[@]}"
sanitize memcheck moe $moe "${sel_moe[@]}"
sanitize racecheck attention $pa "${sel_pa[@]}"
sanitize racecheck moe $moe "${sel_moe[@]}"
sanitize synccheck attention $pa "${sel_pa[@]}"
sanitize synccheck moe $moe "${sel_moe[@]}"
[ $status = 0 ] && echo "gpu-check: PASS" || echo "gpu-check: FAIL (logs in $logs)"
exit $status
