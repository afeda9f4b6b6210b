#!/usr/bin/env bash
# fio through the FUSE mount of `granary local`, warm (every byte cached on the worker),
# against the same fio job on the local disk in the same run. The page cache is dropped
# before every job (root), so both sides read from the disk: the raw job the source files,
# Granary the worker's cache files (FUSE passthrough once a file is wholly cached on the
# node's worker, whatever its length; short-circuit through the daemon with
# GRANARY_FLAGS=--no-passthrough).
#
#   bench/fio-read.sh [SIZE_MIB]     (default 1024; root, fio)
#
# Jobs (bench/fio/*.fio): seq-read (1 MiB sequential, one file of SIZE_MIB), rand-read
# (4 KiB random, 4 readers, 10 s), rand-100k (100 KB random, 16 readers, 1,000 reads each: record
# formats read by a loader), files-read (1 MiB sequential over SIZE_MIB of 64 MiB
# one-block files; their files are made only when the job is run). Per job one unmeasured round, then $ROUNDS (default 5) measured rounds in
# alternating order (raw first, then Granary first), medians. JOBS="files-read" runs only the
# jobs named. Uses $GRANARY_BIN, else the debug binary scripts/test builds.
set -euo pipefail
size_mib="${1:-1024}"
rounds="${ROUNDS:-5}"
# fio's posix_fadvise hint (SEQUENTIAL doubles a file's read-ahead on the local disk, while
# FUSE passthrough reads its backing file with the disk's plain read-ahead: the kernel does
# not pass the hint on). FADVISE=0 runs the jobs without it.
export FADVISE="${FADVISE:-1}"
here="$(cd "$(dirname "$0")" && pwd)"
. "$here/lib.sh"
needs_root
local_workdir fio
mkdir -p "$work/ufs/blocks" "$work/mnt"
head -c "$((size_mib * 1024 * 1024))" /dev/urandom > "$work/ufs/seq.bin"
jobs="${JOBS:-seq-read rand-read rand-100k files-read}"
case " $jobs " in
  *" files-read "*)
    for i in $(seq 1 $((size_mib / 64))); do
      head -c $((64 * 1024 * 1024)) /dev/urandom > "$work/ufs/blocks/b$i.bin"
    done;;
esac
# The files-read job holds all its files open at once, and a passthrough open leases its
# whole file, while leases hold at most a quarter of the worker's cache: with a 3x cache,
# 6 of the 16 files were refused passthrough and read through the daemon (partly over gRPC).
GRANARY_LOG=warn "$bin" local --ufs "$work/ufs" --mount "$work/mnt" --cache-dir "$work/cache" \
  --cache-size "$((size_mib * 6))MiB" ${GRANARY_FLAGS:-} > "$work/local.log" 2>&1 &
pid=$!
for _ in $(seq 1 100); do mountpoint -q "$work/mnt" && break; sleep 0.1; done
mountpoint -q "$work/mnt" || { cat "$work/local.log"; exit 1; }
# Warm the cache: everything read once through the mount (and checked).
cmp -s "$work/ufs/seq.bin" "$work/mnt/seq.bin" || { echo "bytes differ"; exit 1; }
for f in "$work"/ufs/blocks/*.bin; do
  [ -e "$f" ] || continue
  cmp -s "$f" "$work/mnt/blocks/$(basename "$f")" || { echo "bytes differ: $f"; exit 1; }
  cat "$work/mnt/blocks/$(basename "$f")" > /dev/null # first passthrough opens check every CRC32C
done

# fio JOB DIR FILE -> "MB/s IOPS"
run_fio() {
  drop
  DIR="$2" FILE="$3" fio --readonly --output-format=json "$here/fio/$1.fio" |
    python3 -c 'import json,sys; t=sys.stdin.read(); j=json.loads(t[t.index("{"):])["jobs"][0]["read"]; print("%.0f %.0f" % (j["bw_bytes"] / 1e6, j["iops"]))'
}
median() { python3 -c "import sys,statistics; print(statistics.median(float(x) for x in sys.argv[1:]))" "$@"; }
report() { # name unit raw... -- granary...
  local name=$1 col=$2; shift 2
  local raws=() grs=()
  while [ "$1" != "--" ]; do raws+=("$1"); shift; done; shift
  grs=("$@")
  local r g
  r=$(median "${raws[@]}"); g=$(median "${grs[@]}")
  printf '%-11s raw %8.0f %s   granary %8.0f %s   %.2fx   (rounds: raw %s | granary %s)\n' \
    "$name" "$r" "$col" "$g" "$col" "$(python3 -c "print($g / $r)")" "${raws[*]}" "${grs[*]}"
}
declare -A raw_bw gr_bw raw_iops gr_iops
for job in $jobs; do
  case $job in
    files-read) rdir="$work/ufs/blocks"; gdir="$work/mnt/blocks"; file="";;
    *) rdir="$work/ufs"; gdir="$work/mnt"; file="seq.bin";;
  esac
  rb=() gb=() ri=() gi=()
  # One unmeasured round first: on this VM the first read of anything after another job is
  # slow whoever does it (the host's cache state), which hit whichever side went first.
  run_fio "$job" "$rdir" "$file" > /dev/null
  run_fio "$job" "$gdir" "$file" > /dev/null
  for round in $(seq 1 "$rounds"); do
    # Alternating order: neither side always reads right after the other.
    for side in raw granary; do
      if [ $((round % 2)) = 0 ]; then side=$([ "$side" = raw ] && echo granary || echo raw); fi
      if [ "$side" = raw ]; then
        read -r b i < <(run_fio "$job" "$rdir" "$file"); rb+=("$b"); ri+=("$i")
      else
        read -r b i < <(run_fio "$job" "$gdir" "$file"); gb+=("$b"); gi+=("$i")
      fi
    done
  done
  if [ "$job" = rand-read ] || [ "$job" = rand-100k ]; then
    report "$job" IOPS "${ri[@]}" -- "${gi[@]}"
  else
    report "$job" MB/s "${rb[@]}" -- "${gb[@]}"
  fi
done
echo "binary: $bin; ${size_mib} MiB per job; fadvise_hint=$FADVISE; page cache dropped before every job"
