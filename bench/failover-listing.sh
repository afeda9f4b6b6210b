#!/usr/bin/env bash
# A folder of FILES entries listed for the first time through a FUSE mount while the
# master group's leader is killed (-9) part way (issue 31): three `granary master`
# processes on loopback, a folder under-store with one folder of FILES empty files, a
# `granary fuse` mount (no worker: metadata only). `ls -f` of the folder starts; once the
# leader has applied LISTED_PAGES listing pages of it (Raft entries), the leader is
# killed. Checks that `ls` ends without error and with exactly the store's names, that
# every member then holds exactly those names (`granary fs ls --stale` at each), and
# reports the time of the listing against `ls -f` of the same folder on the local disk
# (page cache dropped), how long after the kill a new leader was elected, and the
# masters' memory.
#
#   bench/failover-listing.sh [FILES] [LISTED_PAGES]   (default 1,000,000 and 100; root)
#   LISTED_PAGES 0: the same listing with no failover (the comparison)
#
# PERF=FILE records `perf record` (DWARF stacks) of the first leader during the listing.
# Uses $GRANARY_BIN, else the debug binary scripts/test builds.
set -euo pipefail
files="${1:-1000000}"
listed_pages="${2:-100}"
here="$(cd "$(dirname "$0")" && pwd)"
. "$here/lib.sh"
needs_root
procs_workdir failover-listing
fuse_pid=""
trap 'fuse_unmount; procs_cleanup' EXIT
mkdir -p "$work/ufs/tree/big" "$work/mnt"
python3 - "$work/ufs/tree/big" "$files" <<'PY'
import os, sys
d, n = sys.argv[1], int(sys.argv[2])
for i in range(n):
    open(os.path.join(d, f"f{i:07d}"), "wb").close()
PY
(cd "$work/ufs/tree/big" && ls -f | grep -v '^\.\.\?$' | sort > "$work/want")
[ "$(wc -l < "$work/want")" = "$files" ] || { echo "made $(wc -l < "$work/want") files, not $files"; exit 1; }
list_raw() { ls -f "$1" | wc -l; }
drop
raw=$(timed list_raw "$work/ufs/tree/big")

master_flags=(--allow-local-root "$work/ufs")
master_group
for i in 1 2 3; do start_master "$i"; done
for _ in $(seq 1 300); do leader > /dev/null 2>&1 && break; sleep 0.1; done
"$bin" mount add --master "$addrs" /tree "$work/ufs/tree" --option sync_interval=never > /dev/null
GRANARY_LOG=warn "$bin" fuse --master "$addrs" --mount "$work/mnt" >> "$work/fuse.log" 2>&1 &
fuse_pid=$!
pids+=($fuse_pid)
for _ in $(seq 1 300); do mountpoint -q "$work/mnt" && break; sleep 0.1; done
mountpoint -q "$work/mnt" || { cat "$work/fuse.log"; exit 1; }
ls "$work/mnt/tree" > /dev/null

first=$(leader)
before=$(applied "$first")
ticks() { awk '{print $14 + $15}' "/proc/$1/stat" 2>/dev/null || echo 0; }
cpu0=($(ticks "${mpid[1]}") $(ticks "${mpid[2]}") $(ticks "${mpid[3]}") $(ticks "$fuse_pid"))
s=$(date +%s.%N)
(ls -f "$work/mnt/tree/big" > "$work/got" 2> "$work/ls.err"; echo $? > "$work/ls.rc") &
lister=$!
perf_pid=""
if [ -n "${PERF:-}" ]; then
  perf record -F 500 --call-graph dwarf -o "$PERF" -p "${mpid[$first]}" > /dev/null 2>&1 &
  perf_pid=$!
fi
# Wait until the leader has applied LISTED_PAGES more entries (listing pages), then kill it
# (LISTED_PAGES 0: no kill, the same listing without a failover, for comparison).
for _ in $(seq 1 6000); do
  [ "$listed_pages" = 0 ] && break
  a=$(applied "$first")
  [ -n "$a" ] && [ "$a" -ge $((before + listed_pages)) ] && break
  [ -f "$work/ls.rc" ] && { echo "the listing ended before the leader was killed; use more files"; exit 1; }
  sleep 0.05
