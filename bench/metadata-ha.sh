#!/usr/bin/env bash
# Metadata throughput and failover time of a 3-master group on loopback, against the
# physical limit measured in the same run: synchronous 4 KiB writes (fsync) per second on
# the disk holding the masters' data — every acknowledged create waits for at least two
# of them in sequence (leader log append, then a follower's).
#
#   bench/metadata-ha.sh [SECONDS]        (default 10 per phase)
#
# MASTER_CPU=F gives each master at most F of a core (see lib.sh: masters on machines of
# their own, as far as CPU goes).
#
# Uses $GRANARY_BIN, else the debug binary scripts/test builds. Prints creates/s and stats/s
# at 1, 16 and 64 concurrent callers (stats spread over the three masters, as clients do,
# and with 1 and 64 callers also all at the leader), and the longest pause in acknowledged
# creates when the leader is killed with SIGKILL.
set -euo pipefail
secs="${1:-10}"
. "$(dirname "$0")/lib.sh"
bench_group meta

# The limit: synchronous small writes on the same file system.
fsync_per_s=$(python3 - "$work" <<'PY'
import os, sys, time
p = os.path.join(sys.argv[1], "fsync-probe")
fd = os.open(p, os.O_WRONLY | os.O_CREAT, 0o644)
buf = b"x" * 4096
n, t0 = 0, time.time()
while time.time() - t0 < 2:
    os.write(fd, buf); os.fsync(fd); n += 1
os.close(fd); os.unlink(p)
print(f"{n / (time.time() - t0):.0f}")
PY
)

# CPU seconds a process has used so far (user + system, from /proc).
cpu_of() { awk -v t="$(getconf CLK_TCK)" '{ printf "%.2f", ($14 + $15) / t }' "/proc/$1/stat" 2>/dev/null || echo 0; }
declare -A cpu_note
run() { # concurrency dir [extra args] -> json; notes the CPU seconds each process used in $cpu_note[dir]
  local before=() i
  for i in 1 2 3; do before+=("$(cpu_of "${mpid[$i]}")"); done
  /usr/bin/time -f "%U %S" -o "$work/client-cpu" \
    "$bin" bench metadata --master "$addrs" --dir "$2" --duration "${secs}s" --concurrency "$1" --json "${@:3}"
  local note=""
  for i in 1 2 3; do
    note+="m$i $(python3 -c "print(f'{$(cpu_of "${mpid[$i]}") - ${before[$((i - 1))]}:.1f}')") s, "
  done
  cpu_note[$2]="${note}client $(awk '{ printf "%.1f", $1 + $2 }' "$work/client-cpu") s"
}
field() { python3 -c "import json,sys; print(round(json.loads(sys.argv[1])['$2']))" "$1"; }
run 1 /b1 > "$work/c1"
run 1 /b1l --reads-at-leader > "$work/c1l"
run 16 /b16 > "$work/c16"
run 64 /b64 > "$work/c64"
run 64 /b64l --reads-at-leader > "$work/c64l"
c1=$(cat "$work/c1") c1l=$(cat "$work/c1l") c16=$(cat "$work/c16") c64=$(cat "$work/c64") c64l=$(cat "$work/c64l")

# Failover: kill -9 the leader a third into a create run; the longest gap between two
# acknowledged creates is the time the group could not accept writes.
l=$(leader)
run 4 /fo > "$work/fo.json" &
bpid=$!
sleep "$(python3 -c "print($secs / 3)")"
kill -9 "${mpid[$l]}"
wait "$bpid"
fo=$(cat "$work/fo.json")

echo "binary:                   $bin"
[ -n "${MASTER_CPU:-}" ] && echo "each master limited to:   $MASTER_CPU of a core (MASTER_CPU)"
echo "fsync/s (limit):          $fsync_per_s  (≈ $((fsync_per_s / 2)) sequential replicated appends/s)"
echo "creates/s, 1 caller:      $(field "$c1" creates_per_s)  ($(python3 -c "print(f'{$(field "$c1" creates_per_s) / ($fsync_per_s / 2):.2f}')")x of fsync/2)"
echo "creates/s, 16 callers:    $(field "$c16" creates_per_s)"
echo "creates/s, 64 callers:    $(field "$c64" creates_per_s)"
echo "stats/s, 1 caller:        $(field "$c1" stats_per_s)  (all at the leader: $(field "$c1l" stats_per_s))"
echo "stats/s, 16 callers:      $(field "$c16" stats_per_s)"
echo "stats/s, 64 callers:      $(field "$c64" stats_per_s)  (all at the leader: $(field "$c64l" stats_per_s))"
echo "CPU, 64 callers, spread:   ${cpu_note[/b64]}  (leader: m$l; creates and stats, $secs s each)"
echo "CPU, 64 callers, leader:   ${cpu_note[/b64l]}"
echo "failover (leader kill -9): longest pause between acknowledged creates $(field "$fo" max_create_gap_ms) ms; $(field "$fo" create_errors) creates failed"
