#!/usr/bin/env bash
# A namespace of many files through `granary local` (a folder under-store), against the
# same tree on the local disk in the same run (issue 31, scaled to this machine):
#   - the first `find` (every folder listed from the store and recorded through Raft),
#   - a warm `find` with a stat per file (`-printf '%s'`), page cache dropped, against the
#     local disk's after a drop,
#   - `ls -l` of one folder,
#   - the master's store on disk per file and the process's resident memory per file,
#   - restart to serving: `granary local` stopped (SIGINT) and started again over the same
#     data, time until a stat of the deepest file answers.
#
#   bench/namespace-scale.sh [FOLDERS] [FILES_PER_FOLDER]   (default 200 × 1,000; root)
#
# Uses $GRANARY_BIN, else the debug binary scripts/test builds; GRANARY_FLAGS adds flags to
# `granary local`; FINDS=N repeats the warm find N times (each reported; the last counts);
# PERF_WARM=FILE records `perf record -g` of granary local during each warm find (the last
# one's stays; PERF_CALLGRAPH=dwarf for stacks through code without frame pointers,
# PERF_FREQ=HZ, default 999).
# The files are empty: this measures metadata only.
set -euo pipefail
folders="${1:-200}"
per="${2:-1000}"
total=$((folders * per))
here="$(cd "$(dirname "$0")" && pwd)"
. "$here/lib.sh"
needs_root
local_workdir nsscale
mkdir -p "$work/ufs/tree" "$work/mnt"
empty_tree "$work/ufs/tree" "$folders" "$per"
files_of() { find "$1" -type f | wc -l; }
stat_all() { find "$1" -type f -printf '%s\n' | wc -l; }
ls_l() { ls -l "$1" | tail -n +2 | wc -l; }
start() {
  GRANARY_LOG=warn "$bin" local --ufs "$work/ufs" --mount "$work/mnt" --cache-dir "$work/cache" \
    --cache-size 1GiB ${GRANARY_FLAGS:-} >> "$work/local.log" 2>&1 &
  pid=$!
}
drop
raw_find=$(timed stat_all "$work/ufs/tree")
drop
raw_ls=$(timed ls_l "$work/ufs/tree/d00000")

start
for _ in $(seq 1 300); do mountpoint -q "$work/mnt" && break; sleep 0.1; done
mountpoint -q "$work/mnt" || { cat "$work/local.log"; exit 1; }
first=$(timed files_of "$work/mnt/tree")
warms=""
for _ in $(seq 1 "${FINDS:-1}"); do
  drop
  if [ -n "${PERF_WARM:-}" ]; then
    perf record -F "${PERF_FREQ:-999}" --call-graph "${PERF_CALLGRAPH:-fp}" -o "$PERF_WARM" -p "$pid" > /dev/null 2>&1 &
    perf_pid=$!
    sleep 1
  fi
  warm=$(timed stat_all "$work/mnt/tree")
  warms="$warms ${warm% *}"
  if [ -n "${PERF_WARM:-}" ]; then kill -INT "$perf_pid"; wait "$perf_pid" || true; fi
done
drop
lsl=$(timed ls_l "$work/mnt/tree/d00000")
for r in "$first" "$warm"; do
  [ "${r#* }" = "$total" ] || { echo "found ${r#* } files, not $total"; exit 1; }
done
rss_kib=$(awk '/^VmRSS/ { print $2 }' "/proc/$pid/status")
meta_kib=$(du -sk "$work/cache" | awk '{print $1}')

# Restart to serving: the deepest file's status answers again.
kill -INT "$pid"; wait "$pid" || true; pid=""
mountpoint -q "$work/mnt" && umount -l "$work/mnt"
last="$work/mnt/tree/d$(printf %05d $((folders - 1)))/f$(printf %06d $((per - 1)))"
s=$(date +%s.%N)
start
for _ in $(seq 1 600); do stat "$last" > /dev/null 2>&1 && break; sleep 0.05; done
e=$(date +%s.%N)
stat "$last" > /dev/null || { echo "no answer after a restart"; exit 1; }
restart=$(python3 -c "print(f'{$e - $s:.2f}')")

printf '%-52s %8s s\n' "raw find -printf %s (page cache dropped)" "${raw_find% *}" \
  "granary first find (every folder listed from the store)" "${first% *}" \
  "granary warm find -printf %s (page cache dropped)" "${warm% *}"
[ "${FINDS:-1}" -gt 1 ] && echo "  each warm find (FINDS=${FINDS}):$warms s"
python3 -c "print(f\"{'  warm / raw':52s} {${warm% *} / max(${raw_find% *}, 0.01):8.1f} x\")"
printf '%-52s %8s s\n' "raw ls -l of one folder ($per entries)" "${raw_ls% *}" \
  "granary ls -l of the same folder" "${lsl% *}" \
  "restart to serving (SIGINT, start, first stat)" "$restart"
echo "master store on disk (cache dir, all of it): $((meta_kib / 1024)) MiB, $((meta_kib * 1024 / total)) bytes per file"
echo "resident memory of granary local after the finds: $((rss_kib / 1024)) MiB, $((rss_kib * 1024 / total)) bytes per file"
echo "binary: $bin; $folders folders × $per files = $total files"
