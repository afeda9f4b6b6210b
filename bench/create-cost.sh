#!/usr/bin/env bash
# What one caller's create costs each process of a 3-master group on loopback: CPU (and
# of it, kernel) microseconds and context switches per create, per master and for the
# client, with each master's threads listed. A lone caller's create is latency-bound:
# where its CPU and its hand-overs between threads go is where its time goes.
#
#   bench/create-cost.sh [SECONDS]     (default 8; the middle SECONDS-2 are measured)
#
# PERF=FILE also records `perf record -g` of the three masters over the measured window.
# Uses $GRANARY_BIN, else the debug binary scripts/test builds.
set -euo pipefail
secs="${1:-8}"
[ "$secs" -ge 4 ] || { echo "SECONDS must be at least 4"; exit 2; }
. "$(dirname "$0")/lib.sh"
bench_group create
# Warm up (leader elected, connections open).
"$bin" bench metadata --master "$addrs" --dir /warm --duration 2s --concurrency 1 --json > /dev/null

cpu() { awk '{print $14 + $15}' "/proc/$1/stat"; }      # clock ticks, user + system
sys() { awk '{print $15}' "/proc/$1/stat"; }
# Per thread: tid name switches (voluntary + involuntary).
threads() {
  for t in /proc/"$1"/task/*; do
    echo "$(basename "$t") $(cat "$t/comm") $(awk '/ctxt_switches/ {n += $2} END {print n}' "$t/status")"
  done | sort
}
declare -A c0 c1 s0 s1
"$bin" bench metadata --master "$addrs" --dir /b --duration "${secs}s" --concurrency 1 --json > "$work/out" &
client=$!
sleep 1
for i in 1 2 3; do c0[$i]=$(cpu "${mpid[$i]}"); s0[$i]=$(sys "${mpid[$i]}"); threads "${mpid[$i]}" > "$work/t0.$i"; done
cc0=$(cpu "$client"); t0=$(date +%s.%N)
if [ -n "${PERF:-}" ]; then
  perf record -F 2000 -g -o "$PERF" -p "${mpid[1]},${mpid[2]},${mpid[3]}" -- sleep $((secs - 2)) > /dev/null 2>&1
else
  sleep $((secs - 2))
fi
for i in 1 2 3; do c1[$i]=$(cpu "${mpid[$i]}"); s1[$i]=$(sys "${mpid[$i]}"); threads "${mpid[$i]}" > "$work/t1.$i"; done
cc1=$(cpu "$client"); t1=$(date +%s.%N)
wait "$client"
rate=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['creates_per_s'])" "$work/out")
n=$(python3 -c "print($rate * ($t1 - $t0))")   # creates in the measured window
tick=$(getconf CLK_TCK)
us() { python3 -c "print(round(($2 - $1) * 1e6 / $tick / $n, 1))"; }
roles=$("$bin" master list --json --master "$addrs")
echo "binary:              $bin"
echo "creates/s, 1 caller: $(python3 -c "print(round($rate))")"
for i in 1 2 3; do
  role=$(python3 -c "import json,sys; print(next(m['role'] for m in json.loads(sys.argv[1]) if m['id'] == $i))" "$roles")
  sw=$(join "$work/t0.$i" "$work/t1.$i" | awk -v n="$n" '{d += $5 - $3} END {printf "%.1f", d / n}')
  echo "master $i ($role): $(us "${c0[$i]}" "${c1[$i]}") µs CPU per create (kernel $(us "${s0[$i]}" "${s1[$i]}")), $sw context switches"
  join "$work/t0.$i" "$work/t1.$i" | awk -v n="$n" '$5 > $3 {printf "    thread %s %s: %.2f switches per create\n", $1, $2, ($5 - $3) / n}'
done
echo "client:              $(us "$cc0" "$cc1") µs CPU per create"
