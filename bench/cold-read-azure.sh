#!/usr/bin/env bash
# Cold sequential read of one large object through the FUSE mount (master + worker + fuse,
# Azure Blob under-store on Azurite, in memory), against the limit measured in the same
# run: a single-stream GET of the same object from the same server with the same client
# library (`granary bench get`, object_store, no Granary in the path).
#
#   bench/cold-read-azure.sh [SIZE_MIB]     (default 1024; needs root for FUSE and
#                                             scripts/setup-emulators for Azurite)
#
# Uses $GRANARY_BIN, else the debug binary scripts/test builds. The goal (under-store
# issue) is ≥ 1.5× the single-stream GET.
set -euo pipefail
size_mib="${1:-1024}"
here="$(cd "$(dirname "$0")/.." && pwd)"
bin="${GRANARY_BIN:-${CARGO_TARGET_DIR:-$HOME/.cache/granary/target}/debug/granary}"
tools="${GRANARY_TOOLS:-$HOME/.cache/granary/tools}"
work="$(mktemp -d /tmp/granary-bench-az-XXXXXX)"
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
mkdir -p "$work/src" "$work/mnt"
head -c "$((size_mib * 1024 * 1024))" /dev/urandom > "$work/src/big.bin"
bytes=$((size_mib * 1024 * 1024))
azport=$(free_port); mport=$(free_port)
(cd "$work" && exec "$tools/node/node_modules/.bin/azurite-blob" --blobHost 127.0.0.1 --blobPort "$azport" \
  --inMemoryPersistence --skipApiVersionCheck --loose --disableTelemetry > "$work/azurite.log" 2>&1) &
pids+=($!)
for _ in $(seq 1 100); do (exec 3<>/dev/tcp/127.0.0.1/$azport) 2>/dev/null && break; sleep 0.1; done
"$tools/venv/bin/python" "$here/tests/fixtures/stores.py" azure "http://127.0.0.1:$azport" bench "$work/src"
export AZURITE_BLOB_STORAGE_URL="http://127.0.0.1:$azport"

direct_json=$("$bin" bench get az://bench/big.bin -o use_emulator=true --json)
direct=$(python3 -c "import json,sys; print(json.loads(sys.argv[1])['seconds'])" "$direct_json")

GRANARY_LOG=warn "$bin" master --data-dir "$work/master" --listen "127.0.0.1:$mport" > "$work/master.log" 2>&1 &
pids+=($!)
sleep 1
GRANARY_LOG=warn "$bin" worker --master "127.0.0.1:$mport" --listen 127.0.0.1:0 \
  --cache-dir "$work/cache" --cache-size "$((size_mib * 2))MiB" > "$work/worker.log" 2>&1 &
pids+=($!)
"$bin" mount add /az az://bench --master "127.0.0.1:$mport" -o use_emulator=true -o sync_interval=never > /dev/null
GRANARY_LOG=warn "$bin" fuse --master "127.0.0.1:$mport" --mount "$work/mnt" > "$work/fuse.log" 2>&1 &
pids+=($!)
for _ in $(seq 1 100); do mountpoint -q "$work/mnt" && break; sleep 0.1; done
mountpoint -q "$work/mnt" || { cat "$work"/*.log; exit 1; }
ls -l "$work/mnt/az/" > /dev/null   # metadata loaded before timing
t0=$(date +%s.%N); cat "$work/mnt/az/big.bin" > /dev/null; t1=$(date +%s.%N)
cold=$(python3 -c "print($t1 - $t0)")
t0=$(date +%s.%N); cat "$work/mnt/az/big.bin" > /dev/null; t1=$(date +%s.%N)
warm=$(python3 -c "print($t1 - $t0)")
cmp -s "$work/src/big.bin" "$work/mnt/az/big.bin" || { echo "bytes differ!"; exit 1; }

mbps() { python3 -c "print(f'{$bytes / $1 / 1e6:.0f}')"; }
echo "binary:                      $bin"
echo "object:                      ${size_mib} MiB on Azurite (loopback, in memory)"
echo "direct single-stream GET:    $(mbps "$direct") MB/s (limit)"
echo "granary cold (FUSE, cat):    $(mbps "$cold") MB/s  ($(python3 -c "print(f'{$direct / $cold:.2f}')")x of the direct GET)"
echo "granary warm (FUSE, cat):    $(mbps "$warm") MB/s"
