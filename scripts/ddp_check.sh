#!/usr/bin/env bash
# Data-parallel check on a machine with two GPUs: the lolcats recipe on 2 GPUs (torchrun,
# DDP over NCCL) and on 1 GPU at the same global batch and seed, plus a second seed on 1 GPU to
# measure run-to-run noise. Both phases run two training processes on the host (the 2 ranks; then
# seed 0 on GPU 0 beside seed 1 on GPU 1), so the host load is alike when tokens/s are compared.
#
#   bash scripts/ddp_check.sh WORK_DIR   # then: linearize train --compare-runs WORK_DIR/ddp/* --out DIR
#
# Environment: STEPS (100 per stage)  BATCH (16, global)  EVAL_EVERY (10)
# NVLink multicast stays off (the machine sets NCCL_NVLS_ENABLE=0; kept here for any other host).
set -u
WORK=${1:?usage: ddp_check.sh WORK_DIR (two GPUs)}
STEPS=${STEPS:-100}
BATCH=${BATCH:-16}
EVAL_EVERY=${EVAL_EVERY:-10}
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
OUTDIR="$WORK/ddp"
mkdir -p "$OUTDIR" "$WORK/logs"
source "$(dirname "$0")/timeline.sh"  # log
COMMON=(train --recipe lolcats --output_dir="$OUTDIR"
  --transfer.max_steps="$STEPS" --finetune.max_steps="$STEPS" --transfer.epochs=4 --finetune.epochs=4
  --transfer.optim.batch_size="$BATCH" --finetune.optim.batch_size="$BATCH"
  --transfer.eval_every="$EVAL_EVERY" --finetune.eval_every="$EVAL_EVERY"
  --transfer.eval_batches=1000 --finetune.eval_batches=1000
  --transfer.save_every=100000 --finetune.save_every=100000)
echo "python -m linearize.cli ${COMMON[*]}" > "$OUTDIR/command.txt"

start=$(date +%s)
python -m torch.distributed.run --standalone --nproc_per_node 2 -m linearize.cli -v "${COMMON[@]}" --seed=0 --name=lolcats-2gpu-seed0 \
  > "$WORK/logs/ddp-2gpu-seed0.log" 2>&1
log "ddp 2gpu seed0: exit $?, $(( $(date +%s) - start )) s"

start=$(date +%s)
CUDA_VISIBLE_DEVICES=0 python -m linearize.cli -v "${COMMON[@]}" --seed=0 --name=lolcats-1gpu-seed0 > "$WORK/logs/ddp-1gpu-seed0.log" 2>&1 &
CUDA_VISIBLE_DEVICES=1 python -m linearize.cli -v "${COMMON[@]}" --seed=1 --name=lolcats-1gpu-seed1 > "$WORK/logs/ddp-1gpu-seed1.log" 2>&1 &
wait
log "ddp 1gpu seed0 + seed1: $(( $(date +%s) - start )) s"
