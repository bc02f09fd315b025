#!/usr/bin/env bash
# Second GPU call of a session: KV quality at ~8k tokens, restore timings, then NIAH with what is
# left of the call. Results packed into $OUT/gpu_results2.tgz; NIAH writes its own files to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
final=${OUT:-benchmarks/results/gpu_out}
out=/tmp/gpu_final_out
mkdir -p "$out" "$final"
export PYTHONUNBUFFERED=1 MLX_ENABLE_TF32=0 LONGCTX_HOME=/tmp/longctx-home TRANSFORMERS_VERBOSITY=error
run() {
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  echo "== $name rc=$? $((SECONDS - t0))s"; grep -v "metric" "$out/$name.log" | tail -14
}
run kv_quality 110 python3 benchmarks/kv_quality.py --tokens 7936 --answer 256 --name kv_quality_gpu_7936
run restore 100 python3 benchmarks/restore.py --tokens 1024 4096 8000 --presets fp16 tq4 tq4k3v tq3 --repeat 2 --name restore_gpu
cp benchmarks/results/kv_quality_gpu_7936.json benchmarks/results/restore_gpu.json "$out/" 2>/dev/null
tar czf "$final/gpu_results2.tgz" -C "$out" .
NIAH_BUDGET_S=${NIAH_BUDGET_S:-300} OUT="$final" bash benchmarks/gpu_niah.sh 2>&1 | tail -30
