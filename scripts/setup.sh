#!/usr/bin/env bash
# Create .venv (once) and install zeroshard with its test extras. torch is pinned by constraints.txt
# so that pip takes the local CPU wheel instead of pulling the multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.zeroshard-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ constraints.txt -nt "$stamp" ]; then
  .venv/bin/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[test]"
  touch "$stamp"
fi
