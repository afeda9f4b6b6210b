# Shared by the benchmark scripts (sourced): the binary under test and small helpers.

# The granary binary: $GRANARY_BIN, else the debug build scripts/test makes.
bin="${GRANARY_BIN:-${CARGO_TARGET_DIR:-$HOME/.cache/granary/target}/debug/granary}"

# Benchmarks run plaintext unless told otherwise (GRANARY_INSECURE=0 with GRANARY_TLS_DIR
# set; bench/peer-read.sh --tls measures TLS on against off in one run).
export GRANARY_INSECURE="${GRANARY_INSECURE:-1}"

# Masters seal every mount option that is not known to be public (credentials, keys) and
# refuse them without a secrets key: benchmarks give a throwaway one.
export GRANARY_SECRETS_KEY="${GRANARY_SECRETS_KEY:-bench-only-secrets-key-0123456789abcdef}"

# A free TCP port on 127.0.0.1.
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# Waits (up to 10 s) until PORT accepts connections on HOST (default 127.0.0.1).
wait_port() { for _ in $(seq 1 100); do (exec 3<>/dev/tcp/"${2:-127.0.0.1}"/"$1") 2>/dev/null && return; sleep 0.1; done; }

# metric PORT NAME: the value of one Prometheus sample served on 127.0.0.1:PORT.
metric_at() { curl -s "127.0.0.1:$1/metrics" | awk -v m="$2" '$1 == m { print $2 }'; }

# timed COMMAND...: "SECONDS OUTPUT": how long COMMAND took, then what it printed (one
# line, e.g. a count).
timed() {
  local s e out
  s=$(date +%s.%N)
  out=$("$@")
  e=$(date +%s.%N)
  echo "$(python3 -c "print(f'{$e - $s:.2f}')") $out"
}

# needs_root: exits unless this can drop the page cache (root).
needs_root() { [ -w /proc/sys/vm/drop_caches ] || { echo "needs root (drops the page cache)"; exit 1; }; }

# drop: writes dirty pages back and drops the page cache, so the next read is from the disk.
drop() { sync; echo 1 > /proc/sys/vm/drop_caches; }

# local_workdir NAME: sets $work to a fresh folder under /tmp and, at exit, stops the
# `granary local` process in $pid (if any), unmounts $work/mnt and removes the folder.
local_workdir() {
  work="$(mktemp -d "/tmp/granary-bench-$1-XXXXXX")"
  pid=""
  trap local_cleanup EXIT
}
local_cleanup() {
  [ -n "$pid" ] && kill -INT "$pid" 2>/dev/null && wait "$pid" 2>/dev/null || true
  mountpoint -q "$work/mnt" && umount -l "$work/mnt" || true
  [ -n "${KEEP_WORK:-}" ] && echo "kept $work" || rm -rf "$work"
}

# fuse_unmount: stops the `granary fuse` process in $fuse_pid (if any) and unmounts
# $work/mnt.
fuse_unmount() {
  [ -n "${fuse_pid:-}" ] && kill -INT "$fuse_pid" 2>/dev/null && wait "$fuse_pid" 2>/dev/null || true
  mountpoint -q "$work/mnt" && umount -l "$work/mnt" || true
}

# procs_workdir NAME: sets $work to a fresh folder under /tmp and $pids to an empty list;
# at exit, stops every process whose PID is in $pids and removes the folder.
procs_workdir() {
  work="$(mktemp -d "/tmp/granary-bench-$1-XXXXXX")"
  pids=()
  trap procs_cleanup EXIT
}
procs_cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  cpu_groups_cleanup
  [ -n "${KEEP_WORK:-}" ] && echo "kept $work" || rm -rf "$work"
}

# wait_live MASTER N: waits (up to 10 s) until the master reports N live workers.
wait_live() {
  for _ in $(seq 1 100); do
    [ "$("$bin" report --json --master "$1" | python3 -c 'import json,sys; print(sum(w["state"]=="live" for w in json.load(sys.stdin)["workers"]))')" = "$2" ] && return
    sleep 0.1
  done
}

