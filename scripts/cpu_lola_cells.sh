#!/usr/bin/env bash
# LoLA-budget cells on CPU (for when GPU runs of them run out of GPU memory)
# in float32: window-only baselines at 128 and 512 slots, and LoLA (64, 64) at 8K. niah_single_1,
# 25 samples, one batch each (CPU time: ~1.5 hours on 2 cores).
#   bash scripts/cpu_lola_cells.sh OUT_DIR
set -u
out=${1:?usage: $0 OUT_DIR}
mkdir -p "$out"
F="--device cpu --mc-tasks none --batch-size 25 --suite quick --tasks niah_single_1 --samples 25 --ppl-lengths none"
L="python -m linearize.cli -v"
M="--model smollm2-135m-lolcats --attention lola --chunk 64 --kernel torch"
$L ablate $M --window 128 --sparse-cache 0 --modes window_only $F --lengths 1024,2048,4096,8192 --out "$out/w128-s0-window"
$L ablate $M --window 512 --sparse-cache 0 --modes window_only $F --lengths 1024,2048,4096,8192 --out "$out/w512-s0-window"
# the check of the GPU's window-1,024 cell at 4K (1 of 100): the same first 25 samples in float32
$L ablate $M --window 1024 --sparse-cache 0 --modes window_only $F --lengths 4096 --out "$out/w1024-s0-window-4k"
$L ablate $M --window 64 --sparse-cache 64 --modes hybrid $F --lengths 8192 --out "$out/w64-s64-8k"
