#!/usr/bin/env bash
# LoLA with its memory in the training loop, from a trained hybrid and its calibrated read-out:
# LoRA fine-tuning (next-token loss) through LoLA's three memories (window, sparse cache kept by
# self-recall error, linear state) on long documents, then retrieval of the starting read-out, the
# fine-tuned one and a window of the same slots, side by side.
#
#   bash scripts/lola_in_the_loop.sh train WORK_DIR     # fine-tune (WORK_DIR/runs/NAME/adapter)
#   bash scripts/lola_in_the_loop.sh eval WORK_DIR OUT  # evaluate start, fine-tuned and window-only
#
# The starting read-out is MODEL read as LoLA (window 64 + SLOTS slots, SINKS sinks, chunk 64) with
# the per-head linear-term weights of CALIBRATION (a calibration.json of `linearize calibrate`).
# Environment: MODEL (smollm2-135m-lolcats)
#   CALIBRATION (docs/results/evaluation/lola/readout/lolcats/cal-chained-2048-heldout/calibration.json)
#   SLOTS (256)  SINKS (4)  SOURCE (pysource)  SEQ_LEN (4096)  BATCH (4)  MINUTES (4: training wall time)
#   LR (1e-4)  RANK (8)  NEW_PARAMS (true: feature maps and window factors train too)  NAME (lola-loop)
#   DEVICE (cuda)  SAMPLES (25)  LENGTHS (2048,4096)  PPL_LENGTHS (1024,4096)  EXTRA (more train overrides)
set -u
CMD=${1:?usage: lola_in_the_loop.sh train|eval WORK_DIR [OUT]}
WORK=${2:?usage: lola_in_the_loop.sh train|eval WORK_DIR [OUT]}
MODEL=${MODEL:-smollm2-135m-lolcats}
CALIBRATION=${CALIBRATION:-docs/results/evaluation/lola/readout/lolcats/cal-chained-2048-heldout/calibration.json}
SLOTS=${SLOTS:-256}; SINKS=${SINKS:-4}; SOURCE=${SOURCE:-pysource}; SEQ_LEN=${SEQ_LEN:-4096}; BATCH=${BATCH:-4}
MINUTES=${MINUTES:-4}; LR=${LR:-1e-4}; RANK=${RANK:-8}; NEW_PARAMS=${NEW_PARAMS:-true}; NAME=${NAME:-lola-loop}
DEVICE=${DEVICE:-cuda}; SAMPLES=${SAMPLES:-25}; LENGTHS=${LENGTHS:-2048,4096}; PPL_LENGTHS=${PPL_LENGTHS:-1024,4096}
EXTRA=${EXTRA:-}
L="python -m linearize.cli"
mkdir -p "$WORK"
log() { echo "[$(date +%T)] $*" | tee -a "$WORK/timeline.log"; }

# The starting spec: LoLA over the hybrid's layers, each head's linear-term weight from the calibration.
python - "$CALIBRATION" "$WORK/start_spec.json" "$WORK/window_spec.json" "$SLOTS" "$SINKS" <<'EOF'
import json, sys
cal, start, window, slots, sinks = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
weights = json.load(open(cal))["weights"]
base = {"attention": "lola", "layers": "all", "window": 64, "sparse_cache": slots, "sinks": sinks, "chunk": 64,
        "feature_map": "hedgehog", "linear_rope": False}
json.dump({**base, "overrides": {str(i): {"linear_weight": w} for i, w in weights.items()}}, open(start, "w"), indent=1)
# the same number of exact slots as one window, nothing else
json.dump({**base, "window": 64 + slots, "sparse_cache": 0, "sinks": 0, "linear_weight": 0.0}, open(window, "w"), indent=1)
EOF

case "$CMD" in
train)
  log "train: $MODEL as LoLA (64 + $SLOTS, sinks $SINKS), $SOURCE rows of $SEQ_LEN, batch $BATCH, $MINUTES minutes"
  $L train --recipe lola --model "$MODEL" --name "$NAME" --output_dir "$WORK/runs" \
    --spec "$(cat "$WORK/start_spec.json")" --data.source "$SOURCE" --data.seq_len "$SEQ_LEN" --data.heldout_sequences 16 \
    --transfer.enabled false --finetune.max_steps 100000 --finetune.max_minutes "$MINUTES" --finetune.lora_rank "$RANK" \
    --finetune.train_new_params "$NEW_PARAMS" --finetune.optim.lr "$LR" --finetune.optim.batch_size "$BATCH" \
    --finetune.eval_every 25 --finetune.eval_batches 4 --finetune.save_every 100000 --finetune.keep_best true $EXTRA \
    2>&1 | tee "$WORK/train.log"
  log "train: exit ${PIPESTATUS[0]}"
  ;;
eval)
  OUT=${3:?usage: lola_in_the_loop.sh eval WORK_DIR OUT}
  EVAL="--device $DEVICE --suite standard --tasks niah_single_1,passkey,needle_recall --lengths $LENGTHS --samples $SAMPLES
    --batch-size $SAMPLES --ppl-lengths $PPL_LENGTHS --mc-tasks none"
  run_eval() {  # run_eval TAG ARGS...
    local tag=$1 start=$SECONDS; shift
    mkdir -p "$OUT/$tag"
    $L eval "$@" $EVAL --out "$OUT/$tag" > "$OUT/$tag/log.txt" 2>&1
    log "eval $tag: exit $?, $((SECONDS - start)) s"
  }
  run_eval start --model "$MODEL" --spec "$WORK/start_spec.json" &
  run_eval trained --model "$WORK/runs/$NAME/adapter" &
  run_eval trained-window --model "$WORK/runs/$NAME/adapter" --spec "$WORK/window_spec.json" &
  wait
  ;;
*) echo "unknown command $CMD; valid: train, eval" >&2; exit 2 ;;
esac
