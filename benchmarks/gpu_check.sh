#!/usr/bin/env bash
# One GPU visit: kernel self-checks, the pytest suite on the GPU, then benchmarks.
# Usage (on the H200 machine, from the repo root):
#   benchmarks/gpu_check.sh [selftest|sanitize|pytest|pytest-memcheck|bench-cutlass|demo|demo-fp8|bench-fp8|bench-gather|bench-gmm|gmm-trace|gmm-sustained|kernel-resources|ncu-gmm|ncu-fp8|bench-moe|bench-stages]...
# selftest, sanitize and bench-cutlass run the binaries in $GPU_BIN (default ./.gpu_bin),
# which scripts/build_gpu_tests.sh builds on a machine with Bazel; the Python steps load
# $MOE_XLA_LIBRARY (default: $GPU_BIN/libmoe_xla.so if present, else moe_xla/_native/).
# Logs and JSON go to $OUT (or ./.out).
set -uo pipefail
OUT="${OUT:-$PWD/.out}"; mkdir -p "$OUT"
GPU_BIN="${GPU_BIN:-$PWD/.gpu_bin}"
if [ -z "${MOE_XLA_LIBRARY:-}" ]; then
  MOE_XLA_LIBRARY="$PWD/moe_xla/_native/libmoe_xla.so"
  [ -f "$GPU_BIN/libmoe_xla.so" ] && MOE_XLA_LIBRARY="$GPU_BIN/libmoe_xla.so"
