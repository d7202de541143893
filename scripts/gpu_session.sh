#!/usr/bin/env bash
# A whole GPU job, started detached so that it outlives the shell that starts it:
#   setsid nohup bash scripts/gpu_session.sh > "$WORK/driver.log" 2>&1 < /dev/null &
# then, in later calls, `bash scripts/gpu_pack.sh` copies what has finished into $OUT.
#
# Order: the efficiency benchmarks alone on the idle GPU (timings need it), then dsla-chained alone
# for HEAD_START seconds (fla's Triton autotuning runs uncontended and is cached on disk for the
# later processes), then every other recipe in parallel (each a wall-time budget per stage; the
# transfer objectives are checkpointed per layer, so five runs fit in one GPU's memory), the
# teacher's evaluation beside them if asked, and each conversion's evaluation as soon as its
# training ends (core synthetic tasks + perplexity first, then ablations, then the other synthetic
# tasks; LoLA budgets on the lolcats conversion).
# Every piece writes its own report, so whatever has finished when the machine is taken back comes back.
#
# Environment (defaults are the real run; the CPU dry run sets small values):
#   WORK (/root/assets/work)  DEVICE (cuda)  TRANSFER_MIN (3)  FINETUNE_MIN (3)  CHAINED_MIN (0.15)
#   DSLA_TRANSFER_MIN (2)  HEAD_START (60: seconds dsla-chained trains alone)
#   CORE_SAMPLES (100)  OTHER_SAMPLES (50)  ABLATE_SAMPLES (20)  LOLA_SAMPLES (50)  LENGTHS (1024,2048,4096,8192)
#   PPL_LENGTHS (512,1024,2048,4096,8192)  ABLATE_LENGTHS (1024,2048)
#   EVAL_BATCH (100: prompts per generate call; the converted models' decoding is host-bound, so one
#   call per task and length is ~4x faster than batches of 32, and their state is small)
#   TRAIN (1: train, then evaluate the run; 0: evaluate the shipped conversions smollm2-135m-RECIPE)
#   WARM_FLA (1: before anything else, one DSLA training step alone, so fla's Triton autotuning of the
#   forward and backward kernels runs uncontended and lands in the on-disk autotune cache)
#   TRAIN_EXTRA (--transfer.epochs=4 --transfer.max_steps=2000: the time budget decides)
#   LONG_FINETUNE (--finetune.epochs=2 --finetune.max_steps=2000, for lolcats and inference-hybrid)
#   BENCH (dsla lola: attention kinds benchmarked against the teacher; empty: none)
#   BENCH_PREFILL (1024,4096,8192)  BENCH_DECODE (1024,4096,8000: + decode steps <= 8192)
#   TEACHER (0: 1 evaluates the teacher too)  TAG (1: the driver touches WORK/DONE-TAG when it ends)
#   RECIPES (lolcats hedgecats ssd inference-hybrid: trained in parallel after the head start)
#   FIRST_RECIPE (dsla-chained: trained first, alone for HEAD_START seconds; empty: none)
#   GPUS (0: the GPU indices evaluations are spread over, round-robin, e.g. "0 1" on nvidia-h200-x2)
#   MAX_PER_GPU (6: processes at once per GPU; more wait for a slot. At ~9 per GPU,
#   batch 100 and 8K, and 11 of 29 evaluations ran out of GPU memory)
#   PROBE (0: 1 runs the CUDA-vs-CPU tests and scripts/gpu_probe.py first)
#   DDP (0: 1 runs scripts/gpu_ddp.sh, the 2-GPU vs 1-GPU lolcats check, before the benchmarks)
#   MC_DATA (empty: the folder of the multiple-choice data files; each model then also runs PIQA,
#   WinoGrande, COPA, OpenBookQA and LAMBADA in full through lm-evaluation-harness)
set -u
WORK=${WORK:-/root/assets/work}
DEVICE=${DEVICE:-cuda}
TRANSFER_MIN=${TRANSFER_MIN:-3}
FINETUNE_MIN=${FINETUNE_MIN:-3}
CHAINED_MIN=${CHAINED_MIN:-0.15}
CORE_SAMPLES=${CORE_SAMPLES:-100}
OTHER_SAMPLES=${OTHER_SAMPLES:-50}
ABLATE_SAMPLES=${ABLATE_SAMPLES:-20}
LOLA_SAMPLES=${LOLA_SAMPLES:-50}
LENGTHS=${LENGTHS:-1024,2048,4096,8192}
PPL_LENGTHS=${PPL_LENGTHS:-512,1024,2048,4096,8192}
ABLATE_LENGTHS=${ABLATE_LENGTHS:-1024,2048}
BENCH=${BENCH-dsla lola}
EVAL_BATCH=${EVAL_BATCH:-100}
TRAIN=${TRAIN:-1}
WARM_FLA=${WARM_FLA:-1}
HEAD_START=${HEAD_START:-60}
DSLA_TRANSFER_MIN=${DSLA_TRANSFER_MIN:-2}
TRAIN_EXTRA=${TRAIN_EXTRA---transfer.epochs=4 --transfer.max_steps=2000}
LONG_FINETUNE=${LONG_FINETUNE---finetune.epochs=2 --finetune.max_steps=2000}
RECIPES=${RECIPES-lolcats hedgecats ssd inference-hybrid}
FIRST_RECIPE=${FIRST_RECIPE-dsla-chained}
GPUS=(${GPUS:-0})
MAX_PER_GPU=${MAX_PER_GPU:-6}
PROBE=${PROBE:-0}
DDP=${DDP:-0}
CORE_TASKS=niah_single_1,niah_single_2,niah_single_3,passkey,needle_recall
OTHER_TASKS=niah_multikey_1,niah_multikey_2,niah_multikey_3,niah_multivalue,niah_multiquery,vt,cwe,fwe
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
L="python -m linearize.cli -v"
mkdir -p "$WORK/logs" "$WORK/runs" "$WORK/eval" "$WORK/bench"
log() { echo "[$(date +%T)] $*" | tee -a "$WORK/logs/timeline.log"; }
step() {  # step NAME COMMAND...: run, log its wall time and exit code
  local name=$1; shift
  local start=$(date +%s)
  "$@" > "$WORK/logs/$name.log" 2>&1
  local rc=$?
  log "$name: exit $rc, $(( $(date +%s) - start )) s"
  return $rc
}

