#!/usr/bin/env bash
# Merge what a device call brought back into .devcache/warm-cache.tgz (bench/device_env.sh restores
# it on the next machine): a whole cache ($FILES_AT/warm-cache.tgz) replaces it; the kernels compiled
# since the restore ($FILES_AT/warm-cache-new.tgz, what bench/device_plan.sh returns when the whole
# cache is over the 16 MiB a returned file may have) are added to it.
# Usage, from the repository's root: bash bench/merge_warm_cache.sh FILES_AT   (the run's files_at folder)
set -euo pipefail
FROM=${1:?usage: bash bench/merge_warm_cache.sh FILES_AT}
DEST="$PWD/.devcache/warm-cache.tgz"
mkdir -p .devcache
if [ -f "$FROM/warm-cache.tgz" ]; then
  cp -f "$FROM/warm-cache.tgz" "$DEST.tmp" && mv -f "$DEST.tmp" "$DEST"
  echo "warm cache replaced: $(du -h "$DEST" | cut -f1)"
elif [ -f "$FROM/warm-cache-new.tgz" ]; then
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  [ -f "$DEST" ] && tar xzf "$DEST" -C "$work"
  tar xzf "$FROM/warm-cache-new.tgz" -C "$work"
  # the carry limit is 64 MiB with the tree and the wheels: say when the merged cache nears it
  (cd "$work" && tar czf "$DEST.tmp" .) && mv -f "$DEST.tmp" "$DEST"
  size=$(stat -c %s "$DEST")
  echo "warm cache merged: $(du -h "$DEST" | cut -f1)"
  [ "$size" -lt 40000000 ] || echo "warning: $DEST is over 40 MB: start it afresh from a call's whole cache"
else
  echo "no warm cache in $FROM" >&2; exit 1
fi
