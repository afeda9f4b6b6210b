#!/usr/bin/env bash
# Warm sequential reads of big shards (WebDataset tars, TFRecords, Parquet: files of many
# blocks) from the disk, against the raw disk read of the same files in the same run.
#
#   bench/shard-read.sh [SHARD_MIB] [SHARDS] [EACH_MIB] [ROUNDS]
#                        (defaults 2048 8 1024 4; needs root for FUSE and to drop caches)
#
# Through `granary local` over a folder. Once a file's every block is cached on the node's
# worker it opens in FUSE passthrough: the kernel reads the file version's cache file
# (blocks at their offsets) with no daemon in the way. Two cases, each as pairs in
# alternating order (page cache dropped before every read), medians:
#   one reader of one SHARD_MIB file; SHARDS readers at once, each of its own EACH_MIB file.
# Every file is compared with its source once (cmp) before the timed rounds; the first
# passthrough open of each file checks every page's CRC32C, as documented.
#
# Uses $GRANARY_BIN, else the debug binary scripts/test builds. Prints MB/s and ratios.
set -euo pipefail
shard_mib="${1:-2048}" shards="${2:-8}" each_mib="${3:-1024}" rounds="${4:-4}"
. "$(dirname "$0")/lib.sh"
needs_root
local_workdir shard
mkdir -p "$work/ufs/one" "$work/ufs/many" "$work/mnt"
head -c "$((shard_mib << 20))" /dev/urandom > "$work/ufs/one/shard-0000.tar"
for i in $(seq 1 "$shards"); do
  head -c "$((each_mib << 20))" /dev/urandom > "$work/ufs/many/shard-$(printf %04d "$i").tar"
done

# Leases of files open in passthrough may hold at most a quarter of the cache: room for
# every shard read at once, four times over.
cache_mib=$(( (shard_mib > shards * each_mib ? shard_mib : shards * each_mib) * 4 + 1024 ))
mport=$(free_port)
GRANARY_LOG=warn "$bin" local --ufs "$work/ufs" --mount "$work/mnt" --cache-dir "$work/cache" \
  --cache-size "${cache_mib}MiB" --metrics-listen "127.0.0.1:$mport" > "$work/local.log" 2>&1 &
pid=$!
for _ in $(seq 1 100); do mountpoint -q "$work/mnt" && break; sleep 0.1; done
mountpoint -q "$work/mnt" || { cat "$work/local.log"; exit 1; }

# Cold (fills the cache), then checked against the source (the first passthrough opens).
cat "$work"/mnt/one/* "$work"/mnt/many/* > /dev/null
for f in "$work"/ufs/one/* "$work"/ufs/many/*; do
  rel="${f#"$work"/ufs/}"
  cmp -s "$f" "$work/mnt/$rel" || { echo "bytes differ: $rel"; exit 1; }
done
opens0=$(metric_at "$mport" granary_client_passthrough_opens_total)
daemon0=$(curl -s "127.0.0.1:$mport/metrics" | awk '$1 ~ /^granary_client_read_bytes_total/ { s += $2 } END { printf "%d\n", s }')

seconds() { # command... -> seconds it took
  local t0 t1
  t0=$(date +%s.%N); "$@"; t1=$(date +%s.%N)
  python3 -c "print($t1 - $t0)"
}
read_all() { cat "$1"/one/* > /dev/null; }
read_each() { # dir: one reader per file, at once
  local p=() f
  for f in "$1"/many/*; do cat "$f" > /dev/null & p+=($!); done
  for f in "${p[@]}"; do wait "$f"; done
}
raw1=() g1=() rawn=() gn=()
for round in $(seq 1 "$rounds"); do
  # Alternating order: neither side always reads right after the other.
  if [ $((round % 2)) = 1 ]; then
    drop; raw1+=("$(seconds read_all "$work/ufs")")
    drop; g1+=("$(seconds read_all "$work/mnt")")
    drop; rawn+=("$(seconds read_each "$work/ufs")")
    drop; gn+=("$(seconds read_each "$work/mnt")")
  else
    drop; g1+=("$(seconds read_all "$work/mnt")")
    drop; raw1+=("$(seconds read_all "$work/ufs")")
    drop; gn+=("$(seconds read_each "$work/mnt")")
    drop; rawn+=("$(seconds read_each "$work/ufs")")
  fi
done
opens=$(metric_at "$mport" granary_client_passthrough_opens_total)
daemon=$(curl -s "127.0.0.1:$mport/metrics" | awk '$1 ~ /^granary_client_read_bytes_total/ { s += $2 } END { printf "%d\n", s }')

python3 - "$shard_mib" "$shards" "$each_mib" "${raw1[*]}" "${g1[*]}" "${rawn[*]}" "${gn[*]}" <<'EOF'
import statistics, sys
shard, n, each = (int(x) for x in sys.argv[1:4])
raw1, g1, rawn, gn = ([float(x) for x in a.split()] for a in sys.argv[4:8])
def line(name, mib, raw, g):
    mb = lambda s: (mib << 20) / s / 1e6
    r, m = statistics.median(raw), statistics.median(g)
    ratios = [a / b for a, b in zip(raw, g)]
    # This VM reads whatever goes second in a pair faster; over rounds in alternating order
    # the geometric mean of the pairs' ratios cancels that.
    geo = statistics.geometric_mean(ratios)
    print(f"{name}: raw disk {mb(r):.0f} MB/s, granary {mb(m):.0f} MB/s = {r / m:.2f}x; "
          f"pairs' geometric mean {geo:.2f}x (rounds: {' '.join(f'{x:.2f}' for x in ratios)}; "
          f"medians of {len(raw)} pairs in alternating order, page cache dropped)")
line(f"1 reader of a {shard} MiB shard", shard, raw1, g1)
line(f"{n} readers of {n} x {each} MiB shards", n * each, rawn, gn)
EOF
echo "passthrough opens in the timed rounds: $((opens - opens0)) (of $((rounds * (1 + shards))) reads); bytes the daemon read in them: $((daemon - daemon0))"
