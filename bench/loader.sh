#!/usr/bin/env bash
# The training-loader pattern: N loader processes (a PyTorch DataLoader with num_workers=N)
# each open, read whole and close sample files, in a new random order every epoch, in
# batches of 32, no compute between batches. Targets in the same run, alternating:
#   raw     the folder on the local disk
#   bindfs  the same folder through `bindfs -o multithreaded` (a FUSE passthrough with no
#           caching logic; installed here when missing)
#   warm    Granary (`granary local` over the folder), every block cached on the worker's
#           disk; page cache dropped before each epoch
#   cold    Granary's first epoch, every file from the under-store (once, first)
#   raw-cold the raw folder's first read after a drop (the limit of `cold`; its loaders
#           check every sample's SHA-256 as the cold epoch's do, so both do the same work)
#   copy    the same first read, each sample also written once to a new file on the disk
#           the cache is on: the least any cache that keeps what it reads does
#
#   bench/loader.sh [FILES] [KIB] [LOADERS]   (default 4000 files of ~100 KiB, 4 loaders; root)
#   ROUNDS=N  raw/bindfs/warm triples, alternating, medians reported (default 3)
#   PERF_COLD=FILE  records `perf record -g` (DWARF stacks) of granary local's cold epoch
#
# Sample sizes vary ±15 % around KIB. Every sample of the cold epoch and of the first warm
# epoch is checked against the SHA-256 of the source file. Reports samples/s, MB/s, the
# ratios warm/bindfs and warm/raw, CPU seconds per 1,000 samples of the FUSE processes
# (granary local is master, worker and FUSE daemon in one), and Granary's requests per
# sample by kind (those that wait on the network: `granary_client_op_seconds_count`).
# Uses $GRANARY_BIN, else the debug binary scripts/test builds; GRANARY_FLAGS adds flags
# to `granary local`.
set -euo pipefail
files="${1:-4000}"
kib="${2:-100}"
loaders="${3:-4}"
rounds="${ROUNDS:-3}"
here="$(cd "$(dirname "$0")" && pwd)"
. "$here/lib.sh"
needs_root
command -v bindfs >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bindfs >/dev/null 2>&1; }
local_workdir loader
bindfs_pid=""
cleanup_all() {
  mountpoint -q "$work/bind" && umount "$work/bind" || true
  local_cleanup
}
trap cleanup_all EXIT
mkdir -p "$work/ufs" "$work/mnt" "$work/bind"
python3 "$here/make-samples.py" "$work/ufs/data" "$files" "$kib" "$work/manifest"
mport=$(free_port)
GRANARY_LOG=warn "$bin" local --ufs "$work/ufs" --mount "$work/mnt" --cache-dir "$work/cache" \
  --cache-size "$((files * kib * 2 / 1024 + 1024))MiB" --metrics-listen "127.0.0.1:$mport" \
  ${GRANARY_FLAGS:-} > "$work/local.log" 2>&1 &
pid=$!
for _ in $(seq 1 100); do mountpoint -q "$work/mnt" && break; sleep 0.1; done
mountpoint -q "$work/mnt" || { cat "$work/local.log"; exit 1; }
bindfs -o multithreaded "$work/ufs" "$work/bind"
bindfs_pid=$(pgrep -n -f "bindfs -o multithreaded $work/ufs" || true)

cpu_of() { [ -n "$1" ] && awk '{print $14 + $15}' "/proc/$1/stat" 2>/dev/null || echo 0; }
ops() { curl -s "127.0.0.1:$mport/metrics" | awk '/^granary_client_op_seconds_count/ { print $1, $2 }'; }
# FUSE requests by kind, network waits by kind, kept-file reads, opens from parked
# passthrough backing files (counters).
counters() { curl -s "127.0.0.1:$mport/metrics" | awk '/^granary_client_fuse_requests_total|^granary_client_op_seconds_count|^granary_client_kept_reads_total|^granary_client_parked_opens_total/ { print $1, $2 }'; }
epoch=0
# pass TARGET_DIR CHECK PID -> "samples bytes seconds bad cpu_ticks"
pass() { # TARGET_DIR CHECK PID [COPY_DIR]
  epoch=$((epoch + 1))
  local c0 c1 out
  c0=$(cpu_of "$3")
  out=$(python3 "$here/loader.py" "$1" "$work/manifest" "$loaders" "$epoch" "$2" ${4:+"$4"})
  c1=$(cpu_of "$3")
  echo "$out $((c1 - c0))"
}
drop; rawcold=$(pass "$work/ufs/data" 1 "")
mkdir -p "$work/copy"
# Kept to the end: deleting thousands of files just before the cold epoch would slow its
# cache file creation (ext4 without a journal scans recently deleted inodes).
drop; copied=$(pass "$work/ufs/data" 1 "" "$work/copy")
ops0=$(ops)
drop
if [ -n "${PERF_COLD:-}" ]; then
  perf record -F 1999 -g --call-graph dwarf,16384 -o "$PERF_COLD" -p "$pid" > /dev/null 2>&1 &
  perf_pid=$!
  sleep 1