# shape_port SERVER_PORT: sets $cport to the port clients use: the server's, or with
# SHAPE_MBIT set, a flow-shaper's in front of it (every connection paced to SHAPE_MBIT
# Mbit/s, each request delayed by RTT_MS, default 20; see bench/cold-read.sh). Uses $shaper,
# $work and $pids.
shape_port() {
  if [ -z "${SHAPE_MBIT:-}" ]; then cport=$1; return; fi
  if [ ! -x "$shaper" ]; then
    # A release GRANARY_BIN has no flow-shaper beside it unless built so: the debug one
    # (scripts/test builds it) shapes the same.
    local debug="${CARGO_TARGET_DIR:-$HOME/.cache/granary/target}/debug/flow-shaper"
    [ -x "$debug" ] || { echo "SHAPE_MBIT needs flow-shaper, not found at $shaper (cargo build --release --bin flow-shaper, or SHAPER_BIN=…)"; exit 1; }
    shaper=$debug
  fi
  "$shaper" 127.0.0.1:0 "127.0.0.1:$1" "$SHAPE_MBIT" "${RTT_MS:-20}" > "$work/shaper.addr" &
  pids+=($!)
  for _ in $(seq 1 100); do [ -s "$work/shaper.addr" ] && break; sleep 0.1; done
  cport=$(sed 's/.*://' "$work/shaper.addr")
}

# start_nodes NODES CACHE_MIB [FUSE_FLAG...]: one master (at $maddr) and, per node n, a
# worker and a FUSE mount at $work/m$n sharing the node name n$n, over the folder
# $work/ufs/data mounted at /data. Worker n serves metrics at 127.0.0.1:${wport[n]}, mount
# n at 127.0.0.1:${fport[n]}; their PIDs are ${wpid[n]} and ${fpid[n]}. Appends to $pids
# and $mounts (unmount those at exit).
declare -gA wport fport
start_nodes() {
  local nodes=$1 cache_mib=$2 n mport; shift 2
  mport=$(free_port); maddr="127.0.0.1:$mport"
  GRANARY_LOG=warn "$bin" master --data-dir "$work/master" --listen "$maddr" --allow-local-root "$work/ufs" > "$work/master.log" 2>&1 &
  pids+=($!); wait_port "$mport"
  for n in $(seq 1 "$nodes"); do
    wport[$n]=$(free_port)
    GRANARY_LOG=warn "$bin" worker --master "$maddr" --listen 127.0.0.1:0 --node-name "n$n" \
      --metrics-listen "127.0.0.1:${wport[$n]}" --cache-dir "$work/w$n" --cache-size "${cache_mib}MiB" > "$work/w$n.log" 2>&1 &
    wpid[$n]=$!; pids+=($!)
  done
  wait_live "$maddr" "$nodes"
  "$bin" mount add /data "file://$work/ufs/data" --master "$maddr" > /dev/null
  for n in $(seq 1 "$nodes"); do
    mkdir -p "$work/m$n"; fport[$n]=$(free_port)
    GRANARY_LOG=warn "$bin" fuse --master "$maddr" --mount "$work/m$n" --node-name "n$n" \
      --metrics-listen "127.0.0.1:${fport[$n]}" "$@" > "$work/m$n.log" 2>&1 &
    fpid[$n]=$!; pids+=($!); mounts+=("$work/m$n")
    for _ in $(seq 1 100); do mountpoint -q "$work/m$n" && break; sleep 0.1; done
    mountpoint -q "$work/m$n" || { cat "$work/m$n.log"; exit 1; }
  done
}

# mounts_workdir NAME: procs_workdir NAME, plus $mounts: every path in it is unmounted at
# exit before the processes are stopped.
mounts_workdir() {
  procs_workdir "$1"
  mounts=()
  trap mounts_cleanup EXIT
}
mounts_cleanup() {
  for m in "${mounts[@]}"; do mountpoint -q "$m" && umount -l "$m" || true; done
  procs_cleanup
}

# empty_tree DIR FOLDERS PER: DIR/dNNNNN/fNNNNNN, FOLDERS folders of PER empty files each
# (bench/namespace-scale.sh, bench/namespace-ha.sh: metadata only).
empty_tree() {
  python3 - "$1" "$2" "$3" <<'PY'
import os, sys
root, folders, per = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
for d in range(folders):
    p = os.path.join(root, f"d{d:05d}")
    os.mkdir(p)
    for f in range(per):
        open(os.path.join(p, f"f{f:06d}"), "wb").close()
PY
}

