#!/usr/bin/env bash
# What programs reading through a mount see while its daemon is replaced: ROUNDS graceful
# takeovers (`granary fuse --takeover`), then ROUNDS kills (`kill -9` of a daemon running
# under `--supervise`), while
#   - one `cat` streams a FILE_MIB file (cached, so opened in passthrough) through sha256sum,
#   - one reader streams another FILE_MIB file that is not cached (read through the daemon),
#   - a loader opens, reads and closes SAMPLES small files in a random order, timing each.
#
#   bench/takeover.sh [FILE_MIB] [ROUNDS] [SAMPLES]      (defaults 2048 5 2000; needs root)
#
# NO_RESEND=1: as on a kernel without FUSE_NOTIFY_RESEND (Linux < 6.9; `--no-resend`): each
# takeover quiesces the old daemon first, and there are no kill rounds (no crash recovery
# on such kernels).
#
# Prints, per takeover, the time the new daemon reports the mount was not fully served,
# and at the end: errors seen by the programs (must be none), the SHA-256 checks, and the
# loader's slowest file (open + read + close) against its median.
set -euo pipefail
file_mib="${1:-2048}" rounds="${2:-5}" samples="${3:-2000}"
. "$(dirname "$0")/lib.sh"
needs_root
mounts_workdir takeover
mkdir -p "$work/ufs/data/s"
head -c "$((file_mib << 20))" /dev/urandom > "$work/ufs/data/cached.bin"
head -c "$((file_mib << 20))" /dev/urandom > "$work/ufs/data/cold.bin"
python3 - "$work/ufs/data/s" "$samples" <<'EOF'
import os, sys
for i in range(int(sys.argv[2])):
    open(os.path.join(sys.argv[1], "f%05d.bin" % i), "wb").write(os.urandom(100 * 1024))
EOF
sock="$work/handover.sock"
flags=(--supervise)
[ "${NO_RESEND:-}" = 1 ] && flags=(--no-resend)
start_nodes 1 $((file_mib * 8 + 1024)) --handover-socket "$sock" "${flags[@]}"
mnt="$work/m1/data"
want_cached=$(sha256sum < "$work/ufs/data/cached.bin" | cut -d' ' -f1)
want_cold=$(sha256sum < "$work/ufs/data/cold.bin" | cut -d' ' -f1)
cat "$mnt/cached.bin" > /dev/null        # cached: opens in passthrough from now on
cat "$mnt"/s/* > /dev/null

# The programs, paced so they span every round: a streaming reader of each big file.
cat > "$work/stream.py" <<'EOF'
import hashlib, sys, time
h, rate = hashlib.sha256(), int(sys.argv[2]) << 20
with open(sys.argv[1], "rb") as f:
    t0, n = time.time(), 0
    while b := f.read(1 << 20):
        h.update(b); n += len(b)
        time.sleep(max(0, n / rate - (time.time() - t0)))
print(h.hexdigest())
EOF
rate=$(( file_mib / (rounds * 4 + 2) + 1 ))
python3 "$work/stream.py" "$mnt/cached.bin" "$rate" > "$work/cached.out" 2>&1 & pids+=($!); cached_pid=$!
python3 "$work/stream.py" "$mnt/cold.bin" "$rate" > "$work/cold.out" 2>&1 & pids+=($!); cold_pid=$!
python3 - "$mnt/s" "$work/stop" > "$work/loader.out" 2>&1 <<'EOF' &
import os, random, sys, time
d, stop = sys.argv[1], sys.argv[2]
names, times, errors = sorted(os.listdir(d)), [], 0
while not os.path.exists(stop):
    random.shuffle(names)
    for n in names:
        t = time.time()
        try:
            with open(os.path.join(d, n), "rb") as f:
                f.read()
        except OSError as e:
            errors += 1
            print("error", n, e, flush=True)
        times.append(time.time() - t)
times.sort()
print("files %d errors %d median %.2f ms slowest %.0f ms" % (len(times), errors, 1000 * times[len(times) // 2], 1000 * times[-1]))
EOF
pids+=($!); loader_pid=$!

took() { grep -c "granary took over the mount" "$1" 2>/dev/null || true; }
for r in $(seq 1 "$rounds"); do
  sleep 1
  log="$work/takeover-$r.log"
  GRANARY_LOG=warn "$bin" fuse --master "$maddr" --mount "$work/m1" --node-name n1 \
    --handover-socket "$sock" --takeover "${flags[@]}" > "$log" 2>&1 &
  pids+=($!)
  for _ in $(seq 1 300); do [ "$(took "$log")" = 1 ] && break; sleep 0.1; done
  echo "takeover $r: $(grep -o 'not fully served for [0-9]* ms' "$log")"
done
# The kills need a supervised daemon, started by takeover.
if [ "${NO_RESEND:-}" = 1 ]; then
  rounds=0
else
  GRANARY_LOG=warn "$bin" fuse --master "$maddr" --mount "$work/m1" --node-name n1 \
    --handover-socket "$sock" --takeover --supervise > "$work/supervised.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 1 300); do [ "$(took "$work/supervised.log")" = 1 ] && break; sleep 0.1; done
fi
for r in $(seq 1 "$rounds"); do
  sleep 1
  before=$(took "$work/supervised.log")
  victim=$(grep -o 'daemon pid [0-9]*' "$work/supervised.log" | tail -1 | awk '{print $3}')
  t0=$(date +%s%N)
  kill -9 "$victim"
  for _ in $(seq 1 300); do [ "$(took "$work/supervised.log")" -gt "$before" ] && break; sleep 0.05; done
  echo "kill -9 $r: replaced in $(( ($(date +%s%N) - t0) / 1000000 )) ms;" \
    "$(grep -o 'not fully served for [0-9]* ms' "$work/supervised.log" | tail -1)"
done
touch "$work/stop"
wait "$cached_pid" "$cold_pid" "$loader_pid" || true
echo "passthrough reader: $( [ "$(cat "$work/cached.out")" = "$want_cached" ] && echo "SHA-256 ok" || echo "WRONG: $(cat "$work/cached.out")")"
echo "daemon reader:      $( [ "$(cat "$work/cold.out")" = "$want_cold" ] && echo "SHA-256 ok" || echo "WRONG: $(cat "$work/cold.out")")"
echo "loader:             $(tail -1 "$work/loader.out")"
