#!/usr/bin/env bash
# Variants of one recipe trained side by side (one process each, spread over the GPUs), then one
# table of their held-out results and their runs packed for evaluation elsewhere.
#
#   RECIPE=inference-hybrid bash scripts/recipe_sweep.sh WORK_DIR NAME='--finetune.optim.lr=1e-3 ...' [NAME='...' ...]
#
# Each NAME=FLAGS pair runs `linearize train --recipe RECIPE --name NAME --output_dir WORK_DIR/runs FLAGS`
# (FLAGS: recipe overrides, separated by spaces). A small model leaves most of a GPU idle, so several
# runs share one. Logs: WORK_DIR/logs/NAME.log. At the end: WORK_DIR/report.md (`linearize train
# --report` of the runs that finished) and WORK_DIR/NAME.tgz per run (its summary.json,
# metrics.jsonl, config.yaml and adapter/ as shipped checkpoints hold it: `ship_adapter.py --pack-to`).
#
# Environment: RECIPE (required)  GPUS ("0": the devices the runs are spread over)
set -u
WORK=${1:?usage: RECIPE=NAME recipe_sweep.sh WORK_DIR NAME='FLAGS' [NAME='FLAGS' ...]}
shift
RECIPE=${RECIPE:?set RECIPE to a recipe name or a recipe YAML}
read -r -a gpus <<< "${GPUS:-0}"
mkdir -p "$WORK/logs" "$WORK/runs"
WORK=$(cd "$WORK" && pwd)
names=() pids=()
i=0
for pair in "$@"; do
  name=${pair%%=*} flags=${pair#*=}
  [ "$name" != "$pair" ] || { echo "bad variant '$pair': write NAME='--field=value ...'" >&2; exit 2; }
  gpu=${gpus[$((i % ${#gpus[@]}))]}
  # shellcheck disable=SC2086  # FLAGS split into overrides on purpose
  CUDA_VISIBLE_DEVICES=$gpu python -m linearize.cli -v train --recipe "$RECIPE" --name "$name" --output_dir "$WORK/runs" $flags \
    > "$WORK/logs/$name.log" 2>&1 &
  names+=("$name") pids+=($!)
  echo "$(date +%T) started $name on GPU $gpu: $flags"
  i=$((i + 1))
done
done_runs=()
for k in "${!pids[@]}"; do
  if wait "${pids[$k]}"; then
    done_runs+=("$WORK/runs/${names[$k]}")
    echo "$(date +%T) ${names[$k]} finished"
  else
    echo "$(date +%T) ${names[$k]} failed; the end of its log:"
    tail -n 20 "$WORK/logs/${names[$k]}.log"
  fi
done
[ "${#done_runs[@]}" -gt 0 ] || exit 1
python -m linearize.cli train --report "${done_runs[@]}" | tee "$WORK/report.md"
python "$(dirname "$0")/ship_adapter.py" "${done_runs[@]}" --pack-to "$WORK"
