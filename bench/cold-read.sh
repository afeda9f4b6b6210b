#!/usr/bin/env bash
# Cold sequential read of one large object through the FUSE mount (master + worker + fuse
# processes over an object-store test server), against the limit measured in the same run:
# a single-stream GET of the same object from the same server with the same client
# library (`granary bench get`: object_store, no Granary in the path).
#
#   bench/cold-read.sh [azure|s3] [SIZE_MIB]    (default: azure 1024; needs root for FUSE
#                                                and scripts/setup-emulators)
#
# SHAPE_MBIT=N (optionally RTT_MS=M, default 20) puts `flow-shaper` (tests/src/bin) between
# the clients and the server: every TCP connection's downloads paced to N Mbit/s and each
# request delayed by M ms — the shape of a real object store, where one connection gets a
# bounded share of bandwidth and the first byte takes a round trip. Unset: plain loopback,
# where one stream is limited only by the CPU that server, worker, FUSE daemon and reader
# share on this machine. (`cargo build --release --bin flow-shaper` builds it beside a release
# granary; SHAPER_BIN overrides.)
#
# WORKER_FLAGS adds flags to the worker (e.g. "--data-listen 127.0.0.1:0": the mount then
# reads from it over its block data plane). SHOW_METRICS=1 prints the worker's under-store
# counters after the cold read;
# PERF_WORKER=FILE records the worker with `perf record -g` during it.
#
# azure: Azurite, in memory. s3: s3s-fs (its ranged GETs slow down with object size, so
# its numbers measure the server). Uses $GRANARY_BIN, else the debug binary scripts/test
# builds. The under-store issue's goal is cold ≥ 1.5× the single-stream GET.
set -euo pipefail
store="${1:-azure}"
size_mib="${2:-1024}"
here="$(cd "$(dirname "$0")/.." && pwd)"
. "$(dirname "$0")/lib.sh"
shaper="${SHAPER_BIN:-$(dirname "$bin")/flow-shaper}"
tools="${GRANARY_TOOLS:-$HOME/.cache/granary/tools}"
work="$(mktemp -d /tmp/granary-bench-cold-XXXXXX)"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  sleep 0.5
  mountpoint -q "$work/mnt" && umount -l "$work/mnt" || true
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
mkdir -p "$work/src" "$work/mnt"
head -c "$((size_mib * 1024 * 1024))" /dev/urandom > "$work/src/big.bin"
bytes=$((size_mib * 1024 * 1024))
sport=$(free_port); mport=$(free_port)
case "$store" in
  azure)
    (cd "$work" && exec "$tools/node/node_modules/.bin/azurite-blob" --blobHost 127.0.0.1 \
      --blobPort "$sport" --inMemoryPersistence --skipApiVersionCheck --loose --disableTelemetry \
      > "$work/server.log" 2>&1) &
    pids+=($!); wait_port "$sport"
    "$tools/venv/bin/python" "$here/tests/fixtures/stores.py" azure "http://127.0.0.1:$sport" bench "$work/src"
    shape_port "$sport"
    export AZURITE_BLOB_STORAGE_URL="http://127.0.0.1:$cport"
    uri=az://bench; opts=(-o use_emulator=true) ;;
  s3)
    mkdir -p "$work/s3"; mv "$work/src" "$work/s3/bench"; mkdir -p "$work/src"
    "$tools/bin/s3s-fs" --host 127.0.0.1 --port "$sport" --access-key bench --secret-key bench-secret \
      "$work/s3" > "$work/server.log" 2>&1 &
    pids+=($!); wait_port "$sport"
    ln -s "$work/s3/bench/big.bin" "$work/src/big.bin"
    shape_port "$sport"
    uri=s3://bench; opts=(-o region=us-east-1 -o access_key_id=bench -o secret_access_key=bench-secret
      -o allow_http=true -o "endpoint=http://127.0.0.1:$cport") ;;
  *) echo "usage: $0 [azure|s3] [SIZE_MIB]" >&2; exit 2 ;;
esac

ticks() { awk '{print $14 + $15}' "/proc/$1/stat" 2>/dev/null || echo 0; }
server_pid=${pids[0]}
t_direct=$(ticks "$server_pid")
direct_json=$("$bin" bench get "$uri/big.bin" "${opts[@]}" --json)
direct=$(python3 -c "import json,sys; print(json.loads(sys.argv[1])['seconds'])" "$direct_json")
t_direct=$(( $(ticks "$server_pid") - t_direct ))

