#!/usr/bin/env bash
# The command run on the lent GPU machine, after the staged MLX CUDA install:
#   bash .gpu/pN/install.sh && export PYTHONPATH=/tmp/site:$PWD && bash benchmarks/gpu_run.sh [tests|bench|all]
# tests: the kernel tests (+ the kvcache tests, whose attention now takes the fused path on a GPU)
#        in parallel workers, then benchmarks/kernels.py;
# bench: benchmarks/attend.py, then an ncu profile of the fused kernel at 128k.
# Everything it keeps goes to $OUT (the device tool brings that folder back), named
# gpu_tests_<tag>.txt, kernels_<tag>.json, attend_<tag>.json, ncu_decode_attend_<tag>.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
phase=${1:-all}
tag=${GPU_TAG:-h200}
out=${OUT:-benchmarks/results/gpu_out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
# Full fp32 matmuls: the test oracles need them, and longctx.quant.rotation's orthonormality check
# of mx.hadamard_transform (a matmul) fails under MLX's default TF32 on this GPU.
export MLX_ENABLE_TF32=0

{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
  python3 -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device(), 'cuda', mx.cuda.is_available())"
  python3 -c "import longctx.kernels as k; print('longctx.kernels backend:', k.backend())"
} 2>&1 | tee -a "$out/env_$tag.txt"

if [ "$phase" = tests ] || [ "$phase" = all ]; then
  workers=""
  python3 -c "import xdist" 2> /dev/null && workers="-n 12"
  timeout 330 python3 -m pytest -q -rfEs -p no:cacheprovider $workers \
    tests/test_kernels.py tests/test_kvcache.py 2>&1 | tee "$out/gpu_tests_$tag.txt" | tail -40
  timeout 100 python3 benchmarks/kernels.py --max-log2 22 --name "kernels_$tag" > "$out/kernels_$tag.log" 2>&1
  tail -12 "$out/kernels_$tag.log"
  cp benchmarks/results/kernels_$tag.json "$out/" 2>/dev/null
fi

if [ "$phase" = bench ] || [ "$phase" = all ]; then
  timeout 330 python3 benchmarks/attend.py --name "attend_$tag" > "$out/attend_$tag.log" 2>&1
  grep -E "^\|" "$out/attend_$tag.log" | head -120
  tail -3 "$out/attend_$tag.log"
  cp benchmarks/results/attend_$tag.json "$out/" 2>/dev/null
  if command -v ncu > /dev/null; then
    timeout 150 ncu --clock-control none --kernel-name regex:lc_decode_attend --launch-skip 3 \
      --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis \
      --section ComputeWorkloadAnalysis --section Occupancy --section LaunchStats \
      --section WarpStateStats --section SchedulerStats --section InstructionStats \
      python3 benchmarks/attend.py --profile --lengths 131072 > "$out/ncu_decode_attend_$tag.txt" 2>&1
    grep -E "Duration|Memory Throughput|DRAM Throughput|Compute \(SM\)|Achieved Occupancy|Registers Per|Executed Ipc|Issue Slots|Stall" \
      "$out/ncu_decode_attend_$tag.txt" | head -30
  fi
fi
