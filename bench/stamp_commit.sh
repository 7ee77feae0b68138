#!/usr/bin/env bash
# Run here, from anywhere in the checkout, before each device call: writes the git-computed
# commit label (short HEAD, "-dirty" if the tree differs from it; see bench/commit.py) and a
# fingerprint of the tree to .devcache/commit, which the device tool carries (carry .devcache).
# There, without a usable .git, bench/commit.py reads the label from that file; if the
# tree there no longer matches the fingerprint, the label gets "-stale".
set -euo pipefail
cd "$(dirname "$0")/.."
exec python3 -m bench.commit --stamp
