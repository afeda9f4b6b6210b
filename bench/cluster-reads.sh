#!/usr/bin/env bash
# What a cluster-wide cache saves: N nodes read one dataset from an S3 server (s3s-fs), all
# at once, through Granary, in two layouts measured in the same run:
#   cluster   — one master, N workers, N FUSE mounts: each block has one owner worker, which
#               fetches it from the store once for every node;
#   per-node  — N independent Granary installations (master + worker + FUSE each), i.e. a
#               cache per node, as with node-local caches.
# The figure is under-store bytes read ÷ dataset bytes (the store's bill), from the workers'
# own counters; the limit is 1.00 (every byte read once).
#
#   bench/cluster-reads.sh [NODES] [DATASET_MIB]     (default 3 512; needs root for FUSE and
#                                                     scripts/setup-emulators)
#
# Uses $GRANARY_BIN, else the debug binary scripts/test builds.
set -euo pipefail
nodes="${1:-3}"
dataset_mib="${2:-512}"
. "$(dirname "$0")/lib.sh"
tools="${GRANARY_TOOLS:-$HOME/.cache/granary/tools}"
work="$(mktemp -d /tmp/granary-bench-cluster-XXXXXX)"
pids=()
mounts=()
cleanup() {
  for m in "${mounts[@]}"; do mountpoint -q "$m" && umount -l "$m" || true; done
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

# The dataset: files of 1–8 MiB, written straight into the server's bucket directory.
mkdir -p "$work/s3/data"
total=0; i=0
while [ "$total" -lt $((dataset_mib * 1048576)) ]; do
  len=$(( (i % 8 + 1) * 1048576 + i )); i=$((i + 1))
  head -c "$len" /dev/urandom > "$work/s3/data/f$(printf %04d $i).bin"; total=$((total + len))
done
sport=$(free_port)
"$tools/bin/s3s-fs" --host 127.0.0.1 --port "$sport" --access-key bench --secret-key bench-secret \
  "$work/s3" > "$work/s3s.log" 2>&1 &
pids+=($!); wait_port "$sport"
opts=(-o region=us-east-1 -o access_key_id=bench -o secret_access_key=bench-secret -o allow_http=true
  -o "endpoint=http://127.0.0.1:$sport" -o sync_interval=never)

# start_cluster NAME WORKERS: a master and WORKERS workers; sets $maddr and appends ports.
start_cluster() {
  local name=$1 n=$2 mport wmp
  mport=$(free_port); maddr="127.0.0.1:$mport"
  GRANARY_LOG=warn "$bin" master --data-dir "$work/$name/master" --listen "$maddr" > "$work/$name-master.log" 2>&1 &
  pids+=($!); wait_port "$mport"
  for w in $(seq 1 "$n"); do
    wmp=$(free_port); wports+=("$wmp")
    GRANARY_LOG=warn "$bin" worker --master "$maddr" --listen 127.0.0.1:0 --metrics-listen "127.0.0.1:$wmp" \
      --cache-dir "$work/$name/w$w" --cache-size "$((dataset_mib * 2))MiB" > "$work/$name-w$w.log" 2>&1 &
    pids+=($!)
  done
  wait_live "$maddr" "$n"
  "$bin" mount add /data s3://data --master "$maddr" "${opts[@]}" > /dev/null
}
start_fuse() { # NAME MASTER
  mkdir -p "$work/$1"
  GRANARY_LOG=warn "$bin" fuse --master "$2" --mount "$work/$1" > "$work/$1.log" 2>&1 &
  pids+=($!); mounts+=("$work/$1")
  for _ in $(seq 1 100); do mountpoint -q "$work/$1" && return; sleep 0.1; done
  cat "$work/$1.log"; exit 1
}
read_all() { # read every mount's /data concurrently, checking bytes
  local p=() m
  for m in "$@"; do (cd "$m/data" && find . -type f | sort | xargs sha256sum > "$m.sums") & p+=($!); done
  for m in "${p[@]}"; do wait "$m"; done
  for m in "$@"; do cmp -s "$1.sums" "$m.sums" || { echo "bytes differ between mounts"; exit 1; }; done
  (cd "$work/s3/data" && find . -type f | sort | xargs sha256sum) | cmp -s - "$1.sums" || { echo "bytes differ from the source"; exit 1; }
}
ufs_total() { local s=0 p; for p in "${wports[@]}"; do s=$((s + $(metric_at "$p" granary_worker_ufs_read_bytes_total))); done; echo $s; }

wports=()
start_cluster cluster "$nodes"
cm=()
for n in $(seq 1 "$nodes"); do start_fuse "c-node$n" "$maddr"; cm+=("$work/c-node$n"); done
t0=$(date +%s.%N); read_all "${cm[@]}"; t1=$(date +%s.%N)
cluster_ufs=$(ufs_total)

wports=()
pm=()
for n in $(seq 1 "$nodes"); do start_cluster "p$n" 1; start_fuse "p-node$n" "$maddr"; pm+=("$work/p-node$n"); done
t2=$(date +%s.%N); read_all "${pm[@]}"; t3=$(date +%s.%N)
pernode_ufs=$(ufs_total)

ratio() { python3 -c "print(f'{$1 / $total:.2f}')"; }
echo "dataset:            $(python3 -c "print(f'{$total / 1048576:.0f}')") MiB in $i files, read by $nodes nodes at once"
echo "cluster cache:      under-store read $(ratio "$cluster_ufs")x the dataset  ($(python3 -c "print(f'{$t1 - $t0:.1f}')") s)"
echo "per-node caches:    under-store read $(ratio "$pernode_ufs")x the dataset  ($(python3 -c "print(f'{$t3 - $t2:.1f}')") s)"
