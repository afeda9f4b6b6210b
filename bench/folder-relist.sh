#!/usr/bin/env bash
# One flat folder of many objects on an object store (s3s-fs), listed by a master process
# (`granary fs sync`), and listed again by a freshly started master once one object was
# added: how long each took and the master's peak memory (VmHWM) — the re-listing's is
# what a folder's size costs the leader, since it compares the listing with every known
# child. The figure to watch is memory, against the master's own resident set before the
# re-listing (the limit here: what the master holds anyway).
#
#   bench/folder-relist.sh [OBJECTS]   (default 100000 empty objects; scripts/setup-emulators)
#
# BINS="A B" runs each binary in turn, ROUNDS times (default 2), alternating; else $bin.
# CLI=BIN runs the `granary` commands with that binary (default: the one under test; a
# build before 2026-12-04 gives up on a `fs sync` longer than 10 s).
set -euo pipefail
n="${1:-100000}"
here="$(cd "$(dirname "$0")" && pwd)"
. "$here/lib.sh"
tools="${GRANARY_TOOLS:-$HOME/.cache/granary/tools}"
procs_workdir folder-relist
mkdir -p "$work/s3/bench/big"
python3 - "$work/s3/bench/big" "$n" <<'PY'
import os, sys
root, n = sys.argv[1], int(sys.argv[2])
for i in range(n):
    open(os.path.join(root, f"f{i:07d}"), "wb").close()
PY
sport=$(free_port)
"$tools/bin/s3s-fs" --host 127.0.0.1 --port "$sport" --access-key bench --secret-key bench-secret \
  "$work/s3" > "$work/server.log" 2>&1 &
pids+=($!); wait_port "$sport"
opts=(-o region=us-east-1 -o access_key_id=bench -o secret_access_key=bench-secret
  -o allow_http=true -o "endpoint=http://127.0.0.1:$sport")

mib() { awk -v k="$2:" '$1 == k { printf "%.0f", $2 / 1024 }' "/proc/$1/status"; }

# start_master BIN DATA PORT: sets $mpid once the master answers.
start_master() {
  GRANARY_LOG=warn "$1" master --data-dir "$2" --listen "127.0.0.1:$3" >> "$work/master.log" 2>&1 &
  mpid=$!; pids+=($mpid); wait_port "$3"
  for _ in $(seq 1 100); do "${CLI:-$1}" fs stat / --master "127.0.0.1:$3" > /dev/null 2>&1 && return; sleep 0.1; done
  echo "the master did not serve"; exit 1
}

# one BIN: "first_s first_peak_mib relist_s rss_before_mib relist_peak_mib"
one() {
  local b=$1 port data first peak1 base relist peak2 c="${CLI:-$1}"
  port=$(free_port); data="$work/master-$RANDOM"
  start_master "$b" "$data" "$port"
  "$c" mount add /store s3://bench "${opts[@]}" -o sync_interval=never --master "127.0.0.1:$port" > /dev/null
  first=$(timed "$c" fs sync /store/big --master "127.0.0.1:$port")
  peak1=$(mib "$mpid" VmHWM)
  kill "$mpid"; wait "$mpid" 2>/dev/null || true
  : > "$work/s3/bench/big/zz-added"
  start_master "$b" "$data" "$port"
  base=$(mib "$mpid" VmRSS)
  relist=$(timed "$c" fs sync /store/big --master "127.0.0.1:$port")
  peak2=$(mib "$mpid" VmHWM)
  "$c" fs stat /store/big/zz-added --master "127.0.0.1:$port" > /dev/null \
    || { echo "the added object is not listed"; exit 1; }
  kill "$mpid"; wait "$mpid" 2>/dev/null || true
  rm -rf "$data" "$work/s3/bench/big/zz-added"
  echo "${first%% *} $peak1 ${relist%% *} $base $peak2"
}

read -r -a bins <<< "${BINS:-$bin}"
printf '%-60s %9s %9s %10s %9s %9s\n' "binary ($n objects, one folder, s3s-fs)" "list s" "peak MiB" "relist s" "rss MiB" "peak MiB"
for _ in $(seq 1 "${ROUNDS:-2}"); do
  for b in "${bins[@]}"; do
    printf '%-60s %9s %9s %10s %9s %9s\n' "$b" $(one "$b")
  done
done