done
at_kill=$(applied "$first")
second="$first"
k=$(date +%s.%N)
if [ "$listed_pages" != 0 ]; then
  kill -9 "${mpid[$first]}"
  k=$(date +%s.%N)
  for _ in $(seq 1 600); do
    second=$(leader 2>/dev/null || true)
    [ -n "$second" ] && [ "$second" != "$first" ] && break
    sleep 0.05
  done
fi
elected=$(date +%s.%N)
wait "$lister" || true
e=$(date +%s.%N)
[ -n "$perf_pid" ] && { kill -INT "$perf_pid"; wait "$perf_pid" || true; }
cpu1=($(ticks "${mpid[1]}") $(ticks "${mpid[2]}") $(ticks "${mpid[3]}") $(ticks "$fuse_pid"))
cpu=$(python3 -c "import sys; a, b, hz = sys.argv[1].split(), sys.argv[2].split(), int(sys.argv[3]); d = [f'{(int(y) - int(x)) / hz:.1f}' if int(y) >= int(x) else 'killed' for x, y in zip(a, b)]; print(f'masters {d[0]} / {d[1]} / {d[2]} s, mount {d[3]} s')" "${cpu0[*]}" "${cpu1[*]}" "$(getconf CLK_TCK)")
rc=$(cat "$work/ls.rc")
[ "$rc" = 0 ] || { echo "ls failed ($rc): $(cat "$work/ls.err")"; tail -20 "$work/fuse.log"; exit 1; }
grep -v '^\.\.\?$' "$work/got" | sort > "$work/got.sorted"
got=$(wc -l < "$work/got.sorted")
dups=$(uniq -d "$work/got.sorted" | wc -l)
cmp -s "$work/want" "$work/got.sorted" || { echo "ls through the failover: $got names ($dups twice), not the store's $files"; diff "$work/want" "$work/got.sorted" | head; exit 1; }
# Every member that is up holds exactly the store's names (its own copy; a follower learns
# the last commit index with the next heartbeat, so it is polled for a while).
for i in 1 2 3; do
  [ "$i" = "$first" ] && [ "$listed_pages" != 0 ] && continue
  for _ in $(seq 1 300); do
    "$bin" fs ls --stale --master "127.0.0.1:${ports[$((i - 1))]}" /tree/big | sort > "$work/m$i.names" || true
    cmp -s "$work/want" "$work/m$i.names" && break
    sleep 0.1
  done
  cmp -s "$work/want" "$work/m$i.names" || { echo "master $i holds $(wc -l < "$work/m$i.names") names, not the store's $files"; exit 1; }
done
rss() { awk '/^VmHWM/ { print int($2 / 1024) }' "/proc/$1/status"; }
others=()
for i in 1 2 3; do [ "$i" = "$first" ] && [ "$listed_pages" != 0 ] || others+=("master $i peak $(rss "${mpid[$i]}") MiB"); done

took=$(python3 -c "print(f'{$e - $s:.2f}')")
if [ "$listed_pages" = 0 ]; then
  printf '%s files in one folder, no failover (leader: master %s)\n' "$files" "$first"
else
  printf '%s files in one folder, leader (master %s) killed after %s listing entries applied\n' "$files" "$first" "$((at_kill - before))"
fi
printf '  %-52s %8s s\n' "ls -f on the local disk (page cache dropped)" "${raw% *}"
printf '  %-52s %8s s  (%s names, each once)\n' "ls -f through the mount" "$took" "$got"
[ "$listed_pages" = 0 ] || printf '  %-52s %8s s  (master %s)\n' "kill -9 to a new leader" "$(python3 -c "print(f'{$elected - $k:.2f}')")" "$second"
printf '  %-52s %8sx\n' "ratio to the local disk" "$(python3 -c "print(f'{($e - $s) / max(float("${raw% *}"), 0.01):.1f}')")"
printf '  %s\n' "CPU during the listing: $cpu" "${others[*]}"
