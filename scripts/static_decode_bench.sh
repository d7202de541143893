#!/usr/bin/env bash
# Decoding on static buffers, each step one CUDA graph replay, for both sides of every comparison:
# one attention layer of Llama-3-8B's shape (hybrid, DSLA, LoLA against SDPA softmax), then the whole
# SmolLM2-135M (the teacher against hybrid and DSLA conversions of all its layers), batch 1 and 64.
#   usage: scripts/static_decode_bench.sh OUT [layer|model|all]
# Environment: LINEARIZE (the command; default linearize), LAYER_CONTEXTS (default 4096,32768,131072),
# B1_CONTEXTS and B64_CONTEXTS (the model's decode contexts at batch 1 and 64; default 1024,4096,8000),
# COMPILE=1 (model: compile each decode step with torch.compile before capturing it).
set -euo pipefail
LINEARIZE=${LINEARIZE:-linearize}
OUT=${1:?usage: $0 OUT [layer|model|all]}
PART=${2:-all}
mkdir -p "$OUT"
if [ "$PART" = layer ] || [ "$PART" = all ]; then
  L="--layer llama3-8b --device cuda --graphs --batch-sizes 1,64 --prefill-lengths none --decode-contexts ${LAYER_CONTEXTS:-4096,32768,131072}"
  $LINEARIZE bench $L --attention hybrid --window 64 --out "$OUT/layer/hybrid"
  $LINEARIZE bench $L --attention dsla --out "$OUT/layer/dsla"
  $LINEARIZE bench $L --attention lola --window 64 --sparse-cache 256 --chunk 64 --out "$OUT/layer/lola"
fi
if [ "$PART" = model ] || [ "$PART" = all ]; then
  M="--model smollm2-135m --device cuda --graphs --prefill-lengths 256"
  [ "${COMPILE:-0}" = 1 ] && M="$M --compile"
  for b in 1 64; do
    contexts=$([ $b = 1 ] && echo "${B1_CONTEXTS:-1024,4096,8000}" || echo "${B64_CONTEXTS:-1024,4096,8000}")
    $LINEARIZE bench $M --decode-contexts "$contexts" --attention hybrid --window 64 --batch-size $b --out "$OUT/model/hybrid-b$b"
    $LINEARIZE bench $M --decode-contexts "$contexts" --attention dsla --batch-size $b --out "$OUT/model/dsla-b$b"
  done
fi
