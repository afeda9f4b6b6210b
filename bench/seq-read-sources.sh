#!/usr/bin/env bash
# Where a warm sequential read through the mount gets its bytes: one file of SIZE_MIB read
# through `granary local` (every byte cached on the worker, page cache dropped), with the
# client's counters scraped around each read — bytes by source (short-circuit, worker over
# gRPC, under-store), short-circuit lease requests, bytes prefetched and used — next to a
# `dd` of the source file on the local disk and a `cat` of the worker's own block files of
# it (the same bytes at the same place on the disk: the tightest limit) in the same round.
#
#   bench/seq-read-sources.sh [SIZE_MIB] [dd|fio]   (default 1024 dd; root; fio for the
#                                                     bench/fio/seq-read.fio job)
#
# A sequential reader should read everything by short-circuit with one lease per 16-page
# window (SIZE_MIB / 16 leases at 1 MiB pages). Uses $GRANARY_BIN, else the debug binary.
set -euo pipefail
size_mib="${1:-1024}"
how="${2:-dd}"
here="$(cd "$(dirname "$0")" && pwd)"
. "$here/lib.sh"
needs_root
local_workdir seq-sources
mkdir -p "$work/ufs" "$work/mnt"
head -c "$((size_mib * 1024 * 1024))" /dev/urandom > "$work/ufs/seq.bin"
port="$(free_port)"
GRANARY_LOG=warn "$bin" local --ufs "$work/ufs" --mount "$work/mnt" --cache-dir "$work/cache" \
  --cache-size "$((size_mib * 3))MiB" --metrics-listen "127.0.0.1:$port" > "$work/local.log" 2>&1 &
pid=$!
for _ in $(seq 1 100); do mountpoint -q "$work/mnt" && break; sleep 0.1; done
mountpoint -q "$work/mnt" || { cat "$work/local.log"; exit 1; }
cmp -s "$work/ufs/seq.bin" "$work/mnt/seq.bin" || { echo "bytes differ"; exit 1; }
# The worker's block files of the file (block index order).
mapfile -t blocks < <(find "$work/cache/worker/blocks" -type f | sort)
block_bytes=$(cat "${blocks[@]}" | wc -c)
direct() { # MB/s of reading the block files straight from the disk
  local s e
  s=$(date +%s.%N); cat "${blocks[@]}" > /dev/null; e=$(date +%s.%N)
  python3 -c "print('%.0f' % ($block_bytes / 1e6 / ($e - $s)))"
}
counters() {
  curl -s "127.0.0.1:$port/metrics" |
    grep -E '^granary_client_(read_bytes_total|short_circuit_leases_total|prefetch)' | sort
}
mbps() { # dd's or fio's throughput of reading $1, in MB/s
  if [ "$how" = fio ]; then
    DIR="$(dirname "$1")" FILE="$(basename "$1")" fio --readonly --output-format=json \
      "$here/fio/seq-read.fio" |
      python3 -c 'import json,sys; t=sys.stdin.read(); print("%.0f" % (json.loads(t[t.index("{"):])["jobs"][0]["read"]["bw_bytes"] / 1e6))'
  else
    dd if="$1" of=/dev/null bs=1M 2>&1 | python3 -c 'import sys,re; t=sys.stdin.read().split("\n")[-2]; s=float(re.search(r"copied, ([0-9.]+) s", t).group(1)); print("%.0f" % (int(t.split()[0]) / s / 1e6))'
  fi
}
for round in 1 2 3; do
  drop
  raw="$(mbps "$work/ufs/seq.bin")"
  drop
  blk="$(direct)"
  drop
  counters > "$work/before"
  g="$(mbps "$work/mnt/seq.bin")"
  counters > "$work/after"
  echo "round $round: raw $raw MB/s, block files $blk MB/s, granary $g MB/s ($how)"
  join "$work/before" "$work/after" | awk '{ d = $3 - $2; if (d != 0) printf "    %s +%.0f\n", $1, d }'
done
echo "binary: $bin; ${size_mib} MiB; page cache dropped before every read"
