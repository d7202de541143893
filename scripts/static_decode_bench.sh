#!/usr/bin/env bash
# Decoding on static buffers, each step one CUDA graph replay, for both sides of every comparison:
# one attention layer of Llama-3-8B's shape (hybrid, DSLA, LoLA against SDPA softmax), then the whole
# SmolLM2-135M (the teacher against hybrid and DSLA conversions of all its layers), batch 1 and 64;
# the kernels of one decode step of each side (profile); throughput at equal memory at 32K (capacity).
# The layer's prefill (part prefill, not in all): the fused hybrid and DSLA inference prefills
# against flash softmax and against the exact forms they replace.
#   usage: scripts/static_decode_bench.sh OUT [layer|model|profile|capacity|prefill|all]
# Environment: LINEARIZE (the command; default linearize), LAYER_CONTEXTS (default 4096,32768,131072), LAYER_BATCHES (default 1,64),
# LAYER_KINDS (default "hybrid dsla lola"), MODEL_KINDS (default "hybrid dsla"), B1_CONTEXTS and
# B64_CONTEXTS (the model's decode contexts at batch 1 and 64; default 1024,4096,8000), BATCHES
# (default "1 64"), PREFILL (the model's prefill lengths; default 256, 'none' to skip), COMPILE=1 (every part: compile each side's decode step with torch.compile first),
# CAPACITY_CONTEXT (default 32768), PREFILL_LENGTHS (the layer's prefill lengths at batch 1; default
# 2048,8192,32768,131072; PREFILL_KINDS default "hybrid dsla"),
# PROFILE=1 (part prefill: each case's kernels, both sides, in layer.md), FEATURE_DIM_8B (the Hedgehog
# maps' features in the Llama-3-8B-shaped runs, layer, prefill and the 8B capacity: empty for the square
# maps' 2 x 128, 128 for LoLCATs' 8B size, d x d/2 projections). Kinds: hybrid, dsla, lola (window 64, 256
# sparse slots, chunk 64; decoding keeps the slots' recalls), lola-state (the same, each slot scored against the
# state), lola64 and lola64-state (64 sparse slots).
set -euo pipefail
LINEARIZE=${LINEARIZE:-linearize}
OUT=${1:?usage: $0 OUT [layer|model|profile|capacity|prefill|all]}
PART=${2:-all}
mkdir -p "$OUT"
spec() {  # the spec flags of a kind at the settings the shipped models use
  case "$1" in
    hybrid) echo "--attention hybrid --window 64" ;;
    dsla) echo "--attention dsla" ;;
    lola) echo "--attention lola --window 64 --sparse-cache 256 --chunk 64 --keep-recalls true" ;;  # decoding keeps the slots' recalls
    lola-state) echo "--attention lola --window 64 --sparse-cache 256 --chunk 64 --keep-recalls false" ;;  # every slot scored against the state
    lola64) echo "--attention lola --window 64 --sparse-cache 64 --chunk 64 --keep-recalls true" ;;  # LoLA's (64, 64)
    lola64-state) echo "--attention lola --window 64 --sparse-cache 64 --chunk 64 --keep-recalls false" ;;
    *) echo "unknown kind $1 (hybrid, dsla, lola, lola-state, lola64, lola64-state)" >&2; exit 2 ;;
  esac
}
C=$([ "${COMPILE:-0}" = 1 ] && echo "--compile" || true)
F8=${FEATURE_DIM_8B:+--feature-dim $FEATURE_DIM_8B}
if [ "$PART" = layer ] || [ "$PART" = all ]; then
  L="--layer llama3-8b --device cuda --graphs --batch-sizes ${LAYER_BATCHES:-1,64} --prefill-lengths none --decode-contexts ${LAYER_CONTEXTS:-4096,32768,131072}"
  for kind in ${LAYER_KINDS:-hybrid dsla lola}; do
    $LINEARIZE bench $L $C $(spec "$kind") $F8 --out "$OUT/layer/$kind"
  done
fi
contexts() { [ "$1" = 1 ] && echo "${B1_CONTEXTS:-1024,4096,8000}" || echo "${B64_CONTEXTS:-1024,4096,8000}"; }
if [ "$PART" = model ] || [ "$PART" = all ]; then
  for b in ${BATCHES:-1 64}; do
    for kind in ${MODEL_KINDS:-hybrid dsla}; do
      $LINEARIZE bench --model smollm2-135m --device cuda --graphs $C --prefill-lengths "${PREFILL:-256}" --decode-contexts "$(contexts $b)" \
        $(spec "$kind") --batch-size $b --out "$OUT/model/$kind-b$b"
    done
  done
fi
if [ "$PART" = profile ] || [ "$PART" = all ]; then
  for b in ${BATCHES:-1 64}; do
    for kind in ${MODEL_KINDS:-hybrid dsla}; do
      $LINEARIZE bench --model smollm2-135m --device cuda --profile $C --decode-contexts "$(contexts $b)" $(spec "$kind") \
        --batch-size $b --out "$OUT/profile/$kind-b$b"
    done
  done
fi
if [ "$PART" = capacity ] || [ "$PART" = all ]; then
  for kind in ${MODEL_KINDS:-hybrid dsla}; do
    $LINEARIZE bench --capacity "${CAPACITY_CONTEXT:-32768}" --model smollm2-135m --device cuda $C $(spec "$kind") --out "$OUT/capacity/smollm2-$kind"
    $LINEARIZE bench --capacity "${CAPACITY_CONTEXT:-32768}" --stack llama3-8b --device cuda $C $(spec "$kind") $F8 --out "$OUT/capacity/llama3-8b-$kind"
  done
fi
if [ "$PART" = prefill ]; then
  P="--layer llama3-8b --device cuda --batch-sizes 1 --decode-contexts none --prefill-lengths ${PREFILL_LENGTHS:-2048,8192,32768,131072}"
  [ "${PROFILE:-0}" = 1 ] && P="$P --profile"
  for kind in ${PREFILL_KINDS:-hybrid dsla}; do
    $LINEARIZE bench $P $(spec "$kind") $F8 --out "$OUT/prefill/$kind"
  done
fi
