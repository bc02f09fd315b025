#!/usr/bin/env bash
# Restore timings on the lent GPU machine (MLX CUDA) at 8k tokens and beyond: SmolLM2-135M to its
# 8k context, and with RoPE x4 (ntk-by-parts) to 32k (timing only: the restore path does not
# depend on the RoPE frequencies). Run after the staged install (see benchmarks/gpu_niah.sh):
#   bash .gpu/pN/install.sh && export PYTHONPATH=/tmp/site:$PWD && bash benchmarks/gpu_restore.sh [phases|restore|profile|first|next|stacked|ratios|checks|all]
# phases: benchmarks/restore_phases.py (where the time goes); restore: benchmarks/restore.py;
# profile: benchmarks/restore_profile.py (read variants, per-layer attention, decode per compile
# mode); first: benchmarks/first_call.py (fresh processes; the first ones pay MLX's CUDA JIT);
# next: GPU kernel tests + the quick profile; checks: restore.py at 8k, checksums overlapping the
# read or after it, and the 8k phases;
# stacked: kernel tests incl. stacked slices + restore.py at 8k (format 3); ratios: restore.py
# at 8k, 16k, 32k and the 8k phases.
# Logs and JSON go to $OUT (the device tool brings it back).
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
out=${OUT:-benchmarks/results/gpu_out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 MLX_ENABLE_TF32=0 LONGCTX_HOME=/tmp/longctx-home TRANSFORMERS_VERBOSITY=error
long="smollm2#rope=ntk-by-parts:4"
run() {
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  echo "== $name rc=$? $((SECONDS - t0))s"; grep -v "Warn\|metric" "$out/$name.log" | tail -12
}
if [ "$what" = phases ] || [ "$what" = all ]; then
  run restore_phases_gpu 240 python3 benchmarks/restore_phases.py --model "$long" --tokens 8000 32000 \
    --preset tq4 --repeat 4 --name restore_phases_gpu
  cp benchmarks/results/restore_phases_gpu.json "$out/" 2>/dev/null
fi
if [ "$what" = profile ]; then
  run restore_profile_gpu 300 python3 benchmarks/restore_profile.py --model "$long" --tokens 8000 32000 \
    --repeat 4 --name restore_profile_gpu
  cp benchmarks/results/restore_profile_gpu.json "$out/" 2>/dev/null
fi
if [ "$what" = first ]; then
  run first_call_gpu 500 python3 benchmarks/first_call.py --tokens 8000 --runs 2 --name first_call_gpu
  cp benchmarks/results/first_call_gpu.json "$out/" 2>/dev/null
fi
if [ "$what" = next ]; then  # after a kernel or reader change: GPU kernel tests, then 8k timings
  run gpu_tests 280 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py \
    -k "causal_and_strided or (gpu_decode_attend and 8-256) or compiled_path"
  run restore_profile_gpu 150 python3 benchmarks/restore_profile.py --model "$long" --tokens 8000 \
    --repeat 5 --quick --name restore_profile_gpu_next
  cp benchmarks/results/restore_profile_gpu_next.json "$out/" 2>/dev/null
fi
if [ "$what" = stacked ]; then  # after the format-3 change: kernel tests incl. stacked slices, 8k
  run gpu_tests 240 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py \
    -k "stacked or causal_and_strided or compiled_path or fused_attention_end_to_end"
  run mxload_layouts_gpu 60 python3 benchmarks/mxload_layouts.py --name mxload_layouts_gpu
  cp benchmarks/results/mxload_layouts_gpu.json "$out/" 2>/dev/null
  run restore_gpu_8k_v3 300 python3 benchmarks/restore.py --tokens 8000 --presets tq4 tq4k3v \
    --repeat 9 --no-reprefill --name restore_gpu_8k_v3
  cp benchmarks/results/restore_gpu_8k_v3.json "$out/" 2>/dev/null
fi
if [ "$what" = ratios ]; then  # the 2x target at 8k, 16k and 32k, interleaved, plus 8k phases
  run restore_gpu_8k_r6 200 python3 benchmarks/restore.py --tokens 8000 --presets tq4 tq4k3v \
    --repeat 9 --no-reprefill --name restore_gpu_8k_r6
  run restore_phases_gpu_r5 120 python3 benchmarks/restore_phases.py --tokens 8000 --preset tq4 \
    --repeat 5 --name restore_phases_gpu_r5
  run restore_gpu_32k_r4 260 python3 benchmarks/restore.py --model "$long" --tokens 16384 32000 \
    --presets tq4 --repeat 5 --no-reprefill --name restore_gpu_32k_r4
  cp benchmarks/results/restore_gpu_8k_r6.json benchmarks/results/restore_phases_gpu_r5.json \
    benchmarks/results/restore_gpu_32k_r4.json "$out/" 2>/dev/null
fi
if [ "$what" = checks ]; then  # (c) with the checksums overlapping the read, or after it
  run restore_gpu_8k_checks 240 python3 benchmarks/restore.py --tokens 8000 --presets tq4 \
    --repeat 9 --no-reprefill --checks overlap after --name restore_gpu_8k_checks
  run restore_phases_gpu_r6 100 python3 benchmarks/restore_phases.py --tokens 8000 --preset tq4 \
    --repeat 5 --name restore_phases_gpu_r6
  cp benchmarks/results/restore_gpu_8k_checks.json benchmarks/results/restore_phases_gpu_r6.json "$out/" 2>/dev/null
fi
if [ "$what" = restore ] || [ "$what" = all ]; then
  run restore_gpu_8k 200 python3 benchmarks/restore.py --tokens 8000 --presets tq4 tq4k3v tq5k4v \
    --repeat 3 --name restore_gpu_8k
  run restore_gpu_32k 330 python3 benchmarks/restore.py --model "$long" --tokens 16384 32000 \
    --presets tq4 tq4k3v tq5k4v --repeat 3 --name restore_gpu_32k
  cp benchmarks/results/restore_gpu_8k.json benchmarks/results/restore_gpu_32k.json "$out/" 2>/dev/null
fi
