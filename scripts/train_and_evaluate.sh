#!/usr/bin/env bash
# Train the shipped recipes and evaluate them beside the teacher, in one run on a GPU box.
#
#   bash scripts/train_and_evaluate.sh WORK_DIR [GPU_COUNT]
#   bash scripts/train_and_evaluate.sh --pack WORK_DIR OUT_DIR [WAIT_SECONDS]
#
# The first form trains every recipe of RECIPES in parallel (spread over the GPUs), and evaluates the
# teacher, each trained conversion as soon as its training ends, and any already-trained adapters
# named in MODELS, all with the same settings:
#   wiki perplexity at PPL_LENGTHS and held-out essays at 1K and 4K; needle tests (RULER niah_single_1
#   and passkey, and needle_recall, a needle in our own wording) at NEEDLE_LENGTHS; the five
#   multiple-choice tasks in full (lm-evaluation-harness, offline data from MC_DATA); the component
#   ablation of each conversion (linear part only, window only); and, on LOLA_MODELS, LoLA read-outs
#   (window 64 + 256 sparse slots, with sinks and linear weights) against a 320-token window.
# Each piece writes its own report under WORK_DIR/eval, so whatever has finished is usable. Logs and
# a timeline go to WORK_DIR/logs. The --pack form waits up to WAIT_SECONDS for the run to end, then
# packs reports, logs and trained adapters into at most seven archives in OUT_DIR.
#
# Environment:
#   RECIPES ("lolcats hedgecats ssd inference-hybrid")  TRAIN_FLAGS (--transfer.epochs=2)
#   FINETUNE_EPOCHS (2: lolcats and inference-hybrid; hedgecats and ssd keep their own schedules)
#   MODELS ("": NAME=ADAPTER_DIR pairs to evaluate too, e.g. "dsla-chained=runs/dsla/adapter")
#   ACTIVE ("8 15 22 30": the prefixes evaluated for a model named dsla-*)
#   SAMPLES (25)  NEEDLE_LENGTHS (1024,2048,4096)  PPL_LENGTHS (512,1024,2048,4096,8192)
#   MC_DATA ("": the folder of the multiple-choice files; empty skips them)  MC_LIMIT (100000: documents per task)
#   LOLA_MODELS ("": NAME=ADAPTER_DIR pairs read with LoLA; "lolcats" means the lolcats trained here)
#   LOLA_SAMPLES (20)  LOLA_LENGTHS (2048,4096)  LOLA_SINKS ("0 4")  LOLA_WEIGHTS ("1 0.1 0.01")
#   LOLA_CHUNK (64)  LOLA_BASELINE (1: also the 320-token window)
#   PARTS ("wiki essays mc": which evaluations run)  ABLATE (1: the component ablation of each conversion)
#   MAX_PER_GPU (6: evaluation processes at once per GPU)  DEVICE (cuda)
set -u
if [ "${1:-}" = --pack ]; then
  work=$2 out=$3 wait_s=${4:-0}
  end=$(( $(date +%s) + wait_s ))
  while [ ! -e "$work/DONE" ] && [ "$(date +%s)" -lt "$end" ]; do sleep 5; done
  [ -e "$work/DONE" ] && echo "run finished" || echo "run still going; packing what has finished"
  mkdir -p "$out"
  tar czf "$out/eval.tgz" -C "$work" eval 2> /dev/null
  tar czf "$out/logs.tgz" -C "$work" logs $(cd "$work" && ls -d runs/*/summary.json runs/*/metrics.jsonl runs/*/config.yaml 2> /dev/null)
  i=0
  for run in "$work"/runs/*/adapter; do
    [ -d "$run" ] || continue
    name=$(basename "$(dirname "$run")")
    tar czf "$out/adapter$i.tgz" -C "$work/runs" "$name/adapter" "$name/summary.json" 2> /dev/null
    i=$((i + 1)); [ "$i" -ge 5 ] && break
  done
  tail -n 40 "$work/logs/timeline.log"
  exit 0
fi

WORK=${1:?usage: train_and_evaluate.sh WORK_DIR [GPU_COUNT] | --pack WORK_DIR OUT_DIR [WAIT_SECONDS]}
N_GPUS=${2:-1}
RECIPES=${RECIPES-lolcats hedgecats ssd inference-hybrid}
TRAIN_FLAGS=${TRAIN_FLAGS---transfer.epochs=2}
FINETUNE_EPOCHS=${FINETUNE_EPOCHS:-2}
MODELS=${MODELS:-}
ACTIVE=${ACTIVE:-8 15 22 30}
SAMPLES=${SAMPLES:-25}
NEEDLE_LENGTHS=${NEEDLE_LENGTHS:-1024,2048,4096}
PPL_LENGTHS=${PPL_LENGTHS:-512,1024,2048,4096,8192}
MC_DATA=${MC_DATA:-}
LOLA_MODELS=${LOLA_MODELS:-}
LOLA_SAMPLES=${LOLA_SAMPLES:-20}
LOLA_LENGTHS=${LOLA_LENGTHS:-2048,4096}
LOLA_SINKS=${LOLA_SINKS:-0 4}
LOLA_WEIGHTS=${LOLA_WEIGHTS:-1 0.1 0.01}
LOLA_CHUNK=${LOLA_CHUNK:-64}
LOLA_BASELINE=${LOLA_BASELINE:-1}
PARTS=${PARTS-wiki essays mc}
MC_LIMIT=${MC_LIMIT:-100000}
ABLATE=${ABLATE:-1}
MAX_PER_GPU=${MAX_PER_GPU:-6}
DEVICE=${DEVICE:-cuda}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
L="python -m linearize.cli -v"
mkdir -p "$WORK/logs" "$WORK/runs" "$WORK/eval" "$WORK/locks"
rm -f "$WORK/DONE"
source "$(dirname "$0")/timeline.sh"  # log, step
next=0
pick() { G=$(( next % N_GPUS )); next=$(( next + 1 )); }  # G: the next GPU, round-robin
on() {  # on GPU COMMAND...: run with only that GPU visible once one of its MAX_PER_GPU slots is free
  local index=$1 k fd rc; shift
  while :; do
    for k in $(seq 1 "$MAX_PER_GPU"); do
      exec {fd}> "$WORK/locks/gpu$index-slot$k"
      if flock -n "$fd"; then
        CUDA_VISIBLE_DEVICES=$index "$@"; rc=$?
        exec {fd}>&-
        return $rc
      fi
      exec {fd}>&-
    done
    sleep 3
  done
}

want() { case " $PARTS " in *" $1 "*) true ;; *) false ;; esac; }  # want PART: is PART in PARTS

