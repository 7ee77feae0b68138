# Sourced by the device scripts (device_suite.sh, device_tests.sh, device_plan.sh): the wheels the
# GPU machine lacks (.whl, made by bench/fetch_device_wheels.sh) into /tmp/site, once per warm
# machine (a later call on it finds them), and the import path.
if ls .whl/*.whl >/dev/null 2>&1 && ! { [ -f /tmp/site/.ft-wheels ] && ls .whl | cmp -s - /tmp/site/.ft-wheels; }; then
  timeout 120 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && ls .whl > /tmp/site/.ft-wheels
fi
export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1
# the results' commit label from .devcache/commit (bench/commit.py), "-stale" where the tree moved since:
# a .git left on this machine by an earlier call names another commit (plan 146 was labelled 9a9608c-dirty)
export FT_COMMIT_SOURCE=stamp
# One cache folder for every pytest process and bench of a call (tests/conftest.py reads
# FREETOKEN_TEST_CACHE): each test file used to rebuild the C++ executor (20-60 s) in a fresh one.
export FREETOKEN_TEST_CACHE="${FREETOKEN_TEST_CACHE:-$HOME/.cache}"
# Kernels compiled on an earlier machine (bench/device_plan.sh leaves $OUT/warm-cache.tgz: copy it
# to .devcache/ here): Triton's cache (keyed by source, options and GPU: a stale entry is never used)
# and the C++ executor's build, extracted with fresh times so they count as newer than the checkout
# (a changed source still rebuilds: torch's build compares what it compiles, not only times).
# A warm machine restores again when the call carries a different cache (a quantized plan's after a
# bf16 one): the flag holds the checksum of the tarball restored last.
if [ -f .devcache/warm-cache.tgz ] && [ "$(cat /tmp/.ft-warm-restored 2>/dev/null)" != "$(md5sum < .devcache/warm-cache.tgz)" ]; then
  mkdir -p "$HOME" && tar xzmf .devcache/warm-cache.tgz -C "$HOME" 2>/dev/null \
    && md5sum < .devcache/warm-cache.tgz > /tmp/.ft-warm-restored \
    && echo "warm cache restored ($(du -sh "$HOME/.triton" 2>/dev/null | cut -f1) of Triton kernels)" >&2
fi