log "driver start on $DEVICE"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >> "$WORK/logs/timeline.log" 2>&1
slot=0
gpu() {  # gpu: the next GPU index of GPUS, round-robin
  echo "${GPUS[$(( slot % ${#GPUS[@]} ))]}"
}
on() {  # on INDEX COMMAND...: run COMMAND with only that GPU visible, once one of its MAX_PER_GPU slots is free
  local index=$1 k fd rc; shift
  command -v flock > /dev/null || { CUDA_VISIBLE_DEVICES=$index "$@"; return; }
  mkdir -p "$WORK/locks"
  while :; do
    for k in $(seq 1 "$MAX_PER_GPU"); do
      exec {fd}> "$WORK/locks/gpu$index-slot$k"
      if flock -n "$fd"; then
        CUDA_VISIBLE_DEVICES=$index "$@"
        rc=$?
        exec {fd}>&-
        return $rc
      fi
      exec {fd}>&-
    done
    sleep 5
  done
}

if [ "$PROBE" = 1 ] && [ "$DEVICE" = cuda ]; then
  step probe-tests on "${GPUS[0]}" timeout 180 python -m pytest -q -rs tests/test_cuda_model.py &
  step probe on "${GPUS[$(( 1 % ${#GPUS[@]} ))]}" timeout 240 python scripts/gpu_probe.py &
fi
step warm python -c "
import linearize
from linearize.data import DataConfig, build_dataset
model, tok = linearize.load_model('smollm2-135m', device='cpu')
build_dataset(DataConfig(source='wiki', seq_len=1024), tok)
build_dataset(DataConfig(source='wiki', seq_len=64), tok)
"

if [ "$WARM_FLA" = 1 ] && [ "$DEVICE" = cuda ]; then
  step warm-fla $L train --recipe dsla-chained --output_dir="$WORK/warm" --transfer.max_steps=2 --transfer.eval_every=1000 \
    --chained.enabled=false --data.max_train_sequences=16
fi
wait
if [ "$DDP" = 1 ]; then
  step ddp env WORK="$WORK" bash scripts/gpu_ddp.sh
fi
B="--prefill-lengths ${BENCH_PREFILL:-1024,4096,8192} --decode-contexts ${BENCH_DECODE:-1024,4096,8000} --decode-steps 16 --repeats 3 --device $DEVICE"
# Alone on their GPUs (one kind per GPU, in parallel when there are several): latency ratios need
# an otherwise idle device.
for kind in $BENCH; do
  g=$(gpu); slot=$((slot + 1))
  case $kind in
    hybrid) step bench-hybrid on "$g" timeout "${BENCH_TIMEOUT:-150}" $L bench --attention hybrid --window 64 $B --out "$WORK/bench/hybrid" ;;
    dsla) step bench-dsla on "$g" timeout "${BENCH_TIMEOUT:-150}" $L bench --attention dsla $B --out "$WORK/bench/dsla" ;;
    lola) step bench-lola on "$g" timeout "${BENCH_TIMEOUT:-150}" $L bench --attention lola --window 64 --sparse-cache 64 --chunk 64 $B --out "$WORK/bench/lola" ;;
    *) log "unknown BENCH kind $kind (valid: hybrid dsla lola)" ;;
  esac &
  [ "${#GPUS[@]}" -gt 1 ] || wait
done
wait
slot=0

