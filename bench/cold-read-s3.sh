#!/usr/bin/env bash
# Cold sequential read of one large object through the FUSE mount (master + worker + fuse,
# S3 under-store on s3s-fs), against the limit measured in the same run: a single-stream
# GET of the same object straight from the same server with the same client library
# (`granary bench get`, object_store, no Granary in the path).
#
#   bench/cold-read-s3.sh [SIZE_MIB]        (default 1024; needs root for FUSE and
#                                             scripts/setup-emulators for s3s-fs)
#
# Uses $GRANARY_BIN, else the debug binary scripts/test builds. The goal (under-store
# issue) is ≥ 1.5× the single-stream GET.
set -euo pipefail
size_mib="${1:-1024}"
bin="${GRANARY_BIN:-${CARGO_TARGET_DIR:-$HOME/.cache/granary/target}/debug/granary}"
tools="${GRANARY_TOOLS:-$HOME/.cache/granary/tools}"
work="$(mktemp -d /tmp/granary-bench-s3-XXXXXX)"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  sleep 0.5
  mountpoint -q "$work/mnt" && umount -l "$work/mnt" || true
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
mkdir -p "$work/s3/bench" "$work/mnt"
head -c "$((size_mib * 1024 * 1024))" /dev/urandom > "$work/s3/bench/big.bin"
bytes=$((size_mib * 1024 * 1024))
s3port=$(free_port); mport=$(free_port)
key=bench-access; secret=bench-secret-key
"$tools/bin/s3s-fs" --host 127.0.0.1 --port "$s3port" --access-key "$key" --secret-key "$secret" \
  "$work/s3" > "$work/s3.log" 2>&1 &
pids+=($!)
for _ in $(seq 1 100); do (exec 3<>/dev/tcp/127.0.0.1/$s3port) 2>/dev/null && break; sleep 0.1; done
sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || true

secs() { python3 -c "print($2 - $1)"; }
opts=(-o region=us-east-1 -o "access_key_id=$key" -o "secret_access_key=$secret" -o allow_http=true
  -o "endpoint=http://127.0.0.1:$s3port")
direct_json=$("$bin" bench get s3://bench/big.bin "${opts[@]}" --json)
direct=$(python3 -c "import json,sys; print(json.loads(sys.argv[1])['seconds'])" "$direct_json")

GRANARY_LOG=warn "$bin" master --data-dir "$work/master" --listen "127.0.0.1:$mport" > "$work/master.log" 2>&1 &
pids+=($!)
sleep 1
GRANARY_LOG=warn "$bin" worker --master "127.0.0.1:$mport" --listen 127.0.0.1:0 \
  --cache-dir "$work/cache" --cache-size "$((size_mib * 2))MiB" > "$work/worker.log" 2>&1 &
pids+=($!)
"$bin" mount add /s3 s3://bench --master "127.0.0.1:$mport" "${opts[@]}" -o sync_interval=never > /dev/null
GRANARY_LOG=warn "$bin" fuse --master "127.0.0.1:$mport" --mount "$work/mnt" > "$work/fuse.log" 2>&1 &
pids+=($!)
for _ in $(seq 1 100); do mountpoint -q "$work/mnt" && break; sleep 0.1; done
mountpoint -q "$work/mnt" || { cat "$work"/*.log; exit 1; }
ls -l "$work/mnt/s3/" > /dev/null   # metadata loaded before timing
t0=$(date +%s.%N); cat "$work/mnt/s3/big.bin" > /dev/null; t1=$(date +%s.%N)
cold=$(secs "$t0" "$t1")
t0=$(date +%s.%N); cat "$work/mnt/s3/big.bin" > /dev/null; t1=$(date +%s.%N)
warm=$(secs "$t0" "$t1")
cmp -s "$work/s3/bench/big.bin" "$work/mnt/s3/big.bin" || { echo "bytes differ!"; exit 1; }

mbps() { python3 -c "print(f'{$bytes / $1 / 1e6:.0f}')"; }
echo "binary:                      $bin"
echo "object:                      ${size_mib} MiB on s3s-fs (loopback)"
echo "direct single-stream GET:    $(mbps "$direct") MB/s (limit)"
echo "granary cold (FUSE, cat):    $(mbps "$cold") MB/s  ($(python3 -c "print(f'{$direct / $cold:.2f}')")x of the direct GET)"
echo "granary warm (FUSE, cat):    $(mbps "$warm") MB/s"
