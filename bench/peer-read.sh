#!/usr/bin/env bash
# Peer reads: a cached file read from a worker over gRPC by a client in another process
# (`granary bench read`: the client library, no FUSE), against raw TCP on loopback measured
# in the same run (`granary bench tcp`: one connection, 1 MiB writes). The cluster-cache
# issue's goal is ≥ 0.8× raw TCP.
#
#   bench/peer-read.sh [SIZE_MIB]     (default 1024)
#
# Uses $GRANARY_BIN, else the debug binary scripts/test builds.
set -euo pipefail
size_mib="${1:-1024}"
. "$(dirname "$0")/lib.sh"
procs_workdir peer
mkdir -p "$work/ufs"
head -c "$((size_mib * 1048576))" /dev/urandom > "$work/ufs/big.bin"
mport=$(free_port)
GRANARY_LOG=warn "$bin" master --data-dir "$work/master" --listen "127.0.0.1:$mport" \
  --allow-local-root "$work" > "$work/master.log" 2>&1 &
pids+=($!); wait_port "$mport"
GRANARY_LOG=warn "$bin" worker --master "127.0.0.1:$mport" --listen 127.0.0.1:0 \
  --cache-dir "$work/cache" --cache-size "$((size_mib * 2))MiB" > "$work/worker.log" 2>&1 &
pids+=($!)
for _ in $(seq 1 100); do grep -q "listening on" "$work/worker.log" && break; sleep 0.1; done
sleep 1.5 # first heartbeat: the worker is live for clients
"$bin" mount add /d "$work/ufs" --master "127.0.0.1:$mport" -o sync_interval=never > /dev/null
tcp=$("$bin" bench tcp --size "$((size_mib * 2))MiB" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["mb_per_s"])')
read_json=$("$bin" bench read /d/big.bin --passes 3 --json --master "127.0.0.1:$mport")
# The same warm reads from this node's worker without a socket (short-circuit).
sc_json=$("$bin" bench read /d/big.bin --passes 2 --short-circuit --json --master "127.0.0.1:$mport")
python3 - "$tcp" "$read_json" "$bin" "$size_mib" "$sc_json" <<'PY'
import json, sys
tcp = float(sys.argv[1]); r = json.loads(sys.argv[2]); sc = json.loads(sys.argv[5])
print(f"binary:                 {sys.argv[3]}")
print(f"file:                   {sys.argv[4]} MiB, cached after pass 1")
print(f"raw TCP, loopback:      {tcp:.0f} MB/s (limit)")
for p in r["passes"]:
    label = "cold (fills the cache)" if p["pass"] == 1 else "warm (peer read)"
    print(f"pass {p['pass']} {label:<22} {p['mb_per_s']:.0f} MB/s ({p['mb_per_s'] / tcp:.2f}x of raw TCP)")
for p in sc["passes"]:
    label = "warm (short-circuit)"
    print(f"pass {p['pass']} {label:<22} {p['mb_per_s']:.0f} MB/s ({p['mb_per_s'] / tcp:.2f}x of raw TCP)")
PY
