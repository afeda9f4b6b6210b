#!/usr/bin/env bash
# Peer reads: a cached file read from a worker by a client in another process (`granary
# bench read`: the client library, no FUSE), over gRPC and over the worker's block data
# plane (`--data-listen`: framed plain TCP, whole pages by sendfile), against raw TCP on
# loopback measured in the same run (`granary bench tcp`: one connection, 1 MiB writes).
# The goal is ≥ 0.8× raw TCP for the data plane.
#
#   bench/peer-read.sh [SIZE_MIB] [ROUNDS]     (default 1024 3)
#
# TLS=1: every process with mutual TLS (certificates made by `granary cert` in the run's
# folder; the client reads as `admin`), and the limit is one raw rustls stream on loopback
# (`granary bench tls`) instead of raw TCP.
#
# After one cold pass, ROUNDS rounds each way in alternating order, each round one client
# process reading the file 3 times (its first pass fills the client's reusable buffers;
# the figure is the median of the other two); medians of the rounds. CPU seconds per GB
# of the worker (from /proc) and of the client (`time`, all 3 passes) are printed for each
# way. Uses $GRANARY_BIN, else the debug binary scripts/test builds.
set -euo pipefail
size_mib="${1:-1024}" rounds="${2:-3}"
. "$(dirname "$0")/lib.sh"
procs_workdir peer
mkdir -p "$work/ufs"
head -c "$((size_mib * 1048576))" /dev/urandom > "$work/ufs/big.bin"
master_env=() node_env=() limit=tcp
if [ "${TLS:-0}" = 1 ]; then
  "$bin" cert init --ca-dir "$work/ca" > /dev/null
  "$bin" cert issue master-1 --role master --master-id 1 --ca-dir "$work/ca" --out "$work/tls-master" > /dev/null
  "$bin" cert issue node --role node --ca-dir "$work/ca" --out "$work/tls-node" > /dev/null
  "$bin" cert issue admin --role admin --ca-dir "$work/ca" --out "$work/tls-admin" > /dev/null
  export GRANARY_INSECURE=0 GRANARY_TLS_DIR="$work/tls-admin"
  master_env=(GRANARY_TLS_DIR="$work/tls-master") node_env=(GRANARY_TLS_DIR="$work/tls-node")
  limit=tls
fi
mport=$(free_port)
env "${master_env[@]}" GRANARY_LOG=warn "$bin" master --data-dir "$work/master" --listen "127.0.0.1:$mport" \
  --allow-local-root "$work" > "$work/master.log" 2>&1 &
pids+=($!); wait_port "$mport"
env "${node_env[@]}" GRANARY_LOG=info "$bin" worker --master "127.0.0.1:$mport" --listen 127.0.0.1:0 \
  --data-listen 127.0.0.1:0 \
  --cache-dir "$work/cache" --cache-size "$((size_mib * 2))MiB" > "$work/worker.log" 2>&1 &
wpid=$!; pids+=($wpid)
for _ in $(seq 1 100); do grep -q "listening on" "$work/worker.log" && break; sleep 0.1; done
wait_live "127.0.0.1:$mport" 1
"$bin" mount add /d "$work/ufs" --master "127.0.0.1:$mport" -o sync_interval=never > /dev/null
tcp=$("$bin" bench "$limit" --size "$((size_mib * 2))MiB" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["mb_per_s"])')

ticks() { awk '{ print $14 + $15 }' "/proc/$wpid/stat"; }
# pass N FLAGS...: one client reading the file N times; prints "MB/s worker-cpu-s
# client-cpu-s" (MB/s: the median of passes 2..N, or pass 1 alone; CPU: per pass)
pass() {
  local t0 t1 out n=$1; shift
  t0=$(ticks)
  out=$(/usr/bin/time -o "$work/cpu" -f "%U %S" "$bin" bench read /d/big.bin --passes "$n" \
      --json --master "127.0.0.1:$mport" "$@" 2>> "$work/client.log")
  t1=$(ticks)
  python3 - "$out" "$t0" "$t1" "$(getconf CLK_TCK)" "$(cat "$work/cpu")" <<'PY'
import json, statistics, sys
out, t0, t1, hz = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
p = json.loads(out)["passes"]
u, s = (float(x) for x in sys.argv[5].split())
mbs = statistics.median(x["mb_per_s"] for x in (p[1:] or p))
print(mbs, (t1 - t0) / hz / len(p), (u + s) / len(p))
PY
}
cold=$(pass 1)
grpc=() dp=()
for round in $(seq 1 "$rounds"); do
  if [ $((round % 2)) = 1 ]; then
    grpc+=("$(pass 3 --no-data-plane)"); dp+=("$(pass 3)")
  else
    dp+=("$(pass 3)"); grpc+=("$(pass 3 --no-data-plane)")
  fi
done
# Short-circuit (no socket): the client reads the worker's files as the worker's node
# (not done as the TLS run's `admin`).
sc=""
[ "$limit" = tcp ] && sc=$(pass 3 --short-circuit)
served=$(grep -c "block data plane serving" "$work/worker.log" || true)
python3 - "$tcp" "$size_mib" "$bin" "$cold" "$sc" "$served" "$limit" "${#grpc[@]}" "${grpc[@]}" "${dp[@]}" <<'PY'
import statistics, sys
tcp, mib, binary, cold, sc, served, limit, n = sys.argv[1:9]
tcp, mib, n = float(tcp), int(mib), int(n)
raw = "raw TCP" if limit == "tcp" else "raw TLS"
rows = [tuple(float(x) for x in r.split()) for r in sys.argv[9:]]
grpc, dp = rows[:n], rows[n:]
gb = mib * 1048576 / 1e9
def show(label, rs):
    mbs = statistics.median(r[0] for r in rs)
    w = statistics.median(r[1] for r in rs) / gb
    c = statistics.median(r[2] for r in rs) / gb
    each = " ".join(f"{r[0]:.0f}" for r in rs)
    print(f"{label:<24} {mbs:6.0f} MB/s  {mbs / tcp:.2f}x of {raw}   CPU per GB: worker {w:.2f} s, client {c:.2f} s   (passes: {each} MB/s)")
print(f"binary:                  {binary}")
print(f"file:                    {mib} MiB, cached by the cold pass; medians of {n} alternating rounds")
print(f"{raw + ', loopback:':<24} {tcp:.0f} MB/s (limit{', mutual TLS' if limit == 'tls' else ''})")
show("cold (fills the cache)", [tuple(float(x) for x in cold.split())])
show("warm over gRPC", grpc)
show("warm over the data plane", dp)
if sc:
    show("warm, short-circuit", [tuple(float(x) for x in sc.split())])
if served != "1":
    print("the worker did not serve a data plane!")
PY
