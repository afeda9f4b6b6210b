#!/usr/bin/env bash
# Eviction policies under cyclic epochs: a training job reads the same dataset every epoch,
# and the dataset is larger than the cache. `granary local` (master, worker and FUSE in one
# process) over a folder; `cat` reads every file in the same order, epoch after epoch; the
# worker's own counters give each epoch's hit ratio. Run once per policy. The limit measured
# is the best any policy can do here: cache size / dataset size (whatever stays cached is hit
# once per epoch, and nothing more fits). An epoch's hit ratio is the share of the dataset
# it did not read from the under-store (the worker's under-store byte counter), so a page
# fetched twice counts against it.
#
#   bench/eviction.sh [DATASET_MIB] [CACHE_MIB] [EPOCHS]     (default 256 128 4; needs root)
#
# Uses $GRANARY_BIN, else the debug binary scripts/test builds.
set -euo pipefail
dataset_mib="${1:-256}"
cache_mib="${2:-128}"
epochs="${3:-4}"
. "$(dirname "$0")/lib.sh"
local_workdir evict
metric() { metric_at "$mport" "$1"; }

mkdir -p "$work/ufs" "$work/mnt"
files=$((dataset_mib / 2))
for i in $(seq -w 1 "$files"); do head -c $((2 * 1024 * 1024)) /dev/urandom > "$work/ufs/sample-$i.bin"; done

echo "dataset ${dataset_mib} MiB ($files files of 2 MiB), cache ${cache_mib} MiB, $epochs epochs"
echo "best possible hit ratio after the first epoch: $(python3 -c "print(f'{min(1, $cache_mib / $dataset_mib):.2f}')") (cache / dataset)"
for policy in lru lfu-admission; do
  mport=$(free_port)
  rm -rf "$work/cache"
  GRANARY_LOG=warn "$bin" local --ufs "$work/ufs" --mount "$work/mnt" --cache-dir "$work/cache" \
    --cache-size "${cache_mib}MiB" --eviction "$policy" --metrics-listen "127.0.0.1:$mport" \
    > "$work/local.log" 2>&1 &
  pid=$!
  for _ in $(seq 1 100); do mountpoint -q "$work/mnt" && break; sleep 0.1; done
  mountpoint -q "$work/mnt" || { cat "$work/local.log"; exit 1; }
  line="$policy:"
  for e in $(seq 1 "$epochs"); do
    u0=$(metric granary_worker_ufs_read_bytes_total)
    for f in "$work"/mnt/sample-*.bin; do cat "$f" > /dev/null; done
    u1=$(metric granary_worker_ufs_read_bytes_total)
    line="$line  epoch $e $(python3 -c "print(f'{1 - ($u1 - $u0) / ($dataset_mib * 1048576):.2f}')")"
  done
  ufs=$(metric granary_worker_ufs_read_bytes_total)
  echo "$line   (under-store read $(python3 -c "print(f'{$ufs / ($dataset_mib * 1048576):.2f}')")x the dataset)"
  kill -INT "$pid"; wait "$pid" 2>/dev/null || true; pid=""
  for _ in $(seq 1 50); do mountpoint -q "$work/mnt" || break; sleep 0.1; done
done
