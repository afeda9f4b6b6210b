#!/usr/bin/env bash
# A checkpoint save (a torch.save-like sequential write of one large file through Python,
# then close) through the FUSE mount of `granary local`, in each write mode, against the
# same write to the local disk in the same run. What the training job waits for is the
# time until close returns.
#
#   bench/checkpoint-write.sh [SIZE_MIB]     (default 1024; root)
#
# raw: write + close to the local disk (the page cache absorbs it), and write + fsync +
# close (on the disk). async-through: close returns once the worker journaled (fsync) and
# cached the file; the upload to the under-store folder runs after. cache-through: close
# returns after the under-store has it. Uses $GRANARY_BIN, else the debug binary.
set -euo pipefail
size_mib="${1:-1024}"
here="$(cd "$(dirname "$0")" && pwd)"
. "$here/lib.sh"
local_workdir ckpt
mkdir -p "$work/ufs" "$work/mnt" "$work/raw"
cat > "$work/save.py" <<'PY'
import os, sys, time
path, size, sync = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "fsync"
blk = os.urandom(8 << 20)
t = time.monotonic()
f = open(path, "wb")
n = i = 0
while n < size:
    ln = min(size - n, (1 << 20) * (1 + i % 5) + (i * 17) % 4096)
    off = (i * 4099) % (len(blk) - (6 << 20))
    f.write(memoryview(blk)[off:off + ln]); n += ln; i += 1
if sync:
    f.flush(); os.fsync(f.fileno())
f.close()
print(f"{time.monotonic() - t:.3f}")
PY
bytes=$((size_mib * 1024 * 1024))
save() { python3 "$work/save.py" "$1" "$bytes" "${2:-}"; }
mbps() { python3 -c "print(f'{$bytes / $1 / 1e6:.0f}')"; }
start() { # write mode
  GRANARY_LOG=warn "$bin" local --ufs "$work/ufs" --mount "$work/mnt" --cache-dir "$work/cache" \
    --cache-size "$((size_mib * 4))MiB" --write-mode "$1" > "$work/local-$1.log" 2>&1 &
  pid=$!
  for _ in $(seq 1 100); do mountpoint -q "$work/mnt" && break; sleep 0.1; done
  mountpoint -q "$work/mnt" || { cat "$work/local-$1.log"; exit 1; }
}
stop() { kill -INT "$pid"; wait "$pid" || true; pid=""; }
save "$work/raw/warmup.pt" > /dev/null; rm -f "$work/raw/warmup.pt"; sync
raw=$(save "$work/raw/a.pt"); rm -f "$work/raw/a.pt"; sync
rawsync=$(save "$work/raw/b.pt" fsync); rm -f "$work/raw/b.pt"; sync
start async-through
async=$(save "$work/mnt/async.pt")
t0=$(date +%s.%N)
for _ in $(seq 1 600); do [ "$(stat -c %s "$work/ufs/async.pt" 2>/dev/null)" = "$bytes" ] && break; sleep 0.1; done
persisted=$(python3 -c "print($(date +%s.%N) - $t0)")
stop
start cache-through
cache=$(save "$work/mnt/cache.pt")
[ "$(stat -c %s "$work/ufs/cache.pt")" = "$bytes" ] || { echo "cache-through: not in the store at close"; exit 1; }
stop
echo "raw, close only (page cache)  $(mbps "$raw") MB/s   ${raw} s"
echo "raw, fsync + close (disk)     $(mbps "$rawsync") MB/s   ${rawsync} s"
echo "granary async-through         $(mbps "$async") MB/s   ${async} s   ($(python3 -c "print(f'{$rawsync / $async:.2f}')")x of raw fsync; in the store ${persisted%.*} s later)"
echo "granary cache-through         $(mbps "$cache") MB/s   ${cache} s   ($(python3 -c "print(f'{$rawsync / $cache:.2f}')")x of raw fsync)"
echo "binary: $bin; ${size_mib} MiB, Python writes of 1-5 MiB"