fi
export PYTHONUNBUFFERED=1 MOE_XLA_LIBRARY
SELFTESTS="grouped_gemm_selftest routing_selftest fast_quotient_selftest gather_gemm_selftest gather_tgmm_selftest"
status=0
# The test files that run kernels on the GPU (the 8-device ones run on CPU devices in CI).
GPU_TESTS="tests/test_gmm.py tests/test_gmm_autodiff.py tests/test_gmm_errors.py tests/test_gather_gmm.py tests/test_gather_gmm_activate.py tests/test_gather_tgmm.py tests/test_gmm_lowering.py tests/test_routing.py tests/test_route_grad.py tests/test_moe.py tests/test_parallel_gpu.py tests/test_demo.py tests/test_fp8_quantize.py tests/test_unpermute_transpose.py tests/test_gmm_fp8.py tests/test_moe_fp8.py tests/test_fp8_wgrad.py tests/test_activate_quantize_fp8.py tests/test_activate_grad_quantize_fp8.py tests/test_expand_quantize_fp8_rows.py tests/test_expand_unit_factor.py tests/test_gather_rows.py tests/test_product_combine.py tests/test_activate_weighted_grad.py tests/test_gmm_unpermute.py tests/test_fused_forward.py"
DEMO_ARGS=(--steps 300 --batch 32 --seq 256 --hidden 512 --heads 8 --experts 32 --top-k 4 --layers 4 --dtype bfloat16)
for step in "$@"; do
  echo "=== $step"
  case "$step" in
    selftest)
      for b in $SELFTESTS; do
        "$GPU_BIN/$b" > "$OUT/$b.log" 2>&1; rc=$?
        # On a GPU visit a self-test that skipped (no device seen) has checked nothing.
        grep -q SKIPPED "$OUT/$b.log" && rc=skipped
        grep -E "FAIL|error" "$OUT/$b.log" | head -20; tail -8 "$OUT/$b.log"; echo "$b rc=$rc"
        [ $rc = 0 ] || status=1
      done ;;
    sanitize)
      for b in $SELFTESTS; do
        timeout 200 compute-sanitizer --tool memcheck --print-limit 20 "$GPU_BIN/$b" > "$OUT/memcheck_$b.log" 2>&1; rc=$?
        tail -4 "$OUT/memcheck_$b.log"; echo "memcheck $b rc=$rc"; [ $rc = 0 ] || status=1
      done ;;
    pytest)
      python3 -m pytest -x -q -p no:cacheprovider tests > "$OUT/pytest_gpu.log" 2>&1; rc=$?
      tail -25 "$OUT/pytest_gpu.log"; echo "pytest rc=$rc"; [ $rc = 0 ] || status=1 ;;
    pytest-memcheck)  # the GPU test files under compute-sanitizer memcheck, in chunks (see the script)
      python3 benchmarks/memcheck_pytest.py --out "$OUT/memcheck" ${MEMCHECK_ARGS:-} ${MEMCHECK_TESTS:-$GPU_TESTS} \
        > "$OUT/pytest_memcheck.log" 2>&1; rc=$?
      tail -40 "$OUT/pytest_memcheck.log"; echo "pytest memcheck rc=$rc"; [ $rc = 0 ] || status=1 ;;
    bench-cutlass)
      "$GPU_BIN/grouped_gemm_bench" ${CUTLASS_ARGS:-} > "$OUT/grouped_gemm_bench.log" 2>&1 || status=1
      grep -E "^BEST|geomean|speed-up|OK|FAILED" "$OUT/grouped_gemm_bench.log" | tail -60 ;;
    demo)
      python3 -m moe_xla.demo --out "$OUT/demo" "${DEMO_ARGS[@]}" > "$OUT/demo.log" 2>&1 || status=1; tail -30 "$OUT/demo.log" ;;
    demo-fp8)  # the demo with DEMO_ARGS twice, bf16 and --quantization fp8_blockwise: mean losses of the last 50 steps within 2%
      python3 benchmarks/demo_fp8_vs_bf16.py --out "$OUT/demo_fp8" ${DEMO_FP8_ARGS:-} -- "${DEMO_ARGS[@]}" \
        > "$OUT/demo_fp8_vs_bf16.log" 2>&1 || status=1; tail -14 "$OUT/demo_fp8_vs_bf16.log" ;;
    bench-fp8)
      python3 benchmarks/gmm_fp8.py --out "$OUT" ${FP8_ARGS:-} > "$OUT/bench_gmm_fp8.log" 2>&1 || status=1; tail -14 "$OUT/bench_gmm_fp8.log" ;;
    bench-gather)
      python3 benchmarks/gather_rows.py --out "$OUT" ${GATHER_ARGS:-} > "$OUT/bench_gather_rows.log" 2>&1 || status=1; tail -34 "$OUT/bench_gather_rows.log" ;;
    bench-gmm)
      python3 benchmarks/gmm.py --out "$OUT" ${GMM_ARGS:-} > "$OUT/bench_gmm.log" 2>&1 || status=1; tail -14 "$OUT/bench_gmm.log" ;;
    kernel-resources)  # registers / shared memory / stack of the sm90 grouped GEMM kernels, ours and torch's, names demangled
      for lib in moe_xla/_native/libmoe_xla.so "$(python3 -c 'import os, torch; print(os.path.dirname(torch.__file__))')/lib/libtorch_cuda.so"; do
        echo "-- $lib" | tee -a "$OUT/kernel_resources.txt"
        cuobjdump --dump-resource-usage "$lib" 2>/dev/null | grep -A1 "GroupProblemShape" | grep -v "^--" | paste - - \
          | sed -E 's/.*Function ([^:]*):.*(REG:[0-9]+ STACK:[0-9]+ SHARED:[0-9]+ LOCAL:[0-9]+).*/\2 \1/' \
          | while read -r res name; do echo "$res $(echo "$name" | cu++filt)"; done >> "$OUT/kernel_resources.txt"
      done
      grep -c REG "$OUT/kernel_resources.txt" ;;
    ncu-gmm)  # Nsight Compute on moe_xla's and torch's grouped GEMM kernel, same inputs (benchmarks/gmm_ncu.py)
      for c in ${NCU_CASES:-qwen3-30b-a3b.down:uniform}; do
        ncu --clock-control none -k regex:device_kernel -c 4 --section SpeedOfLight --section LaunchStats --section Occupancy \
          --section WarpStateStats --section MemoryWorkloadAnalysis --section SchedulerStats \
          python3 benchmarks/gmm_ncu.py --case "${c%%:*}" --groups "${c##*:}" > "$OUT/ncu_${c%%:*}_${c##*:}.txt" 2>&1 || status=1
        grep -E "device_kernel|Duration|Registers Per|Dynamic Shared|Compute \(SM\) Throughput|Memory Throughput|Achieved Occupancy|Grid Size|Cluster Size" \
          "$OUT/ncu_${c%%:*}_${c##*:}.txt" | cut -c1-160
      done ;;
    ncu-fp8)  # Nsight Compute on gmm_fp8's kernels per path at ncu's base clock, same inputs (benchmarks/gmm_fp8_ncu.py)
      for c in ${NCU_FP8_CASES:-deepseek-v3.ep8.gate_up:uniform}; do
        f="$OUT/ncu_fp8_${c%%:*}_${c##*:}.txt"
        ncu -k regex:"fp8_wgmma_kernel|device_kernel" -c 4 --section SpeedOfLight --section WarpStateStats \
          --section MemoryWorkloadAnalysis python3 benchmarks/gmm_fp8_ncu.py --case "${c%%:*}" --groups "${c##*:}" \
          --paths ${NCU_FP8_PATHS:-auto wgmma128x128} > "$f" 2>&1 || status=1
        grep -E "fp8_wgmma_kernel|device_kernel|gmm_fp8_ncu|Duration|SM Frequency|Compute \(SM\) Throughput|DRAM Throughput|L2 Hit Rate" \
          "$f" | cut -c1-160
      done ;;
    gmm-sustained)  # gmm vs torch._grouped_mm in turns of seconds, with NVML clock and power
      python3 benchmarks/gmm_sustained.py --out "$OUT" ${SUSTAIN_ARGS:-} > "$OUT/gmm_sustained.log" 2>&1 || status=1; tail -16 "$OUT/gmm_sustained.log" ;;
    gmm-trace)
      python3 benchmarks/gmm_trace.py --out "$OUT" ${TRACE_ARGS:-} > "$OUT/gmm_trace.log" 2>&1 || status=1; tail -14 "$OUT/gmm_trace.log" ;;
    bench-moe)
      python3 benchmarks/moe_layer.py --out "$OUT" > "$OUT/bench_moe.log" 2>&1 || status=1; tail -10 "$OUT/bench_moe.log" ;;
    bench-stages)  # kernel time per stage and direction of one moe fwd+bwd step, GB/s of the memory-bound ones (issue 19)
      python3 benchmarks/moe_layer_stages.py --out "$OUT" ${STAGES_ARGS:-} > "$OUT/bench_stages.log" 2>&1 || status=1; tail -100 "$OUT/bench_stages.log" ;;
  esac
done
exit $status
