#!/usr/bin/env bash
# The training-loader pattern's cold epoch from an object store: LOADERS processes read a
# folder of sample objects whole, shuffled, through the FUSE mount (master, worker and
# mount as separate processes over s3s-fs), against the limit measured in the same run: a
# per-file GET loop straight from the same server with the same client library (`granary
# bench get --each`: every object GET whole, one after another, no Granary in the path).
# Then a warm epoch (page cache dropped) from the worker's disk.
#
#   bench/loader-s3.sh [FILES] [KIB] [LOADERS]   (default 2000 files of ~100 KiB, 4 loaders;
#                                                 root, scripts/setup-emulators)
#
# SHAPE_MBIT=N (RTT_MS=M, default 20) puts `flow-shaper` between the clients and the server,
# as in bench/cold-read.sh: every connection paced to N Mbit/s and every request delayed by
# M ms — a real object store's shape, where a small object's GET is mostly its round trip.
# GRANARY_FLAGS adds flags to `granary fuse` (e.g. `--warm-folder-bytes 0` for the epoch
# without folder warming). Every sample of both epochs is checked against its SHA-256.
# Uses $GRANARY_BIN, else the debug binary scripts/test builds.
set -euo pipefail
files="${1:-2000}"
kib="${2:-100}"
loaders="${3:-4}"
here="$(cd "$(dirname "$0")" && pwd)"
. "$here/lib.sh"
needs_root
shaper="${SHAPER_BIN:-$(dirname "$bin")/flow-shaper}"
tools="${GRANARY_TOOLS:-$HOME/.cache/granary/tools}"
mounts_workdir loader-s3
mounts+=("$work/mnt")
mkdir -p "$work/s3/bench" "$work/mnt"
python3 "$here/make-samples.py" "$work/s3/bench/data" "$files" "$kib" "$work/manifest"
sport=$(free_port); mport=$(free_port); fport=$(free_port); wport=$(free_port)
"$tools/bin/s3s-fs" --host 127.0.0.1 --port "$sport" --access-key bench --secret-key bench-secret \
  "$work/s3" > "$work/server.log" 2>&1 &
pids+=($!); wait_port "$sport"
shape_port "$sport"
opts=(-o region=us-east-1 -o access_key_id=bench -o secret_access_key=bench-secret
  -o allow_http=true -o "endpoint=http://127.0.0.1:$cport")

drop
direct=$("$bin" bench get s3://bench/data/ --each "${opts[@]}" --json)

GRANARY_LOG=warn "$bin" master --data-dir "$work/master" --listen "127.0.0.1:$mport" > "$work/master.log" 2>&1 &
pids+=($!); wait_port "$mport"
GRANARY_LOG=warn "$bin" worker --master "127.0.0.1:$mport" --listen 127.0.0.1:0 \
  --cache-dir "$work/cache" --cache-size "$((files * kib * 2 / 1024 + 1024))MiB" \
  --metrics-listen "127.0.0.1:$wport" > "$work/worker.log" 2>&1 &
pids+=($!)
"$bin" mount add /store s3://bench "${opts[@]}" -o sync_interval=never --master "127.0.0.1:$mport" > /dev/null
GRANARY_LOG=warn "$bin" fuse --master "127.0.0.1:$mport" --mount "$work/mnt" \
  --metrics-listen "127.0.0.1:$fport" ${GRANARY_FLAGS:-} > "$work/fuse.log" 2>&1 &
pids+=($!)
for _ in $(seq 1 100); do mountpoint -q "$work/mnt" && break; sleep 0.1; done
mountpoint -q "$work/mnt" || { cat "$work"/*.log; exit 1; }
find "$work/mnt/store" > /dev/null   # metadata loaded before timing, as for the GET loop's listing

drop; cold=$(python3 "$here/loader.py" "$work/mnt/store/data" "$work/manifest" "$loaders" 1 1)
drop; warm=$(python3 "$here/loader.py" "$work/mnt/store/data" "$work/manifest" "$loaders" 2 1)
for r in "$cold" "$warm"; do
  [ "$(echo "$r" | awk '{print $4}')" = 0 ] || { echo "samples differ from the source: $r"; exit 1; }
  [ "$(echo "$r" | awk '{print $1}')" = "$files" ] || { echo "samples missing: $r"; exit 1; }
done
warmed=$(metric_at "$fport" granary_client_warm_files_total)
if [ -n "${SHOW_METRICS:-}" ]; then
  curl -s "127.0.0.1:$wport/metrics" | grep -E '^granary_worker_(ufs_op_requests|ufs_op_seconds_(sum|count)|read_requests|cache_blocks_asked|singleflight)' || true
  curl -s "127.0.0.1:$fport/metrics" | grep -E '^granary_client_(warm|op_seconds_count|kept)' || true
fi
python3 - "$files" "$kib" "$loaders" "$direct" "$cold" "$warm" "${warmed:-0}" "${SHAPE_MBIT:-}" "${RTT_MS:-20}" <<'PY'
import json, sys
files, kib, loaders = int(sys.argv[1]), sys.argv[2], sys.argv[3]
d = json.loads(sys.argv[4])
cold, warm = sys.argv[5].split(), sys.argv[6].split()
net = f"shaped: {sys.argv[8]} Mbit/s per connection, {sys.argv[9]} ms per request" if sys.argv[8] else "loopback"
g = d["objects_per_s"]
c = int(cold[0]) / float(cold[2])
w = int(warm[0]) / float(warm[2])
print(f"{files} objects of ~{kib} KiB on s3s-fs ({net}), {loaders} loaders")
print(f"  direct per-file GET loop    {g:8.0f} objects/s  {d['mb_per_s']:7.1f} MB/s (limit)")
print(f"  granary cold (first epoch)  {c:8.0f} samples/s  {int(cold[1]) / float(cold[2]) / 1e6:7.1f} MB/s  {c / g:.2f}x the GET loop; files warmed ahead {float(sys.argv[7]):.0f}")
print(f"  granary warm (page cache dropped) {w:8.0f} samples/s")
PY
