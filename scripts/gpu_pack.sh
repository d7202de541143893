#!/usr/bin/env bash
# Wait for scripts/gpu_session.sh (up to WAIT seconds, default 0), then copy what has finished into
# $OUT: one run-NAME.tgz per finished training run (adapter, summary, metrics, config, log) and
# results.tgz (evaluation and benchmark reports, logs, metrics of unfinished runs). At most 8 files.
set -u
WORK=${WORK:-/root/assets/work}
OUT=${OUT:-out}
wait_s=${1:-0}
start=$(date +%s)
while ! ls "$WORK"/DONE-* >/dev/null 2>&1 && [ $(( $(date +%s) - start )) -lt "$wait_s" ]; do
  sleep 20
  if [ $(( ($(date +%s) - start) % 120 )) -lt 20 ]; then
    echo "--- $(date +%T)"; tail -n 4 "$WORK/logs/timeline.log" 2>/dev/null
    nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader 2>/dev/null
  fi
done
mkdir -p "$OUT"
echo "=== timeline"; cat "$WORK/logs/timeline.log" 2>/dev/null
for run in "$WORK"/runs/*/; do
  name=$(basename "$run")
  [ -f "$run/summary.json" ] || continue
  cp "$WORK/logs/train-${name#smollm2-135m-}.log" "$run/train.log" 2>/dev/null
  (cd "$WORK/runs" && tar czf "$OUT/run-$name.tgz" "$name/adapter" "$name/summary.json" "$name/metrics.jsonl" "$name/config.yaml" "$name/train.log")
done
(cd "$WORK" && tar czf "$OUT/results.tgz" --exclude='*.pt' --exclude='adapter' eval bench logs runs ddp 2>/dev/null)
ls -la "$OUT"
