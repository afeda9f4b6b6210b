#!/usr/bin/env bash
# Node-local convergence (issue 29): one master, and per node a worker and a FUSE mount
# sharing a node name (n1, n2, ... as in the cluster tests), all on this machine, each cache
# large enough for the dataset. Every node reads the whole dataset in its own random order
# (N shuffled loader processes), all nodes at once, for EPOCHS epochs from cold, the page
# cache dropped before each. Reports per node and epoch the share of the bytes read that
# came from the node's own worker (short-circuit or passthrough: everything not read over
# the network from another node's worker), and the under-store bytes of all epochs over
# the dataset's (the goal: 1.00x — every block fetched once for the whole cluster).
#
#   bench/node-local.sh [NODES] [FILES] [KIB] [LOADERS]   (default 3 2000 100 4; root)
#   LOCALITY=cluster|node   the mounts' --locality (default node)
#   EPOCHS=N                epochs (default 3)
#
# Every sample of every epoch is checked against its SHA-256. Uses $GRANARY_BIN, else the
# debug binary scripts/test builds.
set -euo pipefail
nodes="${1:-3}"
files="${2:-2000}"
kib="${3:-100}"
loaders="${4:-4}"
locality="${LOCALITY:-node}"
epochs="${EPOCHS:-3}"
here="$(cd "$(dirname "$0")" && pwd)"
. "$here/lib.sh"
needs_root
mounts_workdir node-local
python3 "$here/make-samples.py" "$work/ufs/data" "$files" "$kib" "$work/manifest"
dataset=$(awk '{print $1}' "$work/manifest" | sed "s|^|$work/ufs/data/|" | xargs stat -c %s | awk '{s += $1} END {print s}')

start_nodes "$nodes" "$((files * kib * 3 / 1024 + 1024))" --locality "$locality"

m() { v=$(metric_at "$1" "$2"); echo "${v:-0}"; }
# Bytes a node read from elsewhere than its own worker: other nodes' workers, the store.
peer() { python3 -c "print($(m "${fport[$1]}" granary_client_peer_read_bytes_total) + $(m "${fport[$1]}" 'granary_client_read_bytes_total{source="under_store"}'))"; }
store_bytes() { local s=0 n; for n in $(seq 1 "$nodes"); do s=$(python3 -c "print($s + $(m "${wport[$n]}" granary_worker_ufs_read_bytes_total))"); done; echo "$s"; }
# Waits (up to 60 s) until the node copies asked for are made (the copied counters stop).
settle() {
  local prev="" cur n
  for _ in $(seq 1 300); do
    cur=""; for n in $(seq 1 "$nodes"); do cur="$cur $(m "${fport[$n]}" granary_client_node_copies_total) $(m "${fport[$n]}" granary_client_node_copy_failures_total)"; done
    [ "$cur" = "$prev" ] && return; prev=$cur; sleep 0.2
  done
}
echo "$nodes nodes, $files files of ~$kib KiB ($dataset bytes), $loaders loaders per node, --locality $locality"
for e in $(seq 1 "$epochs"); do
  declare -A p0
  for n in $(seq 1 "$nodes"); do p0[$n]=$(peer "$n"); done
  drop
  ps=()
  for n in $(seq 1 "$nodes"); do
    python3 "$here/loader.py" "$work/m$n/data" "$work/manifest" "$loaders" "$((e * 100 + n))" 1 > "$work/out.$n" &
    ps+=($!)
  done
  for p in "${ps[@]}"; do wait "$p"; done
  line="  epoch $e:"
  for n in $(seq 1 "$nodes"); do
    read -r got bytes secs bad < "$work/out.$n"
    [ "$got" = "$files" ] && [ "$bad" = 0 ] || { echo "node n$n: $got samples read, $bad differ"; exit 1; }
    local_share=$(python3 -c "print(f'{1 - ($(peer "$n") - ${p0[$n]}) / $bytes:.1%}')")
    line="$line n$n $(python3 -c "print(f'{$got / $secs:.0f}')") samples/s, $local_share local;"
  done
  echo "$line"
  settle
done
echo "  under-store bytes, all epochs: $(store_bytes) ($(python3 -c "print(f'{$(store_bytes) / $dataset:.2f}')")x the dataset)"
for n in $(seq 1 "$nodes"); do
  echo "  n$n: node copies $(m "${fport[$n]}" granary_client_node_copies_total) blocks, failed $(m "${fport[$n]}" granary_client_node_copy_failures_total), worker node-copy bytes $(m "${wport[$n]}" granary_worker_node_copy_bytes_total)"
done
