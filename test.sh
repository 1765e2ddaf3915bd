#!/usr/bin/env bash
# The test suite: unit tests and spawned multi-process (gloo) worlds. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
