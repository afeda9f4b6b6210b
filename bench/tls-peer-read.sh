#!/usr/bin/env bash
# TLS on vs off for a warm peer read: the same cached file read from a worker over gRPC
# (`granary bench read`, no short-circuit) by a client in another process, once with
# every process plaintext (--insecure) and once with mutual TLS (certificates made by
# `granary cert` in the run's folder); raw TCP on loopback is measured in the same run.
#
#   bench/tls-peer-read.sh [SIZE_MIB]     (default 1024)
#
# Uses $GRANARY_BIN, else the debug binary scripts/test builds.
set -euo pipefail
size_mib="${1:-1024}"
. "$(dirname "$0")/lib.sh"
procs_workdir tls-peer
mkdir -p "$work/ufs"
head -c "$((size_mib * 1048576))" /dev/urandom > "$work/ufs/big.bin"
"$bin" cert init --ca-dir "$work/ca" > /dev/null
"$bin" cert issue master-1 --role master --master-id 1 --ca-dir "$work/ca" --out "$work/tls-master" > /dev/null
"$bin" cert issue node --role node --ca-dir "$work/ca" --out "$work/tls-node" > /dev/null
"$bin" cert issue admin --role admin --ca-dir "$work/ca" --out "$work/tls-admin" > /dev/null

# run MODE: starts a master and a worker in MODE (insecure|tls), reads the file 3 times,
# prints the JSON of `bench read`, stops them.
run() {
  local mode="$1" master_env node_env admin_env mport wpid mpid
  if [ "$mode" = tls ]; then
    master_env=(GRANARY_INSECURE=0 GRANARY_TLS_DIR="$work/tls-master")
    node_env=(GRANARY_INSECURE=0 GRANARY_TLS_DIR="$work/tls-node")
    admin_env=(GRANARY_INSECURE=0 GRANARY_TLS_DIR="$work/tls-admin")
  else
    master_env=(GRANARY_INSECURE=1); node_env=(GRANARY_INSECURE=1); admin_env=(GRANARY_INSECURE=1)
  fi
  mport=$(free_port)
  env "${master_env[@]}" GRANARY_LOG=warn "$bin" master --data-dir "$work/$mode-master" \
    --listen "127.0.0.1:$mport" --allow-local-root "$work" > "$work/$mode-master.log" 2>&1 &
  mpid=$!; pids+=($mpid); wait_port "$mport"
  env "${node_env[@]}" GRANARY_LOG=warn "$bin" worker --master "127.0.0.1:$mport" \
    --listen 127.0.0.1:0 --cache-dir "$work/$mode-cache" --cache-size "$((size_mib * 2))MiB" \
    > "$work/$mode-worker.log" 2>&1 &
  wpid=$!; pids+=($wpid)
  for _ in $(seq 1 100); do grep -q "listening on" "$work/$mode-worker.log" && break; sleep 0.1; done
  sleep 1.5 # first heartbeat: the worker is live for clients
  env "${admin_env[@]}" "$bin" mount add /d "$work/ufs" --master "127.0.0.1:$mport" -o sync_interval=never > /dev/null
  env "${admin_env[@]}" "$bin" bench read /d/big.bin --passes 3 --json --master "127.0.0.1:$mport"
  kill "$wpid" "$mpid"; wait "$wpid" "$mpid" 2>/dev/null || true
}

tcp=$("$bin" bench tcp --size "$((size_mib * 2))MiB" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["mb_per_s"])')
plain=$(run insecure)
tls=$(run tls)
python3 - "$tcp" "$plain" "$tls" "$bin" "$size_mib" <<'PY'
import json, sys
tcp = float(sys.argv[1]); plain = json.loads(sys.argv[2]); tls = json.loads(sys.argv[3])
warm = lambda r: max(p["mb_per_s"] for p in r["passes"] if p["pass"] > 1)
print(f"binary:             {sys.argv[4]}")
print(f"file:               {sys.argv[5]} MiB, cached after pass 1")
print(f"raw TCP, loopback:  {tcp:.0f} MB/s (limit)")
print(f"warm peer read, plaintext:  {warm(plain):.0f} MB/s ({warm(plain) / tcp:.2f}x of raw TCP)")
print(f"warm peer read, mutual TLS: {warm(tls):.0f} MB/s ({warm(tls) / tcp:.2f}x of raw TCP)")
print(f"TLS / plaintext:    {warm(tls) / warm(plain):.2f}")
PY