evaluate() {  # evaluate NAME MODEL [spec flags...]: core then ablations, beside the other tasks (decoding is host-bound)
  local name=$1 model=$2; shift 2
  local E="--device $DEVICE --mc-tasks none --batch-size $EVAL_BATCH"
  local g=$(gpu)
  {
    step "eval-$name-core" on "$g" $L eval --model "$model" "$@" --suite full --tasks $CORE_TASKS --samples "$CORE_SAMPLES" \
      --lengths "$LENGTHS" --ppl-lengths "$PPL_LENGTHS" $E --out "$WORK/eval/$name/core"
    if [ "$name" != teacher ]; then
      step "ablate-$name" on "$g" $L ablate --model "$model" "$@" --suite quick --tasks niah_single_1,passkey --samples "$ABLATE_SAMPLES" \
        --lengths "$ABLATE_LENGTHS" --ppl-lengths "$ABLATE_LENGTHS" $E --out "$WORK/eval/$name/ablate"
    fi
  } &
  step "eval-$name-other" on "$g" $L eval --model "$model" "$@" --suite full --tasks $OTHER_TASKS --samples "$OTHER_SAMPLES" \
    --lengths "$LENGTHS" --ppl-lengths none $E --out "$WORK/eval/$name/other"
  if [ -n "${MC_DATA:-}" ]; then
    step "eval-$name-mc" on "$g" $L eval --model "$model" "$@" --suite full --tasks "" --ppl-lengths none \
      --mc-tasks piqa,winogrande,copa,openbook_qa,lambada_openai --data-dir "$MC_DATA" --device $DEVICE --batch-size 64 \
      --out "$WORK/eval/$name/mc"
  fi
  wait
}

lola_budgets() {  # LoLA (w, s) vs the same 2w explicit slots without the sparse cache: window 2w + linear state, and window only
  local model=$1
  local F="--device $DEVICE --mc-tasks none --batch-size $EVAL_BATCH --suite quick --tasks niah_single_1 --samples $LOLA_SAMPLES --lengths $LENGTHS --ppl-lengths none"
  for ws in 64 256 512; do  # six processes in parallel, spread over the GPUs
    step "lola-$ws-$ws" on "$(gpu)" $L ablate --model "$model" --attention lola --window $ws --sparse-cache $ws --chunk 64 --kernel torch \
      --modes hybrid $F --out "$WORK/eval/lola/w$ws-s$ws" &
    slot=$((slot + 1))
    step "lola-$((2 * ws))-0" on "$(gpu)" $L ablate --model "$model" --attention lola --window $((2 * ws)) --sparse-cache 0 --chunk 64 --kernel torch \
      --modes hybrid,window_only $F --out "$WORK/eval/lola/w$((2 * ws))-s0" &
    slot=$((slot + 1))
  done
  wait
}

pipeline() {  # pipeline RECIPE: train, then evaluate the trained conversion (TRAIN=0: the shipped one)
  local recipe=$1 name=smollm2-135m-$1
  local model=$name
  [ "$TRAIN" = 1 ] && { train "$recipe" || return; model="$WORK/runs/$name/adapter"; }
  local kernel=torch
  [ "$recipe" = dsla-chained ] && kernel=auto  # DSLA's torch kernel is memory-hungry at 8K: fla
  if [ "$recipe" = lolcats ]; then lola_budgets "$model" & fi  # beside its evaluation: decoding is host-bound
  evaluate "$name" "$model" --kernel $kernel
  wait
}

train() {  # train RECIPE: the recipe with this job's time budgets (dsla-chained: torch fallback)
  local recipe=$1
  local transfer_min=$TRANSFER_MIN extra=$TRAIN_EXTRA
  case $recipe in
    lolcats|inference-hybrid) extra="$extra $LONG_FINETUNE" ;;  # hedgecats: one early-stopped epoch; ssd: its 5-epoch schedule
    dsla-chained) transfer_min=$DSLA_TRANSFER_MIN ;;  # leaves time for the 30 chained steps
  esac
  local budget="--transfer.max_minutes=$transfer_min --finetune.max_minutes=$FINETUNE_MIN --chained.max_minutes=$CHAINED_MIN"
  if ! step "train-$recipe" $L train --recipe "$recipe" --output_dir="$WORK/runs" $budget $extra; then
    [ "$recipe" = dsla-chained ] || return
    # fallback if fla's chunk_gla fails here: the exact torch kernel, in less memory
    step "train-$recipe-torch" $L train --recipe "$recipe" --output_dir="$WORK/runs" $budget $extra \
      --spec.kernel=torch --spec.chunk=8 --transfer.optim.batch_size=4 --chained.optim.batch_size=4
  fi
}

if [ -n "$FIRST_RECIPE" ]; then
  pipeline "$FIRST_RECIPE" &
  slot=$((slot + 1))
  sleep "$HEAD_START"
fi
for recipe in $RECIPES; do
  pipeline "$recipe" &
  slot=$((slot + 1))
  sleep 2
done
[ "${TEACHER:-0}" = 1 ] && evaluate teacher smollm2-135m &
wait
log "driver done"
touch "$WORK/DONE-${TAG:-1}"
