#!/usr/bin/env bash
# Length robustness: conversion options trained side by side with the same steps and data, then
# every one measured on the same held-out text and needles, with the teacher in the same run.
#
#   GPUS="0 1" bash scripts/length_study.sh WORK_DIR
#   bash scripts/length_study.sh --pack WORK_DIR OUT_DIR [WAIT_SECONDS]   # pack what has finished
#
# Hybrid options (the lolcats recipe: hybrid-output MSE transfer, then LoRA; window 64, all layers):
#   base         as shipped: feature maps on RoPE'd q/k, 1K-token rows
#   offset       + random position offsets 0..OFFSET per training row (positions the model never saw)
#   nope         feature maps on q/k before RoPE (spec linear_rope false)
#   long         4K-token rows (batch 2: the same tokens per step)
#   nope-long    both
#   offset-long  offsets 0..OFFSET_LONG and 4K rows
# The nested DSLA family (dsla-chained recipe; stage 1 with a real budget, then chained fine-tuning):
#   dsla         order by held-out loss increase     dsla-nope    the same without RoPE
#   dsla-recall  dsla-nope ordered by held-out loss + 0.1 x recall-probe increase (the recipe's default)
#   dsla-random  a random order (seeded)             evaluated at ACTIVE (random: 8, 15)
# Each evaluation: held-out wiki perplexity at 1K-8K, niah_single_1 / passkey / needle_recall at
# NEEDLE_LENGTHS; then (ESSAYS=1) essay perplexity (out of domain) at 1K, 4K, 8K.
#
# Environment: DEVICE (cuda)  GPUS ("0")  STEPS (200 per stage)
#   STAGE_MIN (6: wall-time cap per stage)  DSLA_TRANSFER_STEPS (600)  DSLA_TRANSFER_MIN (3)
#   CHAINED_STEPS (20)  CHAINED_MIN (0.2)  OFFSET (7168)  OFFSET_LONG (4096)  SAMPLES (25)
#   VARIANTS (all of the above)  EVAL_BATCH (25)  NEEDLE_LENGTHS (2048,4096)  ACTIVE ("8 15 22 30")
#   ESSAYS (1)  EVAL_KERNEL (auto: DSLA prefixes' kernel; torch needs no kernel compilation)
set -u
if [ "${1:-}" = --pack ]; then  # --pack WORK OUT [WAIT]: wait for DONE (up to WAIT s), then pack at most 7 files
  WORK=${2:?usage: length_study.sh --pack WORK_DIR OUT_DIR [WAIT_SECONDS]}
  out=${3:?usage: length_study.sh --pack WORK_DIR OUT_DIR [WAIT_SECONDS]}; wait_s=${4:-0}; start=$(date +%s)
  while [ ! -f "$WORK/DONE" ] && [ $(( $(date +%s) - start )) -lt "$wait_s" ]; do
    sleep 15
    if [ $(( ($(date +%s) - start) % 120 )) -lt 15 ]; then
      echo "--- $(date +%T)"; tail -n 3 "$WORK/logs/timeline.log" 2>/dev/null
      nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader 2>/dev/null
    fi
  done
  mkdir -p "$out"
  echo "=== timeline"; cat "$WORK/logs/timeline.log" 2>/dev/null
  (cd "$WORK" && tar czf "$out/results.tgz" --exclude='*.pt' --exclude='adapter' --exclude='*.safetensors' eval logs runs 2>/dev/null)
  python - "$WORK" "$out" <<'EOF'
import sys, tarfile
from pathlib import Path
from linearize.api import copy_adapter
work, out = Path(sys.argv[1]), Path(sys.argv[2])
groups, size, group = [], 0, []
for adapter in sorted(work.glob("runs/*/adapter")):
    if not (adapter.parent / "summary.json").is_file():
        continue
    dst = copy_adapter(adapter, work / "pack" / adapter.parent.name)  # bf16 storage, as shipped checkpoints are
    n = sum(f.stat().st_size for f in dst.iterdir())
    if group and size + n > 14e6:
        groups.append(group); group, size = [], 0
    group.append(dst); size += n
if group:
    groups.append(group)
for i, g in enumerate(groups[:6]):  # results.tgz + 6 adapter archives + a log: the 8 files a call brings back
    with tarfile.open(out / f"adapters{i}.tgz", "w:gz") as tar:
        for d in g:
            tar.add(d, arcname=d.name)
    print(f"adapters{i}.tgz:", [d.name for d in g])
if len(groups) > 6:
    print("not packed (file limit):", [d.name for g in groups[6:] for d in g])
EOF
  ls -la "$out"
  exit 0
fi

