#!/usr/bin/env bash
# Peer reads: a cached file read from a worker by a client in another process (`granary
# bench read`: the client library, no FUSE), over gRPC and over the worker's block data
# plane (`--data-listen`: framed plain TCP, whole pages by sendfile), against raw TCP on
# loopback measured in the same run (`granary bench tcp`: one connection, 1 MiB writes).
# The goal is ≥ 0.8× raw TCP for the data plane.
#
#   bench/peer-read.sh [SIZE_MIB] [ROUNDS]     (default 1024 3)
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
mport=$(free_port)
GRANARY_LOG=warn "$bin" master --data-dir "$work/master" --listen "127.0.0.1:$mport" \
  --allow-local-root "$work" > "$work/master.log" 2>&1 &
pids+=($!); wait_port "$mport"
GRANARY_LOG=info "$bin" worker --master "127.0.0.1:$mport" --listen 127.0.0.1:0 \
  --data-listen 127.0.0.1:0 \
  --cache-dir "$work/cache" --cache-size "$((size_mib * 2))MiB" > "$work/worker.log" 2>&1 &
wpid=$!; pids+=($wpid)
for _ in $(seq 1 100); do grep -q "listening on" "$work/worker.log" && break; sleep 0.1; done
wait_live "127.0.0.1:$mport" 1
"$bin" mount add /d "$work/ufs" --master "127.0.0.1:$mport" -o sync_interval=never > /dev/null
tcp=$("$bin" bench tcp --size "$((size_mib * 2))MiB" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["mb_per_s"])')

ticks() { awk '{ print $14 + $15 }' "/proc/$wpid/stat"; }
# pass N FLAGS...: one client reading the file N times; prints "MB/s worker-cpu-s
# client-cpu-s" (MB/s: the median of passes 2..N, or pass 1 alone; CPU: per pass)
pass() {
  local t0 t1 out n=$1; shift
  t0=$(ticks)
  out=$( { /usr/bin/time -f "CPU %U %S" "$bin" bench read /d/big.bin --passes "$n" --json \
      --master "127.0.0.1:$mport" "$@"; } 2>&1 )
  t1=$(ticks)
  python3 - "$out" "$t0" "$t1" "$(getconf CLK_TCK)" <<'PY'
import json, statistics, sys
out, t0, t1, hz = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
lines = out.splitlines()
cpu = next(l for l in lines if l.startswith("CPU "))
p = json.loads("\n".join(l for l in lines if not l.startswith("CPU ")))["passes"]
u, s = (float(x) for x in cpu.split()[1:])
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
sc=$(pass 3 --short-circuit)
served=$(grep -c "block data plane serving" "$work/worker.log" || true)
python3 - "$tcp" "$size_mib" "$bin" "$cold" "$sc" "$served" "${#grpc[@]}" "${grpc[@]}" "${dp[@]}" <<'PY'
import statistics, sys
tcp, mib, binary, cold, sc, served, n = sys.argv[1:8]
tcp, mib, n = float(tcp), int(mib), int(n)
rows = [tuple(float(x) for x in r.split()) for r in sys.argv[8:]]
grpc, dp = rows[:n], rows[n:]
gb = mib * 1048576 / 1e9
def show(label, rs):
    mbs = statistics.median(r[0] for r in rs)
    w = statistics.median(r[1] for r in rs) / gb
    c = statistics.median(r[2] for r in rs) / gb
    each = " ".join(f"{r[0]:.0f}" for r in rs)
    print(f"{label:<24} {mbs:6.0f} MB/s  {mbs / tcp:.2f}x of raw TCP   CPU per GB: worker {w:.2f} s, client {c:.2f} s   (passes: {each} MB/s)")
print(f"binary:                  {binary}")
print(f"file:                    {mib} MiB, cached by the cold pass; medians of {n} alternating rounds")
print(f"raw TCP, loopback:       {tcp:.0f} MB/s (limit)")
show("cold (fills the cache)", [tuple(float(x) for x in cold.split())])
show("warm over gRPC", grpc)
show("warm over the data plane", dp)
show("warm, short-circuit", [tuple(float(x) for x in sc.split())])
if served != "1":
    print("the worker did not serve a data plane!")
PY
