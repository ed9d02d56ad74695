#!/usr/bin/env bash
# The headline GPU check (python -m measure.gpu_headline) on a bare CUDA box, as one command:
#
#   bash scripts/gpu_headline.sh              # results under results/
#   OUT=/some/dir bash scripts/gpu_headline.sh  # ... under a scratch folder, packed into $OUT to travel back
#   bash scripts/gpu_headline.sh --run demos    # the blog's demos at GPU sizes, another window of 8 minutes
#   bash scripts/gpu_headline.sh --run paper    # preempt_demo and rate_sweep, another one
#
# A box lent for a short window may have other torch, triton and transformers versions, no network, and none
# of fastapi, uvicorn or the packaged model; the check needs none of those three. Wheels it lacks (say the
# pinned transformers: `pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl
# transformers==5.23.0`, fetched elsewhere) go in .whl/ and are installed into a scratch folder put first on
# PYTHONPATH; the box's torch and triton stay its own (`bash scripts/device_versions_check.sh` runs the CPU
# suite and the sm_90 compiles under such versions beforehand). With $OUT set, everything the check wrote is
# packed into $OUT/headline.tar.gz (unpack it into results/ and commit it) and the summary is copied beside it.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
SITE=${SITE:-/tmp/gpu_headline_site}
export PYTHONUNBUFFERED=1

if ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" .whl/*.whl || exit 1
    export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null

if [ -z "${OUT:-}" ]; then
    exec $PY -m measure.gpu_headline "$@"
fi
RESULTS=$(mktemp -d /tmp/gpu_headline.XXXX)
$PY -m measure.gpu_headline --results-dir "$RESULTS" "$@"
status=$?
mkdir -p "$OUT"
tar czf "$OUT/headline.tar.gz" -C "$RESULTS" .
cp "$RESULTS"/gpu-headline*.md "$OUT"/ 2>/dev/null
exit $status
