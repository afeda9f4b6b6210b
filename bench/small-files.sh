#!/usr/bin/env bash
# Many small files read by a Python data loader (8 threads, `open().read()` of each file,
# as a PyTorch Dataset over image/sample files does) through the FUSE mount of
# `granary local`, against the same reader over the local disk in the same run.
#
#   bench/small-files.sh [FILES] [KIB]     (default 20000 files of 128 KiB; root)
#   ROUNDS=N  raw/warm pairs from the disk, alternating, whose median ratio is reported
#             (default 5)
#
# Passes: raw disk (page cache dropped), Granary cold (every file fetched from the
# under-store folder and cached), Granary warm from the worker's disk (page cache dropped),
# both again from the page cache, then `tar` of the tree (one reader in name order) from
# the disk and from the worker's disk.
# Uses $GRANARY_BIN, else the debug binary scripts/test builds; GRANARY_FLAGS adds flags
# to `granary local` (e.g. "--no-passthrough").
set -euo pipefail
files="${1:-20000}"
kib="${2:-128}"
here="$(cd "$(dirname "$0")" && pwd)"
. "$here/lib.sh"
needs_root
local_workdir small
mkdir -p "$work/ufs" "$work/mnt"
python3 - "$work/ufs/data" "$files" "$kib" <<'PY'
import os, sys
root, n, kib = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
blob = os.urandom(kib * 1024 + 4096)
for i in range(n):
    d = os.path.join(root, f"d{i // 1000:03d}")
    if i % 1000 == 0:
        os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, f"s{i:06d}.jpg"), "wb") as f:
        f.write(blob[i % 4096:i % 4096 + kib * 1024])
PY
cat > "$work/reader.py" <<'PY'
import hashlib, os, sys, time
from concurrent.futures import ThreadPoolExecutor
root = sys.argv[1]
paths = sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs)
def load(p):
    with open(p, "rb") as f:
        return f.read()
t = time.monotonic()
total, digest = 0, hashlib.sha256()
with ThreadPoolExecutor(8) as ex:
    for data in ex.map(load, paths, chunksize=64):
        total += len(data)
        digest.update(data[:64])
took = time.monotonic() - t
print(f"{len(paths)} {total} {took:.3f} {digest.hexdigest()[:16]}")
PY
GRANARY_LOG=warn "$bin" local --ufs "$work/ufs" --mount "$work/mnt" --cache-dir "$work/cache" \
  --cache-size "$((files * kib / 1024 * 2 + 1024))MiB" ${GRANARY_FLAGS:-} > "$work/local.log" 2>&1 &
pid=$!
for _ in $(seq 1 100); do mountpoint -q "$work/mnt" && break; sleep 0.1; done
mountpoint -q "$work/mnt" || { cat "$work/local.log"; exit 1; }
pass() { python3 "$work/reader.py" "$1"; }  # -> files bytes seconds digest
# One reader going through the tree in name order: tar (its output piped on: tar skips
# reading files when it writes to /dev/null itself).
tarpass() {
  local s e
  s=$(date +%s.%N)
  tar cf - -C "$1" . | cat > /dev/null
  e=$(date +%s.%N)
  echo "$files $((files * kib * 1024)) $(python3 -c "print(f'{$e - $s:.3f}')") -"
}
drop; raw=$(pass "$work/ufs/data")
drop; cold=$(pass "$work/mnt/data")
drop; warm=$(pass "$work/mnt/data")
rawpc=$(pass "$work/ufs/data")
warmpc=$(pass "$work/mnt/data")
drop; rawtar=$(tarpass "$work/ufs/data")
drop; warmtar=$(tarpass "$work/mnt/data")
# This VM's disk moves ±10 % and more between passes: more raw/warm pairs, alternating,
# and the median of their ratios (ROUNDS pairs in all, counting the one above).
pairs="$raw|$warm"
for _ in $(seq 2 "${ROUNDS:-5}"); do
  drop; r=$(pass "$work/ufs/data")
  drop; w=$(pass "$work/mnt/data")
  [ "$(echo "$w" | awk '{print $4}')" = "$(echo "$raw" | awk '{print $4}')" ] || { echo "bytes differ: $w vs $raw"; exit 1; }
  pairs="$pairs;$r|$w"
done
digest() { echo "$1" | awk '{print $4}'; }
for p in "$cold" "$warm" "$warmpc"; do
  [ "$(digest "$p")" = "$(digest "$raw")" ] || { echo "bytes differ: $p vs $raw"; exit 1; }
done
line() { # label pass [limit-pass]
  python3 - "$1" "$2" "${3:-}" <<'PY'
import sys
label, p, lim = sys.argv[1], sys.argv[2].split(), sys.argv[3].split()
n, b, s = int(p[0]), int(p[1]), float(p[2])
out = f"{label:<34} {n / s:9.0f} files/s {b / s / 1e6:7.0f} MB/s"
if lim:
    out += f"   {float(lim[2]) / s:.2f}x of raw"
print(out)
PY
}
line "raw disk (limit)" "$raw"
line "granary cold (from the folder)" "$cold" "$raw"
line "granary warm (worker's disk)" "$warm" "$raw"
line "raw page cache (limit)" "$rawpc"
line "granary page cache" "$warmpc" "$rawpc"
line "raw disk, tar (limit)" "$rawtar"
line "granary warm, tar" "$warmtar" "$rawtar"
python3 - "$pairs" <<'PY'
import statistics, sys
rate = lambda p: int(p.split()[0]) / float(p.split()[2])
pairs = [tuple(map(rate, pr.split("|"))) for pr in sys.argv[1].split(";")]
ratios = [w / r for r, w in pairs]
print(f"warm (worker's disk) vs raw disk, {len(pairs)} alternating pairs: "
      + " / ".join(f"{w:.0f} vs {r:.0f}" for r, w in pairs) + " files/s")
print("  ratios " + " / ".join(f"{x:.2f}" for x in ratios)
      + f", median {statistics.median(ratios):.2f}x")
PY
echo "binary: $bin; $files files of $kib KiB, 8 reader threads"
