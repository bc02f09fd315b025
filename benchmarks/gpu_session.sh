#!/usr/bin/env bash
# The product benchmarks on the lent GPU (MLX CUDA), in one call, after the staged install:
#   bash .gpu/pN/install.sh && export PYTHONPATH=/tmp/site:$PWD && bash benchmarks/gpu_session.sh
# attend (decode step, kernel vs SDPA), prefill tok/s + peak memory, KV quality at ~8k tokens,
# restore vs re-prefill vs mlx-lm prompt cache, NIAH if its script exists. Logs and results are
# packed into $OUT/gpu_results.tgz (the device tool returns at most 8 files).
set -uo pipefail
cd "$(dirname "$0")/.."
final=${OUT:-benchmarks/results/gpu_out}
out=/tmp/gpu_session_out
mkdir -p "$out" "$final"
export PYTHONUNBUFFERED=1 MLX_ENABLE_TF32=0 LONGCTX_HOME=/tmp/longctx-home
run() {  # name, timeout, command...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  echo "== $name rc=$? $((SECONDS - t0))s"; grep -v "^\s*\(prefill\|answer\) metric" "$out/$name.log" | tail -14
}
python3 -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device())"
run smoke 90 python3 -c "import longctx, time; from longctx import session; t=time.time(); e=session.ingest('samples/report.pdf').entry; print(e.kv_preset, e.tokens, 'ingest', round(time.time()-t,1)); print(''.join(session.ask('Who is the chief engineer of the cooperative?', max_tokens=24)))"
run attend 120 python3 benchmarks/attend.py --no-sweep --name attend_h200
run prefill 90 python3 benchmarks/prefill.py --tokens 1024 4096 8000 --kv fp16 tq4 --name prefill_gpu
run kv_quality 120 python3 benchmarks/kv_quality.py --tokens 7936 --answer 256 --name kv_quality_gpu_7936
run restore 120 python3 benchmarks/restore.py --tokens 1024 4096 8000 --presets fp16 tq4 tq4k3v tq3 --name restore_gpu
cp benchmarks/results/*_h200.json benchmarks/results/*_gpu*.json benchmarks/results/niah_* "$out/" 2>/dev/null
tar czf "$final/gpu_results.tgz" -C "$out" .
ls -la "$out"
