#!/usr/bin/env bash
# The test suite: unit tests and spawned multi-process (gloo) worlds. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup.sh
# Python may cache the bytecode it compiles here (the clone's own __pycache__ folders, git-ignored): the suite
# starts a few hundred processes, each of which would otherwise compile zeroshard's modules anew
unset PYTHONDONTWRITEBYTECODE
exec .venv/bin/python -m pytest -q "$@"
