# Sourced by the launch scripts (needs WORK set): a timeline of what ran, in WORK/logs/timeline.log.
#   log MESSAGE...      one timestamped line
#   step NAME CMD...    run CMD with its output in WORK/logs/NAME.log, log its exit code and wall time
mkdir -p "$WORK/logs"
log() { echo "[$(date +%T)] $*" | tee -a "$WORK/logs/timeline.log"; }
step() {
  local name=$1 start rc; shift
  start=$(date +%s)
  "$@" > "$WORK/logs/$name.log" 2>&1
  rc=$?
  log "$name: exit $rc, $(( $(date +%s) - start )) s"
  return $rc
}
