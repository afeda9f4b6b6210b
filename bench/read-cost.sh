#!/usr/bin/env bash
# What a linearizable stat costs each master of a 3-master group on loopback, with the
# reads spread over the group (as clients do) and all at the leader, in the same run:
# CPU seconds of each master and of the client per 1,000 stats, and stats/s.
#
#   bench/read-cost.sh [ENTRIES] [CALLERS]     (default 60000 entries, 64 callers)
#
# MASTER_CPU=F gives each master at most F of a core (see lib.sh). PERF=FILE records
# `perf record -g` of the leader (PERF_MASTER=follower: of a follower) during the spread
# reads.
# Uses $GRANARY_BIN, else the debug binary scripts/test builds.
set -euo pipefail
n="${1:-60000}"
callers="${2:-64}"
. "$(dirname "$0")/lib.sh"
bench_group read
l=$(leader)
cpu_of() { awk -v t="$(getconf CLK_TCK)" '{ printf "%.2f", ($14 + $15) / t }' "/proc/$1/stat"; }
bench() { "$bin" bench metadata --master "$addrs" --dir /r --concurrency "$callers" --json "$@"; }
bench --ops "$n" --duration 600s > "$work/made"
made=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['creates'])" "$work/made")
[ "$made" = "$n" ] || { echo "made $made of $n entries"; exit 1; }

phase() { # label [bench args]
  local label=$1 before=() i perf_pid=""
  shift
  for i in 1 2 3; do before+=("$(cpu_of "${mpid[$i]}")"); done
  if [ -n "${PERF:-}" ] && [ "$label" = spread ]; then
    local who=$l
    [ "${PERF_MASTER:-leader}" = follower ] && who=$((l % 3 + 1))
    perf record -F 1000 -g -o "$PERF" -p "${mpid[$who]}" > /dev/null 2>&1 &
    perf_pid=$!
  fi
  /usr/bin/time -f "%U %S" -o "$work/client-cpu" "$bin" bench metadata --master "$addrs" --dir /r \
    --concurrency "$callers" --json --stat-existing "$n" "$@" > "$work/out"
  [ -n "$perf_pid" ] && { kill -INT "$perf_pid"; wait "$perf_pid" || true; }
  local rate line
  rate=$(python3 -c "import json,sys; print(round(json.load(open(sys.argv[1]))['stats_per_s']))" "$work/out")
  line="$(printf '%-8s %6s stats/s; CPU ms per 1,000 stats:' "$label" "$rate")"
  for i in 1 2 3; do
    line+=" m$i$([ "$i" = "$l" ] && echo "(leader)") $(python3 -c "print(round(($(cpu_of "${mpid[$i]}") - ${before[$((i - 1))]}) * 1e6 / $n))")"
  done
  line+=" client $(awk -v n="$n" '{ printf "%d", ($1 + $2) * 1e6 / n }' "$work/client-cpu")"
  echo "$line"
}
echo "binary: $bin; $n entries, $callers callers${MASTER_CPU:+; each master limited to $MASTER_CPU of a core}"
for r in $(seq 1 "${ROUNDS:-2}"); do
  phase spread
  phase leader --reads-at-leader
done
