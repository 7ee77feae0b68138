# Sourced by the device scripts (device_suite.sh, device_tests.sh, device_plan.sh): the wheels the
# GPU machine lacks (.whl, made by bench/fetch_device_wheels.sh) into /tmp/site, once per warm
# machine (a later call on it finds them), and the import path.
if ls .whl/*.whl >/dev/null 2>&1 && ! { [ -f /tmp/site/.ft-wheels ] && ls .whl | cmp -s - /tmp/site/.ft-wheels; }; then
  timeout 120 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && ls .whl > /tmp/site/.ft-wheels
fi
export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1
