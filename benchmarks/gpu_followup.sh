#!/usr/bin/env bash
# Follow-up GPU call: restore timings with the current answering path (own decode loop), the
# RoPE-scaled SmolLM2 NIAH phase with a budget that covers its grid, and the depth-100% row the
# full SmolLM2 grid ran out of time for. About 8 minutes. Stage and install as gpu_niah.sh says.
set -uo pipefail
cd "$(dirname "$0")/.."
final=${OUT:-benchmarks/results/gpu_out}
out=/tmp/gpu_followup  # everything comes back as one tarball ($OUT returns at most 8 files)
mkdir -p "$out" "$final"
export PYTHONUNBUFFERED=1 MLX_ENABLE_TF32=0 LONGCTX_HOME=/tmp/longctx-home TRANSFORMERS_VERBOSITY=error
t0=$SECONDS
timeout 170 python3 benchmarks/restore.py --tokens 1024 4096 8000 --presets fp16 tq4 tq4k3v tq3 \
  --repeat 3 --name restore_gpu > "$out/restore_gpu.log" 2>&1
echo "restore rc=$? $((SECONDS - t0))s"; grep -v Token "$out/restore_gpu.log" | tail -16
cp benchmarks/results/restore_gpu.json "$out/" 2>/dev/null
t1=$SECONDS
timeout 280 python3 benchmarks/niah.py --budget-s 240 --out "$out" --kv fp16,tq4 --model smollm2 \
  --rope-scale 2 --lengths 8k,12k,16k --depths 10,50,90 > "$out/niah_gpu_rope.log" 2>&1
echo "rope rc=$? $((SECONDS - t1))s"; grep -E "score|^wrote" "$out/niah_gpu_rope.log" | tail -4
t2=$SECONDS
timeout 130 python3 benchmarks/niah.py --budget-s 100 --out "$out" --kv fp16,tq4,tq4k3v,tq3 --model smollm2 \
  --lengths 1k,2k,4k,8k --depths 100 --label d100 > "$out/niah_gpu_d100.log" 2>&1
echo "d100 rc=$? $((SECONDS - t2))s"; grep -E "score|^wrote" "$out/niah_gpu_d100.log" | tail -6
tar czf "$final/gpu_followup.tgz" -C "$out" . && ls -la "$out"
