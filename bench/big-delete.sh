#!/usr/bin/env bash
# What one recursive delete of a big folder costs everyone else on a 3-master group on
# loopback: while `granary fs rm -R` removes a folder of FILES entries (a local store
# mounted at /data, the folder listed first), one other caller creates files elsewhere
# (`granary bench metadata`, 1 caller), and the longest pause between its acknowledged
# creates is how long the group stopped for others. Also the delete's own time and each
# master's peak memory (VmHWM) before and after it.
#
#   bench/big-delete.sh [FILES]     (default 200000 empty files in one folder)
#
# PROBE_SECS (default 60) is how long the other caller runs; the delete starts 3 s in and
# must end before it. Uses $GRANARY_BIN, else the debug binary scripts/test builds;
# CLI_BIN, if set, runs the `rm` (a client of another release against these masters:
# clients before 2026-12-06 gave up on a recursive delete after 10 s).
set -euo pipefail
files="${1:-200000}"
probe_secs="${PROBE_SECS:-60}"
. "$(dirname "$0")/lib.sh"
work="$(mktemp -d /tmp/granary-bench-bigdel-XXXXXX)"
pids=()
trap bench_group_cleanup EXIT
mkdir -p "$work/ufs/big"
# Links to one file per 50,000 entries: a new inode per entry is slow to make on this
# VM's ext4, and a file takes at most 65,000 links.
python3 - "$work/ufs/big" "$files" <<'PY'
import os, sys
d, n = sys.argv[1], int(sys.argv[2])
first = None
for i in range(n):
    p = os.path.join(d, f"f{i:07d}")
    if i % 50000 == 0:
        open(p, "wb").close()
        first = p
    else:
        os.link(first, p)
PY

master_flags=(--allow-local-root "$work/ufs")
master_group
for i in 1 2 3; do start_master "$i"; done
for _ in $(seq 1 300); do leader > /dev/null 2>&1 && break; sleep 0.1; done
"$bin" mount add --master "$addrs" /data "$work/ufs" --option sync_interval=never > /dev/null
listed=$("$bin" fs ls --master "$addrs" /data/big | wc -l)
[ "$listed" -ge "$files" ] || { echo "listed $listed entries, not $files"; exit 1; }
hwm() { awk '/VmHWM/ { printf "%d", $2 / 1024 }' "/proc/$1/status"; }
rss() { awk '/VmRSS/ { printf "%d", $2 / 1024 }' "/proc/$1/status"; }
before=""
for i in 1 2 3; do before+="m$i $(rss "${mpid[$i]}")/$(hwm "${mpid[$i]}") MiB  "; done

"$bin" bench metadata --master "$addrs" --dir /probe --duration "${probe_secs}s" \
  --concurrency 1 --json > "$work/probe.json" &
probe=$!
pids+=($probe)
sleep 3
t0=$(date +%s.%N)
rc=0
"${CLI_BIN:-$bin}" fs rm --master "$addrs" -R /data/big 2> "$work/rm.err" || rc=$?
# The removal may go on after a client gave up waiting: until the folder is gone.
until ! "$bin" fs stat --master "$addrs" /data/big > /dev/null 2>&1; do
  python3 -c "import sys; sys.exit(0 if $(date +%s.%N) - $t0 < $probe_secs else 1)" ||
    { echo "/data/big still there after ${probe_secs} s"; exit 1; }
  sleep 0.2
done
took=$(python3 -c "print(f'{$(date +%s.%N) - $t0:.2f}')")
python3 -c "import sys; sys.exit(0 if $took + 3 < $probe_secs else 1)" ||
  { echo "the delete took ${took} s, longer than the probe: raise PROBE_SECS"; exit 1; }
after=""
for i in 1 2 3; do after+="m$i $(rss "${mpid[$i]}")/$(hwm "${mpid[$i]}") MiB  "; done
wait "$probe"
gap=$(python3 -c "import json; print(json.load(open('$work/probe.json'))['max_create_gap_ms'])" 2> /dev/null ||
  echo "?")
[ -e "$work/ufs/big" ] && { echo "the store folder is still there"; exit 1; }
left=$("$bin" fs ls --master "$addrs" /data | wc -l)

echo "binary:                          $bin"
echo "folder:                          $files entries"
echo "rm -R took:                      $took s  (until the folder was gone; the command's exit status: $rc$([ "$rc" = 0 ] || echo ", $(head -c 200 "$work/rm.err")"))"
echo "longest pause of another caller: $gap ms  (creates elsewhere, 1 caller, during the rm)"
echo "masters, RSS/peak before rm:     $before"
echo "masters, RSS/peak after rm:      $after"
echo "entries left under /data:        $left"
