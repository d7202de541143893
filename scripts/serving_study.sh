#!/usr/bin/env bash
# DSLA-Serve's experiment: the Azure conversation trace replayed under every policy, in two settings
# (one GPU each, or one after the other where settings share a GPU), softmax replayed again last as a
# control for the order of the runs.
#
#   GPUS="0 1" bash scripts/serving_study.sh WORK_DIR              # start both (detached), return
#   bash scripts/serving_study.sh --pack WORK_DIR OUT_DIR [WAIT_S]   # wait for both (up to WAIT_S), pack
#
# Settings (docs/results/serving.md says why):
#   smollm2  smollm2-135m-dsla-chained, KV budget 256MiB, memory policy up to 15 of 30 layers, prompts up to
#            8,192 tokens (its positions)
#   7b       random:llama2-7b (random weights, every layer DSLA), 34GiB, up to 16 of 32 layers,
#            --max-running 40 (its pools: 40 slots x 4,096 tokens x 512 KiB = 80 GiB), prompts up to 4,096 tokens
#   tiny     random:tiny on DEVICE=cpu: checks the script in seconds
# Environment: DEVICE (cuda)  START (0: the first trace request replayed)  REQUESTS ("40 100": one replay per count, in turn)  RATE (8)  RATES (a sweep instead of RATE:
#   comma-separated rate scales, e.g. 2,3,4,6; each replay's report per rate and sweep.md beside)  TIMEOUT (150 s per policy)
#   POLICIES (softmax,length-caps,memory,softmax)  REPEATS (1; N: the policy list replayed N times in turn, the report's
#   "Across runs" table gives each policy's mean and range over its runs)
#   PROFILE (0; N > 0: after the timed replays, one more replay of the same requests, in its own process, with N
#   engine steps of each policy under torch.profiler, to replay/SETTING-N-profile; its timings are not the result:
#   in a profiled replay on an H200 the repeated softmax ran 0.61x its first run)  PROFILE_FROM (300: the first
#   profiled step of each policy)
#   BUDGET, MAX_PROMPT (the setting's KV budget and prompt cap instead of those above)
#   SETTINGS ("smollm2 7b")  RUNNER (pooled)  GRAPHS (graphs; no-graphs: decode steps launched op by op)
set -u
if [ "${1:-}" = --pack ]; then
  WORK=${2:?usage: serving_study.sh --pack WORK_DIR OUT_DIR [WAIT_SECONDS]}
  out=${3:?usage: serving_study.sh --pack WORK_DIR OUT_DIR [WAIT_SECONDS]}; wait_s=${4:-0}; start=$(date +%s)
  while [ "$(ls "$WORK"/*.done 2>/dev/null | wc -l)" -lt "$(cat "$WORK/expected" 2>/dev/null || echo 1)" ] \
        && [ $(( $(date +%s) - start )) -lt "$wait_s" ]; do
    sleep 20
    echo "--- $(date +%T)"; for f in "$WORK"/logs/*.log; do echo "$(basename "$f"): $(tail -c 150 "$f" | tr '\r\n' '  ')"; done
    nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader 2>/dev/null
  done
  mkdir -p "$out"
  (cd "$WORK" && tar czf "$out/serving.tgz" replay logs 2>/dev/null)
  for f in "$WORK"/replay/*/report.md "$WORK"/replay/*/sweep.md; do [ -f "$f" ] && { echo "== $f"; cat "$f"; }; done
  exit 0
fi
WORK=${1:?usage: GPUS="0 1" serving_study.sh WORK_DIR}
GPUS=(${GPUS:-0}); REQUESTS=${REQUESTS:-"40 100"}; RATE=${RATE:-8}; TIMEOUT=${TIMEOUT:-150}
POLICIES=${POLICIES:-softmax,length-caps,memory,softmax}; PROFILE=${PROFILE:-0}; RUNNER=${RUNNER:-pooled}; REPEATS=${REPEATS:-1}
SETTINGS=(${SETTINGS:-smollm2 7b})
mkdir -p "$WORK/logs" "$WORK/replay"
rm -f "$WORK"/*.done  # markers of an earlier study in the same WORK_DIR would end --pack at once
echo "${#SETTINGS[@]}" > "$WORK/expected"
rate="--rate-scale $RATE"; [ -n "${RATES:-}" ] && rate="--rate-scales $RATES"
common="--device ${DEVICE:-cuda} --trace azure-conv --start ${START:-0} $rate --policies $POLICIES"
common+=" --slo ttft=2s,tpot=100ms --timeout $TIMEOUT --runner $RUNNER --${GRAPHS:-graphs}"
declare -A chain  # GPU -> the commands of the settings it runs, one after another (one GPU: all in turn)
for i in "${!SETTINGS[@]}"; do
  setting=${SETTINGS[$i]}; gpu=${GPUS[$(( i % ${#GPUS[@]} ))]}
  case $setting in
    smollm2) args="--model smollm2-135m-dsla-chained --kv-budget ${BUDGET:-256MiB} --max-level 15 --max-prompt ${MAX_PROMPT:-8192}" ;;
    7b) args="--model random:llama2-7b --kv-budget ${BUDGET:-34GiB} --max-level 16 --max-running 40 --max-prompt ${MAX_PROMPT:-4096}" ;;
    tiny) args="--model random:tiny --kv-budget ${BUDGET:-1MiB} --max-level 2 --max-prompt ${MAX_PROMPT:-4096}" ;;  # a check of the script itself (DEVICE=cpu)
    *) echo "unknown setting $setting (valid: smollm2, 7b, tiny)" >&2; exit 2 ;;
  esac
  cmd=""
  for n in $REQUESTS; do
    cmd+="python -m linearize.cli -v replay $args --requests $n $common --repeats $REPEATS --out $WORK/replay/$setting-$n >> $WORK/logs/$setting.log 2>&1; "
  done
  if [ "$PROFILE" -gt 0 ]; then
    for n in $REQUESTS; do
      cmd+="python -m linearize.cli -v replay $args --requests $n $common --profile-steps $PROFILE --profile-from ${PROFILE_FROM:-300}"
      cmd+=" --out $WORK/replay/$setting-$n-profile >> $WORK/logs/$setting.log 2>&1; "
    done
  fi
  chain[$gpu]+="$cmd touch $WORK/$setting.done; "
  echo "$setting on GPU $gpu"
done
for gpu in "${!chain[@]}"; do
  CUDA_VISIBLE_DEVICES=$gpu setsid nohup bash -c "${chain[$gpu]}" < /dev/null > /dev/null 2>&1 &
done
