#!/usr/bin/env bash
# Sequential read throughput through `granary local`, against the physical limit measured in
# the same run (reading the same file straight from the local disk / page cache).
#
#   bench/read-throughput.sh [SIZE_MIB]        (default 1024; needs root for FUSE)
#
# Two data sets of SIZE_MIB each: one file of many blocks and files of one 64 MiB block
# each (both opened in FUSE passthrough once wholly cached on the worker).
#
# Uses $GRANARY_BIN, else the debug binary scripts/test builds. Prints MB/s and ratios.
set -euo pipefail
size_mib="${1:-1024}"
here="$(cd "$(dirname "$0")/.." && pwd)"
. "$(dirname "$0")/lib.sh"
local_workdir read
mkdir -p "$work/ufs" "$work/mnt"
head -c "$((size_mib * 1024 * 1024))" /dev/urandom > "$work/ufs/data.bin"
mkdir -p "$work/ufs/blocks"
for i in $(seq 1 $((size_mib / 64))); do
  head -c $((64 * 1024 * 1024)) /dev/urandom > "$work/ufs/blocks/b$i.bin"
done

mbps() { # bytes seconds
  python3 -c "print(f'{$1 / $2 / 1e6:.0f}')"
}
timed_read() { # files... -> seconds
  local t0 t1
  t0=$(date +%s.%N); cat "$@" > /dev/null; t1=$(date +%s.%N)
  python3 -c "print($t1 - $t0)"
}
bytes=$((size_mib * 1024 * 1024))
raw=$(timed_read "$work/ufs/data.bin")   # page-cache warm after head -c wrote it

GRANARY_LOG=warn "$bin" local --ufs "$work/ufs" --mount "$work/mnt" --cache-dir "$work/cache" \
  --cache-size "$((size_mib * 3))MiB" > "$work/local.log" 2>&1 &
pid=$!
for _ in $(seq 1 100); do mountpoint -q "$work/mnt" && break; sleep 0.1; done
mountpoint -q "$work/mnt" || { cat "$work/local.log"; exit 1; }

cold=$(timed_read "$work/mnt/data.bin")
# Re-opened unchanged: the kernel keeps the mount's page cache (FOPEN_KEEP_CACHE).
warm=$(timed_read "$work/mnt/data.bin")
cmp -s "$work/ufs/data.bin" "$work/mnt/data.bin" || { echo "bytes differ!"; exit 1; }

# From the disk: drop the page cache and read the same bytes again — raw from the source
# file, Granary from the worker's cache file (FUSE passthrough). Three
# alternating rounds, medians (this VM's disk is noisy). Needs root.
median() { python3 -c "import sys,statistics; print(statistics.median(float(x) for x in sys.argv[1:]))" "$@"; }
disk_raw=() disk_granary=()
if [ -w /proc/sys/vm/drop_caches ]; then
  for _ in 1 2 3; do
    drop
    disk_raw+=("$(timed_read "$work/ufs/data.bin")")
    drop
    disk_granary+=("$(timed_read "$work/mnt/data.bin")")
  done
fi

# The one-block files: cold, then re-opened in passthrough (the kernel reads the worker's
# block files), then both from the disk.
cat "$work"/ufs/blocks/*.bin > /dev/null # into the page cache, like data.bin
raw_pt=$(timed_read "$work"/ufs/blocks/*.bin)
cold_pt=$(timed_read "$work"/mnt/blocks/*.bin)
check_pt=$(timed_read "$work"/mnt/blocks/*.bin) # first passthrough opens check every CRC
warm_pt=$(timed_read "$work"/mnt/blocks/*.bin)
for f in "$work"/ufs/blocks/*.bin; do
  cmp -s "$f" "$work/mnt/blocks/$(basename "$f")" || { echo "bytes differ: $f"; exit 1; }
done
disk_raw_pt=() disk_pt=()
if [ -w /proc/sys/vm/drop_caches ]; then
  for _ in 1 2 3; do
    drop
    disk_raw_pt+=("$(timed_read "$work"/ufs/blocks/*.bin)")
    drop
    disk_pt+=("$(timed_read "$work"/mnt/blocks/*.bin)")
  done
fi
echo "binary:            $bin"
echo "file:              ${size_mib} MiB"
echo "raw read (limit):  $(mbps $bytes $raw) MB/s   (page cache)"
echo "granary cold:      $(mbps $bytes $cold) MB/s  ($(python3 -c "print(f'{$raw / $cold:.2f}')")x of raw)"
echo "granary warm:      $(mbps $bytes $warm) MB/s  ($(python3 -c "print(f'{$raw / $warm:.2f}')")x of raw; kernel page cache kept across opens)"
if [ ${#disk_raw[@]} -gt 0 ]; then
  dr=$(median "${disk_raw[@]}"); dg=$(median "${disk_granary[@]}")
  echo "raw disk read:     $(mbps $bytes $dr) MB/s   (page cache dropped; median of 3)"
  echo "granary from disk: $(mbps $bytes $dg) MB/s  ($(python3 -c "print(f'{$dr / $dg:.2f}')")x of raw disk; passthrough once wholly cached)"
fi
echo "one-block files:   $((size_mib / 64)) x 64 MiB"
echo "  raw read (limit):  $(mbps $bytes $raw_pt) MB/s   (page cache)"
echo "  granary cold:      $(mbps $bytes $cold_pt) MB/s  ($(python3 -c "print(f'{$raw_pt / $cold_pt:.2f}')")x of raw)"
echo "  granary 1st warm:  $(mbps $bytes $check_pt) MB/s  ($(python3 -c "print(f'{$raw_pt / $check_pt:.2f}')")x of raw; passthrough opens checking every page's CRC32C)"
echo "  granary warm:      $(mbps $bytes $warm_pt) MB/s  ($(python3 -c "print(f'{$raw_pt / $warm_pt:.2f}')")x of raw; passthrough)"
if [ ${#disk_raw_pt[@]} -gt 0 ]; then
  dr=$(median "${disk_raw_pt[@]}"); dg=$(median "${disk_pt[@]}")
  echo "  raw disk read:     $(mbps $bytes $dr) MB/s   (page cache dropped; median of 3)"
  echo "  granary from disk: $(mbps $bytes $dg) MB/s  ($(python3 -c "print(f'{$dr / $dg:.2f}')")x of raw disk; passthrough)"
fi
