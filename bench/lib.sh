# Shared by the benchmark scripts (sourced): the binary under test and small helpers.

# The granary binary: $GRANARY_BIN, else the debug build scripts/test makes.
bin="${GRANARY_BIN:-${CARGO_TARGET_DIR:-$HOME/.cache/granary/target}/debug/granary}"

# A free TCP port on 127.0.0.1.
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# Waits (up to 10 s) until PORT accepts connections on HOST (default 127.0.0.1).
wait_port() { for _ in $(seq 1 100); do (exec 3<>/dev/tcp/"${2:-127.0.0.1}"/"$1") 2>/dev/null && return; sleep 0.1; done; }

# metric PORT NAME: the value of one Prometheus sample served on 127.0.0.1:PORT.
metric_at() { curl -s "127.0.0.1:$1/metrics" | awk -v m="$2" '$1 == m { print $2 }'; }

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
  rm -rf "$work"
}
