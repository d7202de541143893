#!/usr/bin/env bash
# LoLA read-outs side by side: trained hybrids read as LoLA (window 64 + 256 sparse slots, sinks 4,
# prefill chunk 64) with one linear-term weight in every head, with per-head weights calibrated on
# the teacher's layer inputs and on chained inputs (linearize calibrate --inputs), against a
# 320-token window and nothing else (the same slots); niah_single_1, passkey and needle_recall at LENGTHS.
#
#   MODELS="lolcats=smollm2-135m-lolcats nope-long=ADAPTER_DIR" bash scripts/lola_readout.sh WORK_DIR
#
# Every evaluation of every model runs at once (they are host-bound); WORK_DIR/NAME/READOUT/ holds
# each report, WORK_DIR/NAME/cal-*/ each calibration, WORK_DIR/timeline.log the steps and times.
# Environment: MODELS (lolcats=smollm2-135m-lolcats)  DEVICE (cuda)  SAMPLES (25)  LENGTHS (2048,4096)
#   WEIGHT (0.01: the one-weight read)
#   CALIBRATIONS ("teacher:2048 chained:2048 chained:2048:recall-probes": INPUTS:TOKENS[:TEXT] of calibrate)
#   BASELINE (1: the 320-token window)  PPL_LENGTHS (none: wiki perplexity lengths of every read-out)
set -u
WORK=${1:?usage: MODELS="NAME=MODEL ..." lola_readout.sh WORK_DIR}
MODELS=${MODELS:-lolcats=smollm2-135m-lolcats}; DEVICE=${DEVICE:-cuda}; SAMPLES=${SAMPLES:-25}
LENGTHS=${LENGTHS:-2048,4096}; WEIGHT=${WEIGHT:-0.01}; CALIBRATIONS=${CALIBRATIONS:-"teacher:2048 chained:2048 chained:2048:recall-probes"}
BASELINE=${BASELINE:-1}; PPL_LENGTHS=${PPL_LENGTHS:-none}
L="python -m linearize.cli"
LOLA="--attention lola --window 64 --sparse-cache 256 --sinks 4 --chunk 64"
EVAL="--device $DEVICE --suite standard --tasks niah_single_1,passkey,needle_recall --lengths $LENGTHS
  --samples $SAMPLES --batch-size $SAMPLES --ppl-lengths $PPL_LENGTHS --mc-tasks none"
mkdir -p "$WORK"
log() { echo "[$(date +%T)] $*" | tee -a "$WORK/timeline.log"; }
step() {  # step NAME OUT_DIR COMMAND...: run, log the exit status and seconds, keep the output in OUT_DIR/log.txt
  local name=$1 out=$2 start=$SECONDS; shift 2
  mkdir -p "$out"
  "$@" > "$out/log.txt" 2>&1; local rc=$?
  log "$name: exit $rc, $((SECONDS - start)) s"
  return $rc
}
one_model() {  # one_model NAME MODEL
  local name=$1 model=$2 cal inputs tokens text tag
  step "$name-weight$WEIGHT" "$WORK/$name/weight$WEIGHT" $L eval --model "$model" $LOLA --linear-weight "$WEIGHT" $EVAL \
    --out "$WORK/$name/weight$WEIGHT" &
  [ "$BASELINE" = 1 ] && step "$name-window320" "$WORK/$name/window320" $L eval --model "$model" --attention lola \
    --window 320 --sparse-cache 0 --linear-weight 0 $EVAL --out "$WORK/$name/window320" &
  for cal in $CALIBRATIONS; do
    IFS=: read -r inputs tokens text <<< "$cal"; text=${text:-heldout}; tag="$inputs-$tokens-$text"
    ( step "$name-cal-$tag" "$WORK/$name/cal-$tag" $L calibrate --model "$model" $LOLA --inputs "$inputs" \
        --tokens "$tokens" --text "$text" --device "$DEVICE" --out "$WORK/$name/cal-$tag" &&
      step "$name-calibrated-$tag" "$WORK/$name/calibrated-$tag" $L eval --model "$WORK/$name/cal-$tag" $EVAL \
        --out "$WORK/$name/calibrated-$tag" ) &
  done
  wait
}
log "start: models $MODELS; calibrations $CALIBRATIONS; $SAMPLES samples at $LENGTHS on $DEVICE"
for pair in $MODELS; do one_model "${pair%%=*}" "${pair#*=}" & done
wait
log "done"
