#!/usr/bin/env bash
# Start NPROC local CPU processes of jaxpar.train joined by jax.distributed on 127.0.0.1.
#
#   scripts/tools/launch_local.sh NPROC DEVICES_PER_PROC -- <jaxpar.train args>
#
# Output lines carry their rank. As soon as one process fails, the others are stopped (TERM, then
# KILL after a grace period) and the launcher exits with that status; it leaves no process behind.
set -u
usage="usage: $0 NPROC DEVICES_PER_PROC -- <jaxpar.train args>"
if [ $# -lt 2 ] || ! [[ "$1" =~ ^[1-9][0-9]*$ ]] || ! [[ "$2" =~ ^[1-9][0-9]*$ ]]; then
  echo "$usage" >&2; exit 2
fi
nproc=$1 devices_per_proc=$2; shift 2
[ "${1:-}" = "--" ] && shift
python=${PYTHON:-python}
grace_s=${LAUNCH_GRACE_S:-10}
port=$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])') \
  || { echo "launch_local: cannot run $python" >&2; exit 2; }

pids=()
stop_all() {  # TERM lets a process save and exit; KILL whoever is still there after the grace period
  local pid
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null; done
  for _ in $(seq $((grace_s * 10))); do
    local alive=0
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && break
    sleep 0.1
  done
  for pid in "${pids[@]}"; do kill -KILL "$pid" 2>/dev/null; done
  wait 2>/dev/null
}
trap 'stop_all; exit 130' INT
trap 'stop_all; exit 143' TERM

for ((rank = 0; rank < nproc; rank++)); do
  JAX_PLATFORMS=cpu JAX_NUM_CPU_DEVICES=$devices_per_proc \
    "$python" -u -m jaxpar.train --dist.coordinator="127.0.0.1:$port" \
    --dist.num_processes="$nproc" --dist.process_id="$rank" "$@" \
    > >(sed -u "s/^/[rank $rank] /") 2> >(sed -u "s/^/[rank $rank] /" >&2) &
  pids+=($!)
done

running=("${pids[@]}")
while [ ${#running[@]} -gt 0 ]; do
  finished=
  wait -n -p finished "${running[@]}"
  status=$?
  [ -z "$finished" ] && continue
  still=()
  for pid in "${running[@]}"; do [ "$pid" != "$finished" ] && still+=("$pid"); done
  running=("${still[@]}")
  if [ $status -ne 0 ]; then
    for ((rank = 0; rank < nproc; rank++)); do [ "${pids[$rank]}" = "$finished" ] && break; done
    echo "launch_local: rank $rank exited with status $status; stopping the others" >&2
    stop_all
    exit $status
  fi
done
exit 0
