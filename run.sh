#!/usr/bin/env bash
# The main job: a real 2-process ZeRO training run (stage 3, gloo on CPU) on the Python standard
# library's own source. Extra arguments go to `zeroshard demo` (e.g. --steps 100 --stage 1).
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup.sh
exec .venv/bin/zeroshard demo "$@"