# master_group: three masters on loopback ports. Sets $ports, $peers, $addrs and the map
# $mpid (declared here); start_master ID starts one (data in $work/mID, log in
# $work/mID.log, its PID in $mpid[ID] and $pids), with GRANARY_LOG=$MASTER_LOG (default
# warn) and the flags in the array $master_flags.
master_group() {
  ports=($(free_port) $(free_port) $(free_port))
  peers="1=127.0.0.1:${ports[0]},2=127.0.0.1:${ports[1]},3=127.0.0.1:${ports[2]}"
  addrs="127.0.0.1:${ports[0]},127.0.0.1:${ports[1]},127.0.0.1:${ports[2]}"
  declare -gA mpid
}
# members: the group's members as `granary master list --json` gives them; leader: the
# leader's id; applied ID: that member's applied index ("" if it does not answer).
members() { "$bin" master list --json --master "$addrs" 2>/dev/null; }
leader() { members | python3 -c 'import json,sys; print(next(m["id"] for m in json.load(sys.stdin) if m["role"]=="leader"))'; }
applied() {
  members | python3 -c 'import json,sys; print(next((m["applied_index"] for m in json.load(sys.stdin) if m["id"]==int(sys.argv[1])), ""))' "$1" 2>/dev/null || true
}
start_master() { # id
  local i=$1
  GRANARY_LOG="${MASTER_LOG:-warn}" "$bin" master --id "$i" --peers "$peers" \
    --data-dir "$work/m$i" --listen "127.0.0.1:${ports[$((i - 1))]}" ${master_flags[@]+"${master_flags[@]}"} \
    >> "$work/m$i.log" 2>&1 &
  mpid[$i]=$!
  pids+=($!)
  [ -n "${MASTER_CPU:-}" ] && master_cpu "$i" "${mpid[$i]}"
  return 0
}

# A benchmark's 3-master group on loopback: $work (a new folder /tmp/granary-bench-NAME-*),
# the three masters started (start_master) and a leader elected; at exit every process in
# $pids is killed, the CPU groups removed and $work deleted.
bench_group() { # name
  work="$(mktemp -d "/tmp/granary-bench-$1-XXXXXX")"
  pids=()
  trap bench_group_cleanup EXIT
  master_group
  for i in 1 2 3; do start_master "$i"; done
  for _ in $(seq 1 200); do leader > /dev/null 2>&1 && break; sleep 0.1; done
}
bench_group_cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  master_cpu_cleanup
  rm -rf "$work"
}

# MASTER_CPU=F (e.g. 0.4): each master gets at most F of a core (a cgroup v1 CPU quota of
# its own), as if each ran on a machine of its own with that much CPU: on this 2-core
# machine three masters and the benchmark client otherwise take CPU from each other, so
# what a group of masters on their own machines does (followers serving reads) cannot
# show. The masters still share the disk. The groups are removed at exit (master_cpu_cleanup).
master_cpu() { # id pid
  cpu_group "m$1" "$MASTER_CPU" "$2"
}
master_cpu_cleanup() { cpu_groups_cleanup; }

# cpu_group NAME F PID...: the processes (and the children they start from now on) get at
# most F of a core together: a cgroup v1 CPU quota of their own, as if on a machine of
# their own. Removed at exit (cpu_groups_cleanup, from procs_cleanup).
cpu_group() {
  local g f=$2 p
  g=$(cpu_group_path "$1"); shift 2
  [ -d /sys/fs/cgroup/cpu ] || { echo "a CPU budget needs the cgroup v1 cpu controller"; exit 1; }
  mkdir -p "$g"
  echo 100000 > "$g/cpu.cfs_period_us"
  local quota
  quota=$(python3 -c "print(int(float('$f') * 100000))")
  echo "$quota" > "$g/cpu.cfs_quota_us"
  for p in "$@"; do echo "$p" > "$g/cgroup.procs"; done
}
cpu_group_path() { echo "/sys/fs/cgroup/cpu/granary-bench-$$-$1"; }
# in_cpu_group NAME CMD...: runs CMD inside group NAME (made by cpu_group).
in_cpu_group() {
  local g; g=$(cpu_group_path "$1"); shift
  bash -c 'echo $$ > "$0/cgroup.procs" && exec "$@"' "$g" "$@"
}
cpu_groups_cleanup() {
  local g
  for g in /sys/fs/cgroup/cpu/granary-bench-$$-*; do
    [ -d "$g" ] && rmdir "$g" 2>/dev/null || true
  done
}
