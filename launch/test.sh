#!/usr/bin/env bash
# The test suite on CPU: sets up .venv if needed, then runs pytest (GPU tests are deselected; see README).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$(bash launch/setup.sh | tail -n 1)
exec "$PY" -m pytest -q "$@"