evaluate() {  # evaluate NAME MODEL GPU [flags...]: perplexity + needles, essays, multiple choice
  local name=$1 model=$2 g=$3; shift 3
  local E="--device $DEVICE --suite standard"
  want wiki &&
  step "eval-$name-wiki" on "$g" $L eval --model "$model" "$@" $E --ppl-lengths "$PPL_LENGTHS" \
    --tasks niah_single_1,passkey,needle_recall --lengths "$NEEDLE_LENGTHS" --samples "$SAMPLES" --batch-size "$SAMPLES" \
    --mc-tasks none --out "$WORK/eval/$name/wiki" &
  want essays &&
  step "eval-$name-essays" on "$g" $L eval --model "$model" "$@" $E --ppl-source essays --ppl-lengths 1024,4096 \
    --tasks "" --mc-tasks none --batch-size 8 --out "$WORK/eval/$name/essays" &
  if [ -n "$MC_DATA" ] && want mc; then
    step "eval-$name-mc" on "$g" $L eval --model "$model" "$@" $E --ppl-lengths none --tasks "" \
      --mc-tasks piqa,winogrande,copa,openbook_qa,lambada_openai --data-dir "$MC_DATA" --batch-size 64 --mc-limit "$MC_LIMIT" \
      --out "$WORK/eval/$name/mc" &
  fi
  wait
}

