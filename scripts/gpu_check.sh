#!/usr/bin/env bash
# The checks that need a GPU, for a one-GPU machine (H100/H200) where torch, transformers, accelerate, peft
# and pytest are installed already and there is no network.  Run from the source tree; nothing is
# installed or downloaded:
#
#   OUT=/some/dir bash scripts/gpu_check.sh      # logs, selftest.json/.png and a summary under $OUT
#
# Each part runs under its own time limit (550 s in all at most) and writes OUT/<part>.log; the
# summary (OUT/summary.txt) lists each part's exit status and seconds.  The exit status is 1 when a
# part failed or ran out of time.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_check_out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python}"
failed=0

part() {  # part NAME SECONDS COMMAND...: run it under a time limit, log it, keep its status
    local name=$1 limit=$2 start=$SECONDS rc
    shift 2
    echo "== $name (limit ${limit}s): $*"
    timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    echo "$name: exit $rc in $((SECONDS - start)) s$([ "$rc" = 124 ] && echo ' (time limit)')" | tee -a "$OUT/summary.txt"
    tail -n 30 "$OUT/$name.log"
    [ "$rc" = 0 ] || failed=1
}

: >"$OUT/summary.txt"
nvidia-smi >"$OUT/nvidia-smi.log" 2>&1 || true
part env 20 "$PY" -m zeroshard.tools.cli env
# the main job on one GPU: batches, held-out set and the sample's prompt on the engine's device
part demo 75 "$PY" -m zeroshard.tools.cli demo --nproc 1 --out "$OUT/demo"
part selftest 180 "$PY" -m zeroshard.tools.cli selftest --device cuda --nproc 1 --size 350m \
    --json "$OUT/selftest.json"
# a step's phases on this GPU (forward, backward, each collective, bucket copies, optimizer, host reads), DDP
# and the floor beside stages 0 and 2 (benchmarks/step_phases.py): the table in the log, the numbers in the JSON
part step_phases 50 "$PY" benchmarks/bench_step_ratio.py --device cuda --nproc 1 --configs 23m:bf16 \
    --baselines ddp floor --stages 0 2 --rounds 5 --warmup 2 --profile --profile-rounds 3 \
    --out "$OUT/step_phases.json"
# FP8 layers against bf16 on this GPU: tokens/s and loss (skipped, exit 0, without torchao or FP8 GEMMs)
part fp8 75 "$PY" scripts/fp8_gpu_check.py --json "$OUT/fp8.json"
# the tests that need a GPU (marked `cuda`; they run their ranks with the GPU visible)
if "$PY" -m pytest --markers -p no:cacheprovider 2>/dev/null | grep -q "^@pytest.mark.cuda"; then
    part pytest_cuda 90 "$PY" -m pytest -q -p no:cacheprovider -m cuda tests
else
    echo "pytest_cuda: skipped (no cuda marker)" | tee -a "$OUT/summary.txt"
fi
# a quick representative subset on this machine's torch (the suite's CPU worlds, the single-process engine)
part pytest_quick 60 "$PY" -m pytest -q -p no:cacheprovider -m "not cuda" tests/unit/test_single_process.py \
    tests/unit/test_config.py tests/unit/test_estimate.py tests/distributed/test_selftest.py
echo "== summary"
cat "$OUT/summary.txt"
exit "$failed"
