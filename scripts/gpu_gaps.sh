#!/usr/bin/env bash
# Evaluation cells that a full gpu_session.sh run can leave unfinished (its evaluations can run out of
# GPU memory at nine processes per GPU and batch 100), on one H200, with smaller batches:
#   - ssd: the eight "other" synthetic tasks, 50 samples, 1K-8K;
#   - dsla-chained: the component ablation (hybrid, history_only, recent_only, sinks_only, none);
#   - dsla-chained at its usable prefix (--active 10): core tasks (100 samples) + perplexity, other
#     tasks (50 samples), ablation;
#   - LoLA budgets on lolcats: window 128 / 512 + linear at 8K, and the window-only baselines at 100
#     samples;
#   - then, alone on the GPU, the efficiency benchmark at batch 16 and 64 (dsla and hybrid vs the
#     teacher) and at batch 16 (LoLA 64 + 64);
#   - with MC_DATA (the folder of ../shared/data/eval's files; lm-evaluation-harness installed):
#     multiple choice and LAMBADA of dsla-chained --active 10.
# A job that fails is rerun once at half its batch size. Writes $WORK/DONE-gaps at the end.
#   WORK=/root/assets/work bash scripts/gpu_gaps.sh
set -u
WORK=${WORK:-/root/assets/work}
DEVICE=${DEVICE:-cuda}
LENGTHS=1024,2048,4096,8192
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
L="python -m linearize.cli -v"
mkdir -p "$WORK/logs" "$WORK/eval" "$WORK/bench"
log() { echo "[$(date +%T)] $*" | tee -a "$WORK/logs/timeline.log"; }
job() {  # job NAME BATCH COMMAND...: run COMMAND --batch-size BATCH; on failure once more at BATCH / 2
  local name=$1 batch=$2 start rc; shift 2
  start=$(date +%s)
  "$@" --batch-size "$batch" > "$WORK/logs/$name.log" 2>&1
  rc=$?
  log "$name (batch $batch): exit $rc, $(( $(date +%s) - start )) s"
  if [ $rc != 0 ]; then
    start=$(date +%s)
    "$@" --batch-size $(( batch / 2 )) > "$WORK/logs/$name-retry.log" 2>&1
    rc=$?
    log "$name (retry, batch $(( batch / 2 ))): exit $rc, $(( $(date +%s) - start )) s"
  fi
  return $rc
}

log "gaps start on $DEVICE"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >> "$WORK/logs/timeline.log" 2>&1
E="--device $DEVICE --mc-tasks none"
OTHER=niah_multikey_1,niah_multikey_2,niah_multikey_3,niah_multivalue,niah_multiquery,vt,cwe,fwe
CORE=niah_single_1,niah_single_2,niah_single_3,passkey
ABL="--suite quick --tasks niah_single_1,passkey --samples 20 --lengths 1024,2048 --ppl-lengths 1024,2048"

job ssd-other 50 $L eval --model smollm2-135m-ssd --suite full --tasks $OTHER --samples 50 --lengths $LENGTHS \
  --ppl-lengths none $E --out "$WORK/eval/ssd/other" &
job dsla-ablate 50 $L ablate --model smollm2-135m-dsla-chained $ABL $E --out "$WORK/eval/dsla-chained/ablate" &
D10="--model smollm2-135m-dsla-chained --active 10"
job dsla10-core 50 $L eval $D10 --suite full --tasks $CORE --samples 100 --lengths $LENGTHS \
  --ppl-lengths 512,1024,2048,4096,8192 $E --out "$WORK/eval/dsla-active10/core" &
job dsla10-other 50 $L eval $D10 --suite full --tasks $OTHER --samples 50 --lengths $LENGTHS \
  --ppl-lengths none $E --out "$WORK/eval/dsla-active10/other" &
M="--model smollm2-135m-lolcats --attention lola --chunk 64 --kernel torch --sparse-cache 0"
F="$E --suite quick --tasks niah_single_1 --samples 100 --ppl-lengths none"
for w in 128 512; do
  job lola-w$w-hybrid-8k 25 $L ablate $M --window $w --modes hybrid $F --lengths 8192 --out "$WORK/eval/lola/w$w-s0-hybrid-8k" &
  job lola-w$w-window 25 $L ablate $M --window $w --modes window_only $F --lengths $LENGTHS --out "$WORK/eval/lola/w$w-s0-window" &
done
wait
job dsla10-ablate 50 $L ablate $D10 $ABL $E --out "$WORK/eval/dsla-active10/ablate"

# Alone on the GPU: latency ratios need an otherwise idle device.
B="--prefill-lengths 1024,4096,8192 --decode-contexts 1024,4096,8000 --decode-steps 16 --repeats 3 --device $DEVICE"
for batch in 16 64; do
  job bench-dsla-b$batch $batch timeout 200 $L bench --attention dsla $B --out "$WORK/bench/dsla-b$batch"
  job bench-hybrid-b$batch $batch timeout 200 $L bench --attention hybrid $B --out "$WORK/bench/hybrid-b$batch"
done
job bench-lola-b16 16 timeout 240 $L bench --attention lola --window 64 --sparse-cache 64 --chunk 64 $B --out "$WORK/bench/lola-b16"
if [ -n "${MC_DATA:-}" ]; then
  job dsla10-mc 64 $L eval $D10 --suite full --tasks "" --ppl-lengths none \
    --mc-tasks piqa,winogrande,copa,openbook_qa,lambada_openai --data-dir "$MC_DATA" --device $DEVICE --out "$WORK/eval/dsla-active10/mc"
fi
log "gaps done"
touch "$WORK/DONE-gaps"
