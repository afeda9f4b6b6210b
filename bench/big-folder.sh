#!/usr/bin/env bash
# One folder of many objects listed through `granary local` (a folder under-store), against
# listing it on the local disk in the same run: the first `ls` (the master lists the
# under-store folder and records every entry), a second `ls` (the namespace only),
# `ls -l` (a status per name), and, once the mount's sync interval (10 s) has passed with
# one object added to the store, the `ls` that finds the folder due (answered from what
# is known while the re-listing runs, since stale-while-revalidate; before, it waited for
# the whole re-listing) and the time until the added object shows.
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
: > "$work/ufs/big/zz-added"
sleep 11 # the default sync_interval (10 s) passes: the next access finds the folder due
due=$(timed count "$work/mnt/big")
t0=$(date +%s.%N)
until [ -e "$work/mnt/big/zz-added" ] && [ "$(count "$work/mnt/big")" = $((n + 1)) ]; do
  sleep 0.05
  python3 -c "import sys; sys.exit($(date +%s.%N) - $t0 < 300)" && { echo "the added object never showed"; exit 1; }
done
shown=$(python3 -c "print(f'{$(date +%s.%N) - $t0 + ${due% *}:.2f}')")
printf '%-40s %8s s\n' "raw ls (page cache dropped)" "${raw% *}" \
  "raw ls -l" "${raw_l% *}" \
  "granary first ls (lists the store)" "${first% *}" \
  "granary second ls" "${second% *}" \
  "granary ls -l" "${long% *}" \
  "granary ls when the re-listing is due" "${due% *}" \
  "  ... until an added object shows" "$shown"
echo "binary: $bin; one folder of $n objects"
