#!/usr/bin/env bash
# `granary load` of a dataset of many small files and a few large ones onto 3 workers,
# against `cp -r` of the same tree out of the under-store, in the same run. The under-store
# is a local folder (STORE=folder, default: cp -r reads the very files Granary loads), or
# an S3 server (STORE=s3: s3s-fs serving that folder; cp -r then reads its folder, the
# disk read that bounds what the server can send). Checks that the load ends 100 % cached
# and that the workers read every byte from the store exactly once.
#
#   bench/load.sh [FILES] [KIB] [LARGE] [LARGE_MIB]   (default 20000 64 4 256; STORE=s3
#                                                      needs scripts/setup-emulators)
#
# Also reports the master's peak memory (VmHWM) and its growth over the load, per file
# (the load lists the tree too, so this includes the namespace's own share: RocksDB and
# the bounded state cache). CP=0 skips the
# `cp -r` limit (for runs of a million files, where the copy would double the disk used).
#
# Uses $GRANARY_BIN, else the debug binary scripts/test builds.
set -euo pipefail
files="${1:-20000}"
kib="${2:-64}"
large="${3:-4}"
large_mib="${4:-256}"
. "$(dirname "$0")/lib.sh"
needs_root
tools="${GRANARY_TOOLS:-$HOME/.cache/granary/tools}"
procs_workdir load

mkdir -p "$work/s3/data"
python3 - "$work/s3/data" "$files" "$kib" "$large" "$large_mib" <<'PY'
import os, sys
root, n, kib, large, large_mib = sys.argv[1], *map(int, sys.argv[2:])
blob = os.urandom(kib * 1024 + 4096)
for i in range(n):
    d = os.path.join(root, "small", f"d{i // 1000:03d}")
    if i % 1000 == 0:
        os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, f"s{i:06d}.jpg"), "wb") as f:
        f.write(blob[i % 4096:i % 4096 + kib * 1024])
os.makedirs(os.path.join(root, "large"), exist_ok=True)
for i in range(large):
    with open(os.path.join(root, "large", f"l{i}.bin"), "wb") as f:
        for _ in range(large_mib):
            f.write(os.urandom(1 << 20))
PY
total=$(find "$work/s3/data" -type f -printf '%s\n' | awk '{s += $1} END {printf "%.0f\n", s}')

drop
t0=$(date +%s.%N)
if [ "${CP:-1}" != 0 ]; then cp -r "$work/s3/data" "$work/copy"; sync; fi
t1=$(date +%s.%N)
# The copy stays until the end: on ext4 without a journal (this machine's disk), files
# created within a minute of deleting many others cost a scan past every recently deleted
# inode, so deleting it here would slow the load's block files, not cp's.

if [ "${STORE:-folder}" = s3 ]; then
  sport=$(free_port)
  "$tools/bin/s3s-fs" --host 127.0.0.1 --port "$sport" --access-key bench --secret-key bench-secret \
    "$work/s3" > "$work/s3s.log" 2>&1 &
  pids+=($!); wait_port "$sport"
  mount_args=(s3://data -o region=us-east-1 -o access_key_id=bench -o secret_access_key=bench-secret
    -o allow_http=true -o "endpoint=http://127.0.0.1:$sport" -o sync_interval=never)
else
  mount_args=("$work/s3/data" -o sync_interval=never)
fi
mport=$(free_port); maddr="127.0.0.1:$mport"
GRANARY_LOG=warn "$bin" master --data-dir "$work/master" --listen "$maddr" --allow-local-root "$work" \
  > "$work/master.log" 2>&1 &
master_pid=$!; pids+=($!); wait_port "$mport"
wports=()
for w in 1 2 3; do
  wmp=$(free_port); wports+=("$wmp")
  GRANARY_LOG=warn "$bin" worker --master "$maddr" --listen 127.0.0.1:0 --metrics-listen "127.0.0.1:$wmp" \
    --cache-dir "$work/w$w" --cache-size "$((total / 1048576 + 1024))MiB" > "$work/w$w.log" 2>&1 &
  pids+=($!)
done
wait_live "$maddr" 3
"$bin" mount add /data "${mount_args[@]}" --master "$maddr" > /dev/null
kib_of() { awk -v k="$2" '$1 == k":" {print $2}' "/proc/$1/status"; }
rss_before=$(kib_of "$master_pid" VmRSS)
drop
t2=$(date +%s.%N)
"$bin" load /data --json --master "$maddr" > "$work/job.json" || true
t3=$(date +%s.%N)
rss_after=$(kib_of "$master_pid" VmRSS); hwm=$(kib_of "$master_pid" VmHWM)
ufs=0; for p in "${wports[@]}"; do ufs=$((ufs + $(metric_at "$p" granary_worker_ufs_read_bytes_total))); done
python3 - "$work/job.json" "$total" "$ufs" "$t0" "$t1" "$t2" "$t3" "$files" "$large" "${STORE:-folder}" \
  "$rss_before" "$rss_after" "$hwm" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
total, ufs = int(sys.argv[2]), int(sys.argv[3])
t0, t1, t2, t3 = map(float, sys.argv[4:8])
n = int(sys.argv[8]) + int(sys.argv[9])
if j["state"] != "succeeded" or j["done_bytes"] != total:
    sys.exit(f"the load did not cache everything: {json.dumps(j)[:2000]}")
cp, load = t1 - t0, t3 - t2
before, after, hwm = (int(v) * 1024 for v in sys.argv[11:14])
print(f"dataset: {n} files, {total / 1e6:.0f} MB, under-store: {sys.argv[10]}")
if cp > 0.05:
    print(f"cp -r from the under-store (limit)     {cp:7.1f} s  {total / cp / 1e6:6.0f} MB/s")
    print(f"granary load, 3 workers                {load:7.1f} s  {total / load / 1e6:6.0f} MB/s  ({cp / load:.2f}x the speed of cp -r)")
else:
    print(f"granary load, 3 workers                {load:7.1f} s  {total / load / 1e6:6.0f} MB/s  {n / load:8.0f} files/s (cp -r not run)")
print(f"cached {j['cached_percent']:.2f} %, under-store bytes / dataset = {ufs / total:.4f}")
print(f"master memory: {before / 1e6:.0f} MB before the load, {after / 1e6:.0f} MB after it, peak {hwm / 1e6:.0f} MB; "
      f"(peak - before) / files = {(hwm - before) / n:.0f} B")
PY