GRANARY_LOG=warn "$bin" master --data-dir "$work/master" --listen "127.0.0.1:$mport" > "$work/master.log" 2>&1 &
pids+=($!); wait_port "$mport"
wmport=$(free_port)
GRANARY_LOG=warn "$bin" worker --master "127.0.0.1:$mport" --listen 127.0.0.1:0 --metrics-listen "127.0.0.1:$wmport" \
  --cache-dir "$work/cache" --cache-size "$((size_mib * 2))MiB" ${WORKER_FLAGS:-} > "$work/worker.log" 2>&1 &
pids+=($!)
"$bin" mount add /store "$uri" --master "127.0.0.1:$mport" "${opts[@]}" -o sync_interval=never > /dev/null
GRANARY_LOG=warn "$bin" fuse --master "127.0.0.1:$mport" --mount "$work/mnt" > "$work/fuse.log" 2>&1 &
pids+=($!)
for _ in $(seq 1 100); do mountpoint -q "$work/mnt" && break; sleep 0.1; done
mountpoint -q "$work/mnt" || { cat "$work"/*.log; exit 1; }
ls -l "$work/mnt/store/" > /dev/null   # metadata loaded before timing
timed_cat() { local t0 t1; t0=$(date +%s.%N); cat "$1" > /dev/null; t1=$(date +%s.%N); python3 -c "print($t1 - $t0)"; }
if [ -n "${PERF_WORKER:-}" ]; then
  perf record -g -o "$PERF_WORKER" -p "$(pgrep -f "worker --master 127.0.0.1:$mport")" 2>/dev/null &
  perf_pid=$!; sleep 0.5
fi
worker_pid=$(pgrep -f "worker --master 127.0.0.1:$mport" | head -1)
fuse_pid=$(pgrep -f "fuse --master 127.0.0.1:$mport" | head -1)
t_srv=$(ticks "$server_pid"); t_wrk=$(ticks "$worker_pid"); t_fuse=$(ticks "$fuse_pid")
cold=$(timed_cat "$work/mnt/store/big.bin")
hz=$(getconf CLK_TCK)
cpu_line=$(python3 -c "
import sys
hz, gb = float(sys.argv[1]), $bytes / 1e9
d = [(int(b) - int(a)) / hz / gb for a, b in zip(sys.argv[2::2], sys.argv[3::2])]
print(f'server {d[0]:.2f}, worker {d[1]:.2f}, FUSE daemon {d[2]:.2f}')
" "$hz" "$t_srv" "$(ticks "$server_pid")" "$t_wrk" "$(ticks "$worker_pid")" "$t_fuse" "$(ticks "$fuse_pid")")
if [ -n "${PERF_WORKER:-}" ]; then kill -INT "$perf_pid"; wait "$perf_pid" || true; fi
if [ -n "${SHOW_METRICS:-}" ]; then curl -s "127.0.0.1:$wmport/metrics" | grep -E "^granary_worker_(ufs|cache|prefetch|uncached|read)" | grep -v bucket; fi
warm=$(timed_cat "$work/mnt/store/big.bin")
cmp -s "$work/src/big.bin" "$work/mnt/store/big.bin" || { echo "bytes differ!"; exit 1; }

mbps() { python3 -c "print(f'{$bytes / $1 / 1e6:.0f}')"; }
echo "binary:                      $bin"
if [ -n "${SHAPE_MBIT:-}" ]; then net="shaped: ${SHAPE_MBIT} Mbit/s per connection, ${RTT_MS:-20} ms per request"; else net=loopback; fi
echo "object:                      ${size_mib} MiB on $store ($net)"
echo "direct single-stream GET:    $(mbps "$direct") MB/s (limit)"
echo "granary cold (FUSE, cat):    $(mbps "$cold") MB/s  ($(python3 -c "print(f'{$direct / $cold:.2f}')")x of the direct GET)"
echo "granary warm (FUSE, cat):    $(mbps "$warm") MB/s"
echo "cold CPU s per GB:           $cpu_line (server during the direct GET: $(python3 -c "print(f'{$t_direct / $(getconf CLK_TCK) / ($bytes / 1e9):.2f}')"))"
