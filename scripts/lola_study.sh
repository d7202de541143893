#!/usr/bin/env bash
# LoLA on trained hybrids: the sparse cache (window 64 + 256 slots chosen by self-recall error, chunk
# 64) against the same 320 explicit slots spent on a plain window (with the linear state, and alone),
# on the needle tests; every model in parallel on one GPU.
#   WORK=DIR bash scripts/lola_study.sh MODEL [MODEL ...]     (MODEL: a shipped name or a run's adapter dir)
# Writes WORK/NAME/{w64-s256,w320-s0}/ablation.{md,json} and WORK/lola.tgz of all of them.
# Environment: DEVICE (cuda)  SAMPLES (25)  LENGTHS (2048,4096)  BATCH (25)  TASKS (niah_single_1,passkey,needle_recall)
set -u
WORK=${WORK:-lola-study}
DEVICE=${DEVICE:-cuda}
F="--device $DEVICE --mc-tasks none --batch-size ${BATCH:-25} --suite quick --tasks ${TASKS:-niah_single_1,passkey,needle_recall}
   --samples ${SAMPLES:-25} --lengths ${LENGTHS:-2048,4096} --ppl-lengths none --kernel torch --chunk 64"
mkdir -p "$WORK"
for model in "$@"; do
  name=$(basename "$model")
  python -m linearize.cli -v ablate --model "$model" --attention lola --window 64 --sparse-cache 256 --modes hybrid,no_state \
    $F --out "$WORK/$name/w64-s256" > "$WORK/$name-w64-s256.log" 2>&1 &
  python -m linearize.cli -v ablate --model "$model" --attention lola --window 320 --sparse-cache 0 --modes hybrid,window_only \
    $F --out "$WORK/$name/w320-s0" > "$WORK/$name-w320-s0.log" 2>&1 &
done
wait
(cd "$WORK" && tar czf lola.tgz --exclude=lola.tgz .)
cat "$WORK"/*/*/ablation.md 2>/dev/null
