#!/usr/bin/env bash
# The loader pattern on several nodes at once (issue 27): one master, and per node a worker
# and a FUSE mount sharing a node name (n1, n2, ... as in the cluster tests), all on this
# machine. Each node runs N shuffled loader processes over the whole dataset (warm: every
# block cached in the cluster, page cache dropped before every epoch), first alone, then
# all nodes at once; the same for the raw folder (one copy per node). Reports each node's
# samples/s at once ÷ alone, for Granary and for raw (on one machine the nodes share its
# cores and disk: raw's ratio is what sharing alone costs).
#
#   bench/loader-nodes.sh [NODES] [FILES] [KIB] [LOADERS]   (default 3 4000 100 4; root)
#
# LOCALITY=node|cluster: the mounts' --locality (default cluster: each block read from its
# owner; node: copied to each node's worker after the first epoch, waited for before the
# measured epochs).
#
# NODE_CPU=F (e.g. 0.6): each node's worker, mount and loaders (and each raw node's
# loaders) get at most F of a core together, alone and at once alike (cgroup v1 CPU
# quotas), as if each node were a machine of its own with that much CPU: on this 2-core
# machine the nodes otherwise take CPU from each other, which says nothing about nodes on
# machines of their own. They still share the disk; the master is not limited.
#
# Every sample of the first epoch on every node is checked against its SHA-256. Uses
# $GRANARY_BIN, else the debug binary scripts/test builds.
set -euo pipefail
nodes="${1:-3}"
files="${2:-4000}"
kib="${3:-100}"
loaders="${4:-4}"
locality="${LOCALITY:-cluster}"
here="$(cd "$(dirname "$0")" && pwd)"
. "$here/lib.sh"
needs_root
mounts_workdir loader-nodes
python3 "$here/make-samples.py" "$work/ufs/data" "$files" "$kib" "$work/manifest"
for n in $(seq 1 "$nodes"); do cp -r "$work/ufs/data" "$work/raw$n"; done

start_nodes "$nodes" "$((files * kib * 2 / 1024 + 1024))" --locality "$locality"
node_cpu="${NODE_CPU:-}"
if [ -n "$node_cpu" ]; then
  for n in $(seq 1 "$nodes"); do cpu_group "n$n" "$node_cpu" "${wpid[$n]}" "${fpid[$n]}"; done
fi
# on_node N CMD...: CMD as node N's (within its CPU budget when NODE_CPU is set)
on_node() { local n=$1; shift; if [ -n "$node_cpu" ]; then in_cpu_group "n$n" "$@"; else "$@"; fi; }

epoch=0
# pass NODE DIR CHECK -> "samples bytes seconds bad"
pass() { epoch=$((epoch + 1)); on_node "$1" python3 "$here/loader.py" "$2" "$work/manifest" "$loaders" "$epoch" "$3"; }
# at_once CHECK DIR... -> one "samples bytes seconds bad" line per DIR (DIR i as node i's),
# all run together
at_once() {
  local check=$1 d i=0 ps=() p; shift
  epoch=$((epoch + 1))
  for d in "$@"; do
    i=$((i + 1))
    on_node "$i" python3 "$here/loader.py" "$d" "$work/manifest" "$loaders" "$((epoch * 100 + i))" "$check" > "$work/once.$i" &
    ps+=($!)
  done
  for p in "${ps[@]}"; do wait "$p"; done
  for i in $(seq 1 "$#"); do cat "$work/once.$i"; done
  rm -f "$work"/once.*
}
check_all() { # every line: all samples, none bad
  while read -r n _ _ bad; do
    [ "$n" = "$files" ] && [ "$bad" = 0 ] || { echo "samples missing or differing: $n read, $bad bad"; exit 1; }
  done
}
gdirs=(); rdirs=()
for n in $(seq 1 "$nodes"); do gdirs+=("$work/m$n/data"); rdirs+=("$work/raw$n"); done
# Cold: node 1 loads the cluster (each block cached once, on its owner); then every node
# reads everything once, checked.
drop; pass 1 "${gdirs[0]}" 1 | check_all
drop; at_once 1 "${gdirs[@]}" | check_all
# Node copies made in the background (--locality node): wait until they stop.
copies() { local n c=""; for n in $(seq 1 "$nodes"); do c="$c $(metric_at "${fport[$n]}" granary_client_node_copies_total)"; done; echo "$c"; }
prev=""; for _ in $(seq 1 300); do cur=$(copies); [ "$cur" = "$prev" ] && break; prev=$cur; sleep 0.3; done
# One unmeasured epoch per node (the first over local copies opens each file under a lease
# and checks it before it is parked).
for n in $(seq 1 "$nodes"); do drop; pass "$n" "${gdirs[$((n - 1))]}" 0 > /dev/null; done
rate() { awk '{ printf "%.0f\n", $1 / $3 }'; }
declare -A alone_g alone_r
for n in $(seq 1 "$nodes"); do
  drop; alone_r[$n]=$(pass "$n" "${rdirs[$((n - 1))]}" 0 | rate)
  drop; alone_g[$n]=$(pass "$n" "${gdirs[$((n - 1))]}" 0 | rate)
done
drop; mapfile -t once_r < <(at_once 0 "${rdirs[@]}" | rate)
drop; mapfile -t once_g < <(at_once 0 "${gdirs[@]}" | rate)
echo "$nodes nodes, $files files of ~$kib KiB, $loaders loaders per node, --locality $locality${node_cpu:+, each node limited to $node_cpu of a core} (samples/s per node; node copies:$(copies))"
for n in $(seq 1 "$nodes"); do
  g1=${alone_g[$n]}; gn=${once_g[$((n - 1))]}; r1=${alone_r[$n]}; rn=${once_r[$((n - 1))]}
  printf '  node n%s: granary alone %6s, at once %6s (%.2fx)   raw alone %6s, at once %6s (%.2fx)\n' \
    "$n" "$g1" "$gn" "$(python3 -c "print($gn / $g1)")" "$r1" "$rn" "$(python3 -c "print($rn / $r1)")"
done
