#!/usr/bin/env bash
# One folder of many objects listed through `granary local` (a folder under-store), against
# listing it on the local disk in the same run: the first `ls` (the master lists the
# under-store folder and records every entry), a second `ls` (the namespace only), and
# `ls -l` (a status per name).
#
#   bench/big-folder.sh [OBJECTS]     (default 50000 empty files; root, drops the page cache)
#
# Uses $GRANARY_BIN, else the debug binary scripts/test builds; GRANARY_FLAGS adds flags to
# `granary local`.
set -euo pipefail
n="${1:-50000}"
here="$(cd "$(dirname "$0")" && pwd)"
. "$here/lib.sh"
needs_root
local_workdir bigdir
mkdir -p "$work/ufs/big" "$work/mnt"
python3 - "$work/ufs/big" "$n" <<'PY'
import os, sys
root, n = sys.argv[1], int(sys.argv[2])
for i in range(n):
    open(os.path.join(root, f"f{i:07d}"), "wb").close()
PY
count() { ls "$1" | wc -l; }
count_l() { ls -l "$1" | tail -n +2 | wc -l; }
drop
raw=$(timed count "$work/ufs/big")
raw_l=$(timed count_l "$work/ufs/big")
GRANARY_LOG=warn "$bin" local --ufs "$work/ufs" --mount "$work/mnt" --cache-dir "$work/cache" \
  --cache-size 1GiB ${GRANARY_FLAGS:-} > "$work/local.log" 2>&1 &
pid=$!
for _ in $(seq 1 100); do mountpoint -q "$work/mnt" && break; sleep 0.1; done
mountpoint -q "$work/mnt" || { cat "$work/local.log"; exit 1; }
first=$(timed count "$work/mnt/big")
second=$(timed count "$work/mnt/big")
long=$(timed count_l "$work/mnt/big")
for r in "$first" "$second" "$long"; do
  [ "${r#* }" = "$n" ] || { echo "listed ${r#* } entries, not $n"; exit 1; }
done
printf '%-40s %8s s\n' "raw ls (page cache dropped)" "${raw% *}" \
  "raw ls -l" "${raw_l% *}" \
  "granary first ls (lists the store)" "${first% *}" \
  "granary second ls" "${second% *}" \
  "granary ls -l" "${long% *}"
echo "binary: $bin; one folder of $n objects"
