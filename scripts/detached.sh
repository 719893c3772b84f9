#!/usr/bin/env bash
# A command that outlives one device call (the lent machines stop a call at 600 s): started in a
# process session of its own (setsid), which the device tool leaves running while the machine stays
# warm, then waited for and collected by the calls after it. The machine goes back ~30 s after a
# call returns, so chain the calls at once, each waiting until just under its limit:
#   call 1: source scripts/gpu_env.sh && bash scripts/detached.sh start glm1m -- python -m \
#             lockserve.cluster.measure bench prefill ... --out '$DIR' ; bash scripts/detached.sh wait glm1m 540
#   call 2: bash scripts/detached.sh wait glm1m 540 && bash scripts/detached.sh collect glm1m "$OUT"
# start: runs COMMAND under setsid with its output in $DETACHED_ROOT/NAME/log (a literal $DIR in
#   its arguments becomes $DETACHED_ROOT/NAME/files, where it should write); refuses a NAME running.
# wait NAME SECONDS: returns 0 once it ended (its exit status in .../rc) or 3 when SECONDS passed
#   with it still running; prints the log's tail either way.
# collect NAME DEST: copies its files, its log and its exit status into DEST; 3 while it runs.
# DETACHED_ROOT: /tmp/detached unless set.
set -euo pipefail
root=${DETACHED_ROOT:-/tmp/detached}

usage() { echo "usage: detached.sh start NAME -- COMMAND... | wait NAME SECONDS | collect NAME DEST" >&2; exit 2; }
running() { [ -f "$1/pid" ] && [ ! -f "$1/rc" ] && kill -0 "$(cat "$1/pid")" 2>/dev/null; }

start() {
  local name=$1 dir=$root/$1
  shift
  [ "${1:-}" = "--" ] && [ $# -gt 1 ] || usage
  shift
  if running "$dir"; then echo "detached.sh: $name is running (pid $(cat "$dir/pid"))" >&2; exit 2; fi
  rm -rf "$dir" && mkdir -p "$dir/files"
  local args=() a
  for a in "$@"; do args+=("${a//\$DIR/$dir/files}"); done
  # The rc file is written by the session's own shell when the command ends, whatever its status.
  # Nothing of the caller's stays open in it: a tool that waits for the call's output ends with the call.
  setsid bash -c '"$@" > "$0/log" 2>&1; echo $? > "$0/rc"' "$dir" "${args[@]}" > /dev/null 2>&1 < /dev/null &
  echo $! > "$dir/pid"
  echo "detached.sh: started $name (pid $!), output in $dir"
}

wait_for() {
  local name=$1 seconds=$2 dir=$root/$1
  [ -d "$dir" ] || { echo "detached.sh: nothing started as $name" >&2; exit 2; }
  local deadline=$((SECONDS + seconds))
  while [ ! -f "$dir/rc" ] && [ $SECONDS -lt $deadline ]; do
    if ! running "$dir"; then  # gone: its rc lands in a moment, unless it was killed
      sleep 1
      [ -f "$dir/rc" ] || { echo "detached.sh: $name ended without an exit status (killed?)" >&2; exit 1; }
    fi
    sleep 2
  done
  tail -c 2000 "$dir/log" || true
  if [ -f "$dir/rc" ]; then echo "detached.sh: $name ended, exit status $(cat "$dir/rc")"; return 0; fi
  echo "detached.sh: $name still running after ${seconds}s"
  return 3
}

collect() {
  local name=$1 dest=$2 dir=$root/$1
  [ -d "$dir" ] || { echo "detached.sh: nothing started as $name" >&2; exit 2; }
  if [ ! -f "$dir/rc" ]; then echo "detached.sh: $name is still running" >&2; return 3; fi
  mkdir -p "$dest"
  cp -r "$dir/files/." "$dest/"
  cp "$dir/log" "$dest/$name.log"
  cp "$dir/rc" "$dest/$name.rc"
}

case "${1:-}" in
  start) [ $# -ge 3 ] || usage; shift; start "$@" ;;
  wait) [ $# -eq 3 ] || usage; wait_for "$2" "$3" ;;
  collect) [ $# -eq 3 ] || usage; collect "$2" "$3" ;;
  *) usage ;;
esac