fi
cold=$(pass "$work/mnt/data" 1 "$pid")
if [ -n "${PERF_COLD:-}" ]; then kill -INT "$perf_pid"; wait "$perf_pid" || true; fi
warmed=$(metric_at "$mport" granary_client_warm_files_total)
drop; first=$(pass "$work/mnt/data" 1 "$pid")
for r in "$cold" "$first"; do
  [ "$(echo "$r" | awk '{print $4}')" = 0 ] || { echo "samples differ from the source: $r"; exit 1; }
  [ "$(echo "$r" | awk '{print $1}')" = "$files" ] || { echo "samples missing: $r"; exit 1; }
done
ops1=$(ops)
triples=""
warm0=$(counters)
for _ in $(seq 1 "$rounds"); do
  drop; r=$(pass "$work/ufs/data" 0 "")
  drop; b=$(pass "$work/bind/data" 0 "$bindfs_pid")
  drop; w=$(pass "$work/mnt/data" 0 "$pid")
  triples="$triples$r|$b|$w;"
done
warm1=$(counters)
python3 - "$files" "$kib" "$loaders" "$rawcold" "$cold" "$triples" "$(getconf CLK_TCK)" "$ops0" "$ops1" "$warm0" "$warm1" "$rounds" "${warmed:-0}" "$copied" <<'PY'
import statistics, sys
files, kib, loaders = sys.argv[1], sys.argv[2], sys.argv[3]
tck = int(sys.argv[7])
def parse(s):
    n, b, t, bad, cpu = s.split()
    return int(n), int(b), float(t), int(cpu)
def rate(s):
    n, b, t, _ = parse(s)
    return n / t, b / t / 1e6
def cpu_per_k(s):
    n, _, _, cpu = parse(s)
    return cpu / tck / n * 1000
triples = [t.split("|") for t in sys.argv[6].split(";") if t]
raw = [rate(t[0])[0] for t in triples]
bind = [rate(t[1])[0] for t in triples]
warm = [rate(t[2])[0] for t in triples]
print(f"{files} files of ~{kib} KiB, {loaders} loaders, {len(triples)} alternating rounds (medians)")
for name, xs, ts in [("raw", raw, [t[0] for t in triples]), ("bindfs", bind, [t[1] for t in triples]), ("granary warm", warm, [t[2] for t in triples])]:
    mbs = statistics.median(rate(t)[1] for t in ts)
    cpu = statistics.median(cpu_per_k(t) for t in ts)
    cpu_s = f", {cpu:.2f} CPU s / 1,000 samples of the FUSE process" if name != "raw" else ""
    print(f"  {name:13s} {statistics.median(xs):9.0f} samples/s {mbs:8.1f} MB/s{cpu_s}")
print(f"  warm/bindfs   {statistics.median(w / b for w, b in zip(warm, bind)):.2f}x   warm/raw {statistics.median(w / r for w, r in zip(warm, raw)):.2f}x")
rc, c = rate(sys.argv[4])[0], rate(sys.argv[5])[0]
print(f"  cold (first epoch from the store) {c:.0f} samples/s, raw first read {rc:.0f}: {c / rc:.2f}x, {cpu_per_k(sys.argv[5]):.2f} CPU s / 1,000 samples, files warmed ahead of the loaders {float(sys.argv[13]):.0f}")
cp = rate(sys.argv[14])[0]
print(f"  raw first read writing each sample once to the cache's disk (copy) {cp:.0f} samples/s ({cp / rc:.2f}x the raw first read): cold / copy {c / cp:.2f}x")
def opmap(s):
    out = {}
    for line in s.splitlines():
        k, v = line.rsplit(" ", 1)
        out[k] = float(v)
    return out
o0, o1 = opmap(sys.argv[8]), opmap(sys.argv[9])
per = {k.split('op="')[1].split('"')[0]: (o1[k] - o0.get(k, 0)) / (2 * int(files)) for k in o1 if 'op="' in k}
print("  requests per sample (cold + first warm epoch, those that wait on the network): " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(per.items()) if v > 0))
w0, w1, rounds = opmap(sys.argv[10]), opmap(sys.argv[11]), int(sys.argv[12])
n = rounds * int(files)
def per_kind(prefix):
    return {k.split('op="')[1].split('"')[0]: (w1[k] - w0.get(k, 0)) / n for k in w1 if k.startswith(prefix) and 'op="' in k}
fuse = per_kind("granary_client_fuse_requests_total")
net = per_kind("granary_client_op_seconds_count")
def delta(k):
    return (w1.get(k, 0) - w0.get(k, 0)) / n
kept = delta("granary_client_kept_reads_total")
parked = delta("granary_client_parked_opens_total")
print("  warm epochs, per sample: FUSE requests " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(fuse.items()) if v > 0.005)
      + "; waiting on the network " + (", ".join(f"{k} {v:.2f}" for k, v in sorted(net.items()) if v > 0.005) or "none")
      + f"; reads from kept block files {kept:.2f}; opens from parked backing files {parked:.2f}")
PY
