#!/usr/bin/env bash
# A namespace of many files on a 3-master group (issue 31): three `granary master`
# processes on loopback, a folder under-store of empty files mounted at /tree, read through
# a `granary fuse` mount (no worker: only metadata is read). Reports, against the raw disk
# in the same run where there is one:
#   - the first `find` (every folder listed from the store; each listing page is a Raft
#     entry applied by all three masters),
#   - a warm `find` with a stat per file (`-printf %s`), page cache dropped,
#   - per master: the data dir on disk (store, Raft log, snapshots) and resident memory,
#     per file,
#   - the snapshots the masters took (bytes and milliseconds, from their logs; masters
#     snapshot every SNAPSHOT_ENTRIES applied entries, default 10,000, so that the log is
#     compacted as in a group that has run for a while),
#   - a follower stopped, its data dir wiped and started again: time until it has applied
#     everything the leader had (it is sent a snapshot),
#   - the whole group stopped (SIGINT) and started again: time until the deepest file's
#     status answers (`granary fs stat`, at the masters).
#
#   bench/namespace-ha.sh [FOLDERS] [FILES_PER_FOLDER]   (default 200 × 1,000; root)
#
# Uses $GRANARY_BIN, else the debug binary scripts/test builds. The files are empty: this
# measures metadata only.
set -euo pipefail
folders="${1:-200}"
per="${2:-1000}"
total=$((folders * per))
here="$(cd "$(dirname "$0")" && pwd)"
. "$here/lib.sh"
needs_root
procs_workdir nsha
fuse_pid=""
trap 'fuse_unmount; procs_cleanup' EXIT
mkdir -p "$work/ufs/tree" "$work/mnt"
empty_tree "$work/ufs/tree" "$folders" "$per"
stat_all() { find "$1" -type f -printf '%s\n' | wc -l; }
files_of() { find "$1" -type f | wc -l; }
drop
raw_find=$(timed stat_all "$work/ufs/tree")

MASTER_LOG=info
master_flags=(--snapshot-entries "${SNAPSHOT_ENTRIES:-10000}" --allow-local-root "$work/ufs")
master_group
for i in 1 2 3; do start_master "$i"; done
for _ in $(seq 1 300); do leader > /dev/null 2>&1 && break; sleep 0.1; done
"$bin" mount add --master "$addrs" /tree "$work/ufs/tree" > /dev/null
GRANARY_LOG=warn "$bin" fuse --master "$addrs" --mount "$work/mnt" >> "$work/fuse.log" 2>&1 &
fuse_pid=$!
pids+=($fuse_pid)
for _ in $(seq 1 300); do mountpoint -q "$work/mnt" && break; sleep 0.1; done
mountpoint -q "$work/mnt" || { cat "$work/fuse.log"; exit 1; }

first=$(timed files_of "$work/mnt/tree")
drop
# CPU seconds of each master and of the mount during the warm find.
ticks() { awk '{print $14 + $15}' "/proc/$1/stat" 2>/dev/null || echo 0; }
cpu0=($(ticks "${mpid[1]}") $(ticks "${mpid[2]}") $(ticks "${mpid[3]}") $(ticks "$fuse_pid"))
warm=$(timed stat_all "$work/mnt/tree")
cpu1=($(ticks "${mpid[1]}") $(ticks "${mpid[2]}") $(ticks "${mpid[3]}") $(ticks "$fuse_pid"))
warm_cpu=$(python3 -c "import sys; a, b, hz = sys.argv[1].split(), sys.argv[2].split(), int(sys.argv[3]); d = [(int(y) - int(x)) / hz for x, y in zip(a, b)]; print(f'masters {d[0]:.1f} / {d[1]:.1f} / {d[2]:.1f} s, mount {d[3]:.1f} s')" "${cpu0[*]}" "${cpu1[*]}" "$(getconf CLK_TCK)")
warm_leader=$(leader)
for r in "$first" "$warm"; do
  [ "${r#* }" = "$total" ] || { echo "found ${r#* } files, not $total"; exit 1; }
done
fuse_unmount
fuse_pid=""

