#!/usr/bin/env bash
# Every figure the README and the bench pages publish, measured again on one clean commit: each suite
# writes bench/results/<suite>-<revision>.json (its header names the revision and the exact command)
# and its figures. The emulated-host suites need root. About 50 minutes on the 2-core development
# machine. A suite that fails is named at the end (the pipeline suite also exits non-zero when one of
# its targets is missed; its result is written all the same); the others still run.
#
#   bench/headline.sh                 # every suite
#   bench/headline.sh weights local   # only these (names below)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
if [ -n "$(git status --porcelain -- . ':!bench/results' ':!bench/figures')" ]; then
    echo "headline: the tree differs from its commit; commit first (the results must name a clean revision)" >&2
    exit 2
fi
REV=$(git rev-parse --short HEAD)
R=bench/results
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=token
failed=()

suite() {  # suite NAME COMMAND...: runs COMMAND when NAME is asked for (or nothing was)
    local name=$1
    shift
    if [ ${#ONLY[@]} -gt 0 ] && [[ ! " ${ONLY[*]} " == *" $name "* ]]; then
        return
    fi
    echo "== $name: $*"
    local start=$SECONDS
    "$@" || failed+=("$name")
    echo "== $name: $((SECONDS - start)) s"
}

ONLY=("$@")
suite simulated $PY -m bench --simulate --cluster p3.8xlarge --random 300 --out $R/simulated-$REV
suite simulated-small $PY -m bench --simulate --random 200 --random-log2 20 26 --suite single --out $R/simulated-small-$REV
suite planning $PY -m bench --simulate --planning-time --cluster p3.16xlarge --out $R/simulated-$REV
suite simulated-p3.16xlarge $PY -m bench --simulate --cluster p3.16xlarge --random 300 --out $R/simulated-p3.16xlarge-$REV
suite simulated-presets $PY -m bench --simulate --cluster all --suite multi --out $R/simulated-presets-$REV
suite simulated-tiny $PY -m bench --simulate --random 150 --random-log2 16 20 --suite single --out $R/simulated-tiny-$REV
suite simulated-tiny-gloo $PY -m bench --simulate --random 150 --random-log2 16 20 --random-backend gloo --suite single \
    --out $R/simulated-tiny-gloo-$REV
suite weights $PY -m bench weights --out $R/weights-$REV.json --figure bench/figures/weights.png
suite weights-moe $PY -m bench weights --models moe --cases fsdp2-tp4 --methods ours,one_tensor --repeats 3 \
    --out $R/weights-moe-$REV.json --figure none
suite framework $PY -m bench framework --repeats 15 --out $R/framework-$REV.json
suite train-sync $PY -m bench train-sync --repeats 7 --out $R/train-sync-$REV.json
suite example $PY examples/weight_sync.py --json $R/example-weight-sync-$REV.json
suite local $PY -m bench --out $R/local-$REV.json
suite pipeline $PY -m bench pipeline --out $R/pipeline-$REV.json
suite path $PY -m bench path --json $R/path-$REV.json
suite soak $PY -m bench.soak --out $R/soak-$REV.json --png bench/figures/soak.png
suite task-soak $PY -m bench.task_soak --tasks 200 --every 20 --out $R/task-soak-$REV.json
suite chaos env RESHARD_CHAOS_STEPS=256 RESHARD_CHAOS_REPORT=$R/chaos-$REV.json \
    $PY -m pytest -q -p no:cacheprovider tests/chaos/test_chaos.py
suite commit-chaos env RESHARD_COMMIT_CHAOS_STEPS=256 RESHARD_COMMIT_CHAOS_REPORT=$R/commit-chaos-$REV.json \
    $PY -m pytest -q -p no:cacheprovider tests/chaos/test_commit_chaos.py
suite multihost $PY -m bench multihost --repeats 2 --small-repeats 20 --out $R/multihost-$REV.json \
    --png bench/figures/multihost.png
suite multihost-weights $PY -m bench multihost --weights --out $R/multihost-weights-$REV.json
suite netchaos env RESHARD_NETCHAOS_STEPS=160 RESHARD_NETCHAOS_SEGMENT=80 RESHARD_NETCHAOS_SEED=20261127 \
    RESHARD_NETCHAOS_REPORT=$R/netchaos-$REV.json $PY -m pytest -q -p no:cacheprovider tests/multihost_chaos/test_netchaos.py

if [ ${#failed[@]} -gt 0 ]; then
    echo "headline: failed: ${failed[*]}" >&2
    exit 1
fi
echo "headline: every suite ran on $REV"