WORK=${1:?usage: length_study.sh WORK_DIR | --pack WORK_DIR OUT_DIR [WAIT_SECONDS]}
DEVICE=${DEVICE:-cuda}
GPUS=(${GPUS:-0})
STEPS=${STEPS:-200}
STAGE_MIN=${STAGE_MIN:-6}
DSLA_TRANSFER_STEPS=${DSLA_TRANSFER_STEPS:-600}
DSLA_TRANSFER_MIN=${DSLA_TRANSFER_MIN:-3}
CHAINED_STEPS=${CHAINED_STEPS:-20}
CHAINED_MIN=${CHAINED_MIN:-0.2}
OFFSET=${OFFSET:-7168}
OFFSET_LONG=${OFFSET_LONG:-4096}
SAMPLES=${SAMPLES:-25}
EVAL_BATCH=${EVAL_BATCH:-25}
VARIANTS=${VARIANTS:-base offset nope long nope-long offset-long dsla dsla-nope dsla-recall dsla-random}
NEEDLE_LENGTHS=${NEEDLE_LENGTHS:-2048,4096}
ACTIVE=${ACTIVE:-8 15 22 30}
ESSAYS=${ESSAYS:-1}
EVAL_KERNEL=${EVAL_KERNEL:-auto}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
L="python -m linearize.cli -v"
mkdir -p "$WORK/logs" "$WORK/runs" "$WORK/eval"
source "$(dirname "$0")/timeline.sh"  # log, step

variant_flags() {  # the recipe and overrides of one variant
  local long="--data.seq_len=4096 --transfer.optim.batch_size=2 --finetune.optim.batch_size=2"
  local lol="--recipe lolcats --transfer.max_steps=$STEPS --finetune.max_steps=$STEPS --transfer.max_minutes=$STAGE_MIN --finetune.max_minutes=$STAGE_MIN"
  local dsla="--recipe dsla-chained --transfer.max_steps=$DSLA_TRANSFER_STEPS --transfer.max_minutes=$DSLA_TRANSFER_MIN --chained.max_steps=$CHAINED_STEPS --chained.eval_every=$CHAINED_STEPS --chained.max_minutes=$CHAINED_MIN"
  case $1 in
    base) echo "$lol" ;;
    offset) echo "$lol --transfer.position_offset=$OFFSET --finetune.position_offset=$OFFSET" ;;
    nope) echo "$lol --spec.linear_rope=false" ;;
    long) echo "$lol $long" ;;
    nope-long) echo "$lol --spec.linear_rope=false $long" ;;
    offset-long) echo "$lol $long --transfer.position_offset=$OFFSET_LONG --finetune.position_offset=$OFFSET_LONG" ;;
    dsla) echo "$dsla --spec.linear_rope=true --chained.recall_weight=0" ;;
    dsla-nope) echo "$dsla --spec.linear_rope=false --chained.recall_weight=0" ;;
    dsla-recall) echo "$dsla --spec.linear_rope=false --chained.recall_weight=0.1" ;;
    dsla-random) echo "$dsla --chained.order_from=given --chained.order=$(python -c 'import random; o=list(range(30)); random.Random(0).shuffle(o); print("[" + ",".join(map(str, o)) + "]")')" ;;
    *) return 1 ;;
  esac
}

evaluate() {  # evaluate NAME MODEL [flags...]: wiki perplexity + needles, then essay perplexity
  local name=$1 model=$2; shift 2
  local E="--device $DEVICE --mc-tasks none --batch-size $EVAL_BATCH"
  step "eval-$name" $L eval --model "$model" "$@" --suite standard --ppl-lengths 1024,2048,4096,8192 \
    --tasks niah_single_1,passkey,needle_recall --lengths "$NEEDLE_LENGTHS" --samples "$SAMPLES" $E --out "$WORK/eval/$name/wiki"
  [ "$ESSAYS" = 1 ] || return 0
  step "essays-$name" $L eval --model "$model" "$@" --suite standard --ppl-source essays --ppl-lengths 1024,4096,8192 \
    --tasks "" $E --out "$WORK/eval/$name/essays"
}

pipeline() {  # pipeline VARIANT GPU: train, then evaluate
  local v=$1 name=smollm2-135m-$1
  export CUDA_VISIBLE_DEVICES=$2
  step "train-$v" $L train $(variant_flags "$v") --name="$name" --output_dir="$WORK/runs" || return
  local model="$WORK/runs/$name/adapter"
  case $v in
    dsla|dsla-nope|dsla-recall) for k in $ACTIVE; do evaluate "$v-active$k" "$model" --active $k --kernel "$EVAL_KERNEL" & done; wait ;;
    dsla-random) for k in 8 15; do evaluate "$v-active$k" "$model" --active $k --kernel "$EVAL_KERNEL" & done; wait ;;
    *) evaluate "$v" "$model" --kernel torch ;;
  esac
}

log "study start on $DEVICE: ${VARIANTS}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >> "$WORK/logs/timeline.log" 2>&1
step warm python -c "
import linearize
from linearize.data import DataConfig, build_dataset
model, tok = linearize.load_model('smollm2-135m', device='cpu')
for n in (1024, 4096):
    build_dataset(DataConfig(source='wiki', seq_len=n), tok)
"
i=0
for v in $VARIANTS; do
  variant_flags "$v" > /dev/null || { log "unknown variant $v"; continue; }
  pipeline "$v" "${GPUS[$(( i % ${#GPUS[@]} ))]}" &
  i=$((i + 1))
  sleep 3
done
CUDA_VISIBLE_DEVICES=${GPUS[0]} evaluate teacher smollm2-135m &
wait
log "study done"
touch "$WORK/DONE"