ablate() {  # ablate NAME MODEL GPU [flags...]: each component alone against the whole
  local name=$1 model=$2 g=$3; shift 3
  [ "$ABLATE" = 1 ] || return 0
  step "ablate-$name" on "$g" $L ablate --model "$model" "$@" --device "$DEVICE" --suite standard \
    --tasks niah_single_1,passkey --samples 20 --lengths 1024,2048 --ppl-lengths 1024,2048 --mc-tasks none \
    --batch-size 20 --out "$WORK/eval/$name/ablate"
}

lola() {  # lola NAME MODEL GPU: LoLA (64 + 256) read-outs against the same 320 slots as a window
  local name=$1 model=$2 g=$3 sinks weight
  local F="--device $DEVICE --suite standard --tasks niah_single_1,passkey,needle_recall --samples $LOLA_SAMPLES
    --lengths $LOLA_LENGTHS --ppl-lengths none --mc-tasks none --batch-size $LOLA_SAMPLES --kernel torch --chunk $LOLA_CHUNK"
  for sinks in $LOLA_SINKS; do
    for weight in $LOLA_WEIGHTS; do
      local modes=hybrid; [ "$weight" = 1 ] && modes=hybrid,no_state
      step "lola-$name-s$sinks-w$weight-c$LOLA_CHUNK" on "$g" $L ablate --model "$model" --attention lola --window 64 --sparse-cache 256 \
        --sinks $sinks --linear-weight $weight --modes $modes $F --out "$WORK/eval/lola-$name/sinks$sinks-weight$weight-chunk$LOLA_CHUNK" &
    done
  done
  [ "$LOLA_BASELINE" = 1 ] && step "lola-$name-window320" on "$g" $L ablate --model "$model" --attention lola --window 320 --sparse-cache 0 \
    --modes hybrid,window_only $F --out "$WORK/eval/lola-$name/window320" &
  wait
}

train_then_evaluate() {  # RECIPE GPU
  local recipe=$1 g=$2 extra=$TRAIN_FLAGS
  case $recipe in lolcats|inference-hybrid) extra="$extra --finetune.epochs=$FINETUNE_EPOCHS" ;; esac
  CUDA_VISIBLE_DEVICES=$g step "train-$recipe" $L train --recipe "$recipe" --output_dir="$WORK/runs" $extra || return
  local adapter="$WORK/runs/smollm2-135m-$recipe/adapter"
  evaluate "$recipe" "$adapter" "$g" --kernel torch &
  ablate "$recipe" "$adapter" "$g" --kernel torch &
  case " $LOLA_MODELS " in *" $recipe "*) lola "$recipe" "$adapter" "$g" & ;; esac
  wait
}

log "start: $N_GPUS GPU(s) on $DEVICE; recipes: $RECIPES; models: ${MODELS:-none}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >> "$WORK/logs/timeline.log" 2>&1
step data python -c "
import linearize
from linearize.data import DataConfig, build_dataset
model, tok = linearize.load_model('smollm2-135m', device='cpu')
build_dataset(DataConfig(source='wiki', seq_len=1024), tok)
"
for recipe in $RECIPES; do pick; train_then_evaluate "$recipe" "$G" & done
pick; evaluate teacher smollm2-135m "$G" &
for pair in $MODELS; do
  name=${pair%%=*} model=${pair#*=}
  case $name in
    dsla*) for k in $ACTIVE; do pick; evaluate "$name-active$k" "$model" "$G" --active "$k" --kernel torch & done ;;
    *) pick; evaluate "$name" "$model" "$G" --kernel torch & ablate "$name" "$model" "$G" --kernel torch & ;;
  esac
done
for pair in $LOLA_MODELS; do
  [ "$pair" = lolcats ] && continue  # after its training
  pick; lola "${pair%%=*}" "${pair#*=}" "$G" &
done
wait
log "done"
touch "$WORK/DONE"
