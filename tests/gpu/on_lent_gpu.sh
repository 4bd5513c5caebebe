#!/usr/bin/env bash
# Everything a lent GPU machine runs, in one call (it has no network): install the wheels carried
# in .whl/ (Ray and what it needs that the machine lacks), measure the GPU data plane first
# (python -m bench gpu), then the ordered GPU checks (tests/gpu/check.py); logs and results go to
# $OUT (the device tool brings back at most 8 files: the check logs travel as one archive).
# Usage: OUT=<folder> BENCH_S=<seconds> CHECK_S=<seconds> [CHECK_ONLY=step,...] bash tests/gpu/on_lent_gpu.sh [bench options]
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-gpu-check}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RESHARD_REQUIRE_GPUS=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,compute_mode --format=csv | tee "$OUT/smi.txt"
timeout "${BENCH_S:-240}" python3 -m bench gpu --out "$OUT/gpu.json" "$@" 2>&1 | tee "$OUT/bench.log"
echo "bench exit: $?"
timeout "${CHECK_S:-300}" python3 tests/gpu/check.py --keep-going --no-bench ${CHECK_ONLY:+--only "$CHECK_ONLY"} \
    --out /tmp/gpu-check 2>&1 | tee "$OUT/check.log"
echo "check exit: $?"
tar czf "$OUT/check-logs.tgz" -C /tmp gpu-check 2>/dev/null
cat /tmp/gpu-check/summary.txt 2>/dev/null