per_master() {
  for i in 1 2 3; do
    local rss kib snap
    rss=$(awk '/^VmRSS/ { print $2 }' "/proc/${mpid[$i]}/status")
    kib=$(du -sk "$work/m$i" | awk '{print $1}')
    snap=$(du -sk "$work/m$i/snapshots" 2>/dev/null | awk '{print $1}')
    echo "  master $i: data dir $((kib / 1024)) MiB ($((kib * 1024 / total)) bytes per file; snapshots $((${snap:-0} / 1024)) MiB), resident memory $((rss / 1024)) MiB ($((rss * 1024 / total)) bytes per file)"
  done
}
sizes=$(per_master)

# A wiped follower catches up.
l=$(leader)
f=$((l % 3 + 1))
target=$(applied "$l")
kill -INT "${mpid[$f]}"; wait "${mpid[$f]}" 2>/dev/null || true
rm -rf "$work/m$f"
s=$(date +%s.%N)
start_master "$f"
for _ in $(seq 1 36000); do
  a=$(applied "$f")
  [ -n "$a" ] && [ "$a" -ge "$target" ] && break
  sleep 0.1
done
e=$(date +%s.%N)
catchup=$(python3 -c "print(f'{$e - $s:.1f}')")
[ "$(applied "$f")" -ge "$target" ] || { echo "the wiped follower did not catch up"; exit 1; }
wiped_kib=$(du -sk "$work/m$f" | awk '{print $1}')
# Its peak resident memory: an install must not hold the snapshot in memory.
wiped_peak=$(awk '/^VmHWM/ { print $2 }' "/proc/${mpid[$f]}/status")
install_ms=$(grep -h "installed a snapshot" "$work/m$f.log" 2>/dev/null | sed 's/\x1b\[[0-9;]*m//g' |
  sed -nE 's/.* ms=([0-9]+).*/\1/p' | tail -1)

# The group restarts.
for i in 1 2 3; do kill -INT "${mpid[$i]}"; done
for i in 1 2 3; do wait "${mpid[$i]}" 2>/dev/null || true; done
deepest="/tree/d$(printf %05d $((folders - 1)))/f$(printf %06d $((per - 1)))"
s=$(date +%s.%N)
for i in 1 2 3; do start_master "$i"; done
for _ in $(seq 1 3000); do "$bin" fs stat --master "$addrs" "$deepest" > /dev/null 2>&1 && break; sleep 0.05; done
e=$(date +%s.%N)
"$bin" fs stat --master "$addrs" "$deepest" > /dev/null || { echo "no answer after the restart"; exit 1; }
restart=$(python3 -c "print(f'{$e - $s:.2f}')")

printf '%-58s %8s s\n' "raw find -printf %s (page cache dropped)" "${raw_find% *}" \
  "granary first find (every folder listed, through Raft)" "${first% *}" \
  "granary warm find -printf %s (page cache dropped)" "${warm% *}"
python3 -c "print(f\"{'  warm / raw':58s} {${warm% *} / max(${raw_find% *}, 0.01):8.1f} x\")"
echo "  CPU during the warm find: $warm_cpu (the leader: master $warm_leader)"
echo "after the finds:"
echo "$sizes"
echo "snapshots taken (master: index, bytes, ms):"
for i in 1 2 3; do
  grep -h "snapshot taken" "$work/m$i.log" 2>/dev/null | sed 's/\x1b\[[0-9;]*m//g' |
    sed -E 's/.*index=([0-9]+) bytes=([0-9]+) ms=([0-9]+).*/\1 \2 \3/' |
    while read -r idx b ms; do echo "  master $i: index $idx, $((b / 1048576)) MiB, $ms ms"; done || true
done
echo "wiped follower (master $f) caught up with index $target in $catchup s (data dir then $((wiped_kib / 1024)) MiB, peak resident memory $((wiped_peak / 1024)) MiB, install ${install_ms:-?} ms)"
grep -h "snapshot sent" "$work"/m*.log 2>/dev/null | tail -1 | sed 's/\x1b\[[0-9;]*m//g' | sed -E 's/.*index=([0-9]+) bytes=([0-9]+).*/  snapshot sent to it: index \1, \2 bytes/' || true
echo "group restart to serving (SIGINT all three, start, first stat of the deepest file): $restart s"
echo "binary: $bin; $folders folders × $per files = $total files"
